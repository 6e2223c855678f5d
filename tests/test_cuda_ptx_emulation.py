"""cuda_ptx kernels executed on the CPU by the host emulation (``backends/cuda_ptx/emulate.py``),
against the float64 reference. No GPU: ``decode.cu`` is compiled as C++ with every CUDA thread a
fiber, and driven through the backend's own spec choice, input checks and ``kernelParams`` packing.
What it checks: indexing, GQA row mapping, chunk bounds, masks, paging, the online softmax, the
in-program warp merge (split-K), the tensor-core split-K path
(mode ``mma``: ldmatrix / mma.sync / movmatrix through simt.h's warp-collective twins, fragment
layouts, swizzled / padded ring rows, online softmax on fragments), the fp8 e4m3fn decoder and its
scales (CUDA cores), the fp8 tensor-core path (fp8 tiles read by ldmatrix as byte pairs, the permuted
K-dim / head_dim orders, e4m3 -> fp16 through the integer twin of cvt.rn.f16x2.e4m3x2, which is also
the sm_80 fallback, bf16 q moved to fp16 with a power of two per n8-tile), the merge kernel (one team per
row, and several teams per row combined through shared memory), the fused merge inside the partial kernel
(completion counters back at zero, programs run in permuted orders so another program is last), and
shared-memory races between warps (every emulated launch runs simt.h's race check). What it cannot:
PTX instruction behaviour (the twins implement the PTX ISA's documented fragment layouts; the device's
mma rounding differs), global-memory races and memory ordering between programs running at once (the
emulation runs them one at a time), performance (tests/test_cuda_ptx_gpu.py covers the device).

Modes: ``mma`` = split-K on tensor cores (the default for fp16 / bf16 with head_dim % 16 == 0),
``split_k`` = split-K on CUDA cores (``mma: false``). Partial ``o`` of the ``mma`` mode is
compared at q's dtype tolerance (P is rounded to q's dtype for the P.V mma, as in FlashAttention-2), with
an fp8 cache at fp16's (every fp8 mma is fp16: P rounds to fp16 whatever q's dtype).
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
from attnplan.testing import DecodeCase, assert_close_to_reference, make_inputs, poison, problem_of

emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
from attnplan.backends.cuda_ptx.spec import merge_spec  # noqa: E402 (after the import check)
pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the host emulation")

DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn
#: mode -> kernel option mma (the partition is split-K either way)
MODES = {"mma": True, "split_k": False}


@pytest.fixture(scope="module")
def be():
    b = emulate.EmulatedCudaPtxBackend()
    b.prebuild(_parametrized_specs(b))  # the parametrized tests' specializations, built in parallel
    return b


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
    Case((8, 2), 128, (4097,), page=16, splits=(1, 3)),                     # a few hundred tiles
]  # one split crosses block-table batches of 32 tiles (decode.cu, PageWindow): a CUDA-core split-K warp ~129 of
#    8 tokens (5 batches), a tensor-core warp 64-65 (3; warp 0's last tile holds one token)


def _plan(be, x, splits, mode="split_k", **options):
    """A split-K plan for ``x`` with the backend's kernel options for ``mode`` (a key of :data:`MODES`: the
    kernel option ``mma``, unless ``options`` sets it)."""
    options = {"mma": MODES[mode], **options}
    prob = problem_of(x)
    assert be.supports(prob) == []
    kc = be.kernel_config(prob, options, torch.device("cpu"))
    plan = make_plan(prob, CPU_STANDIN, load_config(), "cuda_ptx", kc, num_splits=splits, partitions=be.partitions)
    assert plan.partition == "split_k"
    assert plan.kernel["mma"] == bool(options["mma"]), plan.kernel
    assert be.spec_for("partial", plan, inputs=x).mma == bool(options["mma"])
    return plan


def _mma_ok(case) -> bool:
    return case.dtype in ("fp16", "bf16") and case.head_dim % 16 == 0


def _modes(cases, mma=None):
    """``(case, mode)`` params: every case on CUDA cores (``split_k``), and those at indices ``mma`` (default:
    every fp16 / bf16 case with head_dim a multiple of 16) on tensor cores (each emulated specialization is a
    C++ build of ~0.6 s: the subsets keep the file fast while covering contiguous and paged caches, GQA groups
    1 / 4 / 7 / 8, several row groups, q_len > 1, head_dim 16-256 and every variant)."""
    return [pytest.param(c, p, id=f"{c.id}-{p}") for i, c in enumerate(cases) for p in MODES
            if p == "split_k" or (p == "mma" and _mma_ok(c) and (mma is None or i in mma))]


def _o_dtype(mode, dtype, fp8=False):
    """Tolerance dtype of partial ``o``: fp32, or on tensor cores the dtype P is rounded to: q's, fp16
    with an fp8 cache."""
    return (torch.float16 if fp8 else dtype) if mode == "mma" else torch.float32


# tensor-core cases beyond CASES: group 1 with q_len 3, head_dim 80 (padded ring rows) with 24 rows in
# two n8-tiles, head_dim 96, 64 rows in 4 row groups of 2 n8-tiles
MMA_CASES = [
    Case((4, 4), 64, (9, 1, 0), q_len=3, page=4, dtype="fp16", splits=(1, 3)),
    Case((8, 1), 80, (77, 5), q_len=3, page=8, splits=(1, 2)),
    Case((8, 1), 96, (45, 2), q_len=2, dtype="fp16", splits=(2,)),
    Case((64, 2), 128, (50, 3), q_len=2, page=16, splits=(2,)),
]

CASE_PARAMS = _modes(CASES) + \
    [pytest.param(c, "mma", id=f"{c.id}-mma") for c in MMA_CASES]


@pytest.mark.parametrize("case,partition", CASE_PARAMS)
def test_emulated_kernels_match_reference(be, case, partition, gen):
    dtype = DT[case.dtype]
    hq, hkv = case.heads
    x = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                    dtype=dtype, generator=gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for splits in case.splits:
        plan = _plan(be, x, splits, partition)
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
            assert_close_to_reference(st.o[:, :, :, :n], rp.o, _o_dtype(partition, dtype), "partial o")
            assert_close_to_reference(st.lse[:, :, :, :n], rp.lse, torch.float32, "partial lse")
            assert torch.isnan(st.lse[:, :, :, n:]).all(), "a split beyond the plan was written"
            be.merge(plan, st, out, lse)
            # mixing: the reference merge of the kernel's states gives the same answer
            o2, l2 = merge_states(PartialState(st.o[:, :, :, :n], st.lse[:, :, :, :n]))
            assert_close_to_reference(o2, ref, torch.float32 if dtype == torch.float32 else dtype, "merge_states(o)")
        assert_close_to_reference(out, ref, dtype, f"out (splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (splits {splits})")


def test_emulated_two_vectors_per_lane(be, gen):
    """CUDA-core split-K over an fp32 head_dim-256 row: 64 vectors, two per lane (nv 2), one KV warp."""
    from attnplan.backends.cuda_ptx.spec import vector_layout

    assert vector_layout("float32", 256)["nv"] == 2
    x = make_inputs(2, 2, 1, 256, [45, 3], q_len=2, page_size=16, dtype=torch.float32, generator=gen)
    plan = _plan(be, x, 2, num_warps=1)
    st = PartialState.empty(2, 2, 2, 2, 256).fill_(float("nan"))
    be.partial(plan, x, st)
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, 2)
    assert_close_to_reference(st.o, rp.o, torch.float32, "partial o")
    assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")


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


def test_emulated_worked_merge_example(be):
    """The merge contract's worked example through the merge kernel: scores [0, ln2, ln3, ln4], V = [1, 2, 4, 8]
    split into two halves merge to 4.9 (averaging the halves' outputs would give 3.976)."""
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


@pytest.mark.parametrize("kv_dtype,mma", [(None, False), ("float8_e4m3fn", False), (None, True), ("float8_e4m3fn", True)])
def test_emulated_constants_match_host(be, kv_dtype, mma):
    from attnplan.backends.cuda_ptx.spec import make_spec, vector_layout

    spec = make_spec("partial", "bfloat16", 96, 7, 4, 16, kv_dtype=kv_dtype, mma=mma)
    k = be.kernel(spec)
    assert (k.constant("smem"), k.constant("tile"), k.constant("threads"), k.constant("rt")) == \
        (spec.smem_bytes, spec.tile_tokens, spec.threads, spec.rows_per_group)
    assert (k.constant("mma"), k.constant("ntw"), k.constant("rs")) == \
        (int(spec.mma), spec.n_tiles, spec.row_chunks)
    if mma:  # 28 rows: 4 n8-tiles in 2 row groups of 16 rows; 12 (fp8: 6) chunks per row, padded to 13 (7)
        assert (spec.row_groups, spec.rows_per_group, spec.n_tiles, spec.row_chunks) == \
            (2, 16, 2, 7 if kv_dtype else 13)
    if not mma:
        assert k.constant("lpt") == vector_layout(spec.kv_dtype, 96)["lpt"]


VariantCase = functools.partial(DecodeCase, dtype="bf16", splits=(3,))


VARIANT_CASES = [
    VariantCase((8, 2), 64, (100, 30, 0, 5), q_len=3, page=16, window=20, splits=(1, 3)),   # window, spans pages
    VariantCase((8, 1), 128, (70, 9), window=0, splits=(1, 2)),                            # window 0: only itself
    VariantCase((4, 2), 32, (90,), page=1, dtype="fp32", window=33, splits=(4,)),
    VariantCase((8, 2), 64, (60, 1), q_len=2, cap=2.0, dtype="fp32", splits=(1, 3)),       # soft-cap bites
    VariantCase((8, 2), 64, (60, 0), page=16, sinks=True, dtype="fp16", splits=(1, 3)),     # sinks, empty row
    VariantCase((16, 2), 64, (80, 7), q_len=2, page=4, window=16, cap=5.0, sinks=True, splits=(1, 4)),
    VariantCase((8, 2), 128, (61, 1), q_len=3, cap=2.0, window=40, splits=(1, 3), tags=("tc",)),  # tensor cores
]


def _variant_inputs(case, gen, fp8=False):
    """Inputs of a variant case; ``fp8``: the cache in float8_e4m3fn (K / 4, V x 2 before rounding) with
    per-KV-head scales in [0.5, 1.5)."""
    from attnplan.backends.base import DecodeInputs

    hq, hkv = case.heads
    x0 = make_inputs(len(case.lens), hq, hkv, case.head_dim, list(case.lens), q_len=case.q_len, page_size=case.page,
                     dtype=DT[case.dtype], generator=gen, scale=2.0 if case.cap else 1.0)
    sinks = (torch.randn(hq, generator=gen) * 2).float() if case.sinks else None
    kc, vc, ks, vs = x0.k_cache, x0.v_cache, None, None
    if fp8:
        kc, vc = (kc.float() / 4).to(FP8), (vc.float() * 2).to(FP8)
        ks = (torch.rand(hkv, generator=gen) + 0.5).float()
        vs = (torch.rand(hkv, generator=gen) + 0.5).float()
    return DecodeInputs(x0.q, kc, vc, x0.seq_lens, x0.block_table, x0.sm_scale, window_left=case.window,
                        soft_cap=case.cap, sinks=sinks, k_scale=ks, v_scale=vs)


def _check_variants(be, x, case, partition):
    """``run`` (single pass or partial + merge) and ``partial`` against the reference for each split count
    (``partition``: a key of :data:`MODES`)."""
    dtype = x.q.dtype
    kw = dict(window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale, v_scale=x.v_scale)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       sinks=x.sinks, **kw)
    b, q_len, hq, d = x.q.shape
    for splits in case.splits:
        plan = _plan(be, x, splits, partition)
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
        be.run(plan, x, None if plan.single_pass else PartialState.empty(b, q_len, hq, plan.num_splits, d), out, lse)
        if not plan.single_pass:
            st = PartialState.empty(b, q_len, hq, plan.num_splits, d).fill_(float("nan"))
            be.partial(plan, x, st)
            rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                                   plan.num_splits, **kw)
            assert_close_to_reference(st.o, rp.o, _o_dtype(partition, dtype, x.k_cache.dtype == FP8), "partial o")
            assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse (no sink)")
        assert_close_to_reference(out, ref, dtype, f"out (splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (splits {splits})")


