"""Context-parallel decode across GPUs: correctness against one GPU, time per step, share in
communication.

Each of ``world`` processes (one per GPU, NCCL) holds a contiguous 1/world of every sequence's KV
cache, computes its shard's partial state with attnplan, all-gathers ``(o, lse)`` and merges
(:class:`attnplan.distributed.ContextParallelDecode`). Rank 0 also runs single-GPU decode on the
whole cache (when it fits) and compares. Timing, every rank starting each timed call after a
barrier and a synchronize (without them, a rank's all-gather time includes waiting for the later
rank):

- ``step_us``: CUDA events around the whole eager step (local decode, all-gather, merge), median;
- ``exchange_us``: the same around the exchange alone (all-gather + merge, launch latency included);
- ``comm_kernel_us``: the communication itself, the device time of the NCCL all-gather kernels in the
  step (``torch.profiler``, CUPTI), per step and per rank. It still includes any wait for the
  other rank's data (ranks whose local decode ends later); the smaller rank's figure is the closer
  to the pure transfer. ``comm_share`` = the larger rank's ``comm_kernel_us`` / ``step_us``.

    python benchmarks/bench_cp.py --world 2 --kv 1048576,2097152 --out cp.json      # 2 GPUs
    python benchmarks/bench_cp.py --cpu --world 2 --kv 256                          # gloo dry run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events_median(fn, iters, device, aligned: bool = False):
    """Median time (us) of ``fn()``: CUDA events on a GPU, the host clock on the CPU (gloo dry run).

    ``aligned``: every rank calls this together and each timed call starts after a barrier (and, on
    a GPU, a synchronize), so a collective inside ``fn`` does not time a rank that arrives late.
    Only for code every rank runs: rank 0's single-GPU reference timing must pass ``False``.
    """
    def line_up():
        if aligned:
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()

    if device == "cpu":
        import time

        ts = []
        for _ in range(iters):
            line_up()
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        line_up()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def _nccl_kernel_us(fn, iters) -> dict | None:
    """Device time per call of ``fn`` in each NCCL kernel (CUPTI via ``torch.profiler``), by kernel
    name, after a barrier and a synchronize before each call; ``None`` on the CPU (gloo has no
    kernels). The barrier's own all-reduce kernel waits for the later rank: it is listed, but only
    the all-gather kernels are the step's communication (summing both gave 22 ms on one rank of two H200s)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    return {ev.key: (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)) / iters
            for ev in prof.key_averages() if "nccl" in ev.key.lower()}


def _allgather_us(kernels: dict | None) -> float | None:
    """The all-gather kernels' share of :func:`_nccl_kernel_us`."""
    if kernels is None:
        return None
    return sum(us for name, us in kernels.items() if "allgather" in name.lower().replace("_", ""))


def worker(rank, args, port, queue):
    import attnplan
    from attnplan.distributed import ContextParallelDecode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu = args.cpu
    device = "cpu" if cpu else f"cuda:{rank}"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=args.world)
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    dtype = torch.float16 if cpu else torch.bfloat16
    results = []
    try:
        for total in (int(v) for v in args.kv.split(",")):
            g = torch.Generator(device=device).manual_seed(1000 + total)  # same q on every rank
            q = torch.randn(1, 1, hq, d, generator=g, device=device).to(dtype)
            lo, hi = total * rank // args.world, total * (rank + 1) // args.world
            gs = torch.Generator(device=device).manual_seed(total * 7 + rank)  # each rank its own shard
            k = torch.randn(1, hi - lo, hkv, d, generator=gs, device=device).to(dtype)
            v = torch.randn(1, hi - lo, hkv, d, generator=gs, device=device).to(dtype)
            lens = torch.tensor([hi - lo], dtype=torch.int32, device=device)
            cp = ContextParallelDecode(backend=args.backend)
            plan = cp.plan(q, k, v, lens)
            out = cp.run(q, k, v, lens).clone()  # run() returns its reused buffer
            # every rank times these together, each call after a barrier (no late-rank waiting in them)
            step_us = _events_median(lambda: cp.run(q, k, v, lens), args.iters, device, aligned=True)
            exchange_us = _events_median(cp.exchange, args.iters, device, aligned=True)
            nccl = _nccl_kernel_us(lambda: cp.run(q, k, v, lens), args.iters) if not cpu else None
            per_rank = [None] * args.world
            dist.all_gather_object(per_rank, _allgather_us(nccl))
            # single-device check: gather the shards on rank 0 and decode the whole sequence there
            ks = [torch.empty(1, total * (r + 1) // args.world - total * r // args.world, hkv, d, dtype=dtype, device=device)
                  for r in range(args.world)]
            vs = [torch.empty_like(t) for t in ks]
            for lst, t in ((ks, k), (vs, v)):
                if rank == 0:
                    lst[0].copy_(t)
                    for r in range(1, args.world):
                        dist.recv(lst[r], src=r)
                else:
                    dist.send(t.contiguous(), dst=0)
            if rank == 0:
                kf, vf = torch.cat(ks, 1), torch.cat(vs, 1)
                single = attnplan.decode(q, kf, vf, torch.tensor([total], dtype=torch.int32, device=device),
                                         backend=args.backend)
                single_us = _events_median(lambda: attnplan.decode(q, kf, vf, torch.tensor([total], dtype=torch.int32,
                                                                                            device=device),
                                                                   backend=args.backend), args.iters, device)
                diff = float((out.float() - single.float()).abs().max())
                ref_err = None
                if args.reference:
                    from attnplan import reference

                    ref, _ = reference.attention(q, kf, vf, torch.tensor([total], dtype=torch.int32))
                    ref_err = float((out.double().cpu() - ref).abs().max())
                results.append({"total_kv": total, "world": args.world, "plan_local": plan.to_dict(),
                                "step_us": step_us, "exchange_us": exchange_us, "comm_kernel_us_per_rank": per_rank,
                                "nccl_kernels_us_rank0": nccl,
                                "comm_share": max(per_rank) / step_us if per_rank[0] is not None else None,
                                "single_device_us_eager": single_us, "max_abs_diff_vs_single": diff,
                                "max_abs_err_vs_reference": ref_err, "comm_bytes": cp.comm_bytes})
                comm = ("NCCL kernels " + " / ".join(f"{c:.1f}" for c in per_rank) + f" us per rank, "
                        f"{max(per_rank) / step_us:.1%}" if per_rank[0] is not None else "no kernel times on CPU")
                print(f"kv {total}: cp step {step_us:.1f} us ({comm}; exchange incl. merge {exchange_us:.1f} us); "
                      f"single device {single_us:.1f} us; max |cp - single| {diff:.2e}"
                      + (f"; max |cp - ref| {ref_err:.2e}" if ref_err is not None else ""), flush=True)
            del k, v
            if not cpu:
                torch.cuda.empty_cache()
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kv", default="1048576,2097152", help="total KV tokens of the one sequence")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU tensors (dry run; needs TRITON_INTERPRET=1)")
    ap.add_argument("--reference", action="store_true", help="also compare with the float64 reference")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=1200)
    for p in procs:
        p.join(120)
    env = {"torch": torch.__version__, "world": args.world,
           "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not args.cpu else ["cpu"]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
