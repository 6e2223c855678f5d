"""cuda_ptx kernels executed on the CPU by the host emulation (``backends/cuda_ptx/emulate.py``),
against the float64 reference. No GPU: ``decode.cu`` is compiled as C++ with every CUDA thread a
fiber, and driven through the backend's own spec choice, input checks and ``kernelParams`` packing.
What it checks: indexing, GQA row mapping, chunk bounds, masks, paging, the online softmax, the
in-program warp merge and the merge kernel. What it cannot: PTX instruction behaviour, races,
performance (tests/test_cuda_ptx_gpu.py covers the device).
"""

from __future__ import annotations


import functools

import pytest
import torch

from attnplan import reference
from attnplan.config import load_config
from attnplan.device import CPU_STANDIN
from attnplan.planner import make_plan
from attnplan.problem import DecodeProblem, dtype_name
from attnplan.state import PartialState, merge_states
from attnplan.testing import DecodeCase, assert_close_to_reference, make_inputs, poison

emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the host emulation")

DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def be():
    return emulate.EmulatedCudaPtxBackend()


Case = functools.partial(DecodeCase, dtype="bf16", splits=(3,))


CASES = [
    Case((8, 2), 128, (37, 100, 0), splits=(1, 3)),                       # single pass and split, len 0
    Case((8, 2), 64, (1, 16, 17), page=16, dtype="fp16", splits=(1, 4)),  # page boundary
    Case((4, 1), 32, (40,), page=16, splits=(16,)),                       # more splits than chunks
    Case((16, 2), 128, (21, 9), q_len=4, page=1, splits=(3,)),             # page 1, q_len 4 (2 row groups)
    Case((7, 1), 96, (40, 3), page=4, dtype="fp32", splits=(2,)),          # group 7, non-pow2 head_dim
    Case((64, 4), 32, (30,), splits=(1, 2)),                               # group 16
    Case((8, 1), 256, (70,), page=64, dtype="bf16", splits=(2,)),          # group 8, head_dim 256, page 64
    Case((8, 2), 128, (21, 4), q_len=5, page=32, dtype="fp16", splits=(1, 3)),  # odd q_len, L < q_len
    Case((4, 4), 16, (9, 3), page=1, dtype="fp32", splits=(1, 3)),          # MHA, head_dim 16
    Case((28, 4), 64, (33,), q_len=2, page=16, splits=(2,)),               # 14 rows
    Case((8, 2), 128, (4097,), page=16, splits=(3,)),                       # a few hundred tiles
]


def _plan(be, x, splits):
    b, q_len, hq, d = x.q.shape
    lens = x.seq_lens.tolist()
    prob = DecodeProblem(b, hq, x.k_cache.shape[2], d, q_len, x.k_cache.shape[1] if x.paged else None,
                         dtype_name(x.q.dtype), dtype_name(x.q.dtype), max(lens), sum(lens))
    kc = be.kernel_config(prob, {}, torch.device("cpu"))
    return make_plan(prob, CPU_STANDIN, load_config(), "cuda_ptx", kc, num_splits=splits)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_emulated_kernels_match_reference(be, case, gen):
    dtype = DT[case.dtype]
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=dtype, generator=gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for splits in case.splits:
        plan = _plan(be, x, splits)
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
        if plan.single_pass:
            be.single_pass(plan, x, out, lse)
        else:
            st = PartialState.empty(*x.q.shape[:3], plan.num_splits + 1, case.head_dim).fill_(float("nan"))
            be.partial(plan, x, st)
            rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                   plan.chunk_size, plan.num_splits)
            n = plan.num_splits
            assert_close_to_reference(st.o[:, :, :, :n], rp.o, torch.float32, "partial o")
            assert_close_to_reference(st.lse[:, :, :, :n], rp.lse, torch.float32, "partial lse")
            assert torch.isnan(st.lse[:, :, :, n:]).all(), "a split beyond the plan was written"
            be.merge(plan, st, out, lse)
            # mixing: the reference merge of the kernel's states gives the same answer
            o2, l2 = merge_states(PartialState(st.o[:, :, :, :n], st.lse[:, :, :, :n]))
            assert_close_to_reference(o2, ref, torch.float32 if dtype == torch.float32 else dtype, "merge_states(o)")
        assert_close_to_reference(out, ref, dtype, f"out (splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (splits {splits})")


