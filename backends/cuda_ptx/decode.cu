// attnplan cuda_ptx backend: split-KV ("Flash-Decoding", Dao et al. 2023) decode attention kernels.
//
// Compiled at run time by NVRTC (nvrtc.py) once per specialization, with the headers below as named header
// sources (source.py); the host (spec.py, KernelSpec.defines) passes every compile-time constant as a -D macro
// (config.cuh, layout.cuh). One program holds two kernels, ATTNPLAN_KIND chooses which:
//   attnplan_decode_partial (0) / attnplan_decode_single (1): the split partial kernel writes every split's
//     PartialState (with ATTNPLAN_MERGE 1 it also merges its group's states: the fused merge); the single pass
//     writes out and lse directly.
//   attnplan_merge (2): merges the partial states of one output row per CTA.
//
// Kernel contract (attnplan/backends/base.py): the program (CTA) for split s, KV head h, sequence b serves every
// query head h*GROUP .. h*GROUP+GROUP-1 and all QLEN queries of b. Its chunk is [base + s*chunk_size,
// min(base + (s+1)*chunk_size, L)), L = seq_lens[b], and the last split runs on to L; base = 0, or with a sliding
// window max(0, L - QLEN - window_left). Query i sits at position p = L - QLEN + i and sees positions <= p (and
// >= p - window_left with a window). A row with no visible position writes o = 0, lse = -inf. The partial kernel
// writes fp32 o (normalized) and natural-log lse at split index s (and, with the fused merge, out and lse of the
// group at the end); the single-pass kernel writes out (q's dtype) and lse directly.
// Variants: the soft-cap c*tanh(score/c) is applied to the scaled scores; a sink logit z (per query head, natural
// log) joins the denominator in the single-pass epilogue and the merges only (partial states never include it):
// lse' = logaddexp(lse, z), o' = o * exp(lse - lse'). An fp8 cache holds K/k_scale[h] and V/v_scale[h]:
// k_scale[h] is folded into q's score scale, v_scale[h] into the program's normalized output (so lse and the
// merge never see it).
//
// The pieces (headers of functions and constants, included here at file scope):
//   config.cuh     types, the macros both kernels share
//   ptx.cuh        every inline-PTX instruction, and its host-emulation twin
//   convert.cuh    element conversions, the fp8 e4m3fn decoders, the soft-cap
//   layout.cuh     a kernel's layout from its macros, checked against the host's
//   state.cuh      the partial-state format and the merge contract (merge_row, finish_row)
//   copy.cuh       KV tile copies through the warps' cp.async rings, block-table reads
//   core_loop.cuh  the CUDA-core main loop's helpers (scores, P.V)
//   mma_loop.cuh   the tensor-core main loop (mma_tile: ldmatrix, mma.sync, the online softmax on fragments)
//   epilogue.cuh   the fused cross-program merge
// and kernel-body fragments, included inside the partial kernel below: core_loop_rows / _tile / _finish.cuh (the
// CUDA-core path's setup, per-tile softmax and end) and mma_loop_rows / _finish.cuh (the tensor-core path's). The
// kernel bodies are text rather than calls on purpose: NVVM optimizes a function before it inlines it, so moving
// any piece of a kernel body into a function, even a __forceinline__ one, changes the PTX the kernel compiles to
// (checked for every piece: the rows' setup, the per-tile softmax, the end merge, the empty program's state write),
// and ptxas's register allocation with it (the CUDA-core split-K kernel spilled on sm_80).
#include "config.cuh"
#include "ptx.cuh"
#include "convert.cuh"
#include "layout.cuh"
#include "state.cuh"

