"""cuda_ptx on a CUDA GPU against the float64 reference (skipped without CUDA).

Covers contiguous and paged caches (page 1, 16, 64), GQA groups 1, 4, 7, 8, 16, q_len 1 and 4,
lengths 0, 1, page boundaries and 4097, fp16 / bf16 / fp32, forced split counts (more splits than
chunks included), partial states against ``reference.partial``, mixing with the reference merge,
CUDA-graph replay after in-place ``seq_lens`` rewrites, launches on a side stream, and 64-bit page
offsets; fp8 e4m3fn KV caches with per-KV-head scales (with window / soft-cap / sinks, split-K on tensor
cores by default and on CUDA cores as mode ``core``) and the fp8 decoders on all 256 codes. Outputs are NaN-poisoned before every run.

Tensor cores: split-K runs the ``mma.sync`` path by default for fp16 / bf16 with head_dim % 16 == 0
(the public API's cases above); mode ``core`` forces the CUDA-core split-K kernel (kernel option
``mma: false``, planned through the backend directly) on the same cases, and
:func:`test_mma_and_core_agree` compares the two kernels' partial states. Partial ``o`` of the
tensor-core kernel carries P's rounding to q's dtype (as in FlashAttention-2 / Triton's ``tl.dot``),
so it is compared at q's dtype tolerance; ``lse`` at fp32's. fp8 KV caches run split-K on the tensor cores
too (fp16 mmas: K / V by cvt.rn.f16x2.e4m3x2, bf16 q moved to fp16 with a power of two per n8-tile, P
rounded to fp16), so their partial ``o`` is compared at fp16's tolerance;
:func:`test_fp8_mma_and_core_agree` compares them with the CUDA-core fp8 kernel.
"""

from __future__ import annotations


import functools

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.config import load_config
from attnplan.state import PartialState, merge_states
from attnplan.testing import DecodeCase, assert_close_to_reference, make_inputs, poison

pytestmark = pytest.mark.gpu
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn
#: ``split_k``: the public API (tensor cores where they serve); ``core``: the CUDA-core split-K kernel
MODES = ("split_k", "core")


def _direct_plan(be, x, splits, **options):
    """A plan for ``x`` on this device with the backend's kernel options ``options`` (e.g. ``mma``),
    bypassing the public API (whose config has no ``mma`` key) and the plan cache."""
    from attnplan.device import device_info
    from attnplan.planner import make_plan
    from attnplan.testing import problem_of

    prob = problem_of(x)
    kc = be.kernel_config(prob, options, x.q.device)
    return make_plan(prob, device_info(x.q.device), load_config(), "cuda_ptx", kc, num_splits=splits,
                     partitions=be.partitions, merge_strategies=be.merge_strategies)


def _o_dtype(be, plan, x):
    """Tolerance dtype of partial ``o``: on tensor cores the dtype P is rounded to (q's; fp16 with an fp8
    cache), else fp32."""
    if not be.spec_for("partial", plan, x.q.device, x).mma:
        return torch.float32
    return torch.float16 if x.k_cache.dtype == FP8 else x.q.dtype


def _backend():
    from attnplan.backends import get_backend

    be = get_backend("cuda_ptx")
    ok, why = be.available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    return be


Case = functools.partial(DecodeCase, dtype="bf16", splits=(0,))


CASES = [
    Case((32, 8), 128, (4097, 1, 16, 0), page=16, splits=(0, 1, 7)),
    Case((8, 8), 64, (1, 17, 300), dtype="fp16", splits=(1, 3)),            # group 1, contiguous
    Case((16, 4), 128, (4097, 64), q_len=4, page=64, splits=(0, 5)),          # group 4, q_len 4, page 64
    Case((28, 4), 128, (256, 255, 257), page=16, splits=(0, 2)),             # group 7
    Case((64, 8), 128, (129, 64, 65), page=64, dtype="fp16", splits=(0, 5)),  # group 8
    Case((64, 4), 128, (3000, 17), page=16, splits=(0, 3)),                   # group 16
    Case((16, 4), 128, (100, 33, 3), q_len=4, page=1, splits=(1, 3)),         # page 1, L < q_len
    Case((8, 2), 256, (513, 0), q_len=4, dtype="fp32", splits=(1, 4)),        # fp32, head_dim 256
    Case((4, 1), 32, (40,), page=16, splits=(16,)),                           # more splits than chunks
    Case((32, 8), 96, (1000,), dtype="fp16", splits=(0, 3)),                  # non-pow2 head_dim
    Case((16, 2), 80, (700, 1), page=16, q_len=3, splits=(2,)),
    Case((4, 1), 128, (4096,), dtype="fp32", splits=(1, 4)),                  # interpreter-vs-gpu-tf32: ieee fp32
]


