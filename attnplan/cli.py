"""The ``attnplan`` command line.

``attnplan run``: run a decode workload through the configured backend, print the plan, the
backend and the error against the float64 reference (and, on a GPU, time and bandwidth).
``attnplan run --explain``: print the plan and why earlier backends were skipped, compute nothing.
``attnplan plans show|clear``: inspect or empty the on-disk plan cache.
``attnplan tune``: measure this GPU and write its planner table (:mod:`attnplan.tune`).
The GPU benchmark against torch's attention is a script, ``benchmarks/bench_decode.py``.

``--config FILE`` may come before or after the subcommand (after ``tune``, tune's own parser takes it, with the
same meaning). Every bad argument is an argparse usage
error (exit status 2) or an ``attnplan: error: ...`` message (exit status 2; a config file's errors take one line
each), never a traceback. A command that ran but failed exits with status 1: ``run`` whose output fails the check
against the reference, ``plans show`` on a cache folder that cannot be listed, ``plans clear`` that could not remove
every file.

On a machine without a CUDA GPU the command sets ``TRITON_INTERPRET=1`` and
``NUMBA_ENABLE_CUDASIM=1`` (unless already set) so the kernels run in Triton's interpreter and
numba's simulator, at a small size; it says so in one line when the run falls to the slow float64
reference backend instead, and warns (after printing the plan) before computing a problem large
enough to take minutes there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from attnplan.config import BACKEND_NAMES, MAX_SPLITS, SplitPolicy

#: (num_q_heads, num_kv_heads, head_dim) from the models' published configurations.
MODEL_PRESETS = {
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (64, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "mistral-7b": (32, 8, 128),
    "phi-3-mini": (32, 32, 96),
    "gemma-2-9b": (16, 8, 256),
}


#: multiply-adds (KV tokens x query heads x head_dim x queries, QK^T and PV) above which a CPU run warns first:
#: about a minute in Triton's interpreter on one core (the default CPU workload is ~40x less); the float64
#: reference (torch on the CPU) is ~100x faster and warns at 64x this
CPU_WARN_MACS = 1 << 27
#: programs (one at least per sequence and KV head) past which the same warning is given: ~10 ms each on the CPU
CPU_WARN_PROGRAMS = 4096


def _cpu_mode() -> bool:
    import torch

    return not torch.cuda.is_available()


def _int_in(lo: int, hi: int | None = None, what: str = ""):
    """An argparse ``type``: an int in ``[lo, hi]``; anything else is argparse's usage error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: {what or ('>= ' + str(lo) if hi is None else f'{lo}..{hi}')}")
        return v
    return parse


def _page_size(text: str) -> int:
    v = _int_in(0, 1 << 16)(text)
    if v & (v - 1):
        raise argparse.ArgumentTypeError(f"{v} is not a power of two (0 = contiguous cache)")
    return v


#: longest KV length the command takes: ``seq_lens`` are int32
MAX_KV_LEN = (1 << 31) - 1


