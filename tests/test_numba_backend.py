"""The ``numba`` backend against the float64 reference: partial states split by split, the merge
against :func:`attnplan.state.merge_states`, the single pass, and ``attnplan.decode``.

On CPU (CI: ``NUMBA_ENABLE_CUDASIM=1``) the kernels run in numba's CUDA simulator at small sizes;
the module is skipped when the backend is not available. ``gpu``-marked tests add realistic sizes,
CUDA-graph replay and 64-bit page offsets on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time

import functools

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.problem import DecodeProblem
from attnplan.state import PartialState, merge_states
from attnplan.testing import DecodeCase, assert_close_to_reference, make_inputs, poison

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


Case = functools.partial(DecodeCase, dtype="fp16", splits=(1,))


def _inputs(case: Case, gen, device=DEVICE):
    hq, hkv = case.heads
    return make_inputs(len(case.lens), hq, hkv, case.head_dim, case.lens, q_len=case.q_len, page_size=case.page,
                       dtype=DT[case.dtype], device=device, generator=gen)


def _plan(x, num_splits: int, **kernel):
    """A numba plan for ``x`` with ``num_splits`` forced; ``kernel`` overrides thread-layout keys."""
    w = attnplan.DecodeWrapper(backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits)
    assert plan.backend == "numba"
    if kernel:
        plan = dataclasses.replace(plan, kernel={**plan.kernel, **kernel})
    return plan


def _params(cases):
    return [pytest.param(c, n, id=f"{c.id}-s{n}") for c in cases for n in c.splits]


# Small shapes: the simulator runs every CUDA thread in Python. Lengths cover 0, 1, a page
# boundary (16) and one past it (17); groups 1, 4 and 7; q_len 1 and 3.
PARTIAL_CASES = [
    Case((2, 2), 16, (0, 1, 33), dtype="fp16", splits=(3,), tags=("gqa1",)),
    Case((4, 1), 32, (16, 17), q_len=3, page=16, dtype="bf16", splits=(3,), tags=("page-boundary",)),
    Case((7, 1), 16, (15, 1, 0), page=4, dtype="fp32", splits=(2,), tags=("group7",)),
    Case((8, 2), 24, (9, 4), page=1, dtype="bf16", splits=(4,), tags=("page1",)),
    Case((4, 1), 16, (40,), page=16, dtype="fp16", splits=(16,), tags=("more-splits-than-chunks",)),
    Case((4, 1), 32, (1, 2), q_len=3, dtype="bf16", splits=(2,), tags=("rows-with-nothing-visible",)),
]


@pytest.mark.parametrize("case,num_splits", _params(PARTIAL_CASES))
def test_partial_states_match_reference_per_split(case, num_splits, gen):
    """Each split's (o, lse) against ``reference.partial`` in fp32 tolerance, written into a NaN-filled
    buffer with two spare splits (which must stay untouched)."""
    x = _inputs(case, gen)
    plan = _plan(x, num_splits)
    assert plan.num_splits == num_splits and not plan.single_pass
    b, ql, hq, d = x.q.shape
    state = PartialState.empty(b, ql, hq, num_splits + 2, d, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                            plan.chunk_size, plan.num_splits)
    for s in range(num_splits):
        assert_close_to_reference(state.o[:, :, :, s], ref.o[:, :, :, s], F32_TOL, what=f"o of split {s}")
        assert_close_to_reference(state.lse[:, :, :, s], ref.lse[:, :, :, s], F32_TOL, what=f"lse of split {s}")
    assert torch.isnan(state.o[:, :, :, num_splits:]).all() and torch.isnan(state.lse[:, :, :, num_splits:]).all(), \
        "partial wrote beyond plan.num_splits"


def test_empty_splits_and_empty_rows_are_zero_and_neg_inf(gen):
    """A zero-length sequence, splits past a sequence's end, and queries with nothing visible in a
    chunk all give exactly o = 0, lse = -inf (never NaN, never +inf)."""
    x = _inputs(Case((4, 1), 16, (0, 3), q_len=3, dtype="bf16"), gen)
    plan = _plan(x, 4)
    state = PartialState.empty(2, 3, 4, 4, 16, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    chunk = plan.chunk_size
    assert chunk >= 3
    # sequence 0 (length 0): every split empty; sequence 1: splits >= 1 start past its end
    for b, s in [(0, 0), (0, 1), (0, 3), (1, 1), (1, 2), (1, 3)]:
        assert torch.equal(state.o[b, :, :, s], torch.zeros_like(state.o[b, :, :, s]))
        assert torch.isneginf(state.lse[b, :, :, s]).all()
    # sequence 1, length 3, q_len 3: query 0 sees position 0 only; all its split-0 rows are live
    assert torch.isfinite(state.lse[1, :, :, 0]).all()


def test_row_with_no_visible_position_in_a_live_chunk(gen):
    """Length 1 with q_len 3: queries 0 and 1 see nothing, query 2 sees position 0, in one chunk."""
    x = _inputs(Case((4, 1), 16, (1,), q_len=3, dtype="fp32"), gen)
    plan = _plan(x, 2)
    state = PartialState.empty(1, 3, 4, 2, 16, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    assert torch.isneginf(state.lse[0, :2, :, 0]).all()
    assert torch.equal(state.o[0, :2, :, 0], torch.zeros_like(state.o[0, :2, :, 0]))
    # query 2 attends to exactly one position: o = v[0], lse = scale * q.k
    v0 = x.v_cache[0, 0, 0].double().cpu()
    assert torch.allclose(state.o[0, 2, :, 0].double().cpu(), v0.expand(4, 16), atol=1e-6)
    expect = (x.q[0, 2].double().cpu() @ x.k_cache[0, 0, 0].double().cpu()) * x.sm_scale
    assert torch.allclose(state.lse[0, 2, :, 0].double().cpu(), expect, atol=1e-5)


def test_last_split_runs_on_past_the_planned_length(gen):
    """A plan made for length 20 (2 splits) serves a length 30 tokens past the plan's reach: the last
    split covers [chunk, L). The chunk is the backend's tile-aligned one (16 tokens under the
    simulator, up to 256 on a GPU), so L is taken from the plan."""
    hq, hkv, d = 4, 1, 16
    x = make_inputs(1, hq, hkv, d, [20], page_size=4, capacity=1024, dtype=torch.bfloat16, device=DEVICE,
                    generator=gen)
    plan = _plan(x, 2)
    assert plan.num_splits == 2 and plan.max_tokens + 30 <= 1024
    x.seq_lens.fill_(plan.max_tokens + 30)
    state = PartialState.empty(1, 1, hq, 2, d, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, 2)
    assert_close_to_reference(state.o, ref.o, F32_TOL, what="o")
    assert_close_to_reference(state.lse, ref.lse, F32_TOL, what="lse")
    out = poison(torch.empty_like(x.q))
    BACKEND.run(plan, x, state, out)
    full, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, full, torch.bfloat16)


# -- merge -------------------------------------------------------------------------------------------

def _random_state(batch, q_len, heads, splits, d, gen, empty_frac=0.3):
    o = torch.randn(batch, q_len, heads, splits, d, generator=gen)
    lse = torch.randn(batch, q_len, heads, splits, generator=gen) * 3
    empty = torch.rand(batch, q_len, heads, splits, generator=gen) < empty_frac
    empty[0, 0, 0] = True  # one all-empty row
    lse[empty] = float("-inf")
    o[empty] = float("nan")  # an empty split's o must never be read (merge_states masks it too)
    return PartialState(o.to(DEVICE), lse.to(DEVICE))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_merge_matches_merge_states(dtype, num_splits, gen):
    """The merge kernel against ``merge_states`` (float64) over the first ``plan.num_splits`` splits of a
    buffer with NaN-filled spare splits; an all-empty row gives 0 / -inf."""
    x = _inputs(Case((4, 2), 16, (20, 5), q_len=2, dtype=dtype), gen)
    plan = dataclasses.replace(_plan(x, max(num_splits, 2)), num_splits=num_splits)
    st = _random_state(2, 2, 4, num_splits, 16, gen)
    buf = PartialState.empty(2, 2, 4, num_splits + 2, 16, device=DEVICE).fill_(float("nan"))
    buf.o[:, :, :, :num_splits] = st.o
    buf.lse[:, :, :, :num_splits] = st.lse
    out = poison(torch.empty(2, 2, 4, 16, dtype=DT[dtype], device=DEVICE))
    lse = poison(torch.empty(2, 2, 4, device=DEVICE))
    BACKEND.merge(plan, buf, out, lse)
    ref_o, ref_lse = reference.merge(st)
    assert_close_to_reference(out, ref_o, DT[dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    assert torch.equal(out[0, 0, 0].float(), torch.zeros(16, device=DEVICE)) and torch.isneginf(lse[0, 0, 0])
    out2 = poison(torch.empty_like(out))
    BACKEND.merge(plan, buf, out2, None)  # without lse
    assert torch.equal(out2, out)


def test_merge_seed_003_worked_example():
    """Scores [0, ln2, ln3, ln4] and V [1, 2, 4, 8] in two splits merge to 4.9 (not the naive 3.976)."""
    def state(scores, values):
        s = torch.tensor(scores, dtype=torch.float64)
        lse = torch.logsumexp(s, 0)
        return (torch.exp(s - lse) * torch.tensor(values, dtype=torch.float64)).sum(), lse

    (oa, la), (ob, lb) = state([0, math.log(2)], [1, 2]), state([math.log(3), math.log(4)], [4, 8])
    o = torch.stack([oa, ob]).float().view(1, 1, 1, 2, 1).expand(1, 1, 1, 2, 16).contiguous().to(DEVICE)
    lse = torch.stack([la, lb]).float().view(1, 1, 1, 2).to(DEVICE)
    x = make_inputs(1, 1, 1, 16, [32], dtype=torch.float32, device=DEVICE)
    plan = _plan(x, 2)
    out = poison(torch.empty(1, 1, 1, 16, device=DEVICE))
    out_lse = poison(torch.empty(1, 1, 1, device=DEVICE))
    BACKEND.merge(plan, PartialState(o, lse), out, out_lse)
    assert torch.allclose(out.cpu(), torch.full((1, 1, 1, 16), 4.9), atol=1e-5)
    assert abs(float(out_lse) - math.log(10)) < 1e-5


# -- single pass and the public API --------------------------------------------------------------------

SINGLE_CASES = [
    Case((4, 1), 32, (0, 17), page=16, dtype="bf16", tags=("zero-length-lse-sign",)),
    Case((7, 1), 16, (16, 5), q_len=3, dtype="fp16", tags=("group7",)),
    Case((2, 2), 24, (33, 1), page=4, dtype="fp32"),
]


@pytest.mark.parametrize("case", SINGLE_CASES, ids=lambda c: c.id)
def test_single_pass_matches_reference(case, gen):
    x = _inputs(case, gen)
    plan = _plan(x, 1)
    assert plan.single_pass and plan.grid[0] == 1
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], device=DEVICE))
    BACKEND.single_pass(plan, x, out, lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    out2 = poison(torch.empty_like(x.q))
    BACKEND.single_pass(plan, x, out2, None)  # lse not requested
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
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], device=DEVICE))
    res = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse,
                          backend="numba", num_splits=num_splits)
    assert res is out
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
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


# -- thread layouts, strides, word views ----------------------------------------------------------------

@pytest.mark.parametrize("lanes", [1, 4, 8])
def test_other_thread_layouts(lanes, gen):
    """Lanes per position 1 (no lane reduction), 4 (head_dim 24 = 6 words over 4 lanes: a partial
    slot) and 8 (one token group per program on the simulator)."""
    x = _inputs(Case((4, 1), 24, (29, 6), q_len=2, page=4, dtype="bf16"), gen)
    threads = 8 if not HAS_CUDA else 64
    plan = _plan(x, 3, lanes=lanes, threads=threads, unroll=2)
    state = PartialState.empty(2, 2, 4, 3, 24, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, 3)
    assert_close_to_reference(state.o, ref.o, F32_TOL, what="o")
    assert_close_to_reference(state.lse, ref.lse, F32_TOL, what="lse")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_strided_inputs_and_element_words(dtype, gen):
    """A non-contiguous q, a cache whose strides forbid the 8-byte word view (read element by
    element), and a partial-state buffer that is a slice of a larger one."""
    dt = DT[dtype]
    b, hq, hkv, d, lens = 2, 4, 2, 16, [21, 9]
    base = make_inputs(b, hq, hkv, d, lens, q_len=2, dtype=dt, device=DEVICE, generator=gen)
    q = base.q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Q, H, D] with H-major storage
    wide_k = torch.randn(b, 21, hkv, d + 2, generator=gen).to(dt).to(DEVICE)
    wide_v = torch.randn(b, 21, hkv, d + 2, generator=gen).to(dt).to(DEVICE)
    k, v = wide_k[..., 1:d + 1], wide_v[..., 1:d + 1]  # storage offset 1, row stride d + 2
    with pytest.raises(RuntimeError):
        k.view(torch.int64)
    x = dataclasses.replace(base, q=q, k_cache=k, v_cache=v)
    assert not q.is_contiguous()
    plan = _plan(x, 3)
    big = PartialState.empty(b, 2, hq, 5, d + 4, device=DEVICE).fill_(float("nan"))
    state = PartialState(big.o[:, :, :, 1:4, 2:d + 2], big.lse[:, :, :, 1:4])
    BACKEND.partial(plan, x, state)
    ref = reference.partial(q, k, v, x.seq_lens, None, x.sm_scale, plan.chunk_size, 3)
    assert_close_to_reference(state.o, ref.o, F32_TOL, what="o")
    assert_close_to_reference(state.lse, ref.lse, F32_TOL, what="lse")
    assert torch.isnan(big.lse[:, :, :, 0]).all() and torch.isnan(big.o[..., :2]).all()
    out = attnplan.decode(q, k, v, x.seq_lens, backend="numba", num_splits=2)
    ref_o, _ = reference.attention(q, k, v, x.seq_lens, None, x.sm_scale)
    assert_close_to_reference(out, ref_o, dt)


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
    assert any("rows" in r for r in be.supports(_problem(num_q_heads=16, num_kv_heads=1, q_len=5)))


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
    assert any("rows" in r for r in be.supports(_problem(num_q_heads=16, num_kv_heads=1, q_len=5, window_left=8)))


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
    x = _inputs(Case((4, 1), 16, (5,), dtype="bf16"), gen)
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
# partial states split by split (window bases, soft cap, fp8 words and single codes), the merge's and
# the single pass's sinks, the fp8 decoder, and the specialization flags.

FP8 = torch.float8_e4m3fn


def test_fp8_decoder_matches_torch_on_all_256_codes():
    """The kernels' e4m3fn decoder (run in a kernel: compiled on a GPU, simulated on the CPU) against
    torch's conversion for every code: normals, subnormals (exponent 0: m * 2^-9), +-0, +-448, and
    NaN for 0x7F / 0xFF."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(FP8).float()
    got = torch.full((256,), 12345.0)
    if HAS_CUDA and not kernels.SIM:
        dev_codes, dev_out = codes.cuda(), got.cuda()
        kernels.fp8_decode_kernel()[2, 128](kernels.cuda.as_cuda_array(dev_codes), kernels.cuda.as_cuda_array(dev_out))
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
    pytest.param(Case((8, 2), 32, (70, 1, 0, 9), q_len=2, page=16), dict(window=9), 3, id="window9-paged-q2"),
    pytest.param(Case((4, 1), 16, (40, 5), q_len=4), dict(window=2), 4, id="window2-q4-trailing-empty"),
    pytest.param(Case((7, 1), 32, (45, 1)), dict(cap=5.0), 2, id="softcap5-group7"),
    pytest.param(Case((4, 2), 32, (50, 17, 0), page=16, dtype="bf16"), dict(fp8=(0.05, 2.0)), 3,
                 id="fp8-words-paged"),
    pytest.param(Case((8, 2), 64, (40, 5), q_len=3, page=16, dtype="bf16"), dict(window=11, cap=20.0, fp8=(0.5, 1.5)),
                 3, id="window-softcap-fp8-q3"),
]


