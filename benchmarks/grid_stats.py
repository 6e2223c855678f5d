"""Whole-grid statistics of a decode-grid results CSV (``bench_decode.py``'s ``<out>.csv``), and its comparison
with a baseline CSV.

Per heads configuration: the geometric mean and minimum of the speedup (best peer time / best attnplan time,
CUDA-graph replay), the points at 0.95x or better, the uniform points of at least 256 MiB that reach 92% of
their run's read ceiling, each attnplan backend alone, and the points under 0.95x. With ``--baseline``, the
ratio new / baseline of the best attnplan time and of the best peer time per heads configuration (geometric
means over the points both files hold) and the points whose best attnplan time moved by more than
``--tolerance``: a re-run on the same device and code should stay within about 2% (the run-to-run spread
measured on an H200 between whole-grid runs was 1-3% per heads configuration, peers included).

    python benchmarks/grid_stats.py benchmarks/results/decode_grid.csv --kind uniform --by-layout
    python benchmarks/grid_stats.py new.csv --baseline benchmarks/results/decode_grid.csv
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import OURS, _key, best, contenders, gmean, read_csv  # noqa: E402


def stats(rows: list[dict], by_layout: bool = False) -> dict:
    """The grid's statistics (see the module docstring) as a dict:
    ``{"by_heads": {heads: {"points", "geomean", "min"}}, "all": {...}, "at_095", "big", "big_at_092",
    "backends": {name: {"geomean", "min"}}, "under_095": [(speedup, heads, layout, kind, batch, kv)]}``; with
    ``by_layout``, ``by_heads`` is keyed by ``"heads | layout"``."""
    by_heads: dict = {}
    per_backend: dict = {}
    big = big_ok = 0
    under = []
    for r in rows:
        if r.get("speedup") in (None, ""):
            continue
        sp = float(r["speedup"])
        by_heads.setdefault(f"{r['heads']} | {r['layout']}" if by_layout else r["heads"], []).append(sp)
        peers = [n for n in contenders(r) if n not in OURS]
        _, t_peer = best(r, peers)
        for n in contenders(r):
            if n in OURS and r.get(f"{n}_us") not in (None, ""):
                per_backend.setdefault(n, []).append(t_peer / float(r[f"{n}_us"]))
        if r["kind"] == "uniform" and int(r["bytes"]) >= 2**28:
            big += 1
            _, t_ours = best(r, [n for n in contenders(r) if n in OURS])
            big_ok += int(r["bytes"]) / (t_ours * 1e3) / float(r["ceiling_gbs"]) >= 0.92
        if sp < 0.95:
            under.append((sp, r["heads"], r["layout"], r["kind"], r["batch"], r["kv"]))
    every = [s for v in by_heads.values() for s in v]
    return {"by_heads": {h: {"points": len(v), "geomean": gmean(v), "min": min(v)} for h, v in by_heads.items()},
            "all": {"points": len(every), "geomean": gmean(every), "min": min(every) if every else math.nan},
            "at_095": sum(s >= 0.95 for s in every), "big": big, "big_at_092": big_ok,
            "backends": {n: {"geomean": gmean(v), "min": min(v)} for n, v in sorted(per_backend.items())},
            "under_095": sorted(under)}


def compare(new: list[dict], base: list[dict], tolerance: float) -> dict:
    """Per heads configuration, geometric means of new / baseline for the best attnplan and the best peer time
    over the points both hold; and the points whose best attnplan time moved by more than ``tolerance``
    (a fraction), as ``(ratio, heads, layout, kind, batch, kv)``."""
    old = {_key(r): r for r in base}
    ratios: dict = {}
    moved = []
    for r in new:
        o = old.get(_key(r))
        if o is None:
            continue
        ours = [n for n in contenders(r) if n in OURS]
        peers = [n for n in contenders(r) if n not in OURS]
        t_new, t_old = best(r, ours)[1], best(o, ours)[1]
        p_new, p_old = best(r, peers)[1], best(o, peers)[1]
        if not all(map(math.isfinite, (t_new, t_old, p_new, p_old))):
            continue
        ratios.setdefault(r["heads"], []).append((t_new / t_old, p_new / p_old))
        if abs(t_new / t_old - 1) > tolerance:
            moved.append((t_new / t_old, r["heads"], r["layout"], r["kind"], r["batch"], r["kv"]))
    return {"by_heads": {h: {"points": len(v), "ours": gmean(a for a, _ in v), "peers": gmean(b for _, b in v)}
                         for h, v in ratios.items()}, "moved": sorted(moved)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--baseline", default=None, help="a results CSV to compare with (e.g. the committed decode_grid.csv)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="list points whose best attnplan time moved more")
    ap.add_argument("--kind", default=None, help="only the points of this kind (uniform, varlen); default: all")
    ap.add_argument("--by-layout", action="store_true", help="one row per heads configuration and cache layout")
    a = ap.parse_args(argv)
    rows = [r for r in read_csv(a.csv) if a.kind is None or r.get("kind") == a.kind]
    if not rows:
        ap.error(f"{a.csv} holds no points of kind {a.kind!r}")
    s = stats(rows, a.by_layout)
    head = "| heads | layout " if a.by_layout else "| heads "
    print(f"{head}| points | geomean | min |\n|---{'|---' * a.by_layout}|---|---|---|")
    for h, v in s["by_heads"].items():
        print(f"| {h} | {v['points']} | {v['geomean']:.3f}x | {v['min']:.2f}x |")
    print(f"| all {'| ' * a.by_layout}| {s['all']['points']} | {s['all']['geomean']:.3f}x | {s['all']['min']:.2f}x |")
    print(f"points at 0.95x or better: {s['at_095']} of {s['all']['points']}")
    print(f"uniform points of >= 256 MiB at >= 92% of the ceiling: {s['big_at_092']} of {s['big']}")
    for n, v in s["backends"].items():
        print(f"{n} alone: geomean {v['geomean']:.3f}x, min {v['min']:.2f}x")
    print(f"{len(s['under_095'])} points under 0.95x:")
    for sp, *key in s["under_095"]:
        print(f"  {sp:.3f}x  " + " ".join(map(str, key)))
    if a.baseline:
        c = compare(read_csv(a.csv), read_csv(a.baseline), a.tolerance)
        print(f"\nagainst {a.baseline} (time ratio new / baseline, geometric means; < 1: faster now)")
        print("| heads | points | best attnplan | best peer |\n|---|---|---|---|")
        for h, v in c["by_heads"].items():
            print(f"| {h} | {v['points']} | {v['ours']:.3f} | {v['peers']:.3f} |")
        print(f"{len(c['moved'])} points whose best attnplan time moved by more than {a.tolerance:.0%}:")
        for ratio, *key in c["moved"]:
            print(f"  {ratio:.3f}  " + " ".join(map(str, key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
