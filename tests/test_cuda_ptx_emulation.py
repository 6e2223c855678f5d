"""cuda_ptx kernels executed on the CPU by the host emulation (``backends/cuda_ptx/emulate.py``), against the float64
reference. No GPU: ``decode.cu`` is compiled as C++ with every CUDA thread a fiber, and driven through the backend's
own spec choice, input and workspace checks and ``kernelParams`` packing.

What it checks: the device-side schedule's prologue against :func:`attnplan.schedule.schedule_units` (the probe
entry, hypothesis-drawn lengths, schedules and both targets tables, several scan chunks, a batch of 65,536); the
scheduled partial kernel unit by unit (one-unit sequences written to ``out`` directly with the sink, the others'
states in their ragged workspace slots, ``meta``, slots past the batch's units untouched), the separate merge over
``meta`` and the fused merge (completion counters back at zero, programs run in permuted orders so another program
is last), the conformance tests of every kernel backend (``tests/test_schedule_backends.py``: capacity, live,
forced and batch-invariant plans on long-tailed and padded batches) through the public API; indexing, GQA row
mapping, masks, paging, the online softmax, the in-program warp merge (split-K), the tensor-core path (mode ``mma``:
ldmatrix / mma.sync / movmatrix through simt.h's warp-collective twins), the fp8 e4m3fn decoders and scales, the merge
kernel's teams, NaN isolation (NaN in V rows a query cannot see), 64-bit offsets (views of caches, q and out with
strides past 2**31 elements), and shared-memory races between warps (every emulated launch runs simt.h's race check).
What it cannot: PTX instruction behaviour (the twins implement the PTX ISA's documented fragment layouts; the
device's mma rounding differs), global-memory races and memory ordering between programs running at once (the
emulation runs them one at a time), performance (tests/test_cuda_ptx_gpu.py covers the device).

Modes: ``mma`` = split-K on tensor cores (the default for fp16 / bf16 with head_dim % 16 == 0), ``split_k`` =
split-K on CUDA cores (``mma: false``). Partial ``o`` of the ``mma`` mode is compared at q's dtype tolerance (P is
rounded to q's dtype for the P.V mma, as in FlashAttention-2), with an fp8 cache at fp16's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from attnplan import reference
from attnplan.backends.base import DecodeInputs
from attnplan.config import load_config
from attnplan.device import CPU_STANDIN
from attnplan.planner import FUSED_TEAM_UNITS, make_plan
from attnplan.problem import DecodeProblem, dtype_name
from attnplan.schedule import NUM_TARGETS, Schedule, max_units_bound, schedule_units, slot_unit
from attnplan.state import PartialState, merge_states
from attnplan.testing import (BUCKET_END_TOTALS, FP32_EDGE_CASES, FP32_EDGE_V, TOP_BUCKET_LENGTHS, DecodeCase,
                              assert_close_to_reference, assert_fp32_edge, assert_probe_matches, bucket_schedule,
                              make_inputs, poison, poisoned_workspace, problem_of)

from conftest import full_tier

emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
from attnplan.backends.cuda_ptx import spec as S  # noqa: E402 (after the import check)
pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the host emulation")

CPU = torch.device("cpu")
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn
#: mode -> kernel option mma (split-K either way)
MODES = {"mma": True, "split_k": False}


@pytest.fixture(scope="module")
def be(request):
    b = emulate.EmulatedCudaPtxBackend()
    specs = list(dict.fromkeys(_parametrized_specs(b, full_tier(request.config))))
    # pytest-xdist workers share the build directory (the cache dir set before they start) and each builds every
    # specialization its tests may launch: odd-numbered workers build from the other end, so two workers meet in
    # the middle and load the rest from each other's builds instead of compiling everything twice
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if worker[2:].isdigit() and int(worker[2:]) % 2:
        specs.reverse()
    b.prebuild(specs)  # the parametrized tests' specializations, built in parallel
    return b


# -- helpers ---------------------------------------------------------------------------------------------------

def _plan(be, x, splits, mode="split_k", merge="separate", capacity=None, config=None, **options):
    """A plan for ``x`` (its live lengths, or a cache ``capacity`` in tokens for a capacity plan) with the backend's
    kernel options for ``mode`` (a key of :data:`MODES`, unless ``options`` sets ``mma``), ``splits`` the plan's
    ``num_splits`` (0 = planner), the config's ``split.merge`` = ``merge``."""
    options = {"mma": MODES[mode], **options}
    prob = problem_of(x)
    if capacity:
        prob = dataclasses.replace(prob, max_kv_len=capacity, total_kv_len=capacity * prob.batch, capacity=capacity)
    assert be.supports(prob) == []
    kc = be.kernel_config(prob, options, CPU)
    cfg = config or load_config(split={"merge": merge})
    plan = make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, capacity_mode=bool(capacity), num_splits=splits,
                     merge_strategies=be.merge_strategies, fused_merge_parallelism=be.fused_merge_parallelism,
                     fused_merge_max_chunk=be.fused_merge_max_chunk)
    assert plan.kernel["mma"] == bool(options["mma"]), plan.kernel
    assert be.spec_for("partial", plan).mma == bool(options["mma"])
    return plan


def _workspace(plan):
    """The plan's workspace, poisoned (:func:`attnplan.testing.poisoned_workspace`): unwritten elements show."""
    return poisoned_workspace(plan, CPU)


def _outputs(x):
    return poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], dtype=torch.float32))


def _run(be, x, plan):
    """``plan`` run on ``x`` (partial kernel, then its merge) into poisoned outputs and workspace: ``(out, lse)``."""
    out, lse = _outputs(x)
    be.run(plan, x, _workspace(plan), out, lse)
    return out, lse


def _kw(x):
    return dict(window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale, v_scale=x.v_scale)


def _reference(x):
    return reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sinks=x.sinks,
                               **_kw(x))


def _o_dtype(mode, dtype, fp8=False):
    """Tolerance dtype of partial ``o``: fp32, or on tensor cores the dtype P is rounded to: q's, fp16 with an fp8
    cache."""
    return (torch.float16 if fp8 else dtype) if mode == "mma" else torch.float32


def _check_partial_launch(x, plan, ws, out, lse, o_dtype):
    """After ``partial`` alone (separate merge or single pass): one-unit sequences' rows in ``out`` / ``lse`` equal the
    reference (sink joined) and their workspace slot is untouched; every unit of a longer sequence equals the
    reference's partial state in its slot and its ``out`` rows are untouched; slots past the batch's units are
    untouched; ``meta`` is the host schedule's. Returns the schedule's :class:`~attnplan.schedule.Units`."""
    ref_st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                      plan.schedule, **_kw(x))
    ref_o, ref_lse = _reference(x)
    st = ws.state
    for b in range(x.q.shape[0]):
        lo, hi = int(units.indptr[b]), int(units.indptr[b + 1])  # the reference's states, in sequence order
        f, g = int(units.first[b]), int(units.first[b]) + hi - lo  # the kernel's slots
        if hi - lo == 1:
            assert_close_to_reference(out[b], ref_o[b], x.q.dtype, f"out of one-unit sequence {b}")
            assert_close_to_reference(lse[b], ref_lse[b], torch.float32, f"lse of one-unit sequence {b}")
            if st is not None:
                assert torch.isnan(st.lse[0, :, :, f]).all() and torch.isnan(st.o[0, :, :, f]).all(), \
                    f"one-unit sequence {b} wrote its workspace slot"
        else:
            assert_close_to_reference(st.o[0, :, :, f:g], ref_st.o[0, :, :, lo:hi], o_dtype,
                                      f"o of slots {f}..{g - 1} (sequence {b})")
            assert_close_to_reference(st.lse[0, :, :, f:g], ref_st.lse[0, :, :, lo:hi], torch.float32,
                                      f"lse of slots {f}..{g - 1} (sequence {b})")
            assert torch.isnan(out[b].float()).all() and torch.isnan(lse[b]).all(), \
                f"the partial kernel wrote out rows of sequence {b}"
    if st is not None:
        n = units.num_units
        assert torch.isnan(st.o[0, :, :, n:]).all() and torch.isnan(st.lse[0, :, :, n:]).all(), \
            "a program without a unit wrote its slot"
    if ws.meta is not None:
        bsz = x.q.shape[0]
        assert ws.meta[:bsz].tolist() == units.first.tolist(), "meta: first"
        assert ws.meta[bsz:2 * bsz].tolist() == units.units.tolist(), "meta: units"
    return units


def _run_checked(be, x, plan, mode, fp8=False):
    """``partial`` (checked unit by unit), then the separate merge; ``out`` / ``lse`` against the float64 reference,
    and the reference merge of the kernel's ragged states (states are one format whoever wrote them)."""
    ws = _workspace(plan)
    out, lse = _outputs(x)
    be.partial(plan, x, ws, out, lse)
    units = _check_partial_launch(x, plan, ws, out, lse, _o_dtype(mode, x.q.dtype, fp8))
    if plan.merge == "separate":
        be.merge(plan, ws, out, lse, x.sinks)
        sl = units.slot  # the kernel's slots in sequence order: the ragged layout of indptr
        o2, l2 = merge_states(PartialState(ws.state.o[:, :, :, sl].double(), ws.state.lse[:, :, :, sl].double()),
                              None if x.sinks is None else x.sinks.double(), indptr=units.indptr)
        ref, ref_lse = _reference(x)
        many = units.units >= 2
        tol = torch.float32 if x.q.dtype == torch.float32 and mode != "mma" else x.q.dtype
        assert_close_to_reference(o2[many], ref[many], tol, "merge_states(kernel states)")
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, x.q.dtype, f"out ({plan.schedule.policy}, {plan.merge})")
    assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({plan.schedule.policy}, {plan.merge})")
    return ws, units


def _mma_ok(case) -> bool:
    return case.dtype in ("fp16", "bf16") and case.head_dim % 16 == 0


def _modes(cases, mma=None):
    """``(case, mode)`` params: every case on CUDA cores (``split_k``), and those at indices ``mma`` (default: every
    fp16 / bf16 case with head_dim a multiple of 16) on tensor cores (each emulated specialization is a C++ build of
    ~0.6 s: the subsets keep the file fast while covering both layouts, GQA groups 1 / 4 / 7 / 8, several row groups,
    q_len > 1, head_dim 16-256 and every variant). Params whose id is in :data:`FULL_TIER` are in the full tier, and
    the single pass (split count 1) of those in :data:`SINGLE_FULL_TIER` (:func:`_tiered`)."""
    return [p for i, c in enumerate(cases) for m in MODES
            if m == "split_k" or (m == "mma" and _mma_ok(c) and (mma is None or i in mma))
            for p in _tiered(c, m)]


def _tiered(case, mode) -> list:
    """The params of ``(case, mode)``: one, in the full tier if its id is in :data:`FULL_TIER`; for an id in
    :data:`SINGLE_FULL_TIER`, the case without split count 1 (same id) and its single pass alone in the full tier
    (id ``...-single``)."""
    pid = f"{case.id}-{mode}"
    if pid in SINGLE_FULL_TIER and 1 in case.splits:
        rest = dataclasses.replace(case, splits=tuple(s for s in case.splits if s != 1))
        return [pytest.param(rest, mode, id=pid),
                pytest.param(dataclasses.replace(case, splits=(1,)), mode, id=f"{pid}-single", marks=pytest.mark.full)]
    return [pytest.param(case, mode, id=pid, marks=pytest.mark.full if pid in FULL_TIER else ())]


#: (case, mode) params whose single pass (split count 1) is in the full tier, their other split counts in the default
#: run; the single pass with each one's features runs in other default params (named in the notes)
SINGLE_FULL_TIER = {
    # fp16: the fp16 q_len 5 paged-32 case (both modes); pages of 16 and a partly filled last page: the 4097-token
    # case (both modes); sinks: the window + soft-cap + sinks variant (both modes)
    "fp16-gqa4-8x2-paged16-d64-q1-len1_16_17-split_k", "fp16-gqa4-8x2-paged16-d64-q1-len1_16_17-mma",
    "fp16-gqa4-8x2-paged16-d64-q1-len160_0-sinks-split_k",
    # several row groups on CUDA cores: the q_len 5 case (3 row groups)
    "bf16-gqa16-16x1-contig-d32-q1-len300-split_k",
    # a window on CUDA cores: the window variants (q_len 3 paged; window + soft-cap + sinks)
    "bf16-gqa8-8x1-contig-d128-q1-len270_9-w0-split_k",
    # an fp8 cache: the fp8 contiguous and window + soft-cap + sinks cases (both modes), the 4400-token paged fp8 case
    "fp16-gqa7-7x1-paged16-d64-q1-len140_3-split_k", "fp16-gqa7-7x1-paged16-d64-q1-len140_3-mma",
    # q_len 3 on tensor cores: the q_len 3 window variant, the head_dim 80 case; pages of 4 on tensor cores: the
    # bad-block-table page-4 mma param
    "fp16-gqa1-4x4-paged4-d64-q3-len90_1_0-mma",
    # fp8 on tensor cores: as above; several row groups on tensor cores: the q_len 5 case (2 row groups)
    "bf16-gqa8-8x1-paged16-d128-q3-len1_64_329-mma",
    # an fp8 contiguous cache with window + soft-cap on tensor cores (its split of 3 units in the default run: the only
    # such contiguous case); the single pass with these variants: the fp8 window + soft-cap + sinks mma param (paged)
    "bf16-gqa4-8x2-contig-d128-q3-len261_1-w140-cap2-mma",
}

