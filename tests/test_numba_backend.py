"""The ``numba`` backend against the float64 reference: the device-side schedule's integers, the scheduled
kernel's outputs unit by unit (direct rows, workspace slots, ``meta``), the separate merge against
:func:`attnplan.state.merge_states`, the single pass, ``attnplan.decode``, strides, 64-bit offsets, NaN
isolation, the variants, and numba's process-wide patches kept to launches.

On CPU (CI: ``NUMBA_ENABLE_CUDASIM=1``) the kernels run in numba's CUDA simulator at small sizes;
the module is skipped when the backend is not available. ``gpu``-marked tests add realistic sizes,
CUDA-graph replay, a batch of 65,536 and offsets past 2^31 on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
import time

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.backends.base import Workspace
from attnplan.problem import DecodeProblem
from attnplan.schedule import LONGEST_FIRST_BATCH, NUM_TARGETS, Schedule, first_slots, max_units_bound, schedule_units
from attnplan.state import PartialState
from attnplan.testing import (BUCKET_END_TOTALS, TOP_BUCKET_LENGTHS, DecodeCase, assert_close_to_reference,
                              bucket_schedule, make_inputs, poison)

from conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKEND = get_backend("numba")
_OK, _WHY = BACKEND.available(torch.device(DEVICE))
if not _OK:
    pytest.skip(f"numba backend unavailable on {DEVICE}: {_WHY}", allow_module_level=True)

from attnplan.backends.numba import NumbaBackend, kernels  # noqa: E402  (numba importable from here on)
from numba import cuda  # noqa: E402

DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
F32_TOL = torch.float32  # partial states are fp32 whatever the input dtype
FP8 = torch.float8_e4m3fn

Case = functools.partial(DecodeCase, dtype="fp16", splits=(1,))


def _inputs(case, gen, device=DEVICE, **kw):
    """Random inputs for ``case`` (``kw``: :func:`attnplan.testing.make_inputs`' other arguments)."""
    hq, hkv = case.heads
    return make_inputs(len(case.lens), hq, hkv, case.head_dim, case.lens, q_len=case.q_len, page_size=case.page,
                       dtype=DT[case.dtype], device=device, generator=gen, **kw)


def _plan(x, num_splits=None, *, capacity=False, **kernel):
    """A numba wrapper planned for ``x`` (its variants included) and its plan; ``kernel`` overrides
    thread-layout keys of the plan."""
    w = attnplan.DecodeWrapper(backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits, capacity=capacity,
                  window_left=x.window_left, logits_soft_cap=x.soft_cap, sinks=x.sinks, k_scale=x.k_scale,
                  v_scale=x.v_scale)
    assert plan.backend == "numba"
    if kernel:
        plan = dataclasses.replace(plan, kernel=attnplan.planner.KernelOptions({**plan.kernel, **kernel}))
    return w, plan


def _poisoned_io(x, with_lse=True):
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], device=x.q.device)) if with_lse else None
    return out, lse


def _reference(x, **kw):
    return reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                               window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks, k_scale=x.k_scale,
                               v_scale=x.v_scale, **kw)


def _check_partial_launch(x, plan, workspace, out, lse):
    """After ``BACKEND.partial`` alone: one-unit sequences' rows in ``out``/``lse`` equal the reference (sink
    applied), their workspace slot untouched; every unit of a sequence with several units equals the
    reference's partial state (sequence order, ``indptr``) in its slot ``first[b] + j`` (longest units first in a
    batch of at most 32), its ``out`` rows untouched; slots past the batch's units untouched; ``meta`` equals the
    host schedule (``first`` then ``units``). Returns the schedule's :class:`~attnplan.schedule.Units`."""
    ref_st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                      plan.schedule, window_left=x.window_left, soft_cap=x.soft_cap,
                                      k_scale=x.k_scale, v_scale=x.v_scale)
    ref_o, ref_lse = _reference(x)
    n = units.num_units
    st = workspace.state
    for b in range(x.q.shape[0]):
        lo = int(units.first[b])  # the device's slots; the reference's states are in sequence order
        if int(units.units[b]) == 1:
            assert_close_to_reference(out[b], ref_o[b], x.q.dtype, what=f"out of one-unit sequence {b}")
            if lse is not None:
                assert_close_to_reference(lse[b], ref_lse[b], F32_TOL, what=f"lse of one-unit sequence {b}")
            if st is not None:
                assert torch.isnan(st.lse[0, :, :, lo]).all() and torch.isnan(st.o[0, :, :, lo]).all(), \
                    f"one-unit sequence {b} wrote its workspace slot"
        else:
            hi = lo + int(units.units[b])
            r0, r1 = int(units.indptr[b]), int(units.indptr[b + 1])
            assert_close_to_reference(st.o[0, :, :, lo:hi], ref_st.o[0, :, :, r0:r1], F32_TOL,
                                      what=f"o of slots {lo}..{hi - 1} (sequence {b})")
            assert_close_to_reference(st.lse[0, :, :, lo:hi], ref_st.lse[0, :, :, r0:r1], F32_TOL,
                                      what=f"lse of slots {lo}..{hi - 1} (sequence {b})")
            assert torch.isnan(out[b].float()).all(), f"the partial kernel wrote out rows of sequence {b}"
            if lse is not None:
                assert torch.isnan(lse[b]).all(), f"the partial kernel wrote lse rows of sequence {b}"
    if st is not None:
        assert torch.isnan(st.o[0, :, :, n:]).all() and torch.isnan(st.lse[0, :, :, n:]).all(), \
            "a program without a unit wrote its slot"
    if workspace.meta is not None:
        bsz = x.q.shape[0]
        assert workspace.meta[:bsz].tolist() == units.first.tolist()
        assert workspace.meta[bsz:2 * bsz].tolist() == units.units.tolist()
    return units


# -- the device-side schedule's integers --------------------------------------------------------------

#: threads per program of the prologue tests: the simulator's few (down to 1), whole warps on a GPU
PROBE_THREADS = [1, 2, 8] if kernels.SIM else [32, 64, 256]


def _probe(lens, sched: Schedule, probe_units, *, threads=PROBE_THREADS[-1], q_len=1, window_left=-1,
           write_meta=True, capacity=2**31 - 1):
    """Run the kernels' schedule prologue alone: ``(res [n, 6], meta [2B])`` (kernels.schedule_probe_kernel), each
    length clamped into ``[0, capacity]``."""
    lens = torch.as_tensor(lens, dtype=torch.int32)
    units = torch.as_tensor(probe_units, dtype=torch.int64)
    res = torch.full((units.numel(), 6), -7, dtype=torch.int64)
    meta = torch.full((2 * lens.numel(),), -7, dtype=torch.int32)
    targets = torch.tensor(sched.targets, dtype=torch.int32)
    kern = kernels.schedule_probe_kernel(threads, q_len, window_left >= 0)
    args = (lens, targets, meta, units, res)
    if HAS_CUDA and not kernels.SIM:
        dev = [a.cuda() for a in args]
        with kernels.launch_scope():
            kern[units.numel(), threads](*(cuda.as_cuda_array(a) for a in dev), sched.granule,
                                         sched.min_unit_granules, sched.max_units_per_seq, int(write_meta),
                                         max(window_left, 0), capacity)
        torch.cuda.synchronize()
        res, meta = dev[4].cpu(), dev[2].cpu()
    else:
        old = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        try:
            with kernels.launch_scope():
                kern[units.numel(), threads](*(kernels.sim_array(a.numpy()) for a in args), sched.granule,
                                             sched.min_unit_granules, sched.max_units_per_seq, int(write_meta),
                                             max(window_left, 0), capacity)
        finally:
            sys.setswitchinterval(old)
    return res, meta


def _check_probe(lens, sched, probe_units, res, meta, q_len=1, window_left=-1, write_meta=True, capacity=None):
    """Each probed slot's row is :func:`schedule_units`'s unit in that slot (``by_slot``: longest units first in a
    batch of at most 32, else index order), ``b = -1`` past the batch's units; ``meta`` is ``first`` then
    ``units``. Returns the schedule's :class:`~attnplan.schedule.Units`."""
    u = schedule_units(lens, sched, q_len, window_left, capacity)
    by_slot = u.by_slot()
    for row, slot in zip(res.tolist(), probe_units):
        if slot >= u.num_units:
            assert row[0] == -1 and row[1:] == [-7] * 5, f"slot {slot} past {u.num_units}: {row}"
            continue
        k = int(by_slot[slot])  # the unit (sequence order) in this slot
        b = int(u.seq[k])
        assert int(u.first[b]) + k - int(u.indptr[b]) == slot
        want = [b, k - int(u.indptr[b]), int(u.start[k]), int(u.end[k]), int(u.units[b]), u.granules_per_unit]
        assert row == want, f"slot {slot}: kernel {row}, schedule_units {want}"
    if write_meta:
        bsz = len(lens)
        assert meta[:bsz].tolist() == u.first.tolist() and meta[bsz:].tolist() == u.units.tolist()
    return u


@st.composite
def _schedules(draw):
    granule = draw(st.sampled_from([16, 32, 48]))
    min_c = draw(st.integers(1, 3))
    s_cap = draw(st.integers(2, 9))
    batch = draw(st.integers(1, 11))
    raw = draw(st.lists(st.integers(0, 40), min_size=NUM_TARGETS, max_size=NUM_TARGETS))
    policy = draw(st.sampled_from(["balanced", "forced"]))
    targets = (0, *raw[1:]) if policy == "balanced" else (0,) * NUM_TARGETS
    bound = max(batch, max_units_bound(targets, batch, s_cap)) if policy == "balanced" else batch * s_cap
    lens = draw(st.lists(st.integers(0, 700), min_size=batch, max_size=batch))
    return Schedule(policy, granule, min_c, s_cap, targets, bound), lens


