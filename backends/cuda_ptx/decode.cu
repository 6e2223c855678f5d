// attnplan cuda_ptx backend: split-KV ("Flash-Decoding") decode attention kernels.
//
// Compiled at run time by NVRTC (backends/cuda_ptx/nvrtc.py) once per specialization; the host
// (backends/cuda_ptx/launch.py, KernelSpec.defines) passes every compile-time constant as a -D macro:
//
//   ATTNPLAN_KIND        0 = split partial (writes PartialState), 1 = single pass (writes out, lse),
//                        2 = merge
//   ATTNPLAN_DTYPE       0 = float16, 1 = bfloat16, 2 = float32 (q and out; also the KV cache unless fp8)
//   ATTNPLAN_KV_FP8      1 = the KV cache is float8_e4m3fn (q fp16/bf16), dequantized in the kernel
//                        with the per-KV-head k_scale / v_scale arguments         [partial / single]
//   ATTNPLAN_HEAD_DIM    head_dim (multiple of 8; of 16 with an fp8 cache)
//   ATTNPLAN_GROUP       GQA group size (query heads per KV head)          [partial / single]
//   ATTNPLAN_QLEN        queries per sequence                               [partial / single]
//   ATTNPLAN_PAGE_SIZE   tokens per page, 0 = contiguous cache              [partial / single]
//   ATTNPLAN_KV_WARPS    warps per row group, taking different KV tiles of the chunk  [partial / single]
//   ATTNPLAN_ROW_GROUPS  warp sets that split the GQA-group x q_len rows    [partial / single]
//   ATTNPLAN_STAGES      cp.async pipeline depth of each warp's ring          [partial / single]
//   ATTNPLAN_PASSES      warp passes per KV tile                            [partial / single]
//   ATTNPLAN_WINDOW      1 = sliding window (window_left argument)          [partial / single]
//   ATTNPLAN_SOFTCAP     1 = logits soft-cap (softcap_log2 argument)        [partial / single]
//   ATTNPLAN_MMA         1 = tensor-core split-K path (mma.sync m16n8k16, see "Method"): fp16 / bf16 q,
//                        KV in q's dtype or fp8 e4m3fn, head_dim a multiple of 16, split-K; PASSES is then
//                        the 16-token m-tiles of a warp's KV tile                [partial / single]
//   ATTNPLAN_MERGE       the cross-program merge inside the partial kernel (see "Method, cross-program merge"):
//                        0 = none (the merge kernel follows), 1 = fused                        [partial]
//   ATTNPLAN_MERGE_TEAMS merge teams per merge-kernel CTA: 1 (default), 2, 4 or 8; each merges a range of the
//                        row's splits, combined through shared memory (see the merge kernel)   [merge]
//   ATTNPLAN_SMEM_BYTES, ATTNPLAN_TILE_TOKENS, ATTNPLAN_THREADS: the host's own arithmetic, checked
//                        against the kernel's by static_assert (a mismatch fails compilation).
//
// No #include: only NVRTC built-ins, so no CUDA toolkit headers are needed at run time. fp16/bf16
// conversions are inline PTX (cvt), which needs sm_80 or newer; fp8 e4m3fn is decoded with integer
// ops and the fp16 conversion on the CUDA-core path (no cuda_fp8.h, same code on every architecture),
// and with cvt.rn.f16x2.e4m3x2 on the tensor-core path from sm_89 on (the integer decoder below sm_89).
//
// ATTNPLAN_HOST_EMULATION (tests only): the same source compiles as host C++ against
// emulation/simt.h, which runs every CUDA thread as a fiber so the kernels' indexing, masking and
// merging can be executed on a CPU (backends/cuda_ptx/emulate.py). Only the inline-PTX helpers below
// have host twins; the kernels themselves are the same text.
//
// Kernel contract (attnplan/backends/base.py): the program (CTA) for split s, KV head h, sequence b
// serves every query head h*GROUP .. h*GROUP+GROUP-1 and all QLEN queries of b. Its chunk is
// [base + s*chunk_size, min(base + (s+1)*chunk_size, L)), L = seq_lens[b], and the last split runs on
// to L; base = 0, or with a sliding window max(0, L - QLEN - window_left). Query i sits at position
// p = L - QLEN + i and sees positions <= p (and >= p - window_left with a window). A row with no
// visible position writes o = 0, lse = -inf. The partial kernel writes fp32 o (normalized) and
// natural-log lse at split index s (and, with an in-kernel merge, out and lse of the group at the end);
// the single-pass kernel writes out (q's dtype) and lse directly.
// Variants: the soft-cap c*tanh(score/c) is applied to the scaled scores; a sink logit z (per query
// head, natural log) joins the denominator in the single-pass epilogue and the merge only (partial
// states never include it): lse' = logaddexp(lse, z), o' = o * exp(lse - lse'). An fp8 cache holds
// K/k_scale[h] and V/v_scale[h]: k_scale[h] is folded into q's score scale, v_scale[h] into the
// program's normalized output (so lse and the merge never see it).
//
// Method, cross-program merge (seed 000's split-K "cost 1": the global reduction, by another kernel or
// inside this one; "cost 3": atomics make the reduction order, hence the rounding, run-dependent; peers:
// FlashInfer's merge_states / FlashAttention-2's split-KV combine, both separate kernels). One per-row code,
// merge_row (merge_accumulate, then merge_write), serves the merge kernel and the fused merge: lanes take the
// splits for the lse max and sum (warp shuffles), each thread 4 head_dim columns whose o loads of 8 (4) splits
// are in flight together, splits summed in index order, empty splits (lse = -inf) weigh 0 and an all-empty row
// gives o = 0, lse = -inf, the sink joins the denominator once at the end (join_sink).
//  * ATTNPLAN_MERGE 0: the partial kernel writes its state; the merge kernel (KIND 2, PDL-launched) merges, one
//    merge_row team per row or, with few rows and many splits, ATTNPLAN_MERGE_TEAMS teams per row that each
//    accumulate a range of the splits (merge_accumulate) and combine through shared memory (see the kernel).
//  * fused (1): the counters argument holds one int32 completion counter per (sequence, KV head), zero before
//    the launch. After writing its split's state (every path: tensor-core or CUDA-core split-K, the empty
//    program), every thread fences its stores (__threadfence), a barrier gathers the program and one
//    thread counts it with atom.acq_rel.gpu add (release: cumulative over the program's stores the barrier
//    ordered before it; acquire: every program counted before has released its state). The program that
//    counts last sees the whole group written: it resets the counter to 0 (ready for the next launch and graph
//    replays) and merges the group's R rows over all num_splits splits in split order, its threads in teams of
//    one row's merge_row threads (fewer if the program has fewer warps: several slots per thread), the rows
//    spread over the teams, reading the states with ld.global.cg (L2, the coherence point; never L1 or the
//    non-coherent path), and writes out (q's dtype) and out_lse. Which program is last does not change the
//    result: deterministic. The merge is in the last program's critical path.
//
// Method, tensor-core path (ATTNPLAN_MMA=1; FlashAttention-2's register-level online softmax on mma
// fragments, FlashInfer's decode with tensor cores for GQA, PTX ISA "Matrix fragments for
// mma.m16n8k16"). Decode has few query rows, so the product is computed transposed ("swap AB"):
//  * S^T[tok, row] = K[tok, :] . Q^T[:, row] with mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: M = 16
//    KV tokens, N = 8 rows (GQA group x q_len rows r = i*GROUP + g, a warp holding NTW n8-tiles of them,
//    rows past R zero and masked), K-dim = 16 of head_dim. Q^T's B fragments sit in registers (raw q, loaded
//    once; sm_scale*log2(e) multiplies the fp32 scores); K's A fragments come from the warp's cp.async ring
//    with ldmatrix.x4. Lane (groupID g = lane/4, t = lane%4) holds S^T(tok g / g+8, rows 2t, 2t+1).
//  * Online softmax on those fragments, base 2, fp32: a row's tile max is the max over the lane's tokens and
//    a 3-step butterfly (xor 4, 8, 16) over the 8 lanes sharing the row; the accumulator is rescaled only
//    when the max grows; the row sums stay per lane (their tokens) and are summed across lanes once, at the end.
//  * O^T[d, row] += V^T[d, tok] . P^T[tok, row]: M = 16 head_dim columns, N = 8 rows, K-dim = 16 tokens.
//    V^T's A fragments: ldmatrix.x4.trans of the V tile. P^T's B fragments: P rounded to bf16 / fp16 (as
//    FlashAttention-2 does) and packed in the S^T fragment's layout (an 8x8 (token, row) matrix per half),
//    transposed across the warp with movmatrix.trans into (row g; tokens 2t, 2t+1 / +8). The O^T accumulator
//    fragments (d g / g+8, rows 2t, 2t+1) are fp32 registers; the warp merge at the end is split-K's.
//  * Ring rows of the MMA layout: RS 16-byte chunks per token (head_dim/8; padded to an odd count when not
//    a multiple of 8), chunk v of token t stored at column v ^ (t & 7) when unpadded (XOR swizzle): the 8
//    row addresses of each 8x8 ldmatrix read hit 8 different 16-byte bank groups either way.
//  * Per 16 tokens a warp issues head_dim/16 ldmatrix + NTW x head_dim/16 mma for each of QK^T and P.V,
//    instead of the CUDA-core path's per-lane dot products and 4-level shuffle reductions per token.
//  fp8 e4m3fn KV on the tensor cores (ATTNPLAN_KV_FP8 with ATTNPLAN_MMA): the same rings, masks, softmax,
//  P fragments and merge; only the K / V fragment loads and q's B fragments differ.
//  * The tiles stay fp8 in shared memory (cp.async 16-byte chunks = 16 dims of a token; RS = head_dim/16
//    chunks, swizzled as above when a multiple of 8, else padded to an odd count), so a stage of the bf16
//    default's bytes holds twice the tokens. They are converted in registers right after ldmatrix, not in a
//    16-bit shared-memory staging copy: that would add a shared-memory write + read of twice the tile's bytes
//    and a sync per tile to save nothing (the register conversion is one cvt per 2 values either way).
//  * ldmatrix moves b16 elements, i.e. byte pairs, which is all it needs to: the mma's K-dim (head_dim for
//    QK^T, tokens for P.V) and O^T's M-dim may be permuted freely if both operands / the output agree.
//    K: the bf16 path's ldmatrix.x4 addresses (tokens 0-7 | 8-15) x (chunks 2c | 2c+1) give lane (g, t) bytes
//    4t..4t+3 of tokens g / g+8 in chunks 2c / 2c+1, i.e. two k16-steps per x4 (head_dim/32 per 16 tokens);
//    k-indices 2t, 2t+1 are dims 4t, 4t+1 of the step and 2t+8, 2t+9 dims 4t+2, 4t+3, so cvt of the low / high
//    byte pair of a register is the A fragment's a0 / a2 (token g) or a1 / a3 (token g+8), and q's B
//    fragments are loaded in the same dim order (columns 16kk + 4t.. / 4t+2..).
//    V: ldmatrix.x4.trans with the same addresses gives lane (g, t) the pairs (dims 2g, 2g+1) of tokens 2t
//    and 2t+1 of a chunk; one prmt (bytes 0, 2, 1, 3) regroups them per dim into (dim 2g | dim 2g+1) x
//    (tokens 2t, 2t+1), the A fragment's rows g / g+8 (tokens 8-15 likewise for a2 / a3). So m16-tile md of
//    O^T holds head_dim columns 16md + 2g (row g) and 16md + 2g + 1 (row g+8): acc_col(), used by the end
//    merge. Tokens keep their order, so P^T's movmatrix fragments are the bf16 path's.
//  * e4m3 -> fp16 with cvt.rn.f16x2.e4m3x2 (sm_89+; one instruction per 2 values, exact: every e4m3fn value
//    is an fp16 normal or zero, NaN stays NaN). Below sm_89 (sm_80 / sm_86 compiles) the same helper is the
//    CUDA-core path's integer decoder (value x 2^-8 in fp16 bits), NaN codes set, and one exact mul.rn.f16x2 by
//    256; the host emulation runs that integer form as the cvt's twin. So the values, and the scales
//    (k_scale folded into the score scale, v_scale into the normalized output, FP8_UNIT = 1 here), are the
//    same on every architecture.
//  * Every fp8 mma is f16.f16 (K and V are exact in fp16), whatever q's dtype: P rounds to fp16 (2^-11, finer
//    than bf16's 2^-8), and bf16 q moves to fp16 once per program as q x 2^e, one power of two per n8-tile
//    putting the tile's largest |q| in [2^14, 2^15) (bf16's 8 significant bits fit fp16's 11 down to 2^-32 of
//    it; never an overflow), with 2^-e folded into that tile's score scale rs[nt]. This keeps bf16 q on the
//    one-cvt-per-2-values conversion; converting K to bf16 would take e4m3 -> f16x2 -> 2 x f32 -> bf16x2
//    (4 instructions per 2 values).
//  * Per 16 tokens and head_dim 128 a warp adds 64 cvt (32 for K, 32 for V) and 16 prmt (V) to the bf16 path's
//    instructions and issues half the ldmatrix; with 32-token tiles (below) its loop issues slightly fewer
//    instructions per token than the bf16 kernel while it reads half the bytes (sm_90 SASS, head_dim 128,
//    group 4: 717 / 771 per 32 tokens contiguous / 16-token pages, against bf16's 409 / 439 per 16).
//  * Tiles are sized in bytes (launch.py, MMA_TILE_BYTES): head_dim 128 fp8 takes 2 m-tiles (32 tokens) per
//    8 KB stage, so the bf16 default of 4 warps x 2 stages x 8 KB (64 KB of shared memory, 32 KB in flight)
//    keeps its bytes in flight with twice the tokens, and the online softmax's row-max shuffles and rescales
//    run once per 32 tokens.
//  * Registers: the conversions need some, so the fp8 kernels keep fewer copy constants (LC_COMPACT: a
//    lane's chunks are one column of tokens tok0 + k*TPR, offsets affine in k), load the block table once
//    per page of the tile when a 32-token tile spans 16-token pages (PAGE_REG, any MMA kernel: TILE / PAGE
//    warp-uniform entries instead of one per chunk) and state __launch_bounds__(threads, 1) (below).
//
// Method, CUDA-core path (FlashDecoding; FlashInfer's decode kernels for the CUDA-core layout):
//  * Rows r = i*GROUP + g (query i, head g of the group). Row groups of RT rows; each warp holds its
//    rows' q (pre-scaled by sm_scale*log2(e), and k_scale with fp8) in fp32 registers: the elements of
//    one 16-byte KV vector of head_dim per lane (8 for fp16/bf16, 4 for fp32, 16 for fp8).
//  * Tiles are TILE-aligned token ranges starting at or below the first visible position (positions
//    outside a row's range are masked), so a tile never straddles a page boundary. K and V go through
//    STAGES-deep shared-memory rings with 16-byte cp.async (zero-filled past the chunk).
//  * Paged caches (both paths): where a tile's block-table entries are the same for every lane (a tile in one
//    page, or PAGE_REG), each warp holds its next 32 entries across its lanes and loads the 32 after them
//    16-32 tiles ahead (PageWindow; FlashInfer's batch decode kernel likewise computes the offsets of a run of
//    tiles ahead, into shared memory); a tile's entries reach the lanes by shuffle. Tensor-core kernels form
//    each tile's K / V base pointer once and add each chunk's 32-bit lane offset to it (opaque()).
//  * Scores: each lane multiplies its head_dim slice, a butterfly over LPT lanes sums the slices.
//    Online softmax in base 2 (exp2), fp32 accumulation, rescale only when a row's max grows.
//  * Split-K inside the program: the warps of a row group take different KV tiles (kw, kw+KV_WARPS, ...)
//    through private per-warp rings, so no CTA barrier sits in the main loop; at the end the warps of a row
//    group merge their (m, l, acc) states through shared memory (2 __syncthreads).
//  * 64-bit element offsets everywhere a page/batch index multiplies a stride.

