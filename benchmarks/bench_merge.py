"""Two plan axes besides the split count, side by side, CUDA-graph replay device time, one run.

- ``--mode partition``: split-K (warps over KV positions, merged through shared memory) vs split-V (warps
  over head_dim columns, scores recomputed) inside a program for head_dim 64 / 128 / 256,
  GQA group 1 / 4 / 8 and KV 4K / 128K (batch 1, contiguous bf16, 8 KV heads), each with the
  planner's split count for that partition, plus the planner's own choice (``auto``).
- ``--mode merge``: separate merge kernel vs merge fused into the last program vs the opt-in atomic
  accumulation (``deterministic: false``), plus ``auto``, on a paged (page 16) 32/8/128 grid.

Output: a table on stdout, JSON with ``--out``.

    python benchmarks/bench_merge.py --mode partition,merge --backends triton,cuda_ptx --out axes.json
"""

import argparse
import itertools
import json

import torch

import attnplan
import attnplan.testing
from attnplan.backends import get_backend
from attnplan.tune import _graph_time

MERGE_SHAPES = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (4, 4096), (16, 4096), (4, 32768)]
PARTITION_GRID = list(itertools.product((64, 128, 256), (1, 4, 8), (4096, 131072)))


def _time(cfg, be, x, iters):
    w = attnplan.DecodeWrapper(cfg, backend=be)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    return _graph_time(w, x, iters), plan


def merges(backends, iters, gen):
    """Rows ``{backend, batch, kv, <strategy>: us, <strategy>_plan: str}`` for every merge strategy the backend has."""
    rows = []
    for batch, kv in MERGE_SHAPES:
        x = attnplan.testing.make_inputs(batch, 32, 8, 128, [kv] * batch, page_size=16, dtype=torch.bfloat16,
                                         device="cuda", generator=gen, extra_pages=0)
        for be in backends:
            strategies = sorted(get_backend(be).merge_strategies)
            row = {"backend": be, "batch": batch, "kv": kv}
            for m in strategies + ["auto"]:
                cfg = attnplan.load_config(split={"merge": m}, plan_cache={"disk": False},
                                           **({"deterministic": False} if m == "atomic" else {}))
                row[m], plan = _time(cfg, be, x, iters)
                row[f"{m}_plan"] = f"{plan.num_splits}x{plan.chunk_size} {plan.merge}"
            rows.append(row)
            print(f"merge {be:8s} b{batch:<3d} kv{kv:<7d} " + "  ".join(
                f"{m}={row[m]:.1f}us ({row[m + '_plan']})" for m in strategies + ["auto"]), flush=True)
        del x
    return rows


def partitions(backends, iters, gen):
    """Rows ``{backend, head_dim, group, kv, split_k, split_v, auto: us, *_plan}`` over :data:`PARTITION_GRID`."""
    rows = []
    for d, group, kv in PARTITION_GRID:
        x = attnplan.testing.make_inputs(1, 8 * group, 8, d, [kv], dtype=torch.bfloat16, device="cuda",
                                         generator=gen, extra_pages=0)
        for be in backends:
            row = {"backend": be, "head_dim": d, "group": group, "kv": kv}
            for part in sorted(get_backend(be).partitions) + ["auto"]:
                cfg = attnplan.load_config(split={"partition": part}, plan_cache={"disk": False})
                try:
                    row[part], plan = _time(cfg, be, x, iters)
                    row[f"{part}_plan"] = (f"{plan.num_splits}x{plan.chunk_size} {plan.partition} "
                                           f"cols={plan.column_programs} {plan.kernel}")
                except Exception as e:  # noqa: BLE001 - a partition that cannot serve the shape is recorded
                    row[part] = None
                    row[f"{part}_plan"] = f"error {type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            cells = "  ".join(f"{p}={row[p]:.1f}us" if row.get(p) else f"{p}=err" for p in ("split_k", "split_v", "auto"))
            print(f"partition {be:8s} d{d:<3d} g{group} kv{kv:<7d} {cells}", flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="merge", help="merge, partition, or both (comma-separated)")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(5)
    backends = args.backends.split(",")
    result = {}
    if "partition" in args.mode:
        result["partition"] = partitions(backends, args.iters, gen)
    if "merge" in args.mode:
        result["merge"] = merges(backends, args.iters, gen)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