VARIANT_PARAMS = [p for p in _modes(VARIANT_CASES)
                  if p.values[1] == "mma" or "tc" not in p.values[0].tags]


@pytest.mark.parametrize("case,partition", VARIANT_PARAMS)
def test_emulated_variants_match_reference(be, case, partition, gen):
    _check_variants(be, _variant_inputs(case, gen), case, partition)


FP8_CASES = [
    VariantCase((8, 2), 128, (37, 100, 0), splits=(1, 3)),                          # group 4, contiguous, len 0
    VariantCase((7, 1), 64, (40, 3), page=16, dtype="fp16", splits=(1, 2)),           # group 7, paged, fp16 q
    VariantCase((4, 4), 32, (33, 5), q_len=3, page=1, splits=(2,)),                   # group 1, page 1, q_len 3
    VariantCase((16, 2), 64, (80, 7), q_len=2, page=4, window=16, cap=5.0, sinks=True, splits=(1, 4)),
    VariantCase((8, 2), 256, (50,), page=64, window=20, sinks=True, splits=(3,)),     # head_dim 256
]


# fp8 on tensor cores beyond FP8_CASES (which run there too): group 8 x q_len 3 = 24 rows in two row groups,
# lengths 1 and odd, paged; group 1 with head_dim 80 (5 fp8 chunks per row: the last ldmatrix.x4 reads one
# twice), fp16 q; head_dim 128 with soft-cap + window + q_len 3
FP8_MMA_CASES = [
    VariantCase((8, 1), 128, (1, 64, 129), q_len=3, page=16, splits=(1, 3)),
    VariantCase((4, 4), 80, (45, 2), dtype="fp16", splits=(2,)),
    VariantCase((8, 2), 128, (61, 1), q_len=3, cap=2.0, window=40, splits=(1, 3)),
    # 32-token tiles over 16-token pages (2 block-table slots per tile), one split: a warp's 34-35 tiles use three
    # batches of 32 slots, the third loaded when the window moves on (decode.cu, PageWindow)
    VariantCase((8, 2), 128, (4400, 5), page=16, splits=(1,)),
]

