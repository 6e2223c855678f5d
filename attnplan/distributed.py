"""Context-parallel decode: each rank holds a contiguous shard of every sequence's KV cache.

Each rank computes, with any backend, the attention of the queries over its own shard, i.e. one
partial state per row (normalized ``o`` and natural-log ``lse``, the :class:`PartialState`
contract). The states are exchanged with one ``torch.distributed.all_gather_into_tensor`` of a
packed message per rank and merged by the local backend's separate merge kernel over a ragged
workspace whose ``(first, units)`` table gives every sequence ``world`` consecutive units in index order (the
ragged layout of :func:`attnplan.merge_states`, ``first`` its ``indptr``), so the result equals single-device decode
within rounding (Flash-Decoding's merge, Dao et al. 2023, applied across devices: the split reduction runs over ranks
instead of programs). A rank's ``o`` travels in q's dtype (half the bytes of the fp32 partial-state format), so the
result has one rounding more than single-device decode: within that dtype's tolerance of the largest rank's ``o``,
which exceeds the merged output's where the ranks' outputs cancel (large V values of both signs spread over the
shards); ``lse`` travels in fp32.
Works with NCCL on GPUs and gloo on CPUs.

Visibility: shards are any disjoint sets of a sequence's positions (contiguous ranges in
practice); with ``q_len = 1`` every cached position is visible, so order does not matter (the
merge is commutative). ``q_len > 1`` is refused: a shard that is not the sequence's tail would
need query-dependent visibility.
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import torch
import torch.distributed as dist

from .api import DecodeWrapper, PlanNotReadyError
from .backends.base import Workspace
from .planner import KernelOptions, SplitPlan
from .problem import default_sm_scale
from .schedule import NUM_TARGETS, Schedule
from .state import PartialState

__all__ = ["ContextParallelDecode"]


class ContextParallelDecode:
    """Decode over a KV cache sharded along the sequence across the ranks of ``group``.

    Args:
        group: the process group (default: the world).
        config, backend: as for :class:`~attnplan.DecodeWrapper` (the local computation).

    Each rank calls :meth:`plan` and :meth:`run` with the same ``q`` and its own shard; all ranks
    get the same output.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, config=None, backend: str | None = None):
        self.group = group
        self.local = DecodeWrapper(config, backend=backend)
        self._send: torch.Tensor | None = None
        self.comm_bytes = 0

    def plan(self, q, k_shard, v_shard, shard_lens, block_table=None, *, sm_scale=None, num_splits=None,
             capacity: bool = False):
        """Plan the local shard (host work) and size the exchange buffers.

        Args:
            q: ``[batch, q_len, num_q_heads, head_dim]``, identical on every rank.
            k_shard, v_shard, block_table: this rank's shard of the cache, in the usual layouts.
            shard_lens: ``[batch]`` int32, tokens of each sequence on this rank (0 allowed).

        One all-gather of seven integers (whether the local plan and the exchange's buffers and merge kernels failed,
        q's shape and dtype, the score scale) checks that every rank planned, and planned the same q and scale; it
        waits for the other ranks and reads the result on the host. So a plan that raises on one rank raises on every
        rank instead of leaving the others waiting in a collective. (:meth:`run` adds no such check to a step: a
        ``run()`` that raises on one rank, e.g. for inputs that differ from its plan, leaves the others in the
        exchange until the group's timeout.)

        Raises:
            ValueError: bad inputs (:meth:`attnplan.DecodeWrapper.plan`'s checks), ``q_len > 1``, or a q whose shape
                or dtype, or a score scale (``sm_scale``, ``None`` meaning ``1/sqrt(head_dim)``), that differs between
                ranks (raised on every rank); on the other ranks, a plan that raised on one (that rank raises its own
                error, of whatever type).
        """
        self._send = None  # a failed plan leaves none
        world = dist.get_world_size(self.group)
        failed = plan = send = None  # send: the exchange buffer, kept once every rank agrees
        try:
            if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != 1:
                raise ValueError(f"context-parallel decode supports q_len 1 (q.shape[1]), got {q.shape[1]}: with more "
                                 "queries a shard that is not a sequence's tail would need query-dependent visibility")
            plan = self.local.plan(q, k_shard, v_shard, shard_lens, block_table, sm_scale=sm_scale,
                                   num_splits=num_splits, capacity=capacity)
            send = self._allocate(plan, q, world)
        except Exception as e:  # every rank learns of it in the check below, then raises
            failed = e
        self._check_ranks_agree(q, sm_scale, world, failed)
        self.comm_bytes = world * self._msg
        self._send = send
        return plan

    def _allocate(self, plan: SplitPlan, q: torch.Tensor, world: int) -> torch.Tensor:
        """The exchange's buffers and the merge's workspace and kernels for ``plan`` (before the ranks' agreement,
        so that a failure here, e.g. out of memory or a kernel that does not load, is one the other ranks learn of);
        returns the send buffer, which :meth:`plan` keeps once the ranks agree."""
        b, ql, hq, d = q.shape
        # one packed message per rank: o in q's dtype, then lse fp32 at a 16-byte offset; the local
        # decode writes straight into it, so the exchange is one all-gather with no copies
        o_bytes = b * ql * hq * d * q.element_size()
        self._lse_off = -(-o_bytes // 16) * 16
        self._msg = -(-(self._lse_off + b * ql * hq * 4) // 16) * 16
        self._shape = (b, ql, hq, d)
        send = torch.empty(self._msg, dtype=torch.uint8, device=q.device)
        self._recv = torch.empty(world * self._msg, dtype=torch.uint8, device=q.device)  # flat: gloo wants it so
        self._out, self._lse = self._views(send, q.dtype)
        self._out.fill_(float("nan"))  # an exchange() before any run() merges (world 1: copies) NaN, not stale memory
        self._lse.fill_(float("nan"))
        self._gather_o, self._gather_lse = self._views(self._recv.view(world, self._msg), q.dtype)
        # the backend's own separate merge kernel merges the world's states (one launch instead of ~12 torch ops)
        self._merge_plan, self._workspace = merge_workspace(plan, world, q.device) if world > 1 else (None, None)
        if self._merge_plan is not None:  # compile / load its kernels now, not at the first exchange
            self.local.backend.prepare_merge(self._merge_plan, q.device)
        self._result = torch.empty(b, ql, hq, d, dtype=q.dtype, device=q.device)
        return send

    _DTYPES = (torch.float16, torch.bfloat16, torch.float32)

    def _check_ranks_agree(self, q, sm_scale, world: int, failed: Exception | None) -> None:
        """Raise on every rank unless every rank planned (``failed`` is this rank's plan error, raised here as it
        is; the other ranks raise ``ValueError`` naming the ranks that failed), and planned a q of this rank's shape
        and dtype with this rank's score scale (``ValueError``): a mismatch would otherwise exchange messages of
        other sizes, which the backend aborts on, reinterpret another rank's bytes in this rank's dtype, or merge
        states of different scores."""
        ok = failed is None
        code = self._DTYPES.index(q.dtype) if ok and q.dtype in self._DTYPES else len(self._DTYPES)
        shape = list(q.shape) if ok else [-1] * 4
        # the scale as the plan uses it (None: 1/sqrt(head_dim)), -0.0 as 0.0, compared bit for bit
        scale = (default_sm_scale(q.shape[3]) if sm_scale is None else float(sm_scale)) + 0.0 if ok else math.nan
        bits = struct.unpack("<q", struct.pack("<d", scale))[0]
        # q's device once it planned; a rank that failed (q maybe on the wrong device, or no tensor) takes the
        # group's: NCCL's current GPU, else the CPU
        device = q.device if ok else (torch.device("cuda", torch.cuda.current_device())
                                      if dist.get_backend(self.group) == "nccl" else torch.device("cpu"))
        mine = torch.tensor([int(not ok), *shape, code, bits], dtype=torch.int64, device=device)
        every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        rows = every.view(world, -1).tolist()
        bad = [i for i, r in enumerate(rows) if r[0]]
        if failed is not None:
            raise failed
        if bad:
            raise ValueError(f"context-parallel decode: plan() raised on rank(s) {bad} (each raises its own error)")
        if any(r[1:6] != rows[0][1:6] for r in rows):
            names = [*map(str, self._DTYPES), "other"]
            raise ValueError("context-parallel decode needs the same q on every rank; got (shape, dtype) per rank: "
                             + ", ".join(f"rank {i}: {tuple(r[1:5])} {names[r[5]]}" for i, r in enumerate(rows)))
        if any(r[6] != rows[0][6] for r in rows):
            scales = [struct.unpack("<d", struct.pack("<q", r[6]))[0] for r in rows]
            raise ValueError("context-parallel decode needs the same sm_scale on every rank (None: 1/sqrt(head_dim)); "
                             "got " + ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(scales)))

    def _views(self, buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)`` views of packed messages ``buf [..., msg]`` (uint8): ``o [..., B, Q, H, D]`` in
        ``dtype``, ``lse [..., B, Q, H]`` fp32."""
        lead = buf.shape[:-1]
        b, ql, hq, d = self._shape
        o = buf[..., : b * ql * hq * d * dtype.itemsize].view(dtype).view(*lead, b, ql, hq, d)
        lse = buf[..., self._lse_off: self._lse_off + b * ql * hq * 4].view(torch.float32).view(*lead, b, ql, hq)
        return o, lse

    def run(self, q, k_shard, v_shard, shard_lens, block_table=None) -> torch.Tensor:
        """Local partial, one all-gather of the packed ``(o, lse)`` messages, merge.

        Returns ``out [batch, 1, num_q_heads, head_dim]`` in q's dtype (the wrapper's buffer, valid
        until the next ``run``). The local ``o`` travels in q's dtype (half the bytes of fp32; see the module's
        note on its rounding) and ``lse`` in fp32.

        Raises:
            PlanNotReadyError: no :meth:`plan` (or the last one raised).
        """
        if self._send is None:
            raise PlanNotReadyError("ContextParallelDecode.run() before plan() (or after a plan() that raised)")
        self.local.run(q, k_shard, v_shard, shard_lens, block_table, out=self._out, lse=self._lse)
        return self.exchange()

    def exchange(self) -> torch.Tensor:
        """All-gather the ranks' packed states (one collective), copy them (``o`` widened to fp32) into the
        ragged workspace of :func:`merge_workspace` and merge the ``world`` states of every row with the local
        backend's separate merge kernel (a world of one rank: the local output as it is).

        Returns:
            ``[batch, 1, num_q_heads, head_dim]`` in q's dtype (the same buffer every call).
        Raises:
            RuntimeError: no :meth:`plan` yet.
        """
        if self._send is None:
            raise RuntimeError("ContextParallelDecode.exchange() before plan()")
        dist.all_gather_into_tensor(self._recv, self._send, group=self.group)
        if self._workspace is None:  # one rank: its state is the result
            self._result.copy_(self._gather_o[0])
            return self._result
        st = self._workspace.state
        b, ql, hq, d = self._shape
        world = self._gather_o.shape[0]
        # rank r's state of sequence b goes to slot b * world + r: [world, B, Q, H, (D)] -> [Q, H, B, world, (D)]
        st.o[0].view(ql, hq, b, world, d).copy_(self._gather_o.permute(2, 3, 1, 0, 4))
        st.lse[0].view(ql, hq, b, world).copy_(self._gather_lse.permute(2, 3, 1, 0))
        self.local.backend.merge(self._merge_plan, self._workspace, self._result, None)
        return self._result


def merge_workspace(plan: SplitPlan, world: int, device: torch.device) -> tuple[SplitPlan, Workspace]:
    """The plan and workspace for merging ``world`` partial states per sequence with ``plan``'s backend.

    The states of the ``batch`` sequences lie in the ragged workspace layout (:class:`~attnplan.PartialState`
    with batch axis 1): sequence ``b``'s ``world`` states in slots ``[b * world, (b + 1) * world)``, in rank order;
    its ``meta`` holds ``first[b] = b * world`` then ``units[b] = world`` (what a partial kernel writes for the
    separate merge, here written once). The plan is ``plan`` with a forced schedule of ``world`` units per
    sequence and the separate merge; a cuda_ptx plan's merge is launched without programmatic dependent launch
    (the kernel before it is a copy, not the partial kernel).

    Args:
        plan: the local decode's plan (its problem, kernel options and granule).
        world: states per sequence, ``>= 2`` (the merge kernel leaves rows of one-state sequences unwritten).
        device: where the buffers live.
    Returns:
        ``(merge_plan, workspace)``: ``workspace.state`` is ``o [1, q_len, num_q_heads, batch * world, head_dim]``
        fp32 and ``lse [1, q_len, num_q_heads, batch * world]`` fp32 (uninitialized: the caller fills every slot);
        ``workspace.meta`` int32 ``[2 * batch]``.
    Raises:
        ValueError: ``world < 2``.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an int >= 2 (one state per sequence needs no merge), got {world!r}")
    p = plan.problem
    zeros = (0,) * NUM_TARGETS
    sched = Schedule("forced", plan.schedule.granule, 1, world, zeros, p.batch * world)
    kernel = KernelOptions({**plan.kernel, "pdl": False}) if "pdl" in plan.kernel else plan.kernel
    merge_plan = replace(plan, schedule=sched, merge="separate", policy="forced", kernel=kernel, table_entry=None,
                         candidates=(), q_block=0, head_block=0)  # one merge launch over every row
    merge_plan.validate()
    state = PartialState.empty(1, p.q_len, p.num_q_heads, p.batch * world, p.head_dim, device=device)
    idx = torch.arange(p.batch, dtype=torch.int32) * world
    meta = torch.cat([idx, torch.full((p.batch,), world, dtype=torch.int32)]).to(device)
    return merge_plan, Workspace(state, meta, None, torch.zeros(NUM_TARGETS, dtype=torch.int32, device=device), zeros)