@given(sl=_schedules(), q_len=st.integers(1, 3), window=st.sampled_from([-1, 0, 7, 100]),
       threads=st.sampled_from(PROBE_THREADS))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_prologue_equals_schedule_units(sl, q_len, window, threads):
    """The kernels' prologue computes exactly :func:`attnplan.schedule.schedule_units`'s integers (sequence,
    unit index, token range, units, granules per unit, and ``meta``) for every unit and one past the last,
    with blocks of 1, 2 and 8 threads in the simulator (several scan chunks per batch; 32 to 256 on a GPU)."""
    sched, lens = sl
    n = schedule_units(lens, sched, q_len, window).num_units
    probe = list(range(n + 1))
    res, meta = _probe(lens, sched, probe, threads=threads, q_len=q_len, window_left=window)
    _check_probe(lens, sched, probe, res, meta, q_len, window)


def test_prologue_over_many_scan_chunks(gen):
    """3,000 sequences (94 chunks of 8 threads x SCHED_PER in the simulator): block 0 writes the whole
    ``meta``; a unit in the middle, the last unit and one past it find their sequence; the targets' bucket and
    ``c`` come from a total of several thousand granules (a long sequence among short ones gets many units)."""
    lens = torch.randint(0, 60, (3000,), generator=gen, dtype=torch.int32)
    lens[1234] = 9000
    targets = tuple([0] + [min(3 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)])
    sched = Schedule("balanced", 16, 1, 64, targets, max_units_bound(targets, 3000, 64))
    u = schedule_units(lens, sched)
    assert u.num_units > 3000 and int(u.units[1234]) > 8
    assert u.first.tolist() == u.indptr[:-1].tolist()  # past LONGEST_FIRST_BATCH sequences: slots in index order
    probe = [u.num_units - 1, int(u.first[1234]) + 3, u.num_units]
    res, meta = _probe(lens, sched, probe)
    _check_probe(lens, sched, probe, res, meta)


def _long_tailed_lengths(batch: int, seed: int) -> list[int]:
    """``batch`` seeded long-tailed lengths: mostly short (some empty, some repeated, so granules per unit tie),
    a few long (up to 12,000 tokens), in a shuffled order, so longest-first slots are far from index order."""
    g = torch.Generator().manual_seed(seed)
    lens = (torch.rand(batch, generator=g) ** 6 * 12000).to(torch.int64)
    lens[torch.rand(batch, generator=g) < 0.15] = 0
    lens[: min(batch, 3)] = torch.tensor([20, 3000, 12000][: min(batch, 3)])
    if batch > 6:
        lens[5] = lens[1]  # a tie of cb: broken by index
        lens[6] = 20
    return lens[torch.randperm(batch, generator=g)].tolist()


@pytest.mark.parametrize("batch,seed", [(5, 0), (5, 1), (16, 2), (32, 3), (33, 4), (64, 5)])
def test_prologue_slots_longest_units_first(batch, seed):
    """Long-tailed batches: every slot's sequence, unit index, token range and units, and ``meta``, are
    :func:`schedule_units`'s through ``first`` / ``slot``: at most 32 sequences take the slots in order of
    decreasing granules per unit (ties by index, empty sequences last), far from index order here; 33 and 64 in
    index order (the scan). Blocks of 1, 2 and 8 simulated threads (32 to 256 on a GPU)."""
    lens = _long_tailed_lengths(batch, seed)
    targets = (0,) + (24,) * (NUM_TARGETS - 1)
    sched = Schedule("balanced", 16, 1, 8, targets, max_units_bound(targets, batch, 8))
    u = schedule_units(lens, sched)
    if batch <= LONGEST_FIRST_BATCH:
        assert u.first.tolist() != u.indptr[:-1].tolist() and u.num_units > batch
    else:
        assert u.first.tolist() == u.indptr[:-1].tolist()
    probe = list(range(u.num_units + 1))
    res, meta = _probe(lens, sched, probe, threads=PROBE_THREADS[seed % len(PROBE_THREADS)])
    got = _check_probe(lens, sched, probe, res, meta)
    # and the slots' order itself: in a small batch cb never grows along the slots
    cb = [int(got.unit_granules[b]) for b in res[: u.num_units, 0].tolist()]
    assert batch > LONGEST_FIRST_BATCH or cb == sorted(cb, reverse=True)