FP8_PARAMS = _modes(FP8_CASES) + \
    [pytest.param(c, "mma", id=f"{c.id}-mma") for c in FP8_MMA_CASES]


@pytest.mark.parametrize("case,partition", FP8_PARAMS)
def test_emulated_fp8_kv_matches_reference(be, case, partition, gen):
    """float8_e4m3fn K / V with per-KV-head k_scale / v_scale against the float64 reference (which
    dequantizes as k * k_scale[h], v * v_scale[h]), with window / soft-cap / sinks; CUDA cores (split_k) and
    tensor cores (mma: group 1 / 4 / 7 / 8, q_len 1 / 2 / 3, head_dim 32-256, contiguous and
    paged, lengths 0 / 1 / odd)."""
    _check_variants(be, _variant_inputs(case, gen, fp8=True), case, partition)


def test_emulated_fp8_mma_q_magnitudes(be, gen):
    """bf16 q with an fp8 cache moves to fp16 for the mmas as q x 2^e, one power of two per n8-tile (the
    tile's largest |q| into [2^14, 2^15)): rows of one tile 2^40 apart in magnitude, and tiles at 2^-60 and
    2^60 (far outside fp16's range) still match the reference; 2^-e rejoins the score scale exactly."""
    from attnplan.backends.base import DecodeInputs

    case = VariantCase((24, 3), 64, (50, 7), page=16, splits=(1, 2))
    x = _variant_inputs(case, gen, fp8=True)
    e = torch.tensor([-20, 0, 20, -10, 5, 0, 3, 20] + [-60] * 8 + [60] * 8, dtype=torch.float64)
    q = (x.q.double() * torch.exp2(e).view(1, 1, 24, 1)).to(torch.bfloat16)  # powers of two: exact
    assert torch.equal(q.double(), x.q.double() * torch.exp2(e).view(1, 1, 24, 1))
    x = DecodeInputs(q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, k_scale=x.k_scale,
                     v_scale=x.v_scale)
    _check_variants(be, x, case, "mma")


