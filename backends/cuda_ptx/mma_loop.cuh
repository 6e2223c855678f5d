// attnplan cuda_ptx: the tensor-core main loop (ATTNPLAN_MMA 1; sources: FlashAttention-2's register-level online
// softmax on mma fragments, FlashInfer's decode with tensor cores for GQA, the PTX ISA's "Matrix fragments for
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
//  * Tiles are sized in bytes (spec.py, MMA_TILE_BYTES): head_dim 128 fp8 takes 2 m-tiles (32 tokens) per
//    8 KB stage, so the bf16 default of 4 warps x 2 stages x 8 KB (64 KB of shared memory, 32 KB in flight)
//    keeps its bytes in flight with twice the tokens, and the online softmax's row-max shuffles and rescales
//    run once per 32 tokens.
//  * Registers: the conversions need some, so the fp8 kernels keep fewer copy constants (LC_COMPACT: a
//    lane's chunks are one column of tokens tok0 + k*TPR, offsets affine in k), load the block table once
//    per page of the tile when a 32-token tile spans 16-token pages (PAGE_REG, any MMA kernel: TILE / PAGE
//    warp-uniform entries instead of one per chunk; copy.cuh) and state __launch_bounds__(threads, 1)
//    (layout.cuh, MIN_CTAS_PER_SM).
//
// NaN isolation (q_len > 1): the V tiles of tiles that hold positions some rows see and others do not are checked
// for non-finite elements (v_tile_nonfinite and the helpers after it, below).
// The per-tile work is mma_tile (below); the rows' setup and the end are kernel-body fragments included by
// decode.cu: mma_loop_rows.cuh (q's B fragments, the rows' visible ranges, the softmax state), mma_loop_finish.cuh
// (the warp's (m, l, acc) into the end merge's shared memory).
#pragma once

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

// ldmatrix chunk index: with an odd chunk count (fp8 only) the last x4 reads the last chunk twice
__device__ __forceinline__ int ld_chunk(int v) { return DV % 2 == 0 ? v : cmin(v, DV - 1); }

// Head_dim column of the O^T accumulator element acc[md][nt][e] held by fragment groupID g (h = e / 2):
// bf16 / fp16 KV: M-row g + 8h of m16-tile md; fp8 KV: V's A fragments come from ldmatrix of byte pairs
// (see the header comment), so M-rows g / g+8 are the columns 2g / 2g+1 of the tile's 16.
__host__ __device__ constexpr int acc_col(int md, int g, int h) { return md * 16 + (KV8 ? 2 * g + h : g + 8 * h); }

// One KV tile on the tensor cores: S^T = K . Q^T, mask, online softmax, O^T += V^T . P^T. Fragment coordinates:
// g = lane / 4, t = lane % 4. s[mt][nt][e] is token mt*16 + g + 8*(e/2), row nt*8 + 2t + e%2 of the row group;
// acc[md][nt][e] is head_dim column acc_col(md, g, e/2) of that row; m / l [nt][j] belong to row nt*8 + 2t + j
// (l: the lane's tokens only); rs[nt] is n8-tile nt's score scale (base 2). `masked` (warp-uniform): the tile holds
// positions some row cannot see.
__device__ __forceinline__ void mma_tile(float (&m)[NTW][2], float (&l)[NTW][2], float (&acc)[KS][NTW][4],
                                         const u32 (&qb)[NTW][KS][2], const unsigned char *ks,
                                         const unsigned char *vs, int ts, const int (&lo)[NTW][2],
                                         const int (&hi)[NTW][2], bool masked, int lane, const float (&rs)[NTW],
                                         float softcap_log2) {
    const int g = lane >> 2, r8 = lane & 7;
    // ldmatrix row addresses: matrices (tokens 0-7 | 8-15) x (chunks 2c | 2c+1): lanes 8j..8j+7 give matrix j's
    // rows. K (A of S^T, bf16 / fp16): chunks 2c, 2c+1 are dims 0-7 / 8-15 of k16-step c. fp8 (K and V): each
    // chunk is one k16-step / m16-tile, its bytes read as 8 b16 pairs (see the header comment); an odd last chunk is
    // read twice and its second copy ignored. V (A of O^T, read transposed, bf16 / fp16): matrices (dims 0-7 |
    // 8-15) x (tokens 0-7 | 8-15).
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
            if constexpr (KV8) {
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
                        for (int nt = 0; nt < NTW; ++nt)
                            mma_16816<MMA_BF16>(s[mt][nt], a, qb[nt][kk][0], qb[nt][kk][1]);
                    }
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) mma_16816<MMA_BF16>(s[mt][nt], r, qb[nt][c][0], qb[nt][c][1]);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < PASSES; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[mt][nt][e] * rs[nt];
                if constexpr (SOFTCAP) x = soft_cap(x, softcap_log2);
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
            float mx = fmax_nan(s[0][nt][j], s[0][nt][j + 2]);
