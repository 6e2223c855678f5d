"""Every kernel backend against the float64 reference, on a grid generated from the backends'
declarations (xformers' habit: the grid comes from what each backend says it supports), plus known hard cases
(fp16 score overflow, zero-length rows, NaN outside the valid positions) and the mixed-backend merge (the workspace
of one backend's partial kernel merged by another's merge kernel).

On CPU (CI) the backends run in Triton's interpreter / numba's simulator at small sizes; on a
GPU the same tests run on the device, and the ``gpu``-marked ones add realistic sizes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnplan
import attnplan.testing
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.problem import dtype_name
from attnplan.schedule import schedule_units
from attnplan.state import PartialState, merge_states
from attnplan.testing import (DTYPES as DT, FP32_EDGE_CASES, FP32_EDGE_V, DecodeCase, assert_close_to_reference,
                              assert_fp32_edge, make_inputs, poison)

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = kernel_backends(DEVICE)


Case = DecodeCase


# The CPU grid is small (interpreter/simulator speed); the GPU runs it too, plus GPU_CASES.
CASES = [
    Case((4, 1), 16, (1, 37, 0), tags=("mqa",)),
    Case((8, 2), 64, (33, 16, 17), page=16, splits=(0, 1, 3), dtype="bf16"),
    Case((8, 2), 64, (33, 5), q_len=3, page=4, splits=(1, 4), dtype="fp32"),
    Case((7, 1), 32, (15, 16, 17), page=16, splits=(2,), tags=("group7",)),
    Case((8, 1), 128, (100, 20, 7, 0), splits=(4,), dtype="bf16", tags=("zero-length-padding-row",)),
    Case((4, 1), 128, (0, 37), splits=(1, 4), tags=("zero-length-lse-sign",)),
    Case((4, 1), 32, (40,), page=16, splits=(16,), tags=("more-splits-than-chunks",)),
    Case((16, 1), 32, (30,), splits=(1, 2), tags=("gqa-group-16",)),
    Case((14, 2), 32, (64,), page=16, dtype="bf16", splits=(0, 2), tags=("gqa-group-7",)),
    Case((4, 2), 32, (300,), dtype="bf16", splits=(1, 8, 16), tags=("split-count-changes-result",)),
    Case((4, 2), 128, (21, 9), q_len=5, page=32, splits=(1, 3), tags=("odd-q-len",)),
    Case((8, 2), 96, (40,), splits=(2,), tags=("head-dim-96",)),
    Case((8, 2), 80, (40,), page=16, splits=(2,), dtype="bf16", tags=("head-dim-80",)),
    Case((4, 2), 256, (30,), page=16, splits=(1, 2), tags=("head-dim-256",)),
    Case((4, 1), 128, (64,), dtype="fp32", splits=(1, 4), tags=("fp32-ieee",)),
    Case((4, 2), 16, (9, 3), page=1, splits=(1, 3), tags=("page1",)),
]

GPU_CASES = [
    Case((32, 8), 128, (4097, 1, 4096, 0), page=16, dtype="bf16", splits=(0, 1, 7)),
    Case((16, 2), 128, (100, 2000, 7, 0), dtype="bf16", splits=(0, 5), tags=("zero-length-padding-row",)),
    Case((16, 8), 128, (4096,), dtype="bf16", splits=(1, 16, 32), tags=("split-count-changes-result",)),
    Case((64, 4), 128, (3000, 17), page=16, dtype="bf16", tags=("gqa-group-16",)),
    Case((28, 4), 128, (256, 255, 257), page=16, dtype="bf16", tags=("gqa-group-7",)),
    Case((32, 8), 96, (1000,), dtype="fp16", splits=(0, 3), tags=("head-dim-96",)),
    Case((32, 8), 112, (1000,), page=16, dtype="fp16", tags=("head-dim-112",)),
    Case((16, 2), 256, (16384,), page=16, dtype="bf16", tags=("head-dim-256",)),
    Case((32, 8), 128, (4096,), dtype="fp32", splits=(0, 1), tags=("interpreter-vs-gpu-tf32",)),
    Case((32, 8), 128, (70, 64, 65, 63), q_len=7, page=64, dtype="bf16", splits=(1, 3), tags=("odd-q-len",)),
    Case((8, 1), 128, (131072,), dtype="bf16", tags=("long",)),
]


def _problem(case: Case, backend: str):
    hq, hkv = case.heads
    return attnplan.DecodeProblem(batch=len(case.lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=case.head_dim,
                                  q_len=case.q_len, page_size=case.page, q_dtype=dtype_name(DT[case.dtype]),
                                  kv_dtype=dtype_name(DT[case.dtype]), max_kv_len=max(case.lens))


def _params(cases, full=()):
    """``(backend, case, num_splits)`` params; a ``(case tag, num_splits)`` in ``full`` is in the full tier."""
    out = []
    for be, case, ns in ((b, c, n) for b in BACKENDS for c in cases for n in c.splits):
        tier = any((t, ns) in full for t in case.tags)
        out.append(pytest.param(be, case, ns, id=f"{be}-{case.id}-s{ns}", marks=pytest.mark.full if tier else ()))
    return out


#: (case tag, num_splits) in the full tier: 16 splits of the 300-token sequence is the same many-units path as its 8
CPU_FULL = {("split-count-changes-result", 16)}


def _inputs(case: Case, gen):
    return case.inputs(DEVICE, gen)


def _check_decode(backend: str, case: Case, num_splits: int, gen) -> None:
    reasons = get_backend(backend).supports(_problem(case, backend))
    if reasons:
        pytest.skip("; ".join(reasons))
    x = _inputs(case, gen)
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits)
    assert plan.backend == backend
    if num_splits > 0:
        assert plan.num_splits == num_splits
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("backend,case,num_splits", _params(CASES, CPU_FULL))
def test_decode_matches_reference(backend, case, num_splits, gen):
    _check_decode(backend, case, num_splits, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,case,num_splits", _params(GPU_CASES))
def test_decode_matches_reference_gpu(backend, case, num_splits, gen):
    _check_decode(backend, case, num_splits, gen)


PARTIAL_CASES = [
    Case((8, 2), 64, (45, 0, 16), q_len=2, page=16, dtype="bf16", splits=(3,)),
    Case((4, 1), 32, (33,), dtype="fp32", splits=(5,)),
]


def _scheduled(backend: str, x, num_splits: int, merge: str = "separate"):
    """Plan ``x`` on ``backend`` with ``num_splits`` forced, poison the workspace, ``out`` and ``lse`` with NaN and run
    the partial kernel alone: ``(wrapper, plan, units, out, lse)`` with the batch's schedule ``units``
    (:func:`attnplan.schedule.schedule_units`)."""
    cfg = attnplan.load_config(split={"merge": merge}, plan_cache={"disk": False})
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits)
    w.workspace.state.fill_(float("nan"))
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
    w.backend.partial(plan, x, w.workspace, out, lse)
    units = schedule_units(x.seq_lens.tolist(), plan.schedule, x.q.shape[1])
    return w, plan, units, out, lse


@pytest.mark.parametrize("backend,case,num_splits", _params(PARTIAL_CASES))
def test_partial_states_match_reference(backend, case, num_splits, gen):
    """The partial kernel alone: each unit's (o, lse) in the ragged workspace against ``reference.partial`` for the
    sequences with several units, the one-unit sequences' rows written to out / lse directly, the workspace
    slots past the batch's units untouched (NaN poison), ``workspace.meta`` = the schedule's first slots and units."""
    x = _inputs(case, gen)
    w, plan, units, out, lse = _scheduled(backend, x, num_splits)
    ref, _ = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.schedule)
    full, full_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    ws = w.workspace.state
    for b in range(len(case.lens)):
        lo, hi = int(units.indptr[b]), int(units.indptr[b + 1])  # the reference's states, in sequence order
        f, g = int(units.first[b]), int(units.first[b]) + hi - lo  # the kernel's slots
        if hi - lo == 1:
            assert_close_to_reference(out[b], full[b], DT[case.dtype])
            assert_close_to_reference(lse[b], full_lse[b], torch.float32, what="lse")
            assert torch.isnan(ws.o[:, :, :, f]).all(), "a one-unit sequence wrote its state"
        else:
            assert_close_to_reference(ws.o[:, :, :, f:g], ref.o[:, :, :, lo:hi], DT[case.dtype], what="partial o")
            assert_close_to_reference(ws.lse[:, :, :, f:g], ref.lse[:, :, :, lo:hi], torch.float32, what="partial lse")
            assert torch.isnan(out[b]).all(), "a split sequence's output was written before the merge"
    n = units.num_units
    assert torch.isnan(ws.o[:, :, :, n:]).all() and torch.isnan(ws.lse[:, :, :, n:]).all(), "wrote past the units"
    meta = w.workspace.meta.cpu()
    batch = len(case.lens)
    assert meta[:batch].tolist() == units.first.tolist() and meta[batch:].tolist() == units.units.tolist()


def _mixed_pairs():
    names = BACKENDS + ["reference"]
    return [pytest.param(a, b, id=f"{a}-states-merged-by-{b}") for a, b in itertools.product(names, names) if a != b]


@pytest.mark.parametrize("writer,merger", _mixed_pairs())
def test_mixed_backend_merge(writer, merger, gen):
    """The workspace (ragged states and meta) written by one backend's partial kernel, merged by another's merge
    kernel: equals the reference (one state format, one merge contract). The first sequence spans three granules
    of 256 tokens (the largest a head_dim 32 plan gets: numba's on a GPU; cuda_ptx's is 128 on a device without a
    split table), so it has several units on every device."""
    case = Case((4, 2), 32, (520, 0, 31), q_len=2, page=16, dtype="bf16")
    x = _inputs(case, gen)
    w, plan, units, out, lse = _scheduled(writer, x, 4)
    assert int(units.units.max()) > 1
    get_backend(merger).merge(plan, w.workspace, out, lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_of_two_backends_merge_across_split_points(backend, gen):
    """The first two units of each sequence from ``backend``, the others from the reference, one ragged merge (the
    first sequence three granules long at the largest head_dim 32 granule, 256 tokens: more than two units on every
    device)."""
    x = _inputs(Case((4, 1), 32, (520, 20)), gen)
    w, plan, units, _, _ = _scheduled(backend, x, 4)
    ref_st, _ = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, plan.schedule)
    assert int(units.units[0]) > 2
    n = units.num_units
    ws = w.workspace.state
    mine = torch.zeros(n, dtype=torch.bool)
    for b in range(2):
        lo, hi = int(units.indptr[b]), int(units.indptr[b + 1])
        if hi - lo > 1:
            mine[lo:lo + 2] = True
    sl = units.slot.to(ws.o.device)  # the backend's states in sequence order, the reference's layout
    o = torch.where(mine.view(1, 1, 1, n, 1), ws.o[:, :, :, sl].cpu().double(), ref_st.o)
    ls = torch.where(mine.view(1, 1, 1, n), ws.lse[:, :, :, sl].cpu().double(), ref_st.lse)
    out, _ = merge_states(PartialState(o, ls), indptr=units.indptr)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    many = units.units > 1
    assert_close_to_reference(out[many], ref[many], torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_qk_products_do_not_overflow(backend, gen):
    """q and k entries around 300 in a few dims (products of 9e4 > fp16 max): fp16 scores must not overflow.

    With scores near 3e4 the fp32 rounding of the scores alone moves the softmax weights by ~0.1%,
    so the bound is the precision floor (FlashAttention's practice): the
    table's fp16 atol plus 4x the largest error of the same attention computed by PyTorch in fp32,
    plus the rounding of P to fp16 before a tensor-core P.V (``tl.dot``, cuda_ptx's mma; as in
    FlashAttention): each weight moves by at most u = 2^-11 relative, the output by at most
    u * sum_n P_n |v_n| <= u * max|v|.

    On a GPU, triton and cuda_ptx compute QK^T on the tensor cores, whose fp32 accumulation
    truncates (each m16n8k16 k-step may lose up to one ulp of the running sum, here |q.k| ~ 3.6e5,
    ulp 2^-5): scores move by up to eps = (head_dim / 16) * ulp(max sum|q_d k_d|) * sm_scale and
    the output by up to (e^(2 eps) - 1) * max|v|. Seen on the H200: cuda_ptx once 1.5e-2 against
    the bound without this term, 8.8e-3 (1 of 15 fresh draws).
    """
    x = _inputs(Case((4, 1), 128, (48,)), gen)
    x.q[..., :4] = 300.0
    x.k_cache[:, ::3, :, :4] = 300.0
    out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=2)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    q32, k32, v32 = (t.float().cpu() for t in (x.q, x.k_cache[:, :48], x.v_cache[:, :48]))
    p = torch.softmax(torch.einsum("bqhd,bnd->bqhn", q32, k32[:, :, 0]) * x.sm_scale, -1)
    torch_fp32 = torch.einsum("bqhn,bnd->bqhd", p, v32[:, :, 0]).double()
    floor = (torch_fp32 - ref).abs()
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - ref).abs()
    atol, _ = attnplan.testing.tolerance(torch.float16)
    vmax = float(v32.abs().max())
    bound = atol + 4 * float(floor.max()) + 2.0**-11 * vmax
    if DEVICE == "cuda" and backend in ("triton", "cuda_ptx"):  # tensor-core accumulation (docstring)
        amax = float(torch.einsum("bqhd,bnd->bqhn", q32.abs(), k32[:, :, 0].abs()).max())
        eps = (q32.shape[-1] / 16) * 2.0 ** (math.floor(math.log2(amax)) - 23) * x.sm_scale
        bound += math.expm1(2 * eps) * vmax
    assert float(err.max()) <= bound, f"max err {float(err.max()):.3e}, fp32 floor {float(floor.max()):.3e}, bound {bound:.3e}"


#: every cross-program merge strategy and whether reruns of one plan must be bitwise identical (both merge in unit
#: order).
MERGE_BITWISE = {"separate": True, "fused": True}


def _merge_config(merge: str):
    return attnplan.load_config(split={"merge": merge}, deterministic=MERGE_BITWISE[merge], plan_cache={"disk": False})


def test_merge_bitwise_table_lists_every_strategy():
    from typing import get_args

    from attnplan.config import SplitPolicy

    assert set(get_args(SplitPolicy.model_fields["merge"].annotation)) - {"auto"} == set(MERGE_BITWISE)


@pytest.mark.parametrize("backend,merge", [pytest.param(b, m, id=f"{b}-{m}") for b in BACKENDS for m in MERGE_BITWISE])
def test_deterministic_bitwise(backend, merge, gen):
    """Three runs of one plan: bitwise identical for every strategy, each within tolerance of the reference."""
    if merge not in get_backend(backend).merge_strategies:
        pytest.skip(f"{backend} has no {merge} merge")
    x = _inputs(Case((4, 2), 32, (70, 33), page=16, dtype="bf16"), gen)
    w = attnplan.DecodeWrapper(_merge_config(merge), backend=backend)
    assert w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=3).merge == merge
    runs = [w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table).clone() for _ in range(3)]
    if MERGE_BITWISE[merge]:
        assert all(torch.equal(runs[0], r) for r in runs[1:])
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for r in runs:
        assert_close_to_reference(r, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_reruns_under_contention_gpu(backend, gen, record_property):
    """64 splits racing on the GPU (b=2, 32/8/128, 4096 tokens): 200 reruns per strategy (the number of distinct
    results recorded as ``<merge>_distinct_results``). separate and fused never differ bitwise, and the result is
    within tolerance of the reference."""
    x = make_inputs(2, 32, 8, 128, [4096, 4000], dtype=torch.bfloat16, device=DEVICE, generator=gen)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    for merge in MERGE_BITWISE:
        if merge not in get_backend(backend).merge_strategies:
            continue
        w = attnplan.DecodeWrapper(_merge_config(merge), backend=backend)
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=64)
        assert plan.num_splits == 64 and plan.merge == merge
        distinct: list[torch.Tensor] = []
        for _ in range(200):
            out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens)
            if not any(torch.equal(out, d) for d in distinct):
                distinct.append(out.clone())
        torch.cuda.synchronize()
        record_property(f"{merge}_distinct_results", len(distinct))
        print(f"{backend} {merge}: {len(distinct)} distinct result(s) in 200 runs")
        if MERGE_BITWISE[merge]:
            assert len(distinct) == 1, f"{merge} merge differed bitwise across reruns"
        for d in distinct:
            assert_close_to_reference(d, ref, torch.bfloat16)
        if w.workspace.counters is not None:
            assert int(w.workspace.counters.abs().sum()) == 0



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 4])
def test_nan_outside_valid_positions_and_in_other_sequences_does_not_leak(backend, page, gen):
    """Cache memory past each length (and unused pages) full of NaN, and NaN in one sequence's
    own q and KV: every other sequence's output is exact, the poisoned sequence's stays its own."""
    x = _inputs(Case((8, 2), 32, (13, 0, 6, 9), page=page), gen)
    lens = x.seq_lens.tolist()
    if page is None:
        for b, n in enumerate(lens):
            x.k_cache[b, n:] = float("nan")
            x.v_cache[b, n:] = float("nan")
    else:
        used = set()
        for b, n in enumerate(lens):
            pages = x.block_table[b, : -(-n // page)].tolist()
            used |= set(pages)
            if n % page:  # tail of the last page
                x.k_cache[pages[-1], n % page:] = float("nan")
                x.v_cache[pages[-1], n % page:] = float("nan")
        for p in set(range(x.k_cache.shape[0])) - used:
            x.k_cache[p] = float("nan")
            x.v_cache[p] = float("nan")
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    # now poison sequence 2's own q and KV (its visible positions)
    x.q[2] = float("nan")
    n2 = lens[2]
    if page is None:
        x.k_cache[2, :n2] = float("nan")
        x.v_cache[2, :n2] = float("nan")
    else:
        for p in x.block_table[2, : -(-n2 // page)].tolist():
            x.k_cache[p] = float("nan")
            x.v_cache[p] = float("nan")
    ref2, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert torch.isnan(ref2[2]).all()
    out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, num_splits=3)
    keep = [0, 1, 3]
    assert_close_to_reference(out[keep], ref[keep], torch.float16)
    assert torch.isnan(out[2]).all(), "the poisoned sequence's rows must stay NaN (its own), not turn finite"


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_scores_give_nan_rows_never_empty_rows(backend, gen):
    """Rows whose visible scores hold a NaN (a NaN query head; NaN in K at a sequence's only visible position; +inf
    in q against K = 0) are NaN exactly where the reference's are, never empty rows (o = 0, lse = -inf); the other
    rows within tolerance. Single pass and split."""
    dt = torch.float16
    x = make_inputs(3, 8, 2, 64, [40, 1, 30], dtype=dt, device=DEVICE, generator=gen)
    x.q[0, 0, 2] = float("nan")
    x.k_cache[1, 0, 1, 7] = float("nan")
    x.k_cache[2, :, 0] = 0.0
    x.q[2, 0, 1, 3] = float("inf")
    ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(), None, x.sm_scale)
    for splits in (1, 3):
        lse = torch.full(x.q.shape[:3], -7.0, device=DEVICE)
        out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=splits, lse=lse)
        out, lse = out.cpu(), lse.cpu()
        assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), f"{splits} splits: NaN lse at " \
            f"{torch.isnan(lse).nonzero().tolist()}, reference at {torch.isnan(ref_lse).nonzero().tolist()}"
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert_close_to_reference(out.nan_to_num(0.0), ref.nan_to_num(0.0), dt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_scores_follow_the_softmax(backend, gen):
    """An infinity in q or K that makes a score -inf gives that position weight 0 (the row stays finite; a row whose
    every visible score is -inf is empty: o = 0, lse = -inf); one that makes a score +inf makes the row's o and lse
    NaN. As the reference, single pass and split (GQA 4: query heads 0-3 read KV head 0, 4-7 KV head 1)."""
    dt = torch.float16
    x = make_inputs(3, 8, 2, 64, [40, 30, 20], dtype=dt, device=DEVICE, generator=gen)
    x.q[0, 0, 1, 3] = float("-inf")  # sequence 0, query head 1: every visible K has channel 3 > 0
    x.k_cache[0, :, 0, 3] = x.k_cache[0, :, 0, 3].abs() + 0.1
    x.q[1, 0, 4:, 5] = x.q[1, 0, 4:, 5].abs() + 0.1  # sequence 1: position 7 scores -inf for KV head 1's queries
    x.k_cache[1, 7, 1, 5] = float("-inf")
    x.q[2, 0, :4, 9] = x.q[2, 0, :4, 9].abs() + 0.1  # sequence 2: position 2 scores +inf for KV head 0's queries
    x.k_cache[2, 2, 0, 9] = float("inf")
    ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(), None, x.sm_scale)
    assert (ref[0, 0, 1] == 0).all() and torch.isneginf(ref_lse[0, 0, 1])  # the reference as documented
    assert torch.isfinite(ref[1]).all() and torch.isnan(ref[2, 0, :4]).all() and torch.isnan(ref_lse[2, 0, :4]).all()
    assert torch.isfinite(ref[2, 0, 4:]).all() and torch.isfinite(ref_lse[2, 0, 4:]).all()
    for splits in (1, 3):
        lse = torch.full(x.q.shape[:3], -7.0, device=DEVICE)
        out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=splits, lse=lse)
        out, lse = out.cpu(), lse.cpu()
        for got, want in ((lse, ref_lse), (out, ref)):
            assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{splits} splits: NaN at " \
                f"{torch.isnan(got).nonzero().tolist()}, reference at {torch.isnan(want).nonzero().tolist()}"
            assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        assert_close_to_reference(out.nan_to_num(0.0), ref.nan_to_num(0.0), dt)
        assert_close_to_reference(lse.nan_to_num(0.0, neginf=0.0), ref_lse.nan_to_num(0.0, neginf=0.0), dt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_v_entry_makes_exactly_the_columns_that_see_it_non_finite(backend, gen):
    """+inf and -inf in V at positions some rows see: the columns of exactly those rows are non-finite (the
    reference writes NaN there; a kernel's weighted sum gives +-inf, or NaN where the signs meet), the rest within
    tolerance; the LSE is untouched (V does not reach it). Single pass and split."""
    dt = torch.float16
    x = make_inputs(3, 8, 2, 64, [40, 1, 30], dtype=dt, device=DEVICE, generator=gen)
    x.v_cache[0, 17, 1, 5] = float("inf")
    x.v_cache[2, 3, 0, 9] = float("-inf")
    x.v_cache[2, 29, 0, 9] = float("inf")  # both signs in one column: NaN
    x.v_cache[1, 1, 0, 2] = float("inf")  # past sequence 1's length: never read
    ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(), None, x.sm_scale)
    bad = torch.isnan(ref)
    assert bad[0, 0, 4:8, 5].all() and bad[2, 0, 0:4, 9].all() and int(bad.sum()) == 8  # the GQA groups of 4
    for splits in (1, 3):
        lse = torch.empty(x.q.shape[:3], device=DEVICE)
        out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=splits, lse=lse)
        out, lse = out.cpu(), lse.cpu()
        assert torch.equal(~torch.isfinite(out), bad), f"{splits} splits: non-finite at " \
            f"{(~torch.isfinite(out)).nonzero().tolist()}, reference's NaN at {bad.nonzero().tolist()}"
        assert_close_to_reference(out.masked_fill(bad, 0.0), ref.masked_fill(bad, 0.0), dt)
        assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_legal_scales_do_not_overflow(backend, gen):
    """sm_scale 2e38 (below the bound, FP32_SCALED_MAX) over K = 0: every score is 0 and the output the mean of V; sm_scale
    1e38 over K that is 0 but in its first dimension, ~3e-38 there (scores ~10). A kernel that scales q before the
    dot product overflows (|q| x 1e38 x log2(e) > fp32's max; inf x 0 = NaN)."""
    for sm, kmag in ((2e38, 0.0), (1e38, 2e-38)):
        x = make_inputs(2, 4, 2, 64, [40, 9], dtype=torch.float32, device=DEVICE, generator=gen)
        # |q_0| >= 1 and |k_0| >= 2e-38, the other K dimensions exactly 0: no product below fp32's normal range (a
        # GPU may flush subnormals), and one product per score (its fp32 rounding stays within tolerance)
        x.q[..., 0] = torch.sign(x.q[..., 0]) * (1.0 + x.q[..., 0].abs())
        k0 = torch.sign(x.k_cache[..., 0]) * (1.0 + x.k_cache[..., 0].abs()) * kmag
        x.k_cache.zero_()
        x.k_cache[..., 0] = k0
        ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(), None, sm)
        assert torch.isfinite(ref).all()
        for splits in (1, 3):
            lse = torch.full(x.q.shape[:3], -7.0, device=DEVICE)
            out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=splits, lse=lse,
                                  sm_scale=sm)
            assert_close_to_reference(out.cpu(), ref, torch.float32, f"out at sm_scale {sm:g}, {splits} splits")
            assert_close_to_reference(lse.cpu(), ref_lse, torch.float32, f"lse at sm_scale {sm:g}, {splits} splits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_and_values_at_the_edge_of_the_fp32_range(backend, gen):
    """The fp32 domain the README states ("fp32 range"). Scaled scores up to ~2e38 in magnitude (under
    FP32_SCALED_MAX): q.k in [100, 200) times sm_scale 1e36 or -1e36 (one sign per row: a one-hot softmax whose largest
    score sits near fp32's overflow after the kernels' log2(e) factor), and q.k in [-200, 200) times 1e36 (both signs
    in a row: the differences to the row maximum overflow to -inf, weights that are 0 in float64 too). Then q = 0
    (equal weights) over positive V up to 3.3e38 / 40 (the longest row has 40 tokens): finite weighted sums only if
    no weight exceeds 1 by more than ~3%. Past the domain, scores of -3e38 to -4e38 (q.k in [300, 400) times -1e36)
    all overflow to -inf and the row reads as one that sees nothing, as documented (out 0, lse -inf)."""
    for sm, lo, hi in FP32_EDGE_CASES:
        x = make_inputs(2, 4, 2, 64, [40, 9], dtype=torch.float32, device=DEVICE, generator=gen)
        x.q.zero_()
        if lo is not None:
            x.q[..., 0] = 1.0
            x.k_cache.zero_()
            x.k_cache[..., 0] = (lo + (hi - lo) * torch.rand(x.k_cache.shape[:-1], generator=gen)).to(DEVICE)
        x.v_cache.copy_((0.9 + 0.1 * x.v_cache.abs().clamp(max=1.0)) * FP32_EDGE_V)
        ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(), None, sm)
        assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all()
        for splits in (1, 3):
            lse = torch.full(x.q.shape[:3], -7.0, device=DEVICE)
            out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=splits, lse=lse,
                                  sm_scale=sm)
            assert_fp32_edge(out, lse, ref, ref_lse, lo, torch.float32, f"sm_scale {sm:g}, q.k in [{lo}, {hi}), "
                                                                        f"{splits} splits")


