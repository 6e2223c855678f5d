"""CUDA-graph capture with cached capacity plans, for every kernel backend (GPU only).

One graph is captured once and replayed while the caller rewrites ``seq_lens`` and
``block_table`` in place; every replay must equal the float64 reference at the new lengths
(stale splits after a length change, a padded batch whose idle programs must still write their rows, GQA group 16,
launches on the capture stream), and lengths written outside ``[0, capacity]`` are read clamped into it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

pytestmark = pytest.mark.gpu
BACKENDS = kernel_backends("cuda") if HAS_CUDA else ["triton", "numba", "cuda_ptx"]


def capture(w, x, out, lse):
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside capture
        w.run(*args, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(*args, out=out, lse=lse)
    return g


def check(x, out, lse, dtype):
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, dtype)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("q_len", [1, 4])
def test_graph_replay_follows_new_lengths(backend, page, q_len, gen):
    """Capture at [100]*4, replay at [100, 30000, 5, 0] and more: the schedule follows the new lengths."""
    cap = 32768
    x = make_inputs(4, 32, 8, 128, [100] * 4, q_len=q_len, page_size=page, dtype=torch.bfloat16, device="cuda",
                    capacity=cap, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert plan.capacity_mode and plan.problem.capacity >= cap
    misses = w.ctx.cache.stats.misses
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    for lens in ([100, 30000, 5, 0], [0, 0, 0, 0], [cap, 1, 16, 17], [4, 3, 2, 1]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        if page:  # re-map pages in place, as a serving engine's allocator would
            x.block_table.copy_(x.block_table[torch.randperm(4, generator=gen)])
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(x, out, lse, torch.bfloat16)
    assert w.ctx.cache.stats.misses == misses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16])
def test_live_plan_replays_any_lengths(backend, page, gen):
    """A live plan of uniform lengths (its grid fitted to its own bucket's units) captured and replayed at lengths
    of its bucket, and at lengths it was not planned for (long-tailed, empty, up to the capacity): every replay equals
    the reference."""
    cap = 8192
    x = make_inputs(6, 32, 8, 128, [3000] * 6, page_size=page, dtype=torch.bfloat16, device="cuda", capacity=cap,
                    generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[3000] * 6)
    assert not plan.capacity_mode and not plan.schedule.single_pass  # a scheduled grid fitted to its bucket
    assert plan.schedule.targets[:32] == plan.schedule.targets[32:]
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    for lens in ([2049, 4096, 3000, 2500, 4000, 3333], [4096] * 6, [cap, 1, 0, 17, 4096, 100], [0] * 6,
                 [cap] * 6):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(x, out, lse, torch.bfloat16)


def _nan_past_the_capacity(x, cap: int, page: int | None):
    """``x`` with NaN wherever a read past a sequence's capacity would land: a contiguous k / v becomes the first
    ``cap`` positions of a longer tensor whose other positions are NaN; a paged block table becomes the first columns
    of a wider table whose other columns name a page of NaN (appended to the cache; no sequence maps it)."""
    nan = float("nan")
    if page is None:
        k, v = (torch.cat([t, torch.full_like(t[:, :64], nan)], 1)[:, :cap] for t in (x.k_cache, x.v_cache))
        return dataclasses.replace(x, k_cache=k, v_cache=v)
    k, v = (torch.cat([t, torch.full_like(t[:1], nan)]) for t in (x.k_cache, x.v_cache))
    cols = x.block_table.shape[1]
    wide = torch.full((x.block_table.shape[0], cols + 8), k.shape[0] - 1, dtype=torch.int32, device="cuda")
    wide[:, :cols] = x.block_table
    return dataclasses.replace(x, k_cache=k, v_cache=v, block_table=wide[:, :cols])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("how", ["capacity", "single"])
def test_graph_replay_clamps_lengths_outside_the_capacity(backend, page, q_len, how, gen):
    """A captured capacity plan (and a single-pass live plan) replayed with lengths written outside ``[0,
    capacity]`` (one past it, 2^31 - 1, far past it, negative, the smallest int32): every kernel reads each length
    clamped into ``[0, capacity]``, so every replay equals the reference on the clamped lengths and nothing past the
    capacity is read (NaN there: :func:`_nan_past_the_capacity`)."""
    cap = 4096
    x = make_inputs(4, 32, 8, 128, [100] * 4, q_len=q_len, page_size=page, dtype=torch.bfloat16, device="cuda",
                    capacity=cap, generator=gen)
    x = _nan_past_the_capacity(x, cap, page)
    assert (x.k_cache.shape[1] if page is None else x.block_table.shape[1] * page) == cap
    w = attnplan.DecodeWrapper(backend=backend)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    if how == "capacity":
        plan = w.plan(*args, capacity=True)
        assert plan.capacity_mode
    else:
        plan = w.plan(*args, num_splits=1, seq_lens_host=[100] * 4)
        assert plan.single_pass
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    for lens in ([cap + 1, 2**31 - 1, -5, 100], [-2**31, cap, 2**31 - 1, 0], [cap + 1000, 17, -1, cap - 1]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        clamped = torch.tensor([min(max(n, 0), cap) for n in lens], dtype=torch.int32)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, clamped, x.block_table, x.sm_scale)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_padded_batch(backend, gen):
    """Capacity batch 8, 3 live sequences: the empty sequences' rows are written (0 / -inf)."""
    x = make_inputs(8, 16, 2, 128, [0] * 8, page_size=16, dtype=torch.float16, device="cuda", capacity=4096, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    x.seq_lens.copy_(torch.tensor([1000, 4096, 7, 0, 0, 0, 0, 0], dtype=torch.int32))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check(x, out, lse, torch.float16)
    assert torch.all(out[3:] == 0) and torch.all(torch.isneginf(lse[3:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_gqa_group_16(backend, gen):
    """GQA group 16: 64/4/128, eager and under graph replay."""
    x = make_inputs(2, 64, 4, 128, [3000, 17], page_size=16, dtype=torch.bfloat16, device="cuda", capacity=8192,
                    generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    x.seq_lens.copy_(torch.tensor([8192, 4000], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    check(x, out, lse, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_plan_and_capacity_plan_agree(backend, gen):
    """Eager planning from live lengths may schedule differently; results agree within rounding."""
    x = make_inputs(2, 32, 8, 128, [5000, 300], page_size=16, dtype=torch.bfloat16, device="cuda", capacity=65536,
                    generator=gen)
    eager = attnplan.DecodeWrapper(backend=backend)
    p1 = eager.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    a = eager.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table).clone()
    cap = attnplan.DecodeWrapper(backend=backend)
    p2 = cap.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    b = cap.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table).clone()
    assert p1.schedule != p2.schedule
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(a, ref, torch.bfloat16)
    assert_close_to_reference(b, ref, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_without_plan_during_capture_raises(backend):
    x = make_inputs(1, 8, 2, 64, [10], dtype=torch.float16, device="cuda")
    w = attnplan.DecodeWrapper(backend=backend)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(attnplan.PlanNotReadyError, match="before capturing"):
        with torch.cuda.graph(g):
            w.run(x.q, x.k_cache, x.v_cache, x.seq_lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_does_not_allocate(backend, gen):
    """run() after plan(): the caching allocator's allocation count does not move."""
    x = make_inputs(2, 32, 8, 128, [3000, 20], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replay_with_fused_merge(backend, gen):
    """The fused merge's completion counters reset themselves: replays stay correct."""
    from attnplan.backends import get_backend

    if "fused" not in get_backend(backend).merge_strategies:
        pytest.skip(f"{backend} has no fused merge")
    cfg = attnplan.load_config(split={"merge": "fused"}, plan_cache={"disk": False})
    x = make_inputs(2, 32, 8, 128, [500, 9], page_size=16, dtype=torch.bfloat16, device="cuda", capacity=8192,
                    generator=gen)
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert plan.merge == "fused"
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    g = capture(w, x, out, lse)
    for lens in ([8192, 0], [1, 4000], [300, 301]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        check(x, out, lse, torch.bfloat16)
    assert int(w.workspace.counters.abs().sum()) == 0