#: (case, mode) params in the full tier: a variant of paths the default run checks (each note names them); the
#: fixture builds no specialization for them unless the full tier runs
FULL_TIER = {
    # more splits than granules is the schedule's (the split_k param); d32 on tensor cores: every emulated
    # conformance case (fp16 d32 mma), paged 16 among them
    "bf16-gqa4-4x1-paged16-d32-q1-len40-mma",
    # 16 rows on tensor cores (2 n8-tiles): MMA_CASES' fp16 d96 group 8 x q_len 2; d32 on tensor cores: as above
    "bf16-gqa16-16x1-contig-d32-q1-len300-mma",
    # sinks on tensor cores: the window + soft-cap + sinks mma param and the fused merge's mma cases (specializations
    # shared with test_emulated_kernels_match_reference's fp16 paged 16 mma case)
    "fp16-gqa4-8x2-paged16-d64-q1-len160_0-sinks-mma",
}


def _inputs(case, gen, fp8=False, **kw):
    """Inputs of ``case`` with its variants; ``fp8``: the cache in float8_e4m3fn (K / 4, V x 2 before rounding) with
    per-KV-head scales in [0.5, 1.5)."""
    hq, hkv = case.heads
    x0 = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                     dtype=DT[case.dtype], generator=gen, scale=2.0 if case.cap else 1.0, **kw)
    sinks = (torch.randn(hq, generator=gen) * 2).float() if case.sinks else None
    kc, vc, ks, vs = x0.k_cache, x0.v_cache, None, None
    if fp8:
        kc, vc = (kc.float() / 4).to(FP8), (vc.float() * 2).to(FP8)
        ks = (torch.rand(hkv, generator=gen) + 0.5).float()
        vs = (torch.rand(hkv, generator=gen) + 0.5).float()
    return DecodeInputs(x0.q, kc, vc, x0.seq_lens, x0.block_table, x0.sm_scale, window_left=case.window,
                        soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)


Case = functools.partial(DecodeCase, dtype="bf16", splits=(3,))


# -- the device-side schedule: the prologue against schedule_units ------------------------------------------------

#: (q_len, window, KV warps) of the probe specs: 128 threads (2 sequences per thread and chunk), 32 (8), 64 (4)
PROBE_SPECS = [(1, False, 4), (2, True, 1), (3, False, 2), (1, True, 8)]


def _probe_spec(q_len, window, warps):
    return S.make_spec("partial", "float16", 64, 1, q_len, None, num_warps=warps, mma=False, window=window)


def _check_probe(be, spec, lens, sched, probe, q_len=1, window_left=-1, capacity=None):
    """The probe's (b, j, start, end, units, c, first, cb) of the unit in each slot of ``probe`` and ``meta`` equal
    :func:`schedule_units`'s (both with ``capacity``: lengths clamped into ``[0, capacity]``); units past the batch's
    report b = -1 and write nothing else."""
    u = schedule_units(lens, sched, q_len, window_left, capacity)
    res, meta = be.probe(spec, lens, sched, probe, window_left=window_left, capacity=capacity)
    assert_probe_matches(res, meta, u, probe)
    return u


@st.composite
def _schedules(draw):
    granule = draw(st.sampled_from([16, 32, 48]))
    min_c = draw(st.integers(1, 3))
    s_cap = draw(st.integers(2, 9))
    batch = draw(st.one_of(st.integers(1, 70), st.integers(250, 600)))  # <= 32: the one-warp path, longest first
    raw = draw(st.lists(st.integers(0, 40), min_size=NUM_TARGETS, max_size=NUM_TARGETS))
    policy = draw(st.sampled_from(["balanced", "forced", "batch_invariant"]))
    targets = (0, *raw[1:]) if policy == "balanced" else (0,) * NUM_TARGETS
    bound = max(batch, max_units_bound(targets, batch, s_cap)) if policy == "balanced" else batch * s_cap
    long_tail = draw(st.booleans())
    lens = draw(st.lists(st.integers(0, 40 if long_tail else 700), min_size=batch, max_size=batch))
    if long_tail:
        lens[draw(st.integers(0, batch - 1))] = draw(st.integers(200, 3000))
    return Schedule(policy, granule, min_c, s_cap, targets, bound), lens


@pytest.mark.parametrize("q_len,window,warps", PROBE_SPECS, ids=lambda v: str(v))
@given(sl=_schedules(), window_left=st.sampled_from([0, 7, 100]), data=st.data())
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_emulated_prologue_equals_schedule_units(be, q_len, window, warps, sl, window_left, data):
    """The partial kernel's prologue (the probe entry, the spec's own threads: 32 to 256, 1 to 8 sequences per thread
    and chunk) computes exactly :func:`schedule_units`'s integers for every unit and one past the last (a sample of
    them for batches of several chunks): sequence, unit index, token range, units, granules per unit, first slot and
    ``meta``; balanced schedules read both targets tables (long-tailed batches: one long sequence among short ones)."""
    sched, lens = sl
    spec = _probe_spec(q_len, window, warps)
    w = window_left if window else -1
    n = schedule_units(lens, sched, q_len, w).num_units
    probe = list(range(n + 1)) if n <= 64 else sorted({0, n - 1, n, *data.draw(
        st.lists(st.integers(0, n), min_size=8, max_size=8), label="probe units")})
    _check_probe(be, spec, lens, sched, probe, q_len, w)


def test_emulated_prologue_reads_the_long_tailed_table(be):
    """Two batches of the same total work: near-uniform (2 T >= B nb_max) reads targets[0..31], long-tailed reads
    targets[32..63] (here 4x the units): ``c`` and every sequence's units follow the table the host picks."""
    targets = tuple([0] + [4] * 31 + [0] + [16] * 31)
    sched = Schedule("balanced", 16, 1, 64, targets, max_units_bound(targets, 4, 64))
    spec = _probe_spec(1, False, 4)
    uniform = _check_probe(be, spec, [160, 160, 160, 160], sched, range(9))
    tailed = _check_probe(be, spec, [600, 10, 15, 15], sched, range(20))
    assert uniform.granules_per_unit == 10 and tailed.granules_per_unit == 3
    assert int(tailed.units[0]) == 13 > int(uniform.units[0]) == 1


@given(sl=_schedules(), extra=st.integers(0, 90), window=st.integers(0, 60), data=st.data())
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_emulated_prologue_places_units_as_slot_unit(be, sl, extra, window, data):
    """With the grid's slots given (``slots`` = the grid's unit slots bounded by the spread's window, as the partial
    kernel passes them), grid slot s runs unit :func:`slot_unit` ``(s, U, grid, 1, window)`` of a batch of at most 32
    sequences (spread over the first ``min(grid, window)`` slots, or packed), and a larger batch's slot s runs unit s:
    every slot of a grid of up to 64 slots and one past it (a larger grid: its ends and 12 drawn slots), the unit's
    sequence, range and ``meta`` as :func:`schedule_units` gives them."""
    sched, lens = sl
    spec = _probe_spec(1, False, 4)
    u = schedule_units(lens, sched)
    n = u.num_units
    grid = n + extra  # the plan bounds the batch's units by its grid's slots
    kernel_slots = min(grid, window) if window else grid  # the partial kernel's spread_slots bound
    probe = list(range(grid + 1)) if grid <= 64 else sorted({0, grid - 1, grid, *data.draw(
        st.lists(st.integers(0, grid), min_size=12, max_size=12), label="probe slots")})
    res, meta = be.probe(spec, lens, sched, probe, slots=kernel_slots)
    if len(lens) <= 32:
        runs = [slot_unit(p, n, grid, 1, window) if p < grid else -1 for p in probe]
    else:
        runs = [p if p < n else -1 for p in probe]
    assert_probe_matches(res, meta, u, [n if r < 0 else r for r in runs])


def test_emulated_prologue_spreads_within_the_window(be):
    """One batch of 4 sequences (a long one among short ones: 10 units, longest first) in a grid of 40 slots: spread
    over all 40 (window 0: unit j in slot 4 j), over the first 20 (window 20: slot 2 j; slots 20-39 exit), packed
    (window 10: slots 0-9); a batch of 40 sequences ignores the slots (packed, its units in index order)."""
    targets = tuple([0] + [4] * 31 + [0] + [8] * 31)
    sched = Schedule("balanced", 16, 1, 64, targets, 64)
    spec = _probe_spec(1, False, 4)
    lens = [600, 10, 15, 15]
    u = schedule_units(lens, sched)
    assert u.num_units == 10
    for window, step in [(0, 4), (20, 2), (10, 1)]:
        res, meta = be.probe(spec, lens, sched, range(41), slots=min(40, window) if window else 40)
        assert [p for p in range(41) if res[p, 0] >= 0] == [step * j for j in range(10)], window
        runs = [slot_unit(p, 10, 40, 1, window) if p < 40 else -1 for p in range(41)]
        assert_probe_matches(res, meta, u, [10 if r < 0 else r for r in runs])
    big = [16] * 40
    ub = schedule_units(big, sched)
    res, meta = be.probe(spec, big, sched, range(ub.num_units + 1), slots=4 * ub.num_units)
    assert_probe_matches(res, meta, ub, range(ub.num_units + 1))


