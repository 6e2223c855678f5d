// Host emulation of the CUDA built-ins decode.cu uses, so its kernels run on a CPU (tests only).
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread; blocks run one after another.
// __syncthreads / __syncwarp are barriers over the block / warp, and a warp shuffle is a store to the
// warp's exchange slots, a barrier, a load of the partner's slot and another barrier, so lanes agree
// exactly as on the GPU as long as every lane of the warp reaches the shuffle (a divergent barrier is
// reported as a deadlock, never hangs). cp.async copies synchronously (src-size 0 writes zeros) and
// checks that its source lies inside one of the registered input buffers and its destination inside
// the block's dynamic shared memory, which starts filled with 0xff bytes (NaN) so unwritten reads show.
// fp16 / bf16 conversions round to nearest even like cvt.rn; ex2.approx.ftz is exp2f with denormal
// results flushed. What this cannot show: the real PTX instructions' behaviour, memory-model races
// between warps (each fiber runs until it blocks), alignment faults other than the ones checked,
// and performance.
#pragma once

#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };

namespace emu {

enum FiberState { RUNNABLE = 0, BLOCKED = 1, DONE = 2 };

struct Barrier {
    int count = 0;
    int arrived = 0;
    unsigned gen = 0;
};

struct Fiber {
    ucontext_t ctx;
    uint3 tid{0, 0, 0};
    FiberState state = RUNNABLE;
    Barrier *bar = nullptr;
    unsigned gen = 0;
    std::vector<char> stack;
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t sched;
    int cur = 0;
    std::vector<Barrier> warp_bar;
    Barrier block_bar;
    std::vector<uint32_t> slots;  // 32 per warp
    std::vector<unsigned char> smem;
};

struct Range {
    uintptr_t lo, hi;
};

inline Block *g_block = nullptr;
inline uint3 g_block_idx{0, 0, 0};
inline uint3 g_grid_dim{1, 1, 1};
inline uint3 g_block_dim{1, 1, 1};
inline std::vector<Range> g_ranges;
inline std::string g_error;
inline void (*g_body)() = nullptr;

inline void fail(const std::string &msg) {
    if (g_error.empty()) g_error = msg;
}

inline Fiber &cur() { return g_block->fibers[g_block->cur]; }
inline unsigned char *dynamic_smem() { return g_block->smem.data(); }

inline bool readable(const void *p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    for (const Range &r : g_ranges)
        if (a >= r.lo && a + n <= r.hi) return true;
    return false;
}

inline void barrier_wait(Barrier &b) {
    const unsigned gen = b.gen;
    if (++b.arrived == b.count) {  // last to arrive releases the others
        b.arrived = 0;
        b.gen++;
        for (Fiber &f : g_block->fibers)
            if (f.state == BLOCKED && f.bar == &b && f.gen == gen) f.state = RUNNABLE;
        return;
    }
    Fiber &me = cur();
    me.state = BLOCKED;
    me.bar = &b;
    me.gen = gen;
    swapcontext(&me.ctx, &g_block->sched);
}

inline void warp_barrier() { barrier_wait(g_block->warp_bar[cur().tid.x / 32]); }

template <class T>
inline T shfl_xor(T v, int off) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const unsigned t = cur().tid.x, lane = t & 31, w = t / 32;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    g_block->slots[w * 32 + lane] = bits;
    warp_barrier();
    bits = g_block->slots[w * 32 + ((lane ^ (unsigned)off) & 31)];
    warp_barrier();
    T r;
    std::memcpy(&r, &bits, 4);
    return r;
}

inline void cp_async16(void *dst, const void *src, bool valid) {
    unsigned char *s0 = g_block->smem.data();
    if ((unsigned char *)dst < s0 || (unsigned char *)dst + 16 > s0 + g_block->smem.size() || ((uintptr_t)dst & 15)) {
        fail("cp.async destination outside the dynamic shared memory or not 16-byte aligned");
        return;
    }
    if (!valid) {
        std::memset(dst, 0, 16);
        return;
    }
    if (((uintptr_t)src & 15) || !readable(src, 16)) {
        fail("cp.async source outside every input buffer or not 16-byte aligned");
        std::memset(dst, 0, 16);
        return;
    }
    std::memcpy(dst, src, 16);
}

inline float half_to_float(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline unsigned short float_to_half_rn(float f) {
    _Float16 x = (_Float16)f;  // round to nearest even
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}
inline unsigned short float_to_bf16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
inline float ex2_approx_ftz(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

inline void fiber_main() {
    g_body();
    cur().state = DONE;  // uc_link returns to the scheduler
}

// Run one block of `threads` threads executing `body`; false (and g_error) on deadlock.
inline bool run_block(uint3 block_idx, int threads, size_t smem_bytes, void (*body)()) {
    Block blk;
    g_block = &blk;
    g_block_idx = block_idx;
    g_body = body;
    blk.fibers.resize(threads);
    blk.warp_bar.resize((threads + 31) / 32);
    for (Barrier &b : blk.warp_bar) b.count = 32;
    blk.block_bar.count = threads;
    blk.slots.assign(blk.warp_bar.size() * 32, 0);
    blk.smem.assign(smem_bytes ? smem_bytes : 16, 0xff);
    for (int t = 0; t < threads; ++t) {
        Fiber &f = blk.fibers[t];
        f.tid = uint3{(unsigned)t, 0, 0};
        f.stack.resize(64 * 1024);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &blk.sched;
        makecontext(&f.ctx, (void (*)())fiber_main, 0);
    }
    for (;;) {
        bool ran = false, all_done = true;
        for (int t = 0; t < threads; ++t) {
            if (blk.fibers[t].state == DONE) continue;
            all_done = false;
            if (blk.fibers[t].state != RUNNABLE) continue;
            blk.cur = t;
            ran = true;
            swapcontext(&blk.sched, &blk.fibers[t].ctx);
        }
        if (all_done) break;
        if (!ran) {
            fail("barrier deadlock: threads of one block wait at different __syncthreads/__syncwarp/shuffles "
                 "or some returned early");
            g_block = nullptr;
            return false;
        }
    }
    g_block = nullptr;
    return true;
}

}  // namespace emu

#define threadIdx (emu::cur().tid)
#define blockIdx (emu::g_block_idx)
#define gridDim (emu::g_grid_dim)
#define blockDim (emu::g_block_dim)

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __int_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline void __syncthreads() { emu::barrier_wait(emu::g_block->block_bar); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) { return emu::shfl_xor(v, off); }
template <class T>
inline T __ldg(const T *p) {
    if (!emu::readable(p, sizeof(T))) {
        emu::fail("__ldg outside every input buffer (block table read out of bounds?)");
        return T{};
    }
    return *p;
}