#if ATTNPLAN_KIND == ATTNPLAN_KIND_MERGE
// The merge kernel: one CTA per output row (b, i, head) of the first num_splits splits of o [B, Q, H, S, D] /
// lse [B, Q, H, S] (strides in elements) into out [B, Q, H, D] (q's dtype) and out_lse [B, Q, H] (may be null);
// sinks [H] (may be null) join the denominator (state.cuh's contract). MERGE_TEAMS teams of TEAM_THREADS threads.
// Launched with programmatic dependent launch after the partial kernel: it waits for the partial grid first.
// One team (MERGE_TEAMS 1) merges the row with merge_row: no shared memory, no barrier. Several teams (2, 4 or 8:
// the host's merge_teams, for few rows of many splits, where one team walks ceil(n / MERGE_CHUNK) dependent memory
// round trips; H200, CUPTI: batch 1, 1 KV head, 8 query heads = 8 rows, 128 splits: 9.3 us, 8 round trips per
// CTA): team k merges the contiguous splits [k per, min(n, (k + 1) per)), per = ceil(n / MERGE_TEAMS) rounded up
// to whole chunks (a team's range may be empty), with merge_accumulate (M_k, tot_k, a_k; an empty range or one of
// empty splits gives M_k = -inf, tot_k = 0, a_k = 0). The teams publish them in the dynamic shared memory
// (a_k[HEAD_DIM] of every team, then M_k, tot_k: MERGE_TEAMS x (HEAD_DIM + 2) fp32), one barrier, and team 0
// combines them in team order 0 .. MERGE_TEAMS-1 (deterministic: same inputs and teams, same bits):
//   M = max_k M_k;  tot = sum_k exp(M_k - M) tot_k;  a = sum_k exp(M_k - M) a_k  (teams with M_k = -inf skipped)
// and writes the row with merge_write (M = -inf: o = 0, lse = -inf or the sink; the sink joins once, here).
extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
attnplan_merge(const float *__restrict__ o, const float *__restrict__ lse, elem_t *__restrict__ out,
               float *__restrict__ out_lse, const float *__restrict__ sinks, int num_splits, int q_len, int num_heads,
               i64 o_sb, i64 o_si, i64 o_sh, i64 o_ss,
               i64 l_sb, i64 l_si, i64 l_sh, i64 l_ss,
               i64 out_sb, i64 out_si, i64 out_sh,
               i64 ol_sb, i64 ol_si, i64 ol_sh) {
    pdl_wait();  // launched early (programmatic dependent launch): the partial states are complete after this
    const i64 row = (i64)blockIdx.x + (i64)gridDim.x * (i64)blockIdx.y;
    const int hh = (int)(row % num_heads);
    const int i = (int)((row / num_heads) % q_len);
    const int b = (int)(row / ((i64)num_heads * q_len));
    const float *lr = lse + (i64)b * l_sb + (i64)i * l_si + (i64)hh * l_sh;
    const float *orow = o + (i64)b * o_sb + (i64)i * o_si + (i64)hh * o_sh;
    const float *sink = sinks ? sinks + hh : nullptr;
    elem_t *outp = out + (i64)b * out_sb + (i64)i * out_si + (i64)hh * out_sh;
    float *olp = out_lse ? out_lse + (i64)b * ol_sb + (i64)i * ol_si + (i64)hh * ol_sh : nullptr;
    // the states come from an earlier launch: plain loads
    if constexpr (MERGE_TEAMS == 1) {
        merge_row<TEAM_THREADS, MERGE_CHUNK, false>(lr, l_ss, orow, o_ss, num_splits, sink, outp, olp, threadIdx.x);
    } else {  // several teams per row: ranges of the splits, combined in team order
        ATTNPLAN_DYNAMIC_SMEM(smem);
        float *sm_a = reinterpret_cast<float *>(smem);  // [MERGE_TEAMS][HEAD_DIM]
        float *sm_m = sm_a + MERGE_TEAMS * HEAD_DIM, *sm_tot = sm_m + MERGE_TEAMS;
        const int team = threadIdx.x / TEAM_THREADS, t = threadIdx.x % TEAM_THREADS;
        const int per = ((num_splits + MERGE_TEAMS - 1) / MERGE_TEAMS + MERGE_CHUNK - 1) / MERGE_CHUNK * MERGE_CHUNK;
        const int s0 = cmin(num_splits, team * per), cnt = cmin(num_splits - s0, per);
        float M, tot, a[MERGE_SLOTS][4];
        merge_accumulate<TEAM_THREADS, MERGE_CHUNK, false>(lr + (i64)s0 * l_ss, l_ss, orow + (i64)s0 * o_ss, o_ss, cnt,
                                                               t, M, tot, a);
#pragma unroll
        for (int k = 0; k < MERGE_SLOTS; ++k) {
            const int d = 4 * (t + k * TEAM_THREADS);
            if (d < HEAD_DIM) sts(sm_a + team * HEAD_DIM + d, make_float4(a[k][0], a[k][1], a[k][2], a[k][3]));
        }
        if (t == 0) {
            sts(sm_m + team, M);
            sts(sm_tot + team, tot);
        }
        __syncthreads();
        if (team != 0) return;
        M = NEG_INF;
#pragma unroll
        for (int k = 0; k < MERGE_TEAMS; ++k) M = fmaxf(M, lds<float>(sm_m + k));
        tot = 0.f;
#pragma unroll
        for (int k = 0; k < MERGE_SLOTS; ++k) a[k][0] = a[k][1] = a[k][2] = a[k][3] = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int j = 0; j < MERGE_TEAMS; ++j) {  // team order: deterministic
                const float mj = lds<float>(sm_m + j);
                if (mj == NEG_INF) continue;  // a team of empty splits (or none) weighs 0
                const float f = expf(mj - M);
                tot = fmaf(f, lds<float>(sm_tot + j), tot);
#pragma unroll
                for (int k = 0; k < MERGE_SLOTS; ++k) {
                    const int d = 4 * (t + k * TEAM_THREADS);
                    if (d < HEAD_DIM) {
                        const float4 v = lds<float4>(sm_a + j * HEAD_DIM + d);
                        a[k][0] = fmaf(f, v.x, a[k][0]); a[k][1] = fmaf(f, v.y, a[k][1]);
                        a[k][2] = fmaf(f, v.z, a[k][2]); a[k][3] = fmaf(f, v.w, a[k][3]);
                    }
                }
            }
        }
        merge_write<TEAM_THREADS>(M, tot, a, sink, outp, olp, t);
    }
}