@pytest.mark.parametrize("partition", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_reference(case, partition, gen):
    """``split_k`` through the public API (tensor cores where they serve); ``core``: the CUDA-core split-K
    kernel (fp16 / bf16 cases with head_dim % 16 == 0 only)."""
    be = _backend()
    dtype = DT[case.dtype]
    if partition == "core" and (case.dtype == "fp32" or case.head_dim % 16):
        pytest.skip("the split_k cases already run on CUDA cores")
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=dtype, device="cuda", generator=gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for splits in case.splits:
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
        if partition == "core":
            plan = _direct_plan(be, x, splits, mma=False)
            assert not be.spec_for("partial", plan, x.q.device, x).mma
            st = None if plan.single_pass else PartialState.empty(*x.q.shape[:3], plan.num_splits, case.head_dim,
                                                                  device="cuda")
            be.run(plan, x, st, out, lse)
        else:
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
    """Partial states equal reference.partial split by split; they merge with the reference merge, and the
    cuda_ptx merge kernel merges reference states (states are one format whoever wrote them)."""
    be = _backend()
    dt = DT[dtype]
    x = make_inputs(3, 16, 4, 128, [1000, 40, 0], q_len=4, page_size=page, dtype=dt, device="cuda", generator=gen)
    w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, num_splits=6)
    assert plan.partition == "split_k"
    n = plan.num_splits
    st = PartialState.empty(3, 4, 16, n + 2, 128, device="cuda").fill_(float("nan"))  # wider than the plan
    be.partial(plan, x, st)
    torch.cuda.synchronize()
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, n)
    assert_close_to_reference(st.o[:, :, :, :n], rp.o, _o_dtype(be, plan, x), "partial o")
    assert_close_to_reference(st.lse[:, :, :, :n], rp.lse, torch.float32, "partial lse")
    assert torch.isnan(st.lse[:, :, :, n:]).all(), "splits past the plan must stay untouched"
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    o2, l2 = merge_states(PartialState(st.o[:, :, :, :n], st.lse[:, :, :, :n]))
    assert_close_to_reference(o2, ref, torch.float32 if dt == torch.float32 else dt, "merge_states(cuda_ptx states)")
    assert_close_to_reference(l2, ref_lse, torch.float32, "merge_states lse")
    # reference states through the cuda_ptx merge kernel
    st2 = PartialState(rp.o.float().cuda(), rp.lse.float().cuda())
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(3, 4, 16, device="cuda"))
    be.merge(plan, st2, out, lse)
    torch.cuda.synchronize()
    assert_close_to_reference(out, ref, dt, "cuda_ptx merge of reference states")
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


def test_cuda_graph_replay_after_in_place_rewrites(gen):
    _backend()
    cap = 8192
    x = make_inputs(4, 32, 8, 128, [100] * 4, q_len=1, page_size=16, dtype=torch.bfloat16, device="cuda", capacity=cap,
                    generator=gen)
    w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles and loads outside capture
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
        assert_close_to_reference(out, ref, torch.bfloat16, f"graph replay at {lens}")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"graph replay lse at {lens}")


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


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("splits", [1, 5])
def test_variants_window_softcap_sinks(page, splits, gen):
    """Sliding window (chunks start at the window), soft-cap and sinks (merge / single-pass epilogue)."""
    _backend()
    x = make_inputs(3, 32, 8, 128, [4097, 300, 0], q_len=2, page_size=page, dtype=torch.bfloat16, device="cuda",
                    generator=gen, scale=2.0)
    sinks = (torch.randn(32, generator=gen) * 2).float().cuda()
    kw = dict(window_left=1000, logits_soft_cap=20.0, sinks=sinks)
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
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


