// attnplan cuda_ptx: element conversions without cuda_fp16.h / cuda_bf16.h / cuda_fp8.h: q's dtype to fp32, fp32
// to the output dtype, and the fp8 e4m3fn decoders (the CUDA-core one and the tensor-core path's e4m3 -> fp16);
// and the scores' soft-cap.
#pragma once

// two elements of q's dtype packed in a word -> two floats (fp32: the word is one float, b = 0)
__device__ __forceinline__ void unpack2(u32 w, float &a, float &b) {
    if constexpr (DTYPE == 1) {
        a = __uint_as_float(w << 16);
        b = __uint_as_float(w & 0xffff0000u);
    } else if constexpr (DTYPE == 0) {
        cvt_f32_f16x2(w, a, b);
    } else {
        a = __uint_as_float(w);
        b = 0.f;
    }
}

// one 16-byte vector of q's dtype -> VEC floats
__device__ __forceinline__ void unpack16(const uint4 u, float (&f)[VEC]) {
    if constexpr (DTYPE == 2) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    } else {
        float *g = f;  // VEC == 8 here
        unpack2(u.x, g[0], g[1]); unpack2(u.y, g[2], g[3]);
        unpack2(u.z, g[4], g[5]); unpack2(u.w, g[6], g[7]);
    }
}

// float -> q's dtype (fp16 / bf16: round to nearest even)
__device__ __forceinline__ elem_t from_float(float x) {
    if constexpr (DTYPE == 2)
        return x;
    else if constexpr (DTYPE == 1)
        return cvt_rn_bf16(x);
    else
        return cvt_rn_f16(x);
}

// 4 consecutive output elements in q's dtype: one 8-byte (fp32: 16-byte) store when `vec` (p aligned to it), else
// four element stores (an out whose leading strides are not multiples of 4 elements)
__device__ __forceinline__ void store4(elem_t *p, float a, float b, float c, float d, bool vec) {
    if (!vec) {
        p[0] = from_float(a);
        p[1] = from_float(b);
        p[2] = from_float(c);
        p[3] = from_float(d);
    } else if constexpr (DTYPE == 2) {
        check_aligned(p, 16);
        float4 t; t.x = a; t.y = b; t.z = c; t.w = d;
        *reinterpret_cast<float4 *>(p) = t;
    } else {
        check_aligned(p, 8);
        uint2 t;
        t.x = (u32)from_float(a) | ((u32)from_float(b) << 16);
        t.y = (u32)from_float(c) | ((u32)from_float(d) << 16);
        *reinterpret_cast<uint2 *>(p) = t;
    }
}

// whether 4 consecutive output elements at p take one vector store (p aligned to 4 elements)
__device__ __forceinline__ bool vec4_aligned(const elem_t *p) {
    return ((unsigned long long)p & (4 * sizeof(elem_t) - 1)) == 0;
}

// ---- float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities,
// S.1111.111 (0x7f, 0xff) = NaN ----
// CUDA-core decoder: exact, but scaled by 2^-8: the 7 exponent + mantissa bits move under an fp16's sign into its
// low 4 exponent bits and top 3 mantissa bits, so the fp16 holds value x 2^-8 (fp16 bias 15 = 7 + 8; fp16
// subnormals are exactly the e4m3 subnormals x 2^-8), and cvt.f32.f16 widens it exactly. FP8_UNIT = 2^8 is folded
// into k_scale and v_scale.
constexpr float FP8_UNIT = 256.f;

// 4 e4m3fn bytes (byte 0 first) -> 4 floats x 2^-8 (NaN codes not handled here: fp8x4_nan)
__device__ __forceinline__ void fp8x4_to_float(u32 w, float &a, float &b, float &c, float &d) {
    const u32 lo = __byte_perm(w, 0u, 0x1404u);  // byte 0 -> bits 8..15, byte 1 -> bits 24..31, zeros
    const u32 hi = __byte_perm(w, 0u, 0x3424u);  // byte 2, byte 3 likewise
    cvt_f32_f16x2((lo & 0x80008000u) | ((lo >> 1) & 0x3f803f80u), a, b);
    cvt_f32_f16x2((hi & 0x80008000u) | ((hi >> 1) & 0x3f803f80u), c, d);
}

// bit 7 of byte j set where byte j of w is a NaN code ((byte & 0x7f) == 0x7f; no carry crosses bytes)
__device__ __forceinline__ u32 fp8x4_nan(u32 w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// Tensor-core path: e4m3fn -> fp16 holding the exact value (unscaled: every e4m3fn value, subnormals included, is
// an fp16 normal number or zero; NaN codes give NaN).
// Integer twin of cvt.rn.f16x2.e4m3x2 (the sm_80 / sm_86 form and the host emulation's cvt): x holds one byte in
// bits 8..15 of each half (__byte_perm 0x1404 / 0x3424 of the bytes); the CUDA-core decoder's bit move gives
// value x 2^-8, the NaN codes are set to NaN, and one exact f16x2 multiply by 2^8 restores the value.
__device__ __forceinline__ u32 fp8x2_to_half2_int(u32 x) {
    u32 h = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
    h |= ((((x & 0x7f007f00u) + 0x01000100u) >> 15) & 0x00010001u) * 0x7fffu;  // (byte & 0x7f) == 0x7f: NaN
    return mul_f16x2_256(h);
}

// 4 e4m3fn bytes -> two f16x2 words: lo = bytes 0, 1 (byte 0 in the low half), hi = bytes 2, 3
__device__ __forceinline__ void fp8x4_to_half2x2(u32 w, u32 &lo, u32 &hi) {
    if constexpr (HAS_CVT_E4M3X2) {
        cvt_rn_f16x2_e4m3x2(w, lo, hi);
    } else {
        lo = fp8x2_to_half2_int(__byte_perm(w, 0u, 0x1404u));
        hi = fp8x2_to_half2_int(__byte_perm(w, 0u, 0x3424u));
    }
}

// c * tanh(x / c) without overflow: tanh(a) = -expm1(-2a) / (2 + expm1(-2a)) for a = |x / c| (the logits
// soft-cap, applied to the scaled scores)
__device__ __forceinline__ float soft_cap(float x, float c) {
    const float em = expm1f(-2.f * fabsf(x / c));
    return copysignf(c * (-em / (2.f + em)), x);
}