@pytest.mark.parametrize("total", BUCKET_END_TOTALS)
def test_prologue_reads_the_bucket_of_the_total(total):
    """Totals at both ends of buckets (``bit_length(T + T // 2)``): only ``bucket_of(T)``'s targets are ``T`` (units of
    one granule), every other entry 1 (one unit per sequence), so a bucket off by one shows in the unit count."""
    sched = bucket_schedule(total, total, 256 + 3)
    for lens in ([16 * total], [16 * (total - total // 2), 0, 16 * (total // 2)]):
        u = schedule_units(lens, sched)
        assert u.num_units == total + (len(lens) == 3)  # units of one granule; the empty sequence gets one
        probe = [u.num_units - 1, u.num_units]
        res, meta = _probe(lens, sched, probe)
        _check_probe(lens, sched, probe, res, meta)


@pytest.mark.parametrize("lens", TOP_BUCKET_LENGTHS, ids=["bucket-30-end", "bucket-31-start", "T+T/2-past-2^31"])
def test_prologue_reads_the_top_buckets(lens):
    """Totals at the last buckets' boundary (715,827,882 | 715,827,883 granules) and a total whose ``T + T // 2`` is
    past 2^31 (15 sequences of 2^31 - 1 tokens: bucket 31, not a wrapped one): only the right bucket's targets give 8
    units per sequence, every other entry one."""
    sched = bucket_schedule(sum(-(-n // 16) for n in lens), 8 * len(lens), 256 * len(lens))
    u = schedule_units(lens, sched)
    assert u.units.tolist() == [8] * len(lens)
    probe = [0, u.num_units - 1, u.num_units]
    res, meta = _probe(lens, sched, probe)
    _check_probe(lens, sched, probe, res, meta)


@pytest.mark.parametrize("table", ["c1", "total"])
@pytest.mark.parametrize("q_len,window", [(1, -1), (2, 7)])
def test_prologue_clamps_lengths_into_the_capacity(q_len, window, table):
    """Lengths outside ``[0, capacity]`` on the device (one past it, the largest int32, negative, the smallest int32)
    are read clamped into it: every unit's integers and ``meta`` are :func:`schedule_units`'s for the clamped
    lengths (several scan chunks of 2 simulated threads); unclamped, units would start past the cache. Table "c1":
    units of one granule; "total" (8 units for any bucket): granules per unit ceil(T / 8), so the batch's total
    must be of clamped lengths too."""
    cap = 96
    lens = [cap + 1, 2**31 - 1, -5, 40, -2**31, cap]
    targets = {"c1": tuple([0] + [min(4 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)]),
               "total": (8,) * NUM_TARGETS}[table]
    sched = Schedule("balanced", 16, 1, 4, targets, max_units_bound(targets, len(lens), 4))
    u = schedule_units(lens, sched, q_len, window, cap)
    assert int(u.end.max()) <= cap and int(u.units[1]) == int(u.units[0]) and int(u.units[2]) == 1
    assert table != "c1" or int(u.units[0]) == 3 or window >= 0  # 6 granules in 3 units of 2; a window: one
    probe = list(range(u.num_units + 1))
    res, meta = _probe(lens, sched, probe, threads=PROBE_THREADS[1], q_len=q_len, window_left=window, capacity=cap)
    _check_probe(lens, sched, probe, res, meta, q_len, window, capacity=cap)


@pytest.mark.gpu
def test_gpu_prologue_batch_65536(gen):
    """A batch of 65,536 (and one past 2^16) on the device: every unit's integers and ``meta``."""
    for batch in (65536, 70001):
        lens = torch.randint(0, 3000, (batch,), generator=gen, dtype=torch.int32)
        lens[batch // 2] = 2**20
        targets = tuple([0] + [min(2 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)])
        sched = Schedule("balanced", 64, 1, 128, targets, max_units_bound(targets, batch, 128))
        u = schedule_units(lens, sched)
        probe = list(range(0, u.num_units, 97)) + [u.num_units - 1, u.num_units]
        res, meta = _probe(lens, sched, probe, threads=256)
        _check_probe(lens, sched, probe, res, meta)


# -- the scheduled kernel, unit by unit ------------------------------------------------------------------

# Small shapes: the simulator runs every CUDA thread in Python. Lengths cover 0, 1, a page boundary (16)
# and one past it (17), several units; groups 1, 4 and 7; q_len 1 and 3.
PARTIAL_CASES = [
    Case((2, 2), 16, (0, 1, 33), dtype="fp16", splits=(3,), tags=("gqa1",)),
    Case((4, 1), 32, (16, 17, 40), q_len=3, page=16, dtype="bf16", splits=(3,), tags=("page-boundary",)),
    Case((7, 1), 16, (45, 1, 0), page=4, dtype="fp32", splits=(2,), tags=("group7",)),
    Case((8, 2), 24, (39, 4), page=1, dtype="bf16", splits=(4,), tags=("page1",)),
    Case((4, 1), 16, (40,), page=16, dtype="fp16", splits=(16,), tags=("more-splits-than-granules",)),
    Case((4, 1), 32, (33, 2), q_len=3, dtype="bf16", splits=(3,), tags=("rows-with-nothing-visible",)),
]


def _params(cases):
    return [pytest.param(c, n, id=f"{c.id}-s{n}") for c in cases for n in c.splits]


@pytest.mark.parametrize("case,num_splits", _params(PARTIAL_CASES))
def test_partial_kernel_unit_by_unit(case, num_splits, gen):
    """``partial`` alone: direct rows, workspace slots and ``meta`` (:func:`_check_partial_launch`), workspace
    and outputs poisoned with NaN; then the merge completes ``out`` to the reference."""
    x = _inputs(case, gen)
    w, plan = _plan(x, num_splits)
    assert plan.num_splits == num_splits and not plan.single_pass and plan.merge == "separate"
    assert plan.grid == (plan.schedule.max_units * case.heads[1],)
    w.workspace.state.fill_(float("nan"))
    w.workspace.meta.fill_(-1)
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    units = _check_partial_launch(x, plan, w.workspace, out, lse)
    assert int(units.units.max()) > 1 or not kernels.SIM, "the case should split a sequence"
    BACKEND.merge(plan, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, x.q.dtype)
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


def test_rows_with_nothing_visible_in_a_live_unit(gen):
    """Length 2G + 1 (G the granule), q_len 3, 3 forced units of one granule each: the last unit [2G, 2G + 1)
    holds only a position queries 0 and 1 cannot see (exactly o = 0, lse = -inf in its slot); query 2 sees
    that position alone there (o = v[2G], lse = scale q.k[2G])."""
    x = _inputs(Case((4, 1), 16, (40,), q_len=3, dtype="fp32"), gen, capacity=1024)
    w, plan = _plan(x, 3)
    g = plan.schedule.granule
    length = 2 * g + 1
    x.seq_lens.fill_(length)
    u = schedule_units([length], plan.schedule, q_len=3)
    assert u.start.tolist() == [0, g, 2 * g] and u.end.tolist() == [g, 2 * g, length]
    w.workspace.state.fill_(float("nan"))
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    st = w.workspace.state
    assert torch.isneginf(st.lse[0, :2, :, 2]).all()
    assert torch.equal(st.o[0, :2, :, 2], torch.zeros_like(st.o[0, :2, :, 2]))
    v = x.v_cache[0, 2 * g, 0].double().cpu()
    assert torch.allclose(st.o[0, 2, :, 2].double().cpu(), v.expand(4, 16), atol=1e-6)
    expect = (x.q[0, 2].double().cpu() @ x.k_cache[0, 2 * g, 0].double().cpu()) * x.sm_scale
    assert torch.allclose(st.lse[0, 2, :, 2].double().cpu(), expect, atol=1e-5)


def test_empty_sequence_in_a_split_plan_is_written_directly(gen):
    """A zero-length sequence has one empty unit: its rows are o = 0, lse = -inf (the sink, with sinks) in
    ``out`` exactly, never NaN, and its slot is untouched (the last slot: longest units first, an empty sequence
    last)."""
    x = _inputs(Case((4, 1), 16, (0, 40), q_len=2, dtype="bf16"), gen)
    for sinks in (None, torch.randn(4, generator=gen).to(DEVICE)):
        xs = dataclasses.replace(x, sinks=sinks)
        w, plan = _plan(xs, 3)
        u = schedule_units(xs.seq_lens.cpu(), plan.schedule, 2)
        slot = int(u.first[0])
        assert slot == u.num_units - 1 and int(u.units[1]) > 1
        w.workspace.state.fill_(float("nan"))
        out, lse = _poisoned_io(x)
        BACKEND.run(plan, xs, w.workspace, out, lse)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        want = torch.full((2, 4), float("-inf"), device=DEVICE) if sinks is None else sinks.expand(2, 4)
        assert torch.equal(lse[0], want)
        assert torch.isnan(w.workspace.state.lse[0, :, :, slot]).all()
        assert not torch.isnan(w.workspace.state.lse[0, :, :, :slot]).any()  # sequence 1's units, before it
        ref, ref_lse = _reference(xs)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


def test_live_plan_serves_any_lengths_up_to_the_capacity(gen):
    """A plan made for the live lengths (20, 3, 3, 300; capacity 600) serves the batch after its lengths
    changed to (590, 600, 3, 0): the schedule maps them to units on the device (never more than the plan's
    slots)."""
    x = make_inputs(4, 4, 1, 16, [20, 3, 3, 300], page_size=4, capacity=600, dtype=torch.bfloat16, device=DEVICE,
                    generator=gen)
    w, plan = _plan(x)
    assert not plan.single_pass
    x.seq_lens.copy_(torch.tensor([590, 600, 3, 0], dtype=torch.int32))
    out, lse = _poisoned_io(x)
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    BACKEND.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    assert schedule_units([590, 600, 3, 0], plan.schedule).num_units <= plan.schedule.max_units


def test_many_sequences_over_several_scan_chunks(gen):
    """33 sequences (one more than a prologue chunk of 8 threads x SCHED_PER), one long among short and empty
    ones, up to 2 units each: every row equals the reference, unit by unit."""
    lens = ([0, 1, 5] * 11)[:32] + [150]
    x = make_inputs(33, 1, 1, 16, lens, dtype=torch.float16, device=DEVICE, generator=gen, capacity=150)
    w, plan = _plan(x, 2)
    assert 33 > 8 * kernels.SCHED_PER or HAS_CUDA
    w.workspace.state.fill_(float("nan"))
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    units = _check_partial_launch(x, plan, w.workspace, out, lse)
    assert int(units.units[32]) > 1 or not kernels.SIM
    BACKEND.merge(plan, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, torch.float16)
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


# -- the separate merge ------------------------------------------------------------------------------------

def _ragged_state(q_len, heads, units, d, gen, empty_frac=0.3):
    """A random ragged state for ``units`` per sequence (slots in order, 2 spare slots poisoned), with
    ``meta`` and ``indptr``; row (sequence 0, query 0, head 0) all empty; empty states' ``o`` is NaN (never
    read)."""
    n = sum(units)
    o = torch.randn(1, q_len, heads, n + 2, d, generator=gen)
    lse = torch.randn(1, q_len, heads, n + 2, generator=gen) * 3
    empty = torch.rand(1, q_len, heads, n + 2, generator=gen) < empty_frac
    empty[0, 0, 0, :units[0]] = True
    lse[empty] = float("-inf")
    o[empty] = float("nan")
    o[..., n:, :] = float("nan")
    lse[..., n:] = float("nan")
    indptr = torch.tensor([0, *numpy.cumsum(units).tolist()], dtype=torch.int64)
    meta = torch.tensor([*indptr[:-1].tolist(), *units], dtype=torch.int32)
    return PartialState(o.to(DEVICE), lse.to(DEVICE)), meta.to(DEVICE), indptr


def _workspace(state, meta):
    return Workspace(state, meta, None, torch.zeros(NUM_TARGETS, dtype=torch.int32, device=DEVICE),
                     (0,) * NUM_TARGETS)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_merge_matches_merge_states(dtype, gen):
    """The merge kernel against ``merge_states(..., indptr=...)`` (float64) on the rows of sequences with
    2, 3 and 7 units; rows of one-unit sequences are left as they were (poison stays); an all-empty row
    gives 0 / -inf; without lse the same out."""
    units = [3, 1, 7, 2, 1]
    st, meta, indptr = _ragged_state(2, 4, units, 16, gen)
    x = _inputs(Case((4, 2), 16, (20,) * 5, q_len=2, dtype=dtype), gen)
    _, plan = _plan(x, 7)
    ws = _workspace(st, meta)
    out = poison(torch.empty(5, 2, 4, 16, dtype=DT[dtype], device=DEVICE))
    lse = poison(torch.empty(5, 2, 4, device=DEVICE))
    BACKEND.merge(plan, ws, out, lse)
    ref_o, ref_lse = reference.merge(st, indptr=indptr)
    many = [b for b, n in enumerate(units) if n > 1]
    assert_close_to_reference(out[many], ref_o[many], DT[dtype])
    assert_close_to_reference(lse[many], ref_lse[many], F32_TOL, what="lse")
    assert torch.isnan(out[[1, 4]].float()).all() and torch.isnan(lse[[1, 4]]).all()
    assert torch.equal(out[0, 0, 0].float(), torch.zeros(16, device=DEVICE)) and torch.isneginf(lse[0, 0, 0])
    out2 = poison(torch.empty_like(out))
    BACKEND.merge(plan, ws, out2, None)
    assert torch.equal(out2[many], out[many])


def test_merge_reads_slots_out_of_sequence_order(gen):
    """``meta`` of longest-first slots (``first`` not monotone in the sequence): each row merges exactly its own
    slots ``[first[b], first[b] + units[b])``, the same as the sequence-order state merged through ``indptr``."""
    units = [3, 1, 7, 2, 1]
    st, _, indptr = _ragged_state(2, 4, units, 16, gen)
    first = first_slots([2, 5, 1, 4, 0], units)  # slots: sequence 1, 3, 0, 2, 4
    assert first.tolist() == [3, 0, 6, 1, 13]
    slot = torch.cat([first[b] + torch.arange(n) for b, n in enumerate(units)]).to(DEVICE)
    o, lse = st.o.clone(), st.lse.clone()
    o[..., slot, :] = st.o[..., :sum(units), :]
    lse[..., slot] = st.lse[..., :sum(units)]
    meta = torch.tensor([*first.tolist(), *units], dtype=torch.int32, device=DEVICE)
    x = _inputs(Case((4, 2), 16, (20,) * 5, q_len=2, dtype="fp32"), gen)
    _, plan = _plan(x, 7)
    out = poison(torch.empty(5, 2, 4, 16, device=DEVICE))
    out_lse = poison(torch.empty(5, 2, 4, device=DEVICE))
    BACKEND.merge(plan, _workspace(PartialState(o, lse), meta), out, out_lse)
    ref_o, ref_lse = reference.merge(st, indptr=indptr)
    many = [b for b, n in enumerate(units) if n > 1]
    assert_close_to_reference(out[many], ref_o[many], torch.float32)
    assert_close_to_reference(out_lse[many], ref_lse[many], F32_TOL, what="lse")


def test_merge_nan_state_is_nan_never_an_empty_row(gen):
    """NaN in a non-empty state makes its row NaN, whether the other states are empty or not and wherever
    it sits (first or last slot), with and without sinks; an empty state's NaN ``o`` is never read. (A merge
    whose maximum skips NaN returned such a row as o = 0, lse = -inf: an empty row.)"""
    st, meta, indptr = _ragged_state(1, 2, [3, 3, 2], 16, gen, empty_frac=0.0)
    st.lse[0, 0, 0, 0:3] = torch.tensor([float("nan"), float("-inf"), float("-inf")])  # NaN + empties
    st.lse[0, 0, 1, 0:3] = torch.tensor([0.5, 1.0, float("nan")])  # NaN last among finite
    st.o[0, 0, 0, 3] = float("nan")  # NaN o of a finite state: that row NaN in every column it weighs
    st.lse[0, 0, :, 6:8] = float("-inf")  # sequence 2 all empty: o never read
    st.o[0, 0, :, 6:8] = float("nan")
    x = _inputs(Case((2, 1), 16, (20,) * 3), gen)
    _, plan = _plan(x, 3)
    for sinks in (None, torch.tensor([0.3, float("-inf")], device=DEVICE)):
        out = poison(torch.empty(3, 1, 2, 16, dtype=torch.float32, device=DEVICE))
        lse = poison(torch.empty(3, 1, 2, device=DEVICE))
        BACKEND.merge(plan, _workspace(st, meta), out, lse, sinks)
        ref_o, ref_lse = reference.merge(st, sinks, indptr=indptr)
        assert torch.isnan(ref_o[0, 0]).all() and torch.isnan(ref_lse[0, 0]).all()
        assert torch.equal(torch.isnan(out.cpu()), torch.isnan(ref_o)), "NaN where the contract has NaN, only there"
        assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse))
        keep = ~torch.isnan(ref_o)
        assert_close_to_reference(out.cpu()[keep], ref_o[keep], torch.float32)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert_close_to_reference(lse[2], ref_lse[2], F32_TOL, what="empty rows' lse")


def test_merge_worked_example():
    """Scores [0, ln2, ln3, ln4] and V [1, 2, 4, 8] in two units merge to 4.9 (averaging the halves would give
    3.976) and lse ln 10 (Flash-Decoding's rescaling to a common log-sum-exp)."""
    def state(scores, values):
        s = torch.tensor(scores, dtype=torch.float64)
        lse = torch.logsumexp(s, 0)
        return (torch.exp(s - lse) * torch.tensor(values, dtype=torch.float64)).sum(), lse

    (oa, la), (ob, lb) = state([0, math.log(2)], [1, 2]), state([math.log(3), math.log(4)], [4, 8])
    o = torch.stack([oa, ob]).float().view(1, 1, 1, 2, 1).expand(1, 1, 1, 2, 16).contiguous().to(DEVICE)
    lse = torch.stack([la, lb]).float().view(1, 1, 1, 2).to(DEVICE)
    x = make_inputs(1, 1, 1, 16, [32], dtype=torch.float32, device=DEVICE)
    _, plan = _plan(x, 2)
    out = poison(torch.empty(1, 1, 1, 16, device=DEVICE))
    out_lse = poison(torch.empty(1, 1, 1, device=DEVICE))
    meta = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    BACKEND.merge(plan, _workspace(PartialState(o, lse), meta), out, out_lse)
    assert torch.allclose(out.cpu(), torch.full((1, 1, 1, 16), 4.9), atol=1e-5)
    assert abs(float(out_lse) - math.log(10)) < 1e-5


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_merge_with_sinks_matches_merge_states(dtype, gen):
    """Sinks join the denominator once, after the merge (against ``merge_states`` with sinks): an all-empty
    row gives o = 0 and lse = its sink; a ``-inf`` sink is no sink (no NaN on an empty row); a ``+inf`` sink
    takes all the weight (o = 0, lse = +inf)."""
    units = [3, 2, 4]
    st, meta, indptr = _ragged_state(2, 4, units, 16, gen)
    x = _inputs(Case((4, 2), 16, (20, 5, 7), q_len=2, dtype=dtype), gen)
    _, plan = _plan(x, 4)
    ws = _workspace(st, meta)
    for sinks in ((torch.randn(4, generator=gen) * 2).to(DEVICE),
                  torch.tensor([float("-inf"), 0.5, float("inf"), -1.0], device=DEVICE)):
        out = poison(torch.empty(3, 2, 4, 16, dtype=DT[dtype], device=DEVICE))
        lse = poison(torch.empty(3, 2, 4, device=DEVICE))
        BACKEND.merge(plan, ws, out, lse, sinks)
        ref_o, ref_lse = reference.merge(st, sinks, indptr=indptr)
        assert_close_to_reference(out, ref_o, DT[dtype])
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
        assert torch.equal(out[0, 0, 0].float(), torch.zeros(16, device=DEVICE)) and lse[0, 0, 0] == sinks[0]


# -- single pass and the public API --------------------------------------------------------------------

SINGLE_CASES = [
    Case((4, 1), 32, (0, 17), page=16, dtype="bf16", tags=("zero-length-lse-sign",)),
    Case((7, 1), 16, (16, 5), q_len=3, dtype="fp16", tags=("group7",)),
    Case((2, 2), 24, (33, 1), page=4, dtype="fp32"),
]


@pytest.mark.parametrize("case", SINGLE_CASES, ids=lambda c: c.id)
def test_single_pass_matches_reference(case, gen):
    """A single-pass plan (no workspace state, no merge): one program per (sequence, KV head), rows straight
    into ``out``/``lse``; the same ``out`` without ``lse``."""
    x = _inputs(case, gen)
    w, plan = _plan(x, 1)
    assert plan.single_pass and plan.merge == "none" and w.workspace.state is None
    assert plan.grid == (len(case.lens) * case.heads[1],)
    out, lse = _poisoned_io(x)
    BACKEND.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    out2, _ = _poisoned_io(x, with_lse=False)
    BACKEND.run(plan, x, w.workspace, out2, None)
    assert torch.equal(out2, out)


DECODE_CASES = [
    Case((4, 1), 16, (0, 17), page=16, dtype="bf16", splits=(0, 1, 3, 8)),
    Case((7, 1), 32, (16, 33), q_len=3, page=4, dtype="fp16", splits=(1, 3)),
    Case((2, 2), 16, (70, 1), dtype="fp32", splits=(3, 12)),
    Case((8, 2), 16, (17,), q_len=3, page=1, dtype="bf16", splits=(2,)),
]


@pytest.mark.parametrize("case,num_splits", _params(DECODE_CASES))
def test_decode_api_matches_reference(case, num_splits, gen):
    """``attnplan.decode(..., backend="numba", num_splits=N)``: out and lse against the reference."""
    x = _inputs(case, gen)
    out, lse = _poisoned_io(x)
    res = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse,
                          backend="numba", num_splits=num_splits)
    assert res is out
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_one_position_returns_v_bitwise(dtype, num_splits, gen):
    """A single visible position has weight exactly 1: out equals v bit for bit (widening and the
    round-to-nearest-even store are exact on values that are already in the dtype)."""
    x = _inputs(Case((4, 2), 16, (1, 1), page=16, dtype=dtype), gen)
    out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="numba",
                          num_splits=num_splits)
    pages = x.block_table[:, 0].long()
    v = x.v_cache[pages, 0]  # [B, Hkv, D]
    assert torch.equal(out[:, 0], v.repeat_interleave(2, dim=1))


def test_plan_with_the_fused_merge_is_refused(gen):
    """numba implements the separate merge only; a plan asking for the fused one is an error, not a silent
    output of unmerged rows."""
    x = _inputs(Case((4, 1), 16, (40,)), gen)
    w, plan = _plan(x, 3)
    with pytest.raises(ValueError, match="fused"):
        BACKEND.partial(dataclasses.replace(plan, merge="fused"), x, w.workspace, *_poisoned_io(x))
    with pytest.raises(ValueError, match="state and meta"):
        BACKEND.merge(plan, dataclasses.replace(w.workspace, meta=None), *_poisoned_io(x))


# -- thread layouts, strides, word views ----------------------------------------------------------------

@pytest.mark.parametrize("lanes", [1, 4, 8])
def test_other_thread_layouts(lanes, gen):
    """Lanes per position 1 (no lane reduction), 4 (head_dim 24 = 6 words over 4 lanes: a partial
    slot) and 8 (one token group per program on the simulator), unit by unit."""
    x = _inputs(Case((4, 1), 24, (29, 6, 40), q_len=2, page=4, dtype="bf16"), gen)
    threads = 8 if not HAS_CUDA else 64
    w, plan = _plan(x, 3, lanes=lanes, threads=threads, unroll=2)
    w.workspace.state.fill_(float("nan"))
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    _check_partial_launch(x, plan, w.workspace, out, lse)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_strided_inputs_and_element_words(dtype, gen):
    """A non-contiguous q, a cache whose strides forbid the 8-byte word view (read element by element),
    ``out``/``lse`` with padded leading strides, ``seq_lens`` with stride 2, a block table with padded rows
    and column stride 2: every stride is honoured (same results as the contiguous tensors)."""
    dt = DT[dtype]
    b, hq, hkv, d, lens = 3, 4, 2, 16, [21, 9, 40]
    base = make_inputs(b, hq, hkv, d, lens, q_len=2, page_size=4, dtype=dt, device=DEVICE, generator=gen)
    q = base.q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Q, H, D] with H-major storage
    pages = base.k_cache.shape[0]
    wide_k = torch.randn(pages, 4, hkv, d + 2, generator=gen).to(dt).to(DEVICE)
    wide_v = torch.randn(pages, 4, hkv, d + 2, generator=gen).to(dt).to(DEVICE)
    k, v = wide_k[..., 1:d + 1], wide_v[..., 1:d + 1]  # storage offset 1, row stride d + 2
    with pytest.raises(RuntimeError):
        k.view(torch.int64)
    lens_strided = torch.zeros(2 * b, dtype=torch.int32, device=DEVICE)[::2]
    lens_strided.copy_(base.seq_lens)
    bt = base.block_table
    table = torch.full((b + 1, 2 * bt.shape[1] + 3), -1, dtype=torch.int32, device=DEVICE)[1:, ::2]
    table[:, :bt.shape[1]] = bt
    table = table[:, :bt.shape[1]]
    assert table.stride() == (2 * bt.shape[1] + 3, 2) and lens_strided.stride() == (2,)
    x = dataclasses.replace(base, q=q, k_cache=k, v_cache=v, seq_lens=lens_strided, block_table=table)
    assert not q.is_contiguous()
    ref, ref_lse = reference.attention(q, k, v, base.seq_lens, bt, base.sm_scale)
    for splits in (1, 3):
        w, plan = _plan(dataclasses.replace(x, seq_lens=base.seq_lens, block_table=bt), splits)
        big = poison(torch.empty(b + 1, 3, hq + 1, d + 4, dtype=dt, device=DEVICE))
        out = big[1:, 1:, :hq, 2:d + 2]
        big_lse = poison(torch.empty(b, 2, 2 * hq + 1, device=DEVICE))
        lse = big_lse[:, :, 1:2 * hq:2]
        BACKEND.run(plan, x, w.workspace, out, lse)
        assert_close_to_reference(out, ref, dt)
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
        assert torch.isnan(big[0].float()).all() and torch.isnan(big[:, 0].float()).all()
        assert torch.isnan(big_lse[:, :, 0]).all() and torch.isnan(big_lse[:, :, 2::2]).all()
    assert any(spec.ew == 1 for spec in kernels._DECODE_CACHE)


# -- 64-bit offsets ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True])
def test_offsets_are_64_bit_in_the_compiled_arithmetic(paged):
    """The kernels' offset functions, compiled by ``numba.njit`` with int32 strides (what the launcher passes
    when each stride fits 32 bits) and int32 indices: products past 2^31 come out exact. The simulator computes
    with Python integers, so this checks the typed arithmetic the GPU compile uses: a head-major cache with a
    head stride of 2^30 and 3 KV heads (head 2 starts at 2^31), a page id past 2^31 / page stride, a position
    past 2^31 / token stride."""
    import numba

    i32 = numpy.int32
    head_base = numba.njit(kernels._make_head_base(paged))
    token_offset = numba.njit(kernels._make_token_offset(paged))
    s0, s1, s2 = i32(2**20), i32(2**12), i32(2**30)
    base = head_base(i32(2), i32(3), s0, s2)
    assert base == 2 * 2**30 + (0 if paged else 3 * 2**20)
    table = numpy.array([[5, 3000, 7]], dtype=numpy.int32)
    if paged:  # position 20 of page size 16: logical page 1 -> physical page 3000, token 4
        got = token_offset(table, 0, i32(20), 4, 4000, s0, s1, base)
        assert got == base + 3000 * 2**20 + 4 * 2**12
    else:
        got = token_offset(table, 0, i32(2**20 + 5), 0, 0, s0, s1, base)
        assert got == base + (2**20 + 5) * 2**12
    assert got > 2**31


@pytest.mark.gpu
def test_gpu_head_major_cache_past_2_31_elements(gen):
    """A head-major contiguous cache view (head stride 2^30, 3 KV heads): head 2's elements lie past 2^31
    (a 32-bit head offset would wrap and read out of bounds)."""
    hkv, d, lens = 3, 64, [700, 333]
    small = make_inputs(2, 6, hkv, d, lens, dtype=torch.bfloat16, device="cuda", generator=gen)
    n = hkv * 2**30
    try:
        k_buf, v_buf = (torch.zeros(n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for two 6 GiB buffers")
    cap = small.k_cache.shape[1]
    k, v = (buf.as_strided((2, cap, hkv, d), (cap * d, d, 2**30, 1)) for buf in (k_buf, v_buf))
    k.copy_(small.k_cache)
    v.copy_(small.v_cache)
    ref, _ = reference.attention(small.q, small.k_cache, small.v_cache, small.seq_lens, None, small.sm_scale)
    for splits in (1, 3):
        out = attnplan.decode(small.q, k, v, small.seq_lens, None, backend="numba", num_splits=splits)
        assert_close_to_reference(out, ref, torch.bfloat16)


# -- NaN isolation --------------------------------------------------------------------------------------------

def _assert_nan_pattern_and_values(out, ref, dtype, what="out"):
    """NaN exactly where the reference has NaN; elsewhere within tolerance."""
    o, r = out.detach().cpu().double(), ref.double()
    assert torch.equal(torch.isnan(o), torch.isnan(r)), \
        f"{what}: NaN at {torch.isnan(o).nonzero()[:6].tolist()}, reference at {torch.isnan(r).nonzero()[:6].tolist()}"
    keep = ~torch.isnan(r)
    assert_close_to_reference(o[keep], r[keep], dtype, what=what)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_in_v_reaches_only_rows_that_see_it(num_splits, gen):
    """q_len 3: NaN in V at the last position of a sequence (seen by query 2 only) and at the one before
    (queries 1 and 2), in one channel of one KV head: exactly those rows' columns are NaN (``0 * NaN`` from a
    position a query cannot see made query 0 NaN before). NaN in K at the last position leaves queries 0 and 1
    exact."""
    x = _inputs(Case((4, 2), 16, (37, 20), q_len=3, page=16, dtype="bf16"), gen)
    page = x.block_table[0, 36 // 16].long()
    x.v_cache[page, 36 % 16, 1, 5] = float("nan")  # position 36: query 2 only
    x.v_cache[page, 35 % 16, 0, 9] = float("nan")  # position 35: queries 1, 2
    page1 = x.block_table[1, 19 // 16].long()
    x.k_cache[page1, 19 % 16, 0, 3] = float("nan")  # sequence 1, position 19: query 2's score only
    w, plan = _plan(x, num_splits)
    out, lse = _poisoned_io(x)
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    BACKEND.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert not torch.isnan(ref[0, 0]).any() and torch.isnan(ref[0, 2, 2:4, 5]).all()
    _assert_nan_pattern_and_values(out, ref, torch.bfloat16)
    _assert_nan_pattern_and_values(lse, ref_lse, F32_TOL, "lse")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_in_v_before_a_later_querys_window(num_splits, gen):
    """Window 4, q_len 3: NaN in V at the window's first position (seen by query 0 only; queries 1 and 2
    start later) leaves queries 1 and 2 exact."""
    x = _inputs(Case((4, 1), 16, (50, 30), q_len=3, dtype="fp16"), gen)
    x = dataclasses.replace(x, window_left=4)
    for b, length in enumerate((50, 30)):
        x.v_cache[b, length - 3 - 4, 0, 2 + b] = float("nan")  # base = L - q_len - window_left
    w, plan = _plan(x, num_splits)
    out, lse = _poisoned_io(x)
    BACKEND.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert torch.isnan(ref[:, 0]).any() and not torch.isnan(ref[:, 1:]).any()
    _assert_nan_pattern_and_values(out, ref, torch.float16)
    _assert_nan_pattern_and_values(lse, ref_lse, F32_TOL, "lse")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_query_gives_nan_rows_not_empty_rows(num_splits, gen):
    """A NaN query head: its rows that see a position are NaN in ``out`` and ``lse`` (single pass, and split
    over units merged by the merge kernel); rows that see nothing stay empty; other heads are exact. (A running
    maximum that skips NaN left ``m = -inf`` and reported such rows as empty: o = 0, lse = -inf.)"""
    x = _inputs(Case((4, 1), 16, (40, 1), q_len=2, dtype="fp32"), gen)
    x.q[:, :, 2] = float("nan")
    w, plan = _plan(x, num_splits)
    out, lse = _poisoned_io(x)
    BACKEND.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = _reference(x)
    assert torch.isnan(ref_lse[0, :, 2]).all() and torch.isneginf(ref_lse[1, 0, 2])
    _assert_nan_pattern_and_values(out, ref, torch.float32)
    _assert_nan_pattern_and_values(lse, ref_lse, F32_TOL, "lse")
    assert torch.isneginf(lse[1, 0, 2]) and torch.equal(out[1, 0, 2], torch.zeros_like(out[1, 0, 2]))


# -- the GPU compile of the kernels, checked on the CPU -----------------------------------------------------
# The simulator runs the kernels as Python and type-checks nothing; numba's NVVM compiles them to PTX for a
# compute capability without a driver, in a process where the simulator is off.

_PTX_SCRIPT = r"""
import os, re, sys
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
import numba, torch
from numba import cuda
import numba.cuda.dispatcher as dispatcher
from numba.cuda.cudadrv.error import NvvmSupportError


class Sm90:
    compute_capability = (9, 0)


dispatcher.get_current_device = lambda: Sm90()  # device functions compile for sm_90 without a driver
from attnplan.backends import get_backend
from attnplan.backends.base import Workspace
from attnplan.config import load_config
from attnplan.device import CPU_STANDIN
from attnplan.planner import make_plan
from attnplan.testing import make_inputs, problem_of
import dataclasses

be = get_backend("numba")
k = be._kernels()
assert not k.SIM
launches = []
be._array = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
be._launch = lambda kern, tag, grid, block, args, device: launches.append((kern, tag, args))


def run(q_len, page, window, sinks, splits, dtype, hq, hkv, d):
    x = make_inputs(2, hq, hkv, d, [40, 7], q_len=q_len, page_size=page, dtype=dtype, capacity=64)
    x = dataclasses.replace(x, window_left=window, sinks=torch.zeros(hq) if sinks else None)
    p = problem_of(x)
    plan = make_plan(p, CPU_STANDIN, load_config(), "numba", be.kernel_config(p, {}, torch.device("cuda")),
                     num_splits=splits)
    be.run(plan, x, Workspace.allocate(plan, "cpu"), torch.empty_like(x.q), torch.empty(x.q.shape[:3]))


run(1, 16, -1, False, 4, torch.bfloat16, 32, 8, 128)  # the common case: must keep its arrays in registers
run(3, 16, 9, True, 3, torch.float16, 8, 2, 64)  # q_len 3: the careful tiles; window, sinks
try:
    for kern, tag, args in launches:
        sig = tuple(numba.typeof(a).copy(layout="A") if isinstance(numba.typeof(a), numba.types.Array)
                    else numba.typeof(a) for a in args)
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
        local = re.findall(r"__local_depot0\[(\d+)\]", ptx)
        print(tag, "local", local[0] if local else 0)
    probe = k.schedule_probe_kernel(256, 2, True)
    i64, i32 = numba.int64, numba.int32
    cuda.compile_ptx(probe.py_func, (i32[:], i32[:], i32[:], i64[:], i64[:, :], i64, i64, i64, i64, i64, i64),
                     cc=(9, 0))
except NvvmSupportError as e:
    print("NO-NVVM", e)
    sys.exit(3)
"""


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the compiled kernels themselves")
def test_gpu_kernels_compile_to_ptx_without_a_gpu():
    """The scheduled kernel (q_len 1, paged bf16; q_len 3 with window and sinks), the merge and the prologue
    probe compile for sm_90 through numba's NVVM (typing the GPU path the simulator never types), and the
    common case keeps its per-row arrays in registers (no local-memory depot: a loop that stops unrolling
    spills the accumulators)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 3 or "NvvmSupportError" in proc.stderr or "libnvvm" in proc.stderr.lower():
        pytest.skip(f"numba's NVVM is not available: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" local ") for line in proc.stdout.splitlines() if " local " in line)
    plain = [t for t in lines if "-q1-paged-" in t and t.startswith("decode-bf16")]
    assert plain and lines[plain[0]] == "0", lines
    assert any(t.startswith("merge-") for t in lines) and any("-q3-" in t for t in lines)


# -- declarations, availability, configuration, compilation ----------------------------------------

def _problem(**kw):
    base = dict(batch=1, num_q_heads=8, num_kv_heads=2, head_dim=128, q_len=1, q_dtype="bfloat16",
                kv_dtype="bfloat16", max_kv_len=1024)
    return DecodeProblem(**{**base, **kw})


def test_supports_gives_reasons():
    be = NumbaBackend()
    assert be.supports(_problem()) == []
    assert be.supports(_problem(head_dim=256, num_q_heads=64, num_kv_heads=1)) == []  # 64 rows: the limit
    assert any("head_dim" in r for r in be.supports(_problem(head_dim=100)))
    assert any("head_dim" in r for r in be.supports(_problem(head_dim=264)))
    # 16 x 5 = 80 rows: served in launches of 4 queries (64 rows); a group of 128 query heads alone in 2 head blocks
    assert be.supports(_problem(num_q_heads=16, num_kv_heads=1, q_len=5)) == []
    assert be.q_block(_problem(num_q_heads=16, num_kv_heads=1, q_len=5)) == 4
    big = _problem(num_q_heads=128, num_kv_heads=1)
    assert be.supports(big) == [] and (be.head_block(big), be.kv_passes(big)) == (64, 2)
    assert be.merge_strategies == {"separate"}


def test_available_reasons():
    be = NumbaBackend()
    ok, why = be.available(torch.device("meta"))
    assert not ok and "meta" in why
    if kernels.SIM:
        ok, why = be.available(torch.device("cuda"))
        assert not ok and "CPU tensors only" in why


def test_supports_declares_the_variants():
    """window, softcap, sinks and fp8_kv are served (an fp8 cache with fp16/bf16 q); others still refused."""
    be = NumbaBackend()
    assert be.variants == {"window", "softcap", "sinks", "fp8_kv"}
    assert be.supports(_problem(window_left=64, soft_cap=30.0, has_sinks=True, kv_dtype="float8_e4m3fn",
                                kv_scale="head")) == []
    big = _problem(num_q_heads=128, num_kv_heads=1, window_left=8)
    assert be.supports(big) == [] and be.head_block(big) == 64


def test_kernel_config():
    be = NumbaBackend()
    if kernels.SIM:
        c = be.kernel_config(_problem(head_dim=32), {}, torch.device("cpu"))
        assert c["block_n"] == 16 and c["threads"] == 8 and c["block_n"] == c["threads"] // c["lanes"] * c["unroll"]
    c = be.kernel_config(_problem(), {"block_n": None, "threads": None}, torch.device("cuda"))
    assert c["threads"] == 256 and c["lanes"] == 16 and c["block_n"] == 16 * c["unroll"]
    c = be.kernel_config(_problem(), {"threads": 128, "block_n": 32}, torch.device("cuda"))
    assert c["threads"] == 128 and c["block_n"] == 32
    # an fp8 cache has 8 codes per word: head_dim 64 is 8 words, so at most 8 lanes per position
    c = be.kernel_config(_problem(head_dim=64, kv_dtype="float8_e4m3fn", kv_scale="head"), {}, torch.device("cuda"))
    assert c["lanes"] == 8


def test_kernels_compile_once_per_specialization(gen):
    x = _inputs(Case((4, 1), 16, (5, 40), dtype="bf16"), gen)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2)
    n = len(kernels._DECODE_CACHE), len(kernels._MERGE_CACHE)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2)
    assert (len(kernels._DECODE_CACHE), len(kernels._MERGE_CACHE)) == n
    spec = next(iter(kernels._DECODE_CACHE))
    assert kernels.decode_kernel(spec) is kernels.decode_kernel(spec)


@pytest.mark.skipif(not kernels.SIM, reason="tests the simulator's Python bit helpers")
def test_bit_conversions_match_torch(gen):
    """The 16-bit widening and the round-to-nearest-even narrowing against torch's conversions,
    including ties, overflow to inf, subnormals, infinities and NaN."""
    vals = torch.cat([torch.randn(2000, generator=gen) * 10 ** torch.randint(-6, 6, (2000,), generator=gen),
                      torch.tensor([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.3895e38,
                                    65520.0, 1e-40, -1e-42, 2 ** -24, 2 ** -25 * 3, float("inf"), float("-inf")])])
    for kind, dt in ((kernels.KIND_BF16, torch.bfloat16), (kernels.KIND_FP16, torch.float16)):
        want = vals.to(dt).view(torch.int16).tolist()
        got = [kernels.f32_to_bits16(float(v), kind) for v in vals.tolist()]
        assert got == want, f"{dt}: first mismatch at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        assert kernels.f32_to_bits16(float("nan"), kind) & 0x7FFF > {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}[dt]
        bits = torch.arange(-32768, 32768, 37, dtype=torch.int16)
        ref = bits.view(dt).float()
        wide = torch.tensor([float(kernels.bits16_to_f32(int(b), kind)) for b in bits.tolist()])
        assert torch.equal(torch.isnan(wide), torch.isnan(ref))
        assert torch.equal(wide[~torch.isnan(ref)], ref[~torch.isnan(ref)])


# -- attention variants ----------------------------------------------------------------------------------
# tests/test_variants.py checks every variant through attnplan.decode; these check the kernels' pieces:
# units' states (window bases, soft cap, fp8 words and single codes), the merge's and the direct rows'
# sinks, the fp8 decoder, and the specialization flags.

def test_fp8_decoder_matches_torch_on_all_256_codes():
    """The kernels' e4m3fn decoder (run in a kernel: compiled on a GPU, simulated on the CPU) against
    torch's conversion for every code: normals, subnormals (exponent 0: m * 2^-9), +-0, +-448, and
    NaN for 0x7F / 0xFF."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(FP8).float()
    got = torch.full((256,), 12345.0)
    with kernels.launch_scope():
        if HAS_CUDA and not kernels.SIM:
            dev_codes, dev_out = codes.cuda(), got.cuda()
            kernels.fp8_decode_kernel()[2, 128](kernels.cuda.as_cuda_array(dev_codes),
                                                kernels.cuda.as_cuda_array(dev_out))
            torch.cuda.synchronize()
            got = dev_out.cpu()
        else:
            kernels.fp8_decode_kernel()[1, 1](kernels.sim_array(codes.numpy()), kernels.sim_array(got.numpy()))
    nan = torch.isnan(want)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))  # -0.0 (0x80) keeps its sign
    assert got[1] == 2.0 ** -9 and got[0x7E] == 448.0


def _variant_inputs(x, *, window=-1, cap=0.0, sinks=None, fp8=None):
    """``x`` with variant fields set (fp8: caches requantized, scales as fp32 [num_kv_heads] tensors)."""
    kw = dict(window_left=window, soft_cap=cap, sinks=sinks)
    if fp8 is not None:
        hkv = x.k_cache.shape[2]
        ks, vs = (torch.full((hkv,), float(f), device=DEVICE) if not isinstance(f, torch.Tensor) else f for f in fp8)
        kw.update(k_cache=(x.k_cache.float() / 4).to(FP8), v_cache=(x.v_cache.float() * 2).to(FP8),
                  k_scale=ks, v_scale=vs)
    return dataclasses.replace(x, **kw)


VARIANT_PARTIAL_CASES = [
    # (case, variant kwargs, splits)
    pytest.param(Case((8, 2), 32, (70, 1, 0, 9), q_len=2, page=16), dict(window=40), 3, id="window40-paged-q2"),
    pytest.param(Case((4, 1), 16, (40, 5), q_len=4), dict(window=2), 4, id="window2-q4-one-unit"),
    pytest.param(Case((7, 1), 32, (45, 1)), dict(cap=5.0), 2, id="softcap5-group7"),
    pytest.param(Case((4, 2), 32, (50, 17, 0), page=16, dtype="bf16"), dict(fp8=(0.05, 2.0)), 3,
                 id="fp8-words-paged"),
    pytest.param(Case((8, 2), 64, (40, 5), q_len=3, page=16, dtype="bf16"), dict(window=21, cap=20.0, fp8=(0.5, 1.5)),
                 3, id="window-softcap-fp8-q3"),
    pytest.param(Case((8, 2), 32, (45, 0, 3), q_len=2, page=16, dtype="bf16"), dict(sinks=True), 3,
                 id="sinks-direct-rows"),
]


@pytest.mark.parametrize("case,variant,num_splits", VARIANT_PARTIAL_CASES)
def test_variant_units_match_reference(case, variant, num_splits, gen):
    """Each unit's state against ``reference.partial`` on the same schedule (window bases included), direct
    rows (sinks applied) against the reference, untouched slots and ``meta`` (:func:`_check_partial_launch`);
    then the merged result."""
    variant = dict(variant)
    sinks = torch.randn(case.heads[0], generator=gen).to(DEVICE) if variant.pop("sinks", False) else None
    x = _variant_inputs(_inputs(case, gen), sinks=sinks, **variant)
    w, plan = _plan(x, num_splits)
    assert plan.num_splits == num_splits and not plan.single_pass
    w.workspace.state.fill_(float("nan"))
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    _check_partial_launch(x, plan, w.workspace, out, lse)
    BACKEND.merge(plan, w.workspace, out, lse, x.sinks)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, x.q.dtype)
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


def test_window_rows_with_nothing_visible_and_unit_bases(gen):
    """Window 2, q_len 4: with length 2, queries 0 and 1 sit before position 0 (o = 0, lse = -inf exactly);
    with length 40 the units start at the window's base 40 - 4 - 2 = 34 and query 3 (position 39) sees
    exactly [37, 39]."""
    x = _variant_inputs(_inputs(Case((4, 1), 16, (2, 40), q_len=4, dtype="fp32"), gen), window=2)
    w, plan = _plan(x, 3)
    assert schedule_units([2, 40], plan.schedule, q_len=4, window_left=2).start.tolist() == [0, 34]
    out, lse = _poisoned_io(x)
    BACKEND.run(plan, x, w.workspace, out, lse)
    assert torch.isneginf(lse[0, :2]).all() and torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    q, k = x.q[1, 3].double().cpu(), x.k_cache[1, 37:40, 0].double().cpu()
    expect = torch.logsumexp((q @ k.T) * x.sm_scale, dim=-1)
    assert torch.allclose(lse[1, 3].double().cpu(), expect, atol=1e-5)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, torch.float32)
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


def test_fp8_cache_read_code_by_code(gen):
    """An fp8 cache whose strides forbid the 8-byte word view (storage offset 1, row stride d + 3) is
    read one ``uint8`` code at a time, and still matches the reference."""
    b, hq, hkv, d, lens = 2, 4, 2, 16, [21, 9]
    base = make_inputs(b, hq, hkv, d, lens, q_len=2, dtype=torch.float16, device=DEVICE, generator=gen)
    wide = [(torch.randn(b, 21, hkv, d + 3, generator=gen) * 3).to(FP8).to(DEVICE) for _ in range(2)]
    k, v = (t[..., 1:d + 1] for t in wide)
    with pytest.raises(RuntimeError):
        k.view(torch.int64)
    ks = torch.tensor([0.5, 1.25], device=DEVICE)
    vs = torch.tensor([2.0, 0.75], device=DEVICE)
    x = dataclasses.replace(base, k_cache=k, v_cache=v, k_scale=ks, v_scale=vs)
    for splits in (1, 3):
        out = poison(torch.empty_like(x.q))
        attnplan.decode(x.q, k, v, x.seq_lens, backend="numba", num_splits=splits, k_scale=ks, v_scale=vs, out=out)
        ref, _ = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale, k_scale=ks, v_scale=vs)
        assert_close_to_reference(out, ref, torch.float16)
    assert any(spec.fp8 and spec.ew == 1 for spec in kernels._DECODE_CACHE)


def test_fp8_without_scales_is_an_error(gen):
    x = _inputs(Case((4, 1), 16, (5,), dtype="bf16"), gen)
    w, plan = _plan(x, 2)
    fp8 = dataclasses.replace(x, k_cache=x.k_cache.to(FP8), v_cache=x.v_cache.to(FP8))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        BACKEND.partial(plan, fp8, w.workspace, *_poisoned_io(x))


def test_single_pass_sinks_and_softcap(gen):
    """Single pass (sinks in the epilogue): a zero-length sequence gives o = 0, lse = sink; others
    match the reference, with and without a soft cap and an lse output; a ``-inf`` sink is no sink and a
    ``+inf`` sink gives o = 0, lse = +inf."""
    x = _inputs(Case((8, 2), 32, (0, 17, 3), q_len=2, page=16, dtype="bf16"), gen)
    w, plan = _plan(x, 1)
    assert plan.single_pass
    for cap, sinks in ((0.0, torch.randn(8, generator=gen).to(DEVICE)), (3.0, torch.randn(8, generator=gen).to(DEVICE)),
                       (0.0, torch.tensor([float("-inf"), float("inf")] * 4, device=DEVICE))):
        xv = _variant_inputs(x, cap=cap, sinks=sinks)
        out, lse = _poisoned_io(x)
        BACKEND.run(plan, xv, w.workspace, out, lse)
        ref, ref_lse = _reference(xv)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
        assert torch.equal(lse[0], sinks.expand(2, 8)) and torch.equal(out[0], torch.zeros_like(out[0]))
        out2, _ = _poisoned_io(x, with_lse=False)
        BACKEND.run(plan, xv, w.workspace, out2, None)
        assert torch.equal(out2, out)


def test_variant_flags_are_specializations(gen):
    """Variants are compile-time flags: a variant-free launch keeps the variant-free kernel, and each
    variant adds its own specialization; sinks reach the scheduled kernel (its direct rows) and the merge."""
    x = _inputs(Case((4, 1), 16, (20, 3), dtype="bf16"), gen)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2)
    plain = {s for s in kernels._DECODE_CACHE if s.head_dim == 16 and s.group == 4 and not s.paged}
    assert any(not (s.window or s.softcap or s.fp8 or s.sinks) and s.sched for s in plain)
    assert all("window" not in s.tag() for s in plain if not s.window)
    sinks = torch.zeros(4, device=DEVICE)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2, window_left=3, sinks=sinks)
    specs = set(kernels._DECODE_CACHE)
    assert any(s.window and s.sinks and s.sched for s in specs)
    assert any(s.sinks for s in kernels._MERGE_CACHE)


