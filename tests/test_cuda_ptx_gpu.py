"""cuda_ptx on a CUDA GPU against the float64 reference (skipped without CUDA).

Covers the device-side schedule on the device (the prologue's integers against
:func:`attnplan.schedule.schedule_units` at batches up to 70,001, one-unit sequences written directly, the others'
units in the ragged workspace, ``meta``), contiguous and paged caches (page 1, 16, 64), GQA groups 1, 3, 4, 7, 8, 16,
q_len 1, 2, 4 and 5, lengths 0, 1, page boundaries and 4097, fp16 / bf16 / fp32, forced split counts (more than the
granules included), capacity plans on long-tailed batches, the separate and the fused merge (programs racing on the
device, counters back at zero, bitwise reruns), CUDA-graph replay after in-place ``seq_lens`` / block-table rewrites,
launches on a side stream without allocation, 64-bit page and head offsets, out-of-range block-table entries (clamped:
the reference's answer, no fault), NaN isolation, fp8 e4m3fn KV caches with per-KV-head scales (window / soft-cap /
sinks; split-K on tensor cores by default and on CUDA cores as mode ``core``) and the fp8 decoders on all 256 codes.
Outputs and workspaces are NaN-poisoned before every run.

Tensor cores: split-K runs the ``mma.sync`` path by default for fp16 / bf16 with head_dim % 16 == 0 (the public
API's cases); mode ``core`` forces the CUDA-core split-K kernel (kernel option ``mma: false``, planned through the
backend directly) on the same cases, and :func:`test_mma_and_core_agree` compares the two kernels' partial states.
Partial ``o`` of the tensor-core kernel carries P's rounding to q's dtype (as in FlashAttention-2 / Triton's
``tl.dot``), so it is compared at q's dtype tolerance; ``lse`` at fp32's. fp8 KV caches run on the tensor cores too
(fp16 mmas), so their partial ``o`` is compared at fp16's tolerance.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends.base import DecodeInputs
from attnplan.config import load_config
from attnplan.schedule import NUM_TARGETS, Schedule, max_units_bound, schedule_units, slot_unit
from attnplan.state import PartialState, merge_states
from attnplan.testing import (DecodeCase, assert_close_to_reference, assert_probe_matches, make_inputs, poison,
                              poisoned_workspace)

pytestmark = pytest.mark.gpu
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn
#: ``split_k``: the public API (tensor cores where they serve); ``core``: the CUDA-core split-K kernel
MODES = ("split_k", "core")
CUDA = torch.device("cuda")


def _backend():
    from attnplan.backends import get_backend

    be = get_backend("cuda_ptx")
    ok, why = be.available(CUDA)
    if not ok:
        pytest.skip(why)
    return be


def _direct_plan(be, x, splits, merge="separate", capacity=None, **options):
    """A plan for ``x`` on this device with the backend's kernel options ``options`` (e.g. ``mma``), bypassing the
    public API (whose config has no ``mma`` key) and the plan cache; ``capacity`` (tokens): a capacity plan."""
    from attnplan.device import device_info
    from attnplan.planner import make_plan
    from attnplan.testing import problem_of

    prob = problem_of(x)
    if capacity:
        prob = dataclasses.replace(prob, max_kv_len=capacity, total_kv_len=capacity * prob.batch, capacity=capacity)
    kc = be.kernel_config(prob, options, x.q.device)
    plan = make_plan(prob, device_info(x.q.device), load_config(split={"merge": merge}), "cuda_ptx", kc,
                     capacity_mode=bool(capacity), num_splits=splits, merge_strategies=be.merge_strategies,
                     fused_merge_parallelism=be.fused_merge_parallelism,
                     fused_merge_max_chunk=be.fused_merge_max_chunk)
    be.prepare(plan, x.q.device)
    return plan


def _workspace(plan):
    """The plan's workspace, poisoned (:func:`attnplan.testing.poisoned_workspace`): unwritten elements show."""
    return poisoned_workspace(plan, CUDA)


def _outputs(x):
    return poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))


def _kw(x):
    return dict(window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale, v_scale=x.v_scale)


def _reference(x):
    return reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sinks=x.sinks,
                               **_kw(x))


def _o_dtype(be, plan, x):
    """Tolerance dtype of partial ``o``: on tensor cores the dtype P is rounded to (q's; fp16 with an fp8 cache),
    else fp32."""
    if not be.spec_for("partial", plan, x.q.device).mma:
        return torch.float32
    return torch.float16 if x.k_cache.dtype == FP8 else x.q.dtype


def _check_partial_launch(be, x, plan, ws, out, lse):
    """After ``partial`` alone (separate merge or single pass): one-unit sequences' rows in ``out`` / ``lse`` equal the
    reference (sink joined), their workspace slot untouched; every unit of a longer sequence equals the reference's
    partial state in its slot, its ``out`` rows untouched; slots past the batch's units untouched; ``meta`` is the
    host schedule's. Returns the schedule's Units."""
    torch.cuda.synchronize()
    ref_st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                      plan.schedule, **_kw(x))
    ref_o, ref_lse = _reference(x)
    st = ws.state
    o_dt = _o_dtype(be, plan, x)
    for b in range(x.q.shape[0]):
        lo, hi = int(units.indptr[b]), int(units.indptr[b + 1])  # the reference's states, in sequence order
        f, g = int(units.first[b]), int(units.first[b]) + hi - lo  # the kernel's slots
        if hi - lo == 1:
            assert_close_to_reference(out[b], ref_o[b], x.q.dtype, f"out of one-unit sequence {b}")
            assert_close_to_reference(lse[b], ref_lse[b], torch.float32, f"lse of one-unit sequence {b}")
            if st is not None:
                assert torch.isnan(st.lse[0, :, :, f]).all(), f"one-unit sequence {b} wrote its workspace slot"
        else:
            assert_close_to_reference(st.o[0, :, :, f:g], ref_st.o[0, :, :, lo:hi], o_dt, f"o of sequence {b}")
            assert_close_to_reference(st.lse[0, :, :, f:g], ref_st.lse[0, :, :, lo:hi], torch.float32,
                                      f"lse of sequence {b}")
            assert torch.isnan(out[b].float()).all(), f"the partial kernel wrote out rows of sequence {b}"
    if st is not None:
        n = units.num_units
        assert torch.isnan(st.lse[0, :, :, n:]).all(), "a program without a unit wrote its slot"
    if ws.meta is not None:
        bsz = x.q.shape[0]
        assert ws.meta[:bsz].tolist() == units.first.tolist()
        assert ws.meta[bsz:2 * bsz].tolist() == units.units.tolist()
    return units


