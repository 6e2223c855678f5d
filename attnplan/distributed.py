"""Context-parallel decode: each rank holds a contiguous shard of every sequence's KV cache.

Each rank computes, with any backend, the attention of the queries over its own shard, i.e. one
partial state per row (normalized ``o`` and natural-log ``lse``, the :class:`PartialState`
contract). The states are exchanged with one ``torch.distributed.all_gather_into_tensor`` of a
packed message per rank and merged by the local backend's merge kernel (the contract of
:func:`attnplan.merge_states`), so the result equals single-device decode within rounding
(Flash-Decoding's merge, Dao et al. 2023, applied across devices: the split reduction runs over ranks
instead of programs).
Works with NCCL on GPUs and gloo on CPUs.

Visibility: shards are any disjoint sets of a sequence's positions (contiguous ranges in
practice); with ``q_len = 1`` every cached position is visible, so order does not matter (the
merge is commutative). ``q_len > 1`` is refused: a shard that is not the sequence's tail would
need query-dependent visibility.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .api import DecodeWrapper
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
        Raises:
            ValueError: bad inputs, or ``q_len > 1``.
        """
        world = dist.get_world_size(self.group)
        if q.shape[1] != 1:
            raise ValueError(f"context-parallel decode supports q_len 1 (q.shape[1]), got {q.shape[1]}: with more queries "
                             "a shard that is not a sequence's tail would need query-dependent visibility")
        plan = self.local.plan(q, k_shard, v_shard, shard_lens, block_table, sm_scale=sm_scale, num_splits=num_splits,
                               capacity=capacity)
        b, ql, hq, d = q.shape
        # one packed message per rank: o in q's dtype, then lse fp32 at a 16-byte offset; the local
        # decode writes straight into it, so the exchange is one all-gather with no copies
        o_bytes = b * ql * hq * d * q.element_size()
        self._lse_off = -(-o_bytes // 16) * 16
        self._msg = -(-(self._lse_off + b * ql * hq * 4) // 16) * 16
        self._shape = (b, ql, hq, d)
        self._send = torch.empty(self._msg, dtype=torch.uint8, device=q.device)
        self._recv = torch.empty(world * self._msg, dtype=torch.uint8, device=q.device)  # flat: gloo wants it so
        self._out, self._lse = self._views(self._send, q.dtype)
        self._gather_o, gather_lse = self._views(self._recv.view(world, self._msg), q.dtype)
        # the gathered states in the PartialState layout [B, Q, H, world, D]: o as an fp32 copy (the merge
        # kernels read fp32), lse as a strided view of the received messages; all made here, so run()
        # allocates nothing
        self._state = PartialState(torch.empty(b, ql, hq, world, d, dtype=torch.float32, device=q.device),
                                   gather_lse.permute(1, 2, 3, 0))
        self._result = torch.empty(b, ql, hq, d, dtype=q.dtype, device=q.device)
        # the backend's own merge kernel merges the world's states (one launch instead of ~12 torch ops)
        self._merge_plan = replace(plan, num_splits=world, kernel={**plan.kernel, "pdl": False})
        self.comm_bytes = world * self._msg
        return plan

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
        until the next ``run``). The local ``o`` travels in q's dtype (half the bytes of fp32; its
        rounding is within the output dtype's tolerance) and ``lse`` in fp32.
        """
        self.local.run(q, k_shard, v_shard, shard_lens, block_table, out=self._out, lse=self._lse)
        return self.exchange()

    def exchange(self) -> torch.Tensor:
        """All-gather the ranks' packed states (one collective), widen the gathered ``o`` to fp32 in
        place and merge the ``world`` states with the local backend's merge kernel.

        Returns:
            ``[batch, 1, num_q_heads, head_dim]`` in q's dtype (the same buffer every call).
        Raises:
            RuntimeError: no :meth:`plan` yet.
        """
        if self._send is None:
            raise RuntimeError("ContextParallelDecode.exchange() before plan()")
        dist.all_gather_into_tensor(self._recv, self._send, group=self.group)
        self._state.o.copy_(self._gather_o.permute(1, 2, 3, 0, 4))  # [world, B, Q, H, D] -> [B, Q, H, world, D]
        self.local.backend.merge(self._merge_plan, self._state, self._result, None)
        return self._result