typedef long long i64;
typedef unsigned int u32;

#define ATTNPLAN_KIND_PARTIAL 0
#define ATTNPLAN_KIND_SINGLE 1
#define ATTNPLAN_KIND_MERGE 2

#if !defined(ATTNPLAN_KIND) || !defined(ATTNPLAN_DTYPE) || !defined(ATTNPLAN_HEAD_DIM)
#error "ATTNPLAN_KIND, ATTNPLAN_DTYPE and ATTNPLAN_HEAD_DIM must be defined (-D)"
#endif

#if ATTNPLAN_DTYPE == 2
typedef float elem_t;
#define VEC 4
#else
typedef unsigned short elem_t;
#define VEC 8
#endif

#ifndef ATTNPLAN_KV_FP8
#define ATTNPLAN_KV_FP8 0
#endif
#if ATTNPLAN_KV_FP8
#if ATTNPLAN_DTYPE == 2
#error "an fp8 KV cache needs q in float16 or bfloat16"
#endif
typedef unsigned char kv_t;
#define KVEC 16  // KV elements per 16-byte vector
#else
typedef elem_t kv_t;
#define KVEC VEC
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define QNAN_F (__int_as_float(0x7fffffff))
#define FULL_MASK 0xffffffffu
#define LN2_F 0.69314718055994530942f

constexpr int HEAD_DIM = ATTNPLAN_HEAD_DIM;
static_assert(HEAD_DIM % 8 == 0, "head_dim must be a multiple of 8");

__host__ __device__ constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------------
// conversions (no cuda_fp16.h / cuda_bf16.h / cuda_fp8.h)
// ---------------------------------------------------------------------------------------------
// two packed fp16 (low half first) -> two floats, exactly (subnormals included)
__device__ __forceinline__ void half2_to_float2(u32 w, float &a, float &b) {
#ifdef ATTNPLAN_HOST_EMULATION
    a = emu::half_to_float((unsigned short)(w & 0xffffu));
    b = emu::half_to_float((unsigned short)(w >> 16));
#else
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
        : "=f"(a), "=f"(b) : "r"(w));
#endif
}

__device__ __forceinline__ void unpack2(u32 w, float &a, float &b) {
#if ATTNPLAN_DTYPE == 1
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
#elif ATTNPLAN_DTYPE == 0
    half2_to_float2(w, a, b);
#else
    a = __uint_as_float(w);
    b = 0.f;
#endif
}

// one 16-byte vector of q's dtype -> VEC floats
__device__ __forceinline__ void unpack16(const uint4 u, float (&f)[VEC]) {
#if ATTNPLAN_DTYPE == 2
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
#else
    unpack2(u.x, f[0], f[1]); unpack2(u.y, f[2], f[3]);
    unpack2(u.z, f[4], f[5]); unpack2(u.w, f[6], f[7]);
#endif
}

#if ATTNPLAN_KV_FP8
// float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities,
// S.1111.111 (0x7f, 0xff) = NaN. Decoded exactly, but scaled by 2^-8: the 7 exponent + mantissa bits
// move under an fp16's sign into its low 4 exponent bits and top 3 mantissa bits, so the fp16 holds
// value x 2^-8 (fp16 bias 15 = 7 + 8; fp16 subnormals are exactly the e4m3 subnormals x 2^-8), and
// cvt.f32.f16 widens it exactly. FP8_UNIT = 2^8 is folded into k_scale and v_scale.
constexpr float FP8_UNIT = 256.f;

// 4 e4m3fn bytes (byte 0 first) -> 4 floats x 2^-8 (NaN codes not handled here: fp8x4_nan)
__device__ __forceinline__ void fp8x4_to_float(u32 w, float &a, float &b, float &c, float &d) {
    const u32 lo = __byte_perm(w, 0u, 0x1404u);  // byte 0 -> bits 8..15, byte 1 -> bits 24..31, zeros
    const u32 hi = __byte_perm(w, 0u, 0x3424u);  // byte 2, byte 3 likewise
    half2_to_float2((lo & 0x80008000u) | ((lo >> 1) & 0x3f803f80u), a, b);
    half2_to_float2((hi & 0x80008000u) | ((hi >> 1) & 0x3f803f80u), c, d);
}