def _run_checked(be, x, plan):
    """``partial`` (checked unit by unit), then the separate merge; out / lse against the reference."""
    ws = _workspace(plan)
    out, lse = _outputs(x)
    be.partial(plan, x, ws, out, lse)
    units = _check_partial_launch(be, x, plan, ws, out, lse)
    if plan.merge == "separate":
        be.merge(plan, ws, out, lse, x.sinks)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, x.q.dtype, f"out ({plan.schedule.policy}, {plan.merge})")
    assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({plan.schedule.policy}, {plan.merge})")
    return ws, units


Case = functools.partial(DecodeCase, dtype="bf16", splits=(0,))


# -- the device-side schedule on the device ---------------------------------------------------------------------

@pytest.mark.parametrize("warps", [1, 4, 8])
def test_prologue_equals_schedule_units(warps, gen):
    """The prologue on the device (32, 128, 256 threads) against schedule_units: random batches of 1-700 sequences
    (1-32: one warp schedules them) with long tails, balanced (both targets tables), forced and batch-invariant
    schedules, window or not; every unit of the small batches and a sample of the large, ``meta``; and where the
    grid has more slots than units (up to 32 sequences: spread over the grid or the spread's window, else packed),
    the unit each grid slot runs, :func:`slot_unit`'s."""
    from attnplan.backends.cuda_ptx.spec import make_spec

    be = _backend()
    for window in (False, True):
        spec = make_spec("partial", "float16", 64, 1, 2, None, num_warps=warps, mma=False, window=window)
        for it in range(12):
            batch = int(torch.randint(1, 40 if it % 2 else 700, (1,), generator=gen))  # <= 32: the one-warp path
            lens = torch.randint(0, 700, (batch,), generator=gen)
            if it % 3 == 0:
                lens = torch.randint(0, 40, (batch,), generator=gen)
                lens[int(torch.randint(0, batch, (1,), generator=gen))] = 3000
            policy = ("balanced", "forced", "batch_invariant")[it % 3]
            raw = torch.randint(0, 40, (NUM_TARGETS,), generator=gen).tolist()
            targets = tuple([0] + raw[1:]) if policy == "balanced" else (0,) * NUM_TARGETS
            s_cap = int(torch.randint(2, 10, (1,), generator=gen))
            bound = max(batch, max_units_bound(targets, batch, s_cap)) if policy == "balanced" else batch * s_cap
            sched = Schedule(policy, (16, 32, 48)[it % 3], 1 + it % 3, s_cap, targets, bound)
            w = 7 if window else -1
            _check_probe(be, spec, lens.tolist(), sched, 2, w, gen)
            n = schedule_units(lens.tolist(), sched, 2, w).num_units
            _check_probe(be, spec, lens.tolist(), sched, 2, w, gen, grid=n + 5 * it, spread=(0, n + 3, 2 * n)[it % 3])


def _check_probe(be, spec, lens, sched, q_len, window_left, gen, sample=40, grid=None, spread=0):
    """``grid``: the grid's unit slots (None: the probe's slots are the units); ``spread``: the spread's window
    (0: none), both as the partial kernel applies them (``slot_unit``) to batches of at most 32."""
    u = schedule_units(lens, sched, q_len, window_left)
    n = u.num_units
    m = n if grid is None else grid
    probe = list(range(m + 1)) if m <= sample else sorted({0, m - 1, m, *torch.randint(0, m, (sample,),
                                                                                        generator=gen).tolist()})
    slots = 0 if grid is None else (min(grid, spread) if spread else grid)
    res, meta = be.probe(spec, torch.tensor(lens, dtype=torch.int32, device="cuda"), sched, probe,
                         window_left=window_left, slots=slots)
    torch.cuda.synchronize()
    if grid is not None:
        runs = [(slot_unit(p, n, grid, 1, spread) if len(lens) <= 32 else (p if p < n else -1)) if p < grid else -1
                for p in probe]
        probe = [n if r < 0 else r for r in runs]
    assert_probe_matches(res, meta, u, probe)


