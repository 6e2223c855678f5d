// attnplan cuda_ptx: the partial-state format and the merge contract (attnplan.state.merge_states), one piece of
// code for both kernels: the merge kernel runs merge_row (its teams each merge_accumulate, then merge_write), the
// fused merge of the partial kernel merge_accumulate then merge_write (or merge_write_state, its two levels' team
// state), a partial program finishes each row with finish_row.
//
// A state of (row, split): fp32 o, normalized (sum_j p_j v_j / sum_j p_j over the split), and lse, the natural-log
// log-sum-exp of the split's scaled scores. An empty split (no visible position) has lse = -inf and o = 0. Merge of
// a row's states: lse = logsumexp_s(lse_s), o = sum_s exp(lse_s - lse) o_s; every split empty: o = 0, lse = -inf
// (never -inf - (-inf)). A sink logit z joins the denominator once, after the splits: lse' = logaddexp(lse, z),
// o' = o exp(lse - lse'). Partial states never include a sink.
//
// merge_row: lanes take the splits for the lse max and sum (warp shuffles), each thread 4 head_dim columns whose o
// loads of 8 (4) splits are in flight together, splits summed in index order (deterministic), empty splits weigh 0.
#pragma once

constexpr int ROW_MERGE_THREADS = ((HEAD_DIM / 4 + 31) / 32) * 32;  // one row's merge team: 4 dims per thread

// Loads of partial states. CG (the fused merge: states other programs of the running grid wrote): ld.global.cg
// (ptx.cuh). Otherwise (the merge kernel: the states come from an earlier launch) a plain load.
template <bool CG>
__device__ __forceinline__ float ld_state(const float *p) {
    if (!CG) return *p;
    return ld_cg(p);
}
template <bool CG>
__device__ __forceinline__ float4 ld_state4(const float *p) {  // p 16-byte aligned
    if (!CG) return *reinterpret_cast<const float4 *>(p);
    return ld_cg4(p);
}

// A store of a program's state (or of the single-pass output): the address, then the value.
template <class T>
__device__ __forceinline__ void st_state(T *p, const T &v) { *p = v; }

// A sink logit z joins the denominator of a row whose log-sum-exp is lse: returns lse' = logaddexp(lse, z)
// and sets factor = exp(lse - lse'), what the row's normalized o is multiplied by. An empty row (lse = -inf)
// gets lse' = z and factor 0 (never -inf - (-inf)).
__device__ __forceinline__ float join_sink(float lse, float z, float &factor) {
    if (lse == NEG_INF) {
        factor = 0.f;
        return z;
    }
    const float joined = fmaxf(lse, z) + log1pf(expf(-fabsf(lse - z)));
    factor = expf(lse - joined);
    return joined;
}

// The natural-log lse of a row a partial program finished (online softmax in base 2: running max m, sum l) and the
// factor its accumulator is multiplied by (1 / l, times the fp8 v_scale, times exp(lse - lse') when a sink joins
// the denominator: a row written to out directly, by the single pass or a one-unit sequence). Empty rows (m = -inf):
// o = 0, lse = -inf (or the sink). Keeps its own inline sink join: calling join_sink here changes ptxas's allocation
// of the measured kernels (fp8 tensor-core sm_80: 158 -> 197 registers) for the same arithmetic.
__device__ __forceinline__ void finish_row(float m, float l, float vscale, const float *__restrict__ sinks, int head,
                                           float &lse_n, float &factor) {
    const bool empty = m == NEG_INF;  // else l >= 1 (the max position has p = 1)
    lse_n = empty ? NEG_INF : (m + log2f(l)) * LN2_F;
    float scale = vscale;
    if (sinks) {  // rows written to out only (partial states never include the sink)
        const float z = sinks[head];
        const float joined = empty ? z : fmaxf(lse_n, z) + log1pf(expf(-fabsf(lse_n - z)));
        scale = empty ? 0.f : scale * expf(lse_n - joined);
        lse_n = joined;
    }
    factor = empty ? 0.f : scale / l;
}

// 4-dim column slots per thread of a merge team of TW threads (thread t owns d = 4 (t + k TW), k < slots)
template <int TW>
__host__ __device__ constexpr int merge_slots() { return (HEAD_DIM / 4 + TW - 1) / TW; }