// bit 7 of byte j set where byte j of w is a NaN code ((byte & 0x7f) == 0x7f; no carry crosses bytes)
__device__ __forceinline__ u32 fp8x4_nan(u32 w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// Tensor-core path: e4m3fn -> fp16 holding the exact value (unscaled: every e4m3fn value, subnormals
// included, is an fp16 normal number or zero; NaN codes give NaN).
// Integer twin of cvt.rn.f16x2.e4m3x2 (the sm_80 fallback and the host emulation's cvt): x holds one
// byte in bits 8..15 of each half (__byte_perm 0x1404 / 0x3424 of the bytes); the CUDA-core decoder's
// bit move gives value x 2^-8, the NaN codes are set to NaN, and one exact f16x2 multiply by 2^8
// (mul.rn.f16x2, fp16 subnormals supported) restores the value.
__device__ __forceinline__ u32 fp8x2_to_half2_int(u32 x) {
    u32 h = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
    h |= ((((x & 0x7f007f00u) + 0x01000100u) >> 15) & 0x00010001u) * 0x7fffu;  // (byte & 0x7f) == 0x7f: NaN
#ifdef ATTNPLAN_HOST_EMULATION
    const u32 lo = emu::float_to_half_rn(emu::half_to_float((unsigned short)(h & 0xffffu)) * 256.f);
    const u32 hi = emu::float_to_half_rn(emu::half_to_float((unsigned short)(h >> 16)) * 256.f);
    return lo | (hi << 16);
#else
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x5c005c00u));  // x {256, 256}
    return r;
#endif
}

// 4 e4m3fn bytes -> two f16x2 words: lo = bytes 0, 1 (byte 0 in the low half), hi = bytes 2, 3.
// sm_89+: cvt.rn.f16x2.e4m3x2 (PTX ISA: the upper byte of the .b16 source goes to the upper half).
__device__ __forceinline__ void fp8x4_to_half2x2(u32 w, u32 &lo, u32 &hi) {
#if defined(ATTNPLAN_HOST_EMULATION) || __CUDA_ARCH__ < 890
    lo = fp8x2_to_half2_int(__byte_perm(w, 0u, 0x1404u));
    hi = fp8x2_to_half2_int(__byte_perm(w, 0u, 0x3424u));
#else
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi) : "r"(w));
#endif
}
#endif

// one 16-byte vector of the KV cache -> KVEC floats (fp8: x 2^-8, see FP8_UNIT)
__device__ __forceinline__ void unpack_kv(const uint4 u, float (&f)[KVEC]) {
#if ATTNPLAN_KV_FP8
    fp8x4_to_float(u.x, f[0], f[1], f[2], f[3]);
    fp8x4_to_float(u.y, f[4], f[5], f[6], f[7]);
    fp8x4_to_float(u.z, f[8], f[9], f[10], f[11]);
    fp8x4_to_float(u.w, f[12], f[13], f[14], f[15]);
    const u32 n[4] = {fp8x4_nan(u.x), fp8x4_nan(u.y), fp8x4_nan(u.z), fp8x4_nan(u.w)};
    if ((n[0] | n[1] | n[2] | n[3]) != 0u) {  // rare: a NaN code
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (n[k] & (0x80u << (8 * j))) f[4 * k + j] = QNAN_F;
    }
#else
    unpack16(u, f);
#endif
}

__device__ __forceinline__ elem_t from_float(float x) {
#if ATTNPLAN_DTYPE == 2
    return x;
#elif defined(ATTNPLAN_HOST_EMULATION)
    return ATTNPLAN_DTYPE == 1 ? emu::float_to_bf16_rn(x) : emu::float_to_half_rn(x);
#elif ATTNPLAN_DTYPE == 1
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
#ifdef ATTNPLAN_HOST_EMULATION
    return emu::ex2_approx_ftz(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Programmatic dependent launch (sm_90+, PTX griddepcontrol): the partial kernel lets the merge kernel
// that follows it in the stream launch as soon as every partial CTA is resident; the merge kernel's
// first act is to wait for the partial grid to complete with its memory visible. Both are no-ops when the
// launch does not opt in (host: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) and below sm_90.
__device__ __forceinline__ void pdl_launch_dependents() {
#if !defined(ATTNPLAN_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if !defined(ATTNPLAN_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Shared-memory loads and stores; the host emulation checks them for races between warps and for accesses
// outside the launch's dynamic shared memory (simt.h), which it reports instead of making them.
template <class T>
__device__ __forceinline__ T lds(const void *p) {
#ifdef ATTNPLAN_HOST_EMULATION
    if (!emu::smem_access(p, sizeof(T), 0)) return T{};
#endif
    return *reinterpret_cast<const T *>(p);
}
template <class T>
__device__ __forceinline__ void sts(void *p, const T &v) {
#ifdef ATTNPLAN_HOST_EMULATION
    if (!emu::smem_access(p, sizeof(T), 1)) return;
#endif
    *reinterpret_cast<T *>(p) = v;
}

// ---------------------------------------------------------------------------------------------
// the merge math of the merge kernel and the in-kernel merges (one piece of code for one contract:
// attnplan.state.merge_states). The single-pass epilogue (finish_row) keeps its own inline sink join:
// calling join_sink there changes ptxas's allocation of the measured kernels (fp8 tensor-core sm_80: 158 -> 197
// registers) for the same arithmetic.
// ---------------------------------------------------------------------------------------------
constexpr int ROW_MERGE_THREADS = ((HEAD_DIM / 4 + 31) / 32) * 32;  // 4 dims per thread, whole warps

// Loads of partial states. CG (the in-kernel merges: states other programs of the running grid wrote):
// ld.global.cg, served by L2 (the coherence point), never by L1 or the non-coherent (__ldg) path, and
// volatile with a "memory" clobber so the compiler cannot move it above the completion counter's barrier.
// Otherwise (the merge kernel: the states come from an earlier launch) a plain load.
template <bool CG>
__device__ __forceinline__ float ld_state(const float *p) {
    if (!CG) return *p;
#ifdef ATTNPLAN_HOST_EMULATION
    return __ldcg(p);
#else
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
#endif
}
template <bool CG>
__device__ __forceinline__ float4 ld_state4(const float *p) {  // p 16-byte aligned
    if (!CG) return *reinterpret_cast<const float4 *>(p);
#ifdef ATTNPLAN_HOST_EMULATION
    return __ldcg(reinterpret_cast<const float4 *>(p));
#else
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
                 : "memory");
    return v;
#endif
}

// 4 consecutive output elements in q's dtype (p 8-byte aligned; 16-byte for fp32)
__device__ __forceinline__ void store4(elem_t *p, float a, float b, float c, float d) {
#if ATTNPLAN_DTYPE == 2
    float4 t; t.x = a; t.y = b; t.z = c; t.w = d;
    *reinterpret_cast<float4 *>(p) = t;
#else
    uint2 t;
    t.x = (u32)from_float(a) | ((u32)from_float(b) << 16);
    t.y = (u32)from_float(c) | ((u32)from_float(d) << 16);
    *reinterpret_cast<uint2 *>(p) = t;
#endif
}

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

// 4-dim column slots per thread of a merge team of TW threads (thread t owns d = 4 (t + k TW), k < slots)
template <int TW>
__host__ __device__ constexpr int merge_slots() { return (HEAD_DIM / 4 + TW - 1) / TW; }

// The per-row accumulation of every merge (merge_row, and the merge kernel's teams, each over its range of
// splits): the first n split states of one row, lse_s at lr[s * l_ss] and normalized o_s at orow[s * o_ss + d],
// into the running max M = max_s lse_s, the total weight tot = sum_s exp(lse_s - M) and the weighted column sums
// a = sum_s exp(lse_s - M) o_s (this thread's slots), splits summed in index order (deterministic). Empty splits
// (lse = -inf) weigh 0; every split empty (or n = 0): M = -inf, tot = 0, a = 0 (never -inf - (-inf)). Run by a
// team of TW threads (whole warps; t = the thread's index in the team), each owning the 4-dim slots
// d = 4 (t + k TW). Lanes take the splits (lane s, s + 32, ...): the max and the sum are warp reductions (every
// lane ends with M and tot); every warp of a team reduces the same splits by itself (no shared memory, no
// barrier). The o rows do not depend on the lse values, so the first CHUNK splits' o loads are issued together
// with the lse loads, and later chunks' CHUNK loads all before their use: up to CHUNK splits cost one memory
// round trip (results/2026-11-30-s4-call2: loading o only after the max took 4.1 us at b1 4K, 16 splits, against
// triton's 2.5, whose [splits, dims] block loads are all in flight; with this, 2.8 us in s4-call3). An empty
// split's o may be unwritten (poison): it is read but selected out, never multiplied in.
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
    M = ls0;
    for (int s = lane + 32; s < n; s += 32) M = fmaxf(M, ld_state<CG>(lr + (i64)s * l_ss));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, off));
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
// HEAD_DIM) in q's dtype and, if out_lse is given, *out_lse:
//   lse = M + log(tot);  o = a / tot;  M = -inf (every split empty): o = 0, lse = -inf
// then, with a sink logit z = *sink: lse' = logaddexp(lse, z), o' = o exp(lse - lse') (empty: o = 0, lse = z).
template <int TW>
__device__ __forceinline__ void merge_write(float M, float tot, const float (&a)[merge_slots<TW>()][4],
                                            const float *sink, elem_t *outp, float *out_lse, int t) {
    constexpr int NSLOT = merge_slots<TW>();
    if (M == NEG_INF) {  // every split empty: never -inf - (-inf)
#pragma unroll
        for (int k = 0; k < NSLOT; ++k)
            if (4 * (t + k * TW) < HEAD_DIM) store4(outp + 4 * (t + k * TW), 0.f, 0.f, 0.f, 0.f);
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
        if (d < HEAD_DIM) store4(outp + d, a[k][0] * inv, a[k][1] * inv, a[k][2] * inv, a[k][3] * inv);
    }
    if (t == 0 && out_lse) *out_lse = lse_n;
}