@pytest.mark.parametrize("batch", [65536, 70001])
def test_prologue_batch_65536(batch, gen):
    """Batches of 65,536 and 70,001 (256 chunks and more of the 256-thread prologue): units sampled through the
    batch, the last and one past it, ``meta`` for the whole batch."""
    from attnplan.backends.cuda_ptx.spec import make_spec

    be = _backend()
    lens = torch.randint(0, 3000, (batch,), generator=gen)
    lens[batch // 2] = 2**20
    targets = tuple([0] + [min(2 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)])
    sched = Schedule("balanced", 64, 1, 128, targets, max_units_bound(targets, batch, 128))
    spec = make_spec("partial", "bfloat16", 128, 4, 1, 16)
    _check_probe(be, spec, lens.tolist(), sched, 1, -1, gen, sample=200)


def test_decode_batch_65536(gen):
    """A whole decode at batch 65,536 through the public API (a capacity plan: every program reads the whole batch's
    lengths; one 3000-token sequence among sequences of 0-40 tokens, a paged cache holding only their pages) against
    the reference on a sample of sequences and the long one."""
    _backend()
    batch, cap, page = 65536, 3008, 16
    lens = torch.randint(0, 40, (batch,), generator=gen)
    lens[777] = 3000
    npages = (-(-lens // page)).clamp(min=1)
    first = torch.cumsum(npages, 0) - npages
    j = torch.arange(cap // page)
    bt = torch.where(j[None, :] < npages[:, None], first[:, None] + j[None, :], 0).to(torch.int32)  # unused: page 0
    total = int(npages.sum())
    k = torch.randn(total, page, 1, 64, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(total, page, 1, 64, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(batch, 1, 2, 64, generator=gen).to(torch.bfloat16).cuda()
    sl, bt = lens.to(torch.int32).cuda(), bt.cuda()
    w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
    plan = w.plan(q, k, v, sl, bt, capacity=True)
    assert not plan.single_pass and int(schedule_units(lens.tolist(), plan.schedule).units[777]) > 1
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(batch, 1, 2, device="cuda"))
    w.run(q, k, v, sl, bt, out=out, lse=lse)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse[sl > 0]).any()
    idx = torch.cat([torch.tensor([777]), torch.randint(0, batch, (31,), generator=gen)]).unique().cuda()
    ref, ref_lse = reference.attention(q[idx], k, v, sl[idx], bt[idx], 64 ** -0.5)
    assert_close_to_reference(out[idx], ref, torch.bfloat16)
    assert_close_to_reference(lse[idx], ref_lse, torch.float32, "lse")


# -- the scheduled kernel unit by unit ------------------------------------------------------------------------------

CASES = [
    Case((32, 8), 128, (4097, 1, 16, 0), page=16, splits=(0, 1, 7)),
    Case((8, 8), 64, (1, 17, 300), dtype="fp16", splits=(1, 3)),            # group 1, contiguous
    Case((16, 4), 128, (4097, 64), q_len=4, page=64, splits=(0, 5)),          # group 4, q_len 4, page 64
    Case((28, 4), 128, (256, 255, 257), page=16, splits=(0, 2)),             # group 7
    Case((64, 8), 128, (129, 64, 65), page=64, dtype="fp16", splits=(0, 5)),  # group 8
    Case((64, 4), 128, (3000, 17), page=16, splits=(0, 3)),                   # group 16
    Case((16, 4), 128, (100, 33, 3), q_len=4, page=1, splits=(1, 3)),         # page 1, L < q_len
    Case((8, 2), 256, (513, 0), q_len=4, dtype="fp32", splits=(1, 4)),        # fp32, head_dim 256
    Case((4, 1), 32, (40,), page=16, splits=(16,)),                           # more splits than granules
    Case((32, 8), 96, (1000,), dtype="fp16", splits=(0, 3)),                  # non-pow2 head_dim
    Case((16, 2), 80, (700, 1), page=16, q_len=3, splits=(2,)),
    Case((4, 1), 128, (4096,), dtype="fp32", splits=(1, 4)),                  # interpreter-vs-gpu-tf32: ieee fp32
    # head_dim 64, two n8-tiles a warp and several queries (15 / 16 rows): the single pass states one program per SM
    Case((24, 8), 64, (300, 17), q_len=5, dtype="fp16", splits=(1, 3)),
    Case((64, 8), 64, (700, 2), q_len=2, splits=(1, 3)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_reference(case, mode, gen):
    """``split_k`` through the public API (tensor cores where they serve); ``core``: the CUDA-core split-K kernel
    through the backend, unit by unit (fp16 / bf16 cases with head_dim % 16 == 0 only)."""
    be = _backend()
    dtype = DT[case.dtype]
    if mode == "core" and (case.dtype == "fp32" or case.head_dim % 16):
        pytest.skip("the split_k cases already run on CUDA cores")
    x = case.inputs("cuda", gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for splits in case.splits:
        if mode == "core":
            plan = _direct_plan(be, x, splits, mma=False)
            assert not be.spec_for("partial", plan, x.q.device).mma
            _run_checked(be, x, plan)
            continue
        out, lse = _outputs(x)
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, out=out,
                        lse=lse, backend="cuda_ptx", num_splits=splits, config=load_config())
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, dtype, f"out (num_splits={splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (num_splits={splits})")
        empty = torch.tensor(case.lens, device="cuda") == 0
        assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("page", [None, 16])
def test_partial_states_and_mixing(dtype, page, gen):
    """Partial states equal reference.partial unit by unit; they merge with the reference merge, and the cuda_ptx
    merge kernel merges reference states (states are one format whoever wrote them)."""
    be = _backend()
    dt = DT[dtype]
    x = make_inputs(3, 16, 4, 128, [1000, 40, 0], q_len=4, page_size=page, dtype=dt, device="cuda", generator=gen)
    plan = _direct_plan(be, x, 6)
    ws, units = _run_checked(be, x, plan)
    n = units.num_units
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    sl = units.slot.to(ws.state.o.device)  # the kernel's slots in sequence order: the ragged layout of indptr
    o2, l2 = merge_states(PartialState(ws.state.o[:, :, :, sl].double().cpu(),
                                       ws.state.lse[:, :, :, sl].double().cpu()), indptr=units.indptr)
    tol = torch.float32 if dt == torch.float32 else dt
    multi = [b for b in range(3) if int(units.units[b]) > 1]  # rows merged from states; the others are written
    one = [b for b in range(3) if int(units.units[b]) == 1]   # directly by the partial kernel
    assert 0 in multi, "the 1000-token sequence is split"
    assert_close_to_reference(o2[multi], ref[multi].cpu(), tol, "merge_states(cuda_ptx states)")
    assert_close_to_reference(l2[multi], ref_lse[multi].cpu(), torch.float32, "merge_states lse")
    # reference states through the cuda_ptx merge kernel
    rp, _ = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.schedule)
    ws2 = _workspace(plan)
    sl = units.slot.cuda()
    ws2.state.o[:, :, :, sl] = rp.o.float().cuda()
    ws2.state.lse[:, :, :, sl] = rp.lse.float().cuda()
    ws2.meta.copy_(torch.cat([units.first, units.units]).to(torch.int32).cuda())
    out, lse = _outputs(x)
    be.merge(plan, ws2, out, lse)
    torch.cuda.synchronize()
    assert_close_to_reference(out[multi], ref[multi], dt, "cuda_ptx merge of reference states")
    assert_close_to_reference(lse[multi], ref_lse[multi], torch.float32, "lse")
    assert torch.isnan(out[one].float()).all(), "rows of one-unit sequences were merged"


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("page", [None, 16])
def test_capacity_plan_long_tail(merge, page, gen):
    """A balanced capacity plan on a long-tailed, padded batch (one 32K sequence among short ones and zero-length
    padding slots): the long one spread over many units, the short ones written directly; the same plan on
    all-zero and all-full batches; bitwise reruns; the fused merge's counters back at zero."""
    be = _backend()
    cap = 32768
    lens = [cap, 17, 300, 0, 0, 4096, 1, 90]
    x = make_inputs(len(lens), 32, 8, 128, lens, page_size=page, dtype=torch.bfloat16, device="cuda", generator=gen,
                    capacity=cap)
    plan = _direct_plan(be, x, 0, merge=merge, capacity=cap)
    assert plan.schedule.policy == "balanced" and plan.merge == merge
    u = schedule_units(lens, plan.schedule)
    assert int(u.units[0]) >= 2 and int(u.units[1]) == 1
    for lens_now in (lens, [0] * 8, [cap] * 8):
        x.seq_lens.copy_(torch.tensor(lens_now, dtype=torch.int32))
        ws = _workspace(plan)
        runs = []
        for _ in range(3):
            out, lse = _outputs(x)
            be.run(plan, x, ws, out, lse)
            torch.cuda.synchronize()
            runs.append((out.clone(), lse.clone()))
            if ws.counters is not None:
                assert int(ws.counters.abs().sum()) == 0
        ref, ref_lse = _reference(x)
        assert_close_to_reference(runs[0][0], ref, torch.bfloat16, f"out at {lens_now[:3]}...")
        assert_close_to_reference(runs[0][1], ref_lse, torch.float32, "lse")
        assert all(torch.equal(o, runs[0][0]) and torch.equal(ls, runs[0][1]) for o, ls in runs[1:])


def test_cuda_graph_replay_after_in_place_rewrites(gen):
    _backend()
    cap = 8192
    x = make_inputs(4, 32, 8, 128, [100] * 4, q_len=1, page_size=16, dtype=torch.bfloat16, device="cuda", capacity=cap,
                    generator=gen)
    for merge in ("separate", "fused"):
        w = attnplan.DecodeWrapper(load_config(split={"merge": merge}), backend="cuda_ptx")
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
        assert plan.merge == merge
        out = torch.empty_like(x.q)
        lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
        args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture
            w.run(*args, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(*args, out=out, lse=lse)
        for lens in ([100, 8000, 5, 0], [0, 0, 0, 0], [cap, 1, 16, 17]):
            x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            x.block_table.copy_(x.block_table[torch.randperm(4, generator=gen)])
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ref, ref_lse = reference.attention(*args, sm_scale=x.sm_scale)
            assert_close_to_reference(out, ref, torch.bfloat16, f"graph replay at {lens} ({merge})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"graph replay lse at {lens} ({merge})")


def test_side_stream_and_no_allocation(gen):
    """Launches follow torch's current stream (never the legacy default stream); run() allocates nothing."""
    _backend()
    x = make_inputs(2, 32, 8, 128, [3000, 20], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
    w = attnplan.DecodeWrapper(backend="cuda_ptx")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=4)
    out = torch.empty_like(x.q)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.fill_(float("nan"))
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out)
    s.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before + 0
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_int32_page_offset(gen):
    """Pages past index 131,072 (page x page stride > 2**31 elements): 64-bit offsets."""
    _backend()
    x = make_inputs(2, 32, 8, 128, [300, 40], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
    pages = 140_000
    try:
        k_big = torch.empty(pages, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        v_big = torch.empty_like(k_big)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for 2 x 4.6 GB caches")
    used = x.block_table.flatten().long()
    new = torch.arange(used.numel(), device="cuda") * 3 + 131_072 + 17  # all beyond 2**17 pages
    assert int(new.max()) < pages
    k_big[new] = x.k_cache[used]
    v_big[new] = x.v_cache[used]
    bt = new.to(torch.int32).view_as(x.block_table)
    out = poison(torch.empty_like(x.q))
    attnplan.decode(x.q, k_big, v_big, x.seq_lens, bt, sm_scale=x.sm_scale, out=out, backend="cuda_ptx", num_splits=3)
    torch.cuda.synchronize()
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)
    del k_big, v_big


#: (mode, page, fp8) of the bad-entry test: every block-table read path of copy.cuh, the window of 32 entries
#: (PageWindow: a tile in one page, or PAGE_REG's pages of a tensor-core tile) and the per-chunk loads (load_pages)
BAD_TABLE = [
    ("split_k", 16, False),  # tensor cores, a 16-token tile in one page: the window
    ("split_k", 4, False),   # tensor cores, 4 pages per tile (PAGE_REG): the window
    ("split_k", 1, False),   # tensor cores, 1-token pages: per-chunk loads
    ("split_k", 16, True),   # fp8 on tensor cores, 2 pages per 32-token tile (PAGE_REG)
    ("core", 64, False),     # CUDA cores, 8-token tiles in one page: the window
    ("core", 4, False),      # CUDA cores, 4-token pages: per-chunk loads
]


def _bad_entries(bt, lens, page, num_pages):
    """``bt`` with entries outside [0, num_pages) in the slots the sequences use (negative, -2**31, num_pages, past it,
    2**31 - 1; the first, a middle and the last used slot of each non-empty sequence) and in the unused slots."""
    bt = bt.clone()
    bad = [(-1, num_pages, -2**31), (2**31 - 1, -7, num_pages + 5), (num_pages + 1, -2, 2**31 - 1)]
    for b, n in enumerate(lens):
        used = -(-n // page)
        if used:
            bt[b, 0], bt[b, (used - 1) // 2], bt[b, used - 1] = bad[b % 3]
        bt[b, used:] = -3 if b % 2 else 2**31 - 1
    return bt


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("mode,page,fp8", BAD_TABLE, ids=[f"{m}-page{p}" + ("-kvfp8" if f else "") for m, p, f in
                                                          BAD_TABLE])
def test_bad_block_table_entries_read_a_clamped_page(mode, page, fp8, merge, gen):
    """Block-table entries outside [0, num_pages) in used slots never fault: every page index the kernels load is
    clamped into [0, last_page] (negative -> page 0, too large -> the last page) as the reference clamps them, so the
    single pass, the partial kernel unit by unit, the separate and the fused merge equal the reference on the same
    table; through the public API with host lengths too (plan() then does not read the table)."""
    be = _backend()
    lens = [2000, 700, 33, 0]
    case = Case((32, 8), 128, tuple(lens), q_len=2, page=page)
    x = _fp8_inputs(case, gen) if fp8 else case.inputs("cuda", gen)
    num_pages = x.k_cache.shape[0]
    x = dataclasses.replace(x, block_table=_bad_entries(x.block_table, lens, page, num_pages))
    ref, ref_lse = _reference(x)
    for splits in ((5, 16) if merge == "fused" else (1, 5)):
        plan = _direct_plan(be, x, splits, merge=merge, mma=mode == "split_k")
        spec = be.spec_for("partial", plan, x.q.device)
        assert spec.mma == (mode == "split_k") and spec.page_size == page
        if merge == "separate":
            _run_checked(be, x, plan)
            continue
        assert plan.merge == "fused" and spec.merge == "fused"
        ws = _workspace(plan)
        out, lse = _outputs(x)
        be.run(plan, x, ws, out, lse)
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, x.q.dtype, f"out (fused, {splits} units)")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (fused, {splits} units)")
        assert int(ws.counters.abs().sum()) == 0, "counters not reset"
    if mode == "split_k":
        out, lse = _outputs(x)
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, out=out, lse=lse,
                        backend="cuda_ptx", num_splits=5, k_scale=x.k_scale, v_scale=x.v_scale, seq_lens_host=lens,
                        config=load_config(split={"merge": merge}))
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, x.q.dtype, "out (decode with host lengths)")
        assert_close_to_reference(lse, ref_lse, torch.float32, "lse (decode with host lengths)")


@pytest.mark.parametrize("splits", [1, 3])
def test_head_major_cache_with_head_stride_2_30(splits, gen):
    """A head-major fp8 cache view (head stride 2**30 elements, 3 KV heads: head 2 past 2**31) through the public
    API: 64-bit head offsets."""
    be = _backend()
    x0 = make_inputs(2, 6, 3, 64, [700, 33], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
    views = []
    for c in (x0.k_cache, x0.v_cache):
        p, t, h, d = c.shape
        buf = torch.empty(2 * 2**30 + p * t * d, dtype=FP8, device="cuda")
        v = buf.as_strided(c.shape, (t * d, d, 2**30, 1))
        v.copy_((c.float() * 0.5).to(FP8))
        views.append(v)
    ks, vs = torch.ones(3, device="cuda"), torch.full((3,), 0.5, device="cuda")
    x = DecodeInputs(x0.q, views[0], views[1], x0.seq_lens, x0.block_table, x0.sm_scale, k_scale=ks, v_scale=vs)
    _run_checked(be, x, _direct_plan(be, x, splits))


@pytest.mark.parametrize("q_len,window", [(2, -1), (4, 100)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "kvfp8"])
def test_nan_in_v_reaches_only_rows_that_see_it(q_len, window, mode, fp8, gen):
    """NaN in V at each sequence's last position (query 0 cannot see it) and just before the last query's window:
    exactly the reference's NaN, everything else within tolerance (q_len 2 made query 0 NaN before)."""
    be = _backend()
    x = make_inputs(2, 16, 8, 128, [4097, 300], q_len=q_len, page_size=16, dtype=torch.bfloat16, device="cuda",
                    generator=gen)
    kc, vc, ks, vs = x.k_cache, x.v_cache, None, None
    if fp8:
        kc, vc = (kc.float() / 4).to(FP8), (vc.float() * 2).to(FP8)
        ks, vs = torch.ones(8, device="cuda"), torch.ones(8, device="cuda")
    x = DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=window, k_scale=ks, v_scale=vs)
    for b, n in enumerate(x.seq_lens.tolist()):
        for pos in [n - 1] + ([n - q_len - window] if window >= 0 else []):
            x.v_cache[int(x.block_table[b, pos // 16]), pos % 16, 0, 5] = float("nan")
    ref, _ = _reference(x)
    for splits in (1, 5):
        plan = _direct_plan(be, x, splits, mma=mode == "split_k")
        out, lse = _outputs(x)
        be.run(plan, x, _workspace(plan), out, lse)
        torch.cuda.synchronize()
        assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref)), f"NaN pattern (splits {splits})"
        assert_close_to_reference(out.float().nan_to_num(0.0), ref.nan_to_num(0.0), torch.bfloat16)


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("splits", [1, 5])
def test_variants_window_softcap_sinks(page, splits, gen):
    """Sliding window (units start at the window), soft-cap and sinks (joined where out is written)."""
    _backend()
    x = make_inputs(3, 32, 8, 128, [4097, 300, 0], q_len=2, page_size=page, dtype=torch.bfloat16, device="cuda",
                    generator=gen, scale=2.0)
    sinks = (torch.randn(32, generator=gen) * 2).float().cuda()
    kw = dict(window_left=1000, logits_soft_cap=20.0, sinks=sinks)
    out, lse = _outputs(x)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, out=out, lse=lse,
                    backend="cuda_ptx", num_splits=splits, config=load_config(), **kw)
    torch.cuda.synchronize()
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       window_left=1000, soft_cap=20.0, sinks=sinks)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


FP8_CASES = [
    Case((32, 8), 128, (4097, 1, 16, 0), page=16, splits=(0, 1, 7)),          # the target shape, paged
    Case((8, 8), 64, (1, 17, 300), dtype="fp16", splits=(1, 3)),              # group 1, contiguous, fp16 q
    Case((28, 4), 128, (256, 255, 257), page=16, splits=(0, 2)),              # group 7
    Case((16, 4), 128, (700, 3), q_len=4, page=64, splits=(1, 5)),            # group 4 x q_len 4 (16 rows)
    Case((32, 1), 256, (1000,), page=16, splits=(1, 3)),                      # 32 rows, head_dim 256
    Case((16, 2), 128, (4097, 300), q_len=2, page=16, window=1000, cap=20.0, sinks=True, splits=(1, 5)),
]


def _fp8_inputs(case, gen):
    """A case's inputs with the cache in float8_e4m3fn (K / 4, V x 2 before rounding) and per-KV-head scales in
    [0.5, 1.5), as DecodeInputs."""
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=DT[case.dtype], device="cuda", generator=gen, scale=2.0 if case.cap else 1.0)
    kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
    ks = (torch.rand(hkv, generator=gen, device=gen.device) + 0.5).float().cuda()
    vs = (torch.rand(hkv, generator=gen, device=gen.device) + 0.5).float().cuda()
    sinks = (torch.randn(hq, generator=gen) * 2).float().cuda() if case.sinks else None
    return DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=case.window,
                        soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.id)
def test_fp8_kv_matches_reference(case, mode, gen):
    """float8_e4m3fn K / V, per-KV-head scales, q bf16 / fp16, against the float64 reference (which dequantizes
    k * k_scale[h], v * v_scale[h]); outputs, lse and partial states. ``split_k`` (public API) runs the tensor
    cores, ``core`` the CUDA-core split-K kernel (kernel option ``mma: false``) unit by unit."""
    be = _backend()
    dtype = DT[case.dtype]
    x = _fp8_inputs(case, gen)
    kw = dict(window_left=case.window, logits_soft_cap=case.cap, sinks=x.sinks, k_scale=x.k_scale, v_scale=x.v_scale)
    ref, ref_lse = _reference(x)
    for splits in case.splits:
        if mode == "core":
            plan = _direct_plan(be, x, splits, mma=False)
            assert be.spec_for("partial", plan, x.q.device).kv_fp8 and not be.spec_for("partial", plan).mma
            _run_checked(be, x, plan)
            continue
        out, lse = _outputs(x)
        w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, num_splits=splits,
                      **kw)
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        spec = be.spec_for("partial", plan, x.q.device)
        assert spec.kv_fp8 and spec.mma
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, dtype, f"out (num_splits={splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (num_splits={splits})")
        if not plan.single_pass:
            _run_checked(be, x, _direct_plan(be, x, splits))


