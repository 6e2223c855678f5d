"""Decode-attention benchmark: attnplan backends against torch SDPA (flash, cuDNN) in one run.

For each point (batch, KV length, heads, layout) it times one decode step of every backend,
eagerly and under CUDA-graph replay (partial + merge kernels, i.e. the whole ``run()``), and the
peers' ``scaled_dot_product_attention`` with the flash and cuDNN backends on a dense cache
(GQA through ``enable_gqa``). Inputs are random bf16 (never zeros), rotated across enough
copies that L2 (60 MB on an H200) cannot serve repeats. The ceiling is the streaming-read
bandwidth measured in the same process; each time is reported as GB/s of the bytes a step must
move (K + V of the valid tokens, q read, out written) and as a fraction of that ceiling.

Usage (on the GPU machine)::

    attnplan bench --out benchmarks/results/<name>.json      # or python benchmarks/bench_decode.py

Long-tailed ("varlen") points draw lengths from a lognormal with the given maximum; the peers get
a dense cache padded to the longest sequence, as they would in a serving system, while the bytes
counted for every backend are those of the valid tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnplan
import attnplan.testing
from attnplan.timing import capture_graphs, read_bandwidth_gbs, time_cuda

L2_ROTATE_BYTES = 512 << 20  # rotate input copies until this many bytes are cycled


def build_sets(batch, hq, hkv, d, lens, page, n_sets, gen, q_len=1, kv_dtype="bfloat16"):
    """``n_sets`` independent random input sets (bf16 q, bf16 or fp8 e4m3 KV, on the GPU) for one benchmark point, so timed runs rotate through more bytes than L2 holds."""
    sets = []
    for _ in range(n_sets):
        x = attnplan.testing.make_inputs(batch, hq, hkv, d, lens, page_size=page, dtype=torch.bfloat16, device="cuda",
                                         generator=gen, extra_pages=0, q_len=q_len)
        if kv_dtype == "float8_e4m3fn":  # per-tensor scale 1: N(0, 1) values fit e4m3's range
            x = dataclasses.replace(x, k_cache=x.k_cache.to(torch.float8_e4m3fn), v_cache=x.v_cache.to(torch.float8_e4m3fn))
        sets.append(x)
    return sets


def _bf16(x):
    """The peers' view of a set: its KV cache in bf16 (an fp8 cache widened; the peers have no fp8 KV)."""
    if x.k_cache.dtype != torch.float8_e4m3fn:
        return x
    return dataclasses.replace(x, k_cache=x.k_cache.to(torch.bfloat16), v_cache=x.v_cache.to(torch.bfloat16))


def _time_step(step, n, iters, res):
    """Fill ``res`` with a step's three times (us): ``eager_us`` (host call included, as an eager caller
    sees it), ``graph_us`` (CUDA-graph replay, device time: an L2 flush is queued in front so the
    host's launch latency is not counted) and ``graph_host_us`` (graph replay with the host's launch
    latency, the replay as a lone step sees it)."""
    res["eager_us"] = time_cuda(lambda i: step(i % n), warmup=10, iters=iters)["median_us"]
    try:
        graphs = capture_graphs(step, n)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its eager time
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
        return
    res["graph_us"] = time_cuda(lambda i: graphs[i % n].replay(), warmup=10, iters=iters, flush=True)["median_us"]
    res["graph_host_us"] = time_cuda(lambda i: graphs[i % n].replay(), warmup=10, iters=iters)["median_us"]
    del graphs


def time_backend(name, sets, iters, num_splits=None):
    """Plan and time one attnplan backend on the sets (see :func:`_time_step` for the times), plus
    first-run time (s, includes compilation) and the plan. ``num_splits`` goes to
    :meth:`attnplan.DecodeWrapper.plan`: ``None`` = the config's ``split.num_splits``, 0 = the planner's
    choice, 1 = no split, >1 = forced. Returns ``(result dict, output of set 0)``. Raises ``ValueError``
    (from ``plan``) for a count outside [0, 1024]."""
    res = {}
    wrappers = []
    fp8 = sets[0].k_cache.dtype == torch.float8_e4m3fn
    for x in sets:
        w = attnplan.DecodeWrapper(backend=name)
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits,
               **({"k_scale": 1.0, "v_scale": 1.0} if fp8 else {}))
        wrappers.append(w)
    t0 = time.perf_counter()
    wrappers[0].run(*_args(sets[0]))
    torch.cuda.synchronize()
    res["first_run_s"] = time.perf_counter() - t0
    res["plan"] = {k: wrappers[0].plan_.to_dict()[k]
                   for k in ("num_splits", "chunk_size", "grid", "single_pass", "kernel", "predicted_us", "merge", "partition")}
    out0 = wrappers[0].run(*_args(sets[0])).clone()
    _time_step(lambda j: wrappers[j].run(*_args(sets[j])), len(sets), iters, res)
    return res, out0