// Merge the first n split states of one row (merge_accumulate's layout and team) into outp / out_lse
// (merge_write): lse = logsumexp_s(lse_s); o = sum_s exp(lse_s - lse) o_s; every split empty: o = 0, lse = -inf;
// then the sink, if given. One team per row: the single-team merge kernel and the fused merge.
template <int TW, int CHUNK, bool CG>
__device__ __forceinline__ void merge_row(const float *lr, i64 l_ss, const float *orow, i64 o_ss, int n,
                                          const float *sink, elem_t *outp, float *out_lse, int t) {
    float M, tot, a[merge_slots<TW>()][4];
    merge_accumulate<TW, CHUNK, CG>(lr, l_ss, orow, o_ss, n, t, M, tot, a);
    merge_write<TW>(M, tot, a, sink, outp, out_lse, t);
}

#if ATTNPLAN_KIND != ATTNPLAN_KIND_MERGE
// =============================================================================================
// split partial / single-pass kernel
// =============================================================================================
#if !defined(ATTNPLAN_GROUP) || !defined(ATTNPLAN_QLEN) || !defined(ATTNPLAN_PAGE_SIZE) || \
    !defined(ATTNPLAN_KV_WARPS) || !defined(ATTNPLAN_ROW_GROUPS) || !defined(ATTNPLAN_STAGES) || \
    !defined(ATTNPLAN_PASSES)
#error "partial/single-pass kernels need ATTNPLAN_GROUP, _QLEN, _PAGE_SIZE, _KV_WARPS, _ROW_GROUPS, _STAGES, _PASSES"
#endif
#ifndef ATTNPLAN_WINDOW
#define ATTNPLAN_WINDOW 0
#endif
#ifndef ATTNPLAN_SOFTCAP
#define ATTNPLAN_SOFTCAP 0
#endif
#ifndef ATTNPLAN_MMA
#define ATTNPLAN_MMA 0
#endif
#if ATTNPLAN_MMA && ATTNPLAN_DTYPE == 2
#error "the tensor-core path (ATTNPLAN_MMA) needs fp16 / bf16 q (KV in q's dtype or fp8)"
#endif
#ifndef ATTNPLAN_MERGE
#define ATTNPLAN_MERGE 0
#endif
#if ATTNPLAN_MERGE && ATTNPLAN_KIND != ATTNPLAN_KIND_PARTIAL
#error "an in-kernel merge (ATTNPLAN_MERGE) belongs to the split partial kernel"
#endif

static_assert(HEAD_DIM % KVEC == 0, "head_dim must fill whole 16-byte KV vectors (a multiple of 16 for fp8)");
constexpr int DV = HEAD_DIM / KVEC;                 // 16-byte vectors per K/V row
constexpr int QPV = KVEC / VEC;                     // 16-byte q vectors per KV vector (2 for fp8)
constexpr int LPT = DV >= 32 ? 32 : pow2_ceil(DV);  // lanes per token row
constexpr int NV = (DV + LPT - 1) / LPT;            // 16-byte vectors per lane per row
constexpr int TPP = 32 / LPT;                       // tokens per warp pass
constexpr bool MMA = ATTNPLAN_MMA != 0;
constexpr bool KV8 = ATTNPLAN_KV_FP8 != 0;
// MMA: the mma.sync input type is bf16 only for bf16 q with a bf16 cache; with an fp8 cache every mma is
// fp16 (K and V convert to fp16 exactly; bf16 q moves to fp16 with a power of two per n8-tile; P rounds to fp16)
constexpr bool MMA_BF16 = ATTNPLAN_DTYPE == 1 && !KV8;
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
// ring row stride in 16-byte chunks; MMA rows are XOR-swizzled (DV % 8 == 0) or padded to an odd count
constexpr int RS = !MMA ? DV : (DV % 8 == 0 ? DV : (DV | 1));
constexpr bool SWZ = MMA && DV % 8 == 0;
constexpr int NWK = ATTNPLAN_KV_WARPS;              // warps per row group
constexpr int NWARPS = NRG * NWK;
constexpr int NTHREADS = 32 * NWARPS;
constexpr int STAGES = ATTNPLAN_STAGES;
constexpr int PAGE = ATTNPLAN_PAGE_SIZE;
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
constexpr int RING_BYTES = NWARPS * STAGES * STAGE_BYTES;
constexpr int EPI_BYTES = NWARPS * RT * (HEAD_DIM + 2) * 4;
constexpr int MERGE_MODE = ATTNPLAN_MERGE;          // 0 none, 1 fused (see "Method, cross-program merge")
constexpr int SMEM_BYTES = cmax(RING_BYTES, EPI_BYTES);
static_assert(MERGE_MODE == 0 || SMEM_BYTES >= 16, "the in-kernel merge broadcasts through shared memory word 0");

static_assert((PASSES & (PASSES - 1)) == 0, "passes must be a power of two");
static_assert(STAGES >= 2, "the cp.async ring needs at least two stages");
static_assert(PAGE == 0 || (PAGE & (PAGE - 1)) == 0, "page size must be a power of two");
static_assert(NRG * RT >= R && NRG >= 1 && NWK >= 1, "bad row groups / warps");
static_assert(!MMA || HEAD_DIM % 16 == 0, "the tensor-core path needs head_dim a multiple of 16");
#ifdef ATTNPLAN_SMEM_BYTES
static_assert(SMEM_BYTES == ATTNPLAN_SMEM_BYTES, "host and kernel disagree on dynamic shared memory");
#endif
#ifdef ATTNPLAN_TILE_TOKENS
static_assert(TILE == ATTNPLAN_TILE_TOKENS, "host and kernel disagree on the tile size");
#endif
#ifdef ATTNPLAN_THREADS
static_assert(NTHREADS == ATTNPLAN_THREADS, "host and kernel disagree on threads per block");
#endif

#if ATTNPLAN_KIND == ATTNPLAN_KIND_SINGLE
typedef elem_t out_t;
#define ATTNPLAN_ENTRY attnplan_decode_single
#else
typedef float out_t;
#define ATTNPLAN_ENTRY attnplan_decode_partial
#endif

__device__ __forceinline__ out_t to_out(float x) {
#if ATTNPLAN_KIND == ATTNPLAN_KIND_SINGLE
    return from_float(x);
#else
    return x;
#endif
}

// c * tanh(x / c) without overflow: tanh(a) = -expm1(-2a) / (2 + expm1(-2a)) for a = |x / c|
__device__ __forceinline__ float soft_cap(float x, float c) {
    const float em = expm1f(-2.f * fabsf(x / c));
    return copysignf(c * (-em / (2.f + em)), x);
}

#ifdef ATTNPLAN_HOST_EMULATION
__device__ __forceinline__ void cp_async16(void *smem_ptr, const void *gptr, bool valid) {
    emu::cp_async16(smem_ptr, gptr, valid);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
#else
__device__ __forceinline__ void cp_async16(void *smem_ptr, const void *gptr, bool valid) {
    const u32 s = (u32)__cvta_generic_to_shared(smem_ptr);
    const int n = valid ? 16 : 0;  // src-size 0: no global read, 16 zero bytes written
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gptr), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#endif

#if ATTNPLAN_MMA
// ---- tensor-core helpers (warp-collective: every lane of the warp executes them together) ----
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8j..8j+7 give the row addresses (16 bytes each) of
// 8x8 matrix j; r[j] is this lane's fragment of matrix j (row lane/4, columns 2*(lane%4), +1; .trans: of
// the transposed matrix).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const unsigned char *row) {
#ifdef ATTNPLAN_HOST_EMULATION
    emu::ldmatrix_x4(r, row, TRANS);
#else
    const u32 a = (u32)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#endif
}

// d += A . B: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (fragments per the PTX ISA;
// bf16 iff MMA_BF16)
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 b0, const u32 b1) {
#ifdef ATTNPLAN_HOST_EMULATION
    const u32 b[2] = {b0, b1};
    emu::mma_m16n8k16(d, a, b, MMA_BF16);
#elif ATTNPLAN_DTYPE == 1 && !ATTNPLAN_KV_FP8
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// movmatrix.sync.aligned.m8n8.trans.b16: this lane's fragment (row lane/4, columns 2*(lane%4), +1) of the
// transpose of the 8x8 matrix whose fragments the warp holds in x
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
#ifdef ATTNPLAN_HOST_EMULATION
    return emu::movmatrix_trans(x);
#else
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
#endif
}

// two floats -> the mma input type (bf16 iff BF16), packed (lo in the low half), round to nearest even
template <bool BF16 = MMA_BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#ifdef ATTNPLAN_HOST_EMULATION
    return BF16 ? (u32)emu::float_to_bf16_rn(lo) | ((u32)emu::float_to_bf16_rn(hi) << 16)
                : (u32)emu::float_to_half_rn(lo) | ((u32)emu::float_to_half_rn(hi) << 16);
#else
    u32 r;
    if (BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));  // d = {cvt(a) hi, cvt(b) lo}
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