def _kv_lens(text: str) -> list[int]:
    """``--kv-lens``: comma-separated KV lengths in tokens, each in ``[0, MAX_KV_LEN]``."""
    parse = _int_in(0, MAX_KV_LEN, f"a KV length in [0, {MAX_KV_LEN}] (seq_lens are int32)")
    parts = [t.strip() for t in text.split(",")]
    if not parts or any(not t for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated lengths, e.g. 4096,512")
    return [parse(t) for t in parts]


def _lengths(args, rng, parser) -> list[int]:
    if args.kv_lens:
        lens = list(args.kv_lens)
        if len(lens) == 1:
            lens = lens * args.batch
        if len(lens) != args.batch:
            parser.error(f"--kv-lens gives {len(lens)} lengths but --batch is {args.batch}")
        return lens
    from attnplan.testing import long_tailed_lengths

    return long_tailed_lengths(args.batch, args.max_kv, rng.randrange(2**31))


def _memory_limit(cpu: bool) -> tuple[int, str]:
    """The most bytes a run may allocate for its tensors, and what that is in words: half the host's memory (the
    inputs are drawn on the host, in float32 before the cast), and on a GPU at most its memory too."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: assume a small machine
        host = 16 << 30
    limit, what = host // 2, f"half of this machine's {host / 2**30:.0f} GiB of memory"
    if not cpu:
        import torch

        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if gpu < limit:
            limit, what = gpu, f"the GPU's {gpu / 2**30:.0f} GiB"
    return limit, what


def _check_size(args, lens, heads, itemsize: int, page: int | None, split: SplitPolicy, cpu: bool, parser) -> None:
    """Refuse (argparse's usage error) a workload whose tensors cannot fit :func:`_memory_limit`, before anything
    is allocated: q and the output, the workspace's partial states at their largest (every sequence split into up to
    the forced count, ``--num-splits`` or else the config's ``split.num_splits``, or the config's
    ``split.max_splits`` units of at least 16 tokens), the lengths and the block
    table, and (not with ``--explain``, which plans on views of one row) the K and V caches."""
    hq, hkv, d = heads
    b, ql = args.batch, args.q_len
    cap = max(max(lens), 1)
    pages = -(-cap // page) if page else 0
    q = b * ql * hq * d * itemsize
    forced = split.num_splits if args.num_splits is None else args.num_splits
    splits = 0 if forced == 1 else min(forced or split.max_splits, -(-cap // 16))
    need = {"q and out": 2 * q, "lse and the partial states": b * ql * hq * 4 * (1 + splits * (d + 1))}
    if args.explain:
        need["lengths and one block-table row"] = 4 * (b + pages)
    else:
        rows = (b * pages + 3) * page if page else b * cap  # testing.make_inputs: 3 spare pages
        need["K and V caches"] = 2 * rows * hkv * d * itemsize
        need["block table"] = 12 * b * pages  # int32, and make_inputs' int64 permutation of the pages
    total = sum(need.values())
    limit, what = _memory_limit(cpu)
    if total > limit:
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in need.items() if v >= 2**27)
        parser.error(f"this workload needs about {total / 2**30:.1f} GiB ({parts}) but {what} is the limit "
                     f"({limit / 2**30:.1f} GiB): lower --batch, --max-kv / --kv-lens or --q-len")


def _explain_inputs(args, lens, heads, dtype, page: int | None, device: str):
    """The inputs ``--explain`` plans on: q and the caches views of one row (stride 0: no memory), the block table
    one row of page indices seen by every sequence (its values are never read: ``seq_lens_host`` is given), the
    real lengths. Nothing is computed on them."""
    import torch

    from attnplan.backends.base import DecodeInputs
    from attnplan.problem import default_sm_scale

    hq, hkv, d = heads
    b, cap = args.batch, max(max(lens), 1)
    one = torch.zeros(1, 1, 1, d, dtype=dtype, device=device)
    q = one.expand(b, args.q_len, hq, d)
    if page:
        pages = -(-cap // page)
        k = one.expand(pages, page, hkv, d)
        table = torch.arange(pages, dtype=torch.int32, device=device).expand(b, pages)
    else:
        k, table = one.expand(b, cap, hkv, d), None
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    return DecodeInputs(q, k, k, sl, table, default_sm_scale(d))


def _note(msg: str) -> None:
    print(f"attnplan: {msg}", file=sys.stderr, flush=True)


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


def _run(args, parser) -> int:
    import random

    import torch

    import attnplan
    from attnplan import reference
    from attnplan.testing import make_inputs, tolerance

    cpu = _cpu_mode()
    device = "cpu" if cpu else "cuda"
    hq, hkv, d = MODEL_PRESETS[args.model]
    if args.batch is None:
        args.batch = len(args.kv_lens) if args.kv_lens and len(args.kv_lens) > 1 else 3 if cpu else 4
    if args.max_kv is None:
        args.max_kv = 200 if cpu else 32768
    rng = random.Random(args.seed)
    lens = _lengths(args, rng, parser)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    page = args.page_size or None
    ctx = attnplan.Context.from_config(attnplan.load_config(args.config))
    _check_size(args, lens, (hq, hkv, d), dtype.itemsize, page, ctx.config.split, cpu, parser)
    if args.explain:  # planned on views: the caches are never allocated, the lengths are given on the host
        x = _explain_inputs(args, lens, (hq, hkv, d), dtype, page, device)
    else:
        gen = torch.Generator().manual_seed(args.seed)
        x = make_inputs(args.batch, hq, hkv, d, lens, q_len=args.q_len, page_size=page, dtype=dtype,
                        device=device, generator=gen)
    w = attnplan.DecodeWrapper(ctx, backend=args.backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=args.num_splits,
                  seq_lens_host=lens)
    report = {
        "device": attnplan.device_info(device).to_dict(), "mode": "cpu-interpreter" if cpu else "gpu",
        "model": args.model, "heads": [hq, hkv, d], "batch": args.batch, "q_len": args.q_len, "dtype": args.dtype,
        "page_size": page, "kv_lens": lens, "backend": w.backend.name,
        "skipped": {n: r for n, r in w.skipped}, "plan": plan.to_dict(),
    }
    if not args.json:
        print(f"attnplan {attnplan.__version__} | {report['mode']} | {report['device']['name']}")
        print(f"workload: {args.model} heads {hq}/{hkv}/{d}, batch {args.batch}, q_len {args.q_len}, {args.dtype}, "
              f"{'page ' + str(page) if page else 'contiguous'} cache, KV lengths {lens if len(lens) <= 16 else str(lens[:16]) + '...'}")
        print(f"backend: {w.backend.name}")
        print("plan:\n  " + w.explain().replace("\n", "\n  "), flush=True)
    if args.explain:
        if args.json:
            print(json.dumps({**report, "explain": w.explain()}, indent=2))
        return 0
    if w.backend.name == "reference" and args.backend is None and w.skipped:
        why = "; ".join(f"{n}: {r[0]}" for n, r in w.skipped)
        _note(f"note: running on the slow float64 reference backend because the kernel backends were skipped ({why})"
              + ("; on a CPU set TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 before starting Python to run the "
                 "kernels in Triton's interpreter and numba's simulator" if cpu else ""))
    macs = 2 * sum(lens) * hq * d * args.q_len
    # the interpreter / simulator also pays per program (~10 ms each), one at least per (sequence, KV head), however
    # short the sequences: 1,000 empty ones at 8 KV heads took 82 s
    programs = args.batch * hkv
    slow = w.backend.name != "reference" and programs > CPU_WARN_PROGRAMS
    if cpu and (macs > CPU_WARN_MACS * (64 if w.backend.name == "reference" else 1) or slow):
        _note(f"warning: {sum(lens)} KV tokens x {hq} query heads x head_dim {d} x q_len {args.q_len} "
              f"({macs / 1e9:.1f} G multiply-adds{f', {programs} programs at least' if slow else ''}) on the CPU "
              f"({w.backend.name}{' in the interpreter / simulator' if w.backend.name != 'reference' else ''}) may "
              "take minutes; --batch, --max-kv or --kv-lens make it smaller")
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device=device)
    out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, lse=lse)
    if not args.no_check:
        n = min(args.batch, args.check_seqs)
        bt = x.block_table[:n] if x.block_table is not None else None
        kc, vc = (x.k_cache, x.v_cache) if page else (x.k_cache[:n], x.v_cache[:n])
        ref, ref_lse = reference.attention(x.q[:n], kc, vc, x.seq_lens[:n], bt, x.sm_scale)
        err = (out[:n].double().cpu() - ref).abs()
        atol, rtol = tolerance(dtype)
        ok = bool((err <= atol + rtol * ref.abs()).all()) and not torch.isnan(out[:n]).any().item()
        # the LSE too: -inf exactly where the reference has it, the finite values within fp32's tolerance
        got_lse = lse[:n].double().cpu()
        fin = ~torch.isinf(ref_lse)
        la, lr = tolerance(torch.float32)
        lse_ok = bool(torch.equal(torch.isinf(got_lse), ~fin)) and bool(
            ((got_lse[fin] - ref_lse[fin]).abs() <= la + lr * ref_lse[fin].abs()).all())
        report["check"] = {"sequences": n, "max_abs_err": float(err.max()) if err.numel() else 0.0,
                           "mean_abs_err": float(err.mean()) if err.numel() else 0.0,
                           "tolerance": [atol, rtol], "pass": ok and lse_ok}
    if not cpu and args.iters > 0:
        report["time"] = _time_report(w, x, args, lens)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
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
        errors: list[str] = []
        n = cache.clear(errors=errors)
        print(f"removed {n} plan file(s) from {cache.directory}")
        for e in errors:
            print(f"  could not remove {e}")
        return 1 if errors else 0
    entries = cache.entries()
    if len(entries) == 1 and entries[0]["file"] == str(cache.directory) and "error" in entries[0]:
        print(f"attnplan: error: plan cache {cache.directory}: {entries[0]['error']}", file=sys.stderr)
        return 1  # the folder could not be listed (a file, no permission): no plan file to show
    print(f"plan cache: {cache.directory} ({len(entries)} plan file(s))")
    if args.backend is not None:  # unreadable files have no backend: they show only without the filter
        entries = [e for e in entries if "plan" in e and e["plan"].get("backend") == args.backend]
        print(f"{len(entries)} for backend {args.backend!r}")
    if args.limit is not None and len(entries) > args.limit:
        print(f"the first {args.limit} shown ({len(entries) - args.limit} more: --limit)")
        entries = entries[: args.limit]
    for e in entries:
        print(f"\n== {e['file']}")
        if "error" in e:
            print(f"  unreadable: {e['error']}")
            continue
        try:
            print("  " + SplitPlan.from_dict(e["plan"]).explain().replace("\n", "\n  "))
        except Exception as err:  # noqa: BLE001 -- a plan that validates may still not explain: say so, go on
            print(f"  unreadable plan: {type(err).__name__}: {err}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``attnplan`` console script: ``run``, ``plans show|clear``, ``tune``. Returns the exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # ``tune`` owns its options: hand everything after the word to it unparsed
    # (argparse's REMAINDER drops a tail that starts with an option, e.g. ``tune --json out.json``)
    # (the subcommand is the first token after the global options, ``--config FILE`` alone: a later ``tune``, such
    # as ``plans show --backend tune``, is an argument of another command)
    passthrough, i = [], 0
    while i < len(argv) and (argv[i] == "--config" or argv[i].startswith("--config=")):
        i += 2 if argv[i] == "--config" else 1
    if i < len(argv) and argv[i] == "tune":
        argv, passthrough = argv[: i + 1], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="attnplan", description="split-KV decode attention: run, inspect plans",
                                     allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML config file, merged over plans/default.yaml "
                                                        "(default: $ATTNPLAN_CONFIG, if set)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a decode workload and check it against the float64 reference")
    r.add_argument("--model", choices=sorted(MODEL_PRESETS), default="llama-3.1-8b",
                   help="head configuration preset (default: %(default)s)")
    r.add_argument("--batch", type=_int_in(1, 1 << 20), default=None,
                   help="sequences (default: the number of --kv-lens values when there are several, else 3 on CPU, "
                        "4 on GPU)")
    r.add_argument("--kv-lens", type=_kv_lens, default=None,
                   help="comma-separated KV lengths in tokens (one value = all sequences)")
    r.add_argument("--max-kv", type=_int_in(1, MAX_KV_LEN, f"a KV length in [1, {MAX_KV_LEN}] (seq_lens are int32)"),
                   default=None,
                   help="longest KV length of the long-tailed draw (default 200 on CPU, 32768 on GPU)")
    r.add_argument("--q-len", type=_int_in(1, 16), default=1, help="queries per sequence, 1..16 (speculative "
                                                                    "verification > 1)")
    r.add_argument("--page-size", type=_page_size, default=16, help="tokens per page, a power of two; 0 = contiguous "
                                                                     "cache (default: %(default)s)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="q and KV cache dtype (default: %(default)s)")
    r.add_argument("--backend", default=None, help="force a backend (default: the config's order)")
    r.add_argument("--num-splits", type=_int_in(0, MAX_SPLITS), default=None,
                   help="0 heuristic, 1 no split, >1 forced; given, it overrides the config's split.num_splits "
                        "(default: the config's)")
    r.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0,
                   help="seed of the random inputs and lengths (default: %(default)s)")
    r.add_argument("--iters", type=_int_in(0, 1 << 20), default=50,
                   help="timed iterations on a GPU (0: no timing; default: %(default)s)")
    r.add_argument("--check-seqs", type=_int_in(1, 1 << 20), default=4, help="sequences checked against the "
                                                                            "reference (>= 1; --no-check: none; "
                                                                            "default: %(default)s)")
    r.add_argument("--no-check", action="store_true", help="skip the reference check")
    r.add_argument("--explain", action="store_true", help="print the plan and why earlier backends were skipped, "
                                                          "then stop (no kernel runs)")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--config", default=argparse.SUPPRESS, help="YAML config file (also accepted before `run`)")
    p = sub.add_parser("plans", help="inspect or clear the on-disk plan cache")
    p.add_argument("action", choices=["show", "clear"],
                   help="show: every cached plan, explained, with its file; clear: remove the cached plan files")
    p.add_argument("--limit", type=_int_in(0, 1 << 30), default=None, help="show: at most this many plans")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=None, help="show: only the plans of this backend")
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML config file (also accepted before `plans`)")
    tune = sub.add_parser("tune", help="measure this GPU and write its planner table, <cache dir>/plans/<device>.yaml "
                                       "(--out: another file); --help for options", add_help=False)
    tune.add_argument("tune_args", nargs=argparse.REMAINDER)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a missing command is named by these, not by its dest "cmd"
    args = parser.parse_args(argv)
    if args.cmd == "plans" and args.action == "clear" and (args.limit is not None or args.backend is not None):
        p.error("--limit and --backend select what `plans show` lists; `plans clear` removes every plan file")
    if args.cmd == "tune":
        # a --config before `tune` goes to tune's own --config (one given after `tune` comes later and wins)
        args.tune_args = (["--config", args.config] if args.config is not None else []) + passthrough
        if _cpu_mode() and not {"-h", "--help"} & set(args.tune_args):
            print("attnplan: error: tune needs a CUDA GPU", file=sys.stderr)
            return 2
        from attnplan.tune import main as tune_main

        return tune_main(args.tune_args)
    if _cpu_mode():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    try:
        rc = _run(args, r) if args.cmd == "run" else _plans(args)
        if sys.stdout is not None:  # None: started with stdout closed (`>&-`), where print() writes nothing
            sys.stdout.flush()  # a reader gone before the buffered tail is written: raised here, not at exit
        return rc
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, not the interpreter's traceback
        print("attnplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`attnplan plans show | head`): stop quietly, as Python's docs advise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (ValueError, TypeError, RuntimeError, OSError, MemoryError) as e:  # ConfigError, NoBackendError, bad inputs
        print(f"attnplan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
