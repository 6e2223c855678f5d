"""Whole-grid statistics of issue #7 from one or more ``bench_decode.py`` JSON files: per head configuration
the geometric-mean and minimum speedup of the best attnplan backend over the best torch peer (graph replay,
:func:`attnplan.bench.best`), the points at 0.95x or better, the uniform points of at least 256 MiB of KV at
92% of the run's read ceiling, each backend's own geomean, and the points under 0.95x.

    python benchmarks/diag/grid_stats.py results/2026-11-30-s6-call5/bench.json results/2026-11-30-s6-call5/bench2.json

Made the session-6 whole-grid tables of benchmarks/README.md (and, on session 5's files, the comparison column).

A file may carry ``@heads`` to count only some head configurations from it, e.g. a newer run of two heads
beside an older run of the rest (each point keeps its own run's ceiling):

    python benchmarks/diag/grid_stats.py s7-call3/bench.json s7-call3/bench2.json@64/8/128,28/4/128,8/1/128 \
        s7-call7/bench.json
"""

import argparse
import json
import math

from attnplan.bench import best

OURS = ("triton", "cuda_ptx", "numba")


def gmean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    a = ap.parse_args()
    by_heads, big, per_backend, losses = {}, [], {}, []
    for arg in a.json:
        path, _, only = arg.partition("@")
        d = json.load(open(path))
        bw = d["ceiling"][d["ceiling_used"]]  # GB/s
        for p in d["points"]:
            heads = "/".join(map(str, p["heads"]))
            if only and heads not in only.split(","):
                continue
            names = set(p["results"])
            ours = names & set(OURS)
            _, t_ours = best(p, ours)
            _, t_peer = best(p, names - ours)
            sp = t_peer / t_ours
            by_heads.setdefault(heads, []).append(sp)
            for n in ours:
                per_backend.setdefault(n, []).append(t_peer / best(p, {n})[1])
            if p.get("kind", "uniform") == "uniform" and p["bytes"] >= 2**28:
                big.append(p["bytes"] / (t_ours * 1e3) / bw)  # bytes / us = MB/s; / 1e3 = GB/s
            if sp < 0.95:
                losses.append((sp, heads, p["layout"], p.get("kind", "uniform"), p["batch"], p["kv_len"]))
    print("| heads | points | geomean | min |\n|---|---|---|---|")
    for h, v in by_heads.items():
        print(f"| {h} | {len(v)} | {gmean(v):.2f}x | {min(v):.2f}x |")
    every = [s for v in by_heads.values() for s in v]
    print(f"| all | {len(every)} | {gmean(every):.3f}x | {min(every):.2f}x |")
    print(f"points at 0.95x or better: {sum(s >= 0.95 for s in every)} of {len(every)}")
    print(f"uniform points of >= 256 MiB at >= 92% of the ceiling: {sum(f >= 0.92 for f in big)} of {len(big)}")
    for n, v in sorted(per_backend.items()):
        print(f"{n} alone: geomean {gmean(v):.3f}x, min {min(v):.2f}x")
    print(f"{len(losses)} points under 0.95x:")
    for sp, *key in sorted(losses):
        print(f"  {sp:.2f}x  " + " ".join(map(str, key)))


if __name__ == "__main__":
    main()