#if ATTNPLAN_KV_FP8 && ATTNPLAN_DTYPE == 1
// 2^e for |e| <= 126, exactly
__device__ __forceinline__ float pow2i(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// The power of two 2^e that puts amax (the largest |q| of some rows, > 0 and finite) in [2^14, 2^15): e =
// 14 - floor(log2(amax)), clamped to [-113, 113] (2^e and 2^-e stay normal floats; only an amax under 2^-99
// ends below 2^14). 0 for zero rows (or an inf / NaN amax, which propagate as on any path).
__device__ __forceinline__ int q_exp_shift(float amax) {
    if (!(amax > 0.f) || amax == __int_as_float(0x7f800000)) return 0;
    const int e = 14 - ((int)((__float_as_uint(amax) >> 23) & 0xffu) - 127);  // bf16 subnormals: 141, clamped
    return e < -113 ? -113 : (e > 113 ? 113 : e);
}
#endif

// ldmatrix chunk index: with an odd chunk count (fp8 only) the last x4 reads the last chunk twice
__device__ __forceinline__ int ld_chunk(int v) { return DV % 2 == 0 ? v : cmin(v, DV - 1); }

// Head_dim column of the O^T accumulator element acc[md][nt][e] held by fragment groupID g (h = e / 2):
// bf16 / fp16 KV: M-row g + 8h of m16-tile md; fp8 KV: V's A fragments come from ldmatrix of byte pairs
// (see "Method"), so M-rows g / g+8 are the columns 2g / 2g+1 of the tile's 16.
__host__ __device__ constexpr int acc_col(int md, int g, int h) { return md * 16 + (KV8 ? 2 * g + h : g + 8 * h); }
#endif

// Byte offset of 16-byte chunk v of token row `tok` in a K or V tile of a ring stage (see RS / SWZ).
__host__ __device__ constexpr int chunk_off(int tok, int v) { return (tok * RS + (SWZ ? (v ^ (tok & 7)) : v)) * 16; }

// Visible range [lo, hi) of query i inside the chunk [cs, ce) (empty when lo >= hi).
__device__ __forceinline__ void query_range(int i, int L, int cs, int ce, int window_left, int &lo, int &hi) {
    const int p = L - QLEN + i;  // the query's own position
    hi = p + 1 < ce ? p + 1 : ce;
    lo = cs;
#if ATTNPLAN_WINDOW
    lo = p - window_left > cs ? p - window_left : cs;
#endif
}

// The block-table window (PAGE_WIN: one page per tile, or PAGE_REG's TILE / PAGE pages; either way the same
// entries for every lane). A copying unit (a warp) visits its
// tiles n = 0, 1, 2, ... (first token base + n * step) and their page slots q = n * NPG + j. Lane L holds the entry
// of slot 32 * b + L of the current batch b in `cur` and of batch b + 1 in `nxt`; a tile's entries reach every lane
// by shuffle, and batch b + 2 is loaded when b + 1 becomes current, 32 / NPG tiles before its first use. Before it,
// each tile's entry was loaded one tile ahead, and at 1-2 programs per SM the copies waited on that load
// (ncu, results/2026-11-30-s7-call1: the top stall of the paged loop, b16 1K). 0 outside [start, end).
constexpr bool PAGE_WIN = PAGE > 0 && (ONE_PAGE || (PAGE_REG && NPG <= 32));  // a tile's slots in one batch
static_assert(!PAGE_WIN || 32 % NPG == 0, "a tile's page slots must lie in one batch of 32");
struct PageWindow {
    const int *btb;
    int base, step, start, end, cur, nxt;
    __device__ __forceinline__ int entry(int q) const {
        const int t0 = base + (q / NPG) * step + (q % NPG) * PAGE;  // first token of slot q's page (in the tile)
        return (t0 < end && t0 + PAGE > start) ? __ldg(btb + t0 / (PAGE > 0 ? PAGE : 1)) : 0;
    }
    __device__ __forceinline__ void init(const int *b, int base_, int step_, int start_, int end_, int lane) {
        btb = b, base = base_, step = step_, start = start_, end = end_;
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

// Block-table entries for the chunks thread `cid` copies of tile `ts` (first token); 0 outside [start, end).
__device__ __forceinline__ void load_pages(int (&pg)[NPG], const int *__restrict__ btb, int ts, int start, int end,
                                           int cid) {
#if ATTNPLAN_PAGE_SIZE > 0
    if (ONE_PAGE) {
        pg[0] = (ts < end && ts + TILE > start) ? __ldg(btb + ts / PAGE) : 0;
    } else if (PAGE_REG) {
#pragma unroll
        for (int j = 0; j < NPG; ++j) {  // page j of the tile: tokens [t0, t0 + PAGE)
            const int t0 = ts + j * PAGE;
            pg[j] = (t0 < end && t0 + PAGE > start) ? __ldg(btb + t0 / PAGE) : 0;
        }
    } else {
#pragma unroll
        for (int k = 0; k < NPG; ++k) {
            const int c = cid + NCOPY * k;
            const int t = ts + c / DV;
            pg[k] = ((CH % NCOPY == 0 || c < CH) && t < end && t >= start) ? __ldg(btb + t / PAGE) : 0;
        }
    }
#endif
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

// A pointer the compiler must keep as computed (an empty asm that "changes" it): the tile's base pointers are
// formed once per tile and each chunk's source is one wide add of its 32-bit lane offset. Without it, ptxas
// (register-capped at 3 programs per SM) re-derived every chunk's address from the kernel parameter: a
// constant-bank load, then 4 dependent integer instructions before each cp.async (ncu source page,
// results/2026-11-30-s7-call5: the paged single pass's top loop stall, short scoreboard on those adds).
// Tensor-core kernels only: the CUDA-core ones hold more live registers per tile, and there the pinned pointers
// made ptxas spill under sm_80's 128-register cap.
template <typename T>
__device__ __forceinline__ const T *opaque(const T *p) {
#ifndef ATTNPLAN_HOST_EMULATION
    if (MMA) asm volatile("" : "+l"(p));
#endif
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
#if ATTNPLAN_PAGE_SIZE > 0
    if (ONE_PAGE) {
        const i64 base_row = (i64)(ts & (PAGE - 1));
        kt = kb + (i64)pg[0] * k_s0 + base_row * k_s1;
        vt = vb + (i64)pg[0] * v_s0 + base_row * v_s1;
    }
#else
    kt = kb + (i64)ts * k_s1;
    vt = vb + (i64)ts * v_s1;
#endif
    kt = opaque(kt);
    vt = opaque(vt);
#if ATTNPLAN_PAGE_SIZE > 0
    const kv_t *kp[PAGE_REG ? NPG : 1], *vp[PAGE_REG ? NPG : 1];  // PAGE_REG: the tile's pages, once per tile
#pragma unroll
    for (int j = 0; j < (PAGE_REG ? NPG : 0); ++j) {
        kp[j] = opaque(kb + (i64)pg[j] * k_s0);
        vp[j] = opaque(vb + (i64)pg[j] * v_s0);
    }
#endif
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const int c = cid + NCOPY * k;
        if (CH % NCOPY == 0 || c < CH) {
            const bool valid = lc_tok(lc, k) >= first && lc_tok(lc, k) < avail;
            const kv_t *ksrc = kt, *vsrc = vt;
#if ATTNPLAN_PAGE_SIZE > 0
            if (PAGE_REG) {
                ksrc = kp[PAGE_REG ? pslot(k) : 0];
                vsrc = vp[PAGE_REG ? pslot(k) : 0];
            } else if (!ONE_PAGE) {
                ksrc = kb + (i64)pg[k] * k_s0;
                vsrc = vb + (i64)pg[k] * v_s0;
            }
#endif
            const int so = MMA ? lc_soff(lc, k) : c * 16;
            // an invalid chunk reads nothing (src-size 0); its address is the chunk's page / tile base, in range
            cp_async16(stage + so, valid ? (const void *)(ksrc + lc.koff[k % NKO]) : (const void *)ksrc, valid);
            cp_async16(stage + KT_BYTES + so, valid ? (const void *)(vsrc + lc.voff[k % NKO]) : (const void *)vsrc,
                       valid);
        }
    }
}

// This lane's NV 16-byte vectors (v = lv, lv + LPT, ...) of token row `tok` of a K or V tile in
// shared memory, widened to fp32; vectors past head_dim read as zeros.
__device__ __forceinline__ void load_row(float (&f)[NV][KVEC], const unsigned char *tile, int tok, int lv) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int v = lv + LPT * j;
        if (DV % LPT == 0 || v < DV) {
            unpack_kv(lds<uint4>(tile + (tok * DV + v) * 16), f[j]);
        } else {
#pragma unroll
            for (int e = 0; e < KVEC; ++e) f[j][e] = 0.f;
        }
    }
}

// Scores (base 2) of this warp's rows for one tile in shared memory: sc[p][r] = q_r . k_t for token
// t = p*TPP + slot of the tile, summed over the LPT lanes of the token row (every one of them holds the
// sum), soft-capped.
__device__ __forceinline__ void tile_scores(float (&sc)[PASSES][RT], const float (&qf)[RT][NV][KVEC],
                                            const unsigned char *ks, int slot, int lv, float softcap_log2) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int tok = p * TPP + slot;
        float kf[NV][KVEC];
        load_row(kf, ks, tok, lv);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float a = 0.f;
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) a = fmaf(qf[r][j][e], kf[j][e], a);
            sc[p][r] = a;
        }
#pragma unroll
        for (int off = LPT / 2; off >= 1; off >>= 1)
#pragma unroll
            for (int r = 0; r < RT; ++r) sc[p][r] += __shfl_xor_sync(FULL_MASK, sc[p][r], off);
    }
#if ATTNPLAN_SOFTCAP
#pragma unroll
    for (int p = 0; p < PASSES; ++p)
#pragma unroll
        for (int r = 0; r < RT; ++r) sc[p][r] = soft_cap(sc[p][r], softcap_log2);
#endif
}

// acc += p * v for one tile: lane (slot, lv) takes token p*TPP + slot of every pass and its NV vectors of the row.
__device__ __forceinline__ void tile_pv(float (&acc)[RT][NV][KVEC], const float (&sc)[PASSES][RT],
                                        const unsigned char *vs, int slot, int lv) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int tok = p * TPP + slot;
        float vf[NV][KVEC];
        load_row(vf, vs, tok, lv);
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) acc[r][j][e] = fmaf(sc[p][r], vf[j][e], acc[r][j][e]);
    }
}

