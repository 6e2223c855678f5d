// attnplan cuda_ptx: every inline-PTX instruction the kernels use, each behind a small function, and the host
// emulation's twin of each (ATTNPLAN_HOST_EMULATION: emulation/simt.h's emu:: functions, which implement the
// instructions as the PTX ISA documents them). The two sections define the same functions in the same order;
// nothing outside this header depends on which one is compiled.
//
//   conversions   cvt_f32_f16x2 (two packed fp16 -> two floats), cvt_rn_bf16 / cvt_rn_f16 (float -> 16 bits),
//                 pack2<BF16> (two floats -> packed bf16x2 / f16x2), mul_f16x2_256 (exact x 256 of two fp16),
//                 cvt_rn_f16x2_e4m3x2 (sm_89+ only: HAS_CVT_E4M3X2; convert.cuh holds its integer twin)
//   math          fast_exp2 (ex2.approx.ftz: ex2(-inf) = +0), fmax_nan (max.NaN: NaN if either input is NaN)
//   launches      pdl_launch_dependents / pdl_wait (griddepcontrol, sm_90+; no-ops below and on the host)
//   shared memory lds / sts (the host checks them for races and bounds), ATTNPLAN_DYNAMIC_SMEM
//   barriers      team_barrier (bar.sync id, threads: a named barrier of some warps of the program)
//   global memory ld_cg / ld_cg4 (ld.global.cg: L2, the coherence point), atom_add_acq_rel (gpu scope),
//                 check_aligned (the emulation's check of a vector access's alignment; nothing on the device),
//                 cp_async16 / cp_async_commit / cp_async_wait (16-byte cp.async.cg, src-size 0 zero-fills)
//   tensor cores  ldsm_x4<TRANS> (ldmatrix.x4), mma_16816<BF16> (mma.sync m16n8k16 f32 += {bf16,f16}),
//                 movmatrix_trans
//   codegen       pin (an empty asm that makes the compiler keep a pointer as computed)
#pragma once

#ifdef ATTNPLAN_HOST_EMULATION
// ============================================ host twins ============================================
__device__ __forceinline__ void cvt_f32_f16x2(u32 w, float &a, float &b) {
    a = emu::half_to_float((unsigned short)(w & 0xffffu));
    b = emu::half_to_float((unsigned short)(w >> 16));
}
__device__ __forceinline__ unsigned short cvt_rn_bf16(float x) { return emu::float_to_bf16_rn(x); }
__device__ __forceinline__ unsigned short cvt_rn_f16(float x) { return emu::float_to_half_rn(x); }
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return BF16 ? (u32)emu::float_to_bf16_rn(lo) | ((u32)emu::float_to_bf16_rn(hi) << 16)
                : (u32)emu::float_to_half_rn(lo) | ((u32)emu::float_to_half_rn(hi) << 16);
}
__device__ __forceinline__ u32 mul_f16x2_256(u32 h) {
    const u32 lo = emu::float_to_half_rn(emu::half_to_float((unsigned short)(h & 0xffffu)) * 256.f);
    const u32 hi = emu::float_to_half_rn(emu::half_to_float((unsigned short)(h >> 16)) * 256.f);
    return lo | (hi << 16);
}
// not emulated: the host runs its integer twin (convert.cuh, fp8x2_to_half2_int), as sm_80 / sm_86 compiles do
constexpr bool HAS_CVT_E4M3X2 = false;
void cvt_rn_f16x2_e4m3x2(u32 w, u32 &lo, u32 &hi);  // never defined: only named in discarded branches

__device__ __forceinline__ float fast_exp2(float x) { return emu::ex2_approx_ftz(x); }
__device__ __forceinline__ float fmax_nan(float a, float b) { return a != a || b != b ? QNAN_F : fmaxf(a, b); }

__device__ __forceinline__ void pdl_launch_dependents() {}
__device__ __forceinline__ void pdl_wait() {}

template <class T>
__device__ __forceinline__ T lds(const void *p) {
    if (!emu::smem_access(p, sizeof(T), 0)) return T{};
    return *reinterpret_cast<const T *>(p);
}
template <class T>
__device__ __forceinline__ void sts(void *p, const T &v) {
    if (!emu::smem_access(p, sizeof(T), 1)) return;
    *reinterpret_cast<T *>(p) = v;
}
#define ATTNPLAN_DYNAMIC_SMEM(name) unsigned char *name = emu::dynamic_smem()

// a global-memory vector access of `bytes` at p must be aligned to them (the device faults; x86 would not)
__device__ __forceinline__ void check_aligned(const void *p, int bytes) { emu::check_aligned(p, bytes); }

__device__ __forceinline__ float ld_cg(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float4 ld_cg4(const float *p) { return __ldcg(reinterpret_cast<const float4 *>(p)); }
// blocks run one at a time: a plain read-modify-write
__device__ __forceinline__ int atom_add_acq_rel(int *p, int v) { return atomicAdd(p, v); }
__device__ __forceinline__ void team_barrier(int id, int threads) { emu::named_barrier(id, threads); }

__device__ __forceinline__ void cp_async16(void *smem_ptr, const void *gptr, bool valid) {
    emu::cp_async16(smem_ptr, gptr, valid);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }

template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const unsigned char *row) { emu::ldmatrix_x4(r, row, TRANS); }
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 b0, const u32 b1) {
    const u32 b[2] = {b0, b1};
    emu::mma_m16n8k16(d, a, b, BF16);
}
__device__ __forceinline__ u32 movmatrix_trans(u32 x) { return emu::movmatrix_trans(x); }