def _e4m3fn(code: int) -> float:
    """The value of an e4m3fn byte from its definition (sign, 4-bit exponent bias 7, 3-bit mantissa,
    subnormals at exponent 0, S.1111.111 NaN, no infinities)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


@pytest.mark.parametrize("partition", list(MODES))
def test_emulated_fp8_decoder_all_256_codes(be, partition):
    """Every e4m3fn byte through the kernel's decoder (mma: the integer twin of cvt.rn.f16x2.e4m3x2, the
    sm_80 fallback): V holds all 256 codes in one head_dim-256 row, rotated by h for KV head h (so every
    code takes several byte positions of a 4-byte word), and a one-token partial state is that row x
    v_scale[h], exactly (NaN for 0x7f / 0xff); K holds the codes too (NaN codes zeroed) and one-hot
    queries read one code each into the lse."""
    from attnplan.backends.base import DecodeInputs

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = torch.tensor([_e4m3fn(c) for c in range(256)], dtype=torch.float64)
    assert torch.equal(codes.view(FP8).to(torch.float64).nan_to_num(7.0), table.nan_to_num(7.0))  # torch agrees
    hkv, group, d = 8, 32, 256  # 8 programs x 32 one-hot rows = 256 K codes
    v = torch.stack([codes.roll(h) for h in range(hkv)]).view(FP8).view(1, 1, hkv, d)
    kcodes = codes.clone()
    kcodes[(kcodes & 0x7F) == 0x7F] = 0  # a NaN in K would poison every row's dot product
    k = kcodes.view(FP8).view(1, 1, 1, d).expand(1, 1, hkv, d).contiguous()
    q = torch.zeros(1, 1, hkv * group, d, dtype=torch.bfloat16)
    for h in range(hkv):
        for g in range(group):
            q[0, 0, h * group + g, h * group + g] = 1.0
    k_scale = torch.tensor([2.0 ** (h - 4) for h in range(hkv)])
    v_scale = torch.tensor([2.0 ** (3 - h) for h in range(hkv)])
    x = DecodeInputs(q, k, v, torch.tensor([1], dtype=torch.int32), None, 1.0, k_scale=k_scale, v_scale=v_scale)
    plan = _plan(be, x, 2, partition)
    st = PartialState.empty(1, 1, hkv * group, plan.num_splits, d).fill_(float("nan"))
    be.partial(plan, x, st)
    vtab = torch.stack([table.roll(h) for h in range(hkv)])
    want_o = (vtab * v_scale.double().view(hkv, 1)).repeat_interleave(group, 0)  # [heads, d]
    o = st.o[0, 0, :, 0].double()
    assert torch.equal(torch.isnan(o), torch.isnan(want_o)), "NaN codes"
    assert torch.equal(o.nan_to_num(0.0), want_o.nan_to_num(0.0)), "V decode x v_scale is exact"
    ktab = table.clone()
    ktab[(codes & 0x7F) == 0x7F] = 0.0
    want_lse = ktab * k_scale.double().repeat_interleave(group)  # row h*32+g reads code h*32+g
    assert torch.allclose(st.lse[0, 0, :, 0].double(), want_lse, rtol=1e-6, atol=0)
    assert torch.isneginf(st.lse[0, 0, :, 1]).all() and (st.o[0, 0, :, 1] == 0).all()


@pytest.mark.parametrize("mode,fp8", [("split_k", False), ("mma", False), ("mma", True)])
@pytest.mark.parametrize("chunk", [13, 24, 40])
def test_emulated_unaligned_chunks(be, chunk, mode, fp8, gen):
    """Chunk sizes that are not multiples of the tile or the page: tiles self-align and mask (fp8 on tensor
    cores: 64-token tiles over 8-token pages)."""
    import dataclasses

    x = make_inputs(2, 8, 2, 64, [100, 41], q_len=2, page_size=8, dtype=torch.float16, generator=gen)
    if fp8:
        x = _variant_inputs(VariantCase((8, 2), 64, (100, 41), q_len=2, page=8, dtype="fp16"), gen, fp8=True)
    plan = _plan(be, x, 2, mode)
    n = -(-100 // chunk)
    plan = dataclasses.replace(plan, chunk_size=chunk, num_splits=n, grid=(n, 2, 2), merge_grid=(2 * 2 * 8,))
    st = PartialState.empty(2, 2, 8, n, 64).fill_(float("nan"))
    be.partial(plan, x, st)
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, chunk, n,
                           k_scale=x.k_scale, v_scale=x.v_scale)
    assert_close_to_reference(st.o, rp.o, _o_dtype(mode, torch.float16, fp8), "partial o")
    assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")


# -- the fused merge (plan.merge fused: no merge kernel) ------------------------------------------------------
# (merge, mode, case, fp8, kernel options): both modes; an empty sequence, q_len > 1, sinks, both layouts, fp8 on
# tensor cores, window + soft-cap; the merge's row teams: 8 one-warp teams of 4 rows each (group 8 x q_len 4 on CUDA
# cores: 4 row groups x 2 warps), one warp over head_dim 256 (2 slots per thread), group 7 over fp32 head_dim 96
IN_KERNEL = [
    ("fused", "mma", VariantCase((8, 2), 64, (70, 0, 33), q_len=2, page=16, sinks=True, splits=(5,)), False, {}),
    ("fused", "split_k", VariantCase((16, 2), 64, (45, 0, 7), q_len=4, dtype="fp16", splits=(4,)), False, {}),
    ("fused", "split_k", VariantCase((4, 1), 256, (33, 0), dtype="fp32", sinks=True, splits=(3,)), False,
     {"num_warps": 1}),
    ("fused", "split_k", VariantCase((7, 1), 96, (40, 0, 3), page=4, dtype="fp32", sinks=True, splits=(3,)), False, {}),
    ("fused", "mma", VariantCase((8, 2), 128, (61, 0, 1), q_len=3, page=16, window=40, cap=2.0, sinks=True,
                                 splits=(3,)), True, {}),
    ("fused", "split_k", VariantCase((16, 2), 64, (80, 0, 7), q_len=2, page=4, window=16, splits=(4,)), False, {}),
]
IN_KERNEL_PARAMS = [pytest.param(m, mode, c, f, o, id=f"{m}-{c.id}-{mode}" + ("-kvfp8" if f else "")
                                 + "".join(f"-{k}{v}" for k, v in o.items()))
                    for m, mode, c, f, o in IN_KERNEL]


def _merge_plan(be, x, case, merge, mode, options=None):
    """A plan for ``x`` with ``merge`` (the config's ``split.merge``)."""
    prob = problem_of(x)
    kc = be.kernel_config(prob, {"mma": MODES[mode], **(options or {})}, torch.device("cpu"))
    cfg = load_config(split={"merge": merge})
    plan = make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, num_splits=case.splits[0], partitions=be.partitions,
                     merge_strategies=be.merge_strategies)
    assert plan.merge == merge and plan.partition == "split_k" and plan.merge_grid == (0,), plan.explain()
    assert be.spec_for("partial", plan, inputs=x).merge == merge
    return plan