#if ATTNPLAN_MMA
// One KV tile on the tensor cores (see "Method"): S^T = K . Q^T, mask, online softmax, O^T += V^T . P^T.
// Fragment coordinates: g = lane / 4, t = lane % 4. s[mt][nt][e] is token mt*16 + g + 8*(e/2), row
// nt*8 + 2t + e%2 of the row group; acc[md][nt][e] is head_dim column acc_col(md, g, e/2) of that row;
// m / l [nt][j] belong to row nt*8 + 2t + j (l: the lane's tokens only); rs[nt] is n8-tile nt's score scale
// (base 2). `masked` (warp-uniform): the tile holds positions some row cannot see.
__device__ __forceinline__ void mma_tile(float (&m)[NTW][2], float (&l)[NTW][2], float (&acc)[KS][NTW][4],
                                         const u32 (&qb)[NTW][KS][2], const unsigned char *ks,
                                         const unsigned char *vs, int ts, const int (&lo)[NTW][2],
                                         const int (&hi)[NTW][2], bool masked, int lane, const float (&rs)[NTW],
                                         float softcap_log2) {
    const int g = lane >> 2, r8 = lane & 7;
    // ldmatrix row addresses: matrices (tokens 0-7 | 8-15) x (chunks 2c | 2c+1): lanes 8j..8j+7 give matrix j's
    // rows. K (A of S^T, bf16 / fp16): chunks 2c, 2c+1 are dims 0-7 / 8-15 of k16-step c. fp8 (K and V): each
    // chunk is one k16-step / m16-tile, its bytes read as 8 b16 pairs (see "Method"); an odd last chunk is read
    // twice and its second copy ignored. V (A of O^T, read transposed, bf16 / fp16): matrices (dims 0-7 | 8-15)
    // x (tokens 0-7 | 8-15).
    const int ktok = r8 + (lane & 8), kv = lane >> 4;
    const int vtok = KV8 ? ktok : r8 + ((lane >> 4) << 3), vv = KV8 ? kv : (lane >> 3) & 1;

    float s[PASSES][NTW][4];
#pragma unroll
    for (int mt = 0; mt < PASSES; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int c = 0; c < NLD; ++c) {
            u32 r[4];
            ldsm_x4<false>(r, ks + chunk_off(mt * 16 + ktok, ld_chunk(2 * c + kv)));
#if ATTNPLAN_KV_FP8
            // r[2j] / r[2j+1]: tokens g / g+8, bytes 4t..4t+3 of chunk 2c+j = k16-step kk: the A fragment's
            // k-indices 2t, 2t+1 are dims 4t, 4t+1 of the step, 2t+8, 2t+9 dims 4t+2, 4t+3 (qb follows)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int kk = 2 * c + j;
                if (kk < KS) {
                    u32 a[4];
                    fp8x4_to_half2x2(r[2 * j], a[0], a[2]);
                    fp8x4_to_half2x2(r[2 * j + 1], a[1], a[3]);
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) mma_16816(s[mt][nt], a, qb[nt][kk][0], qb[nt][kk][1]);
                }
            }
#else
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) mma_16816(s[mt][nt], r, qb[nt][c][0], qb[nt][c][1]);
#endif
        }
    }
#pragma unroll
    for (int mt = 0; mt < PASSES; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[mt][nt][e] * rs[nt];
#if ATTNPLAN_SOFTCAP
                x = soft_cap(x, softcap_log2);
#endif
                s[mt][nt][e] = x;
            }
    if (masked) {
#pragma unroll
        for (int mt = 0; mt < PASSES; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = ts + mt * 16 + g + 8 * (e >> 1);
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
                    if (t < lo[nt][e & 1] || t >= hi[nt][e & 1]) s[mt][nt][e] = NEG_INF;
            }
    }

    // online softmax per row; s becomes p = exp2(s - m) (0 where masked)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float mx = fmaxf(s[0][nt][j], s[0][nt][j + 2]);
#pragma unroll
            for (int mt = 1; mt < PASSES; ++mt) mx = fmaxf(mx, fmaxf(s[mt][nt][j], s[mt][nt][j + 2]));
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            if (mx > m[nt][j]) {  // uniform over the 8 lanes of the row
                const float alpha = fast_exp2(m[nt][j] - mx);  // 0 while m = -inf
                m[nt][j] = mx;
                l[nt][j] *= alpha;
#pragma unroll
                for (int md = 0; md < KS; ++md) {
                    acc[md][nt][j] *= alpha;
                    acc[md][nt][j + 2] *= alpha;
                }
            }
            const float mu = m[nt][j] == NEG_INF ? 0.f : m[nt][j];  // never -inf - (-inf)
#pragma unroll
            for (int mt = 0; mt < PASSES; ++mt) {
                const float p0 = fast_exp2(s[mt][nt][j] - mu), p1 = fast_exp2(s[mt][nt][j + 2] - mu);
                s[mt][nt][j] = p0;
                s[mt][nt][j + 2] = p1;
                l[nt][j] += p0 + p1;
            }
        }

    // P^T as B fragments: each half of an S^T fragment is an 8x8 (token, row) matrix; transposed across the
    // warp it is the (row g; tokens 2t, 2t+1) layout B wants
    u32 pb[PASSES][NTW][2];
#pragma unroll
    for (int mt = 0; mt < PASSES; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
            pb[mt][nt][0] = movmatrix_trans(pack2(s[mt][nt][0], s[mt][nt][1]));
            pb[mt][nt][1] = movmatrix_trans(pack2(s[mt][nt][2], s[mt][nt][3]));
        }
#pragma unroll
    for (int c = 0; c < NLD; ++c)
#pragma unroll
        for (int mt = 0; mt < PASSES; ++mt) {
            u32 r[4];
            ldsm_x4<true>(r, vs + chunk_off(mt * 16 + vtok, ld_chunk(2 * c + vv)));
#if ATTNPLAN_KV_FP8
            // r[2j] / r[2j+1]: tokens 2t, 2t+1 / 2t+8, 2t+9 of chunk md = 2c+j, transposed b16 pairs: bytes
            // (tok 2t: dims 2g, 2g+1 | tok 2t+1: dims 2g, 2g+1); regrouped per dim (byte order 0, 2, 1, 3) they are
            // the (M-row g = dim 2g | M-row g+8 = dim 2g+1) x (k-indices 2t, 2t+1) pairs of the A fragment
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int md = 2 * c + j;
                if (md < KS) {
                    u32 a[4];
                    fp8x4_to_half2x2(__byte_perm(r[2 * j], 0u, 0x3120u), a[0], a[1]);
                    fp8x4_to_half2x2(__byte_perm(r[2 * j + 1], 0u, 0x3120u), a[2], a[3]);
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt) mma_16816(acc[md][nt], a, pb[mt][nt][0], pb[mt][nt][1]);
                }
            }
#else
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) mma_16816(acc[c][nt], r, pb[mt][nt][0], pb[mt][nt][1]);
#endif
        }
}
#endif

// The natural-log lse of a finished row and the factor its accumulator is multiplied by (1 / l, times
// the fp8 v_scale, times exp(lse - lse') when a sink joins the denominator in the single pass).
// Empty rows (m = -inf): o = 0, lse = -inf (or the sink).
__device__ __forceinline__ void finish_row(float m, float l, float vscale, const float *__restrict__ sinks, int head,
                                           float &lse_n, float &factor) {
    const bool empty = m == NEG_INF;  // else l >= 1 (the max position has p = 1)
    lse_n = empty ? NEG_INF : (m + log2f(l)) * LN2_F;
    float scale = vscale;
    if (sinks) {  // single pass only (partial states never include the sink)
        const float z = sinks[head];
        const float joined = empty ? z : fmaxf(lse_n, z) + log1pf(expf(-fabsf(lse_n - z)));
        scale = empty ? 0.f : scale * expf(lse_n - joined);
        lse_n = joined;
    }
    factor = empty ? 0.f : scale / l;
}

// A store of the program's state (or of the single-pass output): the address, then the value.
template <class T>
__device__ __forceinline__ void st_state(T *p, const T &v) { *p = v; }

#if ATTNPLAN_MERGE
// ---- the in-kernel merges' synchronization: gpu-scope atomics of the PTX memory model (sm_70+) ----
// The host emulation runs one block at a time: plain read-modify-writes.
__device__ __forceinline__ int atom_add_acq_rel(int *p, int v) {
#ifdef ATTNPLAN_HOST_EMULATION
    return atomicAdd(p, v);
#else
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#endif
}
#endif

#if ATTNPLAN_MERGE
// Fused merge: every thread of the program calls it once its split's state is written (o at ob0 + s * o_ss,
// lse at lb0 + s * l_ss; rows r = i*GROUP + g at i * _si + g * _sh; out / out_lse / sinks likewise at the
// group's first head). Release: each thread fences its own state stores (__threadfence), the barrier gathers
// the program, then one thread counts the program in the (sequence, KV head) completion counter with an
// acq_rel atomic: its release is cumulative over the stores the barrier ordered before it, so the whole state
// is visible at gpu scope before the count moves; its acquire makes every state released before it visible
// to that thread, and through the second barrier to the program. The program that counts last resets the
// counter (no other program of the launch touches it again: zero for the next launch and graph replays) and
// merges the group's rows over all splits in split order with the merge kernel's merge_row, reading the
// states through L2 (ld.global.cg). Its threads form teams of TW (one row's merge_row team, fewer warps if the
// program has fewer) that take the rows r, r + TEAMS, ...; each thread keeps 8 splits' o loads in flight.
__device__ __forceinline__ void fused_merge(unsigned char *smem, int tid, int num_splits, int *counter,
                                            const float *ob0, i64 o_si, i64 o_sh, i64 o_ss,
                                            const float *lb0, i64 l_si, i64 l_sh, i64 l_ss,
                                            elem_t *outb, i64 out_si, i64 out_sh, float *olb, i64 ol_si, i64 ol_sh,
                                            const float *sinkb) {
    __threadfence();
    __syncthreads();
    int *flag = reinterpret_cast<int *>(smem);  // the program is done with its shared memory
    if (tid == 0) {
        const bool last = atom_add_acq_rel(counter, 1) == num_splits - 1;
        if (last) atomicExch(counter, 0);
        sts(flag, last ? 1 : 0);
    }
    __syncthreads();
    if (!lds<int>(flag)) return;
    constexpr int TW = cmin(NTHREADS, ROW_MERGE_THREADS), TEAMS = NTHREADS / TW;
    constexpr int NSLOT = merge_slots<TW>();
    const int team = tid / TW;
    if (team >= TEAMS) return;  // whole warps
    for (int rr = team; rr < R; rr += TEAMS) {
        const int i = rr / GROUP, g = rr % GROUP;
        merge_row<TW, 8 / NSLOT, true>(lb0 + (i64)i * l_si + (i64)g * l_sh, l_ss, ob0 + (i64)i * o_si + (i64)g * o_sh,
                                       o_ss, num_splits, sinkb ? sinkb + g : nullptr,
                                       outb + (i64)i * out_si + (i64)g * out_sh,
                                       olb ? olb + (i64)i * ol_si + (i64)g * ol_sh : nullptr, tid % TW);
    }
}
#endif

