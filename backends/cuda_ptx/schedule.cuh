// attnplan cuda_ptx: the device-side split-KV schedule (attnplan/schedule.py), the partial kernel's prologue.
//
// A plan fixes the grid, the granule and the targets table; at every launch each program of the partial kernel
// computes, from the live seq_lens in device memory, which (sequence b, unit j, token range) its unit u is. The
// integers are attnplan.schedule.schedule_units's with the capacity given, bit for bit (32-bit: the planner keeps a
// batch's capacity below 2^31 granules; ceil(a / b) is (a - 1) / b + 1 for a >= 1, so no sum passes int32). Every
// length is read through seq_len_at, clamped into [0, capacity] (the tokens a sequence of the cache holds), so L
// below is the clamped length wherever it appears and every program derives the same schedule from it:
//   base = max(0, L - QLEN - window_left) with a window, else 0;  nb = ceil((L - base) / granule)  (0 if L <= base)
//   T = sum_b nb, nb_max = max_b nb;  t = targets[k + 32 * tail], k = min(bit_length(T + T/2), 31),
//   tail = 2 T < B nb_max
//   c = max(min_unit_granules, ceil(T / t)), or min_unit_granules when t == 0 (or the schedule is not balanced)
//   units of b: uu = min(max_units_per_seq, ceil(nb / c)), cb = ceil(nb / uu), units = ceil(nb / cb); nb == 0: one
//   (empty) unit, cb = 0;  unit j of b: [base + j cb G, +cb G) within L, in slot first[b] + j, where first is the
//   exclusive prefix sum of units in (cb descending, b) order for a batch of at most LONGEST_FIRST_BATCH (32;
//   longest units first: a grid fills the SMs in slot order) and in b order above
// (FlashAttention-3's hopper/flash_prepare_scheduler.cu makes the same kind of choice on the device, in a kernel of
// its own.) A batch of at most 32 sequences is scheduled by each warp alone, one sequence per lane, without shared
// memory or barriers (schedule_unit_warp). Otherwise every thread of the program runs it (schedule_unit_chunked): the
// batch is read in chunks of SCHED_CHUNK sequences, SCHED_PER consecutive ones per thread (one chunk, one read of
// seq_lens, for batch <= 256 whatever the program's threads), the total and the longest by warp shuffles and one
// exchange through shared memory, the prefix sum by a warp scan and the warps' totals (index order). The scan stops
// at the chunk holding u, except in the program that writes meta (first[b] at b, units[b] at batch + b: the separate
// merge's table), which scans the whole batch.
//
// Shared memory: SCHED_WORDS int32 words at the start of the dynamic shared memory, free again when schedule_unit
// returns (its last barrier is after every read), so the rings may reuse them at once.
#pragma once

constexpr int SCHED_BATCH = 256;                          // sequences one chunk covers at least
constexpr int SCHED_PER = cmax(1, SCHED_BATCH / NTHREADS);  // consecutive sequences per thread per chunk
constexpr int SCHED_CHUNK = NTHREADS * SCHED_PER;           // sequences per chunk
// attnplan.schedule.LONGEST_FIRST_BATCH: slots longest units first up to it, the batches of the one-warp path (a lane
// per sequence; schedule_unit_warp orders them, schedule_unit_chunked keeps index order)
constexpr int LONGEST_FIRST_BATCH = 32;
static_assert(LONGEST_FIRST_BATCH == 32, "the one-warp path orders a batch longest units first, the chunked path not");
// words: the warps' granule sums and maxima, the warps' unit totals, then the result (b, first[b], units[b], cb)
constexpr int SCHED_WORDS = 3 * NWARPS + 4;
static_assert(SMEM_BYTES >= 4 * SCHED_WORDS, "the schedule's exchange lives in the dynamic shared memory");

