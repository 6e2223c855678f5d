// attnplan cuda_ptx: KV tile copies. Each warp streams its tiles of the chunk through a private STAGES-deep ring
// of K and V tiles in shared memory with 16-byte cp.async (zero-filled outside the visible range), reading the
// block table of a paged cache ahead of the copies.
//
//  * Tiles are TILE-aligned token ranges starting at or below the first visible position (positions outside a
//    row's range are masked by the loops), so a tile never straddles a page boundary; warp kw of a row group takes
//    tiles kw, kw + NWK, ... (split-K).
//  * Paged caches: where a tile's block-table entries are the same for every lane (a tile in one page, or
//    PAGE_REG), each warp holds its next 32 entries across its lanes and loads the 32 after them 16-32 tiles ahead
//    (PageWindow; FlashInfer's batch decode kernel likewise computes the offsets of a run of tiles ahead, into
//    shared memory); a tile's entries reach the lanes by shuffle. Tensor-core kernels form each tile's K / V base
//    pointer once and add each chunk's 32-bit lane offset to it (opaque()).
//  * Every page index read from the block table is clamped into [0, last_page] (last_page = pages - 1; page_at),
//    as the reference does: a bad entry reads a wrong page of the cache, never memory outside it. PageWindow
//    clamps once per 32 entries, where a lane loads its entry of the window.
//  * 64-bit element offsets wherever a page, sequence or head index multiplies a stride; a chunk's offset inside
//    its tile or page is 32-bit (the host checks (TILE - 1) x token stride + head_dim < 2^31).
#pragma once

constexpr int PAGE_DIV = PAGE > 0 ? PAGE : 1;  // the page size as a divisor (contiguous caches never divide by it)

// Block-table entry `idx` of a sequence's row `btb` as a page index clamped into [0, last_page] (negative -> 0,
// past the cache -> last_page). Every read of the block table goes through it.
__device__ __forceinline__ int page_at(const int *__restrict__ btb, int idx, int last_page) {
    return cmin(cmax(__ldg(btb + idx), 0), last_page);
}

// The block-table window (PAGE_WIN: one page per tile, or PAGE_REG's TILE / PAGE pages; either way the same
// entries for every lane). A copying unit (a warp) visits its tiles n = 0, 1, 2, ... (first token base + n * step)
// and their page slots q = n * NPG + j. Lane L holds the entry of slot 32 * b + L of the current batch b in `cur`
// and of batch b + 1 in `nxt`; a tile's entries reach every lane by shuffle, and batch b + 2 is loaded when b + 1
// becomes current, 32 / NPG tiles before its first use. Loaded one tile ahead instead, the copies waited on that
// load at 1-2 programs per SM (ncu on an H200: the paged loop's top stall at batch 16, 1K tokens). 0 outside
// [start, end); entries clamped (page_at).
constexpr bool PAGE_WIN = PAGE > 0 && (ONE_PAGE || (PAGE_REG && NPG <= 32));  // a tile's slots in one batch
static_assert(!PAGE_WIN || 32 % NPG == 0, "a tile's page slots must lie in one batch of 32");
struct PageWindow {
    const int *btb;
    int base, step, start, end, last_page, cur, nxt;
    __device__ __forceinline__ int entry(int q) const {
        const int t0 = base + (q / NPG) * step + (q % NPG) * PAGE;  // first token of slot q's page (in the tile)
        return (t0 < end && t0 + PAGE > start) ? page_at(btb, t0 / PAGE_DIV, last_page) : 0;
    }
    __device__ __forceinline__ void init(const int *b, int base_, int step_, int start_, int end_, int last_page_,
                                         int lane) {
        btb = b, base = base_, step = step_, start = start_, end = end_, last_page = last_page_;
        cur = entry(lane);
        nxt = entry(32 + lane);
    }
    // The entries of tile n; called for n = 0, 1, 2, ... in order, by every lane of the warp together.
    __device__ __forceinline__ void tile(int (&pg)[NPG], int n, int lane) {
        const int q0 = n * NPG;
        if (n > 0 && (q0 & 31) == 0) {  // warp-uniform
            cur = nxt;
            nxt = entry(q0 + 32 + lane);
        }
#pragma unroll
        for (int j = 0; j < NPG; ++j) pg[j] = __shfl_sync(FULL_MASK, cur, (q0 + j) & 31);
    }
};