// fp8 tensor-core kernels state minBlocksPerMultiprocessor = 1: left open, ptxas (NVRTC 13.5) trades small
// spills for register occupancy (96 / 128 / 168 registers = 5 / 4 / 3 programs of 128 threads) that the
// shared memory (64 KB per program: 3 per H200 SM, 2 per A100 SM) never allows; stated, it allocates
// without spilling (head_dim 128, sm_90: 130-165 registers, still 3 programs per SM). The bf16 / fp16 and
// CUDA-core kernels keep the measured open form.
#if (ATTNPLAN_MMA && ATTNPLAN_KV_FP8) || ATTNPLAN_MERGE
#define ATTNPLAN_LAUNCH_BOUNDS __launch_bounds__(NTHREADS, 1)
#else
#define ATTNPLAN_LAUNCH_BOUNDS __launch_bounds__(NTHREADS)
#endif
extern "C" __global__ void ATTNPLAN_LAUNCH_BOUNDS
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
#ifdef ATTNPLAN_HOST_EMULATION
    unsigned char *smem = emu::dynamic_smem();
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#if !ATTNPLAN_MERGE
    pdl_launch_dependents();  // the merge kernel may launch now; it waits for this grid to finish
#endif

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
#if ATTNPLAN_WINDOW
    base = L - QLEN - window_left > 0 ? L - QLEN - window_left : 0;  // no chunk before the window
#endif
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
#if ATTNPLAN_MERGE
    // the group's merge, once this program's state is written (every thread, every path; see fused_merge):
    // counters[grp] counts the group's programs
    const i64 grp = (i64)h + (i64)num_kv_heads * b;
    auto merge_group = [&]() {
        elem_t *outb = out + (i64)b * out_sb + (i64)h * GROUP * out_sh;
        float *olb = out_lse ? out_lse + (i64)b * ol_sb + (i64)h * GROUP * ol_sh : nullptr;
        const float *sinkb = sinks ? sinks + h * GROUP : nullptr;
        fused_merge(smem, tid, num_splits, counters + grp, o + (i64)b * o_sb + (i64)h * GROUP * o_sh, o_si, o_sh, o_ss,
                    lse + (i64)b * l_sb + (i64)h * GROUP * l_sh, l_si, l_sh, l_ss, outb, out_si, out_sh, olb, ol_si,
                    ol_sh, sinkb);
    };
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
#if ATTNPLAN_MERGE
        merge_group();
#endif
        return;
    }

    const int rg = warp / NWK, kw = warp % NWK;  // row group; KV warp within it
    const int slot = lane / LPT, lv = lane % LPT;

    float qscale = scale_log2, vscale = 1.f;
#if ATTNPLAN_KV_FP8
    // dequantization folded into the score scale and into the normalized output (the CUDA-core decoder's
    // values carry 2^-8, FP8_UNIT; the tensor-core path's fp16 values are exact)
    qscale *= k_scale[h] * (MMA ? 1.f : FP8_UNIT);
    vscale = v_scale[h] * (MMA ? 1.f : FP8_UNIT);
#endif

#if ATTNPLAN_MMA
    // ---- this warp's rows (row group rg: rows rg*RT + nt*8 + n): Q^T's B fragments (raw q) in registers;
    // the visible ranges [lo, hi) of the lane's C-fragment rows nt*8 + 2t + j; the row group's union ----
    const int fg = lane >> 2, ft = lane & 3;  // fragment groupID, thread in group
    int start = ce, end = cs;  // KV is read only in [start, end): the visible union of the row group's rows
    int max_lo = cs, min_hi = ce;  // tiles inside [max_lo, min_hi) need no mask
#pragma unroll
    for (int i = 0; i < QLEN; ++i) {
        if ((i + 1) * GROUP > rg * RT && i * GROUP < rg * RT + RT) {  // warp-uniform: query i has rows here
            int a, z;
            query_range(i, L, cs, ce, window_left, a, z);
            if (a < z) {
                start = a < start ? a : start;
                end = z > end ? z : end;
            }
            max_lo = a > max_lo ? a : max_lo;
            min_hi = z < min_hi ? z : min_hi;
        }
    }
    int lo[NTW][2], hi[NTW][2];
    u32 qb[NTW][KS][2];
    float rs[NTW];  // score scale (base 2) of n8-tile nt
    // B fragment (k-indices 2t, 2t+1 | 2t+8, 2t+9 of k16-step kk) = q columns kk*16 + (2t | 2t+8) for a bf16 /
    // fp16 cache, kk*16 + (4t | 4t+2) for fp8 (the K-dim order of the fp8 K fragments, see "Method")
    constexpr int QC0 = KV8 ? 4 : 2, QC1 = KV8 ? 2 : 8;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int rr = rg * RT + nt * 8 + 2 * ft + j;
            lo[nt][j] = 0;
            hi[nt][j] = 0;  // padding rows see nothing
            if (rr < R) query_range(rr / GROUP, L, cs, ce, window_left, lo[nt][j], hi[nt][j]);
        }
        rs[nt] = qscale;
        const int rq = rg * RT + nt * 8 + fg;  // this lane's B-fragment row
        if (rq < R) {
            const elem_t *qp = q + (i64)b * q_sb + (i64)(rq / GROUP) * q_si + (i64)(h * GROUP + rq % GROUP) * q_sh;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                qb[nt][kk][0] = *reinterpret_cast<const u32 *>(qp + kk * 16 + QC0 * ft);
                qb[nt][kk][1] = *reinterpret_cast<const u32 *>(qp + kk * 16 + QC0 * ft + QC1);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) qb[nt][kk][0] = qb[nt][kk][1] = 0u;
        }
#if ATTNPLAN_KV_FP8 && ATTNPLAN_DTYPE == 1
        // bf16 q with an fp8 cache: the mmas are fp16, so the rows of n8-tile nt move to fp16 as q x 2^e, e
        // putting the tile's largest |q| in [2^14, 2^15): no overflow, and bf16's 8 significant bits fit fp16's
        // 11 for every element down to 2^-32 of that largest |q| (smaller ones round to fp16's subnormal grid,
        // or flush in the mma: an absolute score error under ~2^-28 x max |q| x |k|); 2^-e joins the tile's
        // score scale (exact)
        float amax = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float x0, x1;
                unpack2(qb[nt][kk][i], x0, x1);
                amax = fmaxf(amax, fmaxf(fabsf(x0), fabsf(x1)));
            }
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off));
        const int ex = q_exp_shift(amax);
        const float up = pow2i(ex);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float x0, x1;
                unpack2(qb[nt][kk][i], x0, x1);
                qb[nt][kk][i] = pack2<false>(x0 * up, x1 * up);
            }
        rs[nt] = qscale * pow2i(-ex);
#endif
    }
    float m[NTW][2], l[NTW][2], acc[KS][NTW][4];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
        m[nt][0] = m[nt][1] = NEG_INF;
        l[nt][0] = l[nt][1] = 0.f;
#pragma unroll
        for (int md = 0; md < KS; ++md)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[md][nt][e] = 0.f;
    }
#else
    // ---- this warp's rows: q in registers (pre-scaled to base 2), visible range [lo, hi) ----
    float qf[RT][NV][KVEC];
    int lo[RT], hi[RT];
    int start = ce, end = cs;  // KV is read only in [start, end): the visible union of the ring's rows
    int max_lo = cs, min_hi = ce;  // tiles inside [max_lo, min_hi) need no mask
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int rr = rg * RT + r;
        lo[r] = 0;
        hi[r] = 0;  // padding rows see nothing
        if (rr < R) {
            const int i = rr / GROUP, g = rr % GROUP;
            query_range(i, L, cs, ce, window_left, lo[r], hi[r]);
            if (lo[r] < hi[r]) {
                start = lo[r] < start ? lo[r] : start;
                end = hi[r] > end ? hi[r] : end;
            }
            max_lo = lo[r] > max_lo ? lo[r] : max_lo;
            min_hi = hi[r] < min_hi ? hi[r] : min_hi;
            const elem_t *qp = q + (i64)b * q_sb + (i64)i * q_si + (i64)(h * GROUP + g) * q_sh;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int v = lv + LPT * j;
                if (v < DV) {
#pragma unroll
                    for (int c = 0; c < QPV; ++c) {
                        float f[VEC];
                        unpack16(*reinterpret_cast<const uint4 *>(qp + v * KVEC + c * VEC), f);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) qf[r][j][c * VEC + e] = f[e] * qscale;
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < KVEC; ++e) qf[r][j][e] = 0.f;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) qf[r][j][e] = 0.f;
        }
    }
    float m[RT], l[RT], acc[RT][NV][KVEC];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int e = 0; e < KVEC; ++e) acc[r][j][e] = 0.f;
    }
#endif

    const kv_t *kb = kc + (i64)h * k_sh;
    const kv_t *vb = vc + (i64)h * v_sh;
    const int *btb = block_table;
#if ATTNPLAN_PAGE_SIZE > 0
    btb = block_table + (i64)b * bt_sb;
#else
    kb += (i64)b * k_s0;
    vb += (i64)b * v_s0;
