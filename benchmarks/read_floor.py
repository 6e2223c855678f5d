"""How fast can any kernel read N bytes on this device, under the decode benchmark's method?

Step targets such as "b1 32/8/128 KV 4K in 8 us" are set against times of whole steps.
``bench_decode.read_bound`` gives one reference
for a step's bytes, one Triton read kernel (``read_us``), and the step floor (``floor_us``, a graph holding one
1-element kernel). Whether a target such as "b1 32/8/128 KV 4K in 8 us" (16.8 MB) or "92% of the ceiling at
256 MiB" can be met by a kernel that has to read those bytes depends on how good that one read kernel is. This
searches for a faster read: for each byte count, every configuration of

- ``triton``: the reference kernel (one tile per program), tile 1-32K elements x 4 / 8 warps;
- ``ldg``: CUDA C (NVRTC), 16-byte ``ld.global.nc.L1::no_allocate`` loads unrolled ``U`` times per thread (ptxas
  keeps at most about 4 of them outstanding per thread at U = 4 and 8: 32 registers), 1-16 CTAs per SM,
  256 / 512 / 1024 threads, the buffer walked grid-stride or one contiguous chunk per CTA;
- ``bulk``: CUDA C, Hopper's bulk copy engine (``cp.async.bulk`` global -> shared with an mbarrier, as TMA
  kernels stream; no tensor map needed for 1-D), ``S`` chunks of ``C`` bytes in flight per CTA, 1-4 CTAs per SM
  (configurations over 220 KB of shared memory per SM are left out and listed as skipped); the bytes past the last
  whole chunk are read with 16-byte loads by the last CTA;
- ``torch_sum``: ``torch.sum`` of the buffer,

timed as the benchmark times a step (CUDA-graph replay, L2 flushed in front, CUDA events, median of ``--iters``;
:func:`attnplan.timing.time_cuda`). Every kernel's result is checked after its timing: the buffer holds bf16 integers
in [-8, 8], so the Triton tiles' fp32 partial sums and ``torch.sum``'s fp32 total are exact and must equal the
buffer's sum, and each CUDA C kernel writes one uint32 word-sum per CTA whose total mod 2**32 must equal torch's sum
of the buffer's 32-bit words. A kernel that skipped bytes is reported as wrong, not fast. Byte counts are rounded
down to a multiple of 16 (the bytes actually read are reported).

    python benchmarks/read_floor.py --bytes 16793600,67125248,268451840,536887296 --out read_floor.json

Needs a CUDA device (sm_90 for ``bulk``); prints a table and writes JSON.
"""

import argparse
import itertools
import json
import statistics

import torch

from attnplan.timing import capture_graphs, time_cuda

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void block_sum_store(u32 acc, u32* out) {
    __shared__ u32 warp_sums[32];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? warp_sums[threadIdx.x] : 0u;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) out[blockIdx.x] = acc;
    }
}

// n16: the buffer's length in 16-byte words. CHUNKED = 0: grid-stride; 1: CTA b reads one contiguous chunk.
template <int U, int CHUNKED>
__device__ __forceinline__ void read_ldg(const uint4* __restrict__ x, long long n16, u32* __restrict__ out) {
    long long begin, end, step;
    if (CHUNKED) {
        long long per = (n16 + gridDim.x - 1) / gridDim.x;
        begin = (long long)blockIdx.x * per + threadIdx.x;
        end = min(n16, (long long)(blockIdx.x + 1) * per);
        step = blockDim.x;
    } else {
        begin = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        end = n16;
        step = (long long)gridDim.x * blockDim.x;
    }
    u32 acc = 0;
    long long i = begin;
    for (; i + (U - 1) * step < end; i += U * step) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ldg_stream(x + i + u * step);
#pragma unroll
        for (int u = 0; u < U; ++u) acc += v[u].x + v[u].y + v[u].z + v[u].w;
    }
    for (; i < end; i += step) {
        uint4 v = ldg_stream(x + i);
        acc += v.x + v.y + v.z + v.w;
    }
    block_sum_store(acc, out);
}

#define LDG(U, C) extern "C" __global__ void read_ldg_u##U##_c##C(const uint4* x, long long n16, u32* out) \
    { read_ldg<U, C>(x, n16, out); }
LDG(1, 0) LDG(2, 0) LDG(4, 0) LDG(8, 0) LDG(1, 1) LDG(2, 1) LDG(4, 1) LDG(8, 1)

