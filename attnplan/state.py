"""The partial-state format and the merge contract, written once.

Every backend writes :class:`PartialState` and every merge reads it, bit for bit the same
layout whichever backend produced it.

Method (Flash-Decoding, Dao et al. 2023; the "online softmax" merge of Milakov & Gimelshein 2018): each split ``s`` of a row keeps the normalized partial
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

from .problem import check_strided

__all__ = ["PartialState", "merge_states", "merge_state_pair", "MERGE_DTYPES"]

#: the dtypes :func:`merge_states` computes in (an fp8 state is no state: torch has no arithmetic in fp8)
MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PartialState:
    """Per-(row, split) partial attention states.

    Attributes:
        o: ``[batch, q_len, num_q_heads, num_splits, head_dim]`` float32, the normalized
            partial output of each split (``0`` for an empty split).
        lse: ``[batch, q_len, num_q_heads, num_splits]`` float32, natural-log log-sum-exp of
            the split's scaled scores ``sm_scale * q.k`` (``-inf`` for an empty split).

    A row is one ``(batch, query, q_head)``; its splits lie next to each other so a merge
    program reads one contiguous block. Splits a row does not use are empty splits. Other float
    dtypes (the float64 reference) use the same layout.

    The device-side schedule's workspace is the same format in its *ragged* form: batch axis 1 and
    the split axis holding every sequence's units one after another, ``o [1, q_len, num_q_heads,
    max_units, head_dim]``; sequence ``b``'s states are the consecutive slots ``[first[b], first[b] +
    units[b])`` (:mod:`attnplan.schedule`: longest units first in a batch of at most 32), in sequence order
    ``[indptr[b], indptr[b + 1])`` (:func:`merge_states` with ``indptr``). A run writes there the states
    of the sequences of two or more units (separate merge); a sequence of one unit writes ``out`` and
    ``lse`` directly and leaves its slot unwritten, and the fused merge keeps no ``(first, units)`` table.

    Raises:
        TypeError: ``o`` or ``lse`` is not a tensor, or is not a dense (strided) one (sparse, nested).
        ValueError: if the two tensors' shapes or devices do not agree. (Dtypes are not checked here:
            :func:`merge_states` takes those of :data:`MERGE_DTYPES`.)
    """

    o: torch.Tensor
    lse: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("o", "lse"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"PartialState: {name} must be a torch.Tensor, got {type(v).__name__}")
            check_strided(v, f"PartialState: {name}")
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
        """Splits per row: ``lse.shape[-1]`` (in the ragged form, the workspace's unit slots)."""
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
        """Join states of the same rows along the split axis (e.g. states of different backends or split counts).

        Raises:
            TypeError: an element is not a :class:`PartialState`.
            ValueError: no state, or states whose rows (``[batch, q_len, num_q_heads]``), ``head_dim`` or device
                differ (named by position).
        """
        states = list(states)
        if not states:
            raise ValueError("PartialState.concat: needs at least one state")
        _check_same_rows(states, "PartialState.concat")
        return PartialState(torch.cat([s.o for s in states], dim=3), torch.cat([s.lse for s in states], dim=3))

    def fill_(self, value: float) -> "PartialState":
        """Poison both tensors (tests use NaN to catch unwritten elements)."""
        self.o.fill_(value)
        self.lse.fill_(value)
        return self


def _check_same_rows(states, what: str) -> None:
    """Raise ``TypeError`` for an element that is not a :class:`PartialState`, ``ValueError`` naming the first state
    whose rows (``o.shape[:3]``), ``head_dim`` or device differ from the first's (their dtypes may differ: torch
    promotes them)."""
    for i, s in enumerate(states):
        if not isinstance(s, PartialState):
            raise TypeError(f"{what}: state {i} must be a PartialState, got {type(s).__name__}")
    first = states[0]
    rows, d, dev = tuple(first.o.shape[:3]), first.o.shape[4], first.o.device
    for i, s in enumerate(states[1:], 1):
        if tuple(s.o.shape[:3]) != rows or s.o.shape[4] != d or s.o.device != dev:
            raise ValueError(f"{what}: state {i} has rows [batch, q_len, num_q_heads] = {list(s.o.shape[:3])}, "
                             f"head_dim {s.o.shape[4]} on {s.o.device}; state 0 has {list(rows)}, head_dim {d} on "
                             f"{dev}: only states of the same rows merge")


def merge_states(state: PartialState, sinks: torch.Tensor | None = None, *,
                 indptr: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every row's splits into the final output: the one merge contract.

    ``lse = logsumexp_s(lse_s)``; ``o = sum_s exp(lse_s - lse) * o_s``; a row whose every ``lse_s`` is ``-inf`` (or
    that has no split at all) gives ``o = 0, lse = -inf`` (no ``-inf - (-inf)``, no NaN). An empty split's ``o`` is
    never read. NaN in a non-empty split's ``o`` or ``lse`` makes the row NaN: it never passes for an empty row; so
    does a ``+inf`` ``lse`` (a split of unbounded weight: no finite merge exists).

    Attention sinks (gpt-oss) are applied here, once, after the splits are merged: a sink logit ``z_h`` joins the
    softmax denominator only, ``lse' = logaddexp(lse, z_h)``, ``o' = o * exp(lse - lse')``. An empty row gets
    ``o = 0, lse = z_h``; a ``-inf`` sink is no sink; a ``+inf`` sink takes all the weight (``o = 0, lse = +inf``).
    Partial states never include the sink, so splitting stays exact.

    Args:
        state: dense: ``o [B, Q, H, S, D]``, ``lse [B, Q, H, S]`` in float16, bfloat16, float32 or float64 on any
            device (``S`` may be 0).
            Ragged (with ``indptr``): the workspace layout of the device-side schedule, ``o [1, Q, H, U, D]``,
            ``lse [1, Q, H, U]``, sequence ``b``'s states in slots ``[indptr[b], indptr[b + 1])``.
        sinks: optional ``[H]`` float sink logits (natural-log units of the scaled scores), on the state's device.
        indptr: optional ``[B + 1]`` integer tensor, non-decreasing, ``indptr[0] = 0``, ``indptr[B] <= U``.
    Returns:
        ``(o, lse)``: ``o [B, Q, H, D]`` in ``state.o``'s dtype and ``lse [B, Q, H]`` in ``state.lse``'s, computed in
        float32 for float16 / bfloat16 states (so a row of values at their largest finite magnitude stays finite)
        and in the state's own dtype for float32 / float64 ones (where such a row can round past it to inf).
    Raises:
        TypeError: ``state`` is not a :class:`PartialState` of float16 / bfloat16 / float32 / float64 tensors
            (:data:`MERGE_DTYPES`; fp8 is refused), or ``sinks`` / ``indptr`` have the wrong dtype.
        ValueError: ``sinks`` or ``indptr`` have the wrong shape or device, or ``indptr`` is not a valid offset array
            (read to the host: ragged merges are for the host, not for CUDA-graph capture).
    """
    if not isinstance(state, PartialState):
        raise TypeError(f"merge_states: state must be a PartialState, got {type(state).__name__}")
    for name in ("o", "lse"):
        dt = getattr(state, name).dtype
        if dt not in MERGE_DTYPES:
            raise TypeError(f"merge_states: the state's {name} must be a float16, bfloat16, float32 or float64 tensor, "
                            f"got {dt}")
    heads = state.o.shape[2]
    if sinks is not None:
        if isinstance(sinks, torch.Tensor):
            check_strided(sinks, "merge_states: sinks")
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise TypeError(f"merge_states: sinks must be a float tensor [num_heads = {heads}], got "
                            f"{getattr(sinks, 'dtype', type(sinks).__name__)}")
        if tuple(sinks.shape) != (heads,) or sinks.device != state.o.device:
            raise ValueError(f"merge_states: sinks must have shape [{heads}] on {state.o.device}, got "
                             f"{tuple(sinks.shape)} on {sinks.device}")
    if indptr is not None:
        state = _ragged_to_dense(state, indptr)
    acc = _accumulation_dtype(state)
    o, lse = _merge(state.o.to(acc), state.lse.to(acc))
    if sinks is not None:
        z = sinks.to(acc).view(1, 1, -1).expand_as(lse)
        new = torch.logaddexp(lse, z)
        # exp(lse - new): 0 for an empty row under a finite sink; both -inf (empty row, no sink) keeps o = 0
        scale = torch.where(torch.isneginf(new), torch.zeros_like(new), torch.exp(lse - new))
        o = o * scale.unsqueeze(-1)
        lse = new
    return o.to(state.o.dtype), lse.to(state.lse.dtype)


def _accumulation_dtype(state: PartialState) -> torch.dtype:
    """The merge's arithmetic: float32 for float16 / bfloat16 states, else the wider of the two dtypes (float32 or
    float64). The weights of a row sum to 1 only up to rounding, so a merge in half precision rounds at every
    product and can carry a row of values at the dtype's largest finite magnitude past it (to inf); float32 rounds
    back to it. float32 states stay float32 (the kernels' workspace states are float32: a float64 merge of them
    was 4x slower on a CPU)."""
    return torch.promote_types(torch.promote_types(state.o.dtype, state.lse.dtype), torch.float32)


def _ragged_to_dense(state: PartialState, indptr: torch.Tensor) -> PartialState:
    """The ragged (scheduled) workspace as a dense state padded with empty splits."""
    if not isinstance(indptr, torch.Tensor) or indptr.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"merge_states: indptr must be an int32/int64 tensor, got "
                        f"{getattr(indptr, 'dtype', type(indptr).__name__)}")
    check_strided(indptr, "merge_states: indptr")
    if indptr.is_meta:
        raise ValueError("merge_states: indptr is on the meta device (a shape without data): its offsets are read")
    if state.o.shape[0] != 1 or indptr.dim() != 1 or indptr.numel() < 1:
        raise ValueError(f"merge_states: a ragged state has batch axis 1 and indptr [B + 1]; got o "
                         f"{tuple(state.o.shape)}, indptr {tuple(indptr.shape)}")
    ip = indptr.to("cpu", torch.int64)
    slots = state.o.shape[3]
    counts = ip[1:] - ip[:-1]
    if int(ip[0]) != 0 or (counts.numel() and int(counts.min()) < 0) or int(ip[-1]) > slots:
        raise ValueError(f"merge_states: indptr must start at 0, not decrease and end <= {slots}, got {ip.tolist()[:16]}")
    batch, width = counts.numel(), max(int(counts.max()) if counts.numel() else 0, 0)
    s = torch.arange(width)
    idx = (ip[:-1, None] + s[None, :]).clamp(max=max(slots - 1, 0))  # [B, W]
    valid = (s[None, :] < counts[:, None]).to(state.o.device)
    idx = idx.to(state.o.device)
    q, h, d = state.o.shape[1], state.o.shape[2], state.o.shape[4]
    if slots == 0 or width == 0:
        return PartialState(state.o.new_zeros(batch, q, h, 0, d), state.lse.new_zeros(batch, q, h, 0))
    o = state.o[0][:, :, idx]  # [Q, H, B, W, D]
    lse = state.lse[0][:, :, idx]  # [Q, H, B, W]
    lse = torch.where(valid, lse, torch.full_like(lse, float("-inf")))
    return PartialState(o.permute(2, 0, 1, 3, 4).contiguous(), lse.permute(2, 0, 1, 3).contiguous())


def _merge(o_all: torch.Tensor, lse_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense merge of ``o [B, Q, H, S, D]`` / ``lse [B, Q, H, S]`` (already in the merge's dtype)."""
    if lse_s.shape[-1] == 0:  # no split at all: every row is empty
        return o_all.new_zeros(*o_all.shape[:3], o_all.shape[4]), lse_s.new_full(lse_s.shape[:3], float("-inf"))
    m = lse_s.amax(dim=-1, keepdim=True)  # [B, Q, H, 1]; NaN if any lse_s is NaN
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(lse_s - m_safe)  # exp(-inf - finite) = 0 for empty splits
    total = w.sum(dim=-1, keepdim=True)
    total_safe = torch.where(empty, torch.ones_like(total), total)
    # o_s of an empty split is 0 by contract and never read: mask it so a stray value (NaN included) cannot leak
    o_s = torch.where(torch.isneginf(lse_s).unsqueeze(-1), torch.zeros_like(o_all), o_all)
    o = ((w / total_safe).unsqueeze(-1) * o_s).sum(dim=-2)
    lse = torch.where(empty, m, m_safe + torch.log(total_safe)).squeeze(-1)
    return o, lse


def merge_state_pair(a: PartialState, b: PartialState) -> PartialState:
    """Merge two states of the same rows (their split counts may differ) into one state per row.

    Used to combine states that came from different places (backends, devices, context-parallel
    ranks). Each input is first merged over its own splits; the result has one split.

    Raises:
        TypeError: as :func:`merge_states`, or an argument is not a :class:`PartialState`.
        ValueError: the two states' rows (``[batch, q_len, num_q_heads]``), ``head_dim`` or device differ (move
            both to one device first).
    """
    _check_same_rows([a, b], "merge_state_pair")
    oa, la = merge_states(a)
    ob, lb = merge_states(b)
    both = PartialState(torch.stack([oa, ob], dim=3), torch.stack([la, lb], dim=3))
    o, lse = merge_states(both)
    return PartialState(o.unsqueeze(3), lse.unsqueeze(3))
