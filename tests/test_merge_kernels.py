"""Every backend's separate merge kernel against the float64 merge contract (:func:`attnplan.state.merge_states` over
the ragged workspace), at the launch geometries it takes for few rows over many units (one sequence, one KV head:
8 rows over hundreds of units).

The plan's device is given a real SM count so the backends take their few-rows geometry (Triton: column slices,
:func:`attnplan.backends.triton.merge_geometry`) even on the CPU interpreter. The workspace holds random states in
slot order with random unit counts per sequence (``workspace.meta``), empty states (``lse = -inf``, ``o`` NaN: never
weighed in), a wholly empty row, and sinks; outputs are poisoned before the launch, and rows of one-unit sequences
(written by the partial kernel, not the merge) must keep their poison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnplan
from attnplan.backends import Workspace, get_backend
from attnplan.schedule import NUM_TARGETS, Schedule
from attnplan.state import PartialState, merge_states
from attnplan.testing import DTYPES, assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = kernel_backends(DEVICE)


def _plan(backend, batch, q_len, heads, d, max_units_per_seq, sm_count, dtype=torch.float16, policy="forced"):
    """A separate-merge plan of ``backend`` for a 1-KV-head problem in ``dtype`` (the output's: cuda_ptx's merge checks
    it against the plan's) whose schedule (``policy``: ``forced``, or ``balanced``, a schedule sized from the lengths,
    whose merge geometry counts on long tails) allows ``max_units_per_seq`` units per sequence, the device's SM count
    set; and its workspace."""
    x = make_inputs(batch, heads, 1, d, [64] * batch, q_len=q_len, dtype=dtype, device=DEVICE)
    w = attnplan.DecodeWrapper(attnplan.load_config(split={"merge": "separate"}, plan_cache={"disk": False}),
                               backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2)
    targets = (0,) * NUM_TARGETS if policy == "forced" else (batch,) * NUM_TARGETS
    sched = Schedule(policy, plan.schedule.granule, 1, max_units_per_seq, targets, batch * max_units_per_seq)
    plan = dataclasses.replace(plan, schedule=sched, device=plan.device._replace(sm_count=sm_count))
    return plan, Workspace.allocate(plan, torch.device(DEVICE))


def _ragged(batch, q_len, heads, d, max_units, gen):
    """Random units per sequence (sequence 0 gets ``max_units``, the last one 1) and random states in their slots;
    about a quarter of the states empty (lse -inf, o NaN), and row (0, 0, 0) wholly empty."""
    units = torch.randint(1, max_units + 1, (batch,), generator=gen)
    units[0] = max_units
    units[-1] = 1
    indptr = torch.zeros(batch + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(units, 0)
    n = int(indptr[-1])
    o = torch.randn(1, q_len, heads, n, d, generator=gen)
    lse = torch.randn(1, q_len, heads, n, generator=gen) * 3
    empty = torch.rand(1, q_len, heads, n, generator=gen) < 0.25
    empty[0, 0, 0, : int(units[0])] = True
    lse[empty] = float("-inf")
    o[empty] = float("nan")
    return units, indptr, o, lse


def _fill(ws: Workspace, units, indptr, o, lse) -> None:
    n = o.shape[3]
    ws.state.fill_(float("nan"))
    ws.state.o[:, :, :, :n].copy_(o)
    ws.state.lse[:, :, :, :n].copy_(lse)
    b = units.numel()
    ws.meta[:b].copy_(indptr[:-1].to(torch.int32))
    ws.meta[b:2 * b].copy_(units.to(torch.int32))


def _check(be, plan, ws, units, indptr, o, lse, dtype, z):
    out = poison(torch.empty(units.numel(), o.shape[1], o.shape[2], o.shape[4], dtype=DTYPES[dtype], device=DEVICE))
    out_lse = poison(torch.empty(out.shape[:3], dtype=torch.float32, device=DEVICE))
    be.merge(plan, ws, out, out_lse, None if z is None else z.float().to(DEVICE))
    ref_o, ref_lse = merge_states(PartialState(o.double(), lse.double()), None if z is None else z.double(),
                                  indptr=indptr)
    many = units > 1
    assert_close_to_reference(out[many.to(out.device)], ref_o[many], DTYPES[dtype])
    assert_close_to_reference(out_lse[many.to(out.device)], ref_lse[many], torch.float32, what="lse")
    assert torch.isnan(out[~many.to(out.device)]).all() and torch.isnan(out_lse[~many.to(out.device)]).all(), \
        "the merge wrote rows of a one-unit sequence"
    return out, out_lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,q_len,heads,d,units,dtype,sinks", [
    (2, 1, 8, 128, 37, "bf16", False),   # 8 rows per sequence: 8 column slices of 16 dims
    (3, 2, 4, 64, 5, "fp16", True),      # fewer units than one load
    (2, 1, 4, 256, 130, "fp16", False),  # head_dim 256: 16 slices; 130 units: a partial last load
    (2, 1, 2, 96, 300, "fp32", True),    # head_dim not a power of two; more units than one load holds
])
def test_merge_kernel_few_rows_many_units(backend, batch, q_len, heads, d, units, dtype, sinks, gen):
    be = get_backend(backend)
    plan, ws = _plan(backend, batch, q_len, heads, d, units, sm_count=132, dtype=DTYPES[dtype])
    u, indptr, o, lse = _ragged(batch, q_len, heads, d, units, gen)
    _fill(ws, u, indptr, o, lse)
    z = torch.randn(heads, generator=gen) if sinks else None
    out, out_lse = _check(be, plan, ws, u, indptr, o, lse, dtype, z)
    if not sinks:  # the all-empty row: o = 0, lse = -inf exactly
        assert torch.all(out[0, 0, 0].float().cpu() == 0) and out_lse[0, 0, 0].item() == float("-inf")
    again, again_lse = _check(be, plan, ws, u, indptr, o, lse, dtype, z)
    assert torch.equal(again.nan_to_num(), out.nan_to_num()) and torch.equal(again_lse.nan_to_num(),
                                                                             out_lse.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_kernel_long_tail_geometry(backend, gen):
    """A schedule sized from the lengths whose rows fill the SMs (5 sequences x 8 query heads = 40 rows on 16 SMs):
    Triton still cuts each row into column slices (4 of 32 dims, 128 units per load: the 160 programs resident at 16
    per SM) and cuda_ptx runs 8 merge teams per row, as for one sequence's 8 rows; sequence 0 over 200 units among
    short ones, against the contract."""
    be = get_backend(backend)
    plan, ws = _plan(backend, 5, 1, 8, 128, 200, sm_count=16, dtype=torch.bfloat16, policy="balanced")
    if backend == "triton":
        from attnplan.backends.triton import merge_geometry

        assert merge_geometry(40, 200, 128, 16, long_tail=True) == (4, 32, 128) != merge_geometry(40, 200, 128, 16)
        L = be._launch(plan, ws, remember=False)  # the backend launches that geometry for this plan
        assert L.merge_grid == (40, 4) and (L.merge_const["BLOCK_D"], L.merge_const["BLOCK_S"]) == (32, 128)
    u, indptr, o, lse = _ragged(5, 1, 8, 128, 200, gen)
    u[1:] = torch.tensor([3, 1, 17, 1])
    indptr[1:] = torch.cumsum(u, 0)
    n = int(indptr[-1])
    o, lse = o[..., :n, :], lse[..., :n]
    _fill(ws, u, indptr, o, lse)
    _check(be, plan, ws, u, indptr, o, lse, "bf16", None)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the sink rule subtracts no equal infinities in any lane
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_kernel_sinks_and_nan(backend, gen):
    """The sink rule and NaN: a ``-inf`` sink is no sink (an all-empty row stays 0 / -inf, no NaN), a finite sink on
    an all-empty row gives o = 0, lse = z; NaN in a non-empty state's lse or o makes the row NaN, never an empty row
    (a merge that takes a NaN-ignoring max would see only empty states there)."""
    be = get_backend(backend)
    plan, ws = _plan(backend, 2, 1, 4, 32, 4, sm_count=8)
    u, indptr, o, lse = _ragged(2, 1, 4, 32, 4, gen)
    u[1] = 1
    indptr[2] = indptr[1] + 1
    lse[0, 0, :, :4] = float("-inf")  # sequence 0: every row all-empty ...
    lse[0, 0, 2, 1] = float("nan")  # ... except head 2: NaN lse beside empty states
    lse[0, 0, 3, 2] = 0.5
    o[0, 0, 3, 2] = torch.randn(32, generator=gen)
    o[0, 0, 3, 2, 5] = float("nan")  # head 3: one non-empty state with NaN in column 5
    _fill(ws, u, indptr, o, lse)
    z = torch.tensor([float("-inf"), 0.25, 1.0, 2.0])
    out = poison(torch.empty(2, 1, 4, 32, dtype=torch.float16, device=DEVICE))
    out_lse = poison(torch.empty(2, 1, 4, dtype=torch.float32, device=DEVICE))
    be.merge(plan, ws, out, out_lse, z.to(DEVICE))
    o0, l0 = out[0, 0].float().cpu(), out_lse[0, 0].cpu()
    assert torch.all(o0[0] == 0) and l0[0].item() == float("-inf"), "a -inf sink on an empty row"
    assert torch.all(o0[1] == 0) and l0[1].item() == 0.25, "a finite sink on an empty row"
    assert torch.isnan(o0[2]).all() and torch.isnan(l0[2]), "NaN lse beside empty states"
    assert torch.isnan(o0[3, 5]) and torch.isfinite(o0[3, :5]).all() and torch.isfinite(l0[3])


def test_triton_merge_geometry():
    """Few rows: column slices of at least 16 dims, up to ~2 programs per SM, loads of up to 256 units;
    rows that fill the SMs (or an unknown SM count) keep one program per row and 32 units per load, unless the
    schedule sizes units from the lengths and a row may hold more than 32 units."""
    from attnplan.backends.triton import merge_geometry

    assert merge_geometry(8, 256, 128, 132) == (8, 16, 256)
    assert merge_geometry(8, 16, 128, 132) == (8, 16, 16)
    assert merge_geometry(64, 40, 128, 132) == (4, 32, 64)
    assert merge_geometry(256, 40, 128, 132) == (1, 128, 32)
    assert merge_geometry(8, 40, 128, 0) == (1, 128, 32)
    assert merge_geometry(8, 3, 64, 132) == (4, 16, 4)
    for rows in (1, 3, 8, 50, 131):
        for d in (64, 96, 128, 256):
            slices, block_d, block_s = merge_geometry(rows, 500, d, 132)
            assert block_d >= 16 and slices * block_d >= d and block_s * block_d <= 4096
            assert rows * slices <= 2 * 2 * 132
            assert merge_geometry(rows, 500, d, 132, long_tail=True) == (slices, block_d, block_s)
    # a schedule from the lengths (long tails): rows that fill the SMs are sliced while the grid stays resident
    # (16 programs per SM: 2,112 on 132 SMs), from 1,056 rows on one program per row
    assert merge_geometry(512, 256, 128, 132, long_tail=True) == (4, 32, 128)
    assert merge_geometry(1024, 256, 128, 132, long_tail=True) == (2, 64, 64)
    assert merge_geometry(1056, 256, 128, 132, long_tail=True) == (2, 64, 64)
    assert merge_geometry(1057, 256, 128, 132, long_tail=True) == merge_geometry(512, 256, 128, 132) == (1, 128, 32)
    assert merge_geometry(132, 256, 256, 132, long_tail=True) == (16, 16, 256)
    assert merge_geometry(512, 256, 128, 0, long_tail=True) == (1, 128, 32)
    # rows of at most one 32-unit load (a live plan of short sequences) keep one program per row
    assert merge_geometry(512, 32, 128, 132, long_tail=True) == (1, 128, 32)
    assert merge_geometry(512, 33, 128, 132, long_tail=True) == (4, 32, 64)
