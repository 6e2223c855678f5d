// attnplan cuda_ptx backend: split-KV ("Flash-Decoding", Dao et al. 2023) decode attention kernels.
//
// Compiled at run time by NVRTC (nvrtc.py) once per specialization, with the headers below as named header
// sources (source.py); the host (spec.py, KernelSpec.defines) passes every compile-time constant as a -D macro
// (config.cuh, layout.cuh). One program holds two kernels, ATTNPLAN_KIND chooses which:
//   attnplan_decode_partial (0): the scheduled partial kernel of a plan with several units per sequence: its
//     prologue (schedule.cuh) computes the device-side schedule from the live seq_lens; a sequence with one unit
//     writes out / out_lse directly, the others' units write their PartialState into the ragged workspace (with
//     ATTNPLAN_MERGE 1 the last unit of each (sequence, KV head) also merges them: the fused merge);
//   attnplan_decode_single (1): the single pass (one unit per sequence, u = b, no prologue) writes out / out_lse;
//   attnplan_merge (2): the separate merge, one output row per CTA, over the slots the partial kernel's meta names.
//
// Kernel contract (attnplan/backends/base.py): a 1-D grid of max_units x num_kv_heads programs, unit-major; the
// program of unit u and KV head h serves every query head h*GROUP .. h*GROUP+GROUP-1 and all QLEN queries of the
// unit's sequence b, over the unit's token range [cs, ce) (single pass: [base, L); base = 0, or with a sliding
// window max(0, L - QLEN - window_left)). L is seq_lens[b] clamped into [0, capacity] (schedule.cuh, seq_len_at),
// in the prologue and everywhere after it. Query i sits at position p = L - QLEN + i and sees
// positions <= p (and >= p - window_left with a window). A row with no visible position gets o = 0, lse = -inf.
// A program past the batch's units exits writing nothing. Workspace slot u holds fp32 o (normalized) and
// natural-log lse of each row; out takes q's dtype.
// Variants: the soft-cap c*tanh(score/c) is applied to the scaled scores; a sink logit z (per query head, natural
// log) joins the denominator where out is written (a one-unit sequence's epilogue, the single pass and the merges;
// partial states never include it): lse' = logaddexp(lse, z), o' = o * exp(lse - lse'). An fp8 cache holds
// K/k_scale[h] and V/v_scale[h]: k_scale[h] is folded into q's score scale, v_scale[h] into the program's
// normalized output (so lse and the merge never see it).
//
// The pieces (headers of functions and constants, included here at file scope):
//   config.cuh     types, the macros both kernels share
//   ptx.cuh        every inline-PTX instruction, and its host-emulation twin
//   convert.cuh    element conversions, the fp8 e4m3fn decoders, the soft-cap
//   layout.cuh     a kernel's layout from its macros, checked against the host's
//   state.cuh      the partial-state format and the merge contract (merge_row, finish_row)
//   schedule.cuh   the device-side schedule (the partial kernel's prologue)
//   copy.cuh       KV tile copies through the warps' cp.async rings, block-table reads
//   core_loop.cuh  the CUDA-core main loop's helpers (scores, P.V)
//   mma_loop.cuh   the tensor-core main loop (mma_tile: ldmatrix, mma.sync, the online softmax on fragments)
//   epilogue.cuh   the fused cross-program merge
// and kernel-body fragments, included inside the partial kernel below: core_loop_rows / _tile / _finish.cuh (the
// CUDA-core path's setup, per-tile softmax and end) and mma_loop_rows / _finish.cuh (the tensor-core path's). The
// kernel bodies are text rather than calls on purpose: NVVM optimizes a function before it inlines it, so moving
// any piece of a kernel body into a function, even a __forceinline__ one, changes the PTX the kernel compiles to
// (checked for every piece: the rows' setup, the per-tile softmax, the end merge, the empty program's state write),
// and ptxas's register allocation with it (the CUDA-core split-K kernel spilled on sm_80). The schedule is a
// function: it runs before the body and only its five integers reach it.
#include "config.cuh"
#include "ptx.cuh"
#include "convert.cuh"
#include "layout.cuh"
#include "state.cuh"