#pragma unroll
            for (int mt = 1; mt < PASSES; ++mt) mx = fmax_nan(mx, fmax_nan(s[mt][nt][j], s[mt][nt][j + 2]));
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) mx = fmax_nan(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            // uniform over the 8 lanes of the row; a NaN score spreads into m, l and acc (the row is NaN, not empty)
            if (!(mx <= m[nt][j])) {
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
            pb[mt][nt][0] = movmatrix_trans(pack2<MMA_BF16>(s[mt][nt][0], s[mt][nt][1]));
            pb[mt][nt][1] = movmatrix_trans(pack2<MMA_BF16>(s[mt][nt][2], s[mt][nt][3]));
        }
#pragma unroll
    for (int c = 0; c < NLD; ++c)
#pragma unroll
        for (int mt = 0; mt < PASSES; ++mt) {
            u32 r[4];
            ldsm_x4<true>(r, vs + chunk_off(mt * 16 + vtok, ld_chunk(2 * c + vv)));
            if constexpr (KV8) {
                // r[2j] / r[2j+1]: tokens 2t, 2t+1 / 2t+8, 2t+9 of chunk md = 2c+j, transposed b16 pairs: bytes
                // (tok 2t: dims 2g, 2g+1 | tok 2t+1: dims 2g, 2g+1); regrouped per dim (byte order 0, 2, 1, 3) they
                // are the (M-row g = dim 2g | M-row g+8 = dim 2g+1) x (k-indices 2t, 2t+1) pairs of the A fragment
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int md = 2 * c + j;
                    if (md < KS) {
                        u32 a[4];
                        fp8x4_to_half2x2(__byte_perm(r[2 * j], 0u, 0x3120u), a[0], a[1]);
                        fp8x4_to_half2x2(__byte_perm(r[2 * j + 1], 0u, 0x3120u), a[2], a[3]);
#pragma unroll
                        for (int nt = 0; nt < NTW; ++nt)
                            mma_16816<MMA_BF16>(acc[md][nt], a, pb[mt][nt][0], pb[mt][nt][1]);
                    }
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) mma_16816<MMA_BF16>(acc[c][nt], r, pb[mt][nt][0], pb[mt][nt][1]);
            }
        }
}

// ---- NaN isolation (QLEN > 1): a tile holding positions some rows see and others do not ----
// O^T += V^T . P^T multiplies a V row a row cannot see by p = 0, and 0 * NaN = NaN (an fp16 / bf16 inf or NaN, an
// fp8 NaN code). For such a tile (the last QLEN - 1 positions of a sequence, the first of a window; warp-uniform)
// the warp first checks its V tile for non-finite elements (v_tile_nonfinite: a few 16-byte shared-memory loads per
// lane and a vote; nearly always none). When there are some, each lane notes which of its accumulator elements
// belong to a row that sees such an element (v_nan_marks: a token loop over the lane's head_dim columns, read from
// the ring), the warp zeroes them in the ring (v_tile_zero_nonfinite), the tile runs as usual, and the noted
// elements become NaN (apply_nan_marks): the float64 reference's rule (attnplan.reference._attend), a non-finite
// V entry a row sees makes that column NaN, the others untouched.
constexpr u32 EXP_MASK16 = DTYPE == 1 ? 0x7f80u : 0x7c00u;  // a 16-bit KV element is inf / NaN: all exponent bits
__device__ __forceinline__ bool nonfinite16(u32 h) { return (h & EXP_MASK16) == EXP_MASK16; }