# -- simulator thread safety and the scope of numba's patches -----------------------------------------------------
# numba's simulator runs each CUDA thread as a Python thread, so a race between them (a missing barrier,
# or check-then-act on state the simulator fills lazily) only shows when a thread switch lands inside a
# window of a few bytecodes: the shared-array race below failed 3 of 3000 runs of an fp8 variant test
# (max error 0.24). Under a "switch storm" every C call of a simulated thread yields the GIL first, which
# makes such a window likely to be hit.

def _yield_before_c_calls(frame, event, arg):
    if event == "c_call":
        time.sleep(0)  # releases the GIL: another simulated thread runs


@contextlib.contextmanager
def _thread_switch_storm():
    """Simulated threads started inside yield the GIL before every C call (a ``threading`` profile
    hook); Python's switch interval is 1 us. Restores both."""
    old_interval, old_hook = sys.getswitchinterval(), threading.getprofile()
    sys.setswitchinterval(1e-6)
    threading.setprofile(_yield_before_c_calls)
    try:
        yield
    finally:
        threading.setprofile(old_hook)
        sys.setswitchinterval(old_interval)


def _shared_probe(out):
    """Each thread stores its index into two shared arrays, then sums both as every thread sees them."""
    a = cuda.shared.array(32, kernels.numpy.float32)
    b = cuda.shared.array(32, kernels.numpy.float32)
    t = cuda.threadIdx.x
    a[t] = t
    b[t] = 2 * t
    cuda.syncthreads()
    sa = 0.0
    sb = 0.0
    for i in range(cuda.blockDim.x):
        sa += a[i]
        sb += b[i]
    out[cuda.blockIdx.x, t, 0] = sa
    out[cuda.blockIdx.x, t, 1] = sb