def _fp8(x, gen):
    """x's cache in float8_e4m3fn (K / 4, V x 2 before rounding) and per-KV-head scales in [0.5, 1.5)."""
    hkv = x.k_cache.shape[2]
    kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
    ks = (torch.rand(hkv, generator=gen, device=gen.device) + 0.5).float().cuda()
    vs = (torch.rand(hkv, generator=gen, device=gen.device) + 0.5).float().cuda()
    return kc, vc, ks, vs


def _fp8_inputs(case, gen):
    """A case's inputs with the cache in float8_e4m3fn and per-KV-head scales (:func:`_fp8`), as DecodeInputs."""
    from attnplan.backends.base import DecodeInputs

    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=DT[case.dtype], device="cuda", generator=gen, scale=2.0 if case.cap else 1.0)
    kc, vc, ks, vs = _fp8(x, gen)
    sinks = (torch.randn(hq, generator=gen) * 2).float().cuda() if case.sinks else None
    return DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=case.window,
                        soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("partition", MODES)
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.id)
def test_fp8_kv_matches_reference(case, partition, gen):
    """float8_e4m3fn K / V, per-KV-head scales, q bf16 / fp16, against the float64 reference (which
    dequantizes k * k_scale[h], v * v_scale[h]); outputs, lse and partial states. ``split_k`` (public API)
    runs the tensor cores, ``core`` the CUDA-core split-K kernel (kernel option ``mma: false``)."""
    be = _backend()
    dtype = DT[case.dtype]
    x = _fp8_inputs(case, gen)
    kc, vc, ks, vs, sinks = x.k_cache, x.v_cache, x.k_scale, x.v_scale, x.sinks
    kw = dict(window_left=case.window, logits_soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=case.window,
                                       soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)
    for splits in case.splits:
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
        if partition == "core":
            plan = _direct_plan(be, x, splits, mma=False)
            st = None if plan.single_pass else PartialState.empty(*x.q.shape[:3], plan.num_splits, case.head_dim,
                                                                  device="cuda")
            be.run(plan, x, st, out, lse)
        else:
            w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
            plan = w.plan(x.q, kc, vc, x.seq_lens, x.block_table, sm_scale=x.sm_scale, num_splits=splits, **kw)
            assert plan.partition == "split_k"
            w.run(x.q, kc, vc, x.seq_lens, x.block_table, out=out, lse=lse)
        spec = be.spec_for("partial", plan, x.q.device, x)
        assert spec.kv_fp8 and spec.mma is (partition == "split_k")
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, dtype, f"out (num_splits={splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (num_splits={splits})")
        if not plan.single_pass:
            st = PartialState.empty(*x.q.shape[:3], plan.num_splits, case.head_dim, device="cuda").fill_(float("nan"))
            be.partial(plan, x, st)
            torch.cuda.synchronize()
            rp = reference.partial(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                                   plan.num_splits, window_left=case.window, soft_cap=case.cap, k_scale=ks, v_scale=vs)
            assert_close_to_reference(st.o, rp.o, _o_dtype(be, plan, x), "partial o")
            assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")


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


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.id)
def test_mma_and_core_agree(case, gen):
    """The tensor-core and CUDA-core split-K kernels on the same inputs and plans: partial states within
    q's dtype tolerance of the reference (o) and fp32's (lse), and of each other."""
    dtype = DT[case.dtype]
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=dtype, device="cuda", generator=gen)
    _check_mma_and_core(case, x, {}, partial_o_dtype=dtype, fp8=False)