// The schedule of one unit: its sequence b (-1: u is past the batch's units), the slot of the sequence's first unit
// (first[b]) and unit count, its granules per unit cb (0 for an empty sequence) and the batch's granules per unit c.
struct UnitInfo {
    int b, first, units, cb, c, u;  // u: the unit this program runs (its slot, or spread: attnplan.schedule.slot_unit)
};

// ceil(a / b) for a >= 1, b >= 1, as (a - 1) / b + 1 (no sum passes int32): unsigned, since every operand of the
// schedule is non-negative (a signed division compiles to ~10 more instructions of sign handling, on the
// prologue's dependent path before the first KV tile)
__device__ __forceinline__ int ceil_div_pos(int a, int b) { return (int)((unsigned)(a - 1) / (unsigned)b) + 1; }

// Sequence b's length as every kernel reads it: seq_lens[b] clamped into [0, capacity] (capacity: the tokens a
// sequence of the cache holds, block_table columns x PAGE or the contiguous cache's token axis). A length written on
// the device after plan() (or found at a CUDA-graph replay) beyond the cache then runs attention over the clamped
// span instead of reading outside the cache; a negative one is an empty sequence.
__device__ __forceinline__ int clamp_len(int len, int capacity) { return cmin(cmax(len, 0), capacity); }

__device__ __forceinline__ int seq_len_at(const int *__restrict__ seq_lens, int b, int capacity) {
    return clamp_len(seq_lens[b], capacity);
}

// Sequence of length L: its first visible position (base) and the granules of its span [base, L).
__device__ __forceinline__ int seq_granules(int L, int window_left, int granule, int &base) {
    base = 0;
    if constexpr (WINDOW) base = L - QLEN - window_left > 0 ? L - QLEN - window_left : 0;
    const int n = L - base;
    return n > 0 ? ceil_div_pos(n, granule) : 0;
}

// Units of a sequence of nb granules when units hold c granules (at most max_per units), and cb, the granules of
// each: equal sizes, every unit non-empty; an empty sequence has one empty unit (cb = 0).
__device__ __forceinline__ int seq_units(int nb, int c, int max_per, int &cb) {
    if (nb <= 0) {
        cb = 0;
        return 1;
    }
    int uu = ceil_div_pos(nb, c);
    if (uu > max_per) uu = max_per;
    cb = ceil_div_pos(nb, uu);
    return ceil_div_pos(nb, cb);
}

// The batch's granules per unit c from its total T and its longest sequence nb_max (the targets table's bucket).
// t_lo / t_hi: this lane's entries lane and 32 + lane of the 64 targets, loaded with seq_lens (a load after the
// bucket is known would be one more dependent DRAM round trip before the first KV tile); total and nb_max are
// warp-uniform, so the entry comes by one shuffle.
__device__ __forceinline__ int sched_granules_per_unit(int t_lo, int t_hi, int total, int nb_max, int batch,
                                                       int min_c) {
    const unsigned t3 = (unsigned)total + ((unsigned)total >> 1);  // T + T/2 < 3 * 2^30: no unsigned overflow
    int k = 32 - __clz((int)t3);  // bit_length(T + T/2) (__clz(0) = 32)
    if (k > 31) k = 31;
    if (2 * (i64)total < (i64)batch * nb_max) k += 32;  // a long-tailed batch: the second table
    const int t = __shfl_sync(FULL_MASK, k >= 32 ? t_hi : t_lo, k & 31);
    int c = min_c;
    if (t > 0 && total > 0) {
        const int per = ceil_div_pos(total, t);
        if (per > c) c = per;
    }
    return c;
}

// attnplan.schedule.slot_unit: the unit that grid slot `slot` of `slots` runs when the batch has `total` < slots
// units (total: none), the working programs spread over the grid's order. 64-bit products: a plan may hold more
// slots than 2^15. Out of line: its 64-bit divisions are ~80 instructions that a grid of exactly its units (every
// uniform live plan) never runs, and inline they sat between the prologue's load and its use, one more cold
// instruction fetch on the path to the first KV tile.
__device__ __noinline__ int spread_slot(int slot, int total, int slots) {
    const i64 v = ((i64)slot * total + slots - 1) / slots;
    return (v < total && (v * slots) / total == slot) ? (int)v : total;
}