def _merge_params():
    return [pytest.param(b, m, id=f"{b}-{m}") for b in BACKENDS for m in ("separate", "fused")]


@pytest.mark.parametrize("backend,merge", _merge_params())
# the merges are the same on a paged cache (the full tier): paged caches with both merges in the default run are
# test_deterministic_bitwise's (page 16, bitwise reruns) and tests/test_schedule_backends.py's capacity replays
@pytest.mark.parametrize("page", [None, pytest.param(16, marks=pytest.mark.full)])
def test_merge_strategies_match_reference_and_are_deterministic(backend, merge, page, gen):
    """Both cross-program merges (a separate merge kernel; the last program of each (sequence, KV head) merging in
    the partial kernel) give the reference, bitwise stable across runs; the fused one's completion counters are
    back at zero after every launch."""
    if merge not in get_backend(backend).merge_strategies:
        pytest.skip(f"{backend} has no {merge} merge")
    cfg = attnplan.load_config(split={"merge": merge}, plan_cache={"disk": False})
    x = _inputs(Case((4, 2), 32, (70, 0, 33, 1), q_len=2, page=page, dtype="bf16"), gen)
    sinks = torch.randn(4, generator=gen).float().to(DEVICE)
    for s in (None, sinks) if "sinks" in get_backend(backend).variants else (None,):
        w = attnplan.DecodeWrapper(cfg, backend=backend)
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=3, sinks=s)
        assert plan.merge == merge
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
        a = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, lse=lse).clone()
        b = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table).clone()
        assert torch.equal(a, b)
        if w.workspace.counters is not None:
            assert int(w.workspace.counters.abs().sum()) == 0
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sinks=s)
        assert_close_to_reference(a, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


def _refusing(monkeypatch, name: str, variant: str) -> None:
    """Make backend ``name`` declare every variant but ``variant`` (support as data: its ``supports`` then
    gives the reason), for this test only."""
    be = get_backend(name)
    monkeypatch.setattr(be, "variants", be.variants - {variant})


@pytest.mark.parametrize("variant,kwargs", [
    ("softcap", {"logits_soft_cap": 10.0}),
    ("window", {"window_left": 4}),
])
def test_dispatch_falls_through_to_a_backend_that_serves_the_variant(variant, kwargs, monkeypatch, gen):
    """The config's first backend refuses the variant (declared so for this test): dispatch skips it with
    the reason naming the variant, runs the next backend in the order, and the output equals the reference."""
    first, *rest = BACKENDS + ["reference"]
    _refusing(monkeypatch, first, variant)
    cfg = attnplan.load_config(backends=[first, *rest], plan_cache={"disk": False})
    x = make_inputs(2, 4, 2, 32, [10, 3], device=DEVICE, generator=gen)
    w = attnplan.DecodeWrapper(cfg)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, **kwargs)
    assert w.backend.name == rest[0]
    assert [n for n, _ in w.skipped] == [first]
    (reasons,) = [r for _, r in w.skipped]
    assert any(variant in r and "not served" in r for r in reasons), reasons
    assert variant in w.explain() and f"skipped {first}" in w.explain()
    out = poison(torch.empty_like(x.q))
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, out=out)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale,
                                 window_left=kwargs.get("window_left", -1), soft_cap=kwargs.get("logits_soft_cap", 0.0))
    assert_close_to_reference(out, ref, torch.float16)


