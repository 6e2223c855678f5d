"""Issue #4 check: cuda_ptx's tensor-core warp tile (option ``passes``) x warps x stages at batch 1,
32/8/128, KV 32K contiguous, then the best options against the default and cuDNN at KV 4K / 32K / 128K.

Sweeps with :func:`attnplan.tune.sweep` (every split count, CUDA-graph replay), writes the best options
as a config and runs ``bench_decode.py`` with and without it in this process's machine (one GPU call).

    python benchmarks/tile_check.py --out dir
"""

import argparse
import json
import os
import subprocess
import sys

from attnplan.tune import sweep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--grid", default="passes=1,2;num_warps=1,2,4;num_stages=2,3")
    args = ap.parse_args()
    from attnplan.tune import parse_option_grid

    rows = sweep("cuda_ptx", shapes=[(1, 32768)], layouts=("contiguous",), iters=30,
                 option_grid=parse_option_grid(args.grid))
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    for r in ok[:8]:
        print(f"{r['us']:7.1f} us  " + " ".join(f"{k}={r[k]}" for k in ("passes", "num_warps", "num_stages", "splits")))
    best = {k: ok[0][k] for k in ("passes", "num_warps", "num_stages")}
    cfg = os.path.join(args.out, "best.yaml")
    with open(cfg, "w") as f:
        f.write("version: 1\nbackend_options:\n  cuda_ptx: " + json.dumps(best) + "\n")
    with open(os.path.join(args.out, "tile_sweep.json"), "w") as f:
        json.dump({"rows": rows, "best": best}, f, indent=1)
    bench = [sys.executable, "benchmarks/bench_decode.py", "--backends", "cuda_ptx", "--batches", "1",
             "--kv", "4096,32768,131072", "--layouts", "contig", "--peers", "cudnn", "--varlen=", "--iters", "30"]
    for name, env in (("default", {}), ("best", {"ATTNPLAN_CONFIG": cfg})):
        out = subprocess.run(bench + ["--out", os.path.join(args.out, f"bench_{name}.json")], env={**os.environ, **env},
                             capture_output=True, text=True)
        print(f"== {name} {best if name == 'best' else ''}")
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith("32/8/128")))


if __name__ == "__main__":
    main()