// Block-table entries for the chunks thread `cid` copies of tile `ts` (first token), clamped (page_at); 0 outside
// [start, end).
__device__ __forceinline__ void load_pages(int (&pg)[NPG], const int *__restrict__ btb, int ts, int start, int end,
                                           int last_page, int cid) {
    if constexpr (PAGE > 0) {
        if (ONE_PAGE) {
            pg[0] = (ts < end && ts + TILE > start) ? page_at(btb, ts / PAGE_DIV, last_page) : 0;
        } else if (PAGE_REG) {
#pragma unroll
            for (int j = 0; j < NPG; ++j) {  // page j of the tile: tokens [t0, t0 + PAGE)
                const int t0 = ts + j * PAGE;
                pg[j] = (t0 < end && t0 + PAGE > start) ? page_at(btb, t0 / PAGE_DIV, last_page) : 0;
            }
        } else {
#pragma unroll
            for (int k = 0; k < NPG; ++k) {
                const int c = cid + NCOPY * k;
                const int t = ts + c / DV;
                const bool used = (CH % NCOPY == 0 || c < CH) && t < end && t >= start;
                pg[k] = used ? page_at(btb, t / PAGE_DIV, last_page) : 0;
            }
        }
    }
}

// Per-thread constants of the tile copies: chunk k of copying thread `cid` is token tok[k] of the tile,
// vector v of that row, at element offset off[k] from the tile's base (token 0 of the tile; for pages
// smaller than the tile, token 0 of the chunk's page). Tiles start at multiples of TILE (and of PAGE
// when PAGE < TILE), which the host checks, so these do not depend on the tile.
// fp8 tensor-core path (LC_COMPACT): a copy round of NCOPY threads covers TPR whole token rows, so thread
// `cid`'s chunks are one column v of tokens tok0 + k*TPR: the token is computed at issue time, the ring
// offsets repeat per XOR-swizzle phase (NSW of them, the rest a constant apart) and the global offsets per
// row within a page (NKO: with pages smaller than the tile the rows restart every PAGE / TPR chunks). This
// keeps the fp8 kernel's registers for its conversions (head_dim 128, 16-token pages: 11 instead of 32).
constexpr bool LC_COMPACT = MMA && KV8 && NCOPY % DV == 0;
constexpr int TPR = NCOPY % DV == 0 ? NCOPY / DV : 1;                       // tokens per copy round
constexpr int NSW = LC_COMPACT && SWZ && TPR < 8 ? cmin(CPL, 8 / TPR) : 1;  // swizzle phases of tok0 + k*TPR
constexpr int NKO = LC_COMPACT && PAGE > 0 && !ONE_PAGE ? cmin(CPL, cmax(1, PAGE / TPR)) : CPL;  // distinct rows
struct LaneCopies {
    int tok[LC_COMPACT ? 1 : CPL];
    int koff[NKO], voff[NKO];  // < 2^31: the host checks (TILE - 1) x token stride + head_dim
    int soff[LC_COMPACT ? NSW : (MMA ? CPL : 1)];  // MMA: byte offset in the stage's K / V tile (chunk_off)
};

__device__ __forceinline__ int lc_tok(const LaneCopies &lc, int k) {
    return LC_COMPACT ? lc.tok[0] + k * TPR : lc.tok[k];
}
__device__ __forceinline__ int lc_soff(const LaneCopies &lc, int k) {
    return LC_COMPACT ? lc.soff[k % NSW] + (k / NSW) * (NSW * TPR * RS * 16) : lc.soff[MMA ? k : 0];
}

