// attnplan cuda_ptx: the kernel's layout, read once from the -D macros, checked against the host's.
//
// spec.py (KernelSpec) computes threads, the tile and the dynamic shared memory in one place and passes them as
// ATTNPLAN_THREADS / _TILE_TOKENS / _SMEM_BYTES; the constants below recompute them from the other macros and
// static_assert equality, so host and kernel cannot drift apart.
//
// Merge kernel (ATTNPLAN_KIND 2):
//   ATTNPLAN_MERGE_TEAMS merge teams per CTA: 1, 2, 4 or 8; each merges a range of the row's units, combined
//                        through shared memory (decode.cu, the merge kernel)
// Partial / single-pass kernel (ATTNPLAN_KIND 0 / 1):
//   ATTNPLAN_KV_FP8      1 = the KV cache is float8_e4m3fn (q fp16 / bf16), dequantized in the kernel with the
//                        per-KV-head k_scale / v_scale arguments
//   ATTNPLAN_GROUP       GQA group size (query heads per KV head)
//   ATTNPLAN_QLEN        queries per sequence
//   ATTNPLAN_PAGE_SIZE   tokens per page, 0 = contiguous cache
//   ATTNPLAN_KV_WARPS    warps per row group, taking different KV tiles of the chunk (split-K)
//   ATTNPLAN_ROW_GROUPS  warp sets that split the GQA-group x q_len rows
//   ATTNPLAN_STAGES      cp.async pipeline depth of each warp's ring
//   ATTNPLAN_PASSES      warp passes per KV tile (tensor cores: 16-token m-tiles per tile)
//   ATTNPLAN_WINDOW      1 = sliding window (window_left argument)
//   ATTNPLAN_SOFTCAP     1 = logits soft-cap (softcap_log2 argument)
//   ATTNPLAN_MMA         1 = the tensor-core path (mma.sync m16n8k16, mma_loop.cuh): fp16 / bf16 q, KV in q's
//                        dtype or fp8 e4m3fn, head_dim a multiple of 16; 0 = CUDA cores (core_loop.cuh)
//   ATTNPLAN_MERGE       1 = the fused cross-program merge inside the partial kernel (epilogue.cuh), 0 = none (the
//                        separate merge kernel follows, or single pass)
//   ATTNPLAN_FUSED_TEAM  with ATTNPLAN_MERGE 1: units per team of the fused merge's two levels (epilogue.cuh)
//   ATTNPLAN_TILE_TOKENS the host's tile, checked like _THREADS and _SMEM_BYTES
#pragma once

// merge kernels
#if ATTNPLAN_KIND == ATTNPLAN_KIND_MERGE
constexpr int MERGE_TEAMS = ATTNPLAN_MERGE_TEAMS;
static_assert(MERGE_TEAMS == 1 || MERGE_TEAMS == 2 || MERGE_TEAMS == 4 || MERGE_TEAMS == 8,
              "merge teams per CTA: 1, 2, 4 or 8");
constexpr int TEAM_THREADS = ((HEAD_DIM / 4 + 31) / 32) * 32;  // one row's merge team: 4 dims per thread, whole warps
constexpr int MERGE_THREADS = MERGE_TEAMS * TEAM_THREADS;
// splits whose o rows one thread loads before using any (merge_row's CHUNK): 16 at one warp per team (64 registers
// of float4), 8 at two (head_dim 256). 32 measured slower on an H200 (3.6 against 2.8 us at 16 splits, no gain at 32)
constexpr int MERGE_CHUNK = TEAM_THREADS == 32 ? 16 : 8;
constexpr int MERGE_SLOTS = (HEAD_DIM / 4 + TEAM_THREADS - 1) / TEAM_THREADS;  // 4-dim column slots per thread
// dynamic shared memory of the teams' combine: a_k[HEAD_DIM] of each team, then M_k, then tot_k (T > 1 only)
constexpr int MERGE_SMEM_BYTES = MERGE_TEAMS == 1 ? 0 : MERGE_TEAMS * (HEAD_DIM + 2) * 4;
static_assert(MERGE_THREADS == ATTNPLAN_THREADS, "host and kernel disagree on merge threads per block");
static_assert(MERGE_SMEM_BYTES == ATTNPLAN_SMEM_BYTES, "host and kernel disagree on dynamic shared memory");