// The per-row accumulation of every merge (merge_row, and the merge kernel's teams, each over its range of
// splits): the first n split states of one row, lse_s at lr[s * l_ss] and normalized o_s at orow[s * o_ss + d],
// into the running max M = max_s lse_s, the total weight tot = sum_s exp(lse_s - M) and the weighted column sums
// a = sum_s exp(lse_s - M) o_s (this thread's slots), splits summed in index order (deterministic). Empty splits
// (lse = -inf) weigh 0; every split empty (or n = 0): M = -inf, tot = 0, a = 0 (never -inf - (-inf)); a NaN lse or
// o of a non-empty split makes the row NaN (M NaN: never an empty row). Run by a
// team of TW threads (whole warps; t = the thread's index in the team), each owning the 4-dim slots
// d = 4 (t + k TW). Lanes take the splits (lane s, s + 32, ...): the max and the sum are warp reductions (every
// lane ends with M and tot); every warp of a team reduces the same splits by itself (no shared memory, no
// barrier). The o rows do not depend on the lse values, so the first CHUNK splits' o loads are issued together
// with the lse loads, and later chunks' CHUNK loads all before their use: up to CHUNK splits cost one memory
// round trip (measured on an H200 at batch 1, 4K tokens, 16 splits: loading o only after the max took 4.1 us,
// this 2.8 us; Triton's merge, whose [splits, dims] block loads are all in flight, 2.5 us). An empty split's o may
// be unwritten (poison): it is read but selected out, never multiplied in.
template <int TW, int CHUNK, bool CG>
__device__ __forceinline__ void merge_accumulate(const float *lr, i64 l_ss, const float *orow, i64 o_ss, int n, int t,
                                                 float &M, float &tot, float (&a)[merge_slots<TW>()][4]) {
    static_assert(TW % 32 == 0, "a merge team is whole warps");
    static_assert(CHUNK >= 1 && 32 % CHUNK == 0, "a chunk of splits divides a warp's 32");
    constexpr int NSLOT = merge_slots<TW>();
    const int lane = t & 31;
    float4 x[CHUNK][NSLOT];
    auto load_chunk = [&](int s) {  // the o rows of splits s .. s + CHUNK - 1 (zeros past n or HEAD_DIM)
#pragma unroll
        for (int j = 0; j < CHUNK; ++j)
#pragma unroll
            for (int k = 0; k < NSLOT; ++k) {
                const int d = 4 * (t + k * TW);
                x[j][k] = s + j < n && d < HEAD_DIM ? ld_state4<CG>(orow + (i64)(s + j) * o_ss + d)
                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
            }
    };
    const float ls0 = lane < n ? ld_state<CG>(lr + (i64)lane * l_ss) : NEG_INF;
    load_chunk(0);
    M = ls0;  // a NaN lse makes M NaN (fmax_nan): the row is NaN, never empty
    for (int s = lane + 32; s < n; s += 32) M = fmax_nan(M, ld_state<CG>(lr + (i64)s * l_ss));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmax_nan(M, __shfl_xor_sync(FULL_MASK, M, off));
    tot = 0.f;
#pragma unroll
    for (int k = 0; k < NSLOT; ++k) a[k][0] = a[k][1] = a[k][2] = a[k][3] = 0.f;
    if (M == NEG_INF) return;  // every split empty: never -inf - (-inf)
    for (int s0 = 0; s0 < n; s0 += 32) {
        // this lane's split weight; empty splits (lse -inf) and lanes past the last split weigh 0
        const float ls = s0 == 0 ? ls0 : s0 + lane < n ? ld_state<CG>(lr + (i64)(s0 + lane) * l_ss) : NEG_INF;
        const float w = ls == NEG_INF ? 0.f : expf(ls - M);
        tot += w;
        for (int c0 = 0; c0 < 32 && s0 + c0 < n; c0 += CHUNK) {
            if (s0 + c0 > 0) load_chunk(s0 + c0);  // the first chunk is in flight since the start
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                const float wj = __shfl_sync(FULL_MASK, w, c0 + j);
                if (wj != 0.f) {
#pragma unroll
                    for (int k = 0; k < NSLOT; ++k) {
                        a[k][0] = fmaf(wj, x[j][k].x, a[k][0]); a[k][1] = fmaf(wj, x[j][k].y, a[k][1]);
                        a[k][2] = fmaf(wj, x[j][k].z, a[k][2]); a[k][3] = fmaf(wj, x[j][k].w, a[k][3]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tot += __shfl_xor_sync(FULL_MASK, tot, off);
}

// Normalize a row's merged (M, tot, a) (merge_accumulate's form, this thread's slots) and write it: outp[0,
// HEAD_DIM) in q's dtype (vector stores where the row is aligned, element stores otherwise) and, if out_lse is given,
// *out_lse:
//   lse = M + log(tot);  o = a / tot;  M = -inf (every split empty): o = 0, lse = -inf
// then, with a sink logit z = *sink: lse' = logaddexp(lse, z), o' = o exp(lse - lse') (empty: o = 0, lse = z).
template <int TW>
__device__ __forceinline__ void merge_write(float M, float tot, const float (&a)[merge_slots<TW>()][4],
                                            const float *sink, elem_t *outp, float *out_lse, int t) {
    constexpr int NSLOT = merge_slots<TW>();
    const bool vec = vec4_aligned(outp);  // the row's start: out's leading strides may be any
    if (M == NEG_INF) {  // every split empty: never -inf - (-inf)
#pragma unroll
        for (int k = 0; k < NSLOT; ++k)
            if (4 * (t + k * TW) < HEAD_DIM) store4(outp + 4 * (t + k * TW), 0.f, 0.f, 0.f, 0.f, vec);
        if (t == 0 && out_lse) *out_lse = sink ? *sink : NEG_INF;
        return;
    }
    float lse_n = M + logf(tot), inv = 1.f / tot;  // tot >= 1: the split holding the max has weight 1
    if (sink) {  // the sink joins the denominator once, after the splits are merged
        float f;
        lse_n = join_sink(lse_n, *sink, f);
        inv *= f;
    }
#pragma unroll
    for (int k = 0; k < NSLOT; ++k) {
        const int d = 4 * (t + k * TW);
        if (d < HEAD_DIM) store4(outp + d, a[k][0] * inv, a[k][1] * inv, a[k][2] * inv, a[k][3] * inv, vec);
    }
    if (t == 0 && out_lse) *out_lse = lse_n;
}

// Normalize a row's merged (M, tot, a) into a partial state (the fused merge's team state): o at orow[0, HEAD_DIM)
// fp32 (16-byte stores; a state row is aligned) and lse at *lr, natural-log, no sink; every split empty: o = 0,
// lse = -inf. A NaN M or tot gives a NaN state.
template <int TW>
__device__ __forceinline__ void merge_write_state(float M, float tot, const float (&a)[merge_slots<TW>()][4],
                                                  float *orow, float *lr, int t) {
    constexpr int NSLOT = merge_slots<TW>();
    const bool empty = M == NEG_INF;  // never -inf - (-inf)
    const float inv = empty ? 0.f : 1.f / tot;
#pragma unroll
    for (int k = 0; k < NSLOT; ++k) {
        const int d = 4 * (t + k * TW);
        if (d < HEAD_DIM) {
            check_aligned(orow + d, 16);
            *reinterpret_cast<float4 *>(orow + d) = make_float4(a[k][0] * inv, a[k][1] * inv, a[k][2] * inv,
                                                                a[k][3] * inv);
        }
    }
    if (t == 0) *lr = empty ? NEG_INF : M + logf(tot);
}

// Merge the first n split states of one row (merge_accumulate's layout and team) into outp / out_lse
// (merge_write): lse = logsumexp_s(lse_s); o = sum_s exp(lse_s - lse) o_s; every split empty: o = 0, lse = -inf;
// then the sink, if given. One team per row: the single-team merge kernel.
template <int TW, int CHUNK, bool CG>
__device__ __forceinline__ void merge_row(const float *lr, i64 l_ss, const float *orow, i64 o_ss, int n,
                                          const float *sink, elem_t *outp, float *out_lse, int t) {
    float M, tot, a[merge_slots<TW>()][4];
    merge_accumulate<TW, CHUNK, CG>(lr, l_ss, orow, o_ss, n, t, M, tot, a);
    merge_write<TW>(M, tot, a, sink, outp, out_lse, t);
}