// The schedule of unit u for a batch of at most 32 sequences: each warp computes all of it by itself, lane i holding
// sequence i (the total and the longest by redux.sync, the prefix sum by a warp scan, u's sequence by a ballot), with
// no shared memory and no barrier. The general path's exchange, three barriers and chunk loop were ~290 instructions
// per warp on the dependent path before the first KV tile (ncu on an H200, b1 4K: 1.36M instructions against 1.05M
// without a schedule, 14.1 us against 11.5). The same integers as schedule_unit_chunked's; meta by warp 0 of the
// writing program (write_meta). len: this lane's length as sched_loads read it (clamped here); t_lo / t_hi:
// sched_granules_per_unit's.
// slots > 0: u is the program's grid slot, and the program runs unit slot_unit(u, U, grid slots, 1, window) of the
// batch's U units: the caller passes slots = min(grid slots, window) (attnplan.schedule.slot_unit: the working
// programs spread over the first `slots` slots, or packed where U >= slots; a program past them exits).
__device__ __forceinline__ UnitInfo schedule_unit_warp(int len, int *__restrict__ meta, int batch, int u, int slots,
                                                       bool write_meta, int window_left, int granule, int min_c,
                                                       int max_per, bool balanced, int t_lo, int t_hi, int lane,
                                                       int capacity) {
    const bool in = lane < batch;
    int base;
    const int nb = in ? seq_granules(clamp_len(len, capacity), window_left, granule, base) : 0;
    int c = min_c;
    if (balanced)  // the total and the longest: one redux.sync each (sm_80), not five shuffle steps
        c = sched_granules_per_unit(t_lo, t_hi, __reduce_add_sync(FULL_MASK, nb), __reduce_max_sync(FULL_MASK, nb),
                                    batch, min_c);
    int cb = 0;
    const int un = in ? seq_units(nb, c, max_per, cb) : 0;
    int start = 0;
    // slots, longest units first (attnplan.schedule.first_slots): where the lanes' cb differ, start = the units of
    // the lanes before this one in (cb descending, lane) order, one broadcast pair per lane (the lanes past the
    // batch hold un = 0); where they are all equal (every uniform batch), that order is the lanes' own and the
    // prefix sum is a warp scan. Lanes past the batch take cb = 0 in the test: the batch's cb are all >= 0.
    if (__reduce_min_sync(FULL_MASK, in ? cb : 0x7fffffff) != __reduce_max_sync(FULL_MASK, cb)) {
#pragma unroll 8
        for (int i = 0; i < 32; ++i) {
            const int cbi = __shfl_sync(FULL_MASK, cb, i), uni = __shfl_sync(FULL_MASK, un, i);
            start += (cbi > cb || (cbi == cb && i < lane)) ? uni : 0;
        }
    } else {
        int incl = un;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, incl, off);
            if (lane >= off) incl += y;
        }
        start = incl - un;
    }
    const int incl = start + un;
    if (write_meta && in) {
        meta[lane] = start;
        meta[batch + lane] = un;
    }
    const int total = __reduce_add_sync(FULL_MASK, un);  // U (lanes past the batch add 0)
    if (slots > total) u = spread_slot(u, total, slots);  // else packed: U <= the grid's slots (the plan's bound)
    const unsigned hit = __ballot_sync(FULL_MASK, in && u >= start && u < incl);
    const int src = hit ? __ffs((int)hit) - 1 : 0;
    UnitInfo r;
    r.b = hit ? src : -1;
    r.first = __shfl_sync(FULL_MASK, start, src);
    r.units = __shfl_sync(FULL_MASK, un, src);
    r.cb = __shfl_sync(FULL_MASK, cb, src);
    r.c = c;
    r.u = u;
    return r;
}

