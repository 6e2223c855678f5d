"""Triton kernels: split-KV partial (also the single-pass path) and the merge.

Method: Flash-Decoding (Dao et al., 2023) split-KV with an exp2 online softmax (FlashAttention-2,
Triton tutorial 06); one program per (split, KV head, sequence) holds the whole GQA group and all
``q_len`` queries as the rows of one ``tl.dot`` tile, so every KV byte is read once (vLLM's and
FlashInfer's grouped decode). Chunk bounds are derived from ``seq_lens`` in the kernel (vLLM's
Triton decode), so one plan and one grid serve all lengths, and CUDA-graph replays.

Split-V (seed 000) with programs as the workers: ``N_COLS`` column programs per split each own
``BLOCK_DV`` V / output columns and recompute QK^T over full K rows. In-kernel merges: ``fused``
(the last program of a (sequence, KV head) group merges in split order: deterministic) and
``atomic`` (seed 000 cost 1: each program merges into a locked accumulator in completion order, the
spin lock as in Triton's layer-norm-backward tutorial; acquire CAS, volatile accumulator loads,
release exchange; not bitwise reproducible).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _add_sink(o, lse, SINKS, head, row_ok):
    """The sink logit ``z`` joins the denominator: ``lse' = logaddexp(lse, z)``, ``o' = o exp(lse - lse')``
    (an empty row, ``lse = -inf``, gets ``o = 0, lse = z``)."""
    z = tl.load(SINKS + head, mask=row_ok, other=0.0)
    hi = tl.maximum(lse, z)
    new = hi + tl.log(tl.exp(lse - hi) + tl.exp(z - hi))
    return o * tl.exp(lse - new)[:, None], new


@triton.jit
def _merge_pair(o_a, lse_a, o_b, lse_b):
    """Two normalized states of the same rows into one (:func:`attnplan.state.merge_states`'s contract:
    empty states weigh 0, two empty states give ``o = 0, lse = -inf``, never ``-inf - (-inf)``).
    Merging into the empty state ``(0, -inf)`` returns ``(o_b, lse_b)`` bit for bit."""
    mx = tl.maximum(lse_a, lse_b)
    empty = mx == float("-inf")
    base = tl.where(empty, 0.0, mx)
    wa = tl.exp(lse_a - base)
    wb = tl.exp(lse_b - base)
    tot = tl.where(empty, 1.0, wa + wb)
    o = (o_a * wa[:, None] + o_b * wb[:, None]) / tot[:, None]
    return o, tl.where(empty, float("-inf"), base + tl.log(tot))


@triton.jit
def split_kv_partial_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, O, LSE, K_SCALE, V_SCALE, SINKS, OUT, LSE_OUT, COUNTERS,
    sm_scale_log2, window_left, soft_cap,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_ot, stride_oh, stride_os,
    stride_lb, stride_lt, stride_lh, stride_ls,
    stride_outb, stride_outt, stride_outh, stride_lob, stride_lot, stride_loh,
    chunk_size, num_splits, num_kv_heads, lock_offset,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, N_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
    WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, SINKS_ON: tl.constexpr,
    MERGE: tl.constexpr, WRITE_OUT_LSE: tl.constexpr,
):
    """Program (split s, column program c, KV head h, sequence b), axis 0 = ``s * N_COLS + c``.
    Rows m = i * GROUP + g are query i of q-head h*GROUP+g.

    Columns (split-V, seed 000, with programs as the workers): column program ``c`` owns V / output
    columns ``[c * BLOCK_DV, (c + 1) * BLOCK_DV)``; it scores its chunk against full K rows (all
    head_dim: QK^T recomputed by each of the ``N_COLS`` programs), keeps its own running max and
    sum and accumulates P.V for its columns only; no cross-program reduction. Every column program
    computes the same lse (same code, same scores), column program 0 writes it. ``N_COLS = 1``,
    ``BLOCK_DV = BLOCK_D`` is the split-K plan (one program, all columns).

    Writes ``O[b, i, head, s, cols]`` and ``LSE[b, i, head, s]`` (for the single-pass path the caller
    passes ``out``/``lse`` with ``stride_os = stride_ls = 0``). ``O`` takes the dtype of the buffer.
    Variants: ``WINDOW`` (chunks start at the window, rows see ``[p - window_left, p]``), ``SOFTCAP``
    (``cap * tanh(s / cap)`` on scaled scores, tanh from ``exp(-2|x|)`` so it cannot overflow),
    ``FP8`` (K/V widened to fp16, a bf16 q row scaled into fp16 by a power of two, ``K_SCALE[h]``
    folded into the score scale and ``V_SCALE[h]`` into the output), ``SINKS_ON`` (single pass, or an
    in-kernel merge: the sink joins the denominator).
    ``MERGE``: ``"none"`` (write the state / the single-pass output), ``"fused"`` (after writing its
    state, the program bumps its (sequence, KV head) completion counter ``COUNTERS[b * Hkv + h]``; the
    one that finishes last of the ``num_splits * N_COLS`` merges the group's rows over all splits in
    split order, the :func:`attnplan.state.merge_states` contract, writes ``OUT``/``LSE_OUT`` and
    resets the counter) or ``"atomic"`` (``O``/``LSE`` are one accumulator slot per column program:
    the program takes the spin lock ``COUNTERS[lock_offset + g]`` of its group ``g = (b * Hkv + h) *
    N_COLS + c``, counts itself in ``COUNTERS[g]``, merges its state into the accumulator, unless it
    is the first, which finds none, and releases the lock; the last of the ``num_splits`` writes
    ``OUT``/``LSE_OUT`` and resets the counter. Merge order = lock order: not bitwise reproducible).
    """
    pid = tl.program_id(0)
    split = pid // N_COLS
    col = pid % N_COLS
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    base = 0
    if WINDOW:  # no chunk before the first position any query can see
        base = tl.maximum(seq_len - Q_LEN - window_left, 0)
    start = base + split * chunk_size
    end = tl.minimum(start + chunk_size, seq_len)
    if split == num_splits - 1:  # the last split runs to the end of the sequence
        end = seq_len

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = offs_m < Q_LEN * GROUP
    visible = seq_len - Q_LEN + qi + 1  # query qi sees positions < visible
    lowest = visible - 1 - window_left  # ... and, with a window, >= lowest
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_v = col * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this column program's V / output columns
    v_ok = offs_v < HEAD_DIM

    q_ptrs = Q + b64 * stride_qb + qi[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale_log2
    if FP8:
        qk_scale = qk_scale * tl.load(K_SCALE + kvh)
    # fp8 K/V widen natively to fp16 (cvt.rn.f16x2.e4m3x2); to bf16 each pair also goes through
    # f16 -> bf16 (PTX counts in NOTES.md change 8). So with fp8 KV the dots run in fp16: a bf16 q
    # row is scaled by a power of two into fp16's range (max |q| -> 2^14, no overflow; values
    # 2^28 below the row's max would go subnormal), and the scale comes back out of its scores.
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8 and Q.dtype.element_ty == tl.bfloat16:
        q_f32 = q.to(tl.float32)
        q_amax = tl.max(tl.abs(q_f32), 1)
        # the shift stays within +-113 (2^113 and its inverse are normal fp32; a row as small as
        # 2^-114 is then left below 2^-1, still exact in fp16) and is 0 for an all-zero or non-finite row
        q_ok = (q_amax > 0.0) & (q_amax < float("inf"))
        q_exp = tl.minimum(tl.maximum(14.0 - tl.ceil(tl.log2(tl.where(q_ok, q_amax, 1.0))), -113.0), 113.0)
        q_up = tl.exp2(tl.where(q_ok, q_exp, 0.0))
        q = (q_f32 * q_up[:, None]).to(tl.float16)
        row_scale = 1.0 / q_up
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    bt_row = BLOCK_TABLE + b64 * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGED:
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
            k_row = page * stride_kb + slot * stride_kt
            v_row = page * stride_vb + slot * stride_vt
        else:
            k_row = b64 * stride_kb + offs_n.to(tl.int64) * stride_kt
            v_row = b64 * stride_vb + offs_n.to(tl.int64) * stride_vt
        k = tl.load(K + k_row[:, None] + kvh * stride_kh + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + v_row[:, None] + kvh * stride_vh + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :], other=0.0)
        if FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if FP8:
            s = s * (qk_scale * row_scale)[:, None]
        else:
            s = s * qk_scale
        if SOFTCAP:  # on natural-log-scaled scores: cap * tanh(x / cap), tanh via exp(-2|x|) (no overflow)
            x = s * (0.6931471805599453 / soft_cap)
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -th, th) * (soft_cap * 1.4426950408889634)
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
        m_i = m_new

    empty = l_i == 0.0  # no visible position in this chunk (p of the running max is exactly 1)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if FP8:
        o = o * tl.load(V_SCALE + kvh)
    if SINKS_ON and MERGE == "none":  # single pass: the sink joins the denominator here
        o, lse = _add_sink(o, lse, SINKS, head, row_ok)
    ov_ok = row_ok[:, None] & v_ok[None, :]
    # every column program has the same lse: column program 0 writes it (a tensor compare: the
    # Triton 3.9 interpreter rejects a mask made of a tensor & a scalar bool)
    lse_ok = row_ok & ((offs_m * 0 + col) == 0)
    out_ptrs = OUT + b64 * stride_outb + qi[:, None] * stride_outt + head[:, None] * stride_outh + offs_v[None, :]
    lse_out_ptrs = LSE_OUT + b64 * stride_lob + qi * stride_lot + head * stride_loh
    if MERGE == "atomic":
        grp = (b * num_kv_heads + kvh) * N_COLS + col
        acc_o_ptrs = O + b64 * stride_ob + qi[:, None] * stride_ot + head[:, None] * stride_oh + col * stride_os + offs_v[None, :]
        acc_lse_ptrs = LSE + b64 * stride_lb + qi * stride_lt + head * stride_lh + col * stride_ls
        while tl.atomic_cas(COUNTERS + lock_offset + grp, 0, 1, sem="acquire", scope="gpu") == 1:
            pass  # spin lock (Triton's layer-norm-backward tutorial); the holder is resident, so it finishes
        done = tl.atomic_add(COUNTERS + grp, 1, sem="relaxed", scope="gpu")  # states merged before this one
        # the first program finds no accumulator: (0, -inf), so it stores its own state (a tensor
        # compare, as for lse_ok: masks must not mix tensors and scalar bools)
        seen = (offs_m * 0 + done) > 0
        acc_lse = tl.load(acc_lse_ptrs, mask=row_ok & seen, other=float("-inf"), volatile=True)
        acc_o = tl.load(acc_o_ptrs, mask=ov_ok & seen[:, None], other=0.0, volatile=True)
        o, lse = _merge_pair(acc_o, acc_lse, o, lse)
        if done == num_splits - 1:  # the last of the group: write the output, leave the counter at zero
            if SINKS_ON:
                o, lse = _add_sink(o, lse, SINKS, head, row_ok)
            tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=ov_ok)
            if WRITE_OUT_LSE:
                tl.store(lse_out_ptrs, lse, mask=lse_ok)
            tl.atomic_xchg(COUNTERS + grp, 0, sem="relaxed", scope="gpu")
        else:
            tl.store(acc_o_ptrs, o, mask=ov_ok)
            tl.store(acc_lse_ptrs, lse, mask=row_ok)
        tl.debug_barrier()  # every thread's accumulator stores precede the release below
        tl.atomic_xchg(COUNTERS + lock_offset + grp, 0, sem="release", scope="gpu")
    else:
        o_ptrs = O + b64 * stride_ob + qi[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + offs_v[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=ov_ok)
        if WRITE_LSE:
            tl.store(LSE + b64 * stride_lb + qi * stride_lt + head * stride_lh + split * stride_ls, lse, mask=lse_ok)
    if MERGE == "fused":
        tl.debug_barrier()  # every thread's state stores precede the release below
        done = tl.atomic_add(COUNTERS + b * num_kv_heads + kvh, 1, sem="acq_rel", scope="gpu")
        if done == num_splits * N_COLS - 1:  # the last program of this group merges it, in split order
            lse_rows = LSE + b64 * stride_lb + qi * stride_lt + head * stride_lh
            o_rows = O + b64 * stride_ob + qi[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for s2 in range(0, num_splits):
                mx = tl.maximum(mx, tl.load(lse_rows + s2 * stride_ls, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
            mbase = tl.where(mx == float("-inf"), 0.0, mx)
            tot = tl.zeros([BLOCK_M], tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for s2 in range(0, num_splits):
                l2 = tl.load(lse_rows + s2 * stride_ls, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                w = tl.exp(l2 - mbase)
                o2 = tl.load(o_rows + s2 * stride_os, mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
                acc2 += w[:, None] * tl.where((l2 == float("-inf"))[:, None], 0.0, o2)
                tot += w
            empty_row = mx == float("-inf")
            tot_safe = tl.where(empty_row, 1.0, tot)
            res = acc2 / tot_safe[:, None]
            res_lse = tl.where(empty_row, float("-inf"), mbase + tl.log(tot_safe))
            if SINKS_ON:
                res, res_lse = _add_sink(res, res_lse, SINKS, head, row_ok)
            out_all = OUT + b64 * stride_outb + qi[:, None] * stride_outt + head[:, None] * stride_outh + offs_d[None, :]
            tl.store(out_all, res.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            if WRITE_OUT_LSE:
                tl.store(lse_out_ptrs, res_lse, mask=row_ok)
            tl.atomic_xchg(COUNTERS + b * num_kv_heads + kvh, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def merge_kernel(
    O_PART, LSE_PART, OUT, LSE_OUT, SINKS, num_splits,
    stride_pb, stride_pt, stride_ph, stride_ps,
    stride_lb, stride_lt, stride_lh, stride_ls,
    stride_outb, stride_outt, stride_outh,
    stride_lob, stride_lot, stride_loh,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, SINKS_ON: tl.constexpr,
):
    """Program (row, column slice): row = (b, i, head), slice ``c`` owns output columns
    ``[c * BLOCK_D, (c + 1) * BLOCK_D)``; the merge contract of :func:`attnplan.state.merge_states`.

    Two passes over the splits in fixed order (deterministic): the LSEs give the common base
    and total weight, then the weighted sum of the normalized partial outputs, ``BLOCK_S`` splits
    per load (all in flight together). Every slice computes the same lse from the same values;
    slice 0 writes it. Slices exist for few rows over many splits: one program per row walks
    ``num_splits / BLOCK_S`` dependent round trips, and 8 rows leave all but 8 SMs idle
    (results/2026-11-30-s5-call1: 6.0-10.8 us at 8 rows x 128-256 splits).
    """
    row = tl.program_id(0)
    col = tl.program_id(1)
    h = row % NUM_HEADS
    t = (row // NUM_HEADS) % Q_LEN
    b = (row // NUM_HEADS // Q_LEN).to(tl.int64)
    lse_base = LSE_PART + b * stride_lb + t * stride_lt + h * stride_lh
    o_base = O_PART + b * stride_pb + t * stride_pt + h * stride_ph
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = col * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        lse_s = tl.load(lse_base + (s0 + offs_s) * stride_ls, mask=s0 + offs_s < num_splits, other=float("-inf"))
        m = tl.maximum(m, lse_s)
    m_max = tl.max(m, 0)
    m_base = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        lse_s = tl.load(lse_base + (s0 + offs_s) * stride_ls, mask=s_ok, other=float("-inf"))
        w = tl.exp(lse_s - m_base)  # 0 for empty splits
        total += w
        o_s = tl.load(o_base + (s0 + offs_s)[:, None] * stride_ps + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        o_s = tl.where((lse_s == float("-inf"))[:, None], 0.0, o_s)
        acc += tl.sum(w[:, None] * o_s, 0)
    tot = tl.sum(total, 0)
    all_empty = m_max == float("-inf")
    tot_safe = tl.where(all_empty, 1.0, tot)
    out = acc / tot_safe
    lse = tl.where(all_empty, float("-inf"), m_base + tl.log(tot_safe))
    if SINKS_ON:  # the sink joins the denominator once, after the splits are merged
        z = tl.load(SINKS + h)
        hi = tl.maximum(lse, z)
        new = hi + tl.log(tl.exp(lse - hi) + tl.exp(z - hi))
        out = out * tl.exp(lse - new)
        lse = new
    tl.store(OUT + b * stride_outb + t * stride_outt + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        if col == 0:
            tl.store(LSE_OUT + b * stride_lob + t * stride_lot + h * stride_loh, lse)