@pytest.mark.skipif(not kernels.SIM, reason="numba's simulator only")
def test_simulated_shared_arrays_are_one_per_block_under_thread_switches():
    """Inside ``kernels.launch_scope()`` every thread of a simulated block gets the same
    ``cuda.shared.array`` per call site, even when the block's threads reach the allocations at once.
    (numba-cuda's simulator fills its per-launch {call site: array} dict by an unlocked check-then-insert,
    so two threads could each make their own array; the scope makes it atomic. Without that, this test
    failed 6 runs of 6.)"""
    n = 32
    kern = cuda.jit(_shared_probe)
    want = torch.tensor([n * (n - 1) / 2, n * (n - 1)]).expand(2, n, 2)
    with _thread_switch_storm(), kernels.launch_scope():
        for _ in range(12):
            out = torch.full((2, n, 2), float("nan"))
            kern[2, n](kernels.sim_array(out.numpy()))
            assert torch.equal(out, want)


def test_numba_patches_last_only_as_long_as_a_launch(monkeypatch, gen):
    """Importing the kernels changes nothing outside numba's own state; the simulator's shared-array lock (or,
    on a GPU, ``numpy.row_stack`` where numpy lacks it) is installed inside ``launch_scope()`` only, nested
    and across a real launch, and removed after."""
    if kernels.SIM:
        from numba.cuda.simulator import kernelapi

        assert kernels.SIM_SHARED_RACE_FREE
        original = kernelapi.FakeCUDAShared.array
        assert not getattr(original, "_attnplan_race_free", False), "patched outside a launch"
        with kernels.launch_scope():
            assert getattr(kernelapi.FakeCUDAShared.array, "_attnplan_race_free", False)
            with kernels.launch_scope():
                pass
            assert getattr(kernelapi.FakeCUDAShared.array, "_attnplan_race_free", False), "inner scope removed it"
        assert kernelapi.FakeCUDAShared.array is original
        had_row_stack = "row_stack" in vars(numpy)
        x = _inputs(Case((4, 1), 16, (20,)), gen)
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2)
        assert kernelapi.FakeCUDAShared.array is original
        assert ("row_stack" in vars(numpy)) == had_row_stack  # the simulator compiles nothing: numpy untouched
    else:
        if "row_stack" in vars(numpy):
            monkeypatch.delattr(numpy, "row_stack")
        with kernels.launch_scope():
            assert numpy.row_stack is numpy.vstack
        assert "row_stack" not in vars(numpy)


