"""A capacity plan against a live plan at uniform lengths: what a CUDA-graph plan's large grid costs when the batch's
work is the same as a live plan's.

A capacity plan (``DecodeWrapper.plan(..., capacity=True)``) sizes its grid for the cache's capacity, so at short
lengths most of its programs find no unit and exit; a live plan's grid at uniform lengths holds about its units
(often a single pass of exactly its programs). Both are replayed from CUDA graphs with the L2 flushed
(``bench_longtail.graph_time``), their outputs checked against a float32 reference first, beside a bare read of the
same bytes.

    python benchmarks/capacity_uniform.py --backend cuda_ptx --heads '32,8,128;16,8,256' --lengths 16384,32768

``--configs a.yaml,b.yaml`` also times the capacity plans of those config files (each merged over
``plans/default.yaml``, e.g. ``benchmarks/configs/merge-fused.yaml``) in the same process.

Prints per point each plan's schedule lines from ``explain()`` (grid, units, kernel options, merge), then one line
(us): the read floor, the capacity plan, each config's capacity plan, the live plan.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import attnplan
import attnplan.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_longtail import graph_time, max_err, read_us, reference_out, shuffled_block_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda_ptx")
    ap.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim; several separated by ';'")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lengths", default="16384,32768", help="uniform lengths (tokens) to time")
    ap.add_argument("--capacity", type=int, default=131072, help="tokens per sequence the cache holds")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", default="", help="also time the capacity plans of these config files (comma-"
                    "separated YAML paths)")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    gen = torch.Generator(device="cuda").manual_seed(1)
    page, cap, batch = args.page, args.capacity, args.batch
    lengths = [int(v) for v in args.lengths.split(",")]
    for heads in args.heads.split(";"):
        hq, hkv, d = (int(v) for v in heads.split(","))
        pool = batch * -(-max(lengths) // page) + 1
        k = torch.randn(pool, page, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(pool, page, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
        for n in lengths:
            lens = [n] * batch
            bt = shuffled_block_table(lens, page, cap // page, pool, gen)
            q = torch.randn(batch, 1, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
            sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
            ref = reference_out(q, k, v, lens, bt, page)
            row = [f"{hq}/{hkv}/{d} b{batch} L{n}", f"read {read_us(sum(lens) * hkv * d * 4, args.iters):.1f}"]
            for mode in ["capacity", *configs, "live"]:
                w = attnplan.DecodeWrapper(*([mode] if mode in configs else []), backend=args.backend)
                if mode == "live":
                    w.plan(q, k, v, sl, bt, seq_lens_host=lens)
                else:
                    w.plan(q, k, v, sl, bt, capacity=True)
                name = os.path.splitext(os.path.basename(mode))[0] if mode in configs else mode
                out = torch.empty_like(q)
                w.run(q, k, v, sl, bt, out=out)
                torch.cuda.synchronize()
                err = max_err(out, ref)
                assert err < attnplan.testing.BENCH_CHECK_REL, f"{name} plan: error {err:.3g}"
                row.append(f"{name} {graph_time(lambda: w.run(q, k, v, sl, bt, out=out), args.iters):.1f}")
                sched = [ln.strip() for ln in w.explain(lens).splitlines()
                         if "grid" in ln or "at these lengths" in ln or ln.startswith("kernel options")
                         or ln.strip().startswith("merge:")]
                print(f"    {name}: " + " | ".join(s[:160] for s in sched))
            print(" ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
