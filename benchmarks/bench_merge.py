"""The cross-program merge, side by side: the separate merge kernel against the merge fused into the last program
of each (sequence, KV head), plus the planner's own choice (``auto``), CUDA-graph replay device time, one run.

For each shape of a paged (page 16) 32/8/128 bf16 grid and each backend, every merge strategy the backend
implements (:attr:`attnplan.backends.base.Backend.merge_strategies`) is planned by the planner (the same split
count for each: the merge does not change the schedule) and timed. Output: a table on stdout, JSON with ``--out``.

    python benchmarks/bench_merge.py --backends triton,cuda_ptx --out merge.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import attnplan
import attnplan.testing
from attnplan.backends import get_backend

MERGE_SHAPES = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (4, 4096), (16, 4096), (4, 32768)]


def strategies(backend: str) -> list[str]:
    """The merge settings compared for ``backend``: each strategy it implements (``separate``, ``fused``), then
    ``auto``."""
    return sorted(get_backend(backend).merge_strategies) + ["auto"]


def plan_label(plan, seq_lens) -> str:
    """``"<units>u <merge>"``: the units the plan's schedule gives the longest of ``seq_lens`` and its merge."""
    from attnplan.schedule import schedule_units

    p = plan.problem
    u = schedule_units(seq_lens, plan.schedule, p.q_len, p.window_left)
    return f"{int(u.units.max())}u {plan.merge}"


def _time(cfg, be, x, iters):
    from attnplan.tune import _graph_time

    w = attnplan.DecodeWrapper(cfg, backend=be)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    return _graph_time(w, x, iters), plan


def merges(backends, iters, gen):
    """Rows ``{backend, batch, kv, <strategy>: us, <strategy>_plan: str}`` for every merge strategy the backend has
    and ``auto``."""
    rows = []
    for batch, kv in MERGE_SHAPES:
        x = attnplan.testing.make_inputs(batch, 32, 8, 128, [kv] * batch, page_size=16, dtype=torch.bfloat16,
                                         device="cuda", generator=gen, extra_pages=0)
        for be in backends:
            row = {"backend": be, "batch": batch, "kv": kv}
            for m in strategies(be):
                cfg = attnplan.load_config(split={"merge": m}, plan_cache={"disk": False})
                row[m], plan = _time(cfg, be, x, iters)
                row[f"{m}_plan"] = plan_label(plan, [kv] * batch)
            rows.append(row)
            print(f"merge {be:8s} b{batch:<3d} kv{kv:<7d} " + "  ".join(
                f"{m}={row[m]:.1f}us ({row[m + '_plan']})" for m in strategies(be)), flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="merge", choices=["merge"],
                    help="what to compare: merge (the only mode; the split-K / split-V partition mode went with "
                         "split-V)")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_merge.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(5)
    result = {"merge": merges(args.backends.split(","), args.iters, gen)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