@pytest.mark.skipif(not kernels.SIM, reason="numba's simulator only")
def test_simulated_decode_is_identical_under_thread_switches(gen):
    """An fp8 cache with per-head scales, bf16 q, GQA group 8, paged, run split (3 units and the merge) and
    single pass 3 times each under a thread-switch storm: every run matches the reference and is bitwise
    identical to the first (a race between simulated threads would make some runs differ; before the
    shared-array fix about half the launches did)."""
    x = make_inputs(1, 8, 1, 32, [40], page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
    ks, vs = (torch.rand(1, generator=gen) + 0.5).float(), (torch.rand(1, generator=gen) + 0.5).float()
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, k_scale=ks, v_scale=vs)
    with _thread_switch_storm():
        for splits in (3, 1):
            first = None
            for _ in range(3):
                out = poison(torch.empty_like(x.q))
                lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
                attnplan.decode(x.q, kc, vc, x.seq_lens, x.block_table, backend="numba", num_splits=splits,
                                out=out, lse=lse, k_scale=ks, v_scale=vs)
                assert_close_to_reference(out, ref, torch.bfloat16)
                assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
                if first is None:
                    first = out.clone(), lse.clone()
                assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"splits {splits}: runs differ"


# -- GPU only ------------------------------------------------------------------------------------------

