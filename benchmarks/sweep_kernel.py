"""Sweep a backend's kernel options and split counts on the GPU (input to the planner's constants).

For each shape and layout, every (block_n, num_warps, num_stages) of the grid is timed under
CUDA-graph replay at several forced split counts (chosen so the grid has about 1, 2, 4 and 8
programs per SM) and at the planner's own choice. Output: JSON with every timing, and a table of
the best options per shape, the per-program streaming rate at about one program per SM, and
how far the planner's choice is from the best split count.

    python benchmarks/sweep_kernel.py --backend triton --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

import attnplan
import attnplan.testing
from attnplan.api import Context
from attnplan.timing import time_cuda

SHAPES = [(1, 131072), (1, 32768), (1, 4096), (4, 32768), (16, 4096)]


def graph_time(w, x, iters):
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w.run(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(*args)
    return time_cuda(lambda i: g.replay(), warmup=5, iters=iters)["median_us"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--layouts", default="contig,paged16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for layout, (batch, kv) in itertools.product(args.layouts.split(","), SHAPES):
        page = int(layout[5:]) if layout.startswith("paged") else None
        x = attnplan.testing.make_inputs(batch, hq, hkv, d, [kv] * batch, page_size=page, dtype=torch.bfloat16,
                                         device="cuda", generator=gen, extra_pages=0)
        nbytes = batch * kv * hkv * d * 2 * 2
        for bn, nw, ns in itertools.product(*(map(int, a.split(",")) for a in (args.block_n, args.warps, args.stages))):
            opts = {"block_n": bn, "num_warps": nw, "num_stages": ns}
            if args.backend != "triton":
                opts = {"block_n": bn}
            ctx = Context.from_config(attnplan.load_config(backend_options={args.backend: opts}, plan_cache={"disk": False}))
            cand = sorted({max(1, math.ceil(sms * k / (batch * hkv))) for k in (1, 2, 4, 8)} | {0})
            for splits in cand:
                if splits and kv / splits < bn:
                    continue
                w = attnplan.DecodeWrapper(ctx, backend=args.backend)
                try:
                    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=splits)
                    t = graph_time(w, x, args.iters)
                except Exception as e:  # noqa: BLE001 - record configs that do not compile or fit
                    rows.append({"layout": layout, "batch": batch, "kv": kv, **opts, "splits": splits, "error": str(e)[:200]})
                    continue
                rows.append({"layout": layout, "batch": batch, "kv": kv, **opts, "splits": plan.num_splits,
                             "planner": splits == 0, "programs": plan.num_programs, "us": t, "gbs": nbytes / t / 1e3})
        print(f"{layout} b{batch} kv{kv}: best " + str(min((r for r in rows if r.get('kv') == kv and r.get('batch') == batch
                                                        and r.get('layout') == layout and 'us' in r), key=lambda r: r['us'])), flush=True)
        del x
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "sms": sms, "heads": [hq, hkv, d], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