#endif
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
        float sc[PASSES][RT];
        tile_scores(sc, qf, ks, slot, lv, softcap_log2);

        // mask the tile's positions a row cannot see, then the online-softmax update of (m, l, acc); sc
        // becomes p = exp2(s - m). The row max is warp-uniform, so the rescale branch is too. (Kept
        // inline: as a helper function ptxas allocates sm_80 split-K registers worse and spills.)
        if (ts < max_lo || ts + TILE > min_hi) {  // warp-uniform: the tile holds positions a row cannot see
#pragma unroll
            for (int p = 0; p < PASSES; ++p) {
                const int t = ts + p * TPP + slot;
#pragma unroll
                for (int r = 0; r < RT; ++r)
                    if (t < lo[r] || t >= hi[r]) sc[p][r] = NEG_INF;
            }
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float mx = sc[0][r];
#pragma unroll
            for (int p = 1; p < PASSES; ++p) mx = fmaxf(mx, sc[p][r]);
#pragma unroll
            for (int off = LPT; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            if (mx > m[r]) {
                const float alpha = fast_exp2(m[r] - mx);  // 0 while m = -inf
                m[r] = mx;
                l[r] *= alpha;
#pragma unroll
                for (int j = 0; j < NV; ++j)
#pragma unroll
                    for (int e = 0; e < KVEC; ++e) acc[r][j][e] *= alpha;
            }
            const float mu = m[r] == NEG_INF ? 0.f : m[r];  // never -inf - (-inf)
#pragma unroll
            for (int p = 0; p < PASSES; ++p) {
                const float pr = fast_exp2(sc[p][r] - mu);
                sc[p][r] = pr;
                l[r] += pr;
            }
        }

        tile_pv(acc, sc, vs, slot, lv);
#endif
        __syncwarp();  // every lane is done with this stage before it is refilled
        stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
        stage_w = stage_w + 1 == STAGES ? 0 : stage_w + 1;
    }
#undef TILE_START
    cp_async_wait<0>();

#if ATTNPLAN_MMA
    // ---- the 8 lanes of a row (fragment groupIDs) hold different tokens: sum l over them ----
#pragma unroll
    for (int off = 4; off < 32; off <<= 1)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) l[nt][j] += __shfl_xor_sync(FULL_MASK, l[nt][j], off);
#else
    // ---- lanes of one row's token slots hold different tokens: sum l over them ----
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
        for (int r = 0; r < RT; ++r) l[r] += __shfl_xor_sync(FULL_MASK, l[r], off);
#endif

#if ATTNPLAN_MMA
    // ---- merge the KV warps of each row group through shared memory (the rings are free now) ----
    __syncthreads();
    float *sm_acc = reinterpret_cast<float *>(smem);  // [NWARPS][RT][HEAD_DIM]
    float *sm_m = sm_acc + NWARPS * RT * HEAD_DIM;    // [NWARPS][RT]
    float *sm_l = sm_m + NWARPS * RT;                 // [NWARPS][RT]
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
        for (int md = 0; md < KS; ++md)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                sts(sm_acc + (warp * RT + nt * 8 + 2 * ft + (e & 1)) * HEAD_DIM + acc_col(md, fg, e >> 1),
                    acc[md][nt][e]);
        if (fg == 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                sts(sm_m + warp * RT + nt * 8 + 2 * ft + j, m[nt][j]);
                sts(sm_l + warp * RT + nt * 8 + 2 * ft + j, l[nt][j]);
            }
        }
    }
#else
    // ---- lanes of the same head_dim slice hold different tokens: sum their acc ----
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) acc[r][j][e] += __shfl_xor_sync(FULL_MASK, acc[r][j][e], off);

    // ---- merge the KV warps of each row group through shared memory (the rings are free now) ----
    __syncthreads();
    float *sm_acc = reinterpret_cast<float *>(smem);  // [NWARPS][RT][HEAD_DIM]
    float *sm_m = sm_acc + NWARPS * RT * HEAD_DIM;    // [NWARPS][RT]
    float *sm_l = sm_m + NWARPS * RT;                 // [NWARPS][RT]
    if (slot == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int v = lv + LPT * j;
                if (v < DV) {
                    float *dst = sm_acc + (warp * RT + r) * HEAD_DIM + v * KVEC;
#pragma unroll
                    for (int e = 0; e < KVEC; e += 4) {
                        float4 t4;
                        t4.x = acc[r][j][e]; t4.y = acc[r][j][e + 1]; t4.z = acc[r][j][e + 2]; t4.w = acc[r][j][e + 3];
                        sts(dst + e, t4);
                    }
                }
            }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            sts(sm_m + warp * RT + r, m[r]);
            sts(sm_l + warp * RT + r, l[r]);
        }
    }
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
#if ATTNPLAN_KIND == ATTNPLAN_KIND_SINGLE
#pragma unroll
        for (int e = 0; e < 4; ++e) st_state(dst + e, to_out(a[e] * factor));  // out: unit stride, any alignment
#else
        float4 t4;
        t4.x = a[0] * factor; t4.y = a[1] * factor; t4.z = a[2] * factor; t4.w = a[3] * factor;
        st_state(reinterpret_cast<float4 *>(dst), t4);
#endif
        if (d == 0 && lb) st_state(lb + (i64)i * lsi + (i64)(hb + g) * lsh, lse_n);
    }
#if ATTNPLAN_MERGE
    merge_group();
#endif
}

#else  // ATTNPLAN_KIND == ATTNPLAN_KIND_MERGE
// =============================================================================================
// merge kernel: one CTA per row (b, i, head), ATTNPLAN_MERGE_TEAMS (T) merge teams of ROW_MERGE_THREADS threads
// per CTA; each thread owns 4 consecutive dims of every slot, lanes share the splits' lse reductions (warp
// shuffles)
//   lse = logsumexp_s(lse_s);  o = sum_s exp(lse_s - lse) o_s;  all-empty row: o = 0, lse = -inf
//   optional sinks [num_heads]: lse' = logaddexp(lse, z), o' = o exp(lse - lse') (empty: o = 0, lse = z)
// T = 1: the team merges the row's splits (merge_row); no shared memory, no barrier.
// T > 1 (2, 4, 8): with few rows and many splits one team is latency bound: it walks ceil(n / MERGE_CHUNK)
// dependent memory round trips (H200, CUPTI: batch 1, 1 KV head, 8 query heads = 8 rows, 128 splits: 9.3 us,
// 8 round trips per CTA). Team k merges the contiguous splits [k per, min(n, (k + 1) per)), per = ceil(n / T)
// rounded up to whole chunks (a team's range may be empty), with merge_row's accumulation (merge_accumulate:
// M_k, tot_k, a_k; an empty range or one of empty splits gives M_k = -inf, tot_k = 0, a_k = 0). The teams
// publish them in shared memory (a_k[HEAD_DIM] of every team, then M_k, tot_k), one barrier, and team 0
// combines them in team order 0 .. T-1 (deterministic: same inputs and T, same bits):
//   M = max_k M_k;  tot = sum_k exp(M_k - M) tot_k;  a = sum_k exp(M_k - M) a_k  (teams with M_k = -inf skipped)
// and writes the row with merge_write (M = -inf: o = 0, lse = -inf or the sink; the sink joins once, here).
// The host chooses T (launch.merge_teams): 1 when the rows fill the SMs or one chunk holds the splits, else the
// smallest power of two with T x 16 >= n, at most 8.
// =============================================================================================
#ifndef ATTNPLAN_MERGE_TEAMS
#define ATTNPLAN_MERGE_TEAMS 1
#endif
constexpr int MERGE_TEAMS = ATTNPLAN_MERGE_TEAMS;
static_assert(MERGE_TEAMS == 1 || MERGE_TEAMS == 2 || MERGE_TEAMS == 4 || MERGE_TEAMS == 8,
              "merge teams per CTA: 1, 2, 4 or 8");
constexpr int TEAM_THREADS = ROW_MERGE_THREADS;  // one row's merge_row team
constexpr int MERGE_THREADS = MERGE_TEAMS * TEAM_THREADS;
// splits whose o rows one thread loads before using any (merge_row's CHUNK): 16 at one warp per team (64
// registers of float4), 8 at two (head_dim 256). 32 (NOTES change 13) measured slower: 3.6 against 2.8 us at
// 16 splits, no gain at 32 (results/2026-11-30-s4-call5)
constexpr int MERGE_CHUNK = TEAM_THREADS == 32 ? 16 : 8;
constexpr int MERGE_SLOTS = merge_slots<TEAM_THREADS>();
// dynamic shared memory of the teams' combine: a_k[HEAD_DIM] of each team, then M_k, then tot_k (T > 1 only)
constexpr int MERGE_SMEM_BYTES = MERGE_TEAMS == 1 ? 0 : MERGE_TEAMS * (HEAD_DIM + 2) * 4;
#ifdef ATTNPLAN_THREADS
static_assert(MERGE_THREADS == ATTNPLAN_THREADS, "host and kernel disagree on merge threads per block");
#endif
#ifdef ATTNPLAN_SMEM_BYTES
static_assert(MERGE_SMEM_BYTES == ATTNPLAN_SMEM_BYTES, "host and kernel disagree on dynamic shared memory");
#endif

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
#if ATTNPLAN_MERGE_TEAMS == 1
    merge_row<TEAM_THREADS, MERGE_CHUNK, false>(lr, l_ss, orow, o_ss, num_splits, sink, outp, olp, threadIdx.x);
#else
#ifdef ATTNPLAN_HOST_EMULATION
    unsigned char *smem = emu::dynamic_smem();
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    float *sm_a = reinterpret_cast<float *>(smem);  // [MERGE_TEAMS][HEAD_DIM]
    float *sm_m = sm_a + MERGE_TEAMS * HEAD_DIM, *sm_tot = sm_m + MERGE_TEAMS;
    const int team = threadIdx.x / TEAM_THREADS, t = threadIdx.x % TEAM_THREADS;
    const int per = ((num_splits + MERGE_TEAMS - 1) / MERGE_TEAMS + MERGE_CHUNK - 1) / MERGE_CHUNK * MERGE_CHUNK;
    const int s0 = cmin(num_splits, team * per), cnt = cmin(num_splits - s0, per);
    float M, tot, a[MERGE_SLOTS][4];
    merge_accumulate<TEAM_THREADS, MERGE_CHUNK, false>(lr + (i64)s0 * l_ss, l_ss, orow + (i64)s0 * o_ss, o_ss, cnt, t,
                                                       M, tot, a);
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
#endif
}
#endif
