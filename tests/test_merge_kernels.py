"""Every backend's merge kernel against the float64 merge contract (:func:`attnplan.state.merge_states`),
at the launch geometries it takes for few rows over many splits (e.g. one sequence with one KV head: 8 rows over hundreds of splits).

The plan's device is given a real SM count so the backends take their few-rows geometry (Triton:
column slices, :func:`attnplan.backends.triton.merge_geometry`) even on the CPU interpreter.
States are random, with empty splits (``lse = -inf``, ``o`` NaN: read but never weighed in), an
all-empty row, and sinks; outputs are poisoned before the launch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnplan
from attnplan.backends import get_backend
from attnplan.state import PartialState, merge_states
from attnplan.testing import DTYPES, assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = kernel_backends(DEVICE)


def _states(batch, q_len, heads, splits, d, gen):
    """Random states ``o [B, Q, H, S, D]`` fp32 and ``lse``; about a quarter of the splits empty (lse -inf,
    o NaN), and row (0, 0, 0) wholly empty."""
    o = torch.randn(batch, q_len, heads, splits, d, generator=gen)
    lse = torch.randn(batch, q_len, heads, splits, generator=gen) * 3
    empty = torch.rand(batch, q_len, heads, splits, generator=gen) < 0.25
    empty[0, 0, 0] = True
    lse[empty] = float("-inf")
    o[empty] = float("nan")
    return o, lse


def _plan(backend, heads, d, splits, sm_count):
    """A plan of ``backend`` for a 1-KV-head problem, with ``num_splits`` and the device's SM count set."""
    x = make_inputs(1, heads, 1, d, [64], dtype=torch.float16, device=DEVICE)
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2)
    return dataclasses.replace(plan, num_splits=splits, device=dict(plan.device, sm_count=sm_count))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,q_len,heads,d,splits,dtype,sinks", [
    (1, 1, 8, 128, 37, "bf16", False),   # 8 rows: 8 column slices of 16 dims
    (1, 2, 4, 64, 5, "fp16", True),      # fewer splits than one load
    (2, 1, 4, 256, 130, "fp16", False),  # head_dim 256: 16 slices; 130 splits: a partial last load
    (1, 1, 2, 96, 300, "fp32", True),    # head_dim not a power of two; more splits than one load holds
])
def test_merge_kernel_few_rows_many_splits(backend, batch, q_len, heads, d, splits, dtype, sinks, gen):
    o, lse = _states(batch, q_len, heads, splits, d, gen)
    z = torch.randn(heads, generator=gen) if sinks else None
    ref_o, ref_lse = merge_states(PartialState(o.double(), lse.double()), z.double() if sinks else None)
    plan = _plan(backend, heads, d, splits, sm_count=132)
    state = PartialState(o.to(DEVICE), lse.to(DEVICE))
    out = poison(torch.empty(batch, q_len, heads, d, dtype=DTYPES[dtype], device=DEVICE))
    out_lse = poison(torch.empty(batch, q_len, heads, dtype=torch.float32, device=DEVICE))
    be = get_backend(backend)
    be.merge(plan, state, out, out_lse, z.to(DEVICE) if sinks else None)
    assert_close_to_reference(out, ref_o, DTYPES[dtype])
    assert_close_to_reference(out_lse, ref_lse, torch.float32, what="lse")
    if not sinks:  # the all-empty row: o = 0, lse = -inf exactly
        assert torch.all(out[0, 0, 0].float().cpu() == 0) and out_lse[0, 0, 0].item() == float("-inf")
    again = poison(torch.empty_like(out))
    again_lse = poison(torch.empty_like(out_lse))
    be.merge(plan, state, again, again_lse, z.to(DEVICE) if sinks else None)
    assert torch.equal(again, out) and torch.equal(again_lse.nan_to_num(), out_lse.nan_to_num())


def test_triton_merge_geometry():
    """Few rows: column slices of at least 16 dims, up to ~2 programs per SM, loads of up to 256 splits;
    rows that fill the SMs (or an unknown SM count) keep one program per row and 32 splits per load."""
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
