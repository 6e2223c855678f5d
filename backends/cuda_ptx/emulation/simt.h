// Host emulation of the CUDA built-ins decode.cu uses, so its kernels run on a CPU (tests only).
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread; blocks run one after another.
// __syncthreads / __syncwarp are barriers over the block / warp, and a warp shuffle is a store to the
// warp's exchange slots, a barrier, a load of the partner's slot and another barrier, so lanes agree
// exactly as on the GPU as long as every lane of the warp reaches the shuffle (a divergent barrier is
// reported as a deadlock, never hangs). cp.async copies synchronously (src-size 0 writes zeros) and
// checks that its source lies inside one of the registered input buffers and its destination inside
// the block's dynamic shared memory, which starts filled with 0xff bytes (NaN) so unwritten reads show.
// The tensor-core instructions of decode.cu's MMA path are warp-collective twins built the same way: each
// lane publishes its operands (ldmatrix: its row address; mma.sync / movmatrix: its fragment registers) in
// the warp's exchange slots, a barrier, each lane assembles its result fragment from the others' per the
// PTX ISA's fragment layouts, another barrier. mma.sync m16n8k16 with fp16 / bf16 inputs sums the exact
// products and the accumulator in double and rounds once to fp32 (the hardware's fp32 accumulation order
// is unspecified; this is at least as accurate). ldmatrix records each lane's 16-byte row read for the
// race check.
// fp16 / bf16 conversions round to nearest even like cvt.rn (fp16 -> fp32 exactly, subnormals included,
// which the fp8 decoder relies on); __byte_perm is prmt's default mode; ex2.approx.ftz is exp2f with denormal
// results flushed. cvt.rn.f16x2.e4m3x2's twin is decode.cu's integer decoder (fp8x2_to_half2_int, also the
// sm_80 fallback), built on these. __shfl_sync / __shfl_xor_sync / __shfl_up_sync share one exchange (__any_sync is
// a butterfly over it, __ballot_sync and __reduce_add_sync / __reduce_max_sync / __reduce_min_sync too); __clz
// counts leading zeros (32 for 0), __ffs finds the lowest set bit.
// Shared-memory race check: the kernel's shared-memory loads and stores (decode.cu's lds / sts helpers)
// and cp.async copies are recorded per 4-byte word with the warp and the __syncthreads epoch. A copy
// counts as written only when its issuing thread's cp.async.wait_group retires its group (then in that
// epoch); it is an error to read a word whose copy is still in flight, to read a word another warp
// wrote in the current epoch (no __syncthreads between), to write (or copy into) a word another warp
// read or wrote in the current epoch, or to copy into a word with a copy still in flight. Lanes of one
// warp are not checked against each other (they order through __syncwarp and shuffles).
// Global-memory atomics (atomicAdd / atomicExch on int), for decode.cu's fused merge: blocks run one after another on
// one OS thread, so a read-modify-write is atomic as written; they check that the word lies in a registered buffer.
// __ldcg (ld.global.cg) is a load from a registered buffer, like __ldg. emu_launch may run the blocks in a permuted
// order (harness.cpp), so the program that finishes a group last is not always its last split.
// What this cannot show: the real PTX instructions' behaviour, races through global memory (concurrent
// blocks, memory ordering), orders the fiber schedule (each fiber runs until it blocks) happens not to
// produce for intra-warp hazards, alignment faults other than the ones checked, and performance.
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
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

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
    std::vector<size_t> open_copies;                // words of cp.async copies not yet committed
    std::vector<std::vector<size_t>> copy_groups;   // committed cp.async groups, oldest first
};