def _check_mma_and_core(case, x, vkw: dict, partial_o_dtype: torch.dtype, fp8: bool) -> None:
    """Run the tensor-core and CUDA-core kernels on ``x`` for each of the case's split counts: outputs and
    lse against the float64 reference (variants ``vkw``); the mma path's partial states against
    ``reference.partial`` (o at ``partial_o_dtype``'s tolerance, lse at fp32's), and against the CUDA-core
    states where both plans chunk alike."""
    be = _backend()
    dtype = DT[case.dtype]
    tag = "fp8 mma" if fp8 else "mma"
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, **vkw)
    for splits in case.splits:
        states = {}
        for mma in (True, False):
            plan = _direct_plan(be, x, splits, mma=mma)
            spec = be.spec_for("partial", plan, x.q.device, x)
            assert spec.mma is mma and plan.kernel["mma"] is mma and (spec.kv_fp8 or not fp8)
            out = poison(torch.empty_like(x.q))
            lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
            if plan.single_pass:
                be.single_pass(plan, x, out, lse)
            else:
                st = PartialState.empty(*x.q.shape[:3], plan.num_splits, case.head_dim, device="cuda")
                be.partial(plan, x, st)
                be.merge(plan, st, out, lse)
                states[mma] = (plan.chunk_size, plan.num_splits, st)
            torch.cuda.synchronize()
            assert_close_to_reference(out, ref, dtype, f"out (mma={mma}, splits={splits})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (mma={mma}, splits={splits})")
        if True in states:
            chunk, n, st = states[True]
            rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, chunk, n, **vkw)
            assert_close_to_reference(st.o, rp.o, partial_o_dtype, f"partial o ({tag})")
            assert_close_to_reference(st.lse, rp.lse, torch.float32, f"partial lse ({tag})")
            if False in states and states[False][:2] == (chunk, n):  # same chunks: the kernels' states agree
                assert_close_to_reference(st.o, states[False][2].o.double(), partial_o_dtype, "partial o mma vs core")
                assert_close_to_reference(st.lse, states[False][2].lse.double(), torch.float32, "lse mma vs core")


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
    """fp8 KV: the tensor-core and CUDA-core split-K kernels on the same inputs: outputs and lse against the
    float64 reference; partial states within fp16's tolerance (mma: P rounded to fp16) / fp32's of the
    reference, and of each other where the two plans chunk alike."""
    x = _fp8_inputs(case, gen)
    vkw = dict(window_left=case.window, soft_cap=case.cap, k_scale=x.k_scale, v_scale=x.v_scale)
    _check_mma_and_core(case, x, vkw, partial_o_dtype=torch.float16, fp8=True)


