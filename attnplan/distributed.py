"""Context-parallel decode: each rank holds a contiguous shard of every sequence's KV cache.

Each rank computes, with any backend, the attention of the queries over its own shard, i.e. one
partial state per row (normalized ``o`` and natural-log ``lse``, the :class:`PartialState`
contract). The states are exchanged with ``torch.distributed.all_gather`` and merged with
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
        self._gather_o: list[torch.Tensor] = []
        self._gather_lse: list[torch.Tensor] = []
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
        self._gather_o = [torch.empty(b, ql, hq, d, dtype=q.dtype, device=q.device) for _ in range(world)]
        self._gather_lse = [torch.empty(b, ql, hq, dtype=torch.float32, device=q.device) for _ in range(world)]
        self.comm_bytes = world * (self._out.numel() * self._out.element_size() + self._lse.numel() * 4)
        return plan

    def run(self, q, k_shard, v_shard, shard_lens, block_table=None) -> torch.Tensor:
        """Local partial, all-gather of ``(o, lse)``, merge. Returns ``out`` in q's dtype.

        The local ``o`` travels in q's dtype (half the bytes of fp32; its rounding is within
        the output dtype's tolerance) and ``lse`` in fp32.
        """
        self.local.run(q, k_shard, v_shard, shard_lens, block_table, out=self._out, lse=self._lse)
        o, lse = self.exchange(self._out, self._lse)
        return o.to(q.dtype)

    def exchange(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather the ranks' states and merge them (fp32 result ``(o, lse)``)."""
        dist.all_gather(self._gather_o, o, group=self.group)
        dist.all_gather(self._gather_lse, lse, group=self.group)
        state = PartialState(torch.stack(self._gather_o, dim=3).float(), torch.stack(self._gather_lse, dim=3))
        return merge_states(state)