@pytest.mark.parametrize("case,variant,num_splits", VARIANT_PARTIAL_CASES)
def test_variant_partial_states_match_reference(case, variant, num_splits, gen):
    """Each split's state against ``reference.partial`` with the same chunk size and window base;
    spare splits of the buffer untouched."""
    x = _variant_inputs(_inputs(case, gen), **variant)
    w = attnplan.DecodeWrapper(backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits,
                  window_left=x.window_left, logits_soft_cap=x.soft_cap, k_scale=x.k_scale, v_scale=x.v_scale)
    assert plan.num_splits == num_splits and not plan.single_pass
    b, ql, hq, d = x.q.shape
    state = PartialState.empty(b, ql, hq, num_splits + 1, d, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                            num_splits, window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale,
                            v_scale=x.v_scale)
    assert_close_to_reference(state.o[:, :, :, :num_splits], ref.o, F32_TOL, what="o")
    assert_close_to_reference(state.lse[:, :, :, :num_splits], ref.lse, F32_TOL, what="lse")
    assert torch.isnan(state.lse[:, :, :, num_splits:]).all()


def test_window_rows_with_nothing_visible_and_chunk_bases(gen):
    """Window 2, q_len 4, length 2: queries 0 and 1 sit before position 0 (empty in every split), and
    with length 40 the chunks start at the window's base 40 - 4 - 2 = 34, so splits past the first
    cover nothing and are empty."""
    x = _variant_inputs(_inputs(Case((4, 1), 16, (2, 40), q_len=4, dtype="fp32"), gen), window=2)
    w = attnplan.DecodeWrapper(backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=3, window_left=2)
    state = PartialState.empty(2, 4, 4, 3, 16, device=DEVICE).fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    assert plan.chunk_size >= 6
    assert torch.isneginf(state.lse[0, :2]).all() and torch.equal(state.o[0, :2], torch.zeros_like(state.o[0, :2]))
    assert torch.isfinite(state.lse[1, :, :, 0]).all()
    assert torch.isneginf(state.lse[1, :, :, 1:]).all() and torch.equal(state.o[1, :, :, 1:],
                                                                         torch.zeros_like(state.o[1, :, :, 1:]))
    # query 3 of sequence 1 (position 39) sees exactly [37, 39]
    q, k = x.q[1, 3].double().cpu(), x.k_cache[1, 37:40, 0].double().cpu()
    expect = torch.logsumexp((q @ k.T) * x.sm_scale, dim=-1)
    assert torch.allclose(state.lse[1, 3, :, 0].double().cpu(), expect, atol=1e-5)


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
    plan = _plan(x, 2)
    fp8 = dataclasses.replace(x, k_cache=x.k_cache.to(FP8), v_cache=x.v_cache.to(FP8))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        BACKEND.partial(plan, fp8, PartialState.empty(1, 1, 4, 2, 16, device=DEVICE))


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_merge_with_sinks_matches_merge_states(dtype, gen):
    """The merge kernel's sinks against ``merge_states`` with sinks, an all-empty row giving o = 0 and
    lse = its sink; the same plan without sinks leaves them out."""
    x = _inputs(Case((4, 2), 16, (20, 5), q_len=2, dtype=dtype), gen)
    plan = dataclasses.replace(_plan(x, 3), num_splits=3)
    st = _random_state(2, 2, 4, 3, 16, gen)
    sinks = (torch.randn(4, generator=gen) * 2).to(DEVICE)
    out = poison(torch.empty(2, 2, 4, 16, dtype=DT[dtype], device=DEVICE))
    lse = poison(torch.empty(2, 2, 4, device=DEVICE))
    BACKEND.merge(plan, st, out, lse, sinks)
    ref_o, ref_lse = reference.merge(st, sinks)
    assert_close_to_reference(out, ref_o, DT[dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
    assert torch.equal(out[0, 0, 0].float(), torch.zeros(16, device=DEVICE)) and lse[0, 0, 0] == sinks[0]
    BACKEND.merge(plan, st, out, lse)
    ref_o, ref_lse = reference.merge(st)
    assert_close_to_reference(out, ref_o, DT[dtype])
    assert torch.isneginf(lse[0, 0, 0])


def test_single_pass_sinks_and_softcap(gen):
    """Single pass (sinks in the epilogue): a zero-length sequence gives o = 0, lse = sink; others
    match the reference, with and without a soft cap and an lse output."""
    x = _inputs(Case((8, 2), 32, (0, 17, 3), q_len=2, page=16, dtype="bf16"), gen)
    sinks = torch.randn(8, generator=gen).to(DEVICE)
    plan = _plan(x, 1)
    assert plan.single_pass
    for cap in (0.0, 3.0):
        xv = _variant_inputs(x, cap=cap, sinks=sinks)
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], device=DEVICE))
        BACKEND.single_pass(plan, xv, out, lse)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                           soft_cap=cap, sinks=sinks)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
        assert torch.equal(lse[0], sinks.expand(2, 8)) and torch.equal(out[0], torch.zeros_like(out[0]))
        out2 = poison(torch.empty_like(x.q))
        BACKEND.single_pass(plan, xv, out2, None)
        assert torch.equal(out2, out)