def test_dispatch_error_names_every_backend_and_its_reason(monkeypatch):
    """No backend in the order serves the variant: ``NoBackendError`` gives the problem's shapes and every
    backend's reason; a forced backend that refuses gets its reason in the error too."""
    order = BACKENDS + ["reference"]
    for name in order:
        _refusing(monkeypatch, name, "softcap")
    x = make_inputs(1, 4, 2, 32, [10], device=DEVICE)
    cfg = attnplan.load_config(backends=order, plan_cache={"disk": False})
    with pytest.raises(attnplan.NoBackendError) as e:
        attnplan.DecodeWrapper(cfg).plan(x.q, x.k_cache, x.v_cache, x.seq_lens, logits_soft_cap=10.0)
    msg = str(e.value)
    assert "heads 4/2, head_dim 32" in msg
    for name in order:
        assert f"  {name}: " in msg and "['softcap'] not served" in msg
    with pytest.raises(attnplan.NoBackendError, match=r"reference: variants \['softcap'\] not served"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, logits_soft_cap=10.0, backend="reference")


def _in_threads(fns, timeout: float = 120) -> None:
    """Run each of ``fns`` in its own thread, all released at once; join them within ``timeout`` and raise the first
    error any of them raised."""
    import threading

    start, errors = threading.Barrier(len(fns)), []

    def body(f):
        try:
            start.wait(timeout)
            f()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(f,), daemon=True) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_decode_on_one_backend_at_once(backend, gen):
    """Several Python threads decoding at once on one backend (a serving loop's workers) each get their own
    problem's attention. On the CPU the kernels run in Triton's interpreter / numba's simulator, which run one
    kernel at a time: the backend serializes those launches (an unserialized second launch moved the first's
    program ids, or found the other launch's simulated ``cuda`` module, and raised)."""
    cases = [make_inputs(2, 4, 2, 32, [40, 7], page_size=16, dtype=torch.float16, generator=gen, device=DEVICE),
             make_inputs(3, 8, 2, 16, [33, 0, 50], dtype=torch.float32, generator=gen, device=DEVICE),
             make_inputs(1, 2, 1, 64, [70], page_size=8, dtype=torch.bfloat16, generator=gen, device=DEVICE)]
    ctx = attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))

    def worker(x):
        def f():
            ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
            for _ in range(3):
                out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend,
                                      config=ctx, seq_lens_host=x.seq_lens.tolist())
                assert_close_to_reference(out, ref, x.q.dtype)
        return f

    _in_threads([worker(x) for x in cases])