// race-check state of one 4-byte word of shared memory
struct Word {
    int w_warp = -1;           // warp of the last completed write
    unsigned w_epoch = ~0u;    // __syncthreads epoch of that write
    int pending = 0;           // cp.async copies in flight into this word
    unsigned r_epoch = ~0u;    // epoch of the reads in r_warps
    uint64_t r_warps = 0;      // warps that read the word in r_epoch
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t sched;
    int cur = 0;
    std::vector<Barrier> warp_bar;
    Barrier block_bar;
    Barrier named_bar[16];        // bar.sync id, threads (id 1-15; 0 is block_bar)
    std::vector<uint32_t> slots;  // 32 per warp
    std::vector<uint64_t> xch;    // 32 x 8 per warp: operands of the warp-collective tensor-core twins
    std::vector<unsigned char> smem;
    std::vector<Word> words;      // one per 4 bytes of smem
    unsigned epoch = 0;           // completed __syncthreads
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
        if (&b == &g_block->block_bar) g_block->epoch++;
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

// bar.sync id, threads: the named barrier id (1-15) of `threads` threads (whole warps); every arrival of one
// generation names the same count
inline void named_barrier(int id, int threads) {
    if (id < 1 || id > 15 || threads <= 0 || threads % 32 || threads > (int)g_block->fibers.size()) {
        fail("bar.sync: id 1-15 and a positive multiple of 32 threads, at most the block's");
        return;
    }
    Barrier &b = g_block->named_bar[id];
    if (b.arrived == 0) b.count = threads;
    else if (b.count != threads) fail("bar.sync: threads of one named barrier name different counts");
    barrier_wait(b);
}

// __shfl_xor_sync (xor = true: partner lane ^ arg) or __shfl_sync (xor = false: source lane arg)
template <class T>
inline T shfl(T v, int arg, bool xor_) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const unsigned t = cur().tid.x, lane = t & 31, w = t / 32;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    g_block->slots[w * 32 + lane] = bits;
    warp_barrier();
    bits = g_block->slots[w * 32 + ((xor_ ? lane ^ (unsigned)arg : (unsigned)arg) & 31)];
    warp_barrier();
    T r;
    std::memcpy(&r, &bits, 4);
    return r;
}

// __shfl_up_sync: the value of lane - delta (this lane's own below delta)
template <class T>
inline T shfl_up(T v, unsigned delta) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const unsigned t = cur().tid.x, lane = t & 31, w = t / 32;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    g_block->slots[w * 32 + lane] = bits;
    warp_barrier();
    if (lane >= delta) bits = g_block->slots[w * 32 + lane - delta];
    warp_barrier();
    T r;
    std::memcpy(&r, &bits, 4);
    return r;
}

// Record an access of n bytes at p (shared memory) for the race check; false (and g_error) if it
// leaves the dynamic shared memory or races.
inline bool smem_access(const void *p, size_t n, int kind /* 0 load, 1 store, 2 cp.async */) {
    Block &blk = *g_block;
    unsigned char *s0 = blk.smem.data();
    const unsigned char *c = (const unsigned char *)p;
    if (c < s0 || c + n > s0 + blk.smem.size() || ((uintptr_t)c & (n >= 16 ? 15 : n - 1))) {
        fail(kind == 2 ? "cp.async destination outside the dynamic shared memory or not 16-byte aligned"
                       : "shared-memory access outside the dynamic shared memory or misaligned");
        return false;
    }
    Fiber &f = cur();
    const int warp = (int)(f.tid.x / 32);
    const uint64_t me = 1ull << (warp & 63);
    const unsigned ep = blk.epoch;
    const size_t w0 = (size_t)(c - s0) / 4, w1 = ((size_t)(c - s0) + n + 3) / 4;
    for (size_t i = w0; i < w1; ++i) {
        Word &w = blk.words[i];
        if (kind == 0) {
            if (w.pending) {
                fail("shared-memory race: a read of a word whose cp.async copy its issuing thread has not waited "
                     "for (cp.async.wait_group)");
                return false;
            }
            if (w.w_epoch == ep && w.w_warp != warp) {
                fail("shared-memory race: a warp reads a word another warp wrote with no __syncthreads between");
                return false;
            }
            if (w.r_epoch != ep) {
                w.r_epoch = ep;
                w.r_warps = 0;
            }
            w.r_warps |= me;
        } else {
            if (w.pending) {
                fail("shared-memory race: a write to a word with a cp.async copy still in flight");
                return false;
            }
            if (w.r_epoch == ep && (w.r_warps & ~me)) {
                fail("shared-memory race: a warp overwrites a word another warp read with no __syncthreads between");
                return false;
            }
            if (w.w_epoch == ep && w.w_warp != warp) {
                fail("shared-memory race: two warps write one word with no __syncthreads between");
                return false;
            }
            if (kind == 2) {
                w.pending++;
                f.open_copies.push_back(i);
            } else {
                w.w_warp = warp;
                w.w_epoch = ep;
            }
        }
    }
    return true;
}