def test_variant_flags_are_specializations(gen):
    """Variants are compile-time flags: a variant-free launch keeps the variant-free kernel (same tag as
    before the variants existed), and each variant adds its own specialization; sinks never reach a
    partial kernel (the merge applies them)."""
    x = _inputs(Case((4, 1), 16, (20,), dtype="bf16"), gen)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2)
    plain = {s for s in kernels._DECODE_CACHE if s.head_dim == 16 and s.group == 4 and not s.paged}
    assert any(not (s.window or s.softcap or s.fp8 or s.sinks) for s in plain)
    assert all("window" not in s.tag() for s in plain if not s.window)
    sinks = torch.zeros(4, device=DEVICE)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="numba", num_splits=2, window_left=3, sinks=sinks)
    specs = set(kernels._DECODE_CACHE)
    assert any(s.window and not s.sinks and not s.single for s in specs)
    assert not any(s.sinks and not s.single for s in specs)
    assert any(s.sinks for s in kernels._MERGE_CACHE)
    with pytest.raises(ValueError, match="merge"):
        kernels.decode_kernel(next(s for s in specs if not s.single)._replace(sinks=True))


# -- simulator thread safety ---------------------------------------------------------------------------
# numba's simulator runs each CUDA thread as a Python thread, so a race between them (a missing barrier,
# or check-then-act on state the simulator fills lazily) only shows when a thread switch lands inside a
# window of a few bytecodes: the shared-array race below failed 3 of 3000 runs of the fp8 variant test
# (CI once: test_fp8_kv_per_head_scales[numba-7x1-paged16-fp8], max error 0.24). Under a "switch storm"
# every C call of a simulated thread yields the GIL first, which makes such a window likely to be hit.

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
    """Every thread of a simulated block gets the same ``cuda.shared.array`` per call site, even when
    the block's threads reach the allocations at once. (numba-cuda's simulator fills its per-launch
    {call site: array} dict by an unlocked check-then-insert, so two threads could each make their own
    array; kernels.py makes it atomic. Without that, this test failed 6 runs of 6.)"""
    n = 32
    kern = cuda.jit(_shared_probe)
    want = torch.tensor([n * (n - 1) / 2, n * (n - 1)]).expand(2, n, 2)
    with _thread_switch_storm():
        for _ in range(12):
            out = torch.full((2, n, 2), float("nan"))
            kern[2, n](kernels.sim_array(out.numpy()))
            assert torch.equal(out, want)