@pytest.mark.parametrize("merge,mode,case,fp8,options", IN_KERNEL_PARAMS)
def test_emulated_in_kernel_merge_matches_reference(be, merge, mode, case, fp8, options, gen):
    """``run`` with the fused merge inside the partial kernel (one launch) against the float64 reference,
    blocks in order and in two permuted orders (so the program that counts last differs): poisoned ``out`` /
    ``lse`` are fully written, the counters are back at zero after every launch, and the result is bitwise the
    same whichever program merged (split order) and leaves every split's partial state in the workspace."""
    x = _variant_inputs(case, gen, fp8=fp8)
    plan = _merge_plan(be, x, case, merge, mode, options)
    kw = dict(window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale, v_scale=x.v_scale)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       sinks=x.sinks, **kw)
    b, q_len, hq, d = x.q.shape
    counters = torch.zeros(plan.sync_words, dtype=torch.int32)
    assert plan.sync_words == b * plan.grid[1]
    outs = []
    try:
        for order in (0, 1, 2):
            be.block_order = order
            ws = PartialState.empty(b, q_len, hq, plan.state_slots, d).fill_(float("nan"))
            out = poison(torch.empty_like(x.q))
            lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
            be.run(plan, x, ws, out, lse, counters)
            assert int(counters.abs().sum()) == 0, f"counters not reset: {counters.tolist()}"
            assert_close_to_reference(out, ref, x.q.dtype, f"out (block order {order})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (block order {order})")
            outs.append((out, lse))
    finally:
        be.block_order = 0
    assert all(torch.equal(o, outs[0][0]) and torch.equal(ls, outs[0][1]) for o, ls in outs[1:])
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                           plan.num_splits, **kw)
    assert_close_to_reference(ws.o, rp.o, _o_dtype(mode, x.q.dtype, fp8), "partial o (fused workspace)")
    assert_close_to_reference(ws.lse, rp.lse, torch.float32, "partial lse (fused workspace)")


def test_emulated_fused_merge_with_a_counter_not_at_zero(be, gen):
    """A fused merge whose counter did not start at zero has no last program (at num_splits: every count is past
    it): that group's rows stay unwritten, the others are merged."""
    merge, mode, case, _, _ = IN_KERNEL[0]
    x = _variant_inputs(case, gen)
    plan = _merge_plan(be, x, case, merge, mode)
    b, q_len, hq, d = x.q.shape
    counters = torch.zeros(plan.sync_words, dtype=torch.int32)
    counters[1] = plan.num_splits  # (sequence 0, KV head 1): query heads 4-7
    out = poison(torch.empty_like(x.q))
    be.run(plan, x, PartialState.empty(b, q_len, hq, plan.state_slots, d), out, None, counters)
    assert torch.isnan(out[0, :, 4:8]).all() and not torch.isnan(out[0, :, :4]).any()
    assert counters.tolist() == [0, 2 * plan.num_splits] + [0] * (plan.sync_words - 2)


def _parametrized_specs(be) -> list:
    """Every specialization the case-parametrized tests launch (same inputs and plans as the tests)."""
    g = torch.Generator().manual_seed(0)
    specs = []
    for params, fp8 in ((CASE_PARAMS, False), (VARIANT_PARAMS, False), (FP8_PARAMS, True)):
        for param in params:
            case, partition = param.values
            x = _variant_inputs(case, g, fp8)
            for splits in case.splits:
                plan = _plan(be, x, splits, partition)
                specs.append(be.spec_for("single" if plan.single_pass else "partial", plan, inputs=x))
                if not plan.single_pass:
                    specs.append(be.spec_for("merge", plan))
    for merge, mode, case, fp8, options in IN_KERNEL:
        x = _variant_inputs(case, g, fp8)
        specs.append(be.spec_for("partial", _merge_plan(be, x, case, merge, mode, options), inputs=x))
    specs += [merge_spec(dtype_name(DT[dt]), d, t) for dt, d, t in MERGE_TEAMS]
    return specs


def _separate_merge_plan(be, batch, q_len, heads, head_dim, dtype, splits):
    """A plan of ``splits`` splits with a merge kernel (``separate``; single pass for 1 split, whose state the merge
    kernel still merges: a distributed merge of one rank) for ``batch x q_len x heads`` rows (one KV head, a paged
    cache of 16 tokens per split), planned for the CPU stand-in (8 SMs)."""
    prob = DecodeProblem(batch, heads, 1, head_dim, q_len, 16, dtype_name(dtype), dtype_name(dtype), 16 * splits,
                         16 * splits * batch)
    kc = be.kernel_config(prob, {}, torch.device("cpu"))
    plan = make_plan(prob, CPU_STANDIN, load_config(split={"merge": "separate"}), "cuda_ptx", kc, num_splits=splits)
    assert plan.num_splits == splits and (plan.single_pass if splits == 1 else plan.merge == "separate")
    return plan


