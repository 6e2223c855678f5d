"""Attention variants on every backend that declares them, against the float64 reference:
sliding window, logits soft-cap, attention sinks, fp8 KV with per-tensor / per-head scales,
head dims 64-256 (non-powers of two masked), page sizes 1-64, q_len up to 8.

A backend that does not declare a variant is skipped with its own reason (the dispatch tests in
``tests/test_backends.py`` check that the config's order then falls through to one that does).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.config import load_config
from attnplan.problem import DecodeProblem, dtype_name
from attnplan.schedule import schedule_units
from attnplan.testing import assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = kernel_backends(DEVICE)
FP8 = torch.float8_e4m3fn


def _run(backend, x, dtype, splits, *, window=-1, cap=0.0, sinks=None, fp8=None, lse_check=True):
    """Run ``backend`` and the reference with the same variant arguments; compare."""
    kw = dict(window_left=window, logits_soft_cap=cap, sinks=sinks)
    kc, vc = x.k_cache, x.v_cache
    if fp8 is not None:
        k_scale, v_scale = fp8
        kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
        kw.update(k_scale=k_scale, v_scale=v_scale)
    hq, hkv = x.q.shape[2], kc.shape[2]
    problem = DecodeProblem(batch=x.q.shape[0], num_q_heads=hq, num_kv_heads=hkv, head_dim=x.q.shape[3],
                            q_len=x.q.shape[1], page_size=kc.shape[1] if x.paged else None, q_dtype=dtype_name(dtype),
                            kv_dtype=dtype_name(kc.dtype), max_kv_len=1, window_left=window, soft_cap=cap,
                            has_sinks=sinks is not None, kv_scale="none" if fp8 is None else "head")
    reasons = get_backend(backend).supports(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    out = poison(torch.empty_like(x.q))
    lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
    attnplan.decode(x.q, kc, vc, x.seq_lens, x.block_table, backend=backend, num_splits=splits, out=out, lse=lse, **kw)
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=window,
                                       soft_cap=cap, sinks=sinks, k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"))
    assert_close_to_reference(out, ref, dtype)
    if lse_check:
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    return out, ref


GQA = [(2, 2), (8, 2), (7, 1), (8, 1), (16, 1)]  # group sizes 1, 4, 7, 8, 16


#: the groups that run each variant on a paged cache in the default run (every group does on a contiguous one): the
#: variants act on the scores and values after the KV load, whose paged addressing is the same for every group; the
#: other groups' paged params are in the full tier
PAGED_GQA = {(8, 2), (7, 1)}


def _grid(extra):
    out = []
    for be, (hq, hkv), page in itertools.product(BACKENDS, GQA, [None, 16]):
        full = page is not None and (hq, hkv) not in PAGED_GQA
        out.append(pytest.param(be, hq, hkv, page, id=f"{be}-{hq}x{hkv}-{'paged16' if page else 'contig'}-{extra}",
                                marks=pytest.mark.full if full else ()))
    return out


@pytest.mark.parametrize("backend,hq,hkv,page", _grid("window"))
def test_sliding_window(backend, hq, hkv, page, gen):
    x = make_inputs(3, hq, hkv, 32, [70, 1, 0], q_len=2, page_size=page, device=DEVICE, generator=gen)
    _run(backend, x, torch.float16, 3, window=9)


@pytest.mark.parametrize("backend,hq,hkv,page", _grid("softcap"))
def test_soft_cap(backend, hq, hkv, page, gen):
    x = make_inputs(3, hq, hkv, 32, [45, 1, 0], page_size=page, device=DEVICE, generator=gen, scale=3.0)
    _run(backend, x, torch.float16, 2, cap=5.0)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no lane subtracts equal infinities (an empty sequence)
@pytest.mark.parametrize("backend,hq,hkv,page", _grid("sinks"))
def test_sinks(backend, hq, hkv, page, gen):
    x = make_inputs(3, hq, hkv, 32, [40, 1, 0], page_size=page, device=DEVICE, generator=gen)
    sinks = torch.randn(hq, generator=gen).float().to(DEVICE)
    for splits in (1, 3):
        _run(backend, x, torch.float16, splits, sinks=sinks)


@pytest.mark.parametrize("backend,hq,hkv,page", _grid("fp8"))
def test_fp8_kv_per_head_scales(backend, hq, hkv, page, gen):
    x = make_inputs(3, hq, hkv, 32, [50, 1, 0], page_size=page, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    ks = (torch.rand(hkv, generator=gen) + 0.5).float().to(DEVICE)
    vs = (torch.rand(hkv, generator=gen) + 0.5).float().to(DEVICE)
    _run(backend, x, torch.bfloat16, 3, fp8=(ks, vs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_kv_with_bf16_q_beyond_fp16_range(backend, gen):
    """bf16 q entries ~1e5 (past fp16's 65504) with a tiny k_scale (scores O(1)), an all-zero q row,
    then a row of ~1e-36: a backend that widens fp8 K/V to fp16 and casts q to fp16 must scale q
    into range first, with a bounded shift."""
    x = make_inputs(3, 8, 2, 64, [40, 17, 9], page_size=None, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    x.q.mul_(1e5)
    x.q[1].zero_()
    _run(backend, x, torch.bfloat16, 2, fp8=(1e-5, 1.5))
    # and rows far below 1 (|q| ~ 1e-36, a shift past 2^113 would overflow): scores ~0, uniform weights
    x.q[0].mul_(1e-41)
    _run(backend, x, torch.bfloat16, 2, fp8=(1e-5, 1.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_scale_is_not_dropped(backend, gen):
    """A dropped fp8 scale shows: k_scale 0.05, v_scale 2.0 with q in bf16, single pass and split."""
    x = make_inputs(2, 8, 2, 64, [33, 20], page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    for splits in (1, 2):
        _run(backend, x, torch.bfloat16, splits, fp8=(0.05, 2.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_nan_in_k_or_v_reaches_the_rows_that_see_it(backend, gen):
    """An e4m3 NaN (0x7f) in the fp8 K cache at a visible position makes every row of its (sequence, KV head) NaN,
    and one in V makes those rows' columns it reaches NaN, as with fp16 caches (the README's NaN rule); nothing else
    is NaN, and the clean sequence stays close to the reference. Skipped on Triton's CPU interpreter, which converts
    an e4m3 NaN to +-480 (the README names that exception)."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("Triton's interpreter converts an e4m3 NaN to +-480 (a GPU's conversion keeps it)")
    x = make_inputs(3, 8, 2, 64, [70, 5, 33], page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    kc, vc = x.k_cache.to(FP8), x.v_cache.to(FP8)
    pk, pv = x.block_table[0, 0], x.block_table[2, 1]  # sequence 0's first page, sequence 2's second (tokens 16-31)
    kc.view(torch.uint8)[pk, 3, 1, 5] = 0x7F  # sequence 0, token 3, KV head 1
    vc.view(torch.uint8)[pv, 2, 0, 9] = 0x7F  # sequence 2, token 18, KV head 0, column 9
    ref, _ = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, k_scale=1.0, v_scale=1.0)
    for splits in (1, 3):
        out = attnplan.decode(x.q, kc, vc, x.seq_lens, x.block_table, backend=backend, num_splits=splits,
                              k_scale=1.0, v_scale=1.0)
        assert torch.isnan(out[0, :, 4:8]).all() and not torch.isnan(out[0, :, :4]).any()  # KV head 1: heads 4-7
        assert torch.isnan(out[2, :, :4, 9]).all() and not torch.isnan(out[2, :, :4, :9]).any()
        assert not torch.isnan(out[2, :, 4:]).any()
        assert_close_to_reference(out[1], ref[1], torch.bfloat16)
        assert torch.equal(torch.isnan(out), torch.isnan(ref.to(out.device)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_all_masked_rows(backend, gen):
    """q_len 4, window 2, some queries see nothing (length < q_len)."""
    x = make_inputs(3, 8, 2, 32, [2, 3, 30], q_len=4, device=DEVICE, generator=gen)
    out, ref = _run(backend, x, torch.float16, 2, window=2)
    assert torch.all(out[0, :2] == 0)  # queries 0 and 1 of a length-2 sequence sit before position 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_trailing_empty_splits_ignore_workspace(backend, gen):
    """Trailing units past a window are empty: 1/8/1, length 8192 (CPU: 600), window 128, 64 splits,
    workspace prefilled with NaN: equals the reference over the last 128 keys."""
    n = 8192 if HAS_CUDA else 600
    x = make_inputs(1, 8, 1, 128 if HAS_CUDA else 32, [n], dtype=torch.bfloat16, device=DEVICE, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    problem_reasons = get_backend(backend).supports(DecodeProblem(batch=1, num_q_heads=8, num_kv_heads=1,
                                                                  head_dim=x.q.shape[3], window_left=128, max_kv_len=n))
    if problem_reasons:
        pytest.skip("; ".join(problem_reasons))
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, window_left=128, num_splits=64)
    assert plan.num_splits == 64
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, window_left=128)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_plans_only_the_window(backend, gen):
    """The planner plans the window's span, not the whole sequence: no chunk reads invisible KV."""
    x = make_inputs(1, 8, 2, 32, [5000 if HAS_CUDA else 700], device=DEVICE, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    if get_backend(backend).supports(DecodeProblem(batch=1, num_q_heads=8, num_kv_heads=2, head_dim=32,
                                                   window_left=64, max_kv_len=10)):
        pytest.skip("window not served")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, window_left=64)
    n = int(x.seq_lens[0])
    units = schedule_units([n], plan.schedule, 1, 64)
    assert int(units.start[0]) == n - 1 - 64 and int(units.end[-1]) == n  # the units cover the window only
    # the planner's candidates are split counts of the window's 65 tokens, not of the whole sequence: chunks sized
    # for them, and no more splits than 65 tokens hold at the least chunk
    most = -(-65 // load_config().split.min_chunk_tokens)
    assert all(c <= 128 and s <= most for s, c, _ in plan.candidates), plan.candidates


@pytest.mark.parametrize("backend", BACKENDS)
def test_spec_verify_masked_tile(backend, gen):
    """q_len 4, length = k * unit + 3 so the last unit holds only positions query 0 cannot see: no NaN, that unit's
    state is empty for query 0 (lse -inf, o 0) and not for query 3."""
    x = make_inputs(1, 8, 2, 32, [2 * 16 + 3], q_len=4, device=DEVICE, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=4)
    units = schedule_units([35], plan.schedule, q_len=4)
    if units.num_units != 3 or int(units.start[2]) != 32:
        pytest.skip(f"backend's granule is {plan.schedule.granule} tokens: no unit of [32, 35)")
    w.workspace.state.fill_(float("nan"))
    out = poison(torch.empty_like(x.q))
    w.backend.partial(plan, x, w.workspace, out, None)
    st = w.workspace.state
    # unit 2 covers [32, 35); query 0 sits at position 31
    assert torch.all(torch.isneginf(st.lse[0, 0, :, 2])) and torch.all(st.o[0, 0, :, 2] == 0)
    assert torch.isfinite(st.lse[0, 3, :, 2]).all()
    _run(backend, x, torch.float16, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_overflow(backend, gen):
    """Soft-cap without overflow: cap 50, raw scores near 5000 and -10000: capped at +-50, finite."""
    x = make_inputs(1, 4, 1, 32, [24], device=DEVICE, generator=gen, dtype=torch.float16)
    x.q.zero_()
    x.q[..., 0] = 1.0
    x.k_cache[0, :12, 0, 0] = 5000.0 * (32 ** 0.5) / 64  # scaled score 5000 / 64 * ... kept in fp16 range
    x.k_cache[0, 12:, 0, 0] = -10000.0 * (32 ** 0.5) / 64
    x.q[..., 0] = 64.0
    out, ref = _run(backend, x, torch.float16, 2, cap=50.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 192, 256])
def test_head_dims(backend, head_dim, gen):
    x = make_inputs(2, 4, 1, head_dim, [19, 1], page_size=16, device=DEVICE, generator=gen)
    _run(backend, x, torch.float16, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [1, 16, 32, 64])
def test_page_sizes_and_boundaries(backend, page, gen):
    lens = [page, page + 1, page - 1 if page > 1 else 0, 2 * page]
    x = make_inputs(4, 4, 1, 32, lens, q_len=3, page_size=page, device=DEVICE, generator=gen)
    _run(backend, x, torch.float16, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_len_8_with_window_softcap_sinks_fp8(backend, gen):
    """Every variant at once, speculative verification with 8 queries."""
    x = make_inputs(2, 8, 2, 64, [40, 5], q_len=8, page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    sinks = torch.randn(8, generator=gen).float().to(DEVICE)
    _run(backend, x, torch.bfloat16, 3, window=11, cap=20.0, sinks=sinks, fp8=(0.5, 1.5))


def test_variant_validation_errors():
    x = make_inputs(1, 4, 2, 16, [5])
    with pytest.raises(ValueError, match="window_left"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, window_left=-5, backend="reference")
    with pytest.raises(ValueError, match="soft_cap"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, logits_soft_cap=-1.0, backend="reference")
    with pytest.raises(ValueError, match=r"sinks must be a float32 tensor of shape \[num_q_heads\] = \[4\]"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, sinks=torch.zeros(3), backend="reference")
    with pytest.raises(ValueError, match="k_scale is required"):
        attnplan.decode(x.q, x.k_cache.to(FP8), x.v_cache.to(FP8), x.seq_lens, backend="reference")
    with pytest.raises(ValueError, match="only to a float8"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, k_scale=1.0, v_scale=1.0, backend="reference")
    with pytest.raises(TypeError, match="fp8 KV cache needs q"):
        attnplan.decode(x.q.float(), x.k_cache.to(FP8), x.v_cache.to(FP8), x.seq_lens, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale must be a float or a float32 tensor \[num_kv_heads\]"):
        attnplan.decode(x.q, x.k_cache.to(FP8), x.v_cache.to(FP8), x.seq_lens, k_scale=1.0, v_scale=torch.ones(3))


def test_variants_are_part_of_the_plan_key():
    a = DecodeProblem(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=16, max_kv_len=100)
    keys = {tuple(sorted(p.bucket().items())) for p in (
        a, DecodeProblem(**{**a.to_dict(), "window_left": 8}), DecodeProblem(**{**a.to_dict(), "soft_cap": 30.0}),
        DecodeProblem(**{**a.to_dict(), "has_sinks": True}),
        DecodeProblem(**{**a.to_dict(), "kv_dtype": "float8_e4m3fn", "kv_scale": "head"}))}
    assert len(keys) == 5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [1e3, 1e4, 1e6, 1e30])
def test_soft_cap_far_above_nearly_equal_scores(backend, cap):
    """A soft cap far above the scores (|score / cap| from ~1e-28 to ~0.1): ``tanh`` of a small argument in fp32
    must keep its digits (``1 - exp(-2|x|)`` loses up to ~7 bits near 0.01 and all of them below ~6e-8); nearly
    equal scores around 100 make any such loss visible in fp32 outputs."""
    g = torch.Generator().manual_seed(0)
    x = make_inputs(1, 4, 1, 16, [64], page_size=16, dtype=torch.float32, generator=g)
    base = torch.randn(16, generator=g)
    k = (base + 0.02 * torch.randn(x.k_cache.shape, generator=g)).to(DEVICE)
    q = ((base * 25.0).expand_as(x.q) + 0.1 * torch.randn(x.q.shape, generator=g)).contiguous()
    x = dataclasses.replace(x, q=q.to(DEVICE), k_cache=k, v_cache=x.v_cache.to(DEVICE),
                            seq_lens=x.seq_lens.to(DEVICE), block_table=x.block_table.to(DEVICE))
    _run(backend, x, torch.float32, 1, cap=cap)