@pytest.mark.parametrize("partition", MODES)
def test_fp8_decoder_all_256_codes(partition):
    """Every e4m3fn byte through the device decoders (split_k: the tensor cores' cvt.rn.f16x2.e4m3x2, or its
    integer fallback below sm_89; core: the CUDA-core integer decoder): a one-token partial state is
    V's row (all 256 codes, rotated by h for KV head h so each code takes several byte positions) x
    v_scale[h], exactly, NaN for 0x7f / 0xff, equal to torch's own float8 conversion."""
    be = _backend()
    from attnplan.backends.base import DecodeInputs

    hkv, d = 4, 256
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    v = torch.stack([codes.roll(h) for h in range(hkv)]).view(FP8).view(1, 1, hkv, d)
    k = torch.zeros_like(v)
    q = torch.randn(1, 1, hkv * 8, d, dtype=torch.bfloat16, device="cuda")
    v_scale = torch.tensor([2.0 ** (h - 2) for h in range(hkv)], device="cuda")
    x = DecodeInputs(q, k, v, torch.tensor([1], dtype=torch.int32, device="cuda"), None, 0.1,
                     k_scale=torch.ones(hkv, device="cuda"), v_scale=v_scale)
    if partition == "core":
        plan = _direct_plan(be, x, 2, mma=False)
    else:
        w = attnplan.DecodeWrapper(load_config(), backend="cuda_ptx")
        plan = w.plan(q, k, v, x.seq_lens, sm_scale=0.1, num_splits=2, k_scale=x.k_scale, v_scale=v_scale)
    assert be.spec_for("partial", plan, q.device, x).mma is (partition == "split_k")
    st = PartialState.empty(1, 1, hkv * 8, plan.num_splits, d, device="cuda").fill_(float("nan"))
    be.partial(plan, x, st)
    torch.cuda.synchronize()
    want = (v[0, 0].double() * v_scale.double().view(hkv, 1)).repeat_interleave(8, 0)
    o = st.o[0, 0, :, 0].double()
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
def test_in_kernel_merges_gpu(mode, fp8, gen):
    """The fused merge inside the partial kernel with programs racing on the device: b=3, 32/8/128, lengths
    4096 / 0 / 1000, q_len 2, paged 16, sinks, 16 and 64 splits, bf16 or fp8 KV; 5 runs each into poisoned
    buffers: every run within tolerance of the reference, bitwise identical, the counters back at zero."""
    from attnplan.backends.base import DecodeInputs
    from attnplan.device import device_info
    from attnplan.planner import make_plan
    from attnplan.testing import problem_of

    be = _backend()
    x = make_inputs(3, 32, 8, 128, [4096, 0, 1000], q_len=2, page_size=16, dtype=torch.bfloat16, device="cuda",
                    generator=gen)
    sinks = (torch.randn(32, generator=gen) * 2).float().cuda()
    kc, vc, ks, vs = x.k_cache, x.v_cache, None, None
    if fp8:
        kc, vc = (kc.float() / 4).to(FP8), (vc.float() * 2).to(FP8)
        ks, vs = (torch.rand(8, generator=gen) + 0.5).cuda(), (torch.rand(8, generator=gen) + 0.5).cuda()
    x = DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, sinks=sinks, k_scale=ks, v_scale=vs)
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, sinks=sinks,
                                       k_scale=ks, v_scale=vs)
    merge = "fused"
    prob = problem_of(x)
    kcfg = be.kernel_config(prob, {"mma": mode == "mma"}, x.q.device)
    cfg = load_config(split={"merge": merge})
    b, q_len, hq, d = x.q.shape
    for splits in (16, 64):
        plan = make_plan(prob, device_info(x.q.device), cfg, "cuda_ptx", kcfg, num_splits=splits,
                         partitions=be.partitions, merge_strategies=be.merge_strategies)
        assert plan.merge == merge and plan.num_splits == splits
        assert be.spec_for("partial", plan, x.q.device, x).merge == merge
        be.prepare(plan, x.q.device)
        ws = PartialState.empty(b, q_len, hq, plan.state_slots, d, device="cuda")
        counters = torch.zeros(plan.sync_words, dtype=torch.int32, device="cuda")
        runs = []
        for _ in range(5):
            out = poison(torch.empty_like(x.q))
            lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
            be.run(plan, x, ws, out, lse, counters)
            torch.cuda.synchronize()
            assert_close_to_reference(out, ref, torch.bfloat16, f"out ({merge}, {splits} splits)")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({merge}, {splits} splits)")
            assert int(counters.abs().sum()) == 0, "counters not reset"
            runs.append((out.clone(), lse.clone()))
        assert all(torch.equal(o, runs[0][0]) and torch.equal(ls, runs[0][1]) for o, ls in runs[1:])


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
    """Split-table rows may carry kernel options (``attnplan tune --row-options``; on an H200 8 KV warps per
    program with 2 stages measured fastest at 16-64 (sequence, KV head) pairs): 2 and 8 KV warps, through the config's backend_options,
    single pass and split with the separate and the fused merge, against the reference."""
    _backend()
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), page_size=case.page,
                    dtype=torch.bfloat16, device="cuda", generator=gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    cfg = load_config(backend_options={"cuda_ptx": options}, split={"merge": merge})
    for splits in case.splits:
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda"))
        w = attnplan.DecodeWrapper(cfg, backend="cuda_ptx")
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sm_scale=x.sm_scale, num_splits=splits)
        assert plan.kernel["num_warps"] == options["num_warps"]
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref, torch.bfloat16, f"out ({options}, {splits} splits, {plan.merge})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({options}, {splits} splits)")