// The prologue's first loads: this lane's length seq_lens[lane] (raw; clamped where it is used) for a batch of at
// most 32 and the targets table (t_lo / t_hi, sched_granules_per_unit's), issued by the partial kernel before any
// branch or call. Inside the schedule they were issued after two cold instruction fetches of ~0.3 us each (ncu, H100,
// b1 1K); issued first, their DRAM round trip overlaps the kernel's own code up to the call, whose by-value
// arguments then wait for it (the profile's largest prologue stall after the change: one round trip, unhidden).
struct SchedLoads {
    int len, t_lo, t_hi;
};

__device__ __forceinline__ SchedLoads sched_loads(const int *__restrict__ seq_lens, const int *__restrict__ targets,
                                                  int batch, bool balanced, int lane) {
    SchedLoads r{0, 0, 0};
    if (batch <= LONGEST_FIRST_BATCH && lane < batch) r.len = seq_lens[lane];
    if (balanced) {
        r.t_lo = targets[lane];
        r.t_hi = targets[32 + lane];
    }
    return r;
}

// The schedule of a batch of more than 32 sequences (schedule_unit's, every thread of the program: it has
// barriers). Out of line, so the warp path of small batches is the only code between the call and its return.
__device__ __noinline__ UnitInfo schedule_unit_chunked(const int *__restrict__ seq_lens, int *__restrict__ meta,
                                                          int batch, int u, bool write_meta, int window_left,
                                                          int granule, int min_c, int max_per, bool balanced,
                                                          int t_lo, int t_hi, unsigned char *smem, int tid,
                                                          int capacity) {
    const int lane = tid & 31, warp = tid >> 5;
    int *w_sum = reinterpret_cast<int *>(smem), *w_max = w_sum + NWARPS, *w_units = w_max + NWARPS;
    int *res = w_units + NWARPS;  // b, first[b], units[b], cb
    if (tid == 0) sts(res, -1);  // published by the first barrier below
    // this thread's sequences of the first chunk: their granules (kept for the scan when one chunk is the batch)
    int nbv[SCHED_PER];
#pragma unroll
    for (int e = 0; e < SCHED_PER; ++e) {
        const int i = tid * SCHED_PER + e;
        int base;
        nbv[e] = i < batch ? seq_granules(seq_len_at(seq_lens, i, capacity), window_left, granule, base) : 0;
    }
    int c = min_c;
    if (balanced) {  // the batch's total granules and longest sequence
        int s = 0, m = 0;
#pragma unroll
        for (int e = 0; e < SCHED_PER; ++e) {
            s += nbv[e];
            m = nbv[e] > m ? nbv[e] : m;
        }
        for (int c0 = SCHED_CHUNK; c0 < batch; c0 += SCHED_CHUNK) {
#pragma unroll
            for (int e = 0; e < SCHED_PER; ++e) {
                const int i = c0 + tid * SCHED_PER + e;
                if (i < batch) {
                    int base;
                    const int nb = seq_granules(seq_len_at(seq_lens, i, capacity), window_left, granule, base);
                    s += nb;
                    m = nb > m ? nb : m;
                }
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_xor_sync(FULL_MASK, s, off);
            const int o = __shfl_xor_sync(FULL_MASK, m, off);
            m = o > m ? o : m;
        }
        if (lane == 0) {
            sts(w_sum + warp, s);
            sts(w_max + warp, m);
        }
        __syncthreads();
        s = 0;
        m = 0;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            s += lds<int>(w_sum + w);
            const int o = lds<int>(w_max + w);
            m = o > m ? o : m;
        }
        c = sched_granules_per_unit(t_lo, t_hi, s, m, batch, min_c);
    }
    // units per sequence and their exclusive prefix sum, chunk by chunk, until the chunk holding u
    int running = 0;
    for (int c0 = 0; c0 < batch; c0 += SCHED_CHUNK) {
        int un[SCHED_PER], cbv[SCHED_PER] = {}, mine = 0;
#pragma unroll
        for (int e = 0; e < SCHED_PER; ++e) {
            const int i = c0 + tid * SCHED_PER + e;
            int nb = nbv[e];
            if (c0 > 0) {
                int base;
                nb = i < batch ? seq_granules(seq_len_at(seq_lens, i, capacity), window_left, granule, base) : 0;
            }
            un[e] = i < batch ? seq_units(nb, c, max_per, cbv[e]) : 0;
            mine += un[e];
        }
        int incl = mine;  // inclusive scan over the warp, then the warps before this one
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, incl, off);
            if (lane >= off) incl += y;
        }
        if (lane == 31) sts(w_units + warp, incl);
        __syncthreads();
        int start = running + incl - mine, total = 0;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const int t = lds<int>(w_units + w);
            start += w < warp ? t : 0;
            total += t;
        }
