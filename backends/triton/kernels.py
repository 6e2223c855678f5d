"""Triton kernels: the scheduled split-KV partial kernel (also the single-pass path) and the merge.

Method: Flash-Decoding (Dao et al., 2023) split-KV with an exp2 online softmax (FlashAttention-2, Triton tutorial
06); one program per (work unit, KV head) holds the whole GQA group and all ``q_len`` queries as the rows of one
``tl.dot`` tile, so every KV byte is read once (vLLM's and FlashInfer's grouped decode).

Which program does which (sequence, KV head, token range) is decided at every launch from the live ``seq_lens``
in device memory: a prologue computes the schedule of :mod:`attnplan.schedule` (granules, the batch's total, the
granules per unit from the plan's targets table, each sequence's units and their exclusive prefix sum) in the
same integers as :func:`attnplan.schedule.schedule_units` (FlashAttention-3's ``hopper/flash_prepare_scheduler.cu``
makes the same choice on the device in a separate kernel). So one plan and one grid serve all lengths, and CUDA-graph
replays. The contract is :mod:`attnplan.backends.base`'s. Every length loaded from ``seq_lens`` is clamped into
``[0, capacity]`` (:func:`_length`; ``capacity`` the tokens a sequence of the cache holds, a kernel argument) before
anything uses it, so a length written on the device beyond the cache reads the clamped span, never outside the
cache, and every program derives the same schedule.

Offsets: every offset that can pass 2^31 elements is computed in int64 (row, head and slot indices are widened
before they meet a stride: Triton multiplies an int32 index by an int32 stride in 32 bits, so a head-major cache
with a head stride of 2^30 and 3 KV heads would wrap).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the prologue's ``pack`` of :func:`attnplan.schedule.slot_unit`: a grid of at most this many slots per live unit
#: runs its units packed, the empty slots last. Spread, the few empty slots of such a grid sit among the working
#: ones and its last working programs lie past the programs the SMs hold at a time (the contiguous kernel's 3
#: stages: 2 per SM), so they start only when earlier ones exit. Measured on an H200 (graph replay, 54 uniform
#: points of 28/4/128, 8/1/128, 32/8/128 x b1-b16 x 4K-64K, both layouts): 0.9875x in geomean, 0.87x at best
#: (32/8/128 contiguous b16 16K: 285.2 -> 248.2 us), 1.05x at worst. cuda_ptx keeps ``pack`` 1: the same rule
#: made its steps 0.7% slower in geomean (up to 13%).
PACK_SLOTS_PER_UNIT = tl.constexpr(2)
#: ``attnplan.schedule.LONGEST_FIRST_BATCH`` (this module imports nothing of attnplan's: the offline compile runs it
#: by path): a prologue block of at most this many sequences lays their units out longest first, a ``[32, 32]``
#: comparison; a larger block in index order, a scan
LONGEST_FIRST_BATCH = tl.constexpr(32)

INT32_MAX = tl.constexpr(2147483647)
#: ``attnplan.problem.LOG2E`` and its inverse ln(2): the kernels' softmax runs in base 2 (scores scaled by
#: ``sm_scale * log2(e)``); the soft cap and the LSE convert back to the natural-log domain
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
#: most fp32 elements of workspace state (``o`` tiles of ``BLOCK_M x BLOCK_D``) the fused merge keeps in flight:
#: 64 registers per thread of a 4-warp program
FUSED_INFLIGHT_ELEMS = 8192


def fused_unroll(block_m: int, block_d: int) -> int:
    """``FUSED_UNROLL`` of :func:`split_kv_partial_kernel`: units whose states the fused merge's last program loads at
    once (:func:`_merge_rows`), as many ``block_m x block_d`` fp32 tiles as fit :data:`FUSED_INFLIGHT_ELEMS`, 1 to 8
    (16 x 128: 4; 128 x 128: 1)."""
    return max(1, min(8, FUSED_INFLIGHT_ELEMS // (block_m * block_d)))


@triton.jit
def _sink_join(lse, z):
    """``(scale, lse')``: the sink logit ``z`` joins a merged row's denominator, ``lse' = logaddexp(lse, z)``, and the
    row's ``o`` is multiplied by ``scale = exp(lse - lse')`` (:func:`attnplan.state.merge_states`'s sink rule). An
    empty row (``lse = -inf``) gets ``scale = 0, lse' = z``; a ``-inf`` sink is no sink (an empty row stays
    ``0 / -inf``, no NaN); a ``+inf`` sink takes all the weight (``scale = 0, lse' = +inf``); a NaN row stays NaN.
    Both sides of a ``tl.where`` are computed, so operands are zeroed where a result is not taken: no lane subtracts
    equal infinities (a NaN there, and a numpy warning under the interpreter)."""
    hi = tl.maximum(lse, z, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(lse, z, propagate_nan=tl.PropagateNan.ALL)
    same = lo == hi
    diff = tl.where(same, 0.0, lo) - tl.where(same, 0.0, hi)  # equal values (infinities too): 0
    new = tl.where(hi == float("-inf"), float("-inf"), hi + tl.log(1.0 + tl.exp(diff)))
    empty = new == float("-inf")
    scale = tl.where(empty, 0.0, tl.exp(tl.where(empty, 0.0, lse) - tl.where(empty, 0.0, new)))
    return scale, new


@triton.jit
def _add_sink(o, lse, SINKS, head, row_ok):
    """:func:`_sink_join` for the rows ``head`` of a program (``o [BLOCK_M, BLOCK_D]``, ``lse [BLOCK_M]``); rows
    outside ``row_ok`` get no sink."""
    z = tl.load(SINKS + head, mask=row_ok, other=float("-inf"))
    scale, new = _sink_join(lse, z)
    return o * scale[:, None], new


@triton.jit
def _length(seq_len, capacity):
    """Lengths loaded from ``seq_lens`` as every kernel reads them: clamped into ``[0, capacity]`` (``capacity``: the
    tokens a sequence of the cache holds), so a length beyond the cache reads the clamped span, never outside the
    cache, and a negative one is an empty sequence (the input contract of :mod:`attnplan.problem`)."""
    return tl.minimum(tl.maximum(seq_len, 0), capacity)


@triton.jit
def _granules(seq_len, Q_LEN: tl.constexpr, GRANULE: tl.constexpr, WINDOW: tl.constexpr, window_left):
    """``(base, nb)``: a sequence's first visible position and the granules of its span ``[base, seq_len)``
    (:mod:`attnplan.schedule`); ``ceil`` as ``(n - 1) // G + 1`` so no intermediate passes int32."""
    base = seq_len * 0
    if WINDOW:
        base = tl.maximum(seq_len - Q_LEN - window_left, 0)
    n = seq_len - base
    nb = tl.where(n > 0, (n - 1) // GRANULE + 1, 0)
    return base, nb


@triton.jit
def _granules_per_unit(total, nb_max, batch, table, min_unit_granules):
    """``c = max(min_unit_granules, ceil(T / targets[k + 32 * tail]))`` with ``k = bit_length(T + T // 2)`` clamped
    to 31 and ``tail = 2 T < batch * nb_max`` (the long-tailed table), or ``min_unit_granules`` when that target is 0;
    ``total`` (``T``) and ``nb_max`` int64, ``c`` int32 (a ``c`` of 2^31 or more acts as ``c = T``: one unit per
    sequence either way). ``table``: the 64 targets, loaded with ``seq_lens`` (a load after the bucket is known would
    be one more dependent DRAM round trip before the first KV tile)."""
    bits = tl.arange(0, 32)
    # bit_length(T + T // 2) clamped to 31 (attnplan.schedule.bucket_of): the number of i < 31 with T + T // 2 >= 2^i
    t3 = total + (total >> 1)
    bucket = tl.sum(((t3 >= (tl.full([32], 1, tl.int64) << bits.to(tl.int64))) & (bits < 31)).to(tl.int32), 0)
    bucket = tl.where(2 * total < nb_max * batch, bucket + 32, bucket)
    t = tl.sum(tl.where(tl.arange(0, 64) == bucket, table, 0), 0).to(tl.int64)
    per = tl.where(t > 0, (total + tl.maximum(t, 1) - 1) // tl.maximum(t, 1), 0)
    return tl.minimum(tl.maximum(per, min_unit_granules), INT32_MAX).to(tl.int32)


@triton.jit
def _units(nb, ok, c, max_units_per_seq):
    """``(cb, units)`` of sequences with ``nb`` granules: ``u = min(max_units_per_seq, ceil(nb / c))`` units of equal
    size ``cb = ceil(nb / u)``, ``units = ceil(nb / cb)``; an empty sequence has one unit (``cb = 0``), a masked-off
    lane (``ok`` false) none. Ceilings as ``(n - 1) // d + 1``: nothing passes int32."""
    has = nb > 0
    nb1 = tl.maximum(nb, 1)
    want = tl.minimum((nb1 - 1) // c + 1, max_units_per_seq)
    cb = tl.where(has, (nb1 - 1) // want + 1, 0)
    units = tl.where(has, (nb1 - 1) // tl.maximum(cb, 1) + 1, 1)
    return cb, tl.where(ok, units, 0)


@triton.jit
def _schedule(SEQ_LENS, stride_sl, TARGETS, META, batch, u, slots, pid, window_left, min_unit_granules,
              max_units_per_seq, capacity, Q_LEN: tl.constexpr, GRANULE: tl.constexpr, WINDOW: tl.constexpr,
              BALANCED: tl.constexpr, WRITE_META: tl.constexpr, BLOCK_B: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """The prologue: the schedule of the live batch, as :func:`attnplan.schedule.schedule_units` computes it with
    ``capacity`` (every length clamped into ``[0, capacity]`` as it is loaded, :func:`_length`).

    Returns ``(b, first_b, units_b, cb, seq_len_b, u)``: the sequence of the program's unit (``-1`` when there is
    none), the slot of its first unit, its unit count, its granules per unit, its (clamped) length, and the unit's
    slot. ``u`` is that slot, or with ``slots > 0`` (``ONE_BLOCK`` only, where ``U`` is known before the search) the
    program's slot of the grid's ``slots``, whose unit slot is :func:`attnplan.schedule.slot_unit`'s (the working
    programs spread over a grid of many more slots than units, else packed at its start). Sequences take the slots
    longest units first where ``BLOCK_B <= LONGEST_FIRST_BATCH`` (a batch of at most 32,
    :func:`attnplan.schedule.first_slots`), in index order otherwise.
    Program ``pid == 0`` writes ``META`` (``first[b]`` at ``b``, ``units[b]`` at ``batch + b``) when
    ``WRITE_META``. ``ONE_BLOCK`` (``batch <= BLOCK_B``): ``seq_lens`` is read once and everything stays in
    registers. Otherwise it is read in blocks of ``BLOCK_B`` (any batch), twice for a balanced schedule (the total
    first); the search stops at the block holding ``u`` (program 0 writing ``META`` reads to the end).
    """
    offs_blk = tl.arange(0, BLOCK_B)
    table = tl.zeros([64], tl.int32)
    if BALANCED:  # issued before seq_lens' load: both round trips overlap
        table = tl.load(TARGETS + tl.arange(0, 64))
    if ONE_BLOCK:
        ok = offs_blk < batch
        lens = _length(tl.load(SEQ_LENS + offs_blk.to(tl.int64) * stride_sl, mask=ok, other=0), capacity)
        _, nb = _granules(lens, Q_LEN, GRANULE, WINDOW, window_left)
        c = min_unit_granules
        if BALANCED:
            c = _granules_per_unit(tl.sum(nb.to(tl.int64), 0), tl.max(nb.to(tl.int64), 0), batch, table,
                                   min_unit_granules)
        cb, units = _units(nb, ok, c, max_units_per_seq)
        incl = tl.cumsum(units, 0)
        excl = incl - units
        if BLOCK_B <= LONGEST_FIRST_BATCH:  # slots longest units first (attnplan.schedule.first_slots)
            # where the cb differ (all equal, as in every uniform batch, the order is the index order: the scan):
            # excl[i] = the units of the sequences before i in (cb descending, index) order (past the batch: 0)
            if tl.min(tl.where(ok, cb, INT32_MAX), 0) != tl.max(cb, 0):
                cbi, cbj = cb[:, None], cb[None, :]
                before = (cbj > cbi) | ((cbj == cbi) & (offs_blk[None, :] < offs_blk[:, None]))
                excl = tl.sum(tl.where(before, units[None, :], 0), 1)
                incl = excl + units
        if slots > 0:  # slot_unit: U <= slots (the plan's bound); int64 products
            total = tl.sum(units, 0).to(tl.int64)
            s64 = u.to(tl.int64)
            v = (s64 * total + slots - 1) // slots
            spread = (v < total) & ((v * slots) // total == s64)
            # packed (slot u runs unit u) where the slots are at most PACK_SLOTS_PER_UNIT x the units
            packed = slots <= PACK_SLOTS_PER_UNIT * total
            u = tl.where(packed, tl.where(s64 < total, s64, total), tl.where(spread, v, total)).to(tl.int32)
        mine = ok & (excl <= u) & (u < incl)
        if WRITE_META:
            if pid == 0:
                tl.store(META + offs_blk, excl, mask=ok)
                tl.store(META + batch + offs_blk, units, mask=ok)
        return (tl.max(tl.where(mine, offs_blk, -1), 0), tl.sum(tl.where(mine, excl, 0), 0),
                tl.sum(tl.where(mine, units, 0), 0), tl.sum(tl.where(mine, cb, 0), 0),
                tl.sum(tl.where(mine, lens, 0), 0), u)
    c = min_unit_granules
    if BALANCED:  # granules per unit from the batch's total and longest sequence
        total = tl.full([], 0, tl.int64)
        nb_max = tl.full([], 0, tl.int64)
        for b0 in range(0, batch, BLOCK_B):
            offs = b0 + offs_blk
            lens = _length(tl.load(SEQ_LENS + offs.to(tl.int64) * stride_sl, mask=offs < batch, other=0), capacity)
            _, nb = _granules(lens, Q_LEN, GRANULE, WINDOW, window_left)
            total += tl.sum(nb.to(tl.int64), 0)
            nb_max = tl.maximum(nb_max, tl.max(nb.to(tl.int64), 0))
        c = _granules_per_unit(total, nb_max, batch, table, min_unit_granules)
    writer = -1
    if WRITE_META:
        writer = 0
    found = -1
    first = 0
    units_b = 0
    cb_b = 0
    len_b = 0
    running = 0
    b0 = 0
    while (b0 < batch) & ((running <= u) | (pid == writer)):
        offs = b0 + offs_blk
        ok = offs < batch
        lens = _length(tl.load(SEQ_LENS + offs.to(tl.int64) * stride_sl, mask=ok, other=0), capacity)
        _, nb = _granules(lens, Q_LEN, GRANULE, WINDOW, window_left)
        cb, units = _units(nb, ok, c, max_units_per_seq)
        incl = running + tl.cumsum(units, 0)
        excl = incl - units
        mine = ok & (excl <= u) & (u < incl)
        found = tl.maximum(found, tl.max(tl.where(mine, offs, -1), 0))
        first += tl.sum(tl.where(mine, excl, 0), 0)
        units_b += tl.sum(tl.where(mine, units, 0), 0)
        cb_b += tl.sum(tl.where(mine, cb, 0), 0)
        len_b += tl.sum(tl.where(mine, lens, 0), 0)
        if WRITE_META:
            if pid == 0:
                tl.store(META + offs, excl, mask=ok)
                tl.store(META + batch + offs, units, mask=ok)
        running += tl.sum(units, 0)
        b0 += BLOCK_B
    return found, first, units_b, cb_b, len_b, u


@triton.jit
def _page(entry, last_page):
    """A block-table entry as an int64 page index clamped into ``[0, last_page]`` (``last_page = num_pages - 1``):
    an entry outside the cache reads a wrong page, never memory outside the cache (the input contract of
    :mod:`attnplan.problem`: with host lengths the table's values are not checked)."""
    return tl.minimum(tl.maximum(entry.to(tl.int64), 0), last_page)


@triton.jit
def _scores(s, qk_scale, row_scale, soft_cap, SOFTCAP: tl.constexpr, FP8: tl.constexpr):
    """Raw ``q.k`` products to log2-domain scores: the scale (with fp8, the K scale and the q row's power-of-two
    shift folded in) and the soft-cap ``cap * tanh(x / cap)`` on the natural-log-scaled scores (tanh via
    ``exp(-2|x|)``: no overflow; below ``|x|`` = 0.375 its Taylor series to ``x^11``, where ``1 - exp(-2|x|)``
    would lose digits of a small ``x`` (a large cap over ordinary scores): within 4 ulps of fp32 everywhere)."""
    if FP8:
        s = s * (qk_scale * row_scale)
    else:
        s = s * qk_scale
    if SOFTCAP:
        x = s * (LN2 / soft_cap)
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        x2 = a * a
        p = -0.008863235529902197 * x2 + 0.021869488536155203  # tanh's odd Taylor coefficients from x^11
        p = ((p * x2 - 0.05396825396825397) * x2 + 0.13333333333333333) * x2 - 0.3333333333333333
        th = tl.where(a < 0.375, a + a * x2 * p, (1.0 - e) / (1.0 + e))
        s = tl.where(x < 0, -th, th) * (soft_cap * LOG2E)
    return s


@triton.jit
def _tile(acc, l_i, m_i, q, K, V, n0, end, b64, kvh64, bt_row, stride_btc, last_page,
          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
          qk_scale, row_scale, soft_cap, visible, lowest, offs_d, d_ok,
          BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr,
          DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr):
    """One KV tile ``[n0, n0 + BLOCK_N)`` into the running ``(acc, l, m)``; positions ``>= end`` are masked (never
    loaded). Only for positions that every row of the program may see, or none: ``P @ V`` multiplies a V row that a
    row cannot see by 0, and ``0 * NaN = NaN`` (:func:`_token` takes the others). Page indices from the block table
    are clamped into ``[0, last_page]`` (:func:`_page`)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    if PAGED:
        page = _page(tl.load(bt_row + (offs_n // PAGE_SIZE).to(tl.int64) * stride_btc, mask=n_ok, other=0), last_page)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        k_row = page * stride_kb + slot * stride_kt
        v_row = page * stride_vb + slot * stride_vt
    else:
        k_row = b64 * stride_kb + offs_n.to(tl.int64) * stride_kt
        v_row = b64 * stride_vb + offs_n.to(tl.int64) * stride_vt
    k = tl.load(K + (k_row + kvh64 * stride_kh)[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                other=0.0)
    v = tl.load(V + (v_row + kvh64 * stride_vh)[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                other=0.0)
    if FP8:
        k = k.to(tl.float16)
        v = v.to(tl.float16)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = _scores(s, qk_scale, row_scale[:, None], soft_cap, SOFTCAP, FP8)
    ok = (offs_n[None, :] < visible[:, None]) & n_ok[None, :]
    if WINDOW:
        ok = ok & (offs_n[None, :] >= lowest[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - (-inf)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _token(acc, l_i, m_i, q, K, V, n, b64, kvh64, bt_row, stride_btc, last_page,
           stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
           qk_scale, row_scale, soft_cap, visible, lowest, offs_d, d_ok,
           PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
           WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr):
    """Position ``n`` alone into the running ``(acc, l, m)``: for the positions that some rows of the program see and
    others do not (the last ``q_len - 1`` of a sequence, the first ``q_len - 1`` of a window).

    ``P @ V`` would multiply the V row by 0 for the rows that cannot see it, and ``0 * NaN = NaN``; here its
    non-finite entries are zeroed and the rows that see the position get NaN in those columns (the reference's
    rule, :func:`attnplan.reference._attend`), while the others are untouched. The dots are 16-row tiles holding
    only position ``n`` (row 0), so they take the tile path's layouts (measured with ``ptxas``: no registers over
    the plain single loop at 16 rows)."""
    r = tl.arange(0, 16)
    if PAGED:
        page = _page(tl.load(bt_row + (n // PAGE_SIZE).to(tl.int64) * stride_btc), last_page)
        slot = (n % PAGE_SIZE).to(tl.int64)
        k_row = page * stride_kb + slot * stride_kt
        v_row = page * stride_vb + slot * stride_vt
    else:
        k_row = b64 * stride_kb + n.to(tl.int64) * stride_kt
        v_row = b64 * stride_vb + n.to(tl.int64) * stride_vt
    one = (r == 0)[:, None] & d_ok[None, :]
    k = tl.load(K + (k_row + kvh64 * stride_kh) + (r * 0)[:, None] + offs_d[None, :], mask=one, other=0.0)
    v = tl.load(V + (v_row + kvh64 * stride_vh) + (r * 0)[:, None] + offs_d[None, :], mask=one, other=0.0)
    if FP8:
        k = k.to(tl.float16)
        v = v.to(tl.float16)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.sum(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), 1)  # columns 1.. hold q . 0
    s = _scores(s, qk_scale, row_scale, soft_cap, SOFTCAP, FP8)
    ok = n < visible
    if WINDOW:
        ok = ok & (n >= lowest)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base)
    l_i = l_i * alpha + p
    finite = tl.abs(v.to(tl.float32)) < float("inf")  # NaN compares false
    bad = tl.sum(tl.where(finite, 0, 1), 0) > 0  # [columns]: position n's V entry is not finite
    v = tl.where(finite, v, 0.0)
    p_col = tl.where((r == 0)[None, :] & ok[:, None], p[:, None], 0.0)  # [rows, 16]: p in column 0 where seen
    acc = acc * alpha[:, None] + tl.dot(p_col.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = tl.where(ok[:, None] & bad[None, :], float("nan"), acc)
    return acc, l_i, m_new


@triton.jit
def _merge_rows(WS_O, WS_LSE, row_base, first, count, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_U: tl.constexpr, UNROLL: tl.constexpr):
    """Merge the workspace slots ``[first, first + count)`` of the program's rows in slot order
    (:func:`attnplan.state.merge_states`: empty states weigh 0 and their ``o`` is never read, an all-empty row gives
    ``0 / -inf``, NaN in a non-empty state propagates). ``row_base``: ``[BLOCK_M]`` int64, each row's slot 0 in the
    contiguous workspace (``lse`` at ``row_base + slot``, ``o`` at ``(row_base + slot) * HEAD_DIM``). Loads bypass
    L1 (``.cg``): other programs wrote the states.

    Latency, not bandwidth, is its cost (one program reads a whole group's states): the LSE maximum takes
    ``BLOCK_U`` slots per load, and the weighted sum ``UNROLL`` slots per step of an unrolled loop, whose loads do
    not depend on each other, so they are in flight together. The sum still adds the slots one after another in
    slot order."""
    offs_u = tl.arange(0, BLOCK_U)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_M], tl.int32)
    for s0 in range(0, count, BLOCK_U):
        u_ok = s0 + offs_u < count
        ls = tl.load(WS_LSE + row_base[:, None] + (first + s0 + offs_u)[None, :],
                     mask=row_ok[:, None] & u_ok[None, :], other=float("-inf"), cache_modifier=".cg")
        mx = tl.maximum(mx, tl.max(ls, 1))
        nan += tl.sum((ls != ls).to(tl.int32), 1)  # tl.max may drop a NaN
    mx = tl.where(nan > 0, float("nan"), mx)
    mbase = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(0, count, UNROLL):
        for j in tl.static_range(UNROLL):
            ok = row_ok & (tl.zeros([BLOCK_M], tl.int32) + (s0 + j) < count)  # a block mask (the interpreter's too)
            idx = row_base + (first + s0 + j)
            ls = tl.load(WS_LSE + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(WS_O + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                        other=0.0, cache_modifier=".cg")
            w = tl.exp(ls - mbase)
            acc += w[:, None] * tl.where((ls == float("-inf"))[:, None], 0.0, o)
            tot += w
    empty = mx == float("-inf")
    tot_safe = tl.where(empty, 1.0, tot)
    return acc / tot_safe[:, None], tl.where(empty, float("-inf"), mbase + tl.log(tot_safe))


@triton.jit
def _store_out(o, lse, OUT, LSE_OUT, SINKS, b64, qi64, head64, head, row_ok, offs_d, d_ok,
               stride_outb, stride_outt, stride_outh, stride_lob, stride_lot,
               SINKS_ON: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A sequence's final rows: ``out[b, i, hq, :]`` in its dtype and ``lse[b, i, hq]``, the sink applied."""
    if SINKS_ON:
        o, lse = _add_sink(o, lse, SINKS, head, row_ok)
    ptrs = OUT + b64 * stride_outb + qi64[:, None] * stride_outt + head64[:, None] * stride_outh + offs_d[None, :]
    tl.store(ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(LSE_OUT + b64 * stride_lob + qi64 * stride_lot + head64, lse, mask=row_ok)


#: parameters of :func:`split_kv_partial_kernel` Triton does not specialize on (no constant for 1, no divisibility):
#: ``capacity`` changes with a contiguous cache's length (one token more per step) and only clamps lengths, so a new
#: value never compiles a new specialization
UNSPECIALIZED = ("capacity",)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def split_kv_partial_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, TARGETS, META, COUNTERS, WS_O, WS_LSE, OUT, LSE_OUT, K_SCALE, V_SCALE, SINKS,
    sm_scale_log2, window_left, soft_cap, batch, ws_slots, min_unit_granules, max_units_per_seq, last_page, capacity,
    stride_sl, stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_btc, stride_outb, stride_outt, stride_outh, stride_lob, stride_lot,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    ONE_BLOCK: tl.constexpr, GRANULE: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MULTI: tl.constexpr,
    BALANCED: tl.constexpr, MERGE: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
    SINKS_ON: tl.constexpr, FUSED_UNROLL: tl.constexpr,
):
    """Program ``p`` of the 1-D grid ``max_units * NUM_KV_HEADS``: unit slot ``p // NUM_KV_HEADS`` for KV head
    ``h = p % NUM_KV_HEADS``, rows ``(query i, head h * GROUP + g)`` of one ``tl.dot`` tile (``BLOCK_M >= 16``).

    ``MULTI`` (``max_units_per_seq > 1``): the prologue (:func:`_schedule`) finds the slot's unit ``u`` (the slot
    itself, or with ``ONE_BLOCK`` the live units spread over the slots, :func:`attnplan.schedule.slot_unit`), its
    sequence ``b`` and token range; a program without a unit exits. Otherwise (single pass) ``b = u`` and the range
    is the sequence's visible span. Every length loaded from ``SEQ_LENS`` is clamped into ``[0, capacity]`` (the
    tokens a sequence of the cache holds, :func:`_length`) and every page index loaded from ``BLOCK_TABLE`` into
    ``[0, last_page]`` (``num_pages - 1``): a bad length or entry reads a wrong span or page but never outside the
    cache. A sequence with one unit is
    written to ``OUT`` / ``LSE_OUT`` (the sink applied); otherwise the unit's normalized fp32 state goes to
    workspace slot ``u`` (``WS_O [1, Q, H, ws_slots, D]``, ``WS_LSE [1, Q, H, ws_slots]``, contiguous, natural-log
    LSE, no sink), and with ``MERGE == "fused"`` the program counts itself in ``COUNTERS[b * NUM_KV_HEADS + h]``;
    the last of the sequence's units merges the rows over its units in unit order (``FUSED_UNROLL`` units' states in
    flight at once, :func:`_merge_rows`), writes ``OUT`` / ``LSE_OUT`` and resets the counter.

    Rows: query ``i`` sees positions ``< seq_len - Q_LEN + i + 1`` (and ``>= seq_len - Q_LEN + i - window_left``
    with ``WINDOW``); a row with none in the unit gets ``o = 0, lse = -inf``. Tiles that hold positions some rows
    see and others do not (only when ``Q_LEN > 1``: a unit's first and last ``Q_LEN - 1`` positions at most) go one
    at a time (:func:`_tokens`), so NaN in a V row a query cannot see never reaches it. Variants: ``SOFTCAP``
    (``cap * tanh(s / cap)`` on scaled scores),
    ``FP8`` (K/V widened to fp16, a bf16 q row scaled into fp16 by a power of two, ``K_SCALE[h]`` folded into the
    score scale and ``V_SCALE[h]`` into the output), ``SINKS_ON`` (the sink joins the denominator where a final
    output is written).
    """
    pid = tl.program_id(0)
    u = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    if MULTI:
        slots = 0
        if ONE_BLOCK:  # spread the working programs over the grid (attnplan.schedule.slot_unit)
            slots = tl.num_programs(0) // NUM_KV_HEADS
        b, first, units_b, cb, seq_len, u = _schedule(SEQ_LENS, stride_sl, TARGETS, META, batch, u, slots, pid,
                                                      window_left, min_unit_granules, max_units_per_seq,
                                                      capacity, Q_LEN, GRANULE, WINDOW, BALANCED,
                                                      MERGE == "separate", BLOCK_B, ONE_BLOCK)
        if b < 0:  # no unit for this slot: the batch has fewer than max_units
            return
        base, _ = _granules(seq_len, Q_LEN, GRANULE, WINDOW, window_left)
        start = base + (u - first) * cb * GRANULE
        end = tl.minimum(start + cb * GRANULE, seq_len)
        start = tl.where(cb > 0, start, seq_len)  # an empty sequence's one unit covers nothing
        end = tl.where(cb > 0, end, seq_len)
    else:
        b = u
        first = u
        units_b = 1
        seq_len = _length(tl.load(SEQ_LENS + b.to(tl.int64) * stride_sl), capacity)
        base, _ = _granules(seq_len, Q_LEN, GRANULE, WINDOW, window_left)
        start = base
        end = seq_len
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    qi64 = qi.to(tl.int64)
    head64 = head.to(tl.int64)
    row_ok = offs_m < Q_LEN * GROUP
    visible = seq_len - Q_LEN + qi + 1  # query qi sees positions < visible
    lowest = visible - 1 - window_left  # ... and, with a window, >= lowest
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b64 * stride_qb + qi64[:, None] * stride_qt + head64[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale_log2
    if FP8:
        qk_scale = qk_scale * tl.load(K_SCALE + kvh)
    # fp8 K/V widen natively to fp16 (cvt.rn.f16x2.e4m3x2); to bf16 each pair also goes through f16 -> bf16. So
    # with fp8 KV the dots run in fp16: a bf16 q row is scaled by a power of two into fp16's range (max |q| ->
    # 2^14, no overflow; values 2^28 below the row's max would go subnormal), and the scale comes back out of its
    # scores.
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8 and Q.dtype.element_ty == tl.bfloat16:
        q_f32 = q.to(tl.float32)
        q_amax = tl.max(tl.abs(q_f32), 1)
        # the shift stays within +-113 (2^113 and its inverse are normal fp32; a row as small as 2^-114 is then
        # left below 2^-1, still exact in fp16) and is 0 for an all-zero or non-finite row
        q_ok = (q_amax > 0.0) & (q_amax < float("inf"))
        q_exp = tl.minimum(tl.maximum(14.0 - tl.ceil(tl.log2(tl.where(q_ok, q_amax, 1.0))), -113.0), 113.0)
        q_up = tl.exp2(tl.where(q_ok, q_exp, 0.0))
        q = (q_f32 * q_up[:, None]).to(tl.float16)
        row_scale = 1.0 / q_up
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BLOCK_TABLE + b64 * stride_btb
    if Q_LEN > 1:
        # [start, a): the window's first positions, which not every query's window reaches; [a, z): seen by every
        # query (or by none), in tiles; [z, end): the causal tail, positions >= seq_len - Q_LEN + 1 that query 0
        # cannot see. The two edges hold at most Q_LEN - 1 positions each (:func:`_tokens`).
        a = start
        if WINDOW:
            a = tl.minimum(tl.maximum(seq_len - 1 - window_left, start), end)
        z = tl.minimum(tl.maximum(seq_len - Q_LEN + 1, a), end)
        for n0 in range(a, z, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, n0, z, b64, kvh64, bt_row, stride_btc, last_page,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  qk_scale, row_scale, soft_cap, visible, lowest, offs_d, d_ok,
                                  BLOCK_N, PAGE_SIZE, PAGED, UPCAST, DOT_PRECISION, WINDOW, SOFTCAP, FP8)
        # the edges after the tiles (the online softmax takes positions in any order): [start, a) then [z, end),
        # one loop whose positions jump from a - 1 to z
        n_head = a - start
        for i in range(0, n_head + end - z):
            n = tl.where(i < n_head, start + i, z + i - n_head)
            acc, l_i, m_i = _token(acc, l_i, m_i, q, K, V, n, b64, kvh64, bt_row, stride_btc, last_page,
                                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                   qk_scale, row_scale, soft_cap, visible, lowest, offs_d, d_ok,
                                   PAGE_SIZE, PAGED, UPCAST, DOT_PRECISION, WINDOW, SOFTCAP, FP8)
    else:  # one query: every position of the unit is seen by every row
        for n0 in range(start, end, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, n0, end, b64, kvh64, bt_row, stride_btc, last_page,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  qk_scale, row_scale, soft_cap, visible, lowest, offs_d, d_ok,
                                  BLOCK_N, PAGE_SIZE, PAGED, UPCAST, DOT_PRECISION, WINDOW, SOFTCAP, FP8)

    empty = l_i == 0.0  # no visible position in this unit (p of the running max is exactly 1)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    if FP8:
        o = o * tl.load(V_SCALE + kvh)
    if MULTI:
        if units_b == 1:
            _store_out(o, lse, OUT, LSE_OUT, SINKS, b64, qi64, head64, head, row_ok, offs_d, d_ok,
                       stride_outb, stride_outt, stride_outh, stride_lob, stride_lot, SINKS_ON, WRITE_LSE)
        else:
            row_base = (qi64 * (GROUP * NUM_KV_HEADS) + head64) * ws_slots  # each row's slot 0
            idx = row_base + u
            tl.store(WS_O + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(WS_LSE + idx, lse, mask=row_ok)
            if MERGE == "fused":
                tl.debug_barrier()  # every thread's state stores precede the release below
                counter = COUNTERS + b64 * NUM_KV_HEADS + kvh64
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == units_b - 1:  # the last unit of this (sequence, KV head) merges it, in unit order
                    res, res_lse = _merge_rows(WS_O, WS_LSE, row_base, first, units_b, row_ok, offs_d, d_ok,
                                               HEAD_DIM, BLOCK_M, BLOCK_D, 32, FUSED_UNROLL)
                    _store_out(res, res_lse, OUT, LSE_OUT, SINKS, b64, qi64, head64, head, row_ok, offs_d, d_ok,
                               stride_outb, stride_outt, stride_outh, stride_lob, stride_lot, SINKS_ON, WRITE_LSE)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero at rest: the next launch
    else:
        _store_out(o, lse, OUT, LSE_OUT, SINKS, b64, qi64, head64, head, row_ok, offs_d, d_ok,
                   stride_outb, stride_outt, stride_outh, stride_lob, stride_lot, SINKS_ON, WRITE_LSE)


@triton.jit
def merge_kernel(
    WS_O, WS_LSE, META, OUT, LSE_OUT, SINKS, batch, ws_slots,
    stride_outb, stride_outt, stride_outh, stride_lob, stride_lot,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, SINKS_ON: tl.constexpr,
):
    """The separate merge: program (row, column slice), row = ``(b, i, head)``, slice ``c`` owns output columns
    ``[c * BLOCK_D, (c + 1) * BLOCK_D)``; the merge contract of :func:`attnplan.state.merge_states`.

    ``META`` (written by the partial kernel's program 0): ``first[b]`` at ``b``, ``units[b]`` at ``batch + b``. A row
    of a sequence with at most one unit exits (the partial kernel wrote it). Otherwise two passes over the slots
    ``[first[b], first[b] + units[b])`` in slot order (deterministic): the LSEs give the common base and total
    weight, then the weighted sum of the normalized partial outputs, ``BLOCK_S`` slots per load. NaN in a state's
    lse or o makes the row NaN. Every slice computes the same lse; slice 0 writes it. Slices exist for few rows over
    many units: one program per row walks ``units / BLOCK_S`` dependent round trips, and 8 rows leave all but 8 SMs
    idle (measured on an H200: 6.0-10.8 us at 8 rows x 128-256 splits with one program per row).
    """
    row = tl.program_id(0)
    col = tl.program_id(1)
    h = row % NUM_HEADS
    t = (row // NUM_HEADS) % Q_LEN
    b = row // NUM_HEADS // Q_LEN
    count = tl.load(META + batch + b)
    first = tl.load(META + b)  # with count: one dependent round trip before the states, not two
    if count <= 1:
        return
    row_base = (t.to(tl.int64) * NUM_HEADS + h) * ws_slots + first
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = col * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, count, BLOCK_S):
        lse_s = tl.load(WS_LSE + row_base + s0 + offs_s, mask=s0 + offs_s < count, other=float("-inf"))
        m = tl.maximum(m, lse_s, propagate_nan=tl.PropagateNan.ALL)
    m_max = tl.max(m, 0)
    m_max = tl.where(tl.sum((m != m).to(tl.int32), 0) > 0, float("nan"), m_max)  # tl.max may drop NaN
    m_base = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, count, BLOCK_S):
        s_ok = s0 + offs_s < count
        lse_s = tl.load(WS_LSE + row_base + s0 + offs_s, mask=s_ok, other=float("-inf"))
        w = tl.exp(lse_s - m_base)  # 0 for empty states
        total += w
        o_s = tl.load(WS_O + (row_base + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        o_s = tl.where((lse_s == float("-inf"))[:, None], 0.0, o_s)
        acc += tl.sum(w[:, None] * o_s, 0)
    tot = tl.sum(total, 0)
    all_empty = m_max == float("-inf")
    tot_safe = tl.where(all_empty, 1.0, tot)
    out = acc / tot_safe
    lse = tl.where(all_empty, float("-inf"), m_base + tl.log(tot_safe))
    if SINKS_ON:  # the sink joins the denominator once, after the states are merged (_sink_join)
        scale, lse = _sink_join(lse, tl.load(SINKS + h))
        out = out * scale
    b64 = b.to(tl.int64)
    tl.store(OUT + b64 * stride_outb + t.to(tl.int64) * stride_outt + h.to(tl.int64) * stride_outh + offs_d,
             out.to(OUT.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        if col == 0:
            tl.store(LSE_OUT + b64 * stride_lob + t.to(tl.int64) * stride_lot + h, lse)