// Hopper bulk copy: CTA b streams chunks b, b + grid, ... of CHUNK bytes through a ring of S shared-memory
// stages; thread 0 issues each copy with an mbarrier expecting CHUNK bytes; every thread then sums its words of
// the stage. nbytes: a multiple of 16; the bytes past the last whole chunk are read by the last CTA with loads.
template <int S, int CHUNK>
__device__ __forceinline__ void read_bulk(const char* __restrict__ x, long long nbytes, u32* __restrict__ out) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bars[S];
    const long long nchunks = nbytes / CHUNK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            u32 b = (u32)__cvta_generic_to_shared(&bars[s]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int s, long long c) {
        u32 b = (u32)__cvta_generic_to_shared(&bars[s]);
        u32 dst = (u32)__cvta_generic_to_shared(ring + (size_t)s * CHUNK);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(CHUNK) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(dst), "l"(x + c * CHUNK), "r"(CHUNK), "r"(b) : "memory");
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < S; ++s) {
            long long c = blockIdx.x + (long long)s * gridDim.x;
            if (c < nchunks) issue(s, c);
        }
    u32 acc = 0;
    int s = 0;
    u32 phase = 0;
    for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u32 b = (u32)__cvta_generic_to_shared(&bars[s]);
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(b), "r"(phase) : "memory");
        const uint4* st = reinterpret_cast<const uint4*>(ring + (size_t)s * CHUNK);
        for (int i = threadIdx.x; i < CHUNK / 16; i += blockDim.x) {
            uint4 v = st[i];
            acc += v.x + v.y + v.z + v.w;
        }
        __syncthreads();  // every thread is done with stage s before it is refilled
        long long next = c + (long long)S * gridDim.x;
        if (threadIdx.x == 0 && next < nchunks) issue(s, next);
        if (++s == S) { s = 0; phase ^= 1u; }
    }
    if (blockIdx.x == gridDim.x - 1)
        for (long long i = nchunks * (CHUNK / 16) + threadIdx.x; i < nbytes / 16; i += blockDim.x) {
            uint4 v = ldg_stream(reinterpret_cast<const uint4*>(x) + i);
            acc += v.x + v.y + v.z + v.w;
        }
    block_sum_store(acc, out);
#endif
}

#define BULK(S, KB) extern "C" __global__ void read_bulk_s##S##_k##KB(const char* x, long long nbytes, u32* out) \
    { read_bulk<S, KB * 1024>(x, nbytes, out); }
