"""The planner's plan against a forced plan of the same units per sequence: the same split count, kernel options
and merge, so what differs is the schedule's grid (unit slots) and policy. Each point's two plans are captured in
CUDA graphs over rotated input copies (at least 512 MB per round) and timed in alternating rounds (L2 flushed,
medians of ``--iters`` replays per round).

    python benchmarks/plan_vs_forced.py --points triton:28,4,128:4:16384:contig,triton:8,1,128:16:16384:contig

A point is ``backend:heads:batch:kv:layout`` (``layout`` ``contig`` or ``paged``, page 16). Prints one line per
point: the units, both grids (programs), each round's time and the ratio of the medians (planner / forced).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

DEFAULT = ("triton:28,4,128:4:16384:contig,triton:8,1,128:16:16384:contig,triton:32,8,128:1:16384:contig,"
           "triton:28,4,128:4:16384:paged,cuda_ptx:32,8,128:4:65536:contig")


def one(backend: str, heads, batch: int, kv: int, paged: bool, rounds: int, iters: int, gen) -> dict:
    """Time the planner's and the forced plan of one point: ``{"units", "grids", "planner_us", "forced_us"}``."""
    import attnplan
    from attnplan.testing import make_inputs
    from attnplan.timing import capture_graphs, time_cuda
    from attnplan.tune import units_per_sequence

    hq, hk, d = heads
    ncopy = max(2, -(-512 * 2**20 // (4 * batch * kv * hk * d)))
    xs = [make_inputs(batch, hq, hk, d, [kv] * batch, page_size=16 if paged else None, dtype=torch.bfloat16,
                      device="cuda", generator=gen, extra_pages=0) for _ in range(ncopy)]
    graphs, grids, units = {}, {}, None
    for name in ("planner", "forced"):
        w = attnplan.DecodeWrapper(backend=backend)
        x = xs[0]
        p = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=None if units is None else units)
        units = units_per_sequence(p, kv) if units is None else units
        grids[name] = p.num_programs
        outs = [torch.empty_like(x.q) for x in xs]
        graphs[name] = (w, outs, capture_graphs(lambda j: w.run(xs[j].q, xs[j].k_cache, xs[j].v_cache, xs[j].seq_lens,
                                                                xs[j].block_table, out=outs[j]), ncopy))
    t = {"planner": [], "forced": []}
    for r in range(rounds):
        for name in ("planner", "forced") if r % 2 == 0 else ("forced", "planner"):
            gs = graphs[name][2]
            t[name].append(time_cuda(lambda i: gs[i % ncopy].replay(), flush=True, iters=iters)["median_us"])
    return {"units": units, "grids": grids, "planner_us": t["planner"], "forced_us": t["forced"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_vs_forced needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(5)
    for spec in args.points.split(","):
        backend, heads, batch, kv, layout = spec.split(":")
        r = one(backend, tuple(int(v) for v in heads.split(",")), int(batch), int(kv), layout == "paged",
                args.rounds, args.iters, gen)
        ratio = statistics.median(r["planner_us"]) / statistics.median(r["forced_us"])
        print(f"{backend:8s} {heads.replace(',', '/'):9s} b{batch:<3s} {kv:>6s} {layout:6s} units {r['units']:3d} "
              f"grids {r['grids']['planner']}/{r['grids']['forced']} planner {[round(v, 1) for v in r['planner_us']]} "
              f"forced {[round(v, 1) for v in r['forced_us']]} planner/forced {ratio:.3f}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
