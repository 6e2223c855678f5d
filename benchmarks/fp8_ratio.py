"""fp8 KV against bf16 KV: two runs of ``bench_decode.py`` on the same points (``--kv-dtype bfloat16`` and
``--kv-dtype float8_e4m3fn``, no peers) combined into one compact results file, the best attnplan backend of each.

    python benchmarks/bench_decode.py --out <dir>/fp8_bfloat16 --heads 32,8,128 --batches 4,16,64 \\
        --kv 16384,65536,131072 --varlen= --peers= --kv-dtype bfloat16 --iters 20
    python benchmarks/bench_decode.py --out <dir>/fp8_float8_e4m3fn ... --kv-dtype float8_e4m3fn --iters 20
    python benchmarks/fp8_ratio.py <dir>/fp8_bfloat16.json <dir>/fp8_float8_e4m3fn.json --out benchmarks/results/fp8.json

Only the points of at least ``--min-mb`` MB of bf16 KV count (the target's set); the ratio is best bf16 time / best
fp8 time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import OURS, read_csv  # noqa: E402


def _rows(csv_path: str) -> dict:
    """The uniform points of a ``bench_decode.py`` CSV by ``(heads, layout, batch, kv)``."""
    return {(r["heads"], r["layout"], r["batch"], r["kv"]): r for r in read_csv(csv_path) if r["kind"] == "uniform"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bf16", help="bench_decode.py's --out prefix (or its .json) for bf16 KV")
    ap.add_argument("fp8", help="the same for fp8 KV")
    ap.add_argument("--out", default="benchmarks/results/fp8.json")
    ap.add_argument("--min-mb", type=float, default=256.0)
    ap.add_argument("--target", type=float, default=1.7)
    args = ap.parse_args(argv)
    pre = [p[:-5] if p.endswith(".json") else p for p in (args.bf16, args.fp8)]
    runs = [json.load(open(p + ".json")) for p in pre]
    tabs = [_rows(p + ".csv") for p in pre]
    rows = []
    for key, b in tabs[0].items():
        f = tabs[1].get(key)
        if f is None or int(b["bytes"]) < args.min_mb * 2**20:
            continue
        bu = {be: float(b[f"{be}_us"]) for be in OURS if b.get(f"{be}_us") not in (None, "")}
        fu = {be: float(f[f"{be}_us"]) for be in OURS if f.get(f"{be}_us") not in (None, "")}
        if not bu or not fu:
            continue
        bb, fb = min(bu, key=bu.get), min(fu, key=fu.get)
        rows.append({"heads": key[0], "layout": key[1], "batch": key[2], "kv": key[3], "bf16_bytes": int(b["bytes"]),
                     "bf16_us": bu, "fp8_us": fu, "bf16_best": bb, "fp8_best": fb,
                     "ratio": round(bu[bb] / fu[fb], 3)})
    run = runs[0]["runs"][-1] if "runs" in runs[0] else runs[0]
    doc = {"what": "best attnplan backend, bf16 KV against fp8 e4m3 KV (per-tensor scales), same points, one run on one machine",
           "commands": [r["runs"][-1].get("command") if "runs" in r else r.get("command") for r in runs],
           "env": run.get("env"), "method": run.get("method"), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    ok = sum(r["ratio"] >= args.target for r in rows)
    print(f"fp8 / bf16 (best backend each; points of >= {args.min_mb:.0f} MB of bf16 KV): {ok} of {len(rows)} "
          f">= {args.target}x")
    for r in rows:
        print(f"  {r['heads']:9s} {r['layout']:7s} b{r['batch']:<3d} {r['kv']:>6d}  bf16 {r['bf16_us'][r['bf16_best']]:8.1f} "
              f"({r['bf16_best']})  fp8 {r['fp8_us'][r['fp8_best']]:8.1f} ({r['fp8_best']})  {r['ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
