"""Per-kernel device time of one decode step: which kernel of the step (partial, merge, ...) costs
what, from CUPTI kernel records (``torch.profiler``), L2 flushed before every step.

The bench times whole steps (graph replay); this splits a step into its kernels, to see where a
short-context step's time goes (e.g. cuda_ptx against cuDNN at b1 KV 4K).

    python benchmarks/profile_kernels.py --backends triton,cuda_ptx --kv 4096,32768 --out prof.json

``--dist`` (``lognormal``, ``bimodal``, ``one_long``: ``bench_longtail.py``'s first length vector of that point)
profiles a long-tailed batch instead, through a capacity plan for ``--kv`` tokens per sequence (paged layouts),
as ``bench_longtail.py`` times it.

Each kernel's time is the median over ``--iters`` steps of its CUPTI duration (start to end on the
GPU); "gap" is the step's span minus the sum of its kernels: eager launch latency between kernels, which
a CUDA graph replay mostly removes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _setup(backend: str, batch: int, kv: int, heads, layout: str, kv_dtype: str = "bfloat16", dist: str = ""):
    """Random bf16 inputs of one shape (page 16 for ``layout == "paged"``; the KV cache cast to ``kv_dtype``, e.g.
    ``float8_e4m3fn`` with per-tensor scale 1), a wrapper and its plan: ``(wrapper, plan, run arguments)``.
    ``dist``: long-tailed lengths up to ``kv`` (``bench_longtail.draw_lengths``, its first vector's seed) and a
    capacity plan for ``kv`` tokens per sequence; else ``kv`` tokens in every sequence and a plan for them."""
    import zlib

    import attnplan
    from attnplan.testing import make_inputs

    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [kv] * batch
    if dist:
        from bench_longtail import draw_lengths

        lens = draw_lengths(dist, batch, kv, seed=zlib.crc32(f"{dist}-{batch}-{hq}-{hkv}-{d}-0".encode()))
    x = make_inputs(batch, hq, hkv, d, lens, page_size=16 if layout == "paged" else None, capacity=kv,
                    dtype=torch.bfloat16, device="cuda", generator=gen, extra_pages=0)
    k, v = x.k_cache, x.v_cache
    if kv_dtype != "bfloat16":
        k, v = k.to(getattr(torch, kv_dtype)), v.to(getattr(torch, kv_dtype))
    scales = {} if kv_dtype == "bfloat16" else {"k_scale": 1.0, "v_scale": 1.0}
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, k, v, x.seq_lens, x.block_table, capacity=bool(dist), **scales)
    return w, plan, (x.q, k, v, x.seq_lens, x.block_table)


def profile(backend: str, batch: int, kv: int, heads, layout: str, iters: int, graph: bool = False,
            kv_dtype: str = "bfloat16", dist: str = "") -> dict:
    """Kernel durations (us) of ``iters`` decode steps of one shape, L2 flushed before each: eager launches, or
    (``graph``) replays of one CUDA graph of the step, as the benchmarks time it (CUPTI records a graph's kernel
    nodes like launches)."""
    from attnplan.timing import capture_graphs, l2_flush
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    w, plan, args = _setup(backend, batch, kv, heads, layout, kv_dtype, dist)
    out = torch.empty_like(args[0])
    step = lambda: w.run(*args, out=out)  # noqa: E731
    if graph:
        g = capture_graphs(lambda j: step(), 1)[0]
        step = g.replay
    for _ in range(5):
        step()
    l2_flush()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            l2_flush()
            torch.cuda.synchronize()  # each step alone on the GPU: its kernels, nothing queued behind
            step()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps, cur = [], []
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        if "reduce_kernel" in e.name:  # the flush (torch.sum) that starts every step
            while cur and cur[-1].name.startswith("Memset"):
                cur.pop()  # the flush's own memset (torch zeroes its reduction's semaphores), after the host's sync
            if cur:
                steps.append(cur)
            cur = []
            continue
        cur.append(e)
    if cur:
        steps.append(cur)
    by_name: dict[str, list[float]] = {}
    spans, sums = [], []
    for st in steps:
        for e in st:
            by_name.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        spans.append(st[-1].time_range.end - st[0].time_range.start)
        sums.append(sum(e.time_range.elapsed_us() for e in st))
    return {"backend": backend, "batch": batch, "kv": kv, "dist": dist, "heads": list(heads), "layout": layout,
            "graph": graph, "merge": plan.merge,
            "splits": plan.num_splits, "programs": plan.num_programs, "steps": len(steps),
            "kernels_us": {k: statistics.median(v) for k, v in by_name.items()},
            "span_us": statistics.median(spans) if spans else None,
            "gap_us": statistics.median(s - k for s, k in zip(spans, sums)) if spans else None}


def plain_steps(backend: str, batch: int, kv: int, heads, layout: str, iters: int, kv_dtype: str = "bfloat16",
                dist: str = "") -> None:
    """``iters`` eager decode steps of one shape with no profiler attached, L2 flushed before each: the
    process for an outside profiler (``ncu``, see ``benchmarks/ncu_partial.sh``) to attach to."""
    from attnplan.timing import l2_flush

    w, plan, args = _setup(backend, batch, kv, heads, layout, kv_dtype, dist)
    for _ in range(iters):
        l2_flush()
        w.run(*args)
    torch.cuda.synchronize()
    print(f"{backend} {layout} b{batch} kv{kv}: {iters} plain steps, {plan.num_splits} splits", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="triton,cuda_ptx")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--kv", default="4096,32768,131072")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--layouts", default="contiguous")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--graph", action="store_true", help="time replays of a CUDA graph of the step, not launches")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--dist", default="", help="long-tailed lengths (lognormal, bimodal, one_long) up to --kv, "
                                               "through a capacity plan ('' = uniform lengths of --kv)")
    ap.add_argument("--plain", action="store_true",
                    help="run the steps with no profiler attached (for ncu), print nothing but a line per shape")
    a = ap.parse_args()
    heads = tuple(int(v) for v in a.heads.split(","))
    rows = []
    for layout in a.layouts.split(","):
        for batch in map(int, a.batches.split(",")):
            for kv in map(int, a.kv.split(",")):
                for be in a.backends.split(","):
                    if a.plain:
                        plain_steps(be, batch, kv, heads, layout, a.iters, a.kv_dtype, a.dist)
                        continue
                    r = profile(be, batch, kv, heads, layout, a.iters, a.graph, a.kv_dtype, a.dist)
                    rows.append(r)
                    ks = "  ".join(f"{k}={v:.1f}" for k, v in r["kernels_us"].items())
                    print(f"{be:8s} {layout:10s} b{batch:<3d} kv{kv:<7d} {a.dist or 'uniform':9s} {r['splits']:3d} splits "
                          f"{r['merge']} merge  span {r['span_us']:.1f} us"
                          f"  gap {r['gap_us']:.1f}  | {ks}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
