"""Sweep a backend's kernel options and split counts on the GPU and dump every timing as JSON.

The sweep itself is :func:`attnplan.tune.sweep` (``attnplan tune`` also fits and writes
a device table from it); this script only records it.

    python benchmarks/sweep_kernel.py --backend triton --out sweep.json
"""

import argparse
import json

import torch

from attnplan.tune import parse_option_grid, sweep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--shapes", default=None, help="batch:kv,... (default: attnplan.tune.SHAPES)")
    ap.add_argument("--layouts", default="contiguous,paged")
    ap.add_argument("--heads", default="32,8,128", help="query heads,KV heads,head_dim")
    ap.add_argument("--programs-per-sm", default=None,
                    help="split counts to try, as programs per SM (default: attnplan.tune.SWEEP_PROGRAMS_PER_SM)")
    ap.add_argument("--option-grid", default=None, type=parse_option_grid,
                    help="options to sweep instead of the backend's grid, e.g. 'num_warps=2,4;num_stages=2,3'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kw = {"layouts": tuple(args.layouts.split(",")), "option_grid": args.option_grid,
          "heads": tuple(int(v) for v in args.heads.split(","))}
    if args.programs_per_sm:
        kw["programs_per_sm"] = tuple(float(v) for v in args.programs_per_sm.split(","))
    if args.shapes:
        kw["shapes"] = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    rows = sweep(args.backend, iters=args.iters, progress=lambda layout, b, kv: print(f"{layout} b{b} kv{kv} done", flush=True), **kw)
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "heads": kw["heads"], "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                   "rows": rows}, f, indent=1)
    # best per shape and layout, last: the table a reader wants
    for key in sorted({(r["layout"], r["batch"], r["kv"]) for r in rows}):
        rs = sorted((r for r in rows if (r["layout"], r["batch"], r["kv"]) == key and "us" in r), key=lambda r: r["us"])
        for r in rs[:3]:
            opts = {k: v for k, v in r.items() if k not in ("layout", "batch", "kv", "us")}
            print(f"{key[0]:10s} {args.heads} b{key[1]:<3d} kv{key[2]:<7d} {r['us']:8.1f} us  {opts}")


if __name__ == "__main__":
    main()