// a global-memory vector access must be aligned to its size (the device faults on a misaligned one)
inline void check_aligned(const void *p, int bytes) {
    if ((uintptr_t)p & (uintptr_t)(bytes - 1)) fail("misaligned global vector access (" + std::to_string(bytes) + " bytes)");
}

inline void cp_async_commit() {
    Fiber &f = cur();
    f.copy_groups.push_back(std::move(f.open_copies));
    f.open_copies.clear();
}

// cp.async.wait_group n: the calling thread's committed groups but the newest n have landed
inline void cp_async_wait(int n) {
    Fiber &f = cur();
    const int warp = (int)(f.tid.x / 32);
    while ((int)f.copy_groups.size() > n) {
        for (size_t i : f.copy_groups.front()) {
            Word &w = g_block->words[i];
            w.pending--;
            w.w_warp = warp;
            w.w_epoch = g_block->epoch;
        }
        f.copy_groups.erase(f.copy_groups.begin());
    }
}

inline void cp_async16(void *dst, const void *src, bool valid) {
    if (!smem_access(dst, 16, 2)) return;
    if (!valid) {  // src-size 0 reads nothing, but the kernel still passes an in-range, aligned address
        if (((uintptr_t)src & 15) || !readable(src, 16))
            fail("zero-filled cp.async chunk's source outside every input buffer or not 16-byte aligned");
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

inline float half_to_float(unsigned short h);

// ---- tensor-core twins (warp-collective; see the header comment) ----
inline uint64_t *warp_xch() { return &g_block->xch[(cur().tid.x / 32) * 32 * 8]; }

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 address the rows of matrix j; r[j] is
// this lane's fragment of matrix j (row lane/4, columns 2*(lane%4), +1), of its transpose with .trans
inline void ldmatrix_x4(unsigned (&r)[4], const void *row, bool trans) {
    const unsigned lane = cur().tid.x & 31;
    uint64_t *x = warp_xch();
    x[lane * 8] = smem_access(row, 16, 0) ? (uint64_t)(uintptr_t)row : 0;  // 0: reported, reads as zeros
    warp_barrier();
    const unsigned g = lane / 4, t = lane % 4;
    for (int j = 0; j < 4; ++j) {
        unsigned short e[2] = {0, 0};
        for (int i = 0; i < 2; ++i) {
            // element (row, col) of matrix j is at byte 2*col of row `row`'s address
            const unsigned rw = trans ? 2 * t + i : g, col = trans ? g : 2 * t + i;
            const unsigned char *p = (const unsigned char *)(uintptr_t)x[(8 * j + rw) * 8];
            if (p) std::memcpy(&e[i], p + 2 * col, 2);
        }
        r[j] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
    warp_barrier();
}

inline float b16_to_float(unsigned bits, bool bf16) {
    return bf16 ? __builtin_bit_cast(float, bits << 16) : half_to_float((unsigned short)bits);
}

// d += A . B, mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32. Fragments (g = lane/4,
// t = lane%4): A[16x16] a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B[16x8] b0
// (2t..2t+1, g), b1 (2t+8.., g); C/D[16x8] d0, d1 (g, 2t, 2t+1), d2, d3 (g+8, 2t, 2t+1); the lower
// column / row index in the low half.
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool bf16) {
    const unsigned lane = cur().tid.x & 31;
    uint64_t *x = warp_xch();
    for (int i = 0; i < 4; ++i) x[lane * 8 + i] = a[i];
    for (int i = 0; i < 2; ++i) x[lane * 8 + 4 + i] = b[i];
    warp_barrier();
    auto half = [&](unsigned ln, unsigned reg, unsigned hi) { return (unsigned)(x[ln * 8 + reg] >> (16 * hi)) & 0xffffu; };
    auto A = [&](unsigned i, unsigned k) {
        return b16_to_float(half((i % 8) * 4 + (k % 8) / 2, (i >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k & 1), bf16);
    };
    auto B = [&](unsigned k, unsigned j) { return b16_to_float(half(j * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k & 1), bf16); };
    const unsigned g = lane / 4, t = lane % 4;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const unsigned i = g + 8 * (e >> 1), j = 2 * t + (e & 1);
        double acc = d[e];
        for (unsigned k = 0; k < 16; ++k) acc += (double)A(i, k) * (double)B(k, j);
        out[e] = (float)acc;
    }
    warp_barrier();
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// movmatrix.sync.aligned.m8n8.trans.b16: this lane's fragment of the transposed 8x8 matrix
inline unsigned movmatrix_trans(unsigned v) {
    const unsigned lane = cur().tid.x & 31;
    uint64_t *x = warp_xch();
    x[lane * 8] = v;
    warp_barrier();
    const unsigned g = lane / 4, t = lane % 4;
    // element (row, col) of the source sits in lane row*4 + col/2, half col%2
    auto el = [&](unsigned rw, unsigned col) { return (unsigned)(x[(rw * 4 + col / 2) * 8] >> (16 * (col & 1))) & 0xffffu; };
    const unsigned r = el(2 * t, g) | (el(2 * t + 1, g) << 16);
    warp_barrier();
    return r;
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
    blk.xch.assign(blk.warp_bar.size() * 32 * 8, 0);
    blk.smem.assign(smem_bytes ? smem_bytes : 16, 0xff);
    blk.words.assign(blk.smem.size() / 4, Word{});
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
// prmt's default mode: byte i of the result is byte (s >> 4i) & 7 of the 8-byte value {y, x}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline void __syncthreads() { emu::barrier_wait(emu::g_block->block_bar); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) { return emu::shfl(v, off, true); }
template <class T>
inline T __shfl_sync(unsigned, T v, int src) { return emu::shfl(v, src, false); }
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) { return emu::shfl_up(v, delta); }
// vote.any: whether any lane of the warp passes a nonzero predicate
inline int __any_sync(unsigned, int pred) {
    for (int off = 1; off < 32; off <<= 1) pred |= emu::shfl(pred, off, true);  // butterfly OR: every lane the same
    return pred != 0;
}
// vote.ballot: bit L set where lane L's predicate is nonzero, the same mask in every lane (a butterfly OR)
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned m = pred ? 1u << (emu::cur().tid.x & 31) : 0u;
    for (int off = 1; off < 32; off <<= 1) m |= emu::shfl(m, off, true);
    return m;
}
// redux.sync (sm_80): the warp's sum / maximum / minimum of an int, the same in every lane (butterflies over the
// exchange)
inline int __reduce_add_sync(unsigned, int v) {
    for (int off = 1; off < 32; off <<= 1) v += emu::shfl(v, off, true);
    return v;
}
inline int __reduce_max_sync(unsigned, int v) {
    for (int off = 1; off < 32; off <<= 1) {
        const int o = emu::shfl(v, off, true);
        v = o > v ? o : v;
    }
    return v;
}
inline int __reduce_min_sync(unsigned, int v) {
    for (int off = 1; off < 32; off <<= 1) {
        const int o = emu::shfl(v, off, true);
        v = o < v ? o : v;
    }
    return v;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }  // 1 + the lowest set bit's index, 0 for 0
template <class T>
inline T __ldg(const T *p) {
    if (!emu::readable(p, sizeof(T))) {
        emu::fail("__ldg outside every input buffer (block table read out of bounds?)");
        return T{};
    }
    return *p;
}
template <class T>
inline T __ldcg(const T *p) {
    if (((uintptr_t)p & (alignof(T) - 1)) || !emu::readable(p, sizeof(T))) {
        emu::fail("__ldcg (ld.global.cg) outside every registered buffer or misaligned");
        return T{};
    }
    return *p;
}
inline bool emu_atomic_ok(const int *p) {
    if (((uintptr_t)p & 3) || !emu::readable(p, 4)) {
        emu::fail("atomic on a word outside every registered buffer (counters) or misaligned");
        return false;
    }
    return true;
}
inline int atomicAdd(int *p, int v) {
    if (!emu_atomic_ok(p)) return 0;
    const int old = *p;
    *p = old + v;
    return old;
}
inline int atomicExch(int *p, int v) {
    if (!emu_atomic_ok(p)) return 0;
    const int old = *p;
    *p = v;
    return old;
}
