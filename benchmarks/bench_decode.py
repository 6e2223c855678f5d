"""Decode-attention benchmark: attnplan's backends against torch SDPA (flash, cuDNN) and FlexAttention,
in one process, on a GPU.

For each point (heads, layout, batch, KV length; uniform or long-tailed lengths) it times one decode step
of every contender with CUDA events after warm-up (at least 10 calls and 25 ms), medians of ``--iters``:

- attnplan: the whole ``DecodeWrapper.run`` (partial and merge kernels, every kernel of the step) under
  CUDA-graph replay, planned by the planner (``num_splits`` 0);
- peers (:mod:`peers`): SDPA with the flash and cuDNN backends, and ``torch.compile``d FlexAttention, on a
  dense bf16 copy padded to the longest sequence, also under CUDA-graph replay.

Graph-replay times are device time: an L2 flush (a 256 MB read) is queued in front of each replay, so L2
is cold and the host's launch latency is hidden (``triton.testing.do_bench``'s method). Inputs are random
bf16 (never zeros), rotated over up to 8 copies (at least 512 MB cycle where 8 copies reach it; L2 is 60 MB on an
H200, so a point under ~64 MB has its copies in L2, which the flush in front of each replay empties). In the
same run: the streaming-read ceiling (GB/s, :func:`attnplan.timing.read_bandwidth_gbs`) and, per point,
the read bound (``read_us``: one streaming-read kernel over the point's bytes, timed the same way) and the
method's floor (``floor_us``: a graph of one 1-element kernel). Bytes are those a step must move: K + V of
the valid tokens, q read, out written.

Usage (GPU machine, repository root)::

    python benchmarks/bench_decode.py                       # 32/8/128 grid -> benchmarks/results/decode_grid.*
    python benchmarks/bench_decode.py --heads '64,8,128;28,4,128' --merge   # more heads into the same files

It prints the table last and writes ``<out>.csv`` (one row per point, :data:`COLUMN_DOC`), ``<out>.json``
(command, environment, commit, ceiling, host costs) and ``<out>.png`` (fraction of the ceiling against KV
length, one heads configuration). ``--merge`` keeps the rows of an existing ``<out>.csv`` that this run does
not measure (a whole grid in several runs); otherwise the files are replaced. ``--out ''`` writes nothing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import attnplan
import attnplan.testing
from attnplan.cache import atomic_write
from attnplan.timing import capture_graphs, read_bandwidth_gbs, time_cuda

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import PEERS, time_peer, time_step  # noqa: E402

L2_ROTATE_BYTES = 512 << 20  # rotate input copies until this many bytes are cycled
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode_grid")
OURS = ("triton", "cuda_ptx", "numba")
KEY = ("heads", "layout", "kind", "batch", "kv", "total_kv", "kv_dtype", "q_len")
#: a row written before ``kv_dtype`` and ``q_len`` were columns: a bf16 cache and one query per sequence
KEY_DEFAULTS = {"kv_dtype": "bfloat16", "q_len": "1"}
#: peers that attend over a dense copy padded to the longest sequence without a mask: at a varlen point they compute
#: another attention (padding included) over more bytes, so they are timed but neither checked against nor counted
#: as the best peer there
PADDED_PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")

#: the CSV's columns; ``<name>`` is each attnplan backend and each peer of the run
COLUMN_DOC = {
    "heads": "num_q_heads/num_kv_heads/head_dim",
    "layout": "contig (contiguous cache) or paged<page_size> (paged cache, random page order)",
    "kind": "uniform (every sequence at kv tokens) or varlen (long-tailed lengths, the longest at kv)",
    "batch": "sequences",
    "kv": "longest KV length, tokens",
    "total_kv": "KV tokens over the batch",
    "kv_dtype": "KV cache dtype (bfloat16, or float8_e4m3fn with per-head scales; the peers read a bf16 copy)",
    "q_len": "queries per sequence",
    "bytes": "bytes a step must move: K + V of the valid tokens, q, out",
    "ceiling_gbs": "streaming-read ceiling measured in the same process, GB/s",
    "<name>_us": "CUDA-graph replay device time of one step, us (median; L2 flushed in front)",
    "<name>_splits": "attnplan backends: the work units (splits) the device-side schedule gives the longest "
                     "sequence at the point's lengths (1 = one program per sequence and KV head)",
    "read_us": "one streaming-read kernel over the point's bytes, same method, us",
    "floor_us": "a graph of one 1-element kernel, same method, us",
    "speedup": "best peer time / best attnplan time, from the unrounded times (> 1: attnplan faster); at varlen points "
               "only the peers that read each sequence's own length (FlashInfer), not the padded SDPA / flex copies",
}


# --------------------------------------------------------------------------------------------- inputs

def build_sets(batch, hq, hkv, d, lens, page, n_sets, gen, q_len=1, kv_dtype="bfloat16"):
    """``n_sets`` independent random input sets (:class:`attnplan.backends.DecodeInputs`: bf16 q, bf16 or fp8
    e4m3 KV with scale 1, on the GPU, drawn from the CUDA generator ``gen``) for one point, so timed runs
    rotate through more bytes than L2 holds. ``page`` None = contiguous cache."""
    sets = []
    for _ in range(n_sets):
        x = attnplan.testing.make_inputs(batch, hq, hkv, d, lens, page_size=page, dtype=torch.bfloat16, device="cuda",
                                         generator=gen, extra_pages=0, q_len=q_len)
        if kv_dtype == "float8_e4m3fn":  # per-tensor scale 1: N(0, 1) values fit e4m3's range
            x = dataclasses.replace(x, k_cache=x.k_cache.to(torch.float8_e4m3fn), v_cache=x.v_cache.to(torch.float8_e4m3fn))
        sets.append(x)
    return sets


def _args(x):
    return (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)


def plan_record(plan, seq_lens) -> dict:
    """What the results keep of an attnplan plan: ``num_splits`` (most units per sequence the schedule allows),
    ``policy`` (the schedule's), ``merge``, ``num_programs`` (the grid), ``kernel`` (its options),
    ``predicted_us``, and ``units``: the units the schedule gives the longest sequence at ``seq_lens`` (host ints;
    :func:`attnplan.schedule.schedule_units`; the last launch's with query or head blocks), the split count that ran,
    and ``launches`` (more than 1 with query or head blocks: the KV read once per launch)."""
    from attnplan.schedule import schedule_units

    p = plan.launches[-1].plan.problem
    u = schedule_units(seq_lens, plan.schedule, p.q_len, p.window_left)
    return {"num_splits": plan.num_splits, "policy": plan.schedule.policy, "merge": plan.merge,
            "num_programs": plan.num_programs, "kernel": dict(plan.kernel), "predicted_us": plan.predicted_us,
            "units": int(u.units.max()) if u.units.numel() else 0, "launches": len(plan.launches)}


def time_backend(name, sets, iters, num_splits=None):
    """Plan and time one attnplan backend on ``sets`` (:func:`peers.time_step`'s times), plus the first run's time
    (``first_run_s``, compilation included) and the plan's main fields (:func:`plan_record`). ``num_splits`` goes to
    :meth:`attnplan.DecodeWrapper.plan`: ``None`` = the config's ``split.num_splits``, 0 = the planner's choice,
    1 = no split, >1 = forced.

    Returns:
        ``(result, out)``: the times and plan, and the output of set 0.
    Raises:
        ValueError: from ``plan`` (e.g. a split count outside [0, 1024]); NoBackendError if the backend refuses.
    """
    res = {}
    wrappers = []
    fp8 = sets[0].k_cache.dtype == torch.float8_e4m3fn
    for x in sets:
        w = attnplan.DecodeWrapper(backend=name)
        w.plan(*_args(x), num_splits=num_splits, **({"k_scale": 1.0, "v_scale": 1.0} if fp8 else {}))
        wrappers.append(w)
    t0 = time.perf_counter()
    wrappers[0].run(*_args(sets[0]))
    torch.cuda.synchronize()
    res["first_run_s"] = time.perf_counter() - t0
    res["plan"] = plan_record(wrappers[0].plan_, sets[0].seq_lens.tolist())
    out0 = wrappers[0].run(*_args(sets[0])).clone()
    time_step(lambda j: wrappers[j].run(*_args(sets[j])), len(sets), iters, res)
    return res, out0


# ------------------------------------------------------------------------------------------ the floor

_BOUND: dict = {}
READ_TILE = 4096  # elements per program of the reference read (read_bound)


def read_bound(nbytes: int, iters: int) -> dict:
    """What a perfect step of ``nbytes`` could take under this benchmark's method: the graph-replay device time
    (L2 flushed in front) of one streaming-read Triton kernel over ``nbytes`` bytes (``read_us``: 4,096-element
    tiles of 8 KiB, one per program, 8 warps) and of a graph holding one 1-element kernel (``floor_us``: what any
    one-kernel step pays for its launch, ramp and event pair, whatever it reads).

    Measured on an H200, this tile was within 0.6% of the fastest of 101 read kernels (Triton tiles, CUDA C
    16-byte loads, Hopper bulk copies; ``benchmarks/read_floor.py``) from 16.8 MB to 537 MB. ``read_us`` is a
    reference, not a strict bound; ``best peer / read_us`` is what a step as fast as that read would gain.

    Returns ``{"read_us", "floor_us"}`` (microseconds), memoized per byte count.

    Raises:
        ImportError: triton is missing.
    """
    from attnplan._read_kernel import streaming_read

    if "floor_us" not in _BOUND:
        one = torch.zeros(1, device="cuda")
        (g,) = capture_graphs(lambda j: one.add_(1.0), 1)
        _BOUND["floor_us"] = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
    if nbytes not in _BOUND:
        n = -(-nbytes // 2)
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)  # freed on return: no memory held between points
        partial = torch.empty(-(-n // READ_TILE), device="cuda", dtype=torch.float32)
        (g,) = capture_graphs(lambda j: streaming_read(x, partial, READ_TILE), 1)
        _BOUND[nbytes] = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
    return {"read_us": _BOUND[nbytes], "floor_us": _BOUND["floor_us"]}


def host_overheads(backend: str = "triton") -> dict:
    """Host cost of planning on this device (us, medians of 5 batches): a plan-cache hit, a miss (the planner
    itself), and ``DecodeWrapper.plan`` on a hit (validation included, which reads ``seq_lens``), at 32/8/128
    batch 1, KV 4,096."""
    import attnplan.api as api
    from attnplan.device import device_info

    dev = torch.device("cuda")
    di = device_info(dev)
    be = attnplan.backends.get_backend(backend)
    hot = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    cold = api.Context.from_config(attnplan.load_config(plan_cache={"enabled": False}))
    prob = attnplan.DecodeProblem(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=4096,
                                  total_kv_len=4096, q_dtype="bfloat16", kv_dtype="bfloat16")
    api.plan_problem(prob, be, dev, hot, dev_info=di)

    def per_call(fn, n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    x = attnplan.testing.make_inputs(1, 32, 8, 128, [4096], dtype=torch.bfloat16, device="cuda")
    w = attnplan.DecodeWrapper(hot, backend=backend)
    w.plan(*_args(x))
    return {"backend": backend,
            "plan_cache_hit_us": statistics.median(per_call(lambda: api.plan_problem(prob, be, dev, hot, dev_info=di), 500) for _ in range(5)),
            "plan_cache_miss_us": statistics.median(per_call(lambda: api.plan_problem(prob, be, dev, cold, dev_info=di), 20) for _ in range(5)),
            "wrapper_plan_hit_us": statistics.median(per_call(lambda: w.plan(*_args(x)), 50) for _ in range(5))}


# ----------------------------------------------------------------------------------- results: rows

def _time(r: dict) -> float | None:
    """A contender's time at a point: its graph-replay time (``None`` if it did not run or was not captured)."""
    return r.get("graph_us")


def to_row(point: dict, ours, ceiling_gbs: float) -> dict:
    """One CSV row (:data:`COLUMN_DOC`) of a measured point (the dict :func:`main` builds: ``heads``, ``layout``,
    ``kind``, ``batch``, ``kv_len``, ``total_kv``, ``bytes``, ``results`` per contender, ``bound``). Times are
    rounded to 0.1 us (``speedup`` is computed before rounding, to 4 decimals); contenders that did not run
    leave their cells empty."""
    row = {"heads": "/".join(map(str, point["heads"])), "layout": point["layout"], "kind": point.get("kind", "uniform"),
           "batch": point["batch"], "kv": point["kv_len"], "total_kv": point["total_kv"],
           "kv_dtype": point.get("kv_dtype", "bfloat16"), "q_len": point.get("q_len", 1), "bytes": point["bytes"],
           "ceiling_gbs": round(ceiling_gbs, 1)}
    for name, r in point["results"].items():
        t = _time(r)
        row[f"{name}_us"] = round(t, 1) if t else ""
        if name in ours:
            row[f"{name}_splits"] = r.get("plan", {}).get("units", "")
    bound = point.get("bound", {})
    row["read_us"] = round(bound["read_us"], 1) if "read_us" in bound else ""
    row["floor_us"] = round(bound["floor_us"], 2) if "floor_us" in bound else ""
    times = {n: _time(r) for n, r in point["results"].items() if _time(r)}  # unrounded
    t_ours = min((t for n, t in times.items() if n in ours), default=math.inf)
    padded = PADDED_PEERS if row["kind"] == "varlen" else ()
    t_peer = min((t for n, t in times.items() if n not in ours and n not in padded), default=math.inf)
    row["speedup"] = round(t_peer / t_ours, 4) if math.isfinite(t_ours) and math.isfinite(t_peer) else ""
    return row


def contenders(row: dict) -> list[str]:
    """The contender names with a time column in ``row`` (``<name>_us``), in column order."""
    return [k[:-3] for k in row if k.endswith("_us") and k not in ("read_us", "floor_us")]


def peer_names(row: dict, ours=OURS) -> list[str]:
    return [n for n in contenders(row) if n not in ours]


def best(row: dict, names) -> tuple[str | None, float]:
    """The fastest of ``names`` in ``row`` (CSV values, numbers or ``""``): ``(name, us)``; ``(None, inf)`` if none ran."""
    ts = [(float(row[f"{n}_us"]), n) for n in names if row.get(f"{n}_us") not in (None, "")]
    return (min(ts)[1], min(ts)[0]) if ts else (None, math.inf)


def _key(row: dict) -> tuple:
    return tuple(str(row.get(k) if row.get(k) not in (None, "") else KEY_DEFAULTS.get(k, "")) for k in KEY)


def read_csv(path: str) -> list[dict]:
    """Rows of a results CSV, numbers as floats/ints (``""`` kept for empty cells)."""
    def num(v):
        if v == "":
            return v
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v

    with open(path, newline="") as f:
        return [{k: num(v) for k, v in r.items()} for r in csv.DictReader(f)]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` rows replace ``old`` ones of the same point (:data:`KEY`); the other old rows stay, in order."""
    fresh = {_key(r): r for r in new}
    kept = [r for r in old if _key(r) not in fresh]
    return kept + new


def csv_text(rows: list[dict]) -> str:
    """The rows as CSV: the columns of :data:`KEY`, ``bytes`` and ``ceiling_gbs`` first, then every other column
    in order of first appearance; missing cells empty."""
    cols = list(KEY) + ["bytes", "ceiling_gbs"]
    for r in rows:
        cols += [k for k in r if k not in cols]
    head = [c for c in cols if c not in ("read_us", "floor_us", "speedup")] + ["read_us", "floor_us", "speedup"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=head, restval="", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _atomic_write(path: str, text: str) -> None:
    """:func:`attnplan.cache.atomic_write`, readable as any results file."""
    atomic_write(path, text, readable=True)


def _ver(mod):
    try:
        return getattr(__import__(mod, fromlist=["__version__"]), "__version__", "?")
    except Exception:  # noqa: BLE001
        return None


def environment() -> dict:
    """GPU, driver and library versions, and the repository's commit: ``$ATTNPLAN_COMMIT`` when set (a machine that
    runs a copy of the working tree, whose ``.git`` may be another commit's, is told the commit by the caller), else
    ``git rev-parse`` here (``+dirty`` with uncommitted changes)."""
    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - not a git checkout, no nvidia-smi: recorded as unknown
            return None

    here = os.path.dirname(os.path.abspath(__file__))
    commit = os.environ.get("ATTNPLAN_COMMIT") or None
    if commit is None:
        commit = run("git", "-C", here, "rev-parse", "--short", "HEAD")
        if commit and run("git", "-C", here, "status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": _ver("triton"),
            "numba_cuda": _ver("numba_cuda"), "cuda_bindings": _ver("cuda.bindings"), "python": platform.python_version(),
            "attnplan": attnplan.__version__, "commit": commit}


def write_results(prefix: str, rows: list[dict], run: dict, merge: bool = False) -> list[dict]:
    """Write ``<prefix>.csv`` (the rows; with ``merge``, merged over an existing file's by :func:`merge_rows`)
    and ``<prefix>.json`` (``runs``: this run's ``run`` record, after the existing file's when merging; and the
    column descriptions). Returns the rows written."""
    runs = [run]
    if merge and os.path.exists(prefix + ".csv"):
        rows = merge_rows(read_csv(prefix + ".csv"), rows)
        if os.path.exists(prefix + ".json"):
            with open(prefix + ".json") as f:
                runs = json.load(f).get("runs", []) + [run]
    _atomic_write(prefix + ".csv", csv_text(rows))
    _atomic_write(prefix + ".json", json.dumps({"columns": COLUMN_DOC, "runs": runs}, indent=1) + "\n")
    return rows


# ------------------------------------------------------------------------------------------- output

def gmean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summary(rows: list[dict], ours=OURS) -> None:
    """Print the table: per point each contender's graph-replay time (us) and its fraction of the ceiling, the
    best attnplan backend's speedup over the best peer, and the read bound with the speedup a step as fast as it
    would have; then the geometric means per heads configuration and over all points."""
    if not rows:
        print("no points")
        return
    names = []
    for r in rows:
        names += [n for n in contenders(r) if n not in names]
    print("\nus per step (fraction of the read ceiling), CUDA-graph replay device time; speedup = best peer / best attnplan")
    print(f"{'heads':9s} {'layout':8s} {'kind':7s} {'batch':>5s} {'kv':>7s} " + " ".join(f"{n:>15s}" for n in names)
          + "  speedup  read bound")
    for r in rows:
        cells = []
        for n in names:
            t = r.get(f"{n}_us")
            cells.append(f"{t:8.1f} ({r['bytes'] / t / 1e3 / r['ceiling_gbs']:4.0%})" if t not in (None, "") else f"{'-':>15s}")
        sp = r.get("speedup")
        read = r.get("read_us")
        _, peer = best(r, peer_names(r, ours))
        print(f"{r['heads']:9s} {r['layout']:8s} {r['kind']:7s} {r['batch']:5d} {r['kv']:7d} " + " ".join(f"{c:>15s}" for c in cells)
              + (f"  {sp:6.2f}x" if sp != "" else "       -")
              + (f"  {read:7.1f} ({peer / read:4.2f}x)" if read not in (None, "") and math.isfinite(peer) else ""))
    by_heads: dict = {}  # (kind, heads): uniform and varlen points are summarized apart
    for r in rows:
        if r.get("speedup") not in (None, ""):
            by_heads.setdefault((r.get("kind") or "uniform", r["heads"]), []).append(r["speedup"])
    for (kind, h), sps in by_heads.items():
        print(f"{h} {kind}: best attnplan vs best peer: geometric mean {gmean(sps):.3f}x, min {min(sps):.2f}x over "
              f"{len(sps)} points")
    for kind in sorted({k for k, _ in by_heads}, reverse=True):
        every = [s for (k, _), v in by_heads.items() if k == kind for s in v]
        print(f"all {kind}: geometric mean {gmean(every):.3f}x, min {min(every):.2f}x over {len(every)} points; "
              f"{sum(s >= 0.95 for s in every)} at 0.95x or better")
    bounds = [best(r, peer_names(r, ours))[1] / r["read_us"] for r in rows if r.get("read_us") not in (None, "")
              and math.isfinite(best(r, peer_names(r, ours))[1])]
    if bounds:
        floors = [r["floor_us"] for r in rows if r.get("floor_us") not in (None, "")]
        print(f"a streaming read of each point's bytes vs best peer: geometric mean {gmean(bounds):.3f}x (what a step as "
              f"fast as one read kernel would gain; a one-kernel graph takes {min(floors):.1f}-{max(floors):.1f} us here)")


def plot(rows: list[dict], path: str, heads: str | None = None, title: str = "") -> None:
    """PNG of the fraction of the read ceiling against KV length, one line per contender, one panel per (layout,
    batch), uniform points of one heads configuration (``heads``, default: the first row's). Small by design
    (dpi 90): one headline figure.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r["kind"] == "uniform" and r["heads"] == (heads or rows[0]["heads"])]
    panels = sorted({(r["layout"], r["batch"]) for r in pts}, key=lambda p: (p[0], p[1]))
    names = []
    for r in pts:
        names += [n for n in contenders(r) if n not in names]
    cols = min(5, len(panels)) or 1
    nrows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.2 * nrows), squeeze=False, sharey=True)
    for ax, (layout, batch) in zip(axes.flat, panels):
        sel = sorted((r for r in pts if r["layout"] == layout and r["batch"] == batch), key=lambda r: r["kv"])
        for n in names:
            xy = [(r["kv"], r["bytes"] / r[f"{n}_us"] / 1e3 / r["ceiling_gbs"]) for r in sel if r.get(f"{n}_us") not in (None, "")]
            if xy:
                ax.plot(*zip(*xy), marker="o", ms=2.5, lw=1, label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{layout}, batch {batch}", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.axhline(1.0, color="gray", lw=0.5)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("fraction of read ceiling", fontsize=7)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title or f"decode attention {heads or rows[0]['heads']}, CUDA-graph replay", fontsize=8)
    fig.supxlabel("KV length (tokens)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    """Run the grid, print the table last, write the results files. Returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="triton,cuda_ptx")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--kv", default="1024,4096,16384,32768,65536,131072")
    ap.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim; several separated by ';'")
    ap.add_argument("--layouts", default="contig,paged16")
    ap.add_argument("--peers", default="cudnn,flash,flashinfer,flashinfer_tc",
                    help="flash, cudnn (SDPA backends), flex (FlexAttention), flashinfer / flashinfer_tc (paged layouts "
                         "only; FlashInfer's paged decode without / with tensor cores, when it imports)")
    ap.add_argument("--flex-batches", default="1,16",
                    help="batches at which FlexAttention runs (it compiles once per shape: tens of seconds each)")
    ap.add_argument("--q-len", type=int, default=1, help="queries per sequence (speculative verification: > 1)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                    help="KV cache dtype (q and out stay bf16); peers always read a bf16 copy")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-gb", type=float, default=16.0, help="skip points whose K+V exceed this many GB")
    ap.add_argument("--varlen", default="16:131072,64:32768", help="batch:max_kv long-tailed points ('' for none)")
    ap.add_argument("--bound", action=argparse.BooleanOptionalAction, default=True,
                    help="time a streaming read of each point's bytes and a one-kernel graph (the method's floor)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="results prefix: <out>.csv, <out>.json, <out>.png ('' = none)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of an existing <out>.csv this run does not measure")
    ap.add_argument("--raw", default=None, help="also write every measurement (plans, eager times) as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    heads_list = [tuple(int(v) for v in h.split(",")) for h in args.heads.split(";") if h]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    ceiling = read_bandwidth_gbs()
    bw = ceiling["ceiling_gbs"]
    print(f"read ceiling {bw:.0f} GB/s ({ceiling})", flush=True)
    try:
        host = host_overheads()
    except Exception as e:  # noqa: BLE001 - a nicety; never stops the benchmark
        host = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(f"host overheads: {host}", flush=True)
    backends = []
    for name in args.backends.split(","):
        ok, why = attnplan.backends.get_backend(name).available(torch.device("cuda"))
        if ok:
            backends.append(name)
        else:
            print(f"skipping backend {name}: {why}")
    grid = []
    for heads in heads_list:
        for layout in args.layouts.split(","):
            page = int(layout[5:]) if layout.startswith("paged") else None
            for batch in (int(b) for b in args.batches.split(",")):
                for kv in (int(k) for k in args.kv.split(",")):
                    grid.append((heads, layout, page, batch, [kv] * batch, "uniform"))
            for spec in filter(None, args.varlen.split(",")):
                batch, kv = (int(v) for v in spec.split(":"))
                grid.append((heads, layout, page, batch, attnplan.testing.long_tailed_lengths(batch, kv), "varlen"))
    kv_item = 1 if args.kv_dtype == "float8_e4m3fn" else 2
    points, rows = [], []
    for i, ((hq, hkv, d), layout, page, batch, lens, kind) in enumerate(grid):
        kv = max(lens)
        kv_bytes = 2 * sum(lens) * hkv * d * 2  # the peers' bf16 copy decides what fits
        if kv_bytes > args.max_gb * 1e9:
            continue
        n_sets = max(1, min(8, math.ceil(L2_ROTATE_BYTES / (kv_bytes * kv_item / 2))))
        sets = build_sets(batch, hq, hkv, d, lens, page, n_sets, gen, q_len=args.q_len, kv_dtype=args.kv_dtype)
        prob = attnplan.DecodeProblem(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_kv_len=kv,
                                      total_kv_len=sum(lens), q_len=args.q_len, q_dtype="bfloat16", kv_dtype=args.kv_dtype)
        pt = {"heads": [hq, hkv, d], "layout": layout, "kind": kind, "batch": batch, "kv_len": kv, "total_kv": sum(lens),
              "q_len": args.q_len, "kv_dtype": args.kv_dtype, "bytes": prob.bytes_moved(), "input_sets": n_sets,
              "results": {}}
        if args.bound:
            try:
                pt["bound"] = read_bound(pt["bytes"], args.iters)
            except Exception as e:  # noqa: BLE001 - the bound is context, not a contender
                pt["bound"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        ref_out = None
        for peer in filter(None, args.peers.split(",")):
            if peer == "flex" and (str(batch) not in args.flex_batches.split(",") or kind != "uniform"):
                continue
            if peer.startswith("flashinfer") and (page is None or args.kv_dtype != "bfloat16" or args.q_len != 1):
                continue  # FlashInfer reads the paged bf16 cache itself
            r, o = time_peer(peer, sets, args.iters)
            pt["results"][PEERS[peer]] = r
            if o is not None and ref_out is None and not (kind == "varlen" and PEERS[peer] in PADDED_PEERS):
                ref_out = o
        for name in backends:
            try:
                r, o = time_backend(name, sets, args.iters, num_splits=0)
                if ref_out is not None and args.kv_dtype == "bfloat16":
                    r["max_abs_diff_vs_peer"] = float((o.float() - ref_out.float()).abs().max())
                    r["max_rel_diff_vs_peer"] = rel = attnplan.testing.max_seq_rel_error(o, ref_out)
                    if not rel < attnplan.testing.BENCH_CHECK_REL:  # a wrong output: an error of the point, no time
                        raise AssertionError(f"output differs from the peer's by {rel:.3g} of a sequence's largest "
                                             f"element (limit {attnplan.testing.BENCH_CHECK_REL})")
            except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            pt["results"][name] = r
        points.append(pt)
        rows.append(to_row(pt, backends, bw))
        cells = " ".join(f"{n}={r['graph_us']:.1f}us" if "graph_us" in r else f"{n}=err" for n, r in pt["results"].items())
        print(f"[{i + 1}/{len(grid)}] {hq}/{hkv}/{d} {layout:8s} {kind:7s} b{batch:<3d} kv{kv:<7d} {cells}", flush=True)
        if args.out:  # this run's rows so far: a run cut short by a time limit keeps what it measured
            _atomic_write(args.out + ".partial.csv", csv_text(rows))
        del sets
        torch.cuda.empty_cache()
    run = {"command": " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:]), "env": environment(),
           "ceiling": ceiling, "host": host, "iters": args.iters, "q_len": args.q_len, "kv_dtype": args.kv_dtype,
           "points": len(rows), "method": "CUDA events after >= 10 calls and 25 ms of warm-up, medians; graph replay "
           "with an L2 flush queued in front (device time); inputs rotated over up to 8 copies (>= 512 MB where 8 "
           "reach it); peers on a dense bf16 copy padded to the longest sequence (at varlen points unmasked, so not "
           "counted as the best peer there); attnplan's output checked per sequence against the first peer that "
           "computes the same attention; read bound and floor measured in the same process"}
    if args.raw:
        _atomic_write(args.raw, json.dumps({**run, "points": points}, indent=1))
    if args.out:
        all_rows = write_results(args.out, rows, run, merge=args.merge)
        if os.path.exists(args.out + ".partial.csv"):
            os.remove(args.out + ".partial.csv")
        try:
            plot(all_rows, args.out + ".png", heads=all_rows[0]["heads"] if all_rows else None,
                 title=f"decode attention {all_rows[0]['heads']}, {run['env']['gpu']}, CUDA-graph replay")
        except ImportError as e:
            print(f"no plot ({e}); pip install -e '.[plot]'")
        print(f"wrote {args.out}.csv ({len(all_rows)} points), {args.out}.json, {args.out}.png")
    summary(rows, set(backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
