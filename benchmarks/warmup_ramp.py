"""Diagnostic: is a step timed right after the GPU sat idle slower than the same step timed warm?

Measured on an H200: a tune that warmed up with 5 replays timed 64/8/128 b256 4K (cuda_ptx, contiguous) at
1,085 us with one split and 987 us with two, and its planner-quality check minutes later timed the same
two-split plan at 1,098 us; ``paged_order.py``, timing inside a longer run, measured 952 / 988. The tune timed
each split count right after building the point's inputs and planning (host work; the GPU idles meanwhile). Since
then ``attnplan.timing.time_cuda`` warms up for at least 25 ms and the tune's first timing on fresh inputs
(``attnplan.tune._graph_time``) for 100 ms; with those, three tune timings in a row on fresh inputs agreed within
0.4%.

This prints, after the GPU has idled ``--idle`` seconds, each replay's own time (CUDA events, L2 flushed in front)
for the first ``--iters`` replays of a step with no warm-up at all, so a ramp shows as a falling series; and the
tune's own measurement (``_graph_time``, as the code now is) three times in a row on fresh inputs, so the first
of the three should match the other two. The SM clock (NVML, when available) is sampled before and after each
series.

    python benchmarks/warmup_ramp.py --out ramp.json
"""

import argparse
import json
import statistics
import time

import torch

import attnplan
from attnplan.timing import capture_graphs, time_cuda
from attnplan.tune import _graph_time, _inputs, _plan


def sm_clock_mhz():
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - NVML missing: no clock readings
        return None


def series(fn, iters, idle_s):
    """Per-replay device times (us) of ``fn`` for ``iters`` replays, no warm-up, after ``idle_s`` seconds of
    idle GPU; and the SM clock (MHz) before and after."""
    torch.cuda.synchronize()
    time.sleep(idle_s)
    c0 = sm_clock_mhz()
    ts = time_cuda(lambda i: fn(), warmup=0, iters=iters, flush=True, warmup_ms=0.0)["samples_us"]
    return ts, c0, sm_clock_mhz()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="64/8/128:256:4096:contiguous:1,64/8/128:256:4096:contiguous:2,"
                                        "64/8/128:256:1024:contiguous:1,32/8/128:1:4096:contiguous:0")
    ap.add_argument("--backend", default="cuda_ptx")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--idle", type=float, default=2.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for spec in a.points.split(","):
        heads, batch, kv, layout, splits = spec.split(":")
        hq, hkv, d = map(int, heads.split("/"))
        x = _inputs(layout, int(batch), int(kv), (hq, hkv, d), gen)
        w = attnplan.DecodeWrapper(backend=a.backend)
        plan = _plan(w, x, int(splits) or None)
        # the tune's measurement, three times in a row, right after the inputs were built
        tune_us = [_graph_time(w, x, 15) for _ in range(3)]
        args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        (g,) = capture_graphs(lambda j: w.run(*args), 1)
        ts, c0, c1 = series(g.replay, a.iters, a.idle)
        pick = [0, 1, 2, 3, 5, 10, 20, 50, 100, len(ts) - 1]
        row = {"point": spec, "splits": plan.num_splits, "tune_graph_time_us": tune_us, "series_us": ts,
               "sm_clock_mhz_before_after": [c0, c1], "median_last_half_us": statistics.median(ts[len(ts) // 2:])}
        rows.append(row)
        cum = 0.0
        marks = []
        for i, t in enumerate(ts):
            cum += t
            if i in pick:
                marks.append(f"#{i}@{cum / 1e3:.1f}ms {t:.1f}")
        print(f"{spec:32s} splits {plan.num_splits:2d} tune x3 {'/'.join(f'{t:.1f}' for t in tune_us)} us | "
              f"after {a.idle:g} s idle: {' '.join(marks)} | median of last half {row['median_last_half_us']:.1f} | "
              f"SM clock {c0} -> {c1} MHz", flush=True)
        del x, w, g
        torch.cuda.empty_cache()
    if a.out:
        json.dump({"rows": rows, "backend": a.backend, "idle_s": a.idle}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