#else
// partial / single-pass kernels
constexpr bool KV8 = ATTNPLAN_KV_FP8 != 0;
static_assert(!KV8 || DTYPE != 2, "an fp8 KV cache needs q in float16 or bfloat16");
typedef select_type<KV8, unsigned char, elem_t>::type kv_t;  // the KV cache's element
constexpr int KVEC = KV8 ? 16 : VEC;                            // KV elements per 16-byte vector
constexpr bool MMA = ATTNPLAN_MMA != 0;
static_assert(!MMA || DTYPE != 2, "the tensor-core path (ATTNPLAN_MMA) needs fp16 / bf16 q (KV in q's dtype or fp8)");
static_assert(!MMA || HEAD_DIM % 16 == 0, "the tensor-core path needs head_dim a multiple of 16");
constexpr bool WINDOW = ATTNPLAN_WINDOW != 0;
constexpr bool SOFTCAP = ATTNPLAN_SOFTCAP != 0;
constexpr int MERGE_MODE = ATTNPLAN_MERGE;  // 0 none, 1 fused
constexpr bool FUSED = MERGE_MODE == 1;
static_assert(MERGE_MODE == 0 || (FUSED && KIND == ATTNPLAN_KIND_PARTIAL),
              "ATTNPLAN_MERGE is 0, or 1: the fused merge, which belongs to the split partial kernel");
#ifdef ATTNPLAN_FUSED_TEAM
constexpr int FUSED_TEAM = ATTNPLAN_FUSED_TEAM;
#else
constexpr int FUSED_TEAM = 0;
#endif
static_assert(!FUSED || FUSED_TEAM >= 2, "the fused merge needs ATTNPLAN_FUSED_TEAM, at least 2 units per team");

// ---- a token row of K or V over the lanes (CUDA cores) ----
static_assert(HEAD_DIM % KVEC == 0, "head_dim must fill whole 16-byte KV vectors (a multiple of 16 for fp8)");
constexpr int DV = HEAD_DIM / KVEC;                 // 16-byte vectors per K/V row
constexpr int QPV = KVEC / VEC;                     // 16-byte q vectors per KV vector (2 for fp8)
constexpr int LPT = DV >= 32 ? 32 : pow2_ceil(DV);  // lanes per token row
constexpr int NV = (DV + LPT - 1) / LPT;            // 16-byte vectors per lane per row
constexpr int TPP = 32 / LPT;                       // tokens per warp pass
// MMA: the mma.sync input type is bf16 only for bf16 q with a bf16 cache; with an fp8 cache every mma is
// fp16 (K and V convert to fp16 exactly; bf16 q moves to fp16 with a power of two per n8-tile; P rounds to fp16)
constexpr bool MMA_BF16 = DTYPE == 1 && !KV8;

// ---- rows and warps: R = GROUP x QLEN rows r = i*GROUP + g (query i, head g of the group) in NRG row groups of
// RT rows, each row group NWK warps that take different KV tiles ----
constexpr int PASSES = ATTNPLAN_PASSES;             // MMA: 16-token m-tiles per tile
constexpr int TILE = PASSES * (MMA ? 16 : TPP);     // tokens per tile
constexpr int CH = TILE * DV;                       // 16-byte chunks per tile (K or V)
constexpr int GROUP = ATTNPLAN_GROUP;
constexpr int QLEN = ATTNPLAN_QLEN;
constexpr int R = GROUP * QLEN;                     // rows per program
constexpr int NRG = ATTNPLAN_ROW_GROUPS;
// rows per row group (MMA: whole n8-tiles, NTW of them per warp)
constexpr int RT = MMA ? 8 * (((R + NRG - 1) / NRG + 7) / 8) : (R + NRG - 1) / NRG;
constexpr int NTW = MMA ? RT / 8 : 1;               // MMA: n8-tiles (8 rows each) per warp
constexpr int KS = HEAD_DIM / 16;                   // MMA: k16-steps of QK^T = m16-tiles of O^T over head_dim
// MMA: ldmatrix.x4 per 16 tokens and KV tile: one covers 2 chunks (bf16 / fp16: one k16-step; fp8: two)
constexpr int NLD = (DV + 1) / 2;
constexpr int NWK = ATTNPLAN_KV_WARPS;              // warps per row group
constexpr int NWARPS = NRG * NWK;
constexpr int NTHREADS = 32 * NWARPS;
constexpr int STAGES = ATTNPLAN_STAGES;
constexpr int PAGE = ATTNPLAN_PAGE_SIZE;

