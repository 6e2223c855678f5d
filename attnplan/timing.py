"""GPU timing shared by the CLI, the tuner and the benchmarks: CUDA events, warm-up by count and time, medians.

:func:`time_cuda` times a callable with CUDA events after warm-up and returns the median in
microseconds; callers rotate their inputs (a list of argument sets) so L2 does not serve
repeats. :func:`read_bandwidth_gbs` measures the streaming-read ceiling in the same process.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

__all__ = ["time_cuda", "read_bandwidth_gbs", "l2_flush", "capture_graphs"]


#: bytes the L2 flush writes before each timed step (the H200's L2 is 60 MB)
FLUSH_BYTES = 256 << 20
_flush_buf: dict = {}


def l2_flush() -> None:
    """Read :data:`FLUSH_BYTES` on the current device (a sum into one value): evicts L2 and keeps the
    GPU busy for tens of microseconds, so the launches queued after it are not waiting on the host
    when they start. A read, not a write: a written buffer leaves ~60 MB of dirty lines in L2 whose
    write-back then lands inside the timed step (measured on an H200: +8-10 us per step with
    ``zero_()``)."""
    dev = torch.cuda.current_device()
    if dev not in _flush_buf:
        _flush_buf[dev] = (torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda"),
                           torch.empty((), dtype=torch.float32, device="cuda"))
    buf, out = _flush_buf[dev]
    torch.sum(buf, dim=0, out=out)


#: least warm-up (milliseconds of calls) before :func:`time_cuda` times anything: ``triton.testing.do_bench``'s
#: default. Counted warm-up calls alone were too short for steps timed right after their inputs were built.
#: Measured on an H200: a tune with 5 warm-up replays timed the single pass 11-14% slower than a warm timing at
#: 9 of 10 cuda_ptx batch-256 points (64/8/128 b256 4K: 1,085 us against 952), and three back-to-back timings on
#: fresh b256 1K inputs gave 278 / 248 / 248 us with the SM clock at 1,965-1,980 MHz throughout. With this
#: warm-up, three timings in a row on fresh inputs agree within 0.4%. The cause below the driver is not known;
#: ``benchmarks/warmup_ramp.py`` looks at it.
WARMUP_MS = 25.0


def time_cuda(fn: Callable[[int], None], *, warmup: int = 10, iters: int = 50, flush: bool = False,
              warmup_ms: float = WARMUP_MS) -> dict:
    """Median time of ``fn(i)``, microseconds. ``i`` counts the calls from 0, warm-up calls included (so
    it runs into the thousands for a short ``fn``): a caller rotating ``n`` input sets takes ``i % n``.

    Warm-up: ``warmup`` calls, then more until at least ``warmup_ms`` milliseconds have passed since the
    first, queued back to back in rounds sized from the time per call so far (``triton.testing.do_bench``'s
    way; each round ends with a synchronize, so the host clock measures the device's work). Then each of the
    ``iters`` timed calls is bracketed by its own pair of CUDA events on the current stream.

    Two kinds of time (``triton.testing.do_bench`` does the same as ``flush=True``):

    - ``flush=False``: the events bracket the host's call, so when the GPU drains faster than the
      host enqueues, the time includes the host's launch latency (the step as an eager caller sees
      it: Python, argument packing, driver calls).
    - ``flush=True``: :func:`l2_flush` is queued before each start event; the GPU is still busy with
      it while the host enqueues the step, so the time is the step's device time (all its kernels
      and the gaps between them, not the host), and L2 is cold at its start.

    Returns:
        ``{"median_us", "min_us", "p90_us", "iters", "samples_us"}`` (``samples_us``: every timed call's
        time in call order).
    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device")
    if flush:
        l2_flush()  # allocates its buffer outside the timed iterations
    t0, i, want = time.perf_counter(), 0, max(warmup, 0)
    while True:
        while i < want:
            fn(i)
            i += 1
        torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if elapsed_ms >= warmup_ms:
            break
        # the rest of warmup_ms at the rate so far (at least one call; the first round may be a single call)
        want = i + max(1, math.ceil((warmup_ms - elapsed_ms) / max(elapsed_ms / i, 1e-3))) if i else 1
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for j in range(iters):
        if flush:
            l2_flush()
        starts[j].record()
        fn(i + j)
        ends[j].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    t = sorted(samples)
    return {"median_us": statistics.median(t), "min_us": t[0], "p90_us": t[int(0.9 * (len(t) - 1))], "iters": iters,
            "samples_us": samples}


def capture_graphs(step: Callable[[int], object], n: int) -> list:
    """One CUDA graph of ``step(j)`` for each ``j < n``, after running every step once on a side
    stream (the warm-up PyTorch's CUDA-graph docs prescribe: lazy allocations and compilation happen
    outside the capture). Returns the ``torch.cuda.CUDAGraph`` objects; replay them on the current stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(n):
            step(j)
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for j in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(j)
        graphs.append(g)
    return graphs


def read_bandwidth_gbs(nbytes: int = 4 << 30, iters: int = 20) -> dict:
    """The streaming-read ceiling in GB/s, measured three ways on a ``nbytes`` buffer of random bf16
    (far larger than L2), median of ``iters`` runs each:

    - ``triton_read``: a Triton kernel, one program per 64 KiB tile, 16-byte loads, one fp32 partial
      sum per program (reads ``nbytes``, writes ~0);
    - ``torch_sum``: ``torch.sum`` to one fp32 value;
    - ``copy_rw``: ``copy_`` counting bytes read plus written.

    ``ceiling_gbs`` is the larger of the two pure reads: the bar decode kernels are held to.
    """
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.empty((), device="cuda", dtype=torch.float32)
    res = {}
    r = time_cuda(lambda i: torch.sum(x, dim=0, dtype=torch.float32, out=out), warmup=3, iters=iters)
    res["torch_sum"] = nbytes / r["median_us"] / 1e3
    try:
        from ._read_kernel import streaming_read

        block = 32768
        partial = torch.empty(-(-x.numel() // block), device="cuda", dtype=torch.float32)
        r = time_cuda(lambda i: streaming_read(x, partial, block), warmup=3, iters=iters)
        res["triton_read"] = nbytes / r["median_us"] / 1e3
    except Exception as e:  # noqa: BLE001 - triton missing: the torch figure stands alone
        res["triton_read_error"] = str(e)[:200]
    y = torch.empty_like(x)
    r = time_cuda(lambda i: y.copy_(x), warmup=3, iters=iters)
    res["copy_rw"] = 2 * nbytes / r["median_us"] / 1e3
    del x, y
    torch.cuda.empty_cache()
    res["ceiling_gbs"] = max(v for k, v in res.items() if k in ("torch_sum", "triton_read"))
    return res
