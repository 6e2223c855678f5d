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
from attnplan.timing import read_bandwidth_gbs, time_cuda

L2_ROTATE_BYTES = 512 << 20  # rotate input copies until this many bytes are cycled


def build_sets(batch, hq, hkv, d, lens, page, n_sets, gen):
    """``n_sets`` independent random input sets (bf16, on the GPU) for one benchmark point, so timed runs rotate through more bytes than L2 holds."""
    sets = []
    for _ in range(n_sets):
        x = attnplan.testing.make_inputs(batch, hq, hkv, d, lens, page_size=page, dtype=torch.bfloat16, device="cuda",
                                         generator=gen, extra_pages=0)
        sets.append(x)
    return sets


def time_backend(name, sets, iters):
    """Plan and time one attnplan backend on the sets: eager and CUDA-graph replay medians (us), first-run time (s, includes compilation) and the plan. Returns ``(result dict, output of set 0)``."""
    res = {}
    wrappers = []
    for x in sets:
        w = attnplan.DecodeWrapper(backend=name)
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        wrappers.append(w)
    t0 = time.perf_counter()
    wrappers[0].run(*_args(sets[0]))
    torch.cuda.synchronize()
    res["first_run_s"] = time.perf_counter() - t0
    res["plan"] = {k: wrappers[0].plan_.to_dict()[k] for k in ("num_splits", "chunk_size", "grid", "single_pass", "kernel", "predicted_us")}
    outs = [w.run(*_args(x)) for w, x in zip(wrappers, sets)]
    eager = time_cuda(lambda i: wrappers[i % len(sets)].run(*_args(sets[i % len(sets)])), warmup=10, iters=iters)
    res["eager_us"] = eager["median_us"]
    graphs = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w, x in zip(wrappers, sets):
            w.run(*_args(x))
    torch.cuda.current_stream().wait_stream(s)
    for w, x in zip(wrappers, sets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(*_args(x))
        graphs.append(g)
    gr = time_cuda(lambda i: graphs[i % len(graphs)].replay(), warmup=10, iters=iters)
    res["graph_us"] = gr["median_us"]
    return res, outs[0]


def _args(x):
    return (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)


def time_sdpa(kind, sets, iters):
    """Time torch SDPA with the ``kind`` backend (``flash`` or ``cudnn``) on a dense ``[B, H, L, D]`` copy of each set (GQA through ``enable_gqa``), eager median (us); a backend that refuses the shape is recorded as an error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]
    dense = []
    for x in sets:
        # peers get a dense [B, H, L, D] cache of the longest length (their layout); K/V copies
        # are made once, outside the timed region.
        lmax = int(x.seq_lens.max())
        if x.block_table is not None:
            ps = x.k_cache.shape[1]
            pages = x.block_table[:, : -(-lmax // ps)].long()
            k = x.k_cache[pages].flatten(1, 2)[:, :lmax]
            v = x.v_cache[pages].flatten(1, 2)[:, :lmax]
        else:
            k, v = x.k_cache[:, :lmax], x.v_cache[:, :lmax]
        dense.append((x.q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
    try:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*dense[0], enable_gqa=True)
            torch.cuda.synchronize()
            r = time_cuda(lambda i: F.scaled_dot_product_attention(*dense[i % len(dense)], enable_gqa=True), warmup=10, iters=iters)
        return {"eager_us": r["median_us"]}, out.transpose(1, 2)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None
    finally:
        del dense
        torch.cuda.empty_cache()


def main(argv=None):
    """``attnplan bench``: the benchmark grid; writes JSON (and a PNG plot) when ``--out`` is given, prints a summary table."""
    ap = argparse.ArgumentParser(prog="attnplan bench")
    ap.add_argument("--backends", default="triton,numba,cuda_ptx")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--kv", default="4096,32768,131072")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--layouts", default="contig,paged16")
    ap.add_argument("--peers", default="flash,cudnn")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-gb", type=float, default=16.0, help="skip points whose K+V exceed this many GB")
    ap.add_argument("--varlen", default="16:131072,64:32768", help="batch:max_kv long-tailed points ('' for none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG path for the bandwidth-fraction plot (default: next to --out)")
    args = ap.parse_args(argv)
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    gen = torch.Generator(device="cuda").manual_seed(1234)
    ceiling = read_bandwidth_gbs()
    bw = ceiling["ceiling_gbs"]
    print(f"read ceiling {bw:.0f} GB/s ({ceiling})", flush=True)
    backends = []
    for name in args.backends.split(","):
        ok, why = attnplan.backends.get_backend(name).available(torch.device("cuda"))
        if ok:
            backends.append(name)
        else:
            print(f"skipping backend {name}: {why}")
    points = []
    grid = []
    for layout in args.layouts.split(","):
        page = int(layout[5:]) if layout.startswith("paged") else None
        for batch in (int(b) for b in args.batches.split(",")):
            for kv in (int(k) for k in args.kv.split(",")):
                grid.append((layout, page, batch, [kv] * batch, "uniform"))
        for spec in filter(None, args.varlen.split(",")):
            batch, kv = (int(v) for v in spec.split(":"))
            grid.append((layout, page, batch, attnplan.testing.long_tailed_lengths(batch, kv), "varlen"))
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        def tqdm(it, **kw):
            return it
    for layout, page, batch, lens, kind in tqdm(grid, desc="bench", unit="point"):
        kv = max(lens)
        kv_bytes = 2 * sum(lens) * hkv * d * 2
        if kv_bytes > args.max_gb * 1e9:
            continue
        n_sets = max(1, min(8, math.ceil(L2_ROTATE_BYTES / kv_bytes)))
        sets = build_sets(batch, hq, hkv, d, lens, page, n_sets, gen)
        prob = attnplan.DecodeProblem(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_kv_len=kv,
                                      total_kv_len=sum(lens), q_dtype="bfloat16", kv_dtype="bfloat16")
        nbytes = prob.bytes_moved()
        pt = {"layout": layout, "kind": kind, "batch": batch, "kv_len": kv, "total_kv": sum(lens), "heads": [hq, hkv, d],
              "bytes": nbytes, "input_sets": n_sets, "results": {}}
        ref_out = None
        for peer in filter(None, args.peers.split(",")):
            r, o = time_sdpa(peer, sets, args.iters)
            pt["results"][f"sdpa_{peer}"] = r
            if o is not None and ref_out is None:
                ref_out = o
        for name in backends:
            try:
                r, o = time_backend(name, sets, args.iters)
                if ref_out is not None and kind == "uniform":
                    r["max_abs_diff_vs_sdpa"] = float((o.float() - ref_out.float()).abs().max())
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            pt["results"][name] = r
        for r in pt["results"].values():
            for key in ("eager_us", "graph_us"):
                if key in r:
                    r[key.replace("_us", "_gbs")] = nbytes / r[key] / 1e3
                    r[key.replace("_us", "_frac")] = nbytes / r[key] / 1e3 / bw
        points.append(pt)
        row = " ".join(
            f"{n}={r.get('graph_us', r.get('eager_us', float('nan'))):.1f}us"
            + (f"({r.get('graph_frac', r.get('eager_frac', 0)):.0%})" if "eager_us" in r else "(err)")
            for n, r in pt["results"].items())
        tqdm.write(f"{layout:8s} {kind:7s} b{batch:<3d} kv{kv:<7d} {row}") if hasattr(tqdm, "write") else print(row)
        del sets
        torch.cuda.empty_cache()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "python": platform.python_version(), "attnplan": attnplan.__version__,
           "triton": _ver("triton"), "numba_cuda": _ver("numba_cuda"), "cuda_bindings": _ver("cuda.bindings")}
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "env": env, "ceiling": ceiling,
              "ceiling_used": "ceiling_gbs", "points": points,
              "notes": "times are medians of CUDA-event-timed steps; graph_us = CUDA graph replay of run(); "
                       "sdpa peers time eagerly on a dense [B,H,L,D] copy"}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
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
    panels = sorted({(p["layout"], p["batch"]) for p in pts})
    names = sorted({n for p in pts for n in p["results"]})
    cols = min(4, len(panels)) or 1
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, (layout, batch) in zip(axes.flat, panels):
        sel = sorted((p for p in pts if p["layout"] == layout and p["batch"] == batch), key=lambda p: p["kv_len"])
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
        ax.set_title(f"{layout}, batch {batch}")
        ax.set_xlabel("KV length (tokens)")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes.flat[0].set_ylabel("fraction of read bandwidth")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"decode attention, {result['env']['device']}, heads {pts[0]['heads'] if pts else ''}; "
                 f"ceiling {result['ceiling'][result['ceiling_used']]:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ver(mod):
    try:
        m = __import__(mod, fromlist=["__version__"])
        return getattr(m, "__version__", "?")
    except Exception:  # noqa: BLE001
        return None


def summary(result):
    """Print the result table: time per step (us) and fraction of the read ceiling per point and backend."""
    bw = result["ceiling"][result["ceiling_used"]]
    print(f"\nceiling {bw:.0f} GB/s; time in us (fraction of ceiling); attnplan = graph replay, sdpa = eager")
    names = sorted({n for p in result["points"] for n in p["results"]})
    print(f"{'layout':8s} {'kind':7s} {'batch':>5s} {'kv':>7s} " + " ".join(f"{n:>16s}" for n in names))
    for p in result["points"]:
        cells = []
        for n in names:
            r = p["results"].get(n, {})
            t = r.get("graph_us", r.get("eager_us"))
            f = r.get("graph_frac", r.get("eager_frac"))
            cells.append(f"{t:9.1f} ({f:4.0%})" if t else f"{'err' if 'error' in r else '-':>16s}")
        print(f"{p['layout']:8s} {p.get('kind', 'uniform'):7s} {p['batch']:5d} {p['kv_len']:7d} " + " ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
