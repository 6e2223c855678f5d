"""The partial-state format and the merge contract, written once.

Every backend writes :class:`PartialState` and every merge reads it, bit for bit the same
layout whichever backend produced it (DESIGN.md, "Partial-state format and merge contract";
seed 003 §03-04 for the math).

Method (seed 003 §04, Flash-Decoding): each split ``s`` of a row keeps the normalized partial
output ``o_s = sum_j p_j v_j / sum_j p_j`` and its natural-log log-sum-exp
``lse_s = m_s + log(l_s)`` of the split's scaled scores. The merge rescales every state to a
common base::

    lse = logsumexp_s(lse_s)
    o   = sum_s exp(lse_s - lse) * o_s

A split with no visible position (beyond the sequence, fully masked, zero-length sequence)
has ``lse_s = -inf`` and ``o_s = 0``; it gets weight ``exp(-inf) = 0``. If every split of a
row is empty the row's result is ``o = 0, lse = -inf`` and ``-inf - (-inf)`` is never
computed. The merge is associative and commutative up to rounding, so states of different
backends, devices and split counts merge together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PartialState", "merge_states", "merge_state_pair"]


@dataclass(frozen=True)
class PartialState:
    """Per-(row, split) partial attention states.

    Attributes:
        o: ``[batch, q_len, num_q_heads, num_splits, head_dim]`` float32, the normalized
            partial output of each split (``0`` for an empty split).
        lse: ``[batch, q_len, num_q_heads, num_splits]`` float32, natural-log log-sum-exp of
            the split's scaled scores ``sm_scale * q.k`` (``-inf`` for an empty split).

    A row is one ``(batch, query, q_head)``; its splits lie next to each other so a merge
    program reads one contiguous block. Splits a row does not use are empty splits, so a
    buffer sized for the capacity serves every CUDA-graph replay. Other float dtypes (the
    float64 reference) use the same layout.

    Raises:
        ValueError: if the two tensors' shapes or devices do not agree.
    """

    o: torch.Tensor
    lse: torch.Tensor

    def __post_init__(self) -> None:
        if self.o.dim() != 5 or self.lse.dim() != 4:
            raise ValueError(
                f"PartialState: o must be 5-D [batch, q_len, num_q_heads, num_splits, head_dim] and "
                f"lse 4-D [batch, q_len, num_q_heads, num_splits]; got o {tuple(self.o.shape)}, "
                f"lse {tuple(self.lse.shape)}"
            )
        if tuple(self.o.shape[:4]) != tuple(self.lse.shape):
            raise ValueError(
                f"PartialState: o.shape[:4] {tuple(self.o.shape[:4])} must equal lse.shape {tuple(self.lse.shape)}"
            )
        if self.o.device != self.lse.device:
            raise ValueError(f"PartialState: o on {self.o.device} but lse on {self.lse.device}")

    @property
    def num_splits(self) -> int:
        return int(self.lse.shape[-1])

    @staticmethod
    def empty(batch: int, q_len: int, num_q_heads: int, num_splits: int, head_dim: int,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "PartialState":
        """Allocate a state buffer (contents undefined; kernels write every element they own)."""
        o = torch.empty(batch, q_len, num_q_heads, num_splits, head_dim, device=device, dtype=dtype)
        lse = torch.empty(batch, q_len, num_q_heads, num_splits, device=device, dtype=dtype)
        return PartialState(o, lse)

    @staticmethod
    def concat(states: "list[PartialState]") -> "PartialState":
        """Join states along the split axis (e.g. states of different backends or devices)."""
        return PartialState(torch.cat([s.o for s in states], dim=3), torch.cat([s.lse for s in states], dim=3))

    def fill_(self, value: float) -> "PartialState":
        """Poison both tensors (tests use NaN to catch unwritten elements)."""
        self.o.fill_(value)
        self.lse.fill_(value)
        return self


def merge_states(state: PartialState, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every row's splits into the final output: the one merge contract.

    ``lse = logsumexp_s(lse_s)``; ``o = sum_s exp(lse_s - lse) * o_s``; a row whose every
    ``lse_s`` is ``-inf`` gives ``o = 0, lse = -inf`` (no ``-inf - (-inf)``, no NaN).

    Attention sinks (gpt-oss) are applied here, once, after the splits are merged: a sink logit
    ``z_h`` joins the softmax denominator only, ``lse' = logaddexp(lse, z_h)``,
    ``o' = o * exp(lse - lse')`` (an empty row gets ``o = 0, lse = z_h``). Partial states never
    include the sink, so splitting stays exact.

    Args:
        state: ``o [B, Q, H, S, D]``, ``lse [B, Q, H, S]`` in any float dtype on any device.
        sinks: optional ``[H]`` sink logits (natural-log units of the scaled scores).
    Returns:
        ``(o, lse)``: ``o [B, Q, H, D]`` and ``lse [B, Q, H]`` in the state's dtype.
    """
    o, lse = _merge(state)
    if sinks is not None:
        z = sinks.to(lse.dtype).to(lse.device).view(1, 1, -1)
        new = torch.logaddexp(lse, z.expand_as(lse))
        o = o * torch.exp(lse - new).unsqueeze(-1)  # exp(-inf - finite) = 0 for empty rows
        lse = new
    return o, lse


def _merge(state: PartialState) -> tuple[torch.Tensor, torch.Tensor]:
    lse_s = state.lse
    m = lse_s.amax(dim=-1, keepdim=True)  # [B, Q, H, 1]
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(lse_s - m_safe)  # exp(-inf - finite) = 0 for empty splits
    total = w.sum(dim=-1, keepdim=True)
    total_safe = torch.where(empty, torch.ones_like(total), total)
    # o_s of an empty split is 0 by contract; mask anyway so a stray value cannot leak.
    o_s = torch.where(torch.isneginf(lse_s).unsqueeze(-1), torch.zeros_like(state.o), state.o)
    o = ((w / total_safe).unsqueeze(-1) * o_s).sum(dim=-2)
    lse = torch.where(empty, m, m_safe + torch.log(total_safe)).squeeze(-1)
    return o, lse


def merge_state_pair(a: PartialState, b: PartialState) -> PartialState:
    """Merge two states of the same rows split by split position into one state per row.

    Used to combine states that came from different places (backends, devices, context-parallel
    ranks). Each input is first merged over its own splits; the result has one split.
    """
    oa, la = merge_states(a)
    ob, lb = merge_states(b)
    both = PartialState(torch.stack([oa, ob], dim=3), torch.stack([la, lb], dim=3))
    o, lse = merge_states(both)
    return PartialState(o.unsqueeze(3), lse.unsqueeze(3))
