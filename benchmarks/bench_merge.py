"""The cross-program merge, side by side: the separate merge kernel against the merge fused into the last program
of each (sequence, KV head), plus the planner's own choice (``auto``), CUDA-graph replay device time, one run.

For each shape (batch, KV length) of a bf16 grid (default: paged, page 16, 32/8/128, :data:`MERGE_SHAPES`) and each
backend, every merge strategy the backend implements (:attr:`attnplan.backends.base.Backend.merge_strategies`) is
planned by the planner (the same split count for each: the merge does not change the schedule) and timed. Output: a
table on stdout, JSON with ``--out``.

    python benchmarks/bench_merge.py --backends triton,cuda_ptx --out merge.json
    python benchmarks/bench_merge.py --backends cuda_ptx --heads '8,1,128;28,4,128' --shapes 1:32768,4:4096 \
        --layouts contig,paged16
"""

from __future__ import annotations

import argparse
import itertools
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


def merges(backends, iters, gen, heads=((32, 8, 128),), shapes=MERGE_SHAPES, pages=(16,)):
    """Rows ``{backend, heads, layout, batch, kv, <strategy>: us, <strategy>_plan: str}`` for every merge strategy
    the backend has and ``auto``, at every ``(num_q_heads, num_kv_heads, head_dim)`` of ``heads``, ``(batch, kv)`` of
    ``shapes`` and page size of ``pages`` (``None``: a contiguous cache)."""
    rows = []
    for (hq, hkv, d), page, (batch, kv) in itertools.product(heads, pages, shapes):
        x = attnplan.testing.make_inputs(batch, hq, hkv, d, [kv] * batch, page_size=page, dtype=torch.bfloat16,
                                         device="cuda", generator=gen, extra_pages=0)
        layout = f"paged{page}" if page else "contig"
        for be in backends:
            row = {"backend": be, "heads": f"{hq}/{hkv}/{d}", "layout": layout, "batch": batch, "kv": kv}
            for m in strategies(be):
                cfg = attnplan.load_config(split={"merge": m}, plan_cache={"disk": False})
                row[m], plan = _time(cfg, be, x, iters)
                row[f"{m}_plan"] = plan_label(plan, [kv] * batch)
            rows.append(row)
            print(f"merge {be:8s} {hq}/{hkv}/{d} {layout:7s} b{batch:<3d} kv{kv:<7d} " + "  ".join(
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
    ap.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim; several separated by ';'")
    ap.add_argument("--shapes", default=",".join(f"{b}:{kv}" for b, kv in MERGE_SHAPES),
                    help="batch:kv points, comma-separated")
    ap.add_argument("--layouts", default="paged16", help="contig and / or paged<page size>, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    heads = [tuple(int(v) for v in h.split(",")) for h in args.heads.split(";")]
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    pages = []
    for lay in args.layouts.split(","):
        size = lay.removeprefix("paged")
        if lay != "contig" and not (lay.startswith("paged") and size.isdigit() and int(size) > 0):
            ap.error(f"--layouts: {lay!r} is neither contig nor paged<page size>, e.g. paged16")
        pages.append(None if lay == "contig" else int(size))
    if not torch.cuda.is_available():
        print("bench_merge.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(5)
    result = {"merge": merges(args.backends.split(","), args.iters, gen, heads, shapes, pages)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
