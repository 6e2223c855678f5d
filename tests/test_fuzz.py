"""Property-based tests (hypothesis): random shapes, lengths, page tables and split counts,
each backend against the float64 reference. CI runs a fixed, small example budget on the CPU
(interpreter / simulator); set ATTNPLAN_FUZZ_EXAMPLES for a longer run (e.g. on the GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.problem import dtype_name
from attnplan.state import PartialState, merge_states
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
EXAMPLES = int(os.environ.get("ATTNPLAN_FUZZ_EXAMPLES", "12"))
#: numba-cuda compiles each new specialization for ~5-10 s on a GPU, and almost every drawn problem
#: is a new one: its GPU budget is a quarter of the others' unless set on its own
NUMBA_EXAMPLES = int(os.environ.get("ATTNPLAN_FUZZ_EXAMPLES_NUMBA", str(max(4, EXAMPLES // 4) if HAS_CUDA else EXAMPLES)))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_NUMBA = settings(FUZZ, max_examples=NUMBA_EXAMPLES)


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    head_dim = draw(st.sampled_from([16, 32, 40, 64] if not HAS_CUDA else [64, 80, 96, 128, 256]))
    batch = draw(st.integers(1, 3))
    q_len = draw(st.integers(1, 4))
    page = draw(st.sampled_from([None, 1, 4, 16]))
    max_len = 48 if not HAS_CUDA else 3000
    lens = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    splits = draw(st.sampled_from([0, 1, 2, 3, 5, 9]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(hq=hkv * group, hkv=hkv, d=head_dim, batch=batch, q_len=q_len, page=page, lens=lens, dtype=dtype,
                splits=splits, seed=seed)


@pytest.mark.parametrize("backend", [b for b in kernel_backends(DEVICE) if b != "numba"])
@FUZZ
@given(p=problems())
def test_fuzz_decode_against_reference(backend, p):
    _check(backend, p)


@pytest.mark.skipif("numba" not in kernel_backends(DEVICE), reason="numba backend not available")
@FUZZ_NUMBA
@given(p=problems())
def test_fuzz_decode_against_reference_numba(p):
    _check("numba", p)


def _check(backend: str, p: dict) -> None:
    x = make_inputs(p["batch"], p["hq"], p["hkv"], p["d"], p["lens"], q_len=p["q_len"], page_size=p["page"],
                    dtype=p["dtype"], device=DEVICE, generator=torch.Generator().manual_seed(p["seed"]))
    problem = attnplan.DecodeProblem(batch=p["batch"], num_q_heads=p["hq"], num_kv_heads=p["hkv"], head_dim=p["d"],
                                     q_len=p["q_len"], page_size=p["page"], q_dtype=dtype_name(p["dtype"]),
                                     kv_dtype=dtype_name(p["dtype"]), max_kv_len=max(p["lens"]))
    if get_backend(backend).supports(problem):
        return
    lse = torch.full(x.q.shape[:3], float("nan"), device=DEVICE)
    out = torch.full_like(x.q, float("nan"))
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, num_splits=p["splits"],
                    out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, p["dtype"])
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 9), rows=st.integers(1, 3), empty=st.lists(st.booleans(), min_size=9, max_size=9),
       seed=st.integers(0, 2**31 - 1))
def test_fuzz_merge_is_order_independent_and_ignores_empty(n, rows, empty, seed):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(rows, 1, 1, n, 4, generator=g, dtype=torch.float64)
    lse = torch.randn(rows, 1, 1, n, generator=g, dtype=torch.float64) * 10
    mask = torch.tensor(empty[:n])
    lse[..., mask] = float("-inf")
    o[..., mask, :] = 0
    a = merge_states(PartialState(o, lse))
    perm = torch.randperm(n, generator=g)
    b = merge_states(PartialState(o[..., perm, :], lse[..., perm]))
    assert torch.allclose(a[0], b[0], atol=1e-12)
    assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
    assert not torch.isnan(a[0]).any() and not torch.isnan(a[1]).any()
    keep = ~mask
    if keep.any():
        c = merge_states(PartialState(o[..., keep, :], lse[..., keep]))
        assert torch.allclose(a[0], c[0], atol=1e-12) and torch.allclose(a[1], c[1])
    else:
        assert torch.all(a[0] == 0) and torch.all(torch.isneginf(a[1]))