def test_emulated_prologue_reads_the_bucket_of_the_total(be):
    """Totals at both ends of buckets (``bit_length(T + T // 2)``), in the one-warp path (1 and 3 sequences) and the
    chunked one (40): only ``bucket_of(T)``'s entries (both tables) are ``T`` (units of one granule), every other
    entry 1 (one unit per sequence), so a bucket off by one shows in the unit count."""
    spec = _probe_spec(1, False, 4)
    for total in BUCKET_END_TOTALS:
        sched = bucket_schedule(total, total, 256 + 40)
        for lens in ([16 * total], [16 * (total - total // 2), 0, 16 * (total // 2)],
                     [16 * max(0, total - 39)] + [16] * min(39, total) + [0] * max(0, 39 - total)):
            u = schedule_units(lens, sched)
            assert u.num_units == total + lens.count(0), (total, len(lens))
            _check_probe(be, spec, lens, sched, [0, u.num_units - 1, u.num_units])


def test_emulated_prologue_reads_the_top_buckets(be):
    """Totals at the last buckets' boundary (715,827,882 | 715,827,883 granules) and a total whose ``T + T / 2``
    is past 2^31 (15 sequences of 2^31 - 1 tokens: a negative int to ``__clz``, clamped to bucket 31): only the right
    bucket's targets give 8 units per sequence, every other entry one."""
    spec = _probe_spec(1, False, 4)
    for lens in TOP_BUCKET_LENGTHS:
        total = sum(-(-n // 16) for n in lens)
        sched = bucket_schedule(total, 8 * len(lens), 256 * len(lens))
        u = _check_probe(be, spec, lens, sched, [0, 8 * len(lens) - 1, 8 * len(lens)])
        assert u.units.tolist() == [8] * len(lens), total


@pytest.mark.parametrize("q_len,window,warps", [(1, False, 4), (2, True, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("batch,table", [(6, "c1"), (40, "c1"), (6, "total"), (300, "total")],
                         ids=["one-warp", "chunks", "one-warp-total", "two-chunks-total"])
def test_emulated_prologue_clamps_lengths_into_the_capacity(be, q_len, window, warps, batch, table):
    """Lengths outside ``[0, capacity]`` on the device (one past it, the largest int32, negative, the smallest
    int32) are read clamped into it: every unit's integers and ``meta`` are :func:`schedule_units`'s for the clamped
    lengths, on the one-warp path (batch <= 32) and the general one; unclamped, 2^31 - 1 tokens would overflow the
    batch's 32-bit total and units would start past the cache. Table "c1": units of one granule whatever the total;
    "total" (a constant target): granules per unit ceil(T / target), so the total must be of clamped lengths, and
    at batch 300 in the chunks after the first (a chunk holds at least 256 sequences) as well."""
    cap = 96
    lens = ([cap + 1, 2**31 - 1, -5, 40, -2**31, cap] * 60)[:batch]
    targets = {"c1": tuple([0] + [min(4 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)]),
               "total": (8 if batch <= 32 else 600,) * NUM_TARGETS}[table]
    sched = Schedule("balanced", 16, 1, 4, targets, max_units_bound(targets, batch, 4))
    w = 7 if window else -1
    n = schedule_units(lens, sched, q_len, w, cap).num_units
    probe = list(range(n + 1)) if n <= 64 else list(range(0, n, 7)) + [n - 1, n]
    u = _check_probe(be, _probe_spec(q_len, window, warps), lens, sched, probe, q_len, w, cap)
    assert int(u.end.max()) <= cap and int(u.units[1]) == int(u.units[0]) and int(u.units[2]) == 1
    assert table != "c1" or int(u.units[0]) == 3 or window  # 6 granules in 3 units of 2; a window: one


def test_emulated_prologue_over_many_chunks(be, gen):
    """3,000 sequences with 32 threads (12 chunks of 256): block 0 writes the whole ``meta``; a unit in the middle,
    the last unit and one past it find their sequence; the bucket and ``c`` come from a total of thousands of
    granules (a long sequence among short ones gets many units)."""
    lens = torch.randint(0, 60, (3000,), generator=gen, dtype=torch.int32)
    lens[1234] = 9000
    targets = tuple([0] + [min(3 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)])
    sched = Schedule("balanced", 16, 1, 64, targets, max_units_bound(targets, 3000, 64))
    u = schedule_units(lens, sched)
    assert u.num_units > 3000 and int(u.units[1234]) > 8
    probe = [0, u.num_units - 1, int(u.first[1234]) + 3, int(u.first[2999]), u.num_units]
    _check_probe(be, _probe_spec(2, True, 1), lens.tolist(), sched, probe, 2, 5)


@pytest.mark.parametrize("batch", [32, 33, 64])
@pytest.mark.parametrize("q_len,window,warps", [(1, False, 4), (2, True, 1)], ids=lambda v: str(v))
def test_emulated_prologue_longest_first_up_to_the_limit(be, batch, q_len, window, warps, gen):
    """At the limit of longest-first slots: 32 sequences (the one-warp path) take the slots longest units first, 33
    and 64 (the general path, one chunk, 32 or 128 threads) in index order (the scan). A seeded long-tailed vector
    with empty sequences and ties, far from index order: every slot and one past."""
    lens = (torch.rand(batch, generator=gen) ** 6 * 9000).to(torch.int32)
    lens[torch.rand(batch, generator=gen) < 0.15] = 0
    lens[batch - 1], lens[batch // 2], lens[3] = 9000, 2500, 2500
    targets = (0,) + (40,) * (NUM_TARGETS - 1)
    sched = Schedule("balanced", 16, 1, 16, targets, max_units_bound(targets, batch, 16))
    u = schedule_units(lens.tolist(), sched)
    assert (u.first.tolist() != u.indptr[:-1].tolist()) == (batch <= 32)
    _check_probe(be, _probe_spec(q_len, window, warps), lens.tolist(), sched, list(range(u.num_units + 1)), q_len,
                 -1 if not window else 10**6)


def test_longest_first_batch_is_the_schedules():
    """The kernel's own copy of the batch limit of longest-first slots (schedule.cuh) is the host schedule's."""
    import re
    from pathlib import Path

    import attnplan.backends.cuda_ptx as cp
    from attnplan.schedule import LONGEST_FIRST_BATCH

    text = (Path(cp.__file__).parent / "schedule.cuh").read_text()
    assert int(re.search(r"constexpr int LONGEST_FIRST_BATCH = (\d+);", text).group(1)) == LONGEST_FIRST_BATCH


def test_emulated_prologue_batch_65536(be, gen):
    """A batch of 65,536 (256 chunks of the 256-thread spec): the first, a middle, the last unit and one past;
    ``meta`` over the whole batch."""
    batch = 65536
    lens = torch.randint(0, 3000, (batch,), generator=gen, dtype=torch.int32)
    lens[batch // 2] = 2**20
    targets = tuple([0] + [min(2 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)])
    sched = Schedule("balanced", 64, 1, 128, targets, max_units_bound(targets, batch, 128))
    u = schedule_units(lens, sched)
    probe = [0, int(u.first[batch // 2]) + 7, u.num_units - 1, u.num_units]
    _check_probe(be, _probe_spec(1, False, 8), lens.tolist(), sched, probe)


# -- the scheduled kernel unit by unit -----------------------------------------------------------------------------

CASES = [
    Case((8, 2), 128, (37, 100, 0), splits=(1, 3)),                       # single pass and split, len 0
    Case((8, 2), 64, (1, 16, 17), page=16, dtype="fp16", splits=(1, 4)),  # page boundary
    Case((4, 1), 32, (40,), page=16, splits=(16,)),                       # more splits than granules
    Case((16, 2), 128, (21, 9), q_len=4, page=1, splits=(3,)),             # page 1, q_len 4 (2 row groups)
    Case((7, 1), 96, (400, 3), page=4, dtype="fp32", splits=(2,)),         # group 7, non-pow2 head_dim
    Case((16, 1), 32, (300,), splits=(1, 2)),                              # group 16
    Case((8, 1), 256, (300,), page=64, dtype="bf16", splits=(2,)),         # group 8, head_dim 256, page 64
    Case((8, 2), 128, (21, 4), q_len=5, page=32, dtype="fp16", splits=(1, 3)),  # odd q_len, L < q_len
    Case((4, 4), 16, (90, 3), page=1, dtype="fp32", splits=(1, 3)),         # MHA, head_dim 16
    Case((14, 2), 64, (233,), q_len=2, page=16, splits=(2,)),              # 14 rows
    Case((4, 1), 128, (4097,), page=16, splits=(1, 3)),                     # a few hundred tiles
]  # one unit crosses block-table batches of 32 tiles (copy.cuh, PageWindow): a CUDA-core split-K warp ~129 of
#    8 tokens (5 batches), a tensor-core warp 64-65 (3)

# tensor-core cases beyond CASES: group 1 with q_len 3, head_dim 80 (padded ring rows) with 24 rows in two n8-tiles,
# head_dim 96, 64 rows in 4 row groups of 2 n8-tiles
MMA_CASES = [
    Case((4, 4), 64, (90, 1, 0), q_len=3, page=4, dtype="fp16", splits=(1, 3)),
    Case((8, 1), 80, (377, 5), q_len=3, page=8, splits=(1, 2)),
    Case((8, 1), 96, (245, 2), q_len=2, dtype="fp16", splits=(2,)),
    Case((32, 1), 128, (250, 3), q_len=2, page=16, splits=(2,)),
]

CASE_PARAMS = _modes(CASES) + [p for c in MMA_CASES for p in _tiered(c, "mma")]


@pytest.mark.parametrize("case,mode", CASE_PARAMS)
def test_emulated_kernels_match_reference(be, case, mode, gen):
    """For each forced split count: ``partial`` alone, unit by unit (:func:`_check_partial_launch`), then the separate
    merge; the single pass for 1."""
    x = _inputs(case, gen)
    for splits in case.splits:
        plan = _plan(be, x, splits, mode)
        assert plan.single_pass == (splits == 1)
        _run_checked(be, x, plan, mode)


def test_emulated_two_vectors_per_lane(be, gen):
    """CUDA-core split-K over an fp32 head_dim-256 row: 64 vectors, two per lane (nv 2), one KV warp."""
    assert S.vector_layout("float32", 256)["nv"] == 2
    x = make_inputs(2, 2, 1, 256, [145, 3], q_len=2, page_size=16, dtype=torch.float32, generator=gen)
    _run_checked(be, x, _plan(be, x, 2, num_warps=1), "split_k")


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_capacity_plan_spreads_a_long_sequence(be, mode, gen):
    """A balanced capacity plan (the one a CUDA graph captures) on a long-tailed, padded batch: the long sequence is
    spread over many units, the short ones and the zero-length padding slots get one unit each and are written
    directly; the same plan then serves all-zero and all-full batches."""
    x = make_inputs(6, 4, 1, 32, [900, 5, 0, 0, 40, 1], page_size=16, dtype=torch.bfloat16, generator=gen,
                    capacity=960)
    plan = _plan(be, x, 0, mode, capacity=960)
    assert plan.schedule.policy == "balanced" and any(plan.schedule.targets), plan.explain()
    _, units = _run_checked(be, x, plan, mode)
    assert int(units.units[0]) >= 4 and units.units[1:].tolist() == [1] * 5
    for lens in ([0] * 6, [960] * 6):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        _run_checked(be, x, plan, mode)


def test_emulated_merge_of_reference_states(be, gen):
    """The merge kernel on reference states (another producer) in the ragged workspace, with ``meta`` from the host
    schedule: empty rows, one-unit sequences' rows left untouched, slots past the units poisoned."""
    x = make_inputs(3, 8, 2, 64, [300, 0, 7], q_len=2, page_size=16, dtype=torch.float16, generator=gen)
    plan = _plan(be, x, 5)
    rp, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.schedule)
    assert units.units.tolist()[1:] == [1, 1] and int(units.units[0]) > 1
    ws = _workspace(plan)
    assert units.first.tolist() == [0, units.num_units - 1, units.num_units - 2]  # sequence 2 (cb 1) before 1 (cb 0)
    ws.state.o[:, :, :, units.slot] = rp.o.float()
    ws.state.lse[:, :, :, units.slot] = rp.lse.float()
    ws.meta.copy_(torch.cat([units.first, units.units]).to(torch.int32))
    out, lse = _outputs(x)
    be.merge(plan, ws, out, lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out[:1], ref[:1], torch.float16)
    assert_close_to_reference(lse[:1], ref_lse[:1], torch.float32, "lse")
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all(), "rows of one-unit sequences were written"


def _merge_plan_and_workspace(be, batch, q_len, heads, head_dim, dtype, max_units_per_seq):
    """A separate-merge plan of one KV head whose schedule allows ``max_units_per_seq`` units per sequence (the CPU
    stand-in's 8 SMs), and its workspace (poisoned)."""
    prob = DecodeProblem(batch, heads, 1, head_dim, q_len, 16, dtype_name(dtype), dtype_name(dtype), 64, 64 * batch)
    kc = be.kernel_config(prob, {}, CPU)
    plan = make_plan(prob, CPU_STANDIN, load_config(split={"merge": "separate"}), "cuda_ptx", kc, num_splits=2)
    sched = Schedule("forced", plan.schedule.granule, 1, max_units_per_seq, (0,) * NUM_TARGETS,
                     batch * max_units_per_seq)
    plan = dataclasses.replace(plan, schedule=sched)
    return plan, _workspace(plan)


def _ragged_states(ws, units, gen, pad_nan=True):
    """Random states in the slots of ``units`` (a list): ~30% empty (lse -inf, o NaN: read but never weighed in),
    row (0, 0, 0) wholly empty; ``meta`` written; slots past the units stay NaN. Returns ``indptr``."""
    indptr = torch.zeros(len(units) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor(units), 0)
    n = int(indptr[-1])
    o, ls = ws.state.o, ws.state.lse
    o[..., :n, :] = torch.randn(o[..., :n, :].shape, generator=gen)
    ls[..., :n] = torch.randn(ls[..., :n].shape, generator=gen) * 3
    empty = torch.rand(ls[..., :n].shape, generator=gen) < 0.3
    empty[0, 0, 0, : units[0]] = True
    ls[..., :n][empty] = float("-inf")
    o[..., :n, :][empty] = float("nan")
    b = len(units)
    ws.meta[:b] = indptr[:-1].to(torch.int32)
    ws.meta[b:2 * b] = torch.tensor(units, dtype=torch.int32)
    return indptr


#: (dtype, head_dim, teams): 1 (the single-team path), 2 and 8 teams per CTA; head_dim 64 / 128 (one-warp teams,
#: 16-unit chunks, 64 with half the lanes owning no columns) and 256 (two-warp teams, 8-unit chunks). In bf16 every
#: head_dim alone and with 2 and 8 teams, but for one-warp teams 2 teams at head_dim 64 and 8 at 128 (the other two in
#: the full tier: the same one-warp teams, at the other count); fp16 (only the output's conversion differs: the teams
#: merge fp32 states) at the single team of head_dim 64 / 128 and at 8 two-warp teams, its other teams in the full tier
MERGE_TEAMS = [(dt, d, t) for dt in ("bf16", "fp16") for d in (64, 128, 256) for t in (1, 2, 8)]
MERGE_TEAMS_FULL = {("bf16", 64, 8), ("bf16", 128, 2), ("fp16", 64, 2), ("fp16", 64, 8), ("fp16", 128, 2),
                    ("fp16", 128, 8), ("fp16", 256, 1), ("fp16", 256, 2)}
MERGE_TEAMS_PARAMS = [pytest.param(*m, id=f"{m[0]}-d{m[1]}-t{m[2]}",
                                   marks=pytest.mark.full if m in MERGE_TEAMS_FULL else ()) for m in MERGE_TEAMS]


@pytest.mark.parametrize("dtype,head_dim,teams", MERGE_TEAMS_PARAMS)
def test_emulated_merge_teams_match_reference(be, dtype, head_dim, teams, gen, monkeypatch):
    """The separate merge with ``teams`` teams per CTA (pinned; :meth:`merge_teams_for` chooses it otherwise) over a
    ragged workspace of sequences of 130, 1, 17, 5 and 40 units (one past a chunk, fewer than a chunk, ranges not a
    multiple of a team's, past four 32-lane rounds; 8 teams over 130: the last ones empty), empty states, an all-empty
    row, sinks on every other call, outputs poisoned: rows of sequences of several units against merge_states in
    float64, the one-unit sequence's rows untouched; a second launch gives the same bits (fixed team order)."""
    dt = DT[dtype]
    monkeypatch.setattr(be, "merge_teams_for", lambda plan, device=None: teams)
    units = [130, 1, 17, 5, 40]
    plan, ws = _merge_plan_and_workspace(be, len(units), 2, 2, head_dim, dt, 130)
    indptr = _ragged_states(ws, units, gen)
    for sinks in (None, torch.randn(2, generator=gen) * 2):
        runs = []
        for _ in range(2):
            out = poison(torch.empty(len(units), 2, 2, head_dim, dtype=dt))
            out_lse = poison(torch.empty(len(units), 2, 2))
            be.merge(plan, ws, out, out_lse, sinks)
            runs.append((out, out_lse))
        n = int(indptr[-1])
        ref, ref_lse = merge_states(PartialState(ws.state.o[..., :n, :].double(), ws.state.lse[..., :n].double()),
                                    None if sinks is None else sinks.double(), indptr=indptr)
        (out, out_lse), (out2, out_lse2) = runs
        many = [0, 2, 3, 4]
        what = f"{teams} teams{', sinks' if sinks is not None else ''}"
        assert_close_to_reference(out[many], ref[many], dt, f"out ({what})")
        assert_close_to_reference(out_lse[many], ref_lse[many], torch.float32, f"lse ({what})")
        assert torch.all(out[0, 0, 0] == 0), what  # the all-empty row: o = 0, lse = -inf or the sink
        assert out_lse[0, 0, 0] == (float("-inf") if sinks is None else sinks[0]), what
        assert torch.isnan(out[1].float()).all() and torch.isnan(out_lse[1]).all(), "a one-unit row was merged"
        assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), f"out not deterministic ({what})"
        assert torch.equal(out_lse.view(torch.int32), out_lse2.view(torch.int32)), f"lse not deterministic ({what})"
    assert S.merge_spec(dtype_name(dt), head_dim, teams) in be.kernels  # the pinned teams' kernel ran


def test_emulated_merge_teams_chosen_by_the_backend(be, gen):
    """Unpinned, the backend picks the teams from the plan's rows, its most units per sequence and the SM count
    (spec.merge_teams; the CPU stand-in's 8): 3 rows x 40 units -> 4 teams, against merge_states; 8 rows -> one team."""
    assert be.merge_teams_for(_merge_plan_and_workspace(be, 2, 1, 4, 128, torch.bfloat16, 40)[0]) == 1
    plan, ws = _merge_plan_and_workspace(be, 1, 1, 3, 128, torch.bfloat16, 40)
    assert be.merge_teams_for(plan, CPU) == 4 and be.spec_for("merge", plan).teams == 4
    indptr = _ragged_states(ws, [40], gen)
    out = poison(torch.empty(1, 1, 3, 128, dtype=torch.bfloat16))
    out_lse = poison(torch.empty(1, 1, 3))
    be.merge(plan, ws, out, out_lse)
    ref, ref_lse = merge_states(PartialState(ws.state.o[..., :40, :].double(), ws.state.lse[..., :40].double()),
                                indptr=indptr)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(out_lse, ref_lse, torch.float32, "lse")
    assert S.merge_spec("bfloat16", 128, 4) in be.kernels


@pytest.mark.parametrize("teams", [1, 8])
def test_emulated_merge_nan_state_is_nan_never_an_empty_row(be, teams, gen, monkeypatch):
    """A NaN lse (or o) in a non-empty state makes the row NaN, never an empty row (o = 0, lse = -inf), also when every
    other state of the row is empty; a -inf sink is no sink (an all-empty row stays 0 / -inf, no NaN)."""
    monkeypatch.setattr(be, "merge_teams_for", lambda plan, device=None: teams)
    plan, ws = _merge_plan_and_workspace(be, 3, 1, 4, 64, torch.float16, 40)
    _ragged_states(ws, [40, 3, 2], gen)
    st = ws.state
    st.lse[0, 0, 1, :40] = float("-inf")
    st.lse[0, 0, 1, 33] = float("nan")  # NaN among empty states
    st.lse[0, 0, 2, 5] = float("nan")  # NaN among finite ones
    st.lse[0, 0, 3, 40:43] = float("-inf")  # sequence 1, head 3: every state empty
    st.o[0, 0, 0, 41, 7] = float("nan")  # sequence 1, head 0: NaN in a non-empty state's o
    st.lse[0, 0, 0, 41] = 0.5
    out = poison(torch.empty(3, 1, 4, 64, dtype=torch.float16))
    lse = poison(torch.empty(3, 1, 4))
    be.merge(plan, ws, out, lse, torch.tensor([0.0, 0.0, 0.0, float("-inf")]))
    assert torch.isnan(lse[0, 0, 1]) and torch.isnan(out[0, 0, 1]).all(), "NaN among empty states"
    assert torch.isnan(lse[0, 0, 2]) and torch.isnan(out[0, 0, 2]).all(), "NaN among finite states"
    assert torch.isnan(out[1, 0, 0, 7]) and not torch.isnan(out[1, 0, 0, :7]).any()
    assert torch.isneginf(lse[1, 0, 3]) and torch.all(out[1, 0, 3] == 0), "-inf sink on an empty row"


def test_emulated_worked_merge_example(be):
    """The merge contract's worked example through the merge kernel: scores [0, ln2, ln3, ln4], V = [1, 2, 4, 8] split
    into two units merge to 4.9 (averaging the halves' outputs would give 3.976)."""
    plan, ws = _merge_plan_and_workspace(be, 1, 1, 1, 16, torch.float32, 2)
    s = torch.tensor([0.0, math.log(2), math.log(3), math.log(4)], dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    for i, (sc, vv) in enumerate([(s[:2], v[:2]), (s[2:], v[2:])]):
        ws.state.lse[0, 0, 0, i] = float(torch.logsumexp(sc, 0))
        ws.state.o[0, 0, 0, i, :] = float((torch.softmax(sc, 0) * vv).sum())
    ws.meta.copy_(torch.tensor([0, 2], dtype=torch.int32))
    out = torch.empty(1, 1, 1, 16)
    be.merge(plan, ws, out, None)
    assert torch.allclose(out, torch.full_like(out, 4.9), atol=1e-6)


def test_emulation_reports_reads_outside_the_inputs(be, gen, monkeypatch):
    """A read outside the inputs is reported, not silent: a block-table entry past the cache is clamped to the last
    page (the reference's answer), and with that page left out of the buffers the kernel may read, the emulation
    reports the read."""
    x = make_inputs(1, 4, 1, 64, [20], page_size=16, dtype=torch.bfloat16, generator=gen)
    x.block_table[0, 0] = 0
    x.block_table[0, 1] = x.k_cache.shape[0] + 5
    plan = _plan(be, x, 1)
    _run_checked(be, x, plan, "split_k")
    monkeypatch.setattr(be, "_inputs", lambda x: [x.q, x.k_cache[:-1], x.v_cache[:-1], x.seq_lens, x.block_table])
    with pytest.raises(emulate.EmulationError, match="outside every input buffer"):
        be.partial(plan, x, _workspace(plan), *_outputs(x))


@pytest.mark.parametrize("kv_dtype,mma", [(None, False), ("float8_e4m3fn", False), (None, True), ("float8_e4m3fn", True)])
def test_emulated_constants_match_host(be, kv_dtype, mma):
    spec = S.make_spec("partial", "bfloat16", 96, 7, 4, 16, kv_dtype=kv_dtype, mma=mma)
    k = be.kernel(spec)
    assert (k.constant("smem"), k.constant("tile"), k.constant("threads"), k.constant("rt")) == \
        (spec.smem_bytes, spec.tile_tokens, spec.threads, spec.rows_per_group)
    assert (k.constant("mma"), k.constant("ntw"), k.constant("rs")) == \
        (int(spec.mma), spec.n_tiles, spec.row_chunks)
    if mma:  # 28 rows: 4 n8-tiles in 2 row groups of 16 rows; 12 (fp8: 6) chunks per row, padded to 13 (7)
        assert (spec.row_groups, spec.rows_per_group, spec.n_tiles, spec.row_chunks) == \
            (2, 16, 2, 7 if kv_dtype else 13)
    if not mma:
        assert k.constant("lpt") == S.vector_layout(spec.kv_dtype, 96)["lpt"]


# -- variants ------------------------------------------------------------------------------------------------------

VariantCase = functools.partial(DecodeCase, dtype="bf16", splits=(3,))

VARIANT_CASES = [
    VariantCase((8, 2), 64, (100, 30, 0, 5), q_len=3, page=16, window=20, splits=(1, 3)),   # window, spans pages
    VariantCase((8, 1), 128, (270, 9), window=0, splits=(1, 2)),                           # window 0: only itself
    VariantCase((4, 2), 32, (290,), page=1, dtype="fp32", window=133, splits=(4,)),
    VariantCase((8, 2), 64, (160, 1), q_len=2, cap=2.0, dtype="fp32", splits=(1, 3)),      # soft-cap bites
    VariantCase((8, 2), 64, (160, 0), page=16, sinks=True, dtype="fp16", splits=(1, 3)),    # sinks, empty row
    VariantCase((16, 2), 64, (180, 7), q_len=2, page=4, window=76, cap=5.0, sinks=True, splits=(1, 4)),
    VariantCase((8, 2), 128, (261, 1), q_len=3, cap=2.0, window=140, splits=(1, 3), tags=("tc",)),  # tensor cores
]

VARIANT_PARAMS = [p for p in _modes(VARIANT_CASES) if p.values[1] == "mma" or "tc" not in p.values[0].tags]


@pytest.mark.parametrize("case,mode", VARIANT_PARAMS)
def test_emulated_variants_match_reference(be, case, mode, gen):
    x = _inputs(case, gen)
    for splits in case.splits:
        _run_checked(be, x, _plan(be, x, splits, mode), mode)


FP8_CASES = [
    VariantCase((8, 2), 128, (137, 100, 0), splits=(1, 3)),                          # group 4, contiguous, len 0
    VariantCase((7, 1), 64, (140, 3), page=16, dtype="fp16", splits=(1, 2)),           # group 7, paged, fp16 q
    VariantCase((4, 4), 32, (133, 5), q_len=3, page=1, splits=(2,)),                   # group 1, page 1, q_len 3
    VariantCase((16, 2), 64, (180, 7), q_len=2, page=4, window=76, cap=5.0, sinks=True, splits=(1, 4)),
    VariantCase((8, 2), 256, (150,), page=64, window=120, sinks=True, splits=(3,)),    # head_dim 256
]

# fp8 on tensor cores beyond FP8_CASES (which run there too): group 8 x q_len 3 = 24 rows in two row groups, lengths
# 1 and odd, paged; group 1 with head_dim 80 (5 fp8 chunks per row: the last ldmatrix.x4 reads one twice), fp16 q;
# head_dim 128 with soft-cap + window + q_len 3; 32-token tiles over 16-token pages (2 block-table slots per tile) over
# one unit: a warp's 34-35 tiles use three batches of 32 slots (copy.cuh, PageWindow)
FP8_MMA_CASES = [
    VariantCase((8, 1), 128, (1, 64, 329), q_len=3, page=16, splits=(1, 3)),
    VariantCase((4, 4), 80, (245, 2), dtype="fp16", splits=(2,)),
    VariantCase((8, 2), 128, (261, 1), q_len=3, cap=2.0, window=140, splits=(1, 3)),
    VariantCase((4, 1), 128, (4400, 5), page=16, splits=(1,)),
]

FP8_PARAMS = _modes(FP8_CASES) + [p for c in FP8_MMA_CASES for p in _tiered(c, "mma")]


@pytest.mark.parametrize("case,mode", FP8_PARAMS)
def test_emulated_fp8_kv_matches_reference(be, case, mode, gen):
    """float8_e4m3fn K / V with per-KV-head k_scale / v_scale against the float64 reference (which dequantizes as
    k * k_scale[h], v * v_scale[h]), with window / soft-cap / sinks; CUDA cores (split_k) and tensor cores (mma:
    group 1 / 4 / 7 / 8, q_len 1 / 2 / 3, head_dim 32-256, contiguous and paged, lengths 0 / 1 / odd)."""
    x = _inputs(case, gen, fp8=True)
    for splits in case.splits:
        _run_checked(be, x, _plan(be, x, splits, mode), mode, fp8=True)


def test_emulated_fp8_mma_q_magnitudes(be, gen):
    """bf16 q with an fp8 cache moves to fp16 for the mmas as q x 2^e, one power of two per n8-tile (the tile's largest
    |q| into [2^14, 2^15)): rows of one tile 2^40 apart in magnitude, and tiles at 2^-60 and 2^60 (far outside fp16's
    range) still match the reference; 2^-e rejoins the score scale exactly."""
    case = VariantCase((24, 3), 64, (150, 7), page=16, splits=(1, 2))
    x = _inputs(case, gen, fp8=True)
    e = torch.tensor([-20, 0, 20, -10, 5, 0, 3, 20] + [-60] * 8 + [60] * 8, dtype=torch.float64)
    q = (x.q.double() * torch.exp2(e).view(1, 1, 24, 1)).to(torch.bfloat16)  # powers of two: exact
    assert torch.equal(q.double(), x.q.double() * torch.exp2(e).view(1, 1, 24, 1))
    x = dataclasses.replace(x, q=q)
    for splits in case.splits:
        _run_checked(be, x, _plan(be, x, splits, "mma"), "mma", fp8=True)


def _e4m3fn(code: int) -> float:
    """The value of an e4m3fn byte from its definition (sign, 4-bit exponent bias 7, 3-bit mantissa, subnormals at
    exponent 0, S.1111.111 NaN, no infinities)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_fp8_decoder_all_256_codes(be, mode, gen):
    """Every e4m3fn byte through the kernel's decoder (mma: the integer twin of cvt.rn.f16x2.e4m3x2, the sm_80
    fallback): a sequence of one granule + 1 tokens forced into 2 units, so its second unit holds token G alone, whose
    V row holds all 256 codes in head_dim 256, rotated by h for KV head h (every code at several byte positions of a
    word); that unit's partial state is the row x v_scale[h], exactly (NaN for 0x7f / 0xff). K holds the codes too
    (NaN codes zeroed) and one-hot queries read one code each into the unit's lse."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = torch.tensor([_e4m3fn(c) for c in range(256)], dtype=torch.float64)
    assert torch.equal(codes.view(FP8).to(torch.float64).nan_to_num(7.0), table.nan_to_num(7.0))  # torch agrees
    hkv, group, d = 8, 32, 256  # 8 programs x 32 one-hot rows = 256 K codes
    k_scale = torch.tensor([2.0 ** (h - 4) for h in range(hkv)])
    v_scale = torch.tensor([2.0 ** (3 - h) for h in range(hkv)])

    def inputs(length):
        k = (torch.randn(1, length, hkv, d, generator=gen) / 8).to(FP8)
        v = (torch.randn(1, length, hkv, d, generator=gen) / 8).to(FP8)
        q = torch.zeros(1, 1, hkv * group, d, dtype=torch.bfloat16)
        for h in range(hkv):
            for g in range(group):
                q[0, 0, h * group + g, h * group + g] = 1.0
        return DecodeInputs(q, k, v, torch.tensor([length], dtype=torch.int32), None, 1.0, k_scale=k_scale,
                            v_scale=v_scale)

    granule = _plan(be, inputs(64), 2, mode).schedule.granule
    x = inputs(granule + 1)
    kcodes = codes.clone()
    kcodes[(kcodes & 0x7F) == 0x7F] = 0  # a NaN in K would poison every row's dot product
    x.k_cache[0, granule] = kcodes.view(FP8).view(1, d).expand(hkv, d)
    x.v_cache[0, granule] = torch.stack([codes.roll(h) for h in range(hkv)]).view(FP8)
    plan = _plan(be, x, 2, mode)
    ws = _workspace(plan)
    be.partial(plan, x, ws, *_outputs(x))
    u = schedule_units([granule + 1], plan.schedule)
    assert u.units.tolist() == [2] and u.start.tolist() == [0, granule]
    vtab = torch.stack([table.roll(h) for h in range(hkv)])
    want_o = (vtab * v_scale.double().view(hkv, 1)).repeat_interleave(group, 0)  # [heads, d]
    o = ws.state.o[0, 0, :, 1].double()
    assert torch.equal(torch.isnan(o), torch.isnan(want_o)), "NaN codes"
    assert torch.equal(o.nan_to_num(0.0), want_o.nan_to_num(0.0)), "V decode x v_scale is exact"
    ktab = table.clone()
    ktab[(codes & 0x7F) == 0x7F] = 0.0
    want_lse = ktab * k_scale.double().repeat_interleave(group)  # row h*32+g reads code h*32+g
    assert torch.allclose(ws.state.lse[0, 0, :, 1].double(), want_lse, rtol=1e-6, atol=0)


def _off_grid_params():
    """(granule, mode, fp8): granules 13, 24 and 40 on CUDA cores; on the tensor cores (fp8 too) 13 (off the page
    and the tile) in the default run, 24 and 40 (the same self-aligning, masked tiles at other offsets) in the full
    tier."""
    return [pytest.param(g, m, f, id=f"{g}-{m}-{f}", marks=pytest.mark.full if m == "mma" and g != 13 else ())
            for g in (13, 24, 40) for m, f in (("split_k", False), ("mma", False), ("mma", True))]


@pytest.mark.parametrize("granule,mode,fp8", _off_grid_params())
def test_emulated_units_off_the_tile_grid(be, granule, mode, fp8, gen):
    """Unit boundaries that are not multiples of the tile or the page (a schedule granule of 13, 24 or 40 tokens: the
    kernels take any): tiles self-align and mask (fp8 on tensor cores: 64-token tiles over 8-token pages)."""
    x = make_inputs(2, 8, 2, 64, [100, 41], q_len=2, page_size=8, dtype=torch.float16, generator=gen)
    if fp8:
        x = _inputs(VariantCase((8, 2), 64, (100, 41), q_len=2, page=8, dtype="fp16"), gen, fp8=True)
    plan = _plan(be, x, 2, mode)
    n = -(-100 // granule)
    plan = dataclasses.replace(plan, schedule=Schedule("forced", granule, 1, n, (0,) * NUM_TARGETS, 2 * n))
    _run_checked(be, x, plan, mode, fp8)


@pytest.mark.parametrize("passes,warps,page", [(2, 2, None), (2, 2, 16), (4, 1, 8)])
def test_emulated_mma_larger_warp_tiles_match_reference(be, passes, warps, page, gen):
    """Option ``passes`` (32- / 64-token warp tiles on the tensor cores): units that end inside a tile, pages smaller
    than the tile, an empty sequence."""
    x = make_inputs(3, 8, 2, 64, [350, 0, 37], page_size=page, dtype=torch.bfloat16, generator=gen)
    plan = _plan(be, x, 3, "mma", passes=passes, num_warps=warps)
    assert plan.kernel["passes"] == passes and be.spec_for("partial", plan).passes == passes
    _run_checked(be, x, plan, "mma")


# -- the fused merge (plan.merge fused: no merge kernel) -----------------------------------------------------------
# (mode, case, fp8, kernel options): both modes; an empty sequence, q_len > 1, sinks, both layouts, fp8 on tensor
# cores, window + soft-cap; the merge's row teams: 8 one-warp teams of 4 rows each (group 8 x q_len 4 on CUDA cores:
# 4 row groups x 2 warps), one warp over head_dim 256 (2 slots per thread), group 7 over fp32 head_dim 96
FUSED = [
    ("mma", VariantCase((8, 2), 64, (270, 0, 33), q_len=2, page=16, sinks=True, splits=(5,)), False, {}),
    ("split_k", VariantCase((8, 1), 64, (145, 0, 7), q_len=4, dtype="fp16", splits=(4,)), False, {}),
    ("split_k", VariantCase((4, 1), 256, (133, 0), dtype="fp32", sinks=True, splits=(3,)), False, {"num_warps": 1}),
    ("split_k", VariantCase((7, 1), 96, (140, 0, 3), page=4, dtype="fp32", sinks=True, splits=(3,)), False, {}),
    ("mma", VariantCase((8, 2), 128, (261, 0, 1), q_len=3, page=16, window=140, cap=2.0, sinks=True, splits=(3,)),
     True, {}),
    ("split_k", VariantCase((8, 1), 64, (280, 0, 7), q_len=2, page=4, window=76, splits=(4,)), False, {}),
    # the long sequence last: its units take slots 0.., sequence 0's (fewer granules each) the slots after them
    ("mma", VariantCase((8, 2), 64, (140, 0, 700), page=16, splits=(5,)), False, {}),
]
FUSED_PARAMS = [pytest.param(mode, c, f, o, id=f"{c.id}-{mode}" + ("-kvfp8" if f else "")
                             + "".join(f"-{k}{v}" for k, v in o.items())) for mode, c, f, o in FUSED]


def _run_fused_in_block_orders(be, x, plan):
    """``plan`` (the fused merge) run on ``x`` with the blocks in order and in two permuted orders (so the programs that
    count last differ), each into a fresh poisoned workspace and outputs: every run's counters back at zero, its
    ``out`` / ``lse`` within tolerance of the float64 reference, and all runs bitwise the same. Returns the last
    run's workspace."""
    ref, ref_lse = _reference(x)
    outs = []
    try:
        for order in (0, 1, 2):
            be.block_order = order
            ws = _workspace(plan)
            out, lse = _outputs(x)
            be.run(plan, x, ws, out, lse)
            assert int(ws.counters.abs().sum()) == 0, f"counters not reset: {ws.counters.tolist()}"
            assert_close_to_reference(out, ref, x.q.dtype, f"out (block order {order})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (block order {order})")
            outs.append((out, lse))
    finally:
        be.block_order = 0
    assert all(torch.equal(o, outs[0][0]) and torch.equal(ls, outs[0][1]) for o, ls in outs[1:])
    return ws


@pytest.mark.parametrize("mode,case,fp8,options", FUSED_PARAMS)
def test_emulated_fused_merge_matches_reference(be, mode, case, fp8, options, gen):
    """``run`` with the fused merge inside the partial kernel (one launch) against the float64 reference, blocks in
    order and in two permuted orders (so the program that counts last differs): poisoned ``out`` / ``lse`` fully
    written, the counters back at zero after every launch, the result bitwise the same whichever program merged (unit
    order); the units' states stay in the workspace, the one-unit sequences' slots untouched."""
    x = _inputs(case, gen, fp8=fp8)
    plan = _plan(be, x, case.splits[0], mode, merge="fused", **options)
    assert plan.merge == "fused" and be.spec_for("partial", plan).merge == "fused", plan.explain()
    ws = _run_fused_in_block_orders(be, x, plan)
    rp, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.schedule,
                                  **_kw(x))
    assert int(units.units[0]) > 1 and int(units.units[1]) == 1
    lo, hi = int(units.indptr[0]), int(units.indptr[1])
    f, g = int(units.first[0]), int(units.first[0]) + hi - lo
    assert_close_to_reference(ws.state.o[..., f:g, :], rp.o[..., lo:hi, :], _o_dtype(mode, x.q.dtype, fp8),
                              "partial o (fused workspace)")
    assert_close_to_reference(ws.state.lse[..., f:g], rp.lse[..., lo:hi], torch.float32,
                              "partial lse (fused workspace)")
    for b in range(1, len(case.lens)):  # one-unit sequences (empty or not) write out / lse directly, never a slot
        if int(units.units[b]) == 1:
            u = int(units.first[b])
            assert torch.isnan(ws.state.lse[..., u]).all() and torch.isnan(ws.state.o[..., u, :]).all(), \
                f"one-unit sequence {b} wrote its slot"


# groups of more than FUSED_TEAM_UNITS (16) units: the fused merge's two levels. Two long sequences, the second of
# longer units (longest units first: its slots come first, so the teams' counters must not follow sequence order), a
# team of two warps over head_dim 256 (the named barrier before the team state's lse), tensor cores with q_len 2 and
# sinks (a team of one unit: 16 + 2)
FUSED_TWO_LEVEL = [
    ("split_k", VariantCase((8, 2), 64, (1100, 2700, 5), page=4, splits=(40,)), {}),
    ("split_k", VariantCase((4, 1), 256, (1300, 5), dtype="fp32", sinks=True, splits=(20,)), {"num_warps": 4}),
    ("mma", VariantCase((8, 1), 64, (2200, 33), q_len=2, page=16, sinks=True, splits=(33,)), {}),
]


@pytest.mark.parametrize("mode,case,options", [pytest.param(m, c, o, id=f"{c.id}-{m}") for m, c, o in FUSED_TWO_LEVEL])
def test_emulated_fused_merge_in_two_levels(be, mode, case, options, gen):
    """The fused merge of sequences of more than 16 units (teams of 16, then the teams), blocks in order and in two
    permuted orders: out / lse within tolerance of the reference and bitwise the same whichever programs count last,
    the counters (groups' and teams') back at zero; each team's first slot holds the team's state (the reference
    merge of the team's reference states, no sink), every other slot its unit's state."""
    x = _inputs(case, gen)
    plan = _plan(be, x, case.splits[0], mode, merge="fused", **options)
    assert plan.merge == "fused" and be.spec_for("partial", plan).merge == "fused", plan.explain()
    rp, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.schedule,
                                  **_kw(x))
    long = [b for b in range(len(case.lens)) if int(units.units[b]) > FUSED_TEAM_UNITS]
    assert len(long) == sum(n > 1000 for n in case.lens) and int(units.units[-1]) == 1, units.units.tolist()
    ws = _run_fused_in_block_orders(be, x, plan)
    o_dt = _o_dtype(mode, x.q.dtype)
    for b in long:
        lo, n, f = int(units.indptr[b]), int(units.units[b]), int(units.first[b])
        for j0 in range(0, n, FUSED_TEAM_UNITS):
            nt = min(FUSED_TEAM_UNITS, n - j0)
            team = PartialState(rp.o[..., lo + j0:lo + j0 + nt, :], rp.lse[..., lo + j0:lo + j0 + nt])
            t_o, t_lse = reference.merge(team)  # [1, q_len, heads, D], [1, q_len, heads]
            assert_close_to_reference(ws.state.o[..., f + j0, :], t_o, o_dt, f"team state o ({b}, {j0})")
            assert_close_to_reference(ws.state.lse[..., f + j0], t_lse, torch.float32, f"team state lse ({b}, {j0})")
            rest = slice(f + j0 + 1, f + j0 + nt)
            assert_close_to_reference(ws.state.o[..., rest, :], rp.o[..., lo + j0 + 1:lo + j0 + nt, :], o_dt,
                                      f"unit states o ({b}, {j0})")
            assert_close_to_reference(ws.state.lse[..., rest], rp.lse[..., lo + j0 + 1:lo + j0 + nt], torch.float32,
                                      f"unit states lse ({b}, {j0})")


def test_emulated_fused_merge_with_a_counter_not_at_zero(be, gen):
    """A fused merge whose counter did not start at zero has no last program (at units[b]: every count is past it):
    that group's rows stay unwritten, the others are merged (and one-unit sequences written directly)."""
    mode, case, _, _ = FUSED[0]
    x = _inputs(case, gen)
    plan = _plan(be, x, case.splits[0], mode, merge="fused")
    units = schedule_units(x.seq_lens.tolist(), plan.schedule, x.q.shape[1])
    ws = _workspace(plan)
    ws.counters[1] = int(units.units[0])  # (sequence 0, KV head 1): query heads 4-7
    out, lse = _outputs(x)
    be.run(plan, x, ws, out, lse)
    assert torch.isnan(out[0, :, 4:8]).all() and not torch.isnan(out[0, :, :4]).any()
    assert not torch.isnan(out[1:]).any()
    assert ws.counters.tolist() == [0, 2 * int(units.units[0])] + [0] * (plan.sync_words - 2)


# -- the conformance tests of every kernel backend, on the emulation through the public API -------------------------

@pytest.fixture
def api_backend(be, monkeypatch):
    """``attnplan.DecodeWrapper(backend="cuda_ptx")`` runs the emulated backend on CPU tensors (plan, prepare,
    Workspace.allocate, run: the public path)."""
    from attnplan import backends

    monkeypatch.setitem(backends._instances, "cuda_ptx", be)
    return "cuda_ptx"


import test_schedule_backends as conformance  # noqa: E402


@pytest.mark.parametrize("case", [pytest.param(c, id=conformance._ids(c), marks=pytest.mark.full if c[3] >= 0 or c[4]
                                               else ()) for c in conformance.CASES])
@pytest.mark.parametrize("mode", ["capacity", pytest.param("live", marks=pytest.mark.full),
                                  pytest.param("forced3", marks=pytest.mark.full), "invariant"])
def test_emulated_schedule_conformance(api_backend, mode, case, gen):
    """tests/test_schedule_backends.py's conformance on the emulation: capacity plans (balanced targets) and the
    batch-invariant schedule of the long-tailed, padded and uniform batches in the default run; in the full tier
    live plans (the same balanced-targets kernel path as a capacity plan, at the live lengths' targets), forced
    counts (what every test_emulated_kernels_match_reference case launches) and the window / soft-cap cases (the
    same prologue; the variants' kernels: test_emulated_variants_match_reference and the fused merge's cases)."""
    conformance.test_schedule_matches_reference(api_backend, mode, case, gen)


@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_emulated_capacity_plan_replays_changing_lengths(api_backend, merge, gen):
    conformance.test_capacity_plan_replays_changing_lengths(api_backend, merge, gen)


def test_emulated_batch_invariant_outputs(api_backend, gen):
    conformance.test_batch_invariant_outputs_are_bitwise_independent_of_batchmates(api_backend, gen)


def test_emulated_programs_without_a_unit_write_nothing(api_backend, gen):
    conformance.test_programs_without_a_unit_write_nothing(api_backend, gen)


def test_emulated_threads_decode_at_once(api_backend, gen):
    """tests/test_backends.py's decode from several threads at once on the emulation: its launches run one at a
    time (the harness keeps a launch's state in globals, and ctypes releases the GIL: two launches at once crashed
    the process) and each thread's launch reads its own inputs."""
    import test_backends

    test_backends.test_threads_decode_on_one_backend_at_once(api_backend, gen)


# -- hostile inputs: NaN isolation, strides, 64-bit offsets ----------------------------------------------------------

def _nan_in_v(x, positions):
    """NaN in V column 5 of KV head 0 at the given (sequence, position) pairs (through the block table if paged)."""
    for b, pos in positions:
        if x.paged:
            page = x.k_cache.shape[1]
            x.v_cache[int(x.block_table[b, pos // page]), pos % page, 0, 5] = float("nan")
        else:
            x.v_cache[b, pos, 0, 5] = float("nan")


def _nan_cases():
    """Every (kernel path, split count) with one (q_len, window) pair in the default run: each path meets the window
    (single pass on two paths, split on the other two) and one of q_len 2 and 3 without it; the other pairs in the
    full tier (the same path at another query count or window)."""
    pairs = [(2, -1), (3, -1), (3, 20)]
    paths = [("split_k", False), ("mma", False), ("mma", True), ("split_k", True)]
    out = []
    for i, (mode, fp8) in enumerate(paths):
        for splits in (1, 3):
            windowed = splits == (1 if i % 2 == 0 else 3)
            chosen = (3, 20) if windowed else (2, -1) if i < 2 else (3, -1)
            for q_len, window in pairs:
                full = (q_len, window) != chosen
                out.append(pytest.param(q_len, window, mode, fp8, splits,
                                        id=f"{splits}-{mode}-{'fp8' if fp8 else 'bf16'}-q{q_len}-w{window}",
                                        marks=pytest.mark.full if full else ()))
    return out


@pytest.mark.parametrize("q_len,window,mode,fp8,splits", _nan_cases())
def test_emulated_nan_in_v_reaches_only_rows_that_see_it(be, q_len, window, mode, fp8, splits, gen):
    """NaN in V at a sequence's last position (query 0 cannot see it; with q_len 2 it made query 0 NaN) and just before
    the last query's window (earlier queries see it, the last does not): exactly the reference's NaN (the column of
    the rows that see it), every other element within tolerance; single pass and split, separate merge."""
    # a row group holds rows of several queries on every path: GQA group 4 (the specializations of the bf16 variant
    # and bad-block-table tests), 2 with an fp8 cache (fp8 CUDA cores: 4 rows per warp)
    case = VariantCase((4, 2) if fp8 else (8, 2), 64, (137, 90), q_len=q_len, page=16, window=window, dtype="bf16")
    x = _inputs(case, gen, fp8=fp8)
    pos = [(b, L - 1) for b, L in enumerate(case.lens)]
    if window >= 0:
        pos += [(b, L - q_len - window) for b, L in enumerate(case.lens)]
    _nan_in_v(x, pos)
    ref, ref_lse = _reference(x)
    assert torch.isnan(ref).any() and not torch.isnan(ref[:, 0]).all()
    plan = _plan(be, x, splits, mode)
    out, lse = _run(be, x, plan)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), \
        f"NaN at {torch.isnan(out).nonzero()[:4].tolist()}, reference at {torch.isnan(ref).nonzero()[:4].tolist()}"
    assert_close_to_reference(out.float().nan_to_num(0.0), ref.nan_to_num(0.0), x.q.dtype)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_non_finite_scores_give_nan_rows_never_empty_rows(be, mode, splits, gen):
    """Rows whose visible scores hold a NaN: a NaN query head (sequence 0), NaN in K at a sequence's only visible
    position (sequence 1, length 1), +inf in q against K = 0 (inf x 0, sequence 2). Each such row is NaN in out and
    lse, exactly where the reference's is, never written as an empty row (o = 0, lse = -inf: a running maximum that
    drops NaN left m at -inf); every other row within tolerance. Single pass and split (separate merge)."""
    x = make_inputs(3, 8, 2, 64, [40, 1, 30], page_size=16, dtype=torch.bfloat16, generator=gen)
    x.q[0, 0, 2] = float("nan")
    x.k_cache[int(x.block_table[1, 0]), 0, 1, 7] = float("nan")  # KV head 1: query heads 4-7 of sequence 1
    page = int(x.block_table[2, 0])
    x.k_cache[page, :, 0] = 0.0  # KV head 0's K of sequence 2's first page zero ...
    x.q[2, 0, 1, 3] = float("inf")  # ... and query head 1 (KV head 0) sees inf x 0 there
    ref, ref_lse = _reference(x)
    assert torch.isnan(ref_lse[0, 0, 2]) and torch.isnan(ref_lse[1, 0, 4:]).all() and torch.isnan(ref_lse[2, 0, 1])
    plan = _plan(be, x, splits, mode)
    out, lse = _run(be, x, plan)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), \
        f"NaN lse at {torch.isnan(lse).nonzero().tolist()}, reference at {torch.isnan(ref_lse).nonzero().tolist()}"
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close_to_reference(out.float().nan_to_num(0.0), ref.nan_to_num(0.0), x.q.dtype)
    assert_close_to_reference(lse.nan_to_num(0.0), ref_lse.nan_to_num(0.0), torch.float32, "lse")


@pytest.mark.parametrize("mode,fp8", [("split_k", False), ("split_k", True), ("mma", False), ("mma", True)])
def test_emulated_large_legal_scales_do_not_overflow_q(be, mode, fp8, gen):
    """A score scale near the largest legal one (sm_scale 2e38, or an fp8 k_scale of 2e38 with sm_scale 1) over K = 0:
    every score is 0 (the softmax is the mean of V); and sm_scale 1e38 over K ~ 1e-37 (scores ~10). Scaling q before
    the dot product overflowed to inf (inf x 0 = NaN, or the row dropped as empty)."""
    for sm, k_scale, kmag in ((2e38, 1.0, 0.0), (1.0, 2e38, 0.0), (1e38, 1.0, 1e-37)):
        if k_scale != 1.0 and not fp8:
            continue
        x = make_inputs(2, 4, 1, 64, [40, 9], page_size=16, dtype=torch.bfloat16, generator=gen)
        kc = x.k_cache.float() * kmag
        vc, ks, vs = x.v_cache, None, None
        if fp8:
            kc, vc = (kc * 1e37 if kmag else kc).to(FP8), x.v_cache.to(FP8)  # fp8 holds no 1e-37: K x 1e37, sm / 1e37
            sm = sm / 1e37 if kmag else sm
            ks, vs = torch.full((1,), k_scale), torch.ones(1)
        else:
            kc = kc.to(x.k_cache.dtype)
        x = dataclasses.replace(x, k_cache=kc, v_cache=vc, sm_scale=sm, k_scale=ks, v_scale=vs)
        ref, ref_lse = _reference(x)
        assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all()
        for splits in (1, 3):
            plan = _plan(be, x, splits, mode)
            out, lse = _run(be, x, plan)
            assert_close_to_reference(out, ref, x.q.dtype, f"out at sm_scale {sm:g}, k_scale {k_scale:g}")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse at sm_scale {sm:g}, k_scale {k_scale:g}")


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_scores_and_values_at_the_edge_of_the_fp32_range(be, mode, gen):
    """The fp32 domain the README states (tests/test_backends.py's test of it, on the specializations of the test
    above): scaled scores of ~1e38-2e38 in magnitude, of one sign or both in a row, and equal weights over positive V
    up to 3.3e38 / 40 give the reference; scores of -3e38 to -4e38 (past the domain) the documented empty row."""
    for sm, lo, hi in FP32_EDGE_CASES:
        x = make_inputs(2, 4, 1, 64, [40, 9], page_size=16, dtype=torch.bfloat16, generator=gen)
        q, kc = torch.zeros_like(x.q), x.k_cache
        if lo is not None:
            q[..., 0] = 1.0
            kc = torch.zeros_like(x.k_cache)
            kc[..., 0] = (lo + (hi - lo) * torch.rand(kc.shape[:-1], generator=gen)).to(kc.dtype)
        vc = ((0.9 + 0.1 * x.v_cache.float().abs().clamp(max=1.0)) * FP32_EDGE_V).to(x.v_cache.dtype)
        x = dataclasses.replace(x, q=q, k_cache=kc, v_cache=vc, sm_scale=sm)
        ref, ref_lse = _reference(x)
        assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all()
        for splits in (1, 3):
            plan = _plan(be, x, splits, mode)
            out, lse = _run(be, x, plan)
            assert_fp32_edge(out, lse, ref, ref_lse, lo, x.q.dtype, f"sm_scale {sm:g}, q.k in [{lo}, {hi}), "
                                                                    f"{splits} splits")


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_nan_outside_the_rows_ranges_is_never_read(be, mode, gen):
    """NaN in K and V everywhere a row cannot see that the kernels may still touch: past each length in the last page,
    and in the unused pages; every output exact (q_len 2, split and single pass)."""
    x = make_inputs(3, 4, 1, 64, [37, 100, 5], q_len=2, page_size=16, dtype=torch.bfloat16, generator=gen)
    used = set()
    for b, n in enumerate(x.seq_lens.tolist()):
        pages = x.block_table[b, : -(-n // 16)].tolist()
        used |= set(pages)
        if n % 16:
            x.k_cache[pages[-1], n % 16:] = float("nan")
            x.v_cache[pages[-1], n % 16:] = float("nan")
    for p in set(range(x.k_cache.shape[0])) - used:
        x.k_cache[p] = float("nan")
        x.v_cache[p] = float("nan")
    for splits in (1, 3):
        _run_checked(be, x, _plan(be, x, splits, mode), mode)


def _head_major(t: torch.Tensor, head_stride: int) -> torch.Tensor:
    """``t`` ``[P, T, H, D]`` as a view with head stride ``head_stride`` elements (head h's rows start at h x
    head_stride) over a buffer of ``(H - 1) x head_stride + P T D`` elements: virtual memory the test writes only
    where the view's elements are."""
    p, tk, h, d = t.shape
    buf = torch.empty((h - 1) * head_stride + p * tk * d, dtype=t.dtype)
    view = buf.as_strided(t.shape, (tk * d, d, head_stride, 1))
    view.copy_(t)
    return view


@pytest.mark.parametrize("page,mode", [(16, "mma"), (None, "split_k"), (None, "mma")])
def test_emulated_head_major_cache_with_head_stride_2_30(be, page, mode, gen):
    """A head-major fp8 cache view (head stride 2**30 elements, 3 KV heads: head 2 starts past 2**31), as a cache pool
    with heads outermost: the head offset h x head stride is a 64-bit product (a 32-bit one would read head 0's rows
    for head 2, or fault); outputs against the float64 reference, single pass and split."""
    x0 = make_inputs(2, 12, 3, 64, [70, 33], page_size=page, dtype=torch.bfloat16, generator=gen)
    kc, vc = (_head_major(c.float().mul(0.5).to(FP8), 2**30) for c in (x0.k_cache, x0.v_cache))
    assert kc.stride(2) == 2**30 and 2 * kc.stride(2) >= 2**31
    x = DecodeInputs(x0.q, kc, vc, x0.seq_lens, x0.block_table, x0.sm_scale, k_scale=torch.ones(3),
                     v_scale=torch.full((3,), 0.5))
    for splits in (1, 2):
        _run_checked(be, x, _plan(be, x, splits, mode), mode, fp8=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_q_and_out_with_strides_past_2_31(be, splits, gen):
    """q and out as views whose batch stride is 2**31 + 64 elements (sequence 1 past 2**31 in both; lse's batch stride
    2**20 + 4): read and written through 64-bit products; the separate merge writes out through the same strides."""
    x0 = make_inputs(2, 4, 1, 64, [140, 33], page_size=16, dtype=torch.bfloat16, generator=gen)

    def strided(t, stride0, fill=None):
        buf = torch.empty(stride0 + t[0].numel(), dtype=t.dtype)
        v = buf.as_strided(t.shape, (stride0, *t.stride()[1:]))
        v.copy_(t) if fill is None else v.fill_(fill)
        return v

    q = strided(x0.q, 2**31 + 64)
    x = dataclasses.replace(x0, q=q)
    plan = _plan(be, x, splits)
    out = strided(torch.empty_like(x0.q), 2**31 + 64, float("nan"))
    lse = strided(torch.empty(x0.q.shape[:3]), 2**20 + 4, float("nan"))
    be.run(plan, x, _workspace(plan), out, lse)
    ref, ref_lse = reference.attention(x0.q, x0.k_cache, x0.v_cache, x0.seq_lens, x0.block_table, x0.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_emulated_out_rows_off_the_vector_grid(be, merge, gen):
    """out with leading strides that are not multiples of 4 elements (rows of a [.., 8, 65]-strided buffer): the merges
    write such rows element by element; an aligned out keeps the vector stores (same values)."""
    x = make_inputs(2, 8, 2, 64, [140, 33], q_len=2, dtype=torch.float16, generator=gen)
    plan = _plan(be, x, 3, merge=merge)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    buf = torch.full((2, 2, 8, 65), float("nan"), dtype=torch.float16)
    out = buf[..., 1:]
    assert out.stride() == (1040, 520, 65, 1)
    lse = poison(torch.empty(2, 2, 8))
    be.run(plan, x, _workspace(plan), out, lse)
    assert_close_to_reference(out, ref, torch.float16)
    assert torch.isnan(buf[..., 0]).all(), "a store ran past a row's start"


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_window_wider_than_the_cache(be, mode, gen):
    """A sliding window at least the cache's capacity, up to 10**30 (any int the input validation allows), sees every
    position: outputs, lse and partial states equal the float64 reference without a window (the packing caps the
    window at the capacity; a window just below it does restrict, and matches the reference with that window).
    (Group 4 x q_len 3: the windowed specializations of test_emulated_variants_match_reference.)"""
    x0 = make_inputs(2, 4, 1, 64, [90, 33], q_len=3, page_size=16, dtype=torch.bfloat16, generator=gen)
    capacity = x0.block_table.shape[1] * 16
    assert capacity == 96
    for window in (capacity - 40, capacity, capacity + 1, 2**31, 10**30):
        x = dataclasses.replace(x0, window_left=window)
        ref_window = window if window < capacity else -1  # the reference cannot take 10**30 (int64 positions)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                           window_left=ref_window)
        for splits in (1, 3):
            plan = _plan(be, x, splits, mode)
            assert be.spec_for("partial", plan).window
            out, lse = _run(be, x, plan)
            assert_close_to_reference(out, ref, torch.bfloat16, f"out (window {window}, splits {splits})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (window {window}, splits {splits})")


def _fp8_cache_past_2_31(layout, lens, gen, hkv=1, d=128, page=16):
    """K and V caches in float8_e4m3fn (1 byte per element, so 2**31 elements are 2 GB of virtual memory the test never
    touches but where it writes) whose used tokens lie beyond element 2**31: paged, the sequences' pages are the last
    ones of a cache of 2**31 / page stride + their count + 2 pages, in a scrambled order; contiguous, the sequence stride is 2**31 + 128
    elements. Returns (k_cache, v_cache, block_table or None)."""
    caches = []
    if layout == "paged":
        per_page = page * hkv * d
        pages_per_seq = -(-max(lens) // page)
        num_pages = 2**31 // per_page + len(lens) * pages_per_seq + 2
        ids = torch.tensor([num_pages - 1 - ((i * 5) % (len(lens) * pages_per_seq)) for i in
                            range(len(lens) * pages_per_seq)], dtype=torch.int32).view(len(lens), pages_per_seq)
        assert int(ids.min()) * per_page > 2**31
        for scale in (0.25, 2.0):
            c = torch.empty(num_pages, page, hkv, d, dtype=FP8)
            c[ids.flatten().long()] = (torch.randn(ids.numel(), page, hkv, d, generator=gen) * scale).to(FP8)
            caches.append(c)
        return caches[0], caches[1], ids
    stride0, cap = 2**31 + 128, max(lens)
    for scale in (0.25, 2.0):
        buf = torch.empty(stride0 * (len(lens) - 1) + cap * hkv * d, dtype=FP8)
        c = buf.as_strided((len(lens), cap, hkv, d), (stride0, hkv * d, d, 1))
        for b in range(len(lens)):
            c[b] = (torch.randn(cap, hkv, d, generator=gen) * scale).to(FP8)
        caches.append(c)
    return caches[0], caches[1], None


@pytest.mark.parametrize("layout,mode", [("paged", "mma"), ("paged", "split_k"), ("contig", "mma")])
def test_emulated_offsets_past_2_31_elements(be, layout, mode, gen):
    """Cache offsets beyond 2**31 elements, formed in 64 bits by the kernel: page index x page stride (pages past index
    2**20 of 2048-element pages) or sequence x sequence stride (2**31 + 128); a 32-bit product would read another page
    or sequence (or fault, which the emulation reports). Partial states and outputs against the float64 reference,
    single pass and split."""
    lens = [140, 23]
    kc, vc, bt = _fp8_cache_past_2_31(layout, lens, gen)
    q = torch.randn(2, 1, 4, 128, generator=gen).to(torch.bfloat16)  # group 4: FP8_CASES' specializations
    ks = (torch.rand(1, generator=gen) + 0.5).float()
    vs = (torch.rand(1, generator=gen) + 0.5).float()
    x = DecodeInputs(q, kc, vc, torch.tensor(lens, dtype=torch.int32), bt, 128 ** -0.5, k_scale=ks, v_scale=vs)
    for splits in (1, 2):
        _run_checked(be, x, _plan(be, x, splits, mode), mode, fp8=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_block_table_rows_of_a_wider_table(be, mode, gen):
    """A block table whose rows are the first columns of a wider table (row stride 11 > 4 pages per sequence, the
    columns past them poisoned with out-of-range page ids) is read through its row stride; the same table's transposed
    storage (column stride > 1) and a strided seq_lens are refused naming the argument."""
    x0 = make_inputs(3, 4, 1, 64, [50, 0, 33], page_size=16, dtype=torch.float16, generator=gen)
    wide = torch.full((3, 11), 10**6, dtype=torch.int32)  # poison: a read of it would take the last page (clamped)
    wide[:, :4] = x0.block_table
    bt = wide[:, :4]
    assert bt.stride() == (11, 1)
    x = dataclasses.replace(x0, block_table=bt)
    for splits in (1, 3):
        _run_checked(be, x, _plan(be, x, splits, mode), mode)
    plan = _plan(be, x, 3, mode)
    ws = _workspace(plan)
    with pytest.raises(ValueError, match="block_table"):
        be.partial(plan, dataclasses.replace(x, block_table=x0.block_table.t().contiguous().t()), ws, *_outputs(x))
    with pytest.raises(ValueError, match="seq_lens"):
        be.partial(plan, dataclasses.replace(x, seq_lens=torch.stack([x.seq_lens, x.seq_lens], 1)[:, 0]), ws,
                   *_outputs(x))


#: (mode, page, head_dim, fp8, merge) of the bad-entry test: every block-table read path of copy.cuh, the window of 32
#: entries (PageWindow: a tile in one page, or on the tensor cores PAGE_REG's pages of a tile) and the per-chunk loads
#: (load_pages: pages smaller than a CUDA-core tile, or than a tensor-core copy round's rows)
BAD_TABLE = [
    ("split_k", 16, 64, False, "separate"),  # CUDA cores, 16-token pages over 8-token tiles: the window
    ("split_k", 4, 64, False, "separate"),   # CUDA cores, 4-token pages: per-chunk loads
    ("mma", 16, 128, False, "separate"),     # tensor cores, a 16-token tile in one page: the window
    ("mma", 4, 64, False, "separate"),       # tensor cores, 8 pages per 32-token tile (PAGE_REG): the window
    ("mma", 1, 128, False, "separate"),      # tensor cores, 1-token pages: per-chunk loads
    ("mma", 16, 128, True, "separate"),      # fp8 on tensor cores, 2 pages per 32-token tile (PAGE_REG)
    ("mma", 16, 64, False, "fused"),         # 2 pages per 32-token tile (PAGE_REG)
    ("split_k", 4, 64, False, "fused"),      # per-chunk loads
]


def _bad_table_inputs(page, head_dim, fp8, gen):
    """Inputs whose block table holds out-of-range entries in slots the sequences use (negative, -2**31, num_pages,
    past it, 2**31 - 1; the first, a middle and the last used slot) and in unused slots past the lengths."""
    case = VariantCase((4, 1), head_dim, (150, 37, 0), q_len=2, page=page)
    x = _inputs(case, gen, fp8=fp8)
    num_pages = x.k_cache.shape[0]
    bt = x.block_table.clone()
    last0, last1 = -(-150 // page) - 1, -(-37 // page) - 1
    bt[0, 0], bt[0, last0 // 2], bt[0, last0] = -1, num_pages, -2**31
    bt[1, 0], bt[1, last1 // 2], bt[1, last1] = 2**31 - 1, -7, num_pages + 5
    bt[1, last1 + 1:] = -3  # unused slots of sequence 1 and every slot of the empty sequence 2
    bt[2] = 2**31 - 1
    return dataclasses.replace(x, block_table=bt)


#: BAD_TABLE separate-merge entries whose single pass is in the full tier (id ``...-single``; their split of 3 units
#: stays in the default run): the single pass and the partial kernel read the block table through the same copy.cuh
#: paths, and the single pass meets bad entries on both modes' windows (the page-16 entries)
BAD_SINGLE_FULL = {("split_k", 4, 64, False), ("mma", 4, 64, False), ("mma", 1, 128, False), ("mma", 16, 128, True)}


def _bad_params():
    """``(mode, page, head_dim, fp8, merge, splits)`` of every BAD_TABLE entry: the fused merge at 3 units, the
    separate one at 1 and 3 (1 in the full tier for :data:`BAD_SINGLE_FULL`)."""
    out = []
    for m, p, d, f, g in BAD_TABLE:
        pid = f"{m}-page{p}-d{d}{'-kvfp8' if f else ''}-{g}"
        if g == "fused":
            out.append(pytest.param(m, p, d, f, g, (3,), id=pid))
        elif (m, p, d, f) in BAD_SINGLE_FULL:
            out += [pytest.param(m, p, d, f, g, (3,), id=pid),
                    pytest.param(m, p, d, f, g, (1,), id=f"{pid}-single", marks=pytest.mark.full)]
        else:
            out.append(pytest.param(m, p, d, f, g, (1, 3), id=pid))
    return out


BAD_PARAMS = _bad_params()


@pytest.mark.parametrize("mode,page,head_dim,fp8,merge,splits", BAD_PARAMS)
def test_emulated_bad_block_table_entries_read_a_clamped_page(be, mode, page, head_dim, fp8, merge, splits, gen):
    """Block-table entries outside [0, num_pages) in used slots: every page index the kernels load is clamped into
    [0, last_page] (negative -> page 0, too large -> the last page), as the reference clamps them, so the single pass,
    the partial kernel's units and states, the separate and the fused merge equal the reference on the same table, and
    nothing is read outside the cache (the emulation checks every cp.async and __ldg against the inputs). The bad
    entries matter: the reference on the table with them replaced by valid pages differs."""
    x = _bad_table_inputs(page, head_dim, fp8, gen)
    num_pages = x.k_cache.shape[0]
    clamped = x.block_table.clamp(0, num_pages - 1)
    assert not torch.equal(clamped, x.block_table)
    ref, _ = _reference(x)
    assert torch.equal(ref, _reference(dataclasses.replace(x, block_table=clamped))[0])
    other, _ = _reference(dataclasses.replace(x, block_table=torch.where(x.block_table < 0, num_pages - 1,
                                                                         torch.where(x.block_table >= num_pages, 0,
                                                                                     x.block_table))))
    assert not torch.allclose(ref[:2].float(), other[:2].float()), "the bad entries do not change the output"
    if merge == "fused":
        plan = _plan(be, x, 3, mode, merge="fused")
        assert plan.merge == "fused" and be.spec_for("partial", plan).merge == "fused"
        ws = _workspace(plan)
        out, lse = _outputs(x)
        be.run(plan, x, ws, out, lse)
        assert int(ws.counters.abs().sum()) == 0
        ref, ref_lse = _reference(x)
        assert_close_to_reference(out, ref, x.q.dtype, "out (fused merge)")
        assert_close_to_reference(lse, ref_lse, torch.float32, "lse (fused merge)")
        return
    for n in splits:
        plan = _plan(be, x, n, mode)
        spec = be.spec_for("partial", plan)
        assert spec.mma == (mode == "mma") and spec.page_size == page
        _run_checked(be, x, plan, mode, fp8=fp8)


# -- the specializations the parametrized tests build (in parallel, once) -----------------------------------------------

# -- the builds: one compiler run per specialization, the precompiled standard headers -----------------------------

def test_concurrent_builders_of_one_specialization_run_the_compiler_once(tmp_path, monkeypatch):
    """Four threads (as well as pytest-xdist workers sharing the build directory) that need the same specialization
    at once: one runs the compiler, the others wait for its shared object and load it."""
    import subprocess
    import threading

    builds, run = [], subprocess.run

    def counting_run(cmd, *a, **kw):
        if str(emulate._EMU_DIR / "harness.cpp") in cmd:
            builds.append(cmd)
        return run(cmd, *a, **kw)

    monkeypatch.setattr(emulate.subprocess, "run", counting_run)
    spec, start, kernels = S.merge_spec("float16", 32, 1), threading.Barrier(4), []

    def build():
        start.wait()
        kernels.append(emulate.EmulatedKernel(spec, tmp_path))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(kernels) == 4 and len(builds) == 1
    sos = list((tmp_path / "emulation").glob("*.so"))
    assert len(sos) == 1 and sos[0].name.startswith(f"{spec.name}-")
    assert not list((tmp_path / "emulation").glob("*.tmp"))
    assert all(k.constant("threads") == kernels[0].constant("threads") > 0 for k in kernels)


def _functions(asm: str) -> dict[str, str]:
    """Each function of GCC's assembly ``asm`` by name, its local labels renumbered in order of appearance."""
    import re

    out = {}
    for m in re.finditer(r"^(\S+):\n(.*?)^\t\.size\t\1, \.-\1$", asm, re.M | re.S):
        labels: dict[str, str] = {}
        out[m[1]] = re.sub(r"\.L\w+", lambda k: labels.setdefault(k[0], f".L{len(labels)}"), m[2])
    return out


@pytest.mark.parametrize("spec", [S.make_spec("partial", "bfloat16", 128, 4, 2, None, num_warps=4, mma=True, window=True),
                                  # the same -include on the merge kernel's build
                                  pytest.param(S.merge_spec("float16", 64, 2), marks=pytest.mark.full)],
                         ids=lambda s: s.name)
def test_precompiled_standard_headers_are_used_and_change_no_function(spec, tmp_path, monkeypatch):
    """The builds' ``-include`` of the precompiled standard headers: an emulation build passes it, GCC loads the
    ``.gch`` (``-H`` marks it ``!``), and every function of the kernel's assembly is the one a build without it makes
    (only their order differs)."""
    import subprocess

    cxx = emulate.compiler()
    if "GCC" not in subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout + \
            subprocess.run([cxx, "-v"], capture_output=True, text=True).stderr:
        pytest.skip("precompiled headers are built for GCC")
    header = emulate._std_header(cxx, tmp_path)
    assert header is not None and header.with_name(header.name + ".gch").is_file()
    cmd = [cxx, *emulate._FLAGS, *(o for o in spec.options() if o.startswith("-D")), "-S",
           str(emulate._EMU_DIR / "harness.cpp"), "-o", "-"]
    plain = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = subprocess.run([*cmd, "-H", "-include", str(header)], capture_output=True, text=True, check=True)
    assert f"! {header}.gch" in r.stderr.splitlines()
    ours, theirs = _functions(r.stdout), _functions(plain)
    assert len(theirs) > 50 and ours == theirs
    cmds, real = [], subprocess.run
    monkeypatch.setattr(emulate.subprocess, "run", lambda c, *a, **k: cmds.append(list(c)) or real(c, *a, **k))
    emulate.EmulatedKernel(spec, tmp_path / "builds")  # the emulation's own build of the spec
    build = [c for c in cmds if str(emulate._EMU_DIR / "harness.cpp") in c and "-shared" in c]
    assert len(build) == 1 and "-include" in build[0], cmds
    assert build[0][build[0].index("-include") + 1].startswith(str(tmp_path / "builds"))


def _parametrized_specs(be, full: bool = True) -> list:
    """Every specialization the case-parametrized tests launch (same inputs and plans as the tests); without ``full``
    not those of parameters in the full tier (they build their own when it runs them)."""
    g = torch.Generator().manual_seed(0)
    specs = [_probe_spec(*p) for p in PROBE_SPECS]
    specs = [dataclasses.replace(s, probe=True) for s in specs]
    for params, fp8 in ((CASE_PARAMS, False), (VARIANT_PARAMS, False), (FP8_PARAMS, True)):
        for param in params:
            if not full and any(m.name == "full" for m in param.marks):
                continue
            case, mode = param.values
            x = _inputs(case, g, fp8)
            for splits in case.splits:
                plan = _plan(be, x, splits, mode)
                specs.append(be.spec_for("partial", plan))
                if plan.merge == "separate":
                    specs.append(be.spec_for("merge", plan))
    for mode, case, fp8, options in FUSED:
        x = _inputs(case, g, fp8)
        specs.append(be.spec_for("partial", _plan(be, x, case.splits[0], mode, merge="fused", **options)))
    for mode, case, options in FUSED_TWO_LEVEL:
        x = _inputs(case, g)
        specs.append(be.spec_for("partial", _plan(be, x, case.splits[0], mode, merge="fused", **options)))
    specs += [S.merge_spec(dtype_name(DT[dt]), d, t) for dt, d, t in MERGE_TEAMS
              if full or (dt, d, t) not in MERGE_TEAMS_FULL]
    for param in BAD_PARAMS:
        if not full and any(m.name == "full" for m in param.marks):
            continue
        mode, page, head_dim, fp8, merge, bad_splits = param.values
        x = _bad_table_inputs(page, head_dim, fp8, g)
        for splits in bad_splits:
            plan = _plan(be, x, splits, mode, merge=merge)
            specs.append(be.spec_for("partial", plan))
            if plan.merge == "separate":
                specs.append(be.spec_for("merge", plan))
    return specs