MMA_CASES = [
    Case((32, 8), 128, (131072,), splits=(0,)),                                 # the target problem
    Case((32, 8), 128, (4097, 1, 16, 0), page=16, splits=(1, 7)),
    Case((64, 4), 128, (3000, 17), page=16, splits=(3,)),                       # group 16: 2 n8-tiles
    Case((64, 2), 128, (700, 3), q_len=2, page=16, splits=(1, 3)),              # 64 rows: 4 row groups
    Case((16, 2), 80, (700, 1), page=16, q_len=3, splits=(2,)),                 # padded ring rows
    Case((8, 1), 256, (1000, 5), q_len=4, page=64, dtype="fp16", splits=(1, 3)),
    Case((8, 8), 64, (1, 17, 300), dtype="fp16", splits=(1, 3)),                # group 1
    Case((16, 4), 128, (100, 33, 3), q_len=4, page=1, splits=(3,)),             # page 1, L < q_len
]


def _check_mma_and_core(x, splits_list):
    """The tensor-core and CUDA-core kernels on ``x`` for each split count: each unit by unit against the reference
    (:func:`_run_checked`), and their partial states against each other where both plans schedule alike."""
    be = _backend()
    for splits in splits_list:
        states = {}
        for mma in (True, False):
            plan = _direct_plan(be, x, splits, mma=mma)
            assert be.spec_for("partial", plan, x.q.device).mma is mma and plan.kernel["mma"] is mma
            ws, units = _run_checked(be, x, plan)
            if not plan.single_pass:
                states[mma] = (plan.schedule, units.num_units, ws.state)
        if len(states) == 2 and states[True][0] == states[False][0]:  # same schedule: the kernels' states agree
            sched, _, st = states[True]
            # only sequences of two or more units have workspace states (one-unit rows go to out directly and
            # their slots keep the poison)
            u = schedule_units(x.seq_lens.tolist(), sched, q_len=x.q.shape[1], window_left=x.window_left)
            slots = torch.cat([torch.arange(int(u.first[b]), int(u.first[b]) + int(u.units[b]))
                               for b in range(len(u.units)) if int(u.units[b]) > 1]
                              or [torch.zeros(0, dtype=torch.int64)]).to(x.q.device)
            o_dt = torch.float16 if x.k_cache.dtype == FP8 else x.q.dtype
            assert_close_to_reference(st.o.index_select(3, slots), states[False][2].o.index_select(3, slots).double(),
                                      o_dt, "partial o mma vs core")
            assert_close_to_reference(st.lse.index_select(3, slots),
                                      states[False][2].lse.index_select(3, slots).double(), torch.float32,
                                      "lse mma vs core")


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.id)
def test_mma_and_core_agree(case, gen):
    """The tensor-core and CUDA-core split-K kernels on the same inputs: partial states within q's dtype tolerance
    of the reference (o) and fp32's (lse), and of each other."""
    _check_mma_and_core(case.inputs("cuda", gen), case.splits)


