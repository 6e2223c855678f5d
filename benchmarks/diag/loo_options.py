"""Diagnostic (s9): the tune's leave-one-out check against the best choice with and without per-row options.

``attnplan tune --row-options`` raises the bar of its own quality check: the exhaustive best is now the best
(options, split count), so a leave-one-out plan that runs the table's default options can miss it even where it
is as good as any plan without per-row options was. This reads ``tune-*.json`` files and counts, per file, the
leave-one-out choices within 5% of the best choice and within 5% of the best choice under ``--default`` options
(the search's own timings; the leave-one-out time is rescaled from the fresh best the tune timed beside it).

    python benchmarks/diag/loo_options.py benchmarks/results/2026-11-30-s9-call2/tune-*.json
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--backend", default="cuda_ptx")
    ap.add_argument("--default", default="num_warps=4", help="the options a plan without per-row options runs")
    args = ap.parse_args()
    key, val = args.default.split("=")
    total = within = within_default = 0
    for f in args.files:
        d = json.load(open(f))
        rows = d["split_search"][args.backend]
        n = w = wd = 0
        for q in d["quality"]:
            point = (q["layout"], q["batch"], q["kv"])
            rs = [r for r in rows if (r["layout"], r["batch"], r["kv"]) == point]
            best = min(r["us"] for r in rs)
            best_default = min(r["us"] for r in rs if str(r["options"].get(key)) == val)
            loo = q["loo_us"] / q["best_us"] * best  # on the search's scale
            n, w, wd = n + 1, w + (loo <= 1.05 * best), wd + (loo <= 1.05 * best_default)
        print(f"{f}: {n} points, leave-one-out within 5% of the best {w}, of the best with {args.default} {wd}")
        total, within, within_default = total + n, within + w, within_default + wd
    print(f"all: {total} points, within 5% of the best {within}, of the best with {args.default} {within_default}")


if __name__ == "__main__":
    main()
