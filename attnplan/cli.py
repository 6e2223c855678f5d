"""The ``attnplan`` command line.

``attnplan run``: run a decode workload through the configured backend, print the plan, the
backend and the error against the float64 reference (and, on a GPU, time and bandwidth).
``attnplan plans show|clear``: inspect or empty the on-disk plan cache.

On a machine without a CUDA GPU the command sets ``TRITON_INTERPRET=1`` and
``NUMBA_ENABLE_CUDASIM=1`` (unless already set) so the kernels run in Triton's interpreter and
numba's simulator, at a small size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: (num_q_heads, num_kv_heads, head_dim) from the models' published configurations.
MODEL_PRESETS = {
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (64, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "mistral-7b": (32, 8, 128),
    "phi-3-mini": (32, 32, 96),
    "gemma-2-9b": (16, 8, 256),
}


def _cpu_mode() -> bool:
    import torch

    return not torch.cuda.is_available()


def _lengths(args, rng) -> list[int]:
    if args.kv_lens:
        lens = [int(x) for x in args.kv_lens.split(",")]
        if len(lens) == 1:
            lens = lens * args.batch
        if len(lens) != args.batch:
            raise SystemExit(f"--kv-lens gives {len(lens)} lengths but --batch is {args.batch}")
        return lens
    from attnplan.testing import long_tailed_lengths

    return long_tailed_lengths(args.batch, args.max_kv, rng.randrange(2**31))


def _time_report(w, x, args, lens) -> dict:
    """Median time of one decode step (every kernel of ``w.run``) with CUDA events after warm-up,
    and the bandwidth of the bytes it must move (K + V of the valid tokens, q, out), GB/s."""
    import attnplan
    from attnplan.problem import dtype_name
    from attnplan.timing import time_cuda

    b, ql, hq, d = x.q.shape
    r = time_cuda(lambda i: w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table), iters=args.iters)
    nbytes = attnplan.DecodeProblem(batch=b, num_q_heads=hq, num_kv_heads=x.k_cache.shape[2], head_dim=d, q_len=ql,
                                    q_dtype=dtype_name(x.q.dtype), kv_dtype=dtype_name(x.k_cache.dtype),
                                    max_kv_len=max(lens), total_kv_len=sum(lens)).bytes_moved()
    r = {k: v for k, v in r.items() if k != "samples_us"}
    return {**r, "bytes": nbytes, "gbs": nbytes / (r["median_us"] * 1e-6) / 1e9,
            "note": "one decode step (all kernels), CUDA events after warm-up; inputs not rotated"}


def _run(args) -> int:
    import random

    import torch

    import attnplan
    from attnplan import reference
    from attnplan.testing import make_inputs, tolerance

    cpu = _cpu_mode()
    device = "cpu" if cpu else "cuda"
    hq, hkv, d = MODEL_PRESETS[args.model]
    if args.batch is None:
        args.batch = 3 if cpu else 4
    if args.max_kv is None:
        args.max_kv = 200 if cpu else 32768
    rng = random.Random(args.seed)
    lens = _lengths(args, rng)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    page = args.page_size or None
    gen = torch.Generator().manual_seed(args.seed)
    x = make_inputs(args.batch, hq, hkv, d, lens, q_len=args.q_len, page_size=page, dtype=dtype,
                    device=device, generator=gen)
    ctx = attnplan.Context.from_config(attnplan.load_config(args.config))
    w = attnplan.DecodeWrapper(ctx, backend=args.backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=args.num_splits)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device=device)
    out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, lse=lse)
    report = {
        "device": attnplan.device_info(device).to_dict(), "mode": "cpu-interpreter" if cpu else "gpu",
        "model": args.model, "heads": [hq, hkv, d], "batch": args.batch, "q_len": args.q_len, "dtype": args.dtype,
        "page_size": page, "kv_lens": lens, "backend": w.backend.name,
        "skipped": {n: r for n, r in w.skipped}, "plan": plan.to_dict(),
    }
    if not args.no_check:
        n = min(args.batch, args.check_seqs)
        bt = x.block_table[:n] if x.block_table is not None else None
        kc, vc = (x.k_cache, x.v_cache) if page else (x.k_cache[:n], x.v_cache[:n])
        ref, ref_lse = reference.attention(x.q[:n], kc, vc, x.seq_lens[:n], bt, x.sm_scale)
        err = (out[:n].double().cpu() - ref).abs()
        atol, rtol = tolerance(dtype)
        ok = bool((err <= atol + rtol * ref.abs()).all()) and not torch.isnan(out).any().item()
        lse_ok = bool(torch.equal(torch.isinf(lse[:n].cpu()), torch.isinf(ref_lse)))
        report["check"] = {"sequences": n, "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
                           "tolerance": [atol, rtol], "pass": ok and lse_ok}
    if not cpu and args.iters > 0:
        report["time"] = _time_report(w, x, args, lens)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"attnplan {attnplan.__version__} | {report['mode']} | {report['device']['name']}")
        print(f"workload: {args.model} heads {hq}/{hkv}/{d}, batch {args.batch}, q_len {args.q_len}, {args.dtype}, "
              f"{'page ' + str(page) if page else 'contiguous'} cache, KV lengths {lens if len(lens) <= 16 else str(lens[:16]) + '...'}")
        print(f"backend: {w.backend.name}")
        print("plan:\n  " + w.explain().replace("\n", "\n  "))
        if "check" in report:
            c = report["check"]
            print(f"check vs float64 reference ({c['sequences']} sequences): max abs err {c['max_abs_err']:.3e}, "
                  f"mean abs err {c['mean_abs_err']:.3e} (tolerance atol {c['tolerance'][0]}, rtol {c['tolerance'][1]}): "
                  f"{'PASS' if c['pass'] else 'FAIL'}")
        if "time" in report:
            t = report["time"]
            print(f"time: {t['median_us']:.1f} us per step (median of {t['iters']}), {t['gbs']:.0f} GB/s of K+V+Q+O")
    return 0 if report.get("check", {}).get("pass", True) else 1


def _plans(args) -> int:
    import attnplan
    from attnplan.api import Context
    from attnplan.planner import SplitPlan

    ctx = Context.from_config(attnplan.load_config(args.config))
    cache = ctx.cache
    if args.action == "clear":
        n = cache.clear()
        print(f"removed {n} plan file(s) from {cache.directory}")
        return 0
    entries = cache.entries()
    print(f"plan cache: {cache.directory} ({len(entries)} plan file(s))")
    for e in entries:
        print(f"\n== {e['file']}")
        if "error" in e:
            print(f"  unreadable: {e['error']}")
            continue
        try:
            print("  " + SplitPlan.from_dict(e["plan"]).explain().replace("\n", "\n  "))
        except (KeyError, TypeError) as err:
            print(f"  unreadable plan: {err}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``attnplan`` console script: ``run``, ``plans show|clear``, ``bench``, ``tune``. Returns the exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # ``bench`` and ``tune`` own their options: hand everything after the word to them unparsed
    # (argparse's REMAINDER drops a tail that starts with an option, e.g. ``tune --json out.json``)
    passthrough = []
    for i, tok in enumerate(argv):
        if tok in ("bench", "tune") and (i == 0 or argv[i - 1] != "--config"):
            argv, passthrough = argv[: i + 1], argv[i + 1:]
            break
    parser = argparse.ArgumentParser(prog="attnplan", description="split-KV decode attention: run, inspect plans",
                                     allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML config file (default: $ATTNPLAN_CONFIG or plans/default.yaml)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a decode workload and check it against the float64 reference")
    r.add_argument("--model", choices=sorted(MODEL_PRESETS), default="llama-3.1-8b", help="head configuration preset")
    r.add_argument("--batch", type=int, default=None, help="sequences (default 3 on CPU, 4 on GPU)")
    r.add_argument("--kv-lens", default=None, help="comma-separated KV lengths (one value = all sequences)")
    r.add_argument("--max-kv", type=int, default=None,
                   help="longest KV length of the long-tailed draw (default 200 on CPU, 32768 on GPU)")
    r.add_argument("--q-len", type=int, default=1, help="queries per sequence (speculative verification > 1)")
    r.add_argument("--page-size", type=int, default=16, help="tokens per page; 0 = contiguous cache")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    r.add_argument("--backend", default=None, help="force a backend (default: the config's order)")
    r.add_argument("--num-splits", type=int, default=None, help="0 heuristic, 1 no split, >1 forced")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--iters", type=int, default=50, help="timed iterations on a GPU (0: no timing)")
    r.add_argument("--check-seqs", type=int, default=4, help="sequences checked against the reference")
    r.add_argument("--no-check", action="store_true", help="skip the reference check")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("plans", help="inspect or clear the on-disk plan cache")
    p.add_argument("action", choices=["show", "clear"])
    bench = sub.add_parser("bench", help="GPU benchmark against torch SDPA (flash, cuDNN); --help for its options",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    tune = sub.add_parser("tune", help="measure this GPU and write plans/<device>.yaml; --help for options", add_help=False)
    tune.add_argument("tune_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd in ("bench", "tune"):
        setattr(args, f"{args.cmd}_args", passthrough)
        if args.config:  # their planning contexts read the config from the environment
            os.environ["ATTNPLAN_CONFIG"] = args.config
    if args.cmd == "tune":
        if _cpu_mode() and not {"-h", "--help"} & set(args.tune_args):
            print("attnplan: error: tune needs a CUDA GPU", file=sys.stderr)
            return 2
        from attnplan.tune import main as tune_main

        return tune_main(args.tune_args)
    if args.cmd == "bench":
        from attnplan.bench import main as bench_main

        if _cpu_mode() and not {"-h", "--help"} & set(args.bench_args):
            print("attnplan: error: bench needs a CUDA GPU", file=sys.stderr)
            return 2
        bench_main(args.bench_args)
        return 0
    if _cpu_mode():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    try:
        return _run(args) if args.cmd == "run" else _plans(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"attnplan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