def _random_states(shape, splits, head_dim, gen, pad=3):
    """fp32 states ``o [*shape, splits + pad, head_dim]`` / ``lse [*shape, splits + pad]``: ~30% empty splits
    (lse -inf, o poisoned with NaN: unwritten), row 0 wholly empty, and the ``pad`` splits past ``splits`` NaN
    (never read)."""
    o = torch.randn(*shape, splits + pad, head_dim, generator=gen)
    ls = torch.randn(*shape, splits + pad, generator=gen) * 3
    empty = torch.rand(*shape, splits + pad, generator=gen) < 0.3
    empty.view(-1, splits + pad)[0] = True  # a row with no visible token
    ls[empty] = float("-inf")
    o[empty] = float("nan")
    ls[..., splits:] = float("nan")
    o[..., splits:, :] = float("nan")
    return o, ls


@pytest.mark.parametrize("head_dim,splits", [(128, 45), (256, 20), (64, 33)])
def test_emulated_merge_many_splits(be, head_dim, splits, gen):
    """The merge kernel (one team per row: 8 rows fill the stand-in's 8 SMs) over more splits than one chunk of
    prefetched o rows (16 at one warp per CTA, 8 at head_dim 256) and than a warp's 32 lanes: random states with
    empty splits (lse -inf, o NaN poison) scattered through the chunks, one all-empty row, sinks; against
    merge_states in float64."""
    b, h = 2, 4
    o = torch.randn(b, 1, h, splits + 2, head_dim, generator=gen)
    ls = torch.randn(b, 1, h, splits + 2, generator=gen) * 3
    empty = torch.rand(b, 1, h, splits + 2, generator=gen) < 0.3
    empty[1, 0, 0] = True  # a row with no visible token
    ls[empty] = float("-inf")
    o[empty] = float("nan")
    sinks = torch.randn(h, generator=gen)
    out = poison(torch.empty(b, 1, h, head_dim, dtype=torch.bfloat16))
    out_lse = poison(torch.empty(b, 1, h))
    plan = _separate_merge_plan(be, b, 1, h, head_dim, torch.bfloat16, splits)
    assert be.merge_teams_for(plan, out.device) == 1
    be.merge(plan, PartialState(o, ls), out, out_lse, sinks)
    ref, ref_lse = merge_states(PartialState(o[:, :, :, :splits].double(), ls[:, :, :, :splits].double()),
                                sinks.double())
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(out_lse, ref_lse, torch.float32, "lse")
    assert torch.all(out[1, 0, 0] == 0)


# -- the merge kernel's teams (decode.cu's ATTNPLAN_MERGE_TEAMS) -----------------------------------------------
#: (dtype, head_dim, teams): 1 (the single-team path), 2 and 8 teams per CTA; head_dim 64 / 128 (one-warp teams,
#: 16-split chunks, 64 with half the lanes owning no columns) and 256 (two-warp teams, 8-split chunks)
MERGE_TEAMS = [(dt, d, t) for dt in ("bf16", "fp16") for d in (64, 128, 256) for t in (1, 2, 8)]
#: split counts: one, fewer than a chunk (8 teams: seven empty ranges), one past a chunk, not a multiple of a team's
#: range, past four 32-lane rounds (130 over 8 teams: ranges of 32, the last of 2, three empty)
TEAM_SPLITS = (1, 5, 17, 40, 130)


@pytest.mark.parametrize("dtype,head_dim,teams", [pytest.param(*m, id=f"{m[0]}-d{m[1]}-t{m[2]}") for m in MERGE_TEAMS])
def test_emulated_merge_teams_match_reference(be, dtype, head_dim, teams, gen, monkeypatch):
    """The merge kernel with ``teams`` teams per CTA (pinned; :meth:`merge_teams_for` chooses it otherwise),
    through the backend's merge (input checks, spec, launch config with the teams' dynamic shared memory,
    kernelParams): 4 rows (q_len 2 x 2 heads) over each of :data:`TEAM_SPLITS`, random states with empty splits
    (lse -inf, o NaN: read but selected out), an all-empty row, NaN past the plan's splits, sinks on every other
    split count, outputs poisoned with NaN; against merge_states in float64 at the output dtype's tolerance. A
    second launch gives the same bits (fixed team order)."""
    dt = DT[dtype]
    monkeypatch.setattr(be, "merge_teams_for", lambda plan, device=None: teams)
    b, q_len, h = 1, 2, 2
    for i, n in enumerate(TEAM_SPLITS):
        plan = _separate_merge_plan(be, b, q_len, h, head_dim, dt, n)
        o, ls = _random_states((b, q_len, h), n, head_dim, gen)
        sinks = torch.randn(h, generator=gen) * 2 if i % 2 else None
        runs = []
        for _ in range(2):
            out = poison(torch.empty(b, q_len, h, head_dim, dtype=dt))
            out_lse = poison(torch.empty(b, q_len, h))
            be.merge(plan, PartialState(o, ls), out, out_lse, sinks)
            runs.append((out, out_lse))
        ref, ref_lse = merge_states(PartialState(o[..., :n, :].double(), ls[..., :n].double()),
                                    None if sinks is None else sinks.double())
        (out, out_lse), (out2, out_lse2) = runs
        what = f"{teams} teams, {n} splits{', sinks' if sinks is not None else ''}"
        assert_close_to_reference(out, ref, dt, f"out ({what})")
        assert_close_to_reference(out_lse, ref_lse, torch.float32, f"lse ({what})")
        assert torch.all(out[0, 0, 0] == 0), what  # the all-empty row: o = 0, lse = -inf or the sink
        assert out_lse[0, 0, 0] == (float("-inf") if sinks is None else sinks[0]), what
        assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), f"out not deterministic ({what})"
        assert torch.equal(out_lse.view(torch.int32), out_lse2.view(torch.int32)), f"lse not deterministic ({what})"
    assert merge_spec(dtype_name(dt), head_dim, teams) in be.kernels  # the pinned teams' kernel ran


