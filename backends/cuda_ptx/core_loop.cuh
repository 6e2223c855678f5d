// attnplan cuda_ptx: the CUDA-core main loop (ATTNPLAN_MMA 0: fp32, head_dims not a multiple of 16, or kernel
// option mma: false). FlashDecoding's split-KV; FlashInfer's decode kernels for the CUDA-core layout.
//
//  * Rows r = i*GROUP + g (query i, head g of the group). Row groups of RT rows; each warp holds its rows' q
//    (its scores scaled by sm_scale*log2(e), and k_scale with fp8) in fp32 registers: the elements of one 16-byte KV
//    vector of head_dim per lane (8 for fp16 / bf16, 4 for fp32, 16 for fp8).
//  * A token row of a K / V tile spans LPT lanes (NV 16-byte vectors each); a warp pass covers TPP = 32 / LPT
//    tokens, a tile PASSES passes. Scores: each lane multiplies its head_dim slice, a butterfly over the LPT lanes
//    sums the slices.
//  * Online softmax in base 2 (exp2), fp32 accumulation, rescale only when a row's max grows; at the end the lanes
//    holding a row's other tokens sum l and acc, and the warp's (m, l, acc) go to shared memory for the merge of
//    the row group's KV warps (decode.cu).
//  * fp8 e4m3fn KV: a 16-byte load carries 16 values, decoded exactly with integer ops and the fp16 conversion
//    (convert.cuh; values x 2^-8, FP8_UNIT folded into the scales).
//  * NaN isolation (q_len > 1): a tile holding positions some rows see and others do not takes tile_pv_isolated.
// The helpers below are functions; the rows' setup, the per-tile softmax and the end are kernel-body fragments
// included by decode.cu: core_loop_rows.cuh, core_loop_tile.cuh, core_loop_finish.cuh.
#pragma once

// one 16-byte vector of the KV cache -> KVEC floats (fp8: x 2^-8, see FP8_UNIT)
template <int N>
__device__ __forceinline__ void unpack_kv(const uint4 u, float (&f)[N]) {
    static_assert(N == KVEC, "one KV vector");
    if constexpr (KV8) {
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
    } else {
        unpack16(u, f);
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
// The score scale applies to each dot product, not to q: a large legal scale (up to FP32_SCALED_MAX) times q would
// overflow where the score does not (q x scale x 0 = NaN). fp8: the decoder's 2^-8 (FP8_UNIT) first, exactly.
__device__ __forceinline__ void tile_scores(float (&sc)[PASSES][RT], const float (&qf)[RT][NV][KVEC],
                                            const unsigned char *ks, int slot, int lv, float qscale,
                                            float softcap_log2) {
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
#pragma unroll
        for (int r = 0; r < RT; ++r) sc[p][r] = (KV8 ? sc[p][r] * FP8_UNIT : sc[p][r]) * qscale;
    }
    if constexpr (SOFTCAP) {
#pragma unroll
        for (int p = 0; p < PASSES; ++p)
#pragma unroll
            for (int r = 0; r < RT; ++r) sc[p][r] = soft_cap(sc[p][r], softcap_log2);
    }
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

// tile_pv for a tile holding positions some of the warp's rows see and others do not (QLEN > 1: the last QLEN - 1
// positions of a sequence, the first of a window): P.V multiplies a V row a row cannot see by p = 0, and 0 * NaN =
// NaN. A lane whose V elements of a token are not all finite (rare: a per-lane branch, nothing collective in it)
// zeroes them for the products and sets those columns of the rows that see the token to NaN (the float64
// reference's rule, attnplan.reference._attend: a non-finite V entry a row sees makes that column NaN). lo / hi:
// the rows' visible ranges, ts the tile's first position.
__device__ __forceinline__ void tile_pv_isolated(float (&acc)[RT][NV][KVEC], const float (&sc)[PASSES][RT],
                                                 const unsigned char *vs, int slot, int lv, int ts,
                                                 const int (&lo)[RT], const int (&hi)[RT]) {
    static_assert(NV * KVEC <= 32, "one bit per element of a lane's V row slice");
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int tok = p * TPP + slot, t = ts + tok;
        float vf[NV][KVEC];
        load_row(vf, vs, tok, lv);
        u32 bad = 0u;
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int e = 0; e < KVEC; ++e)
                if (!(fabsf(vf[j][e]) <= FLT_MAX_F)) bad |= 1u << (j * KVEC + e);
        if (bad) {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e)
                    if (bad & (1u << (j * KVEC + e))) vf[j][e] = 0.f;
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < KVEC; ++e) acc[r][j][e] = fmaf(sc[p][r], vf[j][e], acc[r][j][e]);
            if (bad && t >= lo[r] && t < hi[r]) {
#pragma unroll
                for (int j = 0; j < NV; ++j)
#pragma unroll
                    for (int e = 0; e < KVEC; ++e)
                        if (bad & (1u << (j * KVEC + e))) acc[r][j][e] = QNAN_F;
            }
        }
    }
}
