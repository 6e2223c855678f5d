"""Host cost of one eager decode call: what a caller that does not capture graphs pays on the CPU per layer.

Times, per backend, medians over ``--calls`` calls in a quiet loop (the GPU work is tiny, so the host is the
bottleneck and the wall time per call is the host's cost): ``DecodeWrapper.run()`` after one ``plan()``;
``plan()`` again with host lengths (a plan-cache hit); ``attnplan.decode()`` with ``seq_lens_host`` (cache hit);
and torch's ``scaled_dot_product_attention`` on the same data (dense, ``enable_gqa``) as the bar. It also checks
that ``run()`` and, with host lengths, ``plan()`` / ``decode()`` never synchronize the host
(``torch.cuda.set_sync_debug_mode("error")``).

Usage (GPU machine)::

    python benchmarks/bench_host.py --out benchmarks/results/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnplan
from attnplan.testing import make_inputs


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` rounds of the mean wall time per call of ``calls`` back-to-back calls (us)."""
    for _ in range(min(200, calls)):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def no_sync(fn) -> str:
    """'ok' if ``fn`` runs with sync debug mode 'error', else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return f"sync: {str(e)[:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="triton,cuda_ptx,numba")
    ap.add_argument("--kv", default="1024,32768")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/host.json")
    args = ap.parse_args(argv)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kv in (int(x) for x in args.kv.split(",")):
        x = make_inputs(1, hq, hkv, d, [kv], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
        lens = [kv]
        args_ = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        qd = x.q.transpose(1, 2)  # [1, Hq, 1, D]
        kd = torch.randn(1, hkv, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vd = torch.randn_like(kd)
        sdpa = per_call_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), args.calls)
        rows.append({"kv": kv, "what": "torch sdpa", "us": sdpa})
        for be in args.backends.split(","):
            try:
                w = attnplan.DecodeWrapper(backend=be)
                w.plan(*args_, seq_lens_host=lens)
                out = torch.empty_like(x.q)
                w.run(*args_, out=out)
                r = {"kv": kv, "backend": be,
                     "run_us": per_call_us(lambda: w.run(*args_, out=out), args.calls),
                     "plan_hit_us": per_call_us(lambda: w.plan(*args_, seq_lens_host=lens), args.calls // 4),
                     "decode_us": per_call_us(lambda: attnplan.decode(*args_, out=out, backend=be, seq_lens_host=lens),
                                              args.calls // 4),
                     "run_sync": no_sync(lambda: w.run(*args_, out=out)),
                     "plan_sync": no_sync(lambda: w.plan(*args_, seq_lens_host=lens)),
                     "decode_sync": no_sync(lambda: attnplan.decode(*args_, out=out, backend=be, seq_lens_host=lens))}
            except Exception as e:  # noqa: BLE001 - report and go on
                r = {"kv": kv, "backend": be, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(r)
            print(r, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/bench_host.py", *(argv or sys.argv[1:])]),
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("\nkv      backend   run_us  plan_hit_us  decode_us  sdpa_us  syncs(run/plan/decode)")
    sd = {r["kv"]: r["us"] for r in rows if r.get("what") == "torch sdpa"}
    for r in rows:
        if "run_us" in r:
            print(f"{r['kv']:<7d} {r['backend']:9s} {r['run_us']:6.1f} {r['plan_hit_us']:12.1f} {r['decode_us']:10.1f} "
                  f"{sd[r['kv']]:8.1f}  {r['run_sync']}/{r['plan_sync']}/{r['decode_sync']}")
        elif "error" in r:
            print(f"{r['kv']:<7d} {r['backend']:9s} error {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