def test_emulated_merge_teams_chosen_by_the_backend(be, gen):
    """Unpinned, the backend picks the teams from the plan's rows, its splits and the SM count
    (spec.merge_teams; the CPU stand-in's 8): 3 rows x 40 splits -> 4 teams of 16 splits (the last of 8),
    against merge_states; 8 rows of the same splits -> one team."""
    assert be.merge_teams_for(_separate_merge_plan(be, 2, 1, 4, 128, torch.bfloat16, 40)) == 1
    plan = _separate_merge_plan(be, 1, 1, 3, 128, torch.bfloat16, 40)
    assert be.merge_teams_for(plan, torch.device("cpu")) == 4 and be.spec_for("merge", plan).teams == 4
    o, ls = _random_states((1, 1, 3), 40, 128, gen)
    out = poison(torch.empty(1, 1, 3, 128, dtype=torch.bfloat16))
    out_lse = poison(torch.empty(1, 1, 3))
    be.merge(plan, PartialState(o, ls), out, out_lse)
    ref, ref_lse = merge_states(PartialState(o[..., :40, :].double(), ls[..., :40].double()))
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(out_lse, ref_lse, torch.float32, "lse")
    assert merge_spec("bfloat16", 128, 4) in be.kernels


@pytest.mark.parametrize("teams", [1, 8])
def test_emulated_merge_teams_constants_match_host(be, teams):
    """The compiled merge kernel's teams, threads and dynamic shared memory equal the host spec's."""
    spec = merge_spec("bfloat16", 256, teams)
    k = be.kernel(spec)
    assert (k.constant("teams"), k.constant("threads"), k.constant("smem"), k.constant("chunk")) == \
        (teams, spec.threads, spec.smem_bytes, 8)


@pytest.mark.parametrize("passes,warps,page", [(2, 2, None), (2, 2, 16), (4, 1, 8)])
def test_emulated_mma_larger_warp_tiles_match_reference(be, passes, warps, page, gen):
    """Option ``passes`` (32- / 64-token warp tiles on the tensor cores): chunks that end inside a tile,
    pages smaller than the tile, an empty sequence; partial states and the merged output against the
    float64 reference."""
    x = make_inputs(3, 8, 2, 64, [150, 0, 37], page_size=page, dtype=torch.bfloat16, generator=gen)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    plan = _plan(be, x, 3, "mma", passes=passes, num_warps=warps)
    assert plan.kernel["passes"] == passes and be.spec_for("partial", plan, inputs=x).passes == passes
    st = PartialState.empty(*x.q.shape[:3], plan.num_splits, 64).fill_(float("nan"))
    be.partial(plan, x, st)
    rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                           plan.num_splits)
    assert_close_to_reference(st.o, rp.o, torch.bfloat16, "partial o")
    assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
    be.merge(plan, st, out, lse)
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


# -- 64-bit offsets and 32-bit scalars (args.py: what is packed how) -----------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_window_wider_than_the_cache(be, mode, gen):
    """A sliding window at least the cache's capacity, up to 10**30 (any int the input validation allows), sees
    every position: the windowed kernel's outputs, lse and partial states equal the float64 reference without a
    window (the packing caps the window at the capacity; a window just below it does restrict, and matches the
    reference with that window)."""
    from attnplan.backends.base import DecodeInputs

    x0 = make_inputs(2, 8, 2, 64, [70, 33], q_len=2, page_size=16, dtype=torch.bfloat16, generator=gen)
    capacity = x0.block_table.shape[1] * 16
    assert capacity == 80
    for window in (capacity - 40, capacity, capacity + 1, 2**31, 10**30):
        x = DecodeInputs(x0.q, x0.k_cache, x0.v_cache, x0.seq_lens, x0.block_table, x0.sm_scale, window_left=window)
        ref_window = window if window < capacity else -1  # the reference itself cannot take 10**30 (int64 positions)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                           window_left=ref_window)
        for splits in (1, 3):
            plan = _plan(be, x, splits, mode)
            assert be.spec_for("partial", plan, inputs=x).window
            out = poison(torch.empty_like(x.q))
            lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
            ws = None if plan.single_pass else PartialState.empty(2, 2, 8, plan.num_splits, 64)
            be.run(plan, x, ws, out, lse)
            assert_close_to_reference(out, ref, torch.bfloat16, f"out (window {window}, splits {splits})")
            assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (window {window}, splits {splits})")
            if not plan.single_pass:
                st = PartialState.empty(2, 2, 8, plan.num_splits, 64).fill_(float("nan"))
                be.partial(plan, x, st)
                rp = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       plan.chunk_size, plan.num_splits, window_left=ref_window)
                assert_close_to_reference(st.o, rp.o, _o_dtype(mode, torch.bfloat16), "partial o")
                assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")