FP8_MMA_CASES = [
    Case((32, 8), 128, (131072,), splits=(0,)),                                 # the target problem
    Case((32, 8), 128, (4097, 1, 16, 0), page=16, splits=(1, 7)),
    Case((16, 2), 128, (700, 3, 1), q_len=3, page=16, splits=(1, 3)),           # 24 rows: 2 row groups
    Case((8, 8), 64, (1, 17, 300), dtype="fp16", splits=(1, 3)),                # group 1, padded rows
    Case((8, 1), 256, (1000, 5), q_len=4, page=64, dtype="fp16", splits=(1, 3)),  # 32 rows, head_dim 256
    Case((16, 2), 80, (700, 1), page=16, q_len=3, splits=(2,)),                 # 5 fp8 chunks per row (odd)
    Case((16, 2), 128, (4097, 300), q_len=2, page=16, window=1000, cap=20.0, splits=(1, 5)),  # window + soft-cap
]


@pytest.mark.parametrize("case", FP8_MMA_CASES, ids=lambda c: c.id)
def test_fp8_mma_and_core_agree(case, gen):
    """fp8 KV: the tensor-core and CUDA-core split-K kernels on the same inputs (partial o at fp16's tolerance: P
    rounded to fp16 on the tensor cores)."""
    _check_mma_and_core(_fp8_inputs(case, gen), case.splits)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_decoder_all_256_codes(mode, gen):
    """Every e4m3fn byte through the device decoders (split_k: the tensor cores' cvt.rn.f16x2.e4m3x2, or its integer
    fallback below sm_89; core: the CUDA-core integer decoder): a sequence of one granule + 1 tokens forced into two
    units, the second holding token G alone, whose V row holds all 256 codes rotated by h for KV head h: that unit's
    partial state is the row x v_scale[h], exactly, NaN for 0x7f / 0xff, equal to torch's own float8 conversion."""
    be = _backend()
    hkv, d = 4, 256
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    v_scale = torch.tensor([2.0 ** (h - 2) for h in range(hkv)], device="cuda")

    def inputs(length):
        k = torch.zeros(1, length, hkv, d, dtype=FP8, device="cuda")
        v = (torch.randn(1, length, hkv, d, generator=gen) / 8).to(FP8).cuda()
        q = torch.randn(1, 1, hkv * 8, d, dtype=torch.bfloat16, device="cuda")
        return DecodeInputs(q, k, v, torch.tensor([length], dtype=torch.int32, device="cuda"), None, 0.1,
                            k_scale=torch.ones(hkv, device="cuda"), v_scale=v_scale)

    granule = _direct_plan(be, inputs(64), 2, mma=mode == "split_k").schedule.granule
    x = inputs(granule + 1)
    x.v_cache[0, granule] = torch.stack([codes.roll(h) for h in range(hkv)]).view(FP8)
    plan = _direct_plan(be, x, 2, mma=mode == "split_k")
    assert be.spec_for("partial", plan, CUDA).mma is (mode == "split_k")
    ws = _workspace(plan)
    be.partial(plan, x, ws, *_outputs(x))
    torch.cuda.synchronize()
    assert schedule_units([granule + 1], plan.schedule).start.tolist() == [0, granule]
    want = (x.v_cache[0, granule].double() * v_scale.double().view(hkv, 1)).repeat_interleave(8, 0)
    o = ws.state.o[0, 0, :, 1].double()
    assert torch.equal(torch.isnan(o), torch.isnan(want))
    assert torch.equal(o.nan_to_num(0.0), want.nan_to_num(0.0))