#else
#include "copy.cuh"
#include "core_loop.cuh"
#include "mma_loop.cuh"
#include "epilogue.cuh"

#if ATTNPLAN_KIND == ATTNPLAN_KIND_SINGLE
#define ATTNPLAN_ENTRY attnplan_decode_single
#else
#define ATTNPLAN_ENTRY attnplan_decode_partial
#endif

// The partial (o [B, Q, Hq, S, D] fp32, lse [B, Q, Hq, S]) or single-pass (o = out [B, Q, Hq, D] in q's dtype,
// lse [B, Q, Hq] or null) kernel over q [B, Q, Hq, D], the KV cache (contiguous [B, T, Hkv, D], or paged [pages,
// PAGE, Hkv, D] through block_table [B, max_pages]) and seq_lens [B]; strides in elements (k / v: _s0 sequence or
// page, _s1 token, _sh head; o / lse: _sb, _si, _sh, _ss = split), scale_log2 = sm_scale log2(e), softcap_log2 =
// cap log2(e). sinks [Hq], k_scale / v_scale [Hkv] may be null. The fused merge's out, out_lse and counters
// (ATTNPLAN_MERGE 1) are null otherwise. Grid (S, Hkv, B), or flattened along x.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS_PER_SM)
ATTNPLAN_ENTRY(const elem_t *__restrict__ q, const kv_t *__restrict__ kc, const kv_t *__restrict__ vc,
               const int *__restrict__ seq_lens, const int *__restrict__ block_table,
               out_t *__restrict__ o, float *__restrict__ lse, const float *__restrict__ sinks,
               const float *__restrict__ k_scale, const float *__restrict__ v_scale,
               float scale_log2, float softcap_log2, int chunk_size, int num_splits, int num_kv_heads,
               int window_left,
               i64 q_sb, i64 q_si, i64 q_sh,
               i64 k_s0, i64 k_s1, i64 k_sh,
               i64 v_s0, i64 v_s1, i64 v_sh,
               i64 bt_sb,
               i64 o_sb, i64 o_si, i64 o_sh, i64 o_ss,
               i64 l_sb, i64 l_si, i64 l_sh, i64 l_ss,
               elem_t *__restrict__ out, float *__restrict__ out_lse, int *__restrict__ counters,
               i64 out_sb, i64 out_si, i64 out_sh,
               i64 ol_sb, i64 ol_si, i64 ol_sh) {
    ATTNPLAN_DYNAMIC_SMEM(smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if constexpr (!FUSED) pdl_launch_dependents();  // the merge kernel may launch now; it waits for this grid

    // program -> (split, kv head, sequence); the grid is (S, Hkv, B) or flattened along x.
    // (the 3-D grid without any division: the 64-bit ones sit before the first load, seq_lens[b])
    int s, h, b;
    if (gridDim.x == (unsigned)num_splits && gridDim.y == (unsigned)num_kv_heads) {
        s = (int)blockIdx.x;
        h = (int)blockIdx.y;
        b = (int)blockIdx.z;
    } else {
        const i64 lin = (i64)blockIdx.x + (i64)gridDim.x * ((i64)blockIdx.y + (i64)gridDim.y * (i64)blockIdx.z);
        s = (int)(lin % num_splits);
        h = (int)((lin / num_splits) % num_kv_heads);
        b = (int)(lin / num_splits / num_kv_heads);
    }

    const int L = seq_lens[b];
    int base = 0;
    if constexpr (WINDOW) base = L - QLEN - window_left > 0 ? L - QLEN - window_left : 0;  // none before the window
    const i64 cs64 = (i64)base + (i64)s * chunk_size;
    int cs = L, ce = L;
    if (cs64 < (i64)L) {
        cs = (int)cs64;
        ce = (s == num_splits - 1) ? L : (int)(cs64 + chunk_size < (i64)L ? cs64 + chunk_size : (i64)L);
    }

    // Where the program's rows r = i*GROUP + g go (query i, head h*GROUP + g): the split's slot of the partial
    // state (single pass: out and lse). Partial states never include a sink: with the fused merge `sinks` is the
    // merge's (it joins there), so the state's rows see none.
    // (row r at ob + i * osi + (hb + g) * osh, its lse at lb + i * lsi + (hb + g) * lsh)
    out_t *__restrict__ ob = o + (i64)b * o_sb + (i64)s * o_ss;
    float *__restrict__ lb = lse ? lse + (i64)b * l_sb + (i64)s * l_ss : lse;
    const i64 osi = o_si, osh = o_sh, lsi = l_si, lsh = l_sh;
    const int hb = h * GROUP;
    const float *__restrict__ state_sinks = MERGE_MODE ? nullptr : sinks;
    // the fused merge of the group, once this program's state is written (every thread, every path; epilogue.cuh):
    // counters[grp] counts the group's programs. (Defined only when it is used: an unused capturing lambda
    // changes the PTX of the others.)
#if ATTNPLAN_MERGE
    const i64 grp = (i64)h + (i64)num_kv_heads * b;
    auto merge_group = [&]() {
        elem_t *outb = out + (i64)b * out_sb + (i64)h * GROUP * out_sh;
        float *olb = out_lse ? out_lse + (i64)b * ol_sb + (i64)h * GROUP * ol_sh : nullptr;
        const float *sinkb = sinks ? sinks + h * GROUP : nullptr;
        fused_merge(smem, tid, num_splits, counters + grp, o + (i64)b * o_sb + (i64)h * GROUP * o_sh, o_si, o_sh, o_ss,
                    lse + (i64)b * l_sb + (i64)h * GROUP * l_sh, l_si, l_sh, l_ss, outb, out_si, out_sh, olb, ol_si,
                    ol_sh, sinkb);
    };
#else
    auto merge_group = []() {};  // no fused merge
#endif

    if (cs >= ce) {  // empty program: read nothing, write the empty state of every row
        for (int idx = tid; idx < R * HEAD_DIM; idx += NTHREADS) {
            const int rr = idx / HEAD_DIM, d = idx % HEAD_DIM;
            const int i = rr / GROUP, g = rr % GROUP;
            st_state(ob + (i64)i * osi + (i64)(hb + g) * osh + d, to_out(0.f));
        }
        if (lb) {
            for (int rr = tid; rr < R; rr += NTHREADS) {
                const int i = rr / GROUP, g = rr % GROUP;
                st_state(lb + (i64)i * lsi + (i64)(hb + g) * lsh, state_sinks ? state_sinks[h * GROUP + g] : NEG_INF);
            }
        }
        if constexpr (FUSED) merge_group();
        return;
    }

    const int rg = warp / NWK, kw = warp % NWK;  // row group; KV warp within it
    const int slot = lane / LPT, lv = lane % LPT;

    float qscale = scale_log2, vscale = 1.f;
    if constexpr (KV8) {
        // dequantization folded into the score scale and into the normalized output (the CUDA-core decoder's
        // values carry 2^-8, FP8_UNIT; the tensor-core path's fp16 values are exact)
        qscale *= k_scale[h] * (MMA ? 1.f : FP8_UNIT);
        vscale = v_scale[h] * (MMA ? 1.f : FP8_UNIT);
    }

    // ---- this warp's rows: q in registers, their visible ranges, the online-softmax state ----
#if ATTNPLAN_MMA
#include "mma_loop_rows.cuh"
#else
#include "core_loop_rows.cuh"
#endif

    const kv_t *kb = kc + (i64)h * k_sh;
    const kv_t *vb = vc + (i64)h * v_sh;
    const int *btb = block_table;
    if constexpr (PAGE > 0) {
        btb = block_table + (i64)b * bt_sb;
    } else {
        kb += (i64)b * k_s0;
        vb += (i64)b * v_s0;
    }
    const int tb = start & ~(TILE - 1);  // tiles are TILE-aligned: never across a page boundary
    const int ntiles = end > start ? (end - tb + TILE - 1) / TILE : 0;

    // ---- KV streaming: this warp's tiles kw, kw + NWK, ... through its private ring ----
    const int cid = lane;
    const int my_n = ntiles > kw ? (ntiles - kw + NWK - 1) / NWK : 0;
    unsigned char *ring = smem + warp * (STAGES * STAGE_BYTES);
#define TILE_START(it) (tb + (kw + NWK * (it)) * TILE)
    LaneCopies lc;
    lane_copies(lc, k_s1, v_s1, cid);

    PageWindow pw;
    if (PAGE_WIN) pw.init(btb, TILE_START(0), TILE_START(1) - TILE_START(0), start, end, lane);
    {  // prologue: block-table entries of the first STAGES-1 tiles together, then their copies
        int pgp[STAGES - 1][NPG];
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (PAGE_WIN)
                pw.tile(pgp[st], st, lane);
            else
                load_pages(pgp[st], btb, TILE_START(st), start, end, cid);
        }
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < my_n)
                issue_tile(ring + st * STAGE_BYTES, kb, vb, TILE_START(st), start, end, pgp[st], lc, k_s0, k_s1, v_s0,
                           v_s1, cid);
            cp_async_commit();
        }
    }
    int pg[NPG];
    if (!PAGE_WIN) load_pages(pg, btb, TILE_START(STAGES - 1), start, end, cid);

    int stage_c = 0, stage_w = STAGES - 1;
    for (int it = 0; it < my_n; ++it) {
        if (PAGE_WIN) pw.tile(pg, it + STAGES - 1, lane);
        if (it + STAGES - 1 < my_n)
            issue_tile(ring + stage_w * STAGE_BYTES, kb, vb, TILE_START(it + STAGES - 1), start, end, pg, lc, k_s0,
                       k_s1, v_s0, v_s1, cid);
        cp_async_commit();
        if (!PAGE_WIN) load_pages(pg, btb, TILE_START(it + STAGES), start, end, cid);  // used one iteration later
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int ts = TILE_START(it);
        const unsigned char *ks = ring + stage_c * STAGE_BYTES;
        const unsigned char *vs = ks + KT_BYTES;

#if ATTNPLAN_MMA
        mma_tile(m, l, acc, qb, ks, vs, ts, lo, hi, ts < max_lo || ts + TILE > min_hi, lane, rs, softcap_log2);
#else
#include "core_loop_tile.cuh"
#endif
        __syncwarp();  // every lane is done with this stage before it is refilled
        stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
        stage_w = stage_w + 1 == STAGES ? 0 : stage_w + 1;
    }