template <typename T>
__device__ __forceinline__ const T *pin(const T *p) { return p; }

#else
// ============================================ inline PTX ============================================
constexpr int CUDA_ARCH = __CUDA_ARCH__;

// two packed fp16 (low half first) -> two floats, exactly (subnormals included)
__device__ __forceinline__ void cvt_f32_f16x2(u32 w, float &a, float &b) {
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
        : "=f"(a), "=f"(b) : "r"(w));
}
// float -> bf16 / fp16 bits, round to nearest even
__device__ __forceinline__ unsigned short cvt_rn_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ unsigned short cvt_rn_f16(float x) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
// two floats -> bf16x2 (BF16) or f16x2, packed (lo in the low half), round to nearest even
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));  // d = {cvt(a) hi, cvt(b) lo}
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// both fp16 halves x 256, exactly (mul.rn.f16x2 supports fp16 subnormals)
__device__ __forceinline__ u32 mul_f16x2_256(u32 h) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x5c005c00u));  // x {256, 256}
    return r;
}
// 4 e4m3fn bytes -> two f16x2 words: lo = bytes 0, 1 (byte 0 in the low half), hi = bytes 2, 3 (PTX ISA: the
// upper byte of the .b16 source goes to the upper half); sm_89+
constexpr bool HAS_CVT_E4M3X2 = CUDA_ARCH >= 890;
__device__ __forceinline__ void cvt_rn_f16x2_e4m3x2(u32 w, u32 &lo, u32 &hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi) : "r"(w));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// max(a, b), NaN if either is NaN (max.NaN.f32, sm_80+; fmaxf returns the other operand): the merges' lse maximum,
// so a NaN state never passes for an empty one
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
}

// Programmatic dependent launch (sm_90+, PTX griddepcontrol): the partial kernel lets the merge kernel that
// follows it in the stream launch as soon as every partial CTA is resident; the merge kernel's first act is to
// wait for the partial grid to complete with its memory visible. Both are no-ops when the launch does not opt in
// (host: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) and below sm_90.
__device__ __forceinline__ void pdl_launch_dependents() {
    if constexpr (CUDA_ARCH >= 900) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() {
    if constexpr (CUDA_ARCH >= 900) asm volatile("griddepcontrol.wait;" ::: "memory");
}

// shared-memory loads and stores (the host twins check them for races between warps and for accesses outside
// the launch's dynamic shared memory)
template <class T>
__device__ __forceinline__ T lds(const void *p) {
    return *reinterpret_cast<const T *>(p);
}
template <class T>
__device__ __forceinline__ void sts(void *p, const T &v) {
    *reinterpret_cast<T *>(p) = v;
}
#define ATTNPLAN_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

// the host emulation checks that global vector accesses are aligned; the device needs no code for it
__device__ __forceinline__ void check_aligned(const void *, int) {}

// ld.global.cg: served by L2 (the coherence point), never by L1 or the non-coherent (__ldg) path, and volatile
// with a "memory" clobber so the compiler cannot move it above a barrier or an atomic before it
__device__ __forceinline__ float ld_cg(const float *p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_cg4(const float *p) {  // p 16-byte aligned
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
                 : "memory");
    return v;
}
// gpu-scope atomic add of the PTX memory model (sm_70+), acquire and release: returns the old value
__device__ __forceinline__ int atom_add_acq_rel(int *p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
// bar.sync id, threads: the named barrier `id` (1-15; 0 is __syncthreads') of `threads` threads (whole warps), the
// warps of one team of the program
__device__ __forceinline__ void team_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void cp_async16(void *smem_ptr, const void *gptr, bool valid) {
    const u32 s = (u32)__cvta_generic_to_shared(smem_ptr);
    const int n = valid ? 16 : 0;  // src-size 0: no global read, 16 zero bytes written
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gptr), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- tensor cores (warp-collective: every lane of the warp executes them together) ----
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8j..8j+7 give the row addresses (16 bytes each) of
// 8x8 matrix j; r[j] is this lane's fragment of matrix j (row lane/4, columns 2*(lane%4), +1; .trans: of
// the transposed matrix).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const unsigned char *row) {
    const u32 a = (u32)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// d += A . B: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (fragments per the PTX ISA)
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 b0, const u32 b1) {
    if constexpr (BF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0),
              "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0),
              "r"(b1));
}
// movmatrix.sync.aligned.m8n8.trans.b16: this lane's fragment (row lane/4, columns 2*(lane%4), +1) of the
// transpose of the 8x8 matrix whose fragments the warp holds in x
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// A pointer the compiler must keep as computed (an empty asm that "changes" it), so that one wide add of a
// 32-bit offset forms each address from it (see copy.cuh, opaque)
template <typename T>
__device__ __forceinline__ const T *pin(const T *p) {
    asm volatile("" : "+l"(p));
    return p;
}
#endif
