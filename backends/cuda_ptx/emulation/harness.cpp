// Host harness: decode.cu compiled as C++ (ATTNPLAN_HOST_EMULATION) behind a C entry point that takes
// the same kernelParams array cuLaunchKernel takes (args.PackedArgs), so the host argument packing
// is exercised too. Built and called by backends/cuda_ptx/emulate.py; tests only.
#include "simt.h"
#include "../decode.cu"

#include <algorithm>
#include <random>

namespace {
void **g_params = nullptr;
unsigned g_order_seed = 0;  // 0: blocks in order (x fastest); else a permutation drawn from this seed

template <class T>
T arg(int i) {
    T v;
    std::memcpy(&v, g_params[i], sizeof(T));
    return v;
}

void body() {
#if ATTNPLAN_KIND == ATTNPLAN_KIND_MERGE
    attnplan_merge(arg<const float *>(0), arg<const float *>(1), arg<const int *>(2), arg<elem_t *>(3),
                   arg<float *>(4), arg<const float *>(5), arg<int>(6), arg<int>(7), arg<int>(8),
                   arg<i64>(9), arg<i64>(10), arg<i64>(11),
                   arg<i64>(12), arg<i64>(13), arg<i64>(14),
                   arg<i64>(15), arg<i64>(16), arg<i64>(17),
                   arg<i64>(18), arg<i64>(19), arg<i64>(20));
#elif defined(ATTNPLAN_SCHEDULE_PROBE)
    attnplan_schedule_probe(arg<const int *>(0), arg<const int *>(1), arg<int *>(2), arg<const int *>(3),
                            arg<int *>(4), arg<int>(5), arg<int>(6), arg<int>(7), arg<int>(8), arg<int>(9),
                            arg<int>(10), arg<int>(11), arg<int>(12));
#else
    ATTNPLAN_ENTRY(arg<const elem_t *>(0), arg<const kv_t *>(1), arg<const kv_t *>(2), arg<const int *>(3),
                   arg<const int *>(4), arg<elem_t *>(5), arg<float *>(6), arg<const float *>(7),
                   arg<const float *>(8), arg<const float *>(9),
                   arg<float>(10), arg<float>(11), arg<int>(12), arg<int>(13), arg<int>(14), arg<int>(15),
                   arg<i64>(16), arg<i64>(17), arg<i64>(18),
                   arg<i64>(19), arg<i64>(20), arg<i64>(21),
                   arg<i64>(22), arg<i64>(23), arg<i64>(24),
                   arg<i64>(25),
                   arg<i64>(26), arg<i64>(27), arg<i64>(28), arg<i64>(29),
                   arg<i64>(30), arg<i64>(31), arg<i64>(32), arg<i64>(33),
                   arg<const int *>(34), arg<int *>(35), arg<int *>(36), arg<float *>(37), arg<float *>(38),
                   arg<int>(39), arg<int>(40), arg<int>(41),
                   arg<i64>(42), arg<i64>(43),
                   arg<i64>(44), arg<i64>(45),
                   arg<int>(46), arg<int>(47), arg<int>(48));
#endif
}
}  // namespace

// The order later launches run their blocks in: seed 0 = in order (x fastest, then y, then z), else a
// permutation drawn from `seed` (so the program that finishes a fused merge's group last varies).
extern "C" void emu_block_order(unsigned seed) { g_order_seed = seed; }

// Launch grid (gx, gy, gz) x `threads` threads with `smem` bytes of dynamic shared memory.
// `ranges` holds `nranges` (start, end) byte ranges the kernel may read through cp.async / __ldg / __ldcg
// (and update with atomics). Returns 0, or 1 with the first error copied into `err`.
extern "C" int emu_launch(unsigned gx, unsigned gy, unsigned gz, int threads, unsigned long long smem,
                          void **params, const unsigned long long *ranges, int nranges, char *err, int errlen) {
    emu::g_error.clear();
    emu::g_ranges.clear();
    for (int i = 0; i < nranges; ++i) emu::g_ranges.push_back({(uintptr_t)ranges[2 * i], (uintptr_t)ranges[2 * i + 1]});
    emu::g_grid_dim = uint3{gx, gy, gz};
    emu::g_block_dim = uint3{(unsigned)threads, 1, 1};
    g_params = params;
    std::vector<uint3> blocks;
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) blocks.push_back(uint3{x, y, z});
    if (g_order_seed) {
        std::mt19937 rng(g_order_seed);
        std::shuffle(blocks.begin(), blocks.end(), rng);
    }
    for (size_t k = 0; k < blocks.size() && emu::g_error.empty(); ++k)
        emu::run_block(blocks[k], threads, (size_t)smem, body);
    if (!emu::g_error.empty()) {
        std::snprintf(err, (size_t)errlen, "%s", emu::g_error.c_str());
        return 1;
    }
    return 0;
}

// Kernel constants as the kernel computes them (the host checks its own arithmetic against these).
extern "C" int emu_constant(const char *name) {
    const std::string n(name);
#if ATTNPLAN_KIND != ATTNPLAN_KIND_MERGE
    if (n == "smem") return SMEM_BYTES;
    if (n == "tile") return TILE;
    if (n == "threads") return NTHREADS;
    if (n == "lpt") return LPT;
    if (n == "rt") return RT;
    if (n == "mma") return MMA ? 1 : 0;
    if (n == "ntw") return NTW;
    if (n == "rs") return RS;
#else
    if (n == "threads") return MERGE_THREADS;
    if (n == "teams") return MERGE_TEAMS;
    if (n == "smem") return MERGE_SMEM_BYTES;
    if (n == "chunk") return MERGE_CHUNK;
#endif
    return -1;
}
