"""Merge strategies side by side (issue: seed 000 cost 1 vs cost 3): separate merge kernel vs the
merge fused into the last program of each (sequence, KV head), graph replay, same run, plus the
planner's own choice. Output: a table, and JSON with --out.

    python benchmarks/bench_merge.py --backends triton --out merge.json
"""

import argparse
import json

import torch

import attnplan
import attnplan.testing
from attnplan.backends import get_backend
from attnplan.tune import _graph_time

SHAPES = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (4, 4096), (16, 4096), (4, 32768)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for batch, kv in SHAPES:
        x = attnplan.testing.make_inputs(batch, 32, 8, 128, [kv] * batch, page_size=16, dtype=torch.bfloat16,
                                         device="cuda", generator=gen, extra_pages=0)
        for be in args.backends.split(","):
            strategies = sorted(get_backend(be).merge_strategies)
            row = {"backend": be, "batch": batch, "kv": kv}
            for m in strategies + ["auto"]:
                cfg = attnplan.load_config(split={"merge": m}, plan_cache={"disk": False})
                w = attnplan.DecodeWrapper(cfg, backend=be)
                plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
                row[m] = _graph_time(w, x, args.iters)
                row[f"{m}_plan"] = f"{plan.num_splits}x{plan.chunk_size} {plan.merge}"
            rows.append(row)
            print(f"{be:8s} b{batch:<3d} kv{kv:<7d} " + "  ".join(f"{m}={row[m]:.1f}us ({row[m + '_plan']})"
                                                           for m in strategies + ["auto"]), flush=True)
        del x
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