def test_compiled_for_device_arch():
    be = _backend()
    major, minor = torch.cuda.get_device_capability()
    from attnplan.backends.cuda_ptx.spec import make_spec

    c = be.compile(make_spec("partial", "bfloat16", 128, 4, 1, 16), (major, minor))
    assert c.target.kind == "cubin" and c.target.arch == f"sm_{major}{minor}"


@pytest.mark.parametrize("mode", ["mma", "core"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "kvfp8"])
def test_fused_merge_gpu(mode, fp8, gen):
    """The fused merge inside the partial kernel with programs racing on the device: b=3, 32/8/128, lengths 4096 /
    0 / 1000, q_len 2, paged 16, sinks, 16, 40 and 64 forced units (the last two in two levels), bf16 or fp8 KV; 5 runs
    each into poisoned buffers: every run within tolerance of the reference, bitwise identical, the counters back at
    zero."""
    be = _backend()
    x = make_inputs(3, 32, 8, 128, [4096, 0, 1000], q_len=2, page_size=16, dtype=torch.bfloat16, device="cuda",
                    generator=gen)
    sinks = (torch.randn(32, generator=gen) * 2).float().cuda()
    kc, vc, ks, vs = x.k_cache, x.v_cache, None, None
    if fp8:
        kc, vc = (kc.float() / 4).to(FP8), (vc.float() * 2).to(FP8)
        ks, vs = (torch.rand(8, generator=gen) + 0.5).cuda(), (torch.rand(8, generator=gen) + 0.5).cuda()
    x = DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, sinks=sinks, k_scale=ks, v_scale=vs)
    ref, ref_lse = _reference(x)
    for splits in (16, 40, 64):  # one level; two (teams of 16: 16 + 16 + 8, 4 x 16)
        plan = _direct_plan(be, x, splits, merge="fused", mma=mode == "mma")
        assert plan.merge == "fused" and plan.num_splits == splits
        assert be.spec_for("partial", plan, x.q.device).merge == "fused"
        ws = _workspace(plan)
        runs = []
        for _ in range(5):
            out, lse = _outputs(x)
            be.run(plan, x, ws, out, lse)
            torch.cuda.synchronize()
            assert_close_to_reference(out, ref, torch.bfloat16, f"out (fused, {splits} units)")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (fused, {splits} units)")
            assert int(ws.counters.abs().sum()) == 0, "counters not reset"
            runs.append((out.clone(), lse.clone()))
        assert all(torch.equal(o, runs[0][0]) and torch.equal(ls, runs[0][1]) for o, ls in runs[1:])