def _args(x):
    return (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)


_BOUND = {}
READ_TILE = 4096  # elements per program of the reference read (read_bound)


def read_bound(nbytes: int, iters: int) -> dict:
    """What a perfect step of ``nbytes`` could take under this benchmark's method: the graph-replay
    device time (L2 flushed in front, :func:`attnplan.timing.time_cuda`) of one streaming-read kernel
    over ``nbytes`` bytes (``read_us``: 4,096-element tiles of 8 KiB, one per program, 8 warps), and of a
    graph holding one 1-element kernel (``floor_us``: what any one-kernel step pays for its launch, ramp
    and event pair on this device, whatever it reads). On the H200 that tile was within 0.6% of the
    fastest of 101 read kernels (Triton tiles, CUDA C 16-byte loads, Hopper bulk copies) at 16.8 MB to
    537 MB (``benchmarks/diag/read_floor.py``, results/2026-12-01-s10-call2); the earlier choice (the
    largest tile leaving 4 programs per SM) was up to 4.0% slower. ``read_us`` is still a reference, not
    a strict bound: the peers came in up to ~12% under the older reference at some large batches
    (results/2026-11-30-s5-call6); ``best peer / read_us`` is what a step as fast as that read would gain.

    Returns ``{"read_us", "floor_us"}`` (microseconds); memoized per byte count.
    Raises:
        ImportError: triton is missing (the read kernel is a Triton kernel).
    """
    from ._read_kernel import streaming_read

    if "floor_us" not in _BOUND:
        one = torch.zeros(1, device="cuda")
        (g,) = capture_graphs(lambda j: one.add_(1.0), 1)
        _BOUND["floor_us"] = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
    n = -(-nbytes // 2)
    if nbytes not in _BOUND:
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)  # freed on return: no memory held between points
        block = READ_TILE
        partial = torch.empty(-(-n // block), device="cuda", dtype=torch.float32)
        (g,) = capture_graphs(lambda j: streaming_read(x, partial, block), 1)
        _BOUND[nbytes] = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
    return {"read_us": _BOUND[nbytes], "floor_us": _BOUND["floor_us"]}


def _dense(sets):
    """Dense ``[B, H, L, D]`` copies of each set's q, K, V (the peers' layout), padded to the longest
    sequence as a serving system pads for them; made once, outside the timed region."""
    dense = []
    for x in map(_bf16, sets):
        lmax = int(x.seq_lens.max())
        if x.block_table is not None:
            ps = x.k_cache.shape[1]
            pages = x.block_table[:, : -(-lmax // ps)].long()
            k = x.k_cache[pages].flatten(1, 2)[:, :lmax]
            v = x.v_cache[pages].flatten(1, 2)[:, :lmax]
        else:
            k, v = x.k_cache[:, :lmax], x.v_cache[:, :lmax]
        dense.append((x.q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
    return dense


_FLEX = {}


def _flex_fn():
    """``torch.compile``d FlexAttention (GQA), compiled once per process."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        import torch._dynamo

        for knob in ("cache_size_limit", "recompile_limit"):  # one compile per benchmark shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def time_peer(kind, sets, iters):
    """Time a torch peer on dense copies of the sets: SDPA with the ``flash`` or ``cudnn`` backend
    (GQA through ``enable_gqa``), or ``flex`` (``torch.compile``d FlexAttention, no mask: decode
    with q_len 1 sees the whole cache). Eager and CUDA-graph times as :func:`_time_step`. A peer that
    refuses the shape is recorded as an error, not fatal. Returns ``(result dict, output [B,Q,H,D] or None)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dense = _dense(sets)
    try:
        if kind == "flex":
            if sets[0].q.shape[1] != 1:
                return {"error": "flex peer: q_len > 1 needs a causal block mask (not benchmarked)"}, None
            fn = _flex_fn()

            def step(j):
                return fn(*dense[j], enable_gqa=True)
        else:
            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]
            causal = sets[0].q.shape[1] > 1  # q_len > 1: bottom-right causal needs equal lengths; skip
            if causal:
                return {"error": "sdpa peer: q_len > 1 with a KV cache needs a bottom-right causal mask (not benchmarked)"}, None

            def step(j):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*dense[j], enable_gqa=True)
        out = step(0).transpose(1, 2).clone()
        torch.cuda.synchronize()
        res = {}
        _time_step(step, len(dense), iters, res)
        return res, out
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None
    finally:
        del dense
        torch.cuda.empty_cache()


def host_overheads(backend: str = "triton") -> dict:
    """Host cost of planning on this device (us, medians): a plan-cache hit, a miss (the planner
    itself), and ``DecodeWrapper.plan`` on a hit (validation included, which reads ``seq_lens``)."""
    import attnplan.api as api
    from attnplan.device import device_info

    dev = torch.device("cuda")
    di = device_info(dev)
    be = attnplan.backends.get_backend(backend)
    hot = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    cold = api.Context.from_config(attnplan.load_config(plan_cache={"enabled": False}))
    prob = attnplan.DecodeProblem(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=4096,
                                  total_kv_len=4096, q_dtype="bfloat16", kv_dtype="bfloat16")
    api.plan_problem(prob, be, dev, hot, dev_info=di)

    def per_call(fn, n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    x = attnplan.testing.make_inputs(1, 32, 8, 128, [4096], dtype=torch.bfloat16, device="cuda")
    w = attnplan.DecodeWrapper(hot, backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    return {"backend": backend,
            "plan_cache_hit_us": statistics.median(per_call(lambda: api.plan_problem(prob, be, dev, hot, dev_info=di), 500) for _ in range(5)),
            "plan_cache_miss_us": statistics.median(per_call(lambda: api.plan_problem(prob, be, dev, cold, dev_info=di), 20) for _ in range(5)),
            "wrapper_plan_hit_us": statistics.median(per_call(lambda: w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table), 50) for _ in range(5))}


def _result(args, ceiling, points, backends, host) -> dict:
    """The benchmark's JSON document: command, environment, ceiling, host costs and the points so far."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "python": platform.python_version(), "attnplan": attnplan.__version__,
           "triton": _ver("triton"), "numba_cuda": _ver("numba_cuda"), "cuda_bindings": _ver("cuda.bindings")}
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "env": env, "ceiling": ceiling,
              "ceiling_used": "ceiling_gbs", "points": points, "attnplan_backends": backends, "host": host,
              "notes": "times are medians of CUDA-event-timed steps (us). graph_us: CUDA-graph replay, device time "
                       "(an L2 flush queued in front hides the host's launch latency, as triton.testing.do_bench); "
                       "graph_host_us: the same replay without the flush (host launch latency included); eager_us: "
                       "the eager call, host included. Peers run on a dense [B,H,L,D] bf16 copy padded to the "
                       "longest sequence."}
    return result


def _write(path, result) -> None:
    """Write ``result`` as JSON to ``path``, atomically (nothing when ``path`` is ``None``)."""
    if path:
        from attnplan.tune import _atomic_write

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _atomic_write(path, json.dumps(result, indent=1))


def main(argv=None):
    """``attnplan bench``: the benchmark grid; writes JSON (and a PNG plot) when ``--out`` is given, prints a summary table."""
    ap = argparse.ArgumentParser(prog="attnplan bench")
    ap.add_argument("--backends", default="triton,numba,cuda_ptx")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--kv", default="4096,32768,131072")
    ap.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim; several separated by ';'")
    ap.add_argument("--layouts", default="contig,paged16")
    ap.add_argument("--peers", default="flash,cudnn,flex", help="torch peers: flash, cudnn (SDPA backends), flex (FlexAttention)")
    ap.add_argument("--flex-batches", default="1,16",
                    help="batches at which FlexAttention runs (it compiles once per shape: tens of seconds each)")
    ap.add_argument("--q-len", type=int, default=1, help="queries per sequence (speculative verification: > 1)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                    help="KV cache dtype (q and out stay bf16); peers always read a bf16 copy")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-gb", type=float, default=16.0, help="skip points whose K+V exceed this many GB")
    ap.add_argument("--varlen", default="16:131072,64:32768", help="batch:max_kv long-tailed points ('' for none)")
    ap.add_argument("--bound", action=argparse.BooleanOptionalAction, default=True,
                    help="time a streaming read of each point's bytes and a one-kernel graph (the method's floor)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG path for the bandwidth-fraction plot (default: next to --out)")
    args = ap.parse_args(argv)
    heads_list = [tuple(int(v) for v in h.split(",")) for h in args.heads.split(";") if h]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    ceiling = read_bandwidth_gbs()
    bw = ceiling["ceiling_gbs"]
    print(f"read ceiling {bw:.0f} GB/s ({ceiling})", flush=True)
    try:
        host = host_overheads()
    except Exception as e:  # noqa: BLE001 - a nicety; never stops the benchmark
        host = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(f"host overheads: {host}", flush=True)
    backends = []
    for name in args.backends.split(","):
        ok, why = attnplan.backends.get_backend(name).available(torch.device("cuda"))
        if ok:
            backends.append(name)
        else:
            print(f"skipping backend {name}: {why}")
    points = []
    grid = []
    for heads in heads_list:
        for layout in args.layouts.split(","):
            page = int(layout[5:]) if layout.startswith("paged") else None
            for batch in (int(b) for b in args.batches.split(",")):
                for kv in (int(k) for k in args.kv.split(",")):
                    grid.append((heads, layout, page, batch, [kv] * batch, "uniform"))
            for spec in filter(None, args.varlen.split(",")):
                batch, kv = (int(v) for v in spec.split(":"))
                grid.append((heads, layout, page, batch, attnplan.testing.long_tailed_lengths(batch, kv), "varlen"))
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        def tqdm(it, **kw):
            return it
    kv_item = 1 if args.kv_dtype == "float8_e4m3fn" else 2
    for (hq, hkv, d), layout, page, batch, lens, kind in tqdm(grid, desc="bench", unit="point"):
        kv = max(lens)
        kv_bytes = 2 * sum(lens) * hkv * d * 2  # the peers' bf16 copy decides what fits
        if kv_bytes > args.max_gb * 1e9:
            continue
        n_sets = max(1, min(8, math.ceil(L2_ROTATE_BYTES / (kv_bytes * kv_item / 2))))
        sets = build_sets(batch, hq, hkv, d, lens, page, n_sets, gen, q_len=args.q_len, kv_dtype=args.kv_dtype)
        prob = attnplan.DecodeProblem(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_kv_len=kv,
                                      total_kv_len=sum(lens), q_len=args.q_len, q_dtype="bfloat16", kv_dtype=args.kv_dtype)
        nbytes = prob.bytes_moved()
        pt = {"layout": layout, "kind": kind, "batch": batch, "kv_len": kv, "total_kv": sum(lens), "heads": [hq, hkv, d],
              "q_len": args.q_len, "kv_dtype": args.kv_dtype, "bytes": nbytes, "input_sets": n_sets, "results": {}}
        if args.bound:
            try:
                pt["bound"] = read_bound(nbytes, args.iters)
            except Exception as e:  # noqa: BLE001 - the bound is context, not a contender
                pt["bound"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        ref_out = None
        for peer in filter(None, args.peers.split(",")):
            if peer == "flex" and (str(batch) not in args.flex_batches.split(",") or kind != "uniform"):
                continue
            r, o = time_peer(peer, sets, args.iters)
            pt["results"][peer if peer == "flex" else f"sdpa_{peer}"] = r
            if o is not None and ref_out is None:
                ref_out = o
        for name in backends:
            try:
                r, o = time_backend(name, sets, args.iters)
                if ref_out is not None and kind == "uniform" and args.kv_dtype == "bfloat16":
                    r["max_abs_diff_vs_peer"] = float((o.float() - ref_out.float()).abs().max())
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            pt["results"][name] = r
        for r in pt["results"].values():
            for key in ("eager_us", "graph_us", "graph_host_us"):
                if key in r:
                    r[key.replace("_us", "_gbs")] = nbytes / r[key] / 1e3
                    r[key.replace("_us", "_frac")] = nbytes / r[key] / 1e3 / bw
        points.append(pt)
        _write(args.out, _result(args, ceiling, points, backends, host))  # a run cut short keeps its points
        row = " ".join(f"{n}={r.get('graph_us', r.get('eager_us')):.1f}us" if "eager_us" in r else f"{n}=err"
                       for n, r in pt["results"].items())
        msg = f"{hq}/{hkv}/{d} {layout:8s} {kind:7s} b{batch:<3d} kv{kv:<7d} {row}"
        tqdm.write(msg) if hasattr(tqdm, "write") else print(msg)
        del sets
        torch.cuda.empty_cache()
    result = _result(args, ceiling, points, backends, host)
    _write(args.out, result)
    summary(result)
    png = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if png:
        try:
            plot(result, png)
            print(f"plot: {png}")
        except ImportError as e:
            print(f"no plot ({e}); pip install 'attnplan[plot]'")


def plot(result: dict, path: str) -> None:
    """Bandwidth fraction against KV length, one line per backend / peer, one panel per (layout, batch).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p.get("kind", "uniform") == "uniform"]
    panels = sorted({(tuple(p["heads"]), p["layout"], p["batch"]) for p in pts})
    names = sorted({n for p in pts for n in p["results"]})
    cols = min(4, len(panels)) or 1
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, (heads, layout, batch) in zip(axes.flat, panels):
        sel = sorted((p for p in pts if tuple(p["heads"]) == heads and p["layout"] == layout and p["batch"] == batch),
                     key=lambda p: p["kv_len"])
        for n in names:
            xs, ys = [], []
            for p in sel:
                r = p["results"].get(n, {})
                f = r.get("graph_frac", r.get("eager_frac"))
                if f:
                    xs.append(p["kv_len"])
                    ys.append(f)
            if xs:
                ax.plot(xs, ys, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{'/'.join(map(str, heads))} {layout}, batch {batch}", fontsize=8)
        ax.set_xlabel("KV length (tokens)")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes.flat[0].set_ylabel("fraction of read bandwidth")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"decode attention, {result['env']['device']}, graph replay; "
                 f"ceiling {result['ceiling'][result['ceiling_used']]:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ver(mod):
    try:
        m = __import__(mod, fromlist=["__version__"])
        return getattr(m, "__version__", "?")
    except Exception:  # noqa: BLE001
        return None


def best(point: dict, names) -> tuple[str | None, float]:
    """The fastest of ``names`` at ``point`` by graph-replay device time (eager time where a peer
    could not be captured): ``(name, us)``, ``(None, inf)`` if none ran."""
    ts = [(r.get("graph_us", r.get("eager_us")), n) for n, r in point["results"].items()
          if n in names and ("graph_us" in r or "eager_us" in r)]
    return (min(ts)[1], min(ts)[0]) if ts else (None, math.inf)


def summary(result):
    """Print the result table: device time per step under graph replay (us) and fraction of the read
    ceiling per point and backend, the best attnplan backend's speedup over the best torch peer,
    and the geometric mean of those speedups; with the points' read bounds (:func:`read_bound`), the
    speedup a step as fast as one streaming read of the same bytes would have (a reference)."""
    bw = result["ceiling"][result["ceiling_used"]]
    print(f"\nceiling {bw:.0f} GB/s; us per step (fraction of ceiling), CUDA-graph replay device time for all")
    names = sorted({n for p in result["points"] for n in p["results"]})
    ours = set(result.get("attnplan_backends") or [n for n in names if n in ("triton", "numba", "cuda_ptx")])
    print(f"{'heads':9s} {'layout':8s} {'kind':7s} {'batch':>5s} {'kv':>7s} " + " ".join(f"{n:>15s}" for n in names) + "  speedup")
    speedups, bounds = [], []
    for p in result["points"]:
        cells = []
        for n in names:
            r = p["results"].get(n, {})
            t, f = r.get("graph_us", r.get("eager_us")), r.get("graph_frac", r.get("eager_frac"))
            cells.append(f"{t:8.1f} ({f:4.0%})" if t else f"{'err' if 'error' in r else '-':>15s}")
        _, ours_t = best(p, ours)
        _, peer_t = best(p, set(names) - ours)
        sp = peer_t / ours_t if math.isfinite(peer_t) and math.isfinite(ours_t) else float("nan")
        read_t = p.get("bound", {}).get("read_us")
        bound = peer_t / read_t if read_t and math.isfinite(peer_t) else float("nan")
        if sp == sp:
            speedups.append(sp)
            if bound == bound:  # the speedup a step as fast as one streaming read would have
                bounds.append(bound)
        heads = "/".join(map(str, p["heads"]))
        print(f"{heads:9s} {p['layout']:8s} {p.get('kind', 'uniform'):7s} {p['batch']:5d} {p['kv_len']:7d} "
              + " ".join(f"{c:>15s}" for c in cells) + f"  {sp:5.2f}x"
              + (f"  read {read_t:7.1f} ({bound:4.2f}x)" if read_t else ""))
    if speedups:
        gm = math.exp(sum(map(math.log, speedups)) / len(speedups))
        print(f"best attnplan vs best peer: geometric mean {gm:.2f}x, min {min(speedups):.2f}x over {len(speedups)} points")
    if bounds and len(bounds) == len(speedups):
        gm = math.exp(sum(map(math.log, bounds)) / len(bounds))
        floor = next(p["bound"]["floor_us"] for p in result["points"] if "floor_us" in p.get("bound", {}))
        print(f"a streaming read of each point's bytes vs best peer: geometric mean {gm:.2f}x (what a step as fast "
              f"as one read kernel would gain; a one-kernel graph takes {floor:.1f} us under this method)")


if __name__ == "__main__":
    main()
