"""Context-parallel decode: each rank holds a contiguous shard of every sequence's KV cache.

Each rank computes, with any backend, the attention of the queries over its own shard, i.e. one
partial state per row (normalized ``o`` and natural-log ``lse``, the :class:`PartialState`
contract). The states, packed as one fp32 ``[..., head_dim + 1]`` buffer (``o`` then ``lse``),
are exchanged with one ``torch.distributed.all_gather_into_tensor`` and merged with
:func:`attnplan.merge_states`, so the result equals single-device decode within rounding
(Flash-Decoding's merge applied across devices, seed 003 §06: cross-device split reduction).
Works with NCCL on GPUs and gloo on CPUs.

Visibility: shards are any disjoint sets of a sequence's positions (contiguous ranges in
practice); with ``q_len = 1`` every cached position is visible, so order does not matter (the
merge is commutative). ``q_len > 1`` is refused: a shard that is not the sequence's tail would
need query-dependent visibility.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .api import DecodeWrapper
from .state import PartialState, merge_states

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
        self._lse: torch.Tensor | None = None
        self._pack: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None
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
        self._lse = torch.empty(b, ql, hq, dtype=torch.float32, device=q.device)
        self._out = torch.empty(b, ql, hq, d, dtype=q.dtype, device=q.device)
        # one collective per step: o (fp32) and lse side by side, gathered rank-major
        self._pack = torch.empty(b, ql, hq, d + 1, dtype=torch.float32, device=q.device)
        # rank-major along dim 0, as gloo requires ([world * batch, ...]; NCCL accepts this too)
        self._gathered = torch.empty(world * b, ql, hq, d + 1, dtype=torch.float32, device=q.device)
        self.comm_bytes = self._gathered.numel() * 4
        return plan

    def run(self, q, k_shard, v_shard, shard_lens, block_table=None) -> torch.Tensor:
        """Local partial, all-gather of ``(o, lse)``, merge. Returns ``out`` in q's dtype.

        The local ``o`` is rounded to q's dtype by the local decode (within the output dtype's
        tolerance) and travels in fp32 beside the fp32 ``lse``: a single small collective per
        step costs less than two (decode states are KBs; the collective's latency dominates).
        """
        self.local.run(q, k_shard, v_shard, shard_lens, block_table, out=self._out, lse=self._lse)
        o, lse = self.exchange(self._out, self._lse)
        return o.to(q.dtype)

    def exchange(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather the ranks' states and merge them (fp32 result ``(o, lse)``).

        Args:
            o: ``[batch, q_len, num_q_heads, head_dim]`` this rank's normalized output.
            lse: ``[batch, q_len, num_q_heads]`` fp32, natural log.
        """
        d = o.shape[-1]
        self._pack[..., :d].copy_(o)
        self._pack[..., d].copy_(lse)
        dist.all_gather_into_tensor(self._gathered, self._pack, group=self.group)
        world = self._gathered.shape[0] // self._pack.shape[0]
        g = self._gathered.view(world, *self._pack.shape).movedim(0, 3)  # [batch, q_len, heads, world, d + 1]
        return merge_states(PartialState(g[..., :d], g[..., d]))