@pytest.mark.parametrize("heads,lens,splits,head_dim", [((8, 1), [4096], 64, 128), ((32, 8), [4096, 1000, 0], 16, 128),
                                                         ((16, 8), [1000, 4096], 40, 256)])
def test_fused_merge_reads_this_launchs_states(heads, lens, splits, head_dim, gen):
    """The fused merge's release / acquire on the device, as a smoke test: two inputs A and B of one plan (same
    caches, different q) launched alternately 200 times each on one stream into one workspace, so a merging program
    that read a state not yet visible would read the other input's (same slot, a launch earlier) and differ. Every
    A output bitwise the first A's (and B's the first B's: the merge order is fixed), the first of each within
    tolerance of the reference, the counters back at zero. It catches a merge that often reads early (a count
    before the barrier, no release); a rare, narrow window may pass it. 64 and 40 units merge in two levels (teams
    of 16; at head_dim 256 a team of two warps waits at its named barrier before writing the team state, and the
    longer sequence's units take the first slots)."""
    be = _backend()
    hq, hkv = heads
    xa = make_inputs(len(lens), hq, hkv, head_dim, lens, page_size=16, dtype=torch.bfloat16, device="cuda",
                     generator=gen)
    xb = DecodeInputs(torch.randn(xa.q.shape, generator=gen).to(xa.q), xa.k_cache, xa.v_cache, xa.seq_lens,
                      xa.block_table, xa.sm_scale)
    plan = _direct_plan(be, xa, splits, merge="fused")
    assert plan.merge == "fused" and be.spec_for("partial", plan, xa.q.device).merge == "fused"
    ws = _workspace(plan)
    outs = {"a": [], "b": []}
    for _ in range(200):
        for name, x in (("a", xa), ("b", xb)):
            out, lse = _outputs(x)
            be.run(plan, x, ws, out, lse)
            outs[name].append((out, lse))
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0, "counters not reset"
    for name, x in (("a", xa), ("b", xb)):
        ref, ref_lse = _reference(x)
        o0, l0 = outs[name][0]
        assert_close_to_reference(o0, ref, torch.bfloat16, f"out {name}")
        assert_close_to_reference(l0, ref_lse, torch.float32, f"lse {name}")
        bad = [i for i, (o, ls) in enumerate(outs[name]) if not (torch.equal(o, o0) and torch.equal(ls, l0))]
        assert not bad, f"{name}: {len(bad)} of 200 launches differ from the first (first at {bad[0]})"