def test_emulated_merge_of_reference_states(be, gen):
    """The merge kernel on reference states (other producers), with empty rows and a padded buffer."""
    x = make_inputs(3, 8, 2, 64, [50, 0, 7], q_len=2, page_size=16, dtype=torch.float16, generator=gen)
    plan = _plan(be, x, 5)
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                           plan.num_splits)
    st = PartialState.empty(3, 2, 8, plan.num_splits + 3, 64).fill_(float("nan"))
    st.o[:, :, :, :plan.num_splits] = rp.o.float()
    st.lse[:, :, :, :plan.num_splits] = rp.lse.float()
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(3, 2, 8))
    be.merge(plan, st, out, lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")
    assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()


def test_emulated_seed_example(be):
    """Seed 003's worked example through the merge kernel: scores [0, ln2, ln3, ln4], V = [1, 2, 4, 8] -> 4.9."""
    import math

    s = torch.tensor([0.0, math.log(2), math.log(3), math.log(4)], dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    halves = [(s[:2], v[:2]), (s[2:], v[2:])]
    o = torch.zeros(1, 1, 1, 2, 16)
    lse = torch.zeros(1, 1, 1, 2)
    for i, (sc, vv) in enumerate(halves):
        lse[0, 0, 0, i] = float(torch.logsumexp(sc, 0))
        o[0, 0, 0, i, :] = float((torch.softmax(sc, 0) * vv).sum())
    x = make_inputs(1, 1, 1, 16, [4], dtype=torch.float32)
    plan = _plan(be, x, 2)
    out = torch.empty(1, 1, 1, 16)
    be.merge(plan, PartialState(o, lse), out, None)
    assert torch.allclose(out, torch.full_like(out, 4.9), atol=1e-6)


def test_emulation_reports_out_of_bounds_block_table(be, gen):
    """A block-table entry outside the cache makes the kernel read outside the inputs: reported, not silent."""
    x = make_inputs(1, 4, 1, 64, [20], page_size=16, dtype=torch.bfloat16, generator=gen)
    x.block_table[0, 1] = x.k_cache.shape[0] + 5
    plan = _plan(be, x, 1)
    with pytest.raises(emulate.EmulationError, match="outside every input buffer"):
        be.single_pass(plan, x, torch.empty_like(x.q), None)


def test_emulated_constants_match_host(be):
    from attnplan.backends.cuda_ptx.launch import make_spec

    spec = make_spec("partial", "bfloat16", 96, 7, 4, 16)
    k = be.kernel(spec)
    assert (k.constant("smem"), k.constant("tile"), k.constant("threads"), k.constant("rt")) == \
        (spec.smem_bytes, spec.tile_tokens, spec.threads, spec.rows_per_group)


VariantCase = functools.partial(DecodeCase, dtype="bf16", splits=(3,))


VARIANT_CASES = [
    VariantCase((8, 2), 64, (100, 30, 0, 5), q_len=3, page=16, window=20, splits=(1, 3)),   # window, spans pages
    VariantCase((8, 1), 128, (70, 9), window=0, splits=(1, 2)),                            # window 0: only itself
    VariantCase((4, 2), 32, (90,), page=1, dtype="fp32", window=33, splits=(4,)),
    VariantCase((8, 2), 64, (60, 1), q_len=2, cap=2.0, dtype="fp32", splits=(1, 3)),       # soft-cap bites
    VariantCase((8, 2), 64, (60, 0), page=16, sinks=True, dtype="fp16", splits=(1, 3)),     # sinks, empty row
    VariantCase((16, 2), 64, (80, 7), q_len=2, page=4, window=16, cap=5.0, sinks=True, splits=(1, 4)),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.id)
def test_emulated_variants_match_reference(be, case, gen):
    from attnplan.backends.base import DecodeInputs

    dtype = DT[case.dtype]
    hq, hkv = case.heads
    x0 = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                     dtype=dtype, generator=gen, scale=2.0 if case.cap else 1.0)
    sinks = (torch.randn(hq, generator=gen) * 2).float() if case.sinks else None
    x = DecodeInputs(x0.q, x0.k_cache, x0.v_cache, x0.seq_lens, x0.block_table, x0.sm_scale,
                     window_left=case.window, soft_cap=case.cap, sinks=sinks)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       window_left=case.window, soft_cap=case.cap, sinks=sinks)
    b, q_len, _, d = x.q.shape
    lens = list(case.lens)
    prob = DecodeProblem(b, hq, hkv, d, q_len, case.page, dtype_name(dtype), dtype_name(dtype), max(lens), sum(lens),
                         window_left=case.window, soft_cap=case.cap, has_sinks=case.sinks)
    assert be.supports(prob) == []
    kc = be.kernel_config(prob, {}, torch.device("cpu"))
    for splits in case.splits:
        plan = make_plan(prob, CPU_STANDIN, load_config(), "cuda_ptx", kc, num_splits=splits)
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
        be.run(plan, x, None if plan.single_pass else PartialState.empty(b, q_len, hq, plan.num_splits, d), out, lse)
        if not plan.single_pass:
            st = PartialState.empty(b, q_len, hq, plan.num_splits, d).fill_(float("nan"))
            be.partial(plan, x, st)
            rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                                   plan.num_splits, window_left=case.window, soft_cap=case.cap)
            assert_close_to_reference(st.o, rp.o, torch.float32, "partial o")
            assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse (no sink)")
        assert_close_to_reference(out, ref, dtype, f"out (splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (splits {splits})")


@pytest.mark.parametrize("chunk", [13, 24, 40])
def test_emulated_unaligned_chunks(be, chunk, gen):
    """Chunk sizes that are not multiples of the tile or the page: tiles self-align and mask."""
    import dataclasses

    x = make_inputs(2, 8, 2, 64, [100, 41], q_len=2, page_size=8, dtype=torch.float16, generator=gen)
    plan = _plan(be, x, 2)
    n = -(-100 // chunk)
    plan = dataclasses.replace(plan, chunk_size=chunk, num_splits=n, grid=(n, 2, 2), merge_grid=(2 * 2 * 8,))
    st = PartialState.empty(2, 2, 8, n, 64).fill_(float("nan"))
    be.partial(plan, x, st)
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, chunk, n)
    assert_close_to_reference(st.o, rp.o, torch.float32, "partial o")
    assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")