@pytest.mark.skipif(not kernels.SIM, reason="numba's simulator only")
def test_simulated_decode_is_identical_under_thread_switches(gen):
    """The CI failure's configuration (fp8 cache with per-head scales, bf16 q, GQA group 8, paged) run
    partial + merge (3 splits) and single pass 4 times each under a thread-switch storm: every run
    matches the reference and is bitwise identical to the first (a race between simulated threads
    would make some runs differ; before the shared-array fix about half the launches did)."""
    x = make_inputs(1, 8, 1, 32, [40], page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
    ks, vs = (torch.rand(1, generator=gen) + 0.5).float(), (torch.rand(1, generator=gen) + 0.5).float()
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, k_scale=ks, v_scale=vs)
    with _thread_switch_storm():
        for splits in (3, 1):
            first = None
            for _ in range(4):
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
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], device="cuda"))
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse, backend="numba",
                    num_splits=num_splits)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, DT[case.dtype])
    assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_partial_states_match_reference(page, gen):
    x = _inputs(Case((32, 8), 128, (4097, 0, 1000), q_len=2, page=page, dtype="bf16"), gen)
    plan = _plan(x, 5)
    state = PartialState.empty(3, 2, 32, 7, 128, device="cuda").fill_(float("nan"))
    BACKEND.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, 5)
    assert_close_to_reference(state.o[:, :, :, :5], ref.o, F32_TOL, what="o")
    assert_close_to_reference(state.lse[:, :, :, :5], ref.lse, F32_TOL, what="lse")
    assert torch.isnan(state.o[:, :, :, 5:]).all()
    out = poison(torch.empty_like(x.q))
    BACKEND.merge(plan, state, out, None)
    o, _ = merge_states(PartialState(ref.o, ref.lse))
    assert_close_to_reference(out, o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_cuda_graph_replay_follows_new_lengths(page, gen):
    """Capture once with a capacity plan, change seq_lens in place, replay: equals the reference at
    the new lengths (cases.yaml graph-stale-splits, legacy-stream-launch)."""
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
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
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
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert NumbaBackend.compile_times and all(t > 0 for t in NumbaBackend.compile_times.values())


@pytest.mark.gpu
@pytest.mark.parametrize("element_offset", [0, 1], ids=["int64-words", "element-reads"])
def test_gpu_page_offsets_beyond_int32(element_offset, gen):
    """cases.yaml int32-page-offset: pages past 131,072 of 16 x 8 x 128 elements, so element offsets
    exceed 2^31 (and byte offsets 2^32). With a storage offset of one element the cache cannot be
    read as 8-byte words and the kernel indexes single elements beyond 2^31."""
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
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], device="cuda"))
        attnplan.decode(xv.q, xv.k_cache, xv.v_cache, xv.seq_lens, xv.block_table, out=out, lse=lse, backend="numba",
                        num_splits=n, window_left=xv.window_left, logits_soft_cap=xv.soft_cap, sinks=sinks,
                        k_scale=xv.k_scale, v_scale=xv.v_scale)
        ref, ref_lse = reference.attention(xv.q, xv.k_cache, xv.v_cache, xv.seq_lens, xv.block_table, xv.sm_scale,
                                           window_left=xv.window_left, soft_cap=xv.soft_cap, sinks=sinks,
                                           k_scale=xv.k_scale, v_scale=xv.v_scale)
        assert_close_to_reference(out, ref, DT[case.dtype])
        assert_close_to_reference(lse, ref_lse, F32_TOL, what="lse")
