"""The CPU float64 reference: exact decode attention, split partial states, and the merge.

Every backend is checked against these functions, never against another kernel.
They copy their inputs to the CPU in float64, so they are slow and exact and run anywhere.

Visibility: query ``i`` of a sequence of length ``L`` with ``q_len`` queries sits at position
``p = L - q_len + i`` and sees KV positions ``<= p``, and with a
sliding window only ``>= p - window_left``. A row with no visible position has ``o = 0,
lse = -inf`` (with a sink: ``lse`` = the sink logit).

Lengths: each length is clamped into ``[0, capacity]`` (the tokens a sequence of the cache holds:
``block_table.shape[1] * page_size``, or ``k_cache.shape[1]`` for a contiguous cache) before anything else, as
every kernel clamps the lengths it reads on the device; a length within the capacity is unchanged. Page indices
read from the block table are clamped into ``[0, num_pages)`` likewise (:func:`gather_kv`).

Variants, computed the plain way in float64: fp8 K/V are dequantized as ``k * k_scale[h]``,
``v * v_scale[h]``; the soft-cap is ``cap * tanh(s / cap)`` on the scaled scores ``s``; a sink
logit joins the softmax denominator.
"""

from __future__ import annotations

import torch

from .problem import default_sm_scale, kv_capacity
from .schedule import Schedule, Units, clamp_lengths, schedule_units
from .state import PartialState, merge_states

__all__ = ["attention", "partial", "merge", "gather_kv"]

F64 = torch.float64


def _scale_vec(scale, hkv: int) -> torch.Tensor:
    if scale is None:
        return torch.ones(hkv, dtype=F64)
    if isinstance(scale, torch.Tensor):
        return scale.to("cpu", F64).reshape(-1).expand(hkv) if scale.numel() == 1 else scale.to("cpu", F64)
    return torch.full((hkv,), float(scale), dtype=F64)


def _lengths(seq_lens, k_cache: torch.Tensor, block_table: torch.Tensor | None) -> list[int]:
    """The lengths as the kernels read them: each clamped into ``[0, capacity]`` (module docstring), host ints."""
    return clamp_lengths(seq_lens, kv_capacity(k_cache, block_table)).tolist()


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, b: int, length: int,
              block_table: torch.Tensor | None, k_scale=None, v_scale=None, *,
              start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of sequence ``b``'s logical positions ``[start, length)``, ``[length - start, num_kv_heads,
    head_dim]`` float64 on the CPU (pages looked up in ``block_table`` for a paged cache; fp8 dequantized with
    the per-tensor or per-KV-head scales). ``start`` is clamped into ``[0, length]``."""
    start = min(max(int(start), 0), length)
    if block_table is None:
        k, v = k_cache[b, start:length].to("cpu"), v_cache[b, start:length].to("cpu")
    else:
        ps = k_cache.shape[1]
        pos = torch.arange(start, length, device=k_cache.device)
        # a page index outside the cache reads the nearest page, as the kernels clamp it (never out of bounds)
        pages = block_table[b].to(k_cache.device, torch.int64)[pos // ps].clamp(0, k_cache.shape[0] - 1)
        slots = pos % ps
        # gather on the cache's device, move only this sequence's tokens
        k, v = k_cache[pages, slots].to("cpu"), v_cache[pages, slots].to("cpu")
    hkv = k_cache.shape[2]
    k = k.to(F64) * _scale_vec(k_scale, hkv).view(1, hkv, 1)
    v = v.to(F64) * _scale_vec(v_scale, hkv).view(1, hkv, 1)
    return k, v


def _scores(q_b: torch.Tensor, k: torch.Tensor, sm_scale: float, soft_cap: float = 0.0) -> torch.Tensor:
    """``[q_len, num_q_heads, n]`` scaled (and soft-capped) scores; query head ``h`` reads KV head ``h // group``."""
    group = q_b.shape[1] // k.shape[1]
    k_rep = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
    s = torch.einsum("qhd,nhd->qhn", q_b, k_rep) * sm_scale
    return soft_cap * torch.tanh(s / soft_cap) if soft_cap > 0 else s