#pragma unroll
        for (int e = 0; e < SCHED_PER; ++e) {
            const int i = c0 + tid * SCHED_PER + e;
            if (i < batch) {
                if (write_meta) {
                    meta[i] = start;
                    meta[batch + i] = un[e];
                }
                if (u >= start && u < start + un[e]) {  // exactly one thread of the batch
                    sts(res, i);
                    sts(res + 1, start);
                    sts(res + 2, un[e]);
                    sts(res + 3, cbv[e]);
                }
                start += un[e];
            }
        }
        running += total;
        __syncthreads();
        if (lds<int>(res) >= 0 && !write_meta) break;  // program-uniform: read after the barrier
    }
    UnitInfo r;
    r.b = lds<int>(res);
    r.first = lds<int>(res + 1);
    r.units = lds<int>(res + 2);
    r.cb = lds<int>(res + 3);
    r.c = c;
    r.u = u;  // no spread here: u is the slot (the scan stops at u's chunk, before U is known)
    __syncthreads();  // every read of the exchange is done: the rings may overwrite it
    return r;
}

// The schedule of unit u (module comment). Called by every thread of the program (the chunked path has barriers);
// pre: sched_loads's, issued at the kernel's start; tid the thread's index; meta written (all batch sequences) when
// write_meta; balanced: the plan's targets are not all zero; slots: the grid's unit slots, or fewer (the spread's
// window; 0: u is the unit itself; a batch of at most 32 spreads its units over them); capacity: the clamp of every
// length (seq_len_at).
// Out of line (one call per program): inlined, it moved the partial kernel's main-loop register allocation (see
// decode.cu, write_rows).
__device__ __noinline__ UnitInfo schedule_unit(const int *__restrict__ seq_lens, int *__restrict__ meta, int batch,
                                                  int u, int slots, bool write_meta, int window_left, int granule,
                                                  int min_c, int max_per, bool balanced, SchedLoads pre,
                                                  unsigned char *smem, int tid, int capacity) {
    if (batch > LONGEST_FIRST_BATCH)
        return schedule_unit_chunked(seq_lens, meta, batch, u, write_meta, window_left, granule, min_c, max_per,
                                     balanced, pre.t_lo, pre.t_hi, smem, tid, capacity);
    return schedule_unit_warp(pre.len, meta, batch, u, slots, write_meta && (tid >> 5) == 0, window_left, granule,
                              min_c, max_per, balanced, pre.t_lo, pre.t_hi, tid & 31, capacity);
}

// Token range [cs, ce) of unit u (schedule_unit's un) of a sequence of length L (seq_len_at's, clamped, as the
// schedule read it): unit j = u - first covers
// [base + j cb G, min(base + (j + 1) cb G, L)); an empty sequence's one unit is [L, L).
__device__ __forceinline__ void unit_range(const UnitInfo &un, int u, int L, int window_left, int granule, int &cs,
                                           int &ce) {
    int base;
    seq_granules(L, window_left, granule, base);
    cs = L;
    ce = L;
    if (un.cb > 0) {
        const int span = un.cb * granule;
        cs = base + (u - un.first) * span;
        ce = L - cs > span ? cs + span : L;
    }
}