BULK(2, 16) BULK(4, 16) BULK(8, 16) BULK(4, 32) BULK(2, 64) BULK(3, 64)
"""

LDG_KERNELS = [(u, c) for c in (0, 1) for u in (1, 2, 4, 8)]
BULK_KERNELS = [(2, 16), (4, 16), (8, 16), (4, 32), (2, 64), (3, 64)]


class CudaReads:
    """The CUDA C read kernels of :data:`SOURCE`, compiled by NVRTC for this device and launched with
    ``cuLaunchKernel`` on torch's current stream (captured by CUDA graphs)."""

    def __init__(self):
        from attnplan.backends.cuda_ptx._bindings import bindings, check_driver
        from attnplan.backends.cuda_ptx.nvrtc import compile_source, select_target

        self.driver, _ = bindings()
        self.check = check_driver
        torch.cuda.init()
        d = self.driver
        check_driver(d.cuInit(0), "cuInit")
        dev = check_driver(d.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
        ctx = check_driver(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check_driver(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        cc = torch.cuda.get_device_capability()
        target = select_target(cc)
        self.has_bulk = cc >= (9, 0) and target.kind == "cubin"
        compiled = compile_source(SOURCE, "read_floor.cu", ["-std=c++17"], target)
        self.resources = compiled.resources
        self.module = check_driver(d.cuModuleLoadData(compiled.image), "cuModuleLoadData")
        self.fns = {}
        names = [f"read_ldg_u{u}_c{c}" for u, c in LDG_KERNELS]
        if self.has_bulk:
            names += [f"read_bulk_s{s}_k{k}" for s, k in BULK_KERNELS]
        for name in names:
            fn = check_driver(d.cuModuleGetFunction(self.module, name.encode()), name)
            self.fns[name] = fn
        for s, k in BULK_KERNELS if self.has_bulk else []:
            check_driver(d.cuFuncSetAttribute(
                self.fns[f"read_bulk_s{s}_k{k}"], d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                s * k * 1024), "cuFuncSetAttribute")

    def launch(self, name, grid, block, smem, *args):
        """``args``: (value, ctype) pairs, ctype one of 'p' (pointer), 'q' (int64)."""
        import ctypes

        vals = [ctypes.c_void_p(v) if t == "p" else ctypes.c_longlong(v) for v, t in args]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = torch.cuda.current_stream().cuda_stream
        self.check(self.driver.cuLaunchKernel(self.fns[name], grid, 1, 1, block, 1, 1, smem, stream,
                                              ctypes.addressof(ptrs), 0), name)
        return vals, ptrs  # kept alive by the caller until the launch is captured


def word_sum(x: torch.Tensor) -> int:
    """The sum of ``x``'s 32-bit words mod 2**32 (the CUDA C kernels' checksum)."""
    return int(x.view(torch.int32).to(torch.int64).sum().item()) & 0xFFFFFFFF


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="16793600,67125248,268451840,536887296",
                    help="byte counts (default: b1 32/8/128 at KV 4K, 16K, 64K, 128K; the last two are 256 / 512 MiB)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args()
    from attnplan._read_kernel import _read_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cuda = CudaReads()
    one = torch.zeros(1, device="cuda")
    (g,) = capture_graphs(lambda j: one.add_(1.0), 1)
    floor = time_cuda(lambda i: g.replay(), warmup=10, iters=a.iters, flush=True)["median_us"]
    result = {"sms": sms, "floor_us": floor, "resources": cuda.resources, "sizes": []}
    print(f"floor (one 1-element kernel, graph replay) {floor:.2f} us", flush=True)
    for nbytes in map(int, a.bytes.split(",")):
        n16 = nbytes // 16
        nbytes = n16 * 16  # what is read
        xb = torch.randint(-8, 9, (n16 * 8,), dtype=torch.int16, device="cuda").to(torch.bfloat16)
        x = xb.view(torch.int32)
        want_words = word_sum(x)
        want_sum = float(xb.double().sum().item())  # exact: integers
        out = torch.empty(64 * sms, dtype=torch.int32, device="cuda")
        fsum = torch.empty((), dtype=torch.float32, device="cuda")
        rows, skipped = [], []

        def timed(family, config, step, check, outputs):
            """Time ``step`` (graph replay); then zero its ``outputs``, replay it once more and ``check()`` them."""
            keep = []
            (gr,) = capture_graphs(lambda j: keep.append(step()), 1)
            t = time_cuda(lambda i: gr.replay(), warmup=10, iters=a.iters, flush=True)["median_us"]
            for o in outputs:
                o.zero_()
            gr.replay()
            torch.cuda.synchronize()
            rows.append({"family": family, "config": config, "us": t, "ok": bool(check())})

        timed("torch_sum", {}, lambda: torch.sum(xb, dim=0, dtype=torch.float32, out=fsum),
              lambda: float(fsum.item()) == want_sum, [fsum])
        for block, warps in itertools.product((1024, 2048, 4096, 8192, 16384, 32768), (4, 8)):
            tiles = -(-xb.numel() // block)
            part = torch.empty(tiles, device="cuda", dtype=torch.float32)
            timed("triton", {"block": block, "num_warps": warps},
                  lambda: _read_kernel[(tiles,)](xb, part, xb.numel(), BLOCK=block, num_warps=warps),
                  lambda: float(part.double().sum().item()) == want_sum, [part])
        for (u, c), threads, per_sm in itertools.product(LDG_KERNELS, (256, 512, 1024), (1, 2, 4, 8, 16)):
            if threads * per_sm > 2048:
                continue
            grid = per_sm * sms
            timed("ldg", {"unroll": u, "chunked": c, "threads": threads, "ctas_per_sm": per_sm},
                  lambda: cuda.launch(f"read_ldg_u{u}_c{c}", grid, threads, 0,
                                      (x.data_ptr(), "p"), (n16, "q"), (out.data_ptr(), "p")),
                  lambda: word_sum(out[:grid]) == want_words, [out])
        if cuda.has_bulk:
            for (s, k), threads, per_sm in itertools.product(BULK_KERNELS, (128, 256), (1, 2, 3, 4)):
                config = {"stages": s, "chunk_kb": k, "threads": threads, "ctas_per_sm": per_sm}
                if per_sm * s * k > 220:  # KB of shared memory per SM
                    skipped.append({"family": "bulk", "config": config, "why": "over 220 KB of shared memory per SM"})
                    continue
                grid = per_sm * sms
                timed("bulk", config,
                      lambda: cuda.launch(f"read_bulk_s{s}_k{k}", grid, threads, s * k * 1024,
                                          (x.data_ptr(), "p"), (nbytes, "q"), (out.data_ptr(), "p")),
                      lambda: word_sum(out[:grid]) == want_words, [out])
        bad = [r for r in rows if r["ok"] is False]
        best = {}
        for r in rows:
            if r["ok"] is not False and (r["family"] not in best or r["us"] < best[r["family"]]["us"]):
                best[r["family"]] = r
        result["sizes"].append({"bytes": nbytes, "rows": rows, "skipped": skipped, "best": best, "wrong": len(bad)})
        print(f"\n{nbytes / 1e6:.1f} MB ({len(rows)} kernels, {len(bad)} wrong results, {len(skipped)} skipped)")
        for fam, r in sorted(best.items(), key=lambda kv: kv[1]["us"]):
            print(f"  {fam:9s} {r['us']:8.2f} us  {nbytes / r['us'] / 1e3:6.0f} GB/s  {r['config']}")
        med = statistics.median(r["us"] for r in rows if r["family"] == "ldg")
        print(f"  (ldg median over its configurations {med:.2f} us)", flush=True)
        del x, xb, out
        torch.cuda.empty_cache()
    print("\n| MB | floor us | best read us | family | GB/s | read - floor us |\n|---|---|---|---|---|---|")
    for s in result["sizes"]:
        r = min(s["best"].values(), key=lambda r: r["us"])
        print(f"| {s['bytes'] / 1e6:.1f} | {floor:.2f} | {r['us']:.2f} | {r['family']} | "
              f"{s['bytes'] / r['us'] / 1e3:.0f} | {r['us'] - floor:.2f} |")
    if a.out:
        json.dump(result, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
