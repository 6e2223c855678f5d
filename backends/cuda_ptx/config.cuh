// attnplan cuda_ptx: what both kernels share about their specialization.
//
// Every compile-time constant comes from the host (spec.py, KernelSpec.defines) as a -D macro. The macros are
// read once, here and in layout.cuh, into constexpr values; the code below them branches on those with
// `if constexpr`, not with the preprocessor. Macros of both kernels:
//
//   ATTNPLAN_KIND        0 = split partial (writes PartialState), 1 = single pass (writes out, lse), 2 = merge
//   ATTNPLAN_DTYPE       0 = float16, 1 = bfloat16, 2 = float32 (q and out; also the KV cache unless fp8)
//   ATTNPLAN_HEAD_DIM    head_dim (a multiple of 8; of 16 with an fp8 cache)
//   ATTNPLAN_THREADS     threads per block         } the host's own arithmetic (spec.py), checked against the
//   ATTNPLAN_SMEM_BYTES  dynamic shared memory     } kernel's by static_assert (layout.cuh): a mismatch fails
//                                                    the compile
// The partial / single-pass kernel's and the merge kernel's own macros: layout.cuh.
//
// No #include of CUDA toolkit headers: only NVRTC built-ins (the package's own headers travel to NVRTC as named
// header sources, source.py), so nothing of the toolkit is needed at run time. fp16 / bf16 conversions are
// inline PTX (cvt, sm_80+); fp8 e4m3fn is decoded with integer ops and the fp16 conversion on the CUDA-core path
// and with cvt.rn.f16x2.e4m3x2 on the tensor-core path from sm_89 on (ptx.cuh).
//
// ATTNPLAN_HOST_EMULATION (tests only): the same source compiles as host C++ against emulation/simt.h, which
// runs every CUDA thread as a fiber so the kernels' indexing, masking and merging can be executed on a CPU
// (emulate.py). Only the inline-PTX helpers of ptx.cuh have host twins; the kernels are the same text.
#pragma once

#if !defined(ATTNPLAN_KIND) || !defined(ATTNPLAN_DTYPE) || !defined(ATTNPLAN_HEAD_DIM) || \
    !defined(ATTNPLAN_THREADS) || !defined(ATTNPLAN_SMEM_BYTES)
#error "ATTNPLAN_KIND, _DTYPE, _HEAD_DIM, _THREADS and _SMEM_BYTES must be defined (-D)"
#endif

typedef long long i64;
typedef unsigned int u32;

#define ATTNPLAN_KIND_PARTIAL 0
#define ATTNPLAN_KIND_SINGLE 1
#define ATTNPLAN_KIND_MERGE 2

constexpr int KIND = ATTNPLAN_KIND;
constexpr int DTYPE = ATTNPLAN_DTYPE;  // 0 fp16, 1 bf16, 2 fp32
static_assert(KIND >= 0 && KIND <= 2 && DTYPE >= 0 && DTYPE <= 2, "ATTNPLAN_KIND and ATTNPLAN_DTYPE are 0, 1 or 2");
constexpr int HEAD_DIM = ATTNPLAN_HEAD_DIM;
static_assert(HEAD_DIM % 8 == 0, "head_dim must be a multiple of 8");

template <bool B, class T, class F> struct select_type { typedef T type; };
template <class T, class F> struct select_type<false, T, F> { typedef F type; };

// q's (and out's) element: fp32, or the 16 bits of an fp16 / bf16
typedef select_type<DTYPE == 2, float, unsigned short>::type elem_t;
constexpr int VEC = DTYPE == 2 ? 4 : 8;  // q elements per 16-byte vector

#define NEG_INF (__int_as_float(0xff800000))
#define QNAN_F (__int_as_float(0x7fffffff))
#define FLT_MAX_F (__int_as_float(0x7f7fffff))
#define FULL_MASK 0xffffffffu
#define LN2_F 0.69314718055994530942f

__host__ __device__ constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