// Whether a 16-byte chunk of the KV dtype holds an inf / NaN element.
__device__ __forceinline__ bool chunk_nonfinite(const uint4 u) {
    const u32 w[4] = {u.x, u.y, u.z, u.w};
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if constexpr (KV8)
            bad |= fp8x4_nan(w[k]) != 0u;
        else
            bad |= nonfinite16(w[k] & 0xffffu) || nonfinite16(w[k] >> 16);
    }
    return bad;
}

// Whether the warp's V tile (TILE token rows of DV chunks at vs) holds a non-finite element; warp-collective.
__device__ __forceinline__ bool v_tile_nonfinite(const unsigned char *vs, int lane) {
    bool bad = false;
    for (int c = lane; c < TILE * DV; c += 32) bad |= chunk_nonfinite(lds<uint4>(vs + chunk_off(c / DV, c % DV)));
    return __any_sync(FULL_MASK, bad) != 0;
}

// The V tile's non-finite elements set to zero (the lanes' chunks; the caller syncs the warp before and after).
__device__ __forceinline__ void v_tile_zero_nonfinite(unsigned char *vs, int lane) {
    for (int c = lane; c < TILE * DV; c += 32) {
        unsigned char *p = vs + chunk_off(c / DV, c % DV);
        const uint4 u = lds<uint4>(p);
        if (!chunk_nonfinite(u)) continue;
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if constexpr (KV8) {
                w[k] &= ~((fp8x4_nan(w[k]) >> 7) * 0xffu);
            } else {
                const u32 lo = w[k] & 0xffffu, hi = w[k] >> 16;
                w[k] = (nonfinite16(lo) ? 0u : lo) | ((nonfinite16(hi) ? 0u : hi) << 16);
            }
        }
        sts(p, make_uint4(w[0], w[1], w[2], w[3]));
    }
}

// Bit ((md * 2 + e / 2) * NTW + nt) * 2 + e % 2 set for each accumulator element acc[md][nt][e] of this lane whose
// row sees a non-finite V element of its column in the tile (first position ts; rows' ranges lo / hi).
constexpr int NAN_MARK_BITS = KS * 2 * NTW * 2;
static_assert(NAN_MARK_BITS <= 64, "one bit per accumulator element of a lane");
__device__ __forceinline__ unsigned long long v_nan_marks(const unsigned char *vs, int ts, const int (&lo)[NTW][2],
                                                          const int (&hi)[NTW][2], int lane) {
    const int g = lane >> 2;
    unsigned long long marks = 0ull;
#pragma unroll
    for (int md = 0; md < KS; ++md)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int col = acc_col(md, g, hh);
            const int v = col / KVEC, byte = (col % KVEC) * (int)sizeof(kv_t);  // the column's chunk and byte
#pragma unroll 1
            for (int t = 0; t < TILE; ++t) {
                const unsigned char *p = vs + chunk_off(t, v) + byte;
                const bool bad = KV8 ? (lds<unsigned char>(p) & 0x7fu) == 0x7fu : nonfinite16(lds<unsigned short>(p));
                if (bad) {
                    const int pos = ts + t;
#pragma unroll
                    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                            if (pos >= lo[nt][j] && pos < hi[nt][j])
                                marks |= 1ull << (((md * 2 + hh) * NTW + nt) * 2 + j);
                }
            }
        }
    return marks;
}

// The accumulator elements v_nan_marks noted set to NaN.
__device__ __forceinline__ void apply_nan_marks(float (&acc)[KS][NTW][4], unsigned long long marks) {
#pragma unroll
    for (int md = 0; md < KS; ++md)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (marks & (1ull << (((md * 2 + (e >> 1)) * NTW + nt) * 2 + (e & 1)))) acc[md][nt][e] = QNAN_F;
}