__device__ __forceinline__ void lane_copies(LaneCopies &lc, i64 k_s1, i64 v_s1, int cid) {
    constexpr int N = LC_COMPACT ? cmax(NKO, NSW) : CPL;  // LC_COMPACT: the first chunks hold every distinct offset
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int c = cid + NCOPY * k;
        const int tok = c / DV, v = c % DV;
        const int row = (PAGE > 0 && !ONE_PAGE) ? (tok & (PAGE - 1)) : tok;
        if (k < (LC_COMPACT ? 1 : CPL))
            lc.tok[LC_COMPACT ? 0 : k] = (CH % NCOPY == 0 || c < CH) ? tok : (1 << 30);  // past CH: never valid
        if (k < NKO) {
            lc.koff[k % NKO] = (int)((i64)row * k_s1 + v * KVEC);
            lc.voff[k % NKO] = (int)((i64)row * v_s1 + v * KVEC);
        }
        if (MMA && k < (LC_COMPACT ? NSW : CPL))
            lc.soff[k % (LC_COMPACT ? NSW : CPL)] = chunk_off(tok < TILE ? tok : 0, v);
    }
}

// A tile base pointer the compiler must keep as computed (ptx.cuh, pin): the tile's base pointers are formed once
// per tile and each chunk's source is one wide add of its 32-bit lane offset. Without it, ptxas (register-capped
// at 3 programs per SM) re-derived every chunk's address from the kernel parameter: a constant-bank load, then 4
// dependent integer instructions before each cp.async (ncu on an H200: the paged single pass's top loop stall,
// short scoreboard on those adds). Tensor-core kernels only: the CUDA-core ones hold more live registers per
// tile, and there the pinned pointers made ptxas spill under sm_80's 128-register cap.
template <typename T>
__device__ __forceinline__ const T *opaque(const T *p) {
    if constexpr (MMA) p = pin(p);
    return p;
}

// Issue the cp.async copies of thread `cid`'s chunks of one K tile and one V tile into a ring stage
// (no commit). Chunks of tokens before `start` or at / past `end` are zero-filled without reading
// global memory.
__device__ __forceinline__ void issue_tile(unsigned char *stage, const kv_t *__restrict__ kb,
                                           const kv_t *__restrict__ vb, int ts, int start, int end,
                                           const int (&pg)[NPG], const LaneCopies &lc, i64 k_s0, i64 k_s1,
                                           i64 v_s0, i64 v_s1, int cid) {
    const int first = start - ts, avail = end - ts;  // tile tokens [first, avail) are read
    const kv_t *kt = kb, *vt = vb;
    if constexpr (PAGE > 0) {
        if (ONE_PAGE) {
            const i64 base_row = (i64)(ts & (PAGE - 1));
            kt = kb + (i64)pg[0] * k_s0 + base_row * k_s1;
            vt = vb + (i64)pg[0] * v_s0 + base_row * v_s1;
        }
    } else {
        kt = kb + (i64)ts * k_s1;
        vt = vb + (i64)ts * v_s1;
    }
    kt = opaque(kt);
    vt = opaque(vt);
    const kv_t *kp[PAGE_REG ? NPG : 1], *vp[PAGE_REG ? NPG : 1];  // PAGE_REG: the tile's pages, once per tile
#pragma unroll
    for (int j = 0; j < (PAGE_REG ? NPG : 0); ++j) {
        kp[j] = opaque(kb + (i64)pg[j] * k_s0);
        vp[j] = opaque(vb + (i64)pg[j] * v_s0);
    }
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const int c = cid + NCOPY * k;
        if (CH % NCOPY == 0 || c < CH) {
            const bool valid = lc_tok(lc, k) >= first && lc_tok(lc, k) < avail;
            const kv_t *ksrc = kt, *vsrc = vt;
            if constexpr (PAGE > 0) {
                if (PAGE_REG) {
                    ksrc = kp[PAGE_REG ? pslot(k) : 0];
                    vsrc = vp[PAGE_REG ? pslot(k) : 0];
                } else if (!ONE_PAGE) {
                    ksrc = kb + (i64)pg[k] * k_s0;
                    vsrc = vb + (i64)pg[k] * v_s0;
                }
            }
            const int so = MMA ? lc_soff(lc, k) : c * 16;
            // an invalid chunk reads nothing (src-size 0); its address is the chunk's page / tile base, in range
            cp_async16(stage + so, valid ? (const void *)(ksrc + lc.koff[k % NKO]) : (const void *)ksrc, valid);
            cp_async16(stage + KT_BYTES + so, valid ? (const void *)(vsrc + lc.voff[k % NKO]) : (const void *)vsrc,
                       valid);
        }
    }
}
