"""The GPU timing helpers' own logic, on the CPU: CUDA's events and synchronize are faked, and a fake host clock
advances 1 ms per call of the timed function (attnplan.timing.time_cuda, attnplan.tune._graph_time)."""

import types

import pytest
import torch

import attnplan.timing as timing
import attnplan.tune as tune


@pytest.fixture
def fake_cuda(monkeypatch):
    """A log of what time_cuda did, in order: ("call", i) per call of fn, "sync", "clock" per host-clock read."""
    log, clock = [], [0.0]

    class Event:
        def __init__(self, enable_timing=True):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 0.002  # ms

    def perf_counter():
        log.append("clock")
        return clock[0]

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda *a: log.append("sync"))
    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=perf_counter))

    def fn(i):
        log.append(("call", i))
        clock[0] += 1e-3

    return log, fn


def _calls(log):
    return [e[1] for e in log if isinstance(e, tuple)]


@pytest.mark.parametrize("warmup, warmup_ms, n_warm", [(3, 25.0, 25), (3, 0.0, 3), (30, 5.0, 30), (0, 4.0, 4), (0, 0.0, 0)])
def test_time_cuda_warms_up_by_count_and_time(fake_cuda, warmup, warmup_ms, n_warm):
    """At least ``warmup`` calls and at least ``warmup_ms`` of them (the longer of the two), then ``iters`` timed
    calls; call indices run on without a restart (callers rotate input sets by ``i % n``); the host clock is only
    read after a synchronize (else it would time the host's enqueueing, not the device's work)."""
    log, fn = fake_cuda
    r = timing.time_cuda(fn, warmup=warmup, iters=4, warmup_ms=warmup_ms)
    assert _calls(log) == list(range(n_warm + 4))
    assert r["iters"] == 4 and r["samples_us"] == [pytest.approx(2.0)] * 4 and r["median_us"] == pytest.approx(2.0)
    clocks = [k for k, e in enumerate(log) if e == "clock"]
    assert all(log[k - 1] == "sync" for k in clocks[1:])
    assert log[clocks[-1] + 1:].count("sync") == 1  # the timed calls: one synchronize at the end


def test_time_cuda_default_warmup_is_do_bench_25_ms(fake_cuda):
    log, fn = fake_cuda
    timing.time_cuda(fn, warmup=2, iters=1)
    assert timing.WARMUP_MS == 25.0 and len(_calls(log)) == 25 + 1


def test_tune_first_timing_on_fresh_inputs_warms_up_longer(monkeypatch):
    """``tune._graph_time``: the first timing on a KV cache warms up for FIRST_WARMUP_MS, later ones on the same
    cache for WARMUP_MS, a new cache's first again FIRST_WARMUP_MS (measured on an H200: a tune that warmed up with 5
    replays timed single passes 11-14% slow right after building their inputs)."""
    seen = []
    monkeypatch.setattr(timing, "capture_graphs", lambda step, n: [types.SimpleNamespace(replay=lambda: None)])
    monkeypatch.setattr(timing, "time_cuda", lambda fn, **kw: (seen.append(kw["warmup_ms"]), {"median_us": 1.0})[1])

    def inputs():
        k = torch.zeros(2, 3)
        return types.SimpleNamespace(q=None, k_cache=k, v_cache=k, seq_lens=None, block_table=None)

    w = types.SimpleNamespace(run=lambda *a: None)
    x1, x2 = inputs(), inputs()
    for x in (x1, x1, x2, x1, x2):
        assert tune._graph_time(w, x, 3) == 1.0
    first, later = tune.FIRST_WARMUP_MS, timing.WARMUP_MS
    assert first > later and seen == [first, later, first, later, later]
    key = id(x1.k_cache)
    del x1
    assert key not in tune._timed_caches  # forgotten when the cache is freed (an id may be reused)