#undef TILE_START
    cp_async_wait<0>();

    // ---- the warps' (m, l, acc) into shared memory (the rings are free now) ----
#if ATTNPLAN_MMA
#include "mma_loop_finish.cuh"
#else
#include "core_loop_finish.cuh"
#endif
    __syncthreads();

    // each thread 4 consecutive head_dim columns of one row: the row's warp weights once per 4 columns, 16-byte
    // shared-memory loads and (partial state, 16-byte aligned: host check) stores; warps summed in index order
    constexpr int D4 = HEAD_DIM / 4;
    for (int idx = tid; idx < R * D4; idx += NTHREADS) {
        const int rr = idx / D4, d = (idx % D4) * 4;
        const int w0 = (rr / RT) * NWK, r = rr % RT;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWK; ++w) M = fmaxf(M, lds<float>(sm_m + (w0 + w) * RT + r));
        float lsum = 0.f, a[4] = {0.f, 0.f, 0.f, 0.f};
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWK; ++w) {
                const float f = fast_exp2(lds<float>(sm_m + (w0 + w) * RT + r) - M);  // 0 for a warp that saw nothing
                lsum = fmaf(f, lds<float>(sm_l + (w0 + w) * RT + r), lsum);
                const float4 x = lds<float4>(sm_acc + ((w0 + w) * RT + r) * HEAD_DIM + d);
                a[0] = fmaf(f, x.x, a[0]);
                a[1] = fmaf(f, x.y, a[1]);
                a[2] = fmaf(f, x.z, a[2]);
                a[3] = fmaf(f, x.w, a[3]);
            }
        }
        const int i = rr / GROUP, g = rr % GROUP;
        float lse_n, factor;
        finish_row(M, lsum, vscale, state_sinks, h * GROUP + g, lse_n, factor);
        out_t *dst = ob + (i64)i * osi + (i64)(hb + g) * osh + d;
        if constexpr (KIND == ATTNPLAN_KIND_SINGLE) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st_state(dst + e, to_out(a[e] * factor));  // out: unit stride, any alignment
        } else {
            float4 t4;
            t4.x = a[0] * factor; t4.y = a[1] * factor; t4.z = a[2] * factor; t4.w = a[3] * factor;
            st_state(reinterpret_cast<float4 *>(dst), t4);
        }
        if (d == 0 && lb) st_state(lb + (i64)i * lsi + (i64)(hb + g) * lsh, lse_n);
    }
    if constexpr (FUSED) merge_group();
}

#endif