def _fp8_cache_past_2_31(layout, lens, gen, hkv=1, d=128, page=16):
    """K and V caches in float8_e4m3fn (1 byte per element, so 2**31 elements are 2 GB of virtual memory the test
    never touches but where it writes) whose used tokens lie beyond element 2**31: paged, the sequences' pages are
    the last ones of 2**31 / page stride + 8 pages, in a scrambled order; contiguous, the sequence stride is 2**31 +
    128 elements. Returns (k_cache, v_cache, block_table or None)."""
    fp8 = torch.float8_e4m3fn
    caches = []
    if layout == "paged":
        per_page = page * hkv * d
        num_pages = 2**31 // per_page + 8
        pages_per_seq = -(-max(lens) // page)
        ids = torch.tensor([num_pages - 1 - ((i * 5) % (len(lens) * pages_per_seq)) for i in
                            range(len(lens) * pages_per_seq)], dtype=torch.int32).view(len(lens), pages_per_seq)
        assert int(ids.min()) * per_page > 2**31
        for scale in (0.25, 2.0):
            c = torch.empty(num_pages, page, hkv, d, dtype=fp8)
            c[ids.flatten().long()] = (torch.randn(ids.numel(), page, hkv, d, generator=gen) * scale).to(fp8)
            caches.append(c)
        return caches[0], caches[1], ids
    stride0, cap = 2**31 + 128, max(lens)
    for scale in (0.25, 2.0):
        buf = torch.empty(stride0 * (len(lens) - 1) + cap * hkv * d, dtype=fp8)
        c = buf.as_strided((len(lens), cap, hkv, d), (stride0, hkv * d, d, 1))
        for b in range(len(lens)):
            c[b] = (torch.randn(cap, hkv, d, generator=gen) * scale).to(fp8)
        caches.append(c)
    return caches[0], caches[1], None


@pytest.mark.parametrize("layout,mode", [("paged", "mma"), ("paged", "split_k"), ("contig", "mma")])
def test_emulated_offsets_past_2_31_elements(be, layout, mode, gen):
    """Cache offsets beyond 2**31 elements, formed in 64 bits by the kernel: page index x page stride (pages past
    index 2**20 of 2048-element pages) or sequence x sequence stride (2**31 + 128); a 32-bit product would read
    another page or sequence (or fault, which the emulation reports). Partial states and the merged output against
    the float64 reference, single pass and split."""
    from attnplan.backends.base import DecodeInputs

    lens = [40, 23]
    kc, vc, bt = _fp8_cache_past_2_31(layout, lens, gen)
    q = torch.randn(2, 1, 8, 128, generator=gen).to(torch.bfloat16)
    ks = (torch.rand(1, generator=gen) + 0.5).float()
    vs = (torch.rand(1, generator=gen) + 0.5).float()
    x = DecodeInputs(q, kc, vc, torch.tensor(lens, dtype=torch.int32), bt, 128 ** -0.5, k_scale=ks, v_scale=vs)
    kw = dict(k_scale=ks, v_scale=vs)
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, bt, x.sm_scale, **kw)
    for splits in (1, 2):
        plan = _plan(be, x, splits, mode)
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty(2, 1, 8))
        be.run(plan, x, None if plan.single_pass else PartialState.empty(2, 1, 8, plan.num_splits, 128), out, lse)
        assert_close_to_reference(out, ref, torch.bfloat16, f"out ({layout}, splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse ({layout}, splits {splits})")
        if not plan.single_pass:
            st = PartialState.empty(2, 1, 8, plan.num_splits, 128).fill_(float("nan"))
            be.partial(plan, x, st)
            rp = reference.partial(x.q, kc, vc, x.seq_lens, bt, x.sm_scale, plan.chunk_size, plan.num_splits, **kw)
            assert_close_to_reference(st.o, rp.o, _o_dtype(mode, torch.bfloat16, fp8=True), "partial o")
            assert_close_to_reference(st.lse, rp.lse, torch.float32, "partial lse")


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_block_table_rows_of_a_wider_table(be, mode, gen):
    """A block table whose rows are the first columns of a wider table (row stride 11 > 4 pages per sequence, the
    columns past them poisoned with out-of-range page ids) is read through its row stride: outputs and partial states
    against the float64 reference; the same table's transposed storage (column stride > 1) and a strided seq_lens are
    refused naming the argument."""
    from attnplan.backends.base import DecodeInputs

    x0 = make_inputs(3, 8, 2, 64, [50, 0, 33], page_size=16, dtype=torch.float16, generator=gen)
    wide = torch.full((3, 11), 10**6, dtype=torch.int32)  # poison: any read of it faults in the emulation
    wide[:, :4] = x0.block_table
    bt = wide[:, :4]
    assert bt.stride() == (11, 1)
    x = DecodeInputs(x0.q, x0.k_cache, x0.v_cache, x0.seq_lens, bt, x0.sm_scale)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x0.block_table, x.sm_scale)
    for splits in (1, 3):
        plan = _plan(be, x, splits, mode)
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
        be.run(plan, x, None if plan.single_pass else PartialState.empty(3, 1, 8, plan.num_splits, 64), out, lse)
        assert_close_to_reference(out, ref, torch.float16, f"out (splits {splits})")
        assert_close_to_reference(lse, ref_lse, torch.float32, f"lse (splits {splits})")
    plan = _plan(be, x, 3, mode)
    st = PartialState.empty(3, 1, 8, plan.num_splits, 64)
    with pytest.raises(ValueError, match="block_table"):
        be.partial(plan, DecodeInputs(x.q, x.k_cache, x.v_cache, x.seq_lens, x0.block_table.t().contiguous().t(),
                                      x.sm_scale), st)
    with pytest.raises(ValueError, match="seq_lens"):
        be.partial(plan, DecodeInputs(x.q, x.k_cache, x.v_cache, torch.stack([x.seq_lens, x.seq_lens], 1)[:, 0], bt,
                                      x.sm_scale), st)