WARPS_CASES = [
    Case((8, 1), 128, (2048, 1000, 17, 0), splits=(1, 5)),           # group 1, contiguous
    Case((8, 1), 128, (4097, 16, 1), page=16, splits=(0, 5)),         # group 1, paged
    Case((28, 4), 128, (4097, 255), page=16, splits=(1, 5)),          # group 7
    Case((64, 8), 128, (1000, 65), splits=(2, 5)),                    # group 8
    Case((16, 8), 256, (1000, 33), page=16, splits=(1, 5)),           # head_dim 256
]


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("options", [{"num_warps": 8, "num_stages": 2}, {"num_warps": 8}, {"num_warps": 2}],
                         ids=["w8s2", "w8", "w2"])
@pytest.mark.parametrize("case", WARPS_CASES, ids=lambda c: c.id)
def test_kv_warps_options_match_reference(case, options, merge, gen):
    """Split-table rows may carry kernel options (``attnplan tune --row-options``; on an H200 8 KV warps per program
    with 2 stages measured fastest at 16-64 (sequence, KV head) pairs): 2 and 8 KV warps, through the config's
    backend_options, single pass and split with the separate and the fused merge, against the reference."""
    _backend()
    x = case.inputs("cuda", gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    cfg = load_config(backend_options={"cuda_ptx": options}, split={"merge": merge})
    for splits in case.splits:
        out, lse = _outputs(x)
        w = attnplan.DecodeWrapper(cfg, backend="cuda_ptx")
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, num_splits=splits)
        assert plan.kernel["num_warps"] == options["num_warps"]
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, torch.bfloat16, f"out ({options}, {splits} splits, {plan.merge})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({options}, {splits} splits)")


@pytest.mark.parametrize("merge,splits", [("separate", 4), ("fused", 4), ("separate", 1)])
def test_bound_launch_matches_reference(merge, splits, gen):
    """DecodeWrapper.run() through cuda_ptx's bound launch (the prepared arguments, only the call's data pointers
    written): new q, out and lse tensors every call, out in another layout (wider rows, a 2-byte offset) and lse in
    another layout on later calls, each layout's first call unbound and the rest bound; then a capacity plan
    captured in a CUDA graph through the bound launch and replayed after in-place seq_lens rewrites."""
    from attnplan.backends.cuda_ptx import BoundLaunch

    _backend()
    lens = [3000, 17, 900]
    x = make_inputs(3, 32, 8, 128, lens, page_size=16, dtype=torch.bfloat16, device="cuda", capacity=4096,
                    generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    cfg = load_config(split={"merge": merge})
    w = attnplan.DecodeWrapper(cfg, backend="cuda_ptx")
    plan = w.plan(*args, seq_lens_host=lens, num_splits=splits)
    assert plan.single_pass == (splits == 1) and (plan.single_pass or plan.merge == merge)
    bl = w._launcher
    assert isinstance(bl, BoundLaunch)
    ref, ref_lse = _reference(x)
    b, q, h, d = x.q.shape

    def wide():
        return poison(torch.empty(b, q, h, d + 64, dtype=x.q.dtype, device="cuda"))[..., :d]

    def shifted():
        return poison(torch.empty(x.q.numel() + 1, dtype=x.q.dtype, device="cuda"))[1:].view(x.q.shape)

    def lse_strided():
        return poison(torch.empty(b, q + 1, h, dtype=torch.float32, device="cuda"))[:, :q]

    layouts = [(lambda: poison(torch.empty_like(x.q)), lambda: poison(torch.empty(b, q, h, device="cuda"))),
               (wide, lse_strided), (shifted, None), (lambda: poison(torch.empty_like(x.q)), None)]
    for i, (make_out, make_lse) in enumerate(layouts):
        for step in range(3):
            out, lse = make_out(), None if make_lse is None else make_lse()
            got = w.run(x.q.clone(), *args[1:], out=out, lse=lse)
            torch.cuda.synchronize()
            assert got is out
            assert_close_to_reference(out, ref, torch.bfloat16, f"out (layout {i}, call {step}, {merge})")
            if lse is not None:
                assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (layout {i}, call {step}, {merge})")
        assert len(bl.direct) == i + 1
    # a capacity plan through the bound launch in a CUDA graph
    cap = 4096
    wg = attnplan.DecodeWrapper(cfg, backend="cuda_ptx")
    wg.plan(*args, capacity=True, num_splits=splits)
    bg = wg._launcher
    assert isinstance(bg, BoundLaunch)
    out = torch.empty_like(x.q)
    lse = torch.empty(b, q, h, dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture: the layout's unbound call prepares it
        wg.run(*args, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(s)
    assert len(bg.direct) == 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wg.run(*args, out=out, lse=lse)
    for now in ([100, 4000, 5], [0, 0, 0], [cap, 1, 17]):
        x.seq_lens.copy_(torch.tensor(now, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        r, r_lse = _reference(x)
        assert_close_to_reference(out, r, torch.bfloat16, f"graph replay at {now} ({merge}, {splits} splits)")
        assert_close_to_reference(lse, r_lse, torch.float32, f"graph replay lse at {now} ({merge})")