#if ATTNPLAN_KIND == ATTNPLAN_KIND_MERGE
// The separate merge: one CTA per output row (b, i, head) of the ragged workspace o [1, Q, H, U, D] / lse [1, Q, H,
// U] (strides in elements) into out [B, Q, H, D] (q's dtype) and out_lse [B, Q, H] (may be null); sinks [H] (may
// be null) join the denominator (state.cuh's contract). meta [2 B] is the partial kernel's table: row b's states are
// the slots [meta[b], meta[b] + meta[B + b]) (first[b], units[b]), merged in slot order; a row of a sequence with
// at most one unit exits (the partial kernel wrote it). MERGE_TEAMS teams of TEAM_THREADS threads.
// Launched with programmatic dependent launch after the partial kernel: it waits for the partial grid (and so for
// meta) first.
// One team (MERGE_TEAMS 1) merges the row with merge_row: no shared memory, no barrier. Several teams (2, 4 or 8:
// the host's merge_teams, for few rows of many splits, where one team walks ceil(n / MERGE_CHUNK) dependent memory
// round trips; H200, CUPTI: batch 1, 1 KV head, 8 query heads = 8 rows, 128 splits: 9.3 us, 8 round trips per
// CTA): team k merges the contiguous splits [k per, min(n, (k + 1) per)) of the row's n, per = ceil(n / MERGE_TEAMS)
// rounded up to whole chunks (a team's range may be empty), with merge_accumulate (M_k, tot_k, a_k; an empty range
// or one of empty splits gives M_k = -inf, tot_k = 0, a_k = 0). The teams publish them in the dynamic shared memory
// (a_k[HEAD_DIM] of every team, then M_k, tot_k: MERGE_TEAMS x (HEAD_DIM + 2) fp32), one barrier, and team 0
// combines them in team order 0 .. MERGE_TEAMS-1 (deterministic: same inputs and teams, same bits):
//   M = max_k M_k;  tot = sum_k exp(M_k - M) tot_k;  a = sum_k exp(M_k - M) a_k  (teams with M_k = -inf skipped;
//   a NaN M_k makes M NaN: never an empty row)
// and writes the row with merge_write (M = -inf: o = 0, lse = -inf or the sink; the sink joins once, here).
extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
attnplan_merge(const float *__restrict__ o, const float *__restrict__ lse, const int *__restrict__ meta,
               elem_t *__restrict__ out, float *__restrict__ out_lse, const float *__restrict__ sinks, int batch,
               int q_len, int num_heads,
               i64 o_si, i64 o_sh, i64 o_ss,
               i64 l_si, i64 l_sh, i64 l_ss,
               i64 out_sb, i64 out_si, i64 out_sh,
               i64 ol_sb, i64 ol_si, i64 ol_sh) {
    pdl_wait();  // launched early (programmatic dependent launch): the partial states and meta are complete after this
    const i64 row = (i64)blockIdx.x + (i64)gridDim.x * (i64)blockIdx.y;
    const int hh = (int)(row % num_heads);
    const int i = (int)((row / num_heads) % q_len);
    const int b = (int)(row / ((i64)num_heads * q_len));
    const int units = meta[batch + b];  // units[b]
    if (units <= 1) return;  // written by the partial kernel (the whole CTA: one row)
    const i64 first = meta[b];    // first[b]
    const float *lr = lse + (i64)i * l_si + (i64)hh * l_sh + first * l_ss;
    const float *orow = o + (i64)i * o_si + (i64)hh * o_sh + first * o_ss;
    const float *sink = sinks ? sinks + hh : nullptr;
    elem_t *outp = out + (i64)b * out_sb + (i64)i * out_si + (i64)hh * out_sh;
    float *olp = out_lse ? out_lse + (i64)b * ol_sb + (i64)i * ol_si + (i64)hh * ol_sh : nullptr;
    // the states come from an earlier launch: plain loads
    if constexpr (MERGE_TEAMS == 1) {
        merge_row<TEAM_THREADS, MERGE_CHUNK, false>(lr, l_ss, orow, o_ss, units, sink, outp, olp, threadIdx.x);
    } else {  // several teams per row: ranges of the splits, combined in team order
        ATTNPLAN_DYNAMIC_SMEM(smem);
        float *sm_a = reinterpret_cast<float *>(smem);  // [MERGE_TEAMS][HEAD_DIM]
        float *sm_m = sm_a + MERGE_TEAMS * HEAD_DIM, *sm_tot = sm_m + MERGE_TEAMS;
        const int team = threadIdx.x / TEAM_THREADS, t = threadIdx.x % TEAM_THREADS;
        const int per = ((units + MERGE_TEAMS - 1) / MERGE_TEAMS + MERGE_CHUNK - 1) / MERGE_CHUNK * MERGE_CHUNK;
        const int s0 = cmin(units, team * per), cnt = cmin(units - s0, per);
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
        for (int k = 0; k < MERGE_TEAMS; ++k) M = fmax_nan(M, lds<float>(sm_m + k));
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
#include "schedule.cuh"
#include "copy.cuh"
#include "core_loop.cuh"
#include "mma_loop.cuh"
#include "epilogue.cuh"

#if ATTNPLAN_KIND == ATTNPLAN_KIND_SINGLE
#define ATTNPLAN_ENTRY attnplan_decode_single
#else
#define ATTNPLAN_ENTRY attnplan_decode_partial
#endif

// The scheduled partial kernel (KIND 0) or the single pass (KIND 1) over q [B, Q, Hq, D], the KV cache (contiguous
// [B, T, Hkv, D], or paged [pages, PAGE, Hkv, D] through block_table [B, max_pages]) and seq_lens [B]. Strides in
// elements: q _sb, _si, _sh; k / v _s0 sequence or page, _s1 token, _sh head; the block table's rows bt_sb (unit
// column stride); out [B, Q, Hq, D] and out_lse [B, Q, Hq] _sb, _si, _sh (unit last stride); the workspace o [1, Q,
// Hq, U, D] / lse [1, Q, Hq, U] _si, _sh, _ss = slot. scale_log2 = sm_scale log2(e), softcap_log2 = cap log2(e).
// The schedule (schedule.cuh): granule, max_units_per_seq, batch, min_unit_granules, balanced (targets not all zero)
// and targets [64], the plan's table; meta [2 B] is written by program 0 for the separate merge (null otherwise),
// counters [(B + U) Hkv] are the fused merge's (groups', then teams'; zero at rest; null otherwise). The single pass
// reads granule, max_units_per_seq (1), o_ss and l_ss (0) as its one split's chunk arithmetic and nothing else of the
// schedule or the workspace: the parameters it reads come first, in the order they had before the schedule (its PTX and
// registers are the same; parameter order moves ptxas's register allocation). last_page (pages - 1 of a paged cache,
// 0 and never read for a contiguous one) comes after the schedule's and the workspace's: every page index read from
// the block table is clamped into [0, last_page] (copy.cuh, page_at), so a bad entry reads a wrong page, never
// outside the cache. capacity (the tokens a sequence of the cache holds: block_table columns x PAGE, or the
// contiguous cache's token axis) comes after it: every length read from seq_lens is clamped into [0, capacity]
// (schedule.cuh, seq_len_at), so a length beyond the cache reads the clamped span, never outside the cache.
// spread_slots (last of all; 0 = none) bounds the slots a batch of at most 32 spreads its units over
// (attnplan.schedule.slot_unit's window: the host's spread_slots / spread_window, 2 programs per SM, for plans that
// may see long-tailed batches); where the units fill the window they are packed.
// out_lse, sinks [Hq], k_scale / v_scale [Hkv] may be null. Grid (1, Hkv, units), or the unit-major program index
// u Hkv + h along x.
#if ATTNPLAN_KIND == ATTNPLAN_KIND_PARTIAL
// The partial kernel's end, out of line: the rows of the program (rows_out.cuh) from the KV warps' states in shared
// memory. The schedule's prologue (schedule_unit) is out of line too: inlined, the two would share the kernel's
// register allocation with the main loop, which then grew by 6-48 registers (sm_90 and sm_80 compiles: the fp8
// tensor-core kernel 168 -> 174, the fused merge's 161 -> 209, one program per SM less), although neither runs
// inside the loop; as calls (once per program each) the loop compiles as in the single pass.
__device__ __noinline__ void write_rows(const unsigned char *smem, int tid, float vscale, const float *row_sinks, int h,
                                        bool direct, elem_t *ob, i64 osi, i64 osh, float *lb, i64 lsi, i64 lsh,
                                        float *wb, i64 o_si, i64 o_sh, float *wlb, i64 l_si, i64 l_sh) {
    const int hb = h * GROUP;
    const float *sm_acc = reinterpret_cast<const float *>(smem);  // [NWARPS][RT][HEAD_DIM]
    const float *sm_m = sm_acc + NWARPS * RT * HEAD_DIM;          // [NWARPS][RT]
    const float *sm_l = sm_m + NWARPS * RT;                       // [NWARPS][RT]
#include "rows_out.cuh"
}
#else  // the single pass writes its rows in place (named only in its discarded branch)
__device__ __noinline__ void write_rows(const unsigned char *smem, int tid, float vscale, const float *row_sinks, int h,
                                        bool direct, elem_t *ob, i64 osi, i64 osh, float *lb, i64 lsi, i64 lsh,
                                        float *wb, i64 o_si, i64 o_sh, float *wlb, i64 l_si, i64 l_sh);
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS_PER_SM)
ATTNPLAN_ENTRY(const elem_t *__restrict__ q, const kv_t *__restrict__ kc, const kv_t *__restrict__ vc,
               const int *__restrict__ seq_lens, const int *__restrict__ block_table,
               elem_t *__restrict__ out, float *__restrict__ out_lse, const float *__restrict__ sinks,
               const float *__restrict__ k_scale, const float *__restrict__ v_scale,
               float scale_log2, float softcap_log2, int granule, int max_units_per_seq, int num_kv_heads,
               int window_left,
               i64 q_sb, i64 q_si, i64 q_sh,
               i64 k_s0, i64 k_s1, i64 k_sh,
               i64 v_s0, i64 v_s1, i64 v_sh,
               i64 bt_sb,
               i64 out_sb, i64 out_si, i64 out_sh, i64 o_ss,
               i64 ol_sb, i64 ol_si, i64 ol_sh, i64 l_ss,
               const int *__restrict__ targets, int *__restrict__ meta, int *__restrict__ counters,
               float *__restrict__ ws_o, float *__restrict__ ws_lse, int batch, int min_unit_granules, int balanced,
               i64 o_si, i64 o_sh,
               i64 l_si, i64 l_sh,
               int last_page, int capacity, int spread_slots) {
    ATTNPLAN_DYNAMIC_SMEM(smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // program -> (unit u, kv head h); the unit's sequence b and token range [cs, ce); direct: the sequence has one
    // unit, its rows go to out / out_lse (q's dtype, the sink joins), else to workspace slot u (fp32, never a sink:
    // with the fused merge `sinks` is the merge's). The CUDA grid is (1, Hkv, units) or the unit-major program index
    // u Hkv + h along x (spec.partial_launch_config).
    // (a direct row r = i*GROUP + g at ob + i * osi + (hb + g) * osh, its lse at lb + i * lsi + (hb + g) * lsh; a
    // state row at ws_o + u * o_ss + i * o_si + (hb + g) * o_sh, its lse at ws_lse + u * l_ss + i * l_si + (hb + g) *
    // l_sh)
    int s, h, b, cs, ce, L;  // s: the single pass's split (0)
    bool direct = true;
    int first = 0, units_b = 1, unit_k = 0;  // the sequence's first workspace slot, units, this unit (fused merge)
    elem_t *__restrict__ ob;
    float *__restrict__ lb;
    float *__restrict__ wb = nullptr, *__restrict__ wlb = nullptr;
    if constexpr (KIND == ATTNPLAN_KIND_SINGLE) {
        // The single pass keeps the text it had as one split of the split kernel before the schedule (its grid (1,
        // Hkv, B), the split s = 0 of max_units_per_seq = 1, chunk arithmetic on granule, o_ss = l_ss = 0 from the
        // host): NVVM and ptxas compile it to the PTX and the registers measured then. Rewritten as u = b and [base,
        // L), the fp8 tensor-core single pass went from 168 to 174-176 registers on sm_90 (3 -> 2 programs per SM).
        if (gridDim.x == (unsigned)max_units_per_seq && gridDim.y == (unsigned)num_kv_heads) {
            s = (int)blockIdx.x;
            h = (int)blockIdx.y;
            b = (int)blockIdx.z;
        } else {
            const i64 lin = (i64)blockIdx.x + (i64)gridDim.x * ((i64)blockIdx.y + (i64)gridDim.y * (i64)blockIdx.z);
            s = (int)(lin % max_units_per_seq);
            h = (int)((lin / max_units_per_seq) % num_kv_heads);
            b = (int)(lin / max_units_per_seq / num_kv_heads);
        }
        L = seq_len_at(seq_lens, b, capacity);
        int base = 0;
        if constexpr (WINDOW) base = L - QLEN - window_left > 0 ? L - QLEN - window_left : 0;  // none before the window
        const i64 cs64 = (i64)base + (i64)s * granule;
        cs = L;
        ce = L;
        if (cs64 < (i64)L) {
            cs = (int)cs64;
            ce = (s == max_units_per_seq - 1) ? L : (int)(cs64 + granule < (i64)L ? cs64 + granule : (i64)L);
        }
        ob = out + (i64)b * out_sb + (i64)s * o_ss;
        lb = out_lse ? out_lse + (i64)b * ol_sb + (i64)s * l_ss : out_lse;
    } else {
        // the schedule's loads first (schedule.cuh, sched_loads): issued before the grid arithmetic and the call
        const SchedLoads pre = sched_loads(seq_lens, targets, batch, balanced != 0, lane);
        int u, slots;  // the program's unit slot of the grid's slots (schedule_unit may spread the units over them)
        if (gridDim.x == 1u && gridDim.y == (unsigned)num_kv_heads) {
            h = (int)blockIdx.y;
            u = (int)blockIdx.z;
            slots = (int)gridDim.z;
        } else {
            const int p = (int)blockIdx.x;
            u = p / num_kv_heads;
            h = p - u * num_kv_heads;
            slots = (int)gridDim.x / num_kv_heads;
        }
        if (spread_slots > 0 && slots > spread_slots) slots = spread_slots;  // the spread's window (slot_unit)
        const UnitInfo un = schedule_unit(seq_lens, meta, batch, u, slots, meta != nullptr && u == 0 && h == 0,
                                          window_left, granule, min_unit_granules, max_units_per_seq, balanced != 0,
                                          pre, smem, tid, capacity);
        if (un.b < 0) return;  // no unit for this slot: nothing to write
        u = un.u;
        b = un.b;
        first = un.first;
        units_b = un.units;
        unit_k = u - first;
        direct = units_b == 1;
        L = seq_len_at(seq_lens, b, capacity);  // the length the schedule read
        unit_range(un, u, L, window_left, granule, cs, ce);
        ob = out + (i64)b * out_sb;
        lb = out_lse ? out_lse + (i64)b * ol_sb : out_lse;
        wb = ws_o + (i64)u * o_ss;
        wlb = ws_lse + (i64)u * l_ss;
    }
    const i64 osi = out_si, osh = out_sh, lsi = ol_si, lsh = ol_sh;
    const int hb = h * GROUP;
    const float *__restrict__ row_sinks = direct ? sinks : nullptr;  // block-uniform
    // the fused merge of the group, once this program's state is written (every thread, every path; epilogue.cuh):
    // counters[b * Hkv + h] counts the group's units (or teams), and with more than FUSED_TEAM units team j's
    // counter is counters[(batch + first + j FUSED_TEAM) * Hkv + h], at its first unit's slot (SplitPlan.sync_words;
    // slots are unique, and not in sequence order). (Defined only when it is used: an unused capturing lambda changes
    // the PTX of the others.)
#if ATTNPLAN_MERGE
    auto merge_group = [&]() {
        elem_t *outb = out + (i64)b * out_sb + (i64)hb * out_sh;
        float *olb = out_lse ? out_lse + (i64)b * ol_sb + (i64)hb * ol_sh : nullptr;
        const float *sinkb = sinks ? sinks + hb : nullptr;
        const i64 team = (i64)batch + first + unit_k / FUSED_TEAM * FUSED_TEAM;
        fused_merge(smem, tid, units_b, unit_k, counters + ((i64)h + (i64)num_kv_heads * b),
                    counters + ((i64)h + (i64)num_kv_heads * team),
                    ws_o + (i64)first * o_ss + (i64)hb * o_sh, o_si, o_sh, o_ss,
                    ws_lse + (i64)first * l_ss + (i64)hb * l_sh, l_si, l_sh, l_ss, outb, out_si, out_sh, olb, ol_si,
                    ol_sh, sinkb);
    };
#else
    auto merge_group = []() {};  // no fused merge
#endif

    if (cs >= ce) {  // empty program: read nothing, write the empty state of every row
        if (direct) {  // o = 0, lse = -inf or the sink
            for (int idx = tid; idx < R * HEAD_DIM; idx += NTHREADS) {
                const int rr = idx / HEAD_DIM, d = idx % HEAD_DIM;
                const int i = rr / GROUP, g = rr % GROUP;
                st_state(ob + (i64)i * osi + (i64)(hb + g) * osh + d, from_float(0.f));
            }
            if (lb) {
                for (int rr = tid; rr < R; rr += NTHREADS) {
                    const int i = rr / GROUP, g = rr % GROUP;
                    st_state(lb + (i64)i * lsi + (i64)(hb + g) * lsh, row_sinks ? row_sinks[h * GROUP + g] : NEG_INF);
                }
            }
        } else {  // never for a sequence of several units (each is non-empty); kept so the merge always counts
            for (int idx = tid; idx < R * HEAD_DIM; idx += NTHREADS) {
                const int rr = idx / HEAD_DIM, d = idx % HEAD_DIM;
                const int i = rr / GROUP, g = rr % GROUP;
                st_state(wb + (i64)i * o_si + (i64)(hb + g) * o_sh + d, 0.f);
            }
            for (int rr = tid; rr < R; rr += NTHREADS) {
                const int i = rr / GROUP, g = rr % GROUP;
                st_state(wlb + (i64)i * l_si + (i64)(hb + g) * l_sh, NEG_INF);
            }
            if constexpr (FUSED) merge_group();
        }
        return;
    }

    const int rg = warp / NWK, kw = warp % NWK;  // row group; KV warp within it
    const int slot = lane / LPT, lv = lane % LPT;

    float qscale = scale_log2, vscale = 1.f;
    if constexpr (KV8) {
        // dequantization folded into the score scale and into the normalized output (the CUDA-core decoder's
        // values carry 2^-8, FP8_UNIT, taken out exactly where they are used: tile_scores, rows_out.cuh; the
        // tensor-core path's fp16 values are exact). Bounded on the host: sm_scale x k_scale fits fp32 after log2(e)
        qscale *= k_scale[h];
        vscale = v_scale[h];
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
    if (PAGE_WIN) pw.init(btb, TILE_START(0), TILE_START(1) - TILE_START(0), start, end, last_page, lane);
    {  // prologue: block-table entries of the first STAGES-1 tiles together, then their copies
        int pgp[STAGES - 1][NPG];
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (PAGE_WIN)
                pw.tile(pgp[st], st, lane);
            else
                load_pages(pgp[st], btb, TILE_START(st), start, end, last_page, cid);
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
    if (!PAGE_WIN) load_pages(pg, btb, TILE_START(STAGES - 1), start, end, last_page, cid);

    int stage_c = 0, stage_w = STAGES - 1;
    for (int it = 0; it < my_n; ++it) {
        if (PAGE_WIN) pw.tile(pg, it + STAGES - 1, lane);
        if (it + STAGES - 1 < my_n)
            issue_tile(ring + stage_w * STAGE_BYTES, kb, vb, TILE_START(it + STAGES - 1), start, end, pg, lc, k_s0,
                       k_s1, v_s0, v_s1, cid);
        cp_async_commit();
        if (!PAGE_WIN)  // used one iteration later
            load_pages(pg, btb, TILE_START(it + STAGES), start, end, last_page, cid);
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int ts = TILE_START(it);
        const unsigned char *ks = ring + stage_c * STAGE_BYTES;
        const unsigned char *vs = ks + KT_BYTES;

#if ATTNPLAN_MMA
        if constexpr (QLEN > 1) {  // the tile may hold positions some rows see and others do not: NaN isolation
            const bool masked = ts < max_lo || ts + TILE > min_hi;  // warp-uniform
            unsigned long long vnan = 0ull;
            if (masked && v_tile_nonfinite(vs, lane)) {  // rare: V non-finite in this tile
                vnan = v_nan_marks(vs, ts, lo, hi, lane);
                __syncwarp();
                v_tile_zero_nonfinite(const_cast<unsigned char *>(vs), lane);
                __syncwarp();
            }
            mma_tile(m, l, acc, qb, ks, vs, ts, lo, hi, masked, lane, rs, softcap_log2);
            if (vnan) apply_nan_marks(acc, vnan);
        } else {
            mma_tile(m, l, acc, qb, ks, vs, ts, lo, hi, ts < max_lo || ts + TILE > min_hi, lane, rs, softcap_log2);
        }
#else
#include "core_loop_tile.cuh"
#endif
        __syncwarp();  // every lane is done with this stage before it is refilled
        stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
        stage_w = stage_w + 1 == STAGES ? 0 : stage_w + 1;
    }
#undef TILE_START
    cp_async_wait<0>();
    // The merge kernel may launch once every program has read its KV (or exited): launched then, its CTAs wait
    // (griddepcontrol.wait: this grid complete, its memory visible) only through the programs' epilogues. Triggered
    // at the programs' start instead, they waited through the whole stream beside it, and one KV head's step (8/1/128
    // b1 128K paged, 256 units, 8 merge CTAs) took 2.6-2.8 us longer than with no early launch at all (an H100).
    if constexpr (!FUSED) pdl_launch_dependents();

    // ---- the warps' (m, l, acc) into shared memory (the rings are free now) ----
#if ATTNPLAN_MMA
#include "mma_loop_finish.cuh"
#else
#include "core_loop_finish.cuh"
#endif
    __syncthreads();

    if constexpr (KIND == ATTNPLAN_KIND_PARTIAL) {
        write_rows(smem, tid, vscale, row_sinks, h, direct, ob, osi, osh, lb, lsi, lsh, wb, o_si, o_sh, wlb, l_si, l_sh);
    } else {
#include "rows_out.cuh"
    }
    if constexpr (FUSED) {
        if (!direct) merge_group();
    }
}

#endif

#if ATTNPLAN_KIND == ATTNPLAN_KIND_PARTIAL && defined(ATTNPLAN_SCHEDULE_PROBE)
// The partial kernel's prologue alone (tests; the spec's probe flag): block k runs schedule_unit for grid slot
// probe_units[k] with the partial kernel's threads and writes res[8 k .. 8 k + 8) = (b, j, cs, ce, units[b], c,
// first[b], cb) of the unit that slot runs, or only b = -1 where it runs none; block 0 writes meta when it is not
// null. Lengths are clamped into [0, capacity] as in the partial kernel. slots: what the partial kernel passes
// schedule_unit (its grid's unit slots, bounded by spread_slots), 0 for a slot that is its unit.
extern "C" __global__ void __launch_bounds__(NTHREADS)
attnplan_schedule_probe(const int *__restrict__ seq_lens, const int *__restrict__ targets, int *__restrict__ meta,
                        const int *__restrict__ probe_units, int *__restrict__ res, int batch, int window_left,
                        int granule, int min_unit_granules, int max_units_per_seq, int balanced, int capacity,
                        int slots) {
    ATTNPLAN_DYNAMIC_SMEM(smem);
    const int tid = threadIdx.x, k = (int)blockIdx.x, u = probe_units[k];
    const SchedLoads pre = sched_loads(seq_lens, targets, batch, balanced != 0, tid & 31);
    const UnitInfo un = schedule_unit(seq_lens, meta, batch, u, slots, meta != nullptr && k == 0, window_left,
                                      granule, min_unit_granules, max_units_per_seq, balanced != 0, pre, smem, tid,
                                      capacity);
    if (tid != 0) return;
    int *r = res + 8 * (i64)k;
    r[0] = un.b;
    if (un.b < 0) return;
    int cs, ce;
    unit_range(un, un.u, seq_len_at(seq_lens, un.b, capacity), window_left, granule, cs, ce);
    r[1] = un.u - un.first;
    r[2] = cs;
    r[3] = ce;
    r[4] = un.units;
    r[5] = un.c;
    r[6] = un.first;
    r[7] = un.cb;
}
#endif
