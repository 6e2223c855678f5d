"""Sweep a backend's kernel options and split counts on the GPU and dump every timing as JSON.

The sweep itself is :func:`attnplan.tune.sweep` (``attnplan tune`` also fits and writes
``plans/<device>.yaml`` from it); this script only records it. The first sweep in
``results/2026-11-30-sweep-triton`` was made by an earlier, standalone version of this file.

    python benchmarks/sweep_kernel.py --backend triton --out sweep.json
"""

import argparse
import json

import torch

from attnplan.tune import sweep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = sweep(args.backend, iters=args.iters, progress=lambda layout, b, kv: print(f"{layout} b{b} kv{kv} done", flush=True))
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