GPU_CASES = [
    Case((32, 8), 128, (4097, 1, 4096, 0), page=16, dtype="bf16", splits=(0, 1, 7)),
    Case((32, 8), 128, (4097, 16, 17), dtype="bf16", splits=(0, 3)),
    Case((28, 4), 128, (256, 255, 257), page=16, dtype="bf16", splits=(0, 2), tags=("gqa-group-7",)),
    Case((64, 4), 128, (3000, 17), page=16, dtype="bf16", splits=(0, 1), tags=("gqa-group-16",)),
    Case((32, 8), 128, (70, 64, 65, 63), q_len=3, page=64, dtype="fp16", splits=(1, 3)),
    Case((32, 8), 96, (1000,), dtype="fp16", splits=(0, 3), tags=("head-dim-96",)),
    Case((16, 2), 256, (4097,), page=16, dtype="bf16", splits=(0,), tags=("head-dim-256",)),
    Case((32, 8), 128, (4097,), dtype="fp32", splits=(0, 1)),
    Case((8, 1), 128, (131072,), dtype="bf16", splits=(0,), tags=("long",)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,num_splits", _params(GPU_CASES))
def test_gpu_decode_matches_reference(case, num_splits, gen):
    x = _inputs(case, gen)
    out, lse = _poisoned_io(x)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse, backend="numba",
                    num_splits=num_splits)
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_partial_kernel_unit_by_unit(page, gen):
    x = _inputs(Case((32, 8), 128, (4097, 0, 1000), q_len=2, page=page, dtype="bf16"), gen)
    w, plan = _plan(x, 5)
    w.workspace.state.fill_(float("nan"))
    out, lse = _poisoned_io(x)
    BACKEND.partial(plan, x, w.workspace, out, lse)
    _check_partial_launch(x, plan, w.workspace, out, lse)
    BACKEND.merge(plan, w.workspace, out, lse)
    ref, _ = _reference(x)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_batch_65536(gen):
    """A batch of 65,536 short sequences (0-48 tokens) and one of 4,000 under a capacity plan: every program's
    prologue loops over the whole batch; every row is written, and a sample of rows (the long one included)
    equals the reference."""
    batch, page, long_b = 65536, 16, 12345
    lens = torch.randint(0, 49, (batch,), generator=gen)
    x = make_inputs(batch, 1, 1, 64, lens.tolist(), page_size=page, capacity=48, extra_pages=260,
                    dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    used = torch.zeros(x.k_cache.shape[0], dtype=torch.bool, device="cuda")
    used[x.block_table.flatten().long()] = True
    table = torch.zeros(batch, 250, dtype=torch.int32, device="cuda")
    table[:, :3] = x.block_table
    table[long_b] = (~used).nonzero().flatten()[:250].to(torch.int32)
    x.seq_lens[long_b] = 4000
    x = dataclasses.replace(x, block_table=table)
    w, plan = _plan(x, capacity=True)
    out, lse = _poisoned_io(x)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    idx = torch.tensor([0, 1, long_b, batch // 2, batch - 1, *torch.randint(0, batch, (27,), generator=gen).tolist()])
    sub = idx.cuda()
    ref, ref_lse = reference.attention(x.q[sub], x.k_cache, x.v_cache, x.seq_lens[sub], table[sub], x.sm_scale)
    assert_close_to_reference(out[sub], ref, torch.bfloat16)
    assert_close_to_reference(lse[sub], ref_lse, F32_TOL, what="lse")
    assert int(schedule_units(x.seq_lens.cpu(), plan.schedule).units[long_b]) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_cuda_graph_replay_follows_new_lengths(page, gen):
    """Capture once with a capacity plan, change seq_lens in place, replay: equals the reference at the new
    lengths (the schedule is recomputed on the device at every replay), with kernels launched on torch's
    capture stream."""
    cap = 8192
    x = make_inputs(4, 32, 8, 128, [100] * 4, page_size=page, capacity=cap, dtype=torch.bfloat16, device="cuda",
                    generator=gen)
    w = attnplan.DecodeWrapper(backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    for lens in ([100, 3000, 5, 0], [cap, 1, 4097, 100]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _reference(x)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    assert plan.capacity_mode


@pytest.mark.gpu
def test_gpu_run_on_side_stream_allocates_nothing(gen):
    x = _inputs(Case((32, 8), 128, (3000, 50), page=16, dtype="bf16"), gen)
    w = attnplan.DecodeWrapper(backend="numba")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=6)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    s.synchronize()
    assert torch.cuda.memory_allocated() == before
    ref, _ = _reference(x)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert NumbaBackend.compile_times and all(t > 0 for t in NumbaBackend.compile_times.values())


@pytest.mark.gpu
@pytest.mark.parametrize("element_offset", [0, 1], ids=["int64-words", "element-reads"])
def test_gpu_page_offsets_beyond_int32(element_offset, gen):
    """Pages past 131,072 of 16 x 8 x 128 elements, so element offsets exceed 2^31 (and byte offsets
    2^32). With a storage offset of one element the cache cannot be read as 8-byte words and the kernel
    indexes single elements beyond 2^31."""
    hkv, d, ps, lens = 8, 128, 16, [700, 333]
    small = make_inputs(2, 32, hkv, d, lens, page_size=ps, dtype=torch.bfloat16, device="cuda", generator=gen)
    num_pages = 140_000
    n = num_pages * ps * hkv * d
    try:
        k, v = (torch.zeros(n + element_offset, dtype=torch.bfloat16, device="cuda")[element_offset:]
                .view(num_pages, ps, hkv, d) for _ in range(2))
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 9 GB cache")
    table = small.block_table.long() + 131_072 + 5_000  # every page beyond 2^31 elements
    k[table.flatten()] = small.k_cache[small.block_table.long().flatten()]
    v[table.flatten()] = small.v_cache[small.block_table.long().flatten()]
    out = attnplan.decode(small.q, k, v, small.seq_lens, table.to(torch.int32), backend="numba", num_splits=3)
    ref, _ = reference.attention(small.q, small.k_cache, small.v_cache, small.seq_lens, small.block_table,
                                 small.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)


VARIANT_GPU_CASES = [
    pytest.param(Case((32, 8), 128, (4097, 1, 300, 0), page=16, dtype="bf16"), dict(window=1024), (0, 1, 5),
                 id="window1024-paged"),
    pytest.param(Case((64, 8), 128, (3000, 17), q_len=4, dtype="fp16"), dict(window=127, cap=30.0), (0, 3),
                 id="window-softcap-q4"),
    pytest.param(Case((32, 8), 128, (4097, 16, 0), page=16, dtype="bf16"), dict(fp8=(0.05, 2.0), sinks=True),
                 (0, 1, 4), id="fp8-sinks-paged"),
    pytest.param(Case((64, 4), 64, (2048,), dtype="bf16"), dict(fp8=(0.5, 1.5), cap=50.0), (0, 1), id="fp8-softcap-d64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,variant,splits", VARIANT_GPU_CASES)
def test_gpu_variants_match_reference(case, variant, splits, gen):
    """Compiled variant kernels at realistic sizes, through ``attnplan.decode``."""
    x = _inputs(case, gen)
    variant = dict(variant)
    sinks = torch.randn(case.heads[0], generator=gen).cuda() if variant.pop("sinks", False) else None
    xv = _variant_inputs(x, sinks=sinks, **variant)
    for n in splits:
        out, lse = _poisoned_io(x)
        attnplan.decode(xv.q, xv.k_cache, xv.v_cache, xv.seq_lens, xv.block_table, out=out, lse=lse, backend="numba",
                        num_splits=n, window_left=xv.window_left, logits_soft_cap=xv.soft_cap, sinks=sinks,
                        k_scale=xv.k_scale, v_scale=xv.v_scale)
        ref, ref_lse = _reference(xv)
        assert_close_to_reference(out, ref, DT[case.dtype])
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