def _attend(scores: torch.Tensor, visible: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted V over the visible positions: ``o [Q, H, D]``, ``lse [Q, H]``; empty rows 0 / -inf. A
    ``-inf`` score weighs 0 (a row of them only is empty); a NaN or ``+inf`` one makes the row's ``o`` and ``lse`` NaN.

    Positions a row cannot see never touch it, NaN included: scores are selected (not multiplied) away, and a
    non-finite V entry reaches only the rows that see its position (there it makes the output's columns NaN; a
    kernel's weighted sum gives +-inf for an infinite entry, which tests compare as non-finite).

    The weights are ``exp(s - max) / sum``, not ``exp(s - lse)``: with scores near 1e16 and above, ``lse = max +
    log(sum)`` rounds ``log(sum)`` away in float64 and ``exp(s - lse)`` would not sum to 1 (128 equal scores of
    1e17 gave 128 x the mean of V)."""
    group = scores.shape[1] // v.shape[1]
    s = scores.masked_fill(~visible, float("-inf"))
    if s.shape[-1]:
        lse = torch.logsumexp(s, dim=-1)
        m = s.amax(dim=-1)
    else:
        lse = m = torch.full(s.shape[:-1], float("-inf"), dtype=F64)
    empty = torch.isneginf(m)
    lse = torch.where(torch.isposinf(m), torch.full_like(lse, float("nan")), lse)  # a +inf score: NaN, as o's
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m).unsqueeze(-1))
    p = p.masked_fill(~visible, 0.0)
    total = p.sum(dim=-1)
    v_rep = v.repeat_interleave(group, dim=1)  # [n, Hq, D]
    finite = torch.isfinite(v_rep)
    o = torch.einsum("qhn,nhd->qhd", p, torch.where(finite, v_rep, torch.zeros_like(v_rep)))
    o = o / torch.where(empty, torch.ones_like(total), total).unsqueeze(-1)
    if not bool(finite.all()):  # rows that see a non-finite V entry: NaN in those columns
        seen = torch.einsum("qhn,nhd->qhd", visible.to(F64), (~finite).to(F64)) > 0
        o = torch.where(seen, torch.full_like(o, float("nan")), o)
    return o, lse


def _first_visible(q_len: int, length: int, window_left: int) -> int:
    """The lowest position any query of the sequence sees: 0, or with a window shorter than the sequence, query 0's
    ``length - q_len - window_left`` (clamped at 0). Positions below it are never read."""
    return max(0, length - q_len - window_left) if 0 <= window_left < length else 0


def _visible(q_len: int, length: int, lo: int, hi: int, num_heads: int, window_left: int = -1) -> torch.Tensor:
    """``[q_len, num_heads, hi - lo]`` mask of positions ``lo..hi-1`` each query may see."""
    pos = torch.arange(lo, hi)
    p = length - q_len + torch.arange(q_len)  # query i's own position; it sees positions <= p[i]
    vis = pos[None, :] <= p[:, None]
    if 0 <= window_left < length:  # a window at least as long as the sequence is none (and any int is legal)
        vis &= pos[None, :] >= (p - window_left)[:, None]
    return vis.unsqueeze(1).expand(q_len, num_heads, hi - lo)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor | None = None, sm_scale: float | None = None, *, window_left: int = -1,
              soft_cap: float = 0.0, sinks: torch.Tensor | None = None, k_scale=None,
              v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode attention in float64 on the CPU.

    Args:
        q: ``[batch, q_len, num_q_heads, head_dim]``.
        k_cache, v_cache: contiguous ``[batch, max_kv_len, num_kv_heads, head_dim]`` or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]`` (then ``block_table`` is given).
        seq_lens: ``[batch]`` int, valid KV length of each sequence (0 allowed; clamped into ``[0, capacity]`` as the
            kernels clamp it, module docstring).
        block_table: ``[batch, max_pages_per_seq]`` int32 or ``None``.
        sm_scale: score scale; default ``1/sqrt(head_dim)``.
        window_left, soft_cap, sinks, k_scale, v_scale: the variants (module docstring).
    Returns:
        ``(out, lse)``: ``out [batch, q_len, num_q_heads, head_dim]`` float64 and natural-log
        ``lse [batch, q_len, num_q_heads]`` float64 (including the sink), on the CPU.
    """
    batch, q_len, hq, d = q.shape
    scale = default_sm_scale(d) if sm_scale is None else sm_scale
    qf = q.to("cpu", F64)
    lens = _lengths(seq_lens, k_cache, block_table)
    out = torch.zeros(batch, q_len, hq, d, dtype=F64)
    lse = torch.full((batch, q_len, hq), float("-inf"), dtype=F64)
    for b, length in enumerate(lens):
        lo = _first_visible(q_len, length, window_left)  # a sliding window reads only its positions
        k, v = gather_kv(k_cache, v_cache, b, length, block_table, k_scale, v_scale, start=lo)
        o_b, lse_b = _attend(_scores(qf[b], k, scale, soft_cap), _visible(q_len, length, lo, length, hq, window_left),
                             v)
        out[b], lse[b] = o_b, lse_b
    if sinks is not None:  # the sink joins the denominator: the plain softmax over [scores, sink]
        z = sinks.to("cpu", F64).view(1, 1, hq).expand_as(lse)
        new = torch.logaddexp(lse, z)
        scale = torch.where(torch.isneginf(new), torch.zeros_like(new), torch.exp(lse - new))  # -inf sink: no sink
        out = out * scale.unsqueeze(-1)
        lse = new
    return out, lse


def partial(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor | None, sm_scale: float | None, schedule: Schedule, *,
            window_left: int = -1, soft_cap: float = 0.0, k_scale=None, v_scale=None) -> tuple[PartialState, Units]:
    """Reference partial states of the device-side schedule: one state per work unit of
    :func:`attnplan.schedule.schedule_units`, in the ragged workspace layout (``o [1, q_len, num_q_heads, U, D]``,
    ``lse [1, q_len, num_q_heads, U]``; sequence ``b``'s units are slots ``[indptr[b], indptr[b + 1])``). Rows with
    no visible position in a unit get the empty state (``o = 0``, ``lse = -inf``). Sinks are not part of partial
    states. Lengths are clamped into ``[0, capacity]`` (module docstring), the schedule computed from the clamped
    ones, as the kernels' prologues compute it.

    Returns:
        ``(state, units)``: a float64 :class:`PartialState` on the CPU and the batch's :class:`~attnplan.schedule.Units`.
    """
    batch, q_len, hq, d = q.shape
    scale = default_sm_scale(d) if sm_scale is None else sm_scale
    qf = q.to("cpu", F64)
    lens = _lengths(seq_lens, k_cache, block_table)
    units = schedule_units(lens, schedule, q_len, window_left)
    n = units.num_units
    st = PartialState(torch.zeros(1, q_len, hq, n, d, dtype=F64), torch.full((1, q_len, hq, n), float("-inf"), dtype=F64))
    for b, length in enumerate(lens):
        for u in range(int(units.indptr[b]), int(units.indptr[b + 1])):
            lo, hi = int(units.start[u]), int(units.end[u])
            if hi <= lo:
                continue
            k, v = gather_kv(k_cache, v_cache, b, hi, block_table, k_scale, v_scale, start=lo)  # this unit's tokens
            o_s, lse_s = _attend(_scores(qf[b], k, scale, soft_cap),
                                 _visible(q_len, length, lo, hi, hq, window_left), v)
            st.o[0, :, :, u], st.lse[0, :, :, u] = o_s, lse_s
    return st, units


def merge(state: PartialState, sinks: torch.Tensor | None = None,
          indptr: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference merge: :func:`attnplan.state.merge_states` in float64 on the CPU (``indptr``: ragged state)."""
    return merge_states(PartialState(state.o.to("cpu", F64), state.lse.to("cpu", F64)),
                        None if sinks is None else sinks.to("cpu", F64),
                        indptr=None if indptr is None else indptr.to("cpu"))