// ---- a warp's ring: STAGES stages of a K tile and a V tile, TILE token rows of RS 16-byte chunks each; MMA rows
// are XOR-swizzled (DV % 8 == 0) or padded to an odd count, so the 8 row addresses of each 8x8 ldmatrix read hit 8
// different 16-byte bank groups ----
constexpr int RS = !MMA ? DV : (DV % 8 == 0 ? DV : (DV | 1));
constexpr bool SWZ = MMA && DV % 8 == 0;
constexpr int NCOPY = 32;                           // threads filling one ring (a warp)
constexpr int CPL = (CH + NCOPY - 1) / NCOPY;       // chunks per copying thread per tile (K or V)
constexpr bool ONE_PAGE = PAGE >= TILE;             // a (T-aligned) tile lies in one page
// MMA with pages smaller than the tile (e.g. fp8's 32-token tiles over 16-token pages): when a copy round's
// tokens (NCOPY / DV) divide the page, chunk k of every copying thread lies in page PSLOT(k) of the tile, so
// the tile needs its TILE / PAGE block-table entries (the same for every lane) instead of one per chunk
constexpr bool PAGE_REG = MMA && PAGE > 0 && !ONE_PAGE && NCOPY % DV == 0 && PAGE % (NCOPY / DV) == 0;
constexpr int NPG = ONE_PAGE ? 1 : (PAGE_REG ? TILE / PAGE : CPL);  // block-table entries per copying thread per tile
__host__ __device__ constexpr int pslot(int k) { return PAGE_REG ? k * (NCOPY / DV) / PAGE : k; }
constexpr int KT_BYTES = TILE * RS * 16;            // the K (or V) tile of a stage
constexpr int STAGE_BYTES = 2 * KT_BYTES;           // K + V of one tile
// Byte offset of 16-byte chunk v of token row `tok` in a K or V tile of a ring stage (see RS / SWZ).
__host__ __device__ constexpr int chunk_off(int tok, int v) { return (tok * RS + (SWZ ? (v ^ (tok & 7)) : v)) * 16; }

// ---- dynamic shared memory: the rings, reused at the end for the warps' merge: [NWARPS][RT][HEAD_DIM] acc, then
// [NWARPS][RT] m and l (the loops' *_finish.cuh fragments write it, decode.cu merges it) ----
constexpr int RING_BYTES = NWARPS * STAGES * STAGE_BYTES;
constexpr int EPI_BYTES = NWARPS * RT * (HEAD_DIM + 2) * 4;
constexpr int SMEM_BYTES = cmax(RING_BYTES, EPI_BYTES);
static_assert(MERGE_MODE == 0 || SMEM_BYTES >= 16, "the in-kernel merge broadcasts through shared memory word 0");

static_assert((PASSES & (PASSES - 1)) == 0, "passes must be a power of two");
static_assert(STAGES >= 2, "the cp.async ring needs at least two stages");
static_assert(PAGE == 0 || (PAGE & (PAGE - 1)) == 0, "page size must be a power of two");
static_assert(NRG * RT >= R && NRG >= 1 && NWK >= 1, "bad row groups / warps");
static_assert(SMEM_BYTES == ATTNPLAN_SMEM_BYTES, "host and kernel disagree on dynamic shared memory");
static_assert(TILE == ATTNPLAN_TILE_TOKENS, "host and kernel disagree on the tile size");
static_assert(NTHREADS == ATTNPLAN_THREADS, "host and kernel disagree on threads per block");

// fp8 tensor-core kernels state minBlocksPerMultiprocessor = 1: left open, ptxas (NVRTC 13.5) trades small spills for
// register occupancy (96 / 128 / 168 registers = 5 / 4 / 3 programs of 128 threads) that the shared memory (64 KB per
// program: 3 per H200 SM, 2 per A100 SM) never allows; stated, it allocates without spilling (head_dim 128, sm_90:
// 130-165 registers, still 3 programs per SM). So does the bf16 / fp16 tensor-core single pass at head_dim 64 with two
// n8-tiles a warp (9-16 rows) and several queries: open, 128 registers and a 16-byte spill (q_len 2-8, contiguous; at
// q_len 1, 127 registers and none); stated, 146-154 and none (3 programs per SM either way; graph-replayed on an H100,
// contiguous steps 1.5-3.7% faster, paged ones unchanged). The other bf16 / fp16 and CUDA-core kernels keep the
// measured open form (0: no minimum), the fused merge's too since its merge is a call (epilogue.cuh): stated there, it
// gave 184 registers (2 programs of 128 threads per SM), open 164.
constexpr int MIN_CTAS_PER_SM =
    (MMA && (KV8 || (KIND == ATTNPLAN_KIND_SINGLE && HEAD_DIM == 64 && NTW == 2 && QLEN > 1))) ? 1 : 0;

// Visible range [lo, hi) of query i inside the chunk [cs, ce) (empty when lo >= hi): query i sits at position
// p = L - QLEN + i and sees positions <= p, and >= p - window_left with a window.
__device__ __forceinline__ void query_range(int i, int L, int cs, int ce, int window_left, int &lo, int &hi) {
    const int p = L - QLEN + i;  // the query's own position
    hi = p + 1 < ce ? p + 1 : ce;
    lo = cs;
    if constexpr (WINDOW) lo = p - window_left > cs ? p - window_left : cs;
}
#endif
