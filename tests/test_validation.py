"""Bad input: each check trips with a message naming the argument, the value and the expectation."""

import warnings

import pytest
import torch

import attnplan
from attnplan.testing import make_inputs


def good(**kw):
    x = make_inputs(2, 8, 2, 16, [5, 9], page_size=kw.pop("page_size", None), **kw)
    return dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)


def call(args):
    return attnplan.decode(args["q"], args["k_cache"], args["v_cache"], args["seq_lens"], args["block_table"],
                           backend="reference")


def test_good_inputs_pass():
    call(good())
    call(good(page_size=4))


@pytest.mark.parametrize("mutate,exc,needle", [
    (lambda a: a.update(q=a["q"][0]), ValueError, "q must be 4-D"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q.dtype"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :-1]), ValueError, "v_cache shape"),
    (lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), TypeError, "k_cache.dtype"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :8], v_cache=a["v_cache"][..., :8]), ValueError, "head_dim 8 must equal"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens.dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, r"seq_lens must have shape \[batch\] = \[2\]"),
    (lambda a: a.update(seq_lens=torch.tensor([5, 10], dtype=torch.int32)), ValueError, "seq_lens\\[1\\] = 10 exceeds the cache capacity 9"),
    (lambda a: a.update(seq_lens=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "seq_lens must be >= 0"),
    (lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "unit stride"),
    (lambda a: a.update(q=torch.zeros(2, 17, 8, 16, dtype=torch.float16)), ValueError, "q_len"),
    (lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError, "contiguous k_cache must have shape"),
])
def test_contiguous_input_errors(mutate, exc, needle):
    a = good()
    mutate(a)
    with pytest.raises(exc, match=needle):
        call(a)


@pytest.mark.parametrize("mutate,exc,needle", [
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table.dtype"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table must have shape"),
    (lambda a: a["block_table"].__setitem__((1, 2), 10_000), ValueError, r"block_table\[1, 2\] = 10000 is outside"),
    (lambda a: a["block_table"].__setitem__((0, 0), -1), ValueError, r"block_table\[0, 0\] = -1"),
    (lambda a: a.update(seq_lens=torch.tensor([5, 13], dtype=torch.int32)), ValueError, "max_pages_per_seq"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :3], v_cache=a["v_cache"][:, :3]), ValueError, "page_size"),
])
def test_paged_input_errors(mutate, exc, needle):
    a = good(page_size=4)
    mutate(a)
    with pytest.raises(exc, match=needle):
        call(a)


def test_unused_block_table_entries_are_not_checked():
    """Entries past a sequence's pages may hold anything (padding)."""
    a = good(page_size=4)
    a["block_table"][0, 2] = 10_000  # sequence 0 has 5 tokens = 2 pages
    call(a)


@pytest.mark.parametrize("hq,hkv", [(33, 2), (3, 2)])
def test_non_divisible_gqa_is_rejected_before_any_kernel(hq, hkv):
    """33 query heads over 2 KV heads has no GQA group size: refused by name."""
    q = torch.zeros(1, 1, hq, 16, dtype=torch.float16)
    k = torch.zeros(1, 8, hkv, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"num_q_heads \({hq}\).*num_kv_heads \({hkv}\)"):
        attnplan.decode(q, k, k, torch.tensor([4], dtype=torch.int32))


def test_devices_must_match():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    a = good()
    a["q"] = a["q"].cuda()
    with pytest.raises(ValueError, match="k_cache is on"):
        call(a)


def test_run_checks_against_plan_and_requires_plan():
    a = good()
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(attnplan.PlanNotReadyError):
        w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"])
    w.plan(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"])
    with pytest.raises(ValueError, match="differ from the planned"):
        w.run(a["q"][:1], a["k_cache"], a["v_cache"], a["seq_lens"])
    with pytest.raises(ValueError, match="out must be"):
        w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], out=torch.empty(3))


def test_forced_unsupported_backend_gives_reasons():
    """A forced backend that cannot serve the problem: the error names it and its reason."""
    with pytest.raises(attnplan.NoBackendError,
                       match=r"(?s)no backend can run.*\n  triton: head_dim 12 not in \[16, 256\]"):
        attnplan.decode(torch.zeros(1, 1, 4, 12, dtype=torch.float16), torch.zeros(1, 4, 2, 12, dtype=torch.float16),
                        torch.zeros(1, 4, 2, 12, dtype=torch.float16), torch.tensor([3], dtype=torch.int32),
                        backend="triton")


@pytest.mark.parametrize("bad", [-3, 5000, 2.5, True, "4", torch.tensor(2.0), torch.tensor([2, 3])],
                         ids=["-3", "5000", "2.5", "True", "str", "float-tensor", "two-element-tensor"])
def test_plan_num_splits_is_checked(bad):
    """Refused by name: not an int in [0, MAX_SPLITS] (a numpy integer is an int, as window_left takes one; a float
    or many-element tensor, which ``operator.index`` refuses with its own words, is not)."""
    import attnplan
    from attnplan.testing import make_inputs

    x = make_inputs(1, 4, 1, 16, [20], dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(ValueError, match="num_splits"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=bad)
    if _np() is not None:
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=_np().int64(2))
        assert w.plan_.num_splits == 2


@pytest.mark.parametrize("bad", [24, 64, 17])
def test_config_block_dv_is_refused_as_removed(bad):
    import attnplan
    from attnplan.config import ConfigError

    with pytest.raises(ConfigError, match="backend_options.triton.block_dv: block_dv was removed"):
        attnplan.load_config(backend_options={"triton": {"block_dv": bad}})


def test_seq_lens_host_replaces_the_device_read_and_is_checked():
    import attnplan
    from attnplan.testing import make_inputs

    x = make_inputs(2, 4, 1, 16, [20, 7], dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20, 7])
    assert plan.problem.max_kv_len == attnplan.problem.len_bucket(20)
    with pytest.raises(ValueError, match="seq_lens_host must hold 2"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20])
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20, 999])


def _np():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize("bad,exc,needle", [
    ([float("nan"), 5], TypeError, r"seq_lens_host\[0\] must be an int .*got nan \(float\)"),
    ([float("inf"), 5], TypeError, r"seq_lens_host\[0\] must be an int .*got inf"),
    ([19.5, 5.0], TypeError, r"seq_lens_host\[0\] must be an int .*got 19.5"),  # never truncated
    ((20.0, 5), TypeError, r"seq_lens_host\[0\] must be an int"),
    (["20", "5"], TypeError, r"seq_lens_host\[0\] must be an int .*'20' \(str\)"),
    ([None, 5], TypeError, r"seq_lens_host\[0\] must be an int .*None"),
    ([[20], [5]], TypeError, r"seq_lens_host\[0\] must be an int .*\[20\] \(list\)"),
    ([20 + 0j, 5], TypeError, r"seq_lens_host\[0\] must be an int"),
    (lambda: iter([20, 5.5]), TypeError, r"seq_lens_host\[1\] must be an int"),
    (5, TypeError, r"seq_lens_host must be a list, tuple, .* got int 5"),
    ("25", TypeError, r"seq_lens_host must be .* got str"),
    (b"\x14\x05", TypeError, r"seq_lens_host must be .* got bytes"),
    ({0: 20, 1: 5}, TypeError, r"seq_lens_host must be .* got dict"),
    ({20, 5}, TypeError, r"seq_lens_host must be .* got set"),
    (lambda: torch.tensor(20), ValueError, r"seq_lens_host must be 1-D \[batch\] \(dense\), got a torch.strided "
                                           r"tensor of shape \(\)"),
    (lambda: torch.tensor([[20, 5]]), ValueError, r"seq_lens_host must be 1-D"),
    (lambda: torch.tensor([20, 5]).to_sparse(), ValueError, r"seq_lens_host must be 1-D \[batch\] \(dense\), got a "
                                                            r"torch.sparse_coo tensor"),
    (lambda: torch.tensor([20.0, 5.0]), TypeError, r"seq_lens_host must hold ints, got a torch.float32 tensor"),
    (lambda: torch.tensor([20, 5], device="meta"), ValueError, r"seq_lens_host must be host integers, got a tensor "
                                                                r"on meta"),
    (lambda: _np().array([20.0, 5.0]), TypeError, r"seq_lens_host must hold ints, got a float64 array"),
    (lambda: _np().array([[20, 5]]), ValueError, r"seq_lens_host must be 1-D"),
    ([2**70, 5], ValueError, r"seq_lens\[0\] = 1180591620717411303424 exceeds the cache capacity 32 tokens "
                             r"\(max_pages_per_seq \* page_size; given as seq_lens_host\[0\]\)"),
    ([-2**70, 5], ValueError, r"seq_lens must be >= 0, got \[-1180591620717411303424, 5\] \(given as seq_lens_host\)"),
    ([10**5000, 5], ValueError, r"seq_lens\[0\] = an int of 16610 bits"),
    (lambda: _np().array([2**63 + 5, 5], dtype="uint64"), ValueError, r"seq_lens\[0\] = 9223372036854775813 "),
])
def test_seq_lens_host_of_other_kinds_is_refused_by_name(bad, exc, needle):
    """``seq_lens_host`` is one int per sequence: a list or tuple (or another ordered iterable) of ints (Python,
    numpy or 0-d torch integers; bools count), a 1-D CPU integer tensor or numpy integer array. A float is refused,
    not truncated; so are NaN, strings, None, a scalar, a mapping (its keys are no lengths), a set (no order),
    float tensors and tensors off the CPU; ints of any size are range-checked without overflow. Nothing runs."""
    x = make_inputs(2, 4, 2, 16, [20, 5], page_size=16, dtype=torch.float16)
    make = bad if callable(bad) else lambda: bad
    out = torch.full_like(x.q, float("nan"))
    with pytest.raises(exc, match=needle):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference", out=out,
                        seq_lens_host=make())
    assert torch.isnan(out).all()
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(exc, match=needle):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=make())


@pytest.mark.parametrize("good", [
    [20, 5], (20, 5), range(20, 4, -15), iter([20, 5]), [True, 5], lambda: torch.tensor([20, 5]),
    lambda: torch.tensor([20, 5], dtype=torch.int32), lambda: [torch.tensor(20), torch.tensor(5)],
    lambda: _np().array([20, 5]), lambda: [_np().int64(20), _np().int32(5)], lambda: _np().array([20, 5], "uint8")])
def test_seq_lens_host_kinds_that_are_ints_are_accepted(good):
    x = make_inputs(2, 4, 2, 16, [20, 5], page_size=16, dtype=torch.float16)
    good = good() if callable(good) else good
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=good)
    lens = [int(v) for v in w._lens_host]
    assert lens in ([20, 5], [1, 5]) and w.plan_.problem.max_kv_len == attnplan.problem.len_bucket(max(lens))



# ---------------------------------------------------------------------------------------------------
# The input contract (attnplan.problem's module docstring): every refusal names the argument and
# happens before any kernel runs (a NaN-poisoned out stays NaN); every allowed input matches the
# float64 reference.

import math

from conftest import kernel_backends

from attnplan import reference
from attnplan.testing import assert_close_to_reference

CPU_BACKENDS = ["reference", *kernel_backends("cpu")]


def fp32_case(page_size=4, lens=(13, 7), q_len=1, seed=0):
    return make_inputs(2, 4, 2, 16, list(lens), q_len=q_len, page_size=page_size, dtype=torch.float32,
                       generator=torch.Generator().manual_seed(seed))


def poisoned(x):
    return torch.full_like(x.q, float("nan")), torch.full(x.q.shape[:3], float("nan"))


def refused(exc, needle, fn, out=None, lse=None):
    """``fn()`` raises ``exc`` matching ``needle`` and left the poisoned ``out`` / ``lse`` untouched."""
    with pytest.raises(exc, match=needle):
        fn()
    for t in (out, lse):
        if t is not None:
            assert torch.isnan(t).all(), "a kernel wrote before the refusal"


def strided(t, axis=-1):
    """``t``'s values in a view whose ``axis`` has stride 2 (same shape)."""
    return torch.stack([t, torch.zeros_like(t)], dim=t.dim() if axis == -1 else axis + 1).select(
        t.dim() if axis == -1 else axis + 1, 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_seq_lens_is_refused(backend):
    """``torch.tensor([37, 9, 100, 9])[::2]`` as seq_lens: Triton assumed unit stride and read past it."""
    x = make_inputs(2, 4, 2, 16, [37, 100], dtype=torch.float32)
    sl = torch.tensor([37, 9, 100, 9], dtype=torch.int32)[::2]
    assert sl.stride() == (2,)
    out, lse = poisoned(x)
    refused(ValueError, r"seq_lens must have unit stride .* strides \(2,\)",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, sl, backend=backend, out=out, lse=lse), out, lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_column_major_block_table_is_refused(backend):
    x = fp32_case()
    bt = x.block_table.t().contiguous().t()
    assert torch.equal(bt, x.block_table) and bt.stride(1) != 1
    out, lse = poisoned(x)
    refused(ValueError, r"block_table must have unit stride in its last axis",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, backend=backend, out=out, lse=lse),
            out, lse)


def test_strided_sinks_are_refused():
    x = fp32_case()
    sinks = strided(torch.zeros(4))
    out, lse = poisoned(x)
    refused(ValueError, r"sinks must have unit stride",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sinks=sinks,
                                    backend="reference", out=out, lse=lse), out, lse)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_strided_fp8_scale_tensors_are_refused(name):
    x = make_inputs(2, 4, 2, 16, [13, 7], page_size=4, dtype=torch.float16)
    k8, v8 = x.k_cache.to(torch.float8_e4m3fn), x.v_cache.to(torch.float8_e4m3fn)
    scales = {"k_scale": torch.ones(2), "v_scale": torch.ones(2), name: strided(torch.ones(2))}
    out, lse = poisoned(x)
    refused(ValueError, rf"{name} must have unit stride",
            lambda: attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", out=out, lse=lse,
                                    **scales), out, lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_out_last_axis_is_refused(backend):
    x = fp32_case()
    out = strided(torch.full_like(x.q, float("nan")))
    refused(ValueError, r"out must have unit stride in head_dim",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, out=out),
            out)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_lse_last_axis_is_refused(backend):
    x = fp32_case()
    out = torch.full_like(x.q, float("nan"))
    lse = strided(torch.full(x.q.shape[:3], float("nan")))
    refused(ValueError, r"lse must have unit stride",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, out=out,
                                    lse=lse), out, lse)


def _allowed_stride_inputs(x):
    """Each allowed non-unit stride (module docstring) as a view holding the same values."""
    qb = torch.randn(2, x.q.shape[1], 8, 16)
    qb[:, :, ::2] = x.q
    kv = torch.empty(*x.k_cache.shape[:2], 2, *x.k_cache.shape[2:])
    kv[:, :, 0], kv[:, :, 1] = x.k_cache, x.v_cache
    kb = torch.randn(*x.k_cache.shape[:3], 32)
    kb[..., :16] = x.k_cache
    pb = torch.randn(2 * x.k_cache.shape[0], *x.k_cache.shape[1:])
    pb[1::2] = x.k_cache
    bb = torch.full((2, 2 * x.block_table.shape[1]), -7, dtype=torch.int32)
    bb[:, : x.block_table.shape[1]] = x.block_table
    return {"q head stride": dict(q=qb[:, :, ::2]),
            "K and V interleaved (token stride)": dict(k_cache=kv[:, :, 0], v_cache=kv[:, :, 1]),
            "K head stride": dict(k_cache=kb[..., :16]),
            "K page stride": dict(k_cache=pb[1::2]),
            "block-table row stride": dict(block_table=bb[:, : x.block_table.shape[1]])}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_allowed_strides_match_the_reference(backend, splits):
    """q's batch / head strides, the cache's page / token / head strides, block-table rows and out's / lse's
    leading strides are free."""
    x = fp32_case(q_len=2)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    for what, change in _allowed_stride_inputs(x).items():
        a = {**dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table),
             **change}
        ob = torch.full((2, 2, 4, 48), float("nan"))
        lb = torch.full((3, 2, 2, 8), float("nan"))
        out, lse = ob[:, :, :, 8:24], lb[1, :, :, 2:6]  # leading strides (192, 96, 48) and (16, 8)
        attnplan.decode(**a, backend=backend, num_splits=splits, out=out, lse=lse)
        assert_close_to_reference(out, ref, torch.float32, what=f"out ({what})")
        assert_close_to_reference(lse, ref_lse, torch.float32, what=f"lse ({what})")


# -- run() against plan() ----------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    (lambda a: a.update(k_cache=strided(a["k_cache"])), r"k_cache strides .* differs from the planned"),
    (lambda a: a.update(v_cache=a["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)), r"v_cache strides"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), r"seq_lens dtype torch.int64 differs"),
    (lambda a: a.update(seq_lens=strided(a["seq_lens"])), r"seq_lens strides"),
    (lambda a: a.update(block_table=a["block_table"].t().contiguous().t()), r"block_table strides"),
    (lambda a: a.update(block_table=None), r"block_table was a tensor at plan\(\) and is None now"),
    (lambda a: a.update(q=torch.empty(a["q"].numel() + 1)[1:].view(a["q"].shape).copy_(a["q"])),
     r"q 16-byte alignment of the data pointer False differs from the planned True"),
    (lambda a: a.update(v_cache=a["v_cache"][:-1]), r"v_cache shape"),
])
def test_run_refuses_what_plan_did_not_see(change, needle):
    """run() compares every tensor's shape, strides, dtype, device and alignment with the plan's: a K whose
    last axis has stride 2 is refused by decode() and, after a plan with a contiguous K, by run()."""
    x = fp32_case()
    a = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)
    assert a["q"].data_ptr() % 16 == 0
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(**a)
    change(a)
    out, lse = poisoned(x)
    refused(ValueError, needle, lambda: w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"],
                                              out=out, lse=lse), out, lse)


def test_run_refuses_a_non_tensor_by_name():
    x = fp32_case()
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor, got list"):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table.tolist())
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=[1.0])


# -- non-finite and out-of-range parameters -----------------------------------------------------------

@pytest.mark.parametrize("kw,exc,needle", [
    (dict(logits_soft_cap=float("inf")), ValueError, r"logits_soft_cap must be a finite float in \[0, 1e\+30\]"),
    (dict(logits_soft_cap=2e30), ValueError, "logits_soft_cap must be a finite float in"),
    (dict(sm_scale=1e39), ValueError, "sm_scale must be finite and at most 2.359e"),
    (dict(sm_scale=-3e38), ValueError, "sm_scale must be finite and at most"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite"),
    (dict(sm_scale=float("inf")), ValueError, "sm_scale must be finite"),
    (dict(sm_scale=-float("inf")), ValueError, "sm_scale must be finite"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale must be a float"),
    (dict(window_left=True), TypeError, "window_left must be an int"),
    (dict(window_left=2.5), TypeError, "window_left must be an int"),
    (dict(window_left=-2), ValueError, "window_left must be -1"),
    (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), ValueError, r"sinks\[1\] = nan"),
    (dict(sinks=torch.tensor([0.0, 0.0, 0.0, float("inf")])), ValueError, r"sinks\[3\] = inf"),
    (dict(logits_soft_cap=1e-300), ValueError, "logits_soft_cap must be .* 0 \\(off\\) or at least 1.175e-38"),
    (dict(logits_soft_cap=5e-324), ValueError, "logits_soft_cap must be .* at least 1.175e-38"),
    (dict(logits_soft_cap=1e-39), ValueError, "logits_soft_cap must be .* at least 1.175e-38"),
    # a nonzero scale whose fp32 product with log2(e) would be subnormal
    (dict(sm_scale=8e-39), ValueError, r"sm_scale must be 0 or at least 8.148e-39 in magnitude .* got 8e-39"),
    (dict(sm_scale=-1e-300), ValueError, "sm_scale must be 0 or at least 8.148e-39"),
    (dict(sm_scale=5e-324), ValueError, "sm_scale must be 0 or at least 8.148e-39"),
    # real numbers beyond the float range: refused as out of range, named, never an OverflowError
    (dict(sm_scale=10**400), ValueError, "sm_scale must be finite and at most .* got an int of 1329 bits"),
    (dict(sm_scale=-10**5000), ValueError, "sm_scale must be finite and at most .* got an int of 16610 bits"),
    (dict(logits_soft_cap=10**400), ValueError, "logits_soft_cap must be a finite float in .* got an int of"),
    (dict(window_left=-10**5000), ValueError, "window_left must be -1 .* got an int of 16610 bits"),
])
def test_bad_parameters_are_refused_by_name(kw, exc, needle):
    x = fp32_case()
    out, lse = poisoned(x)
    refused(exc, needle, lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table,
                                                 backend="reference", out=out, lse=lse, **kw), out, lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kw", [dict(sm_scale=0.0), dict(sm_scale=-0.7), dict(window_left=10**12),
                                dict(window_left=2**64 + 2), dict(logits_soft_cap=1e4), dict(logits_soft_cap=1e30),
                                dict(window_left=0), dict(sinks=torch.tensor([float("-inf"), 0.5, float("-inf"), -3.0])),
                                dict(logits_soft_cap=1e-3)], ids=lambda kw: next(iter(kw)) + "=" + str(next(iter(kw.values())))[:12])
def test_legal_edge_parameters_match_the_reference(backend, kw):
    """0 and negative scales are legal math; a window longer than any cache is no window (any int); a -inf sink is
    none; a soft cap far above the scores leaves them nearly unchanged (tanh of a tiny argument, which fp32 keeps
    exact only through a series: 1 - exp(-2|x|) loses a small x)."""
    x = fp32_case(q_len=2)
    out, lse = poisoned(x)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, num_splits=3, out=out,
                    lse=lse, **kw)
    rkw = {"window_left" if k == "window_left" else "soft_cap" if k == "logits_soft_cap" else k: v for k, v in kw.items()}
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table,
                                       rkw.pop("sm_scale", None), **rkw)
    assert_close_to_reference(out, ref, torch.float32)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_smallest_sm_scale_matches_the_reference_in_bf16(backend, num_splits, sign):
    """The smallest nonzero ``sm_scale`` (``SM_SCALE_MIN``: ``x log2(e)`` is fp32's smallest normal number) gives the
    reference's nearly uniform softmax in bf16, single pass and split (a scale just below it, now refused, gave
    Triton's interpreter an fp64 argument and an all-zero single-pass output)."""
    from attnplan.problem import SM_SCALE_MIN
    x = make_inputs(1, 2, 1, 64, [37], page_size=None, dtype=torch.bfloat16,
                    generator=torch.Generator().manual_seed(11))
    out = torch.full_like(x.q, float("nan"))
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend=backend, num_splits=num_splits, out=out,
                    sm_scale=sign * SM_SCALE_MIN)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, sign * SM_SCALE_MIN)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_smallest_soft_cap_matches_the_reference_at_zero_scores(backend):
    """At the smallest legal soft cap (fp32's smallest normal number) ``1 / cap`` is finite in fp32, so a score of
    exactly 0 (here a query of zeros beside an ordinary one) is capped to 0, not ``0 / 0``: the rows match the
    float64 reference. A smaller positive cap is refused (it is 0 or subnormal in fp32)."""
    from attnplan.problem import SOFT_CAP_MIN

    x = fp32_case(q_len=2)
    x.q[0].zero_()
    out, lse = poisoned(x)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, num_splits=3, out=out,
                    lse=lse, logits_soft_cap=SOFT_CAP_MIN)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, soft_cap=SOFT_CAP_MIN)
    assert_close_to_reference(out, ref, torch.float32)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    with pytest.raises(ValueError, match="logits_soft_cap must be .* at least 1.175e-38"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend,
                        logits_soft_cap=SOFT_CAP_MIN / 2)


def fp8_case():
    x = make_inputs(2, 4, 2, 16, [13, 7], page_size=4, dtype=torch.float16)
    return x, x.k_cache.to(torch.float8_e4m3fn), x.v_cache.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, 1e39, 1e-46, 1e-40])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_fp8_scales_must_be_finite_and_positive(bad, name, as_tensor):
    """Finite and in fp32's normal range: the kernels apply the scale in fp32, where 1e-46 is 0 and 1e-40 a subnormal
    that a GPU may flush to 0 (every score 0, or an all-zero output)."""
    x, k8, v8 = fp8_case()
    scales = {"k_scale": 1.0, "v_scale": 1.0}
    scales[name] = torch.tensor([1.0, bad]) if as_tensor else bad
    out, lse = poisoned(x)
    needle = (rf"{name}\[1\] = {float(torch.tensor(bad))}" if as_tensor
              else rf"{name} must be a finite float in \[1.175e-38, ")
    refused(ValueError, needle, lambda: attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference",
                                                        out=out, lse=lse, **scales), out, lse)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_fp8_scale_tensors_that_require_grad_are_refused(name):
    """As q, the caches and sinks: with grad mode on, a scale tensor that requires grad is refused by name by plan()
    and decode() (the output would be detached from it); under ``torch.no_grad()`` the same call is served."""
    x, k8, v8 = fp8_case()
    scales = {"k_scale": torch.full((2,), 0.5), "v_scale": torch.full((2,), 2.0)}
    scales[name] = scales[name].clone().requires_grad_()
    out, lse = poisoned(x)
    refused(ValueError, f"{name} requires grad: attnplan computes no gradients",
            lambda: attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", out=out, lse=lse,
                                    **scales), out, lse)
    with pytest.raises(ValueError, match=f"{name} requires grad"):
        attnplan.DecodeWrapper(backend="reference").plan(x.q, k8, v8, x.seq_lens, x.block_table, **scales)
    with torch.no_grad():
        got = attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", **scales)
        ref, _ = reference.attention(x.q, k8, v8, x.seq_lens, x.block_table, x.sm_scale, **scales)
    assert not got.requires_grad
    assert_close_to_reference(got, ref, torch.float16)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_fp8_float_scales_beyond_the_float_range_are_refused_by_name(name):
    x, k8, v8 = fp8_case()
    scales = {"k_scale": 1.0, "v_scale": 1.0, name: 10**400}
    out, lse = poisoned(x)
    refused(ValueError, rf"{name} must be a finite float in \[1.175e-38, .* got an int of 1329 bits",
            lambda: attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", out=out, lse=lse,
                                    **scales), out, lse)


def test_numpy_float16_parameters_are_checked_without_warnings():
    """A numpy ``float16`` is a real number like any other: its range checks compare Python floats (comparing the
    float16 itself with the ~2.4e38 bound would warn on casting the bound to float16)."""
    import warnings

    np = pytest.importorskip("numpy")
    x, k8, v8 = fp8_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", sm_scale=np.float16(0.25),
                        logits_soft_cap=np.float16(30.0), k_scale=np.float16(0.5), v_scale=np.float16(2.0))


def test_tensor_values_are_read_once_per_version(monkeypatch):
    """plan() reads a tensor's sink / scale values the first time it sees the tensor at a version; later
    plans of the same tensor at the same version read nothing (no device sync)."""
    import attnplan.problem as P

    reads = []
    real = P._bad_values
    monkeypatch.setattr(P, "_bad_values", lambda name, t: reads.append(name) or real(name, t))
    x, k8, v8 = fp8_case()
    ks, vs, sinks = torch.ones(2), torch.full((2,), 0.5), torch.zeros(4)
    w = attnplan.DecodeWrapper(backend="reference")
    for _ in range(3):
        w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=ks, v_scale=vs, sinks=sinks, seq_lens_host=[13, 7])
    assert sorted(reads) == ["k_scale", "sinks", "v_scale"]
    sinks[2] = float("nan")  # an in-place write bumps the version: read again, refused
    with pytest.raises(ValueError, match=r"sinks\[2\] = nan"):
        w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=ks, v_scale=vs, sinks=sinks)
    assert reads.count("sinks") == 2
    ks.data[0] = -1.0  # documented limit: a write that bypasses the version counter is not seen
    w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=ks, v_scale=vs)
    ks.mul_(1.0)  # any in-place op bumps the version: read again
    with pytest.raises(ValueError, match=r"k_scale\[0\] = -1.0"):
        w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=ks, v_scale=vs)


def test_problem_refuses_bool_window_and_infinite_soft_cap():
    with pytest.raises(TypeError, match="window_left"):
        attnplan.DecodeProblem(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=16, window_left=True)
    with pytest.raises(ValueError, match="soft_cap"):
        attnplan.DecodeProblem(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=16, soft_cap=math.inf)


@pytest.mark.parametrize("kw,needle", [
    (dict(q_len=2.5), "DecodeProblem.q_len must be an int, got float 2.5"),
    (dict(head_dim=16.0), "DecodeProblem.head_dim must be an int, got float 16.0"),
    (dict(batch=True), "DecodeProblem.batch must be an int, got bool True"),
    (dict(head_dim="16"), "DecodeProblem.head_dim must be an int, got str '16'"),
    (dict(page_size=16.0), "DecodeProblem.page_size must be an int, got float"),
    (dict(max_kv_len=1e9), "DecodeProblem.max_kv_len must be an int"),
    (dict(capacity=1.5), "DecodeProblem.capacity must be an int"),
    (dict(has_sinks="no"), "DecodeProblem.has_sinks must be a bool, got str 'no'"),  # truthy: had sinks
])
def test_problem_fields_of_the_wrong_type_are_refused_by_name(kw, needle):
    """A DecodeProblem made by hand (for make_plan) checks its fields' types: a float count or length was planned
    with (q_len 2.5, head_dim 16.0), a string compared deep in the planner, a truthy string read as sinks."""
    with pytest.raises(TypeError, match=needle):
        attnplan.DecodeProblem(**{**dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, max_kv_len=100), **kw})


def test_problem_takes_numpy_integers_as_python_ints():
    np = _np()
    p = attnplan.DecodeProblem(batch=np.int64(2), num_q_heads=np.int32(4), num_kv_heads=2, head_dim=16,
                               page_size=np.int64(16), max_kv_len=np.int64(100), window_left=np.int64(7))
    for name in ("batch", "num_q_heads", "page_size", "max_kv_len", "window_left", "total_kv_len", "capacity"):
        assert type(getattr(p, name)) is int, name
    assert p == attnplan.DecodeProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16,
                                       max_kv_len=100, window_left=7)


# -- aliasing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_out_aliasing_q_is_refused_under_a_single_pass(backend):
    """``out=q`` with a single-pass plan (the partial kernel writes out while other programs read q)."""
    x = fp32_case()
    q0 = x.q.clone()
    refused(ValueError, "out overlaps q",
            lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend,
                                    num_splits=1, out=x.q))
    assert torch.equal(x.q, q0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_lse_viewing_out_is_refused(backend):
    """``lse=out[..., 0]`` (refused for its stride) and an lse with unit stride inside out's bytes."""
    x = fp32_case()
    out = torch.full_like(x.q, float("nan"))
    refused(ValueError, "lse must have unit stride", lambda: attnplan.decode(
        x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, out=out, lse=out[..., 0]), out)
    lse = out.view(-1)[: 2 * 4].view(2, 1, 4)
    refused(ValueError, "out overlaps lse", lambda: attnplan.decode(
        x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, out=out, lse=lse), out)


@pytest.mark.parametrize("victim", ["k_cache", "v_cache", "seq_lens", "block_table", "sinks"])
def test_out_viewing_an_input_is_refused(victim):
    x = fp32_case()
    sinks = torch.zeros(4)
    pool = torch.zeros(4096)  # one storage holding the victim and out, in crossing byte ranges
    a = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table, sinks=sinks)
    t = a[victim]
    a[victim] = pool.view(torch.int32)[: t.numel()].view(t.shape).copy_(t) if t.dtype == torch.int32 else \
        pool[: t.numel()].view(t.shape).copy_(t)
    out = pool[t.numel() // 2: t.numel() // 2 + x.q.numel()].view(x.q.shape)
    with pytest.raises(ValueError, match=f"out overlaps {victim}"):
        attnplan.decode(**a, backend="reference", out=out)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(**a)
    with pytest.raises(ValueError, match=f"out overlaps {victim}"):
        w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"], out=out)


def test_disjoint_views_of_one_buffer_are_allowed():
    """out and lse carved from one workspace without crossing byte ranges are fine."""
    x = fp32_case()
    ws = torch.full((x.q.numel() + 8,), float("nan"))
    out, lse = ws[: x.q.numel()].view(x.q.shape), ws[x.q.numel():].view(2, 1, 4)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference", out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert_close_to_reference(out, ref, torch.float32)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


# -- hostile inputs of the kinds a first round of checks missed ---------------------------------------------

def test_a_paged_cache_without_pages_is_refused_for_any_capacity():
    """A plan serves any lengths up to its capacity: a paged cache of 0 pages can serve none above 0 (the kernels
    clamp page indices into [0, num_pages)), so it is refused even when the planned lengths are all 0."""
    q = torch.zeros(1, 1, 2, 16)
    k = torch.empty(0, 16, 1, 16)
    bt, sl = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for capacity in (False, True):
        with pytest.raises(ValueError, match="a paged k_cache needs at least one page"):
            attnplan.DecodeWrapper(backend="reference").plan(q, k, k, sl, bt, capacity=capacity)
    out = attnplan.decode(q, k, k, sl, torch.zeros(1, 0, dtype=torch.int32), backend="reference")  # capacity 0
    assert torch.equal(out, torch.zeros_like(q))


def test_fp8_score_scale_times_k_scale_must_fit_fp32():
    x, k8, v8 = fp8_case()
    with pytest.raises(ValueError, match="sm_scale x k_scale"):
        attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", sm_scale=1e30, k_scale=1e10,
                        v_scale=1.0)


def test_fp8_score_scale_times_the_largest_tensor_k_scale_must_fit_fp32():
    """Per-KV-head scales: each at most FP32_SCALED_MAX, and sm_scale times the largest of them too; the second plan
    of the same tensor (its values remembered, not read again) is checked against its own sm_scale."""
    from attnplan.problem import FP32_SCALED_MAX

    x, k8, v8 = fp8_case()
    ones = torch.ones(2)
    big = torch.tensor([1.0, FP32_SCALED_MAX * 1.2])  # finite in fp32, beyond what the kernels' fp32 product holds
    with pytest.raises(ValueError, match=r"k_scale\[1\] = .*at most"):
        attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", k_scale=big, v_scale=ones)
    k_scale = torch.tensor([1.0, 1e10])
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=k_scale, v_scale=ones, sm_scale=1e20)
    with pytest.raises(ValueError, match=r"sm_scale x max\(k_scale\) = 1e\+40"):
        w.plan(x.q, k8, v8, x.seq_lens, x.block_table, k_scale=k_scale, v_scale=ones, sm_scale=1e30)
    with pytest.raises(ValueError, match=r"sm_scale x max\(k_scale\)"):
        attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", k_scale=k_scale, v_scale=ones,
                        sm_scale=-1e30)


@pytest.mark.parametrize("name", ["sinks", "k_scale", "out", "lse"])
def test_lazy_negated_variant_tensors_and_outputs_are_refused(name):
    """A lazily negated view reads (or is written) as its memory is, without the pending negation."""
    x, k8, v8 = fp8_case()
    out, lse = poisoned(x)
    a = dict(sinks=torch.zeros(4), k_scale=torch.ones(2), v_scale=torch.ones(2), out=out, lse=lse)
    a[name] = torch._neg_view(a[name])
    refused(ValueError, f"{name} is a lazily negated", lambda: attnplan.decode(
        x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", **a), None if name == "out" else out)
    if name in ("out", "lse"):  # run(): its one-pass check and its full path
        w = attnplan.DecodeWrapper(backend="reference")
        good = dict(a, **{name: torch._neg_view(a[name])})  # undo: a plain tensor again
        w.plan(x.q, k8, v8, x.seq_lens, x.block_table, sinks=good["sinks"], k_scale=good["k_scale"],
               v_scale=good["v_scale"])
        for _ in range(2):
            with pytest.raises(ValueError, match=f"{name} is a lazily negated"):
                w.run(x.q, k8, v8, x.seq_lens, x.block_table, out=a["out"], lse=a["lse"])


def test_zero_head_dim_and_lazy_negated_views_are_refused():
    x = fp32_case()
    with pytest.raises(ValueError, match="head_dim"):
        attnplan.decode(torch.zeros(1, 1, 1, 0), torch.zeros(1, 4, 1, 0), torch.zeros(1, 4, 1, 0),
                        torch.tensor([2], dtype=torch.int32), backend="reference")
    neg = torch._neg_view(x.q)
    assert neg.is_neg()
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference")  # same signature
    with pytest.raises(ValueError, match="q is a lazily negated or conjugated view"):
        attnplan.decode(neg, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "seq_lens", "block_table"])
def test_lazy_negated_inputs_are_refused_by_plan_and_run(name, backend):
    """A lazily negated input has the shape, strides, dtype, device and data pointer of the tensor it views, so run()'s
    signature cannot tell them apart: plan(), run()'s one-pass check and its full path each refuse it by name before
    any kernel runs (it would be read as its memory is, without the negation), and the wrapper still runs the plain
    tensor afterwards."""
    x = fp32_case()
    args = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)
    bad = dict(args, **{name: torch._neg_view(args[name])})
    out, lse = poisoned(x)
    w = attnplan.DecodeWrapper(backend=backend)
    refused(ValueError, f"{name} is a lazily negated", lambda: w.plan(*bad.values()))
    w.plan(*args.values())
    # a second plan() of the same signature reuses the first one's checks: not for such a view (host lengths given,
    # so no value check reads the view's negated entries first)
    refused(ValueError, f"{name} is a lazily negated", lambda: w.plan(*bad.values(), seq_lens_host=[13, 7]))
    w.plan(*args.values())
    # run() takes its one-pass check, which hands the view to the full path, which raises; try_run() declines
    refused(ValueError, f"{name} is a lazily negated", lambda: w.run(*bad.values(), out=out, lse=lse), out, lse)
    assert w.try_run(*bad.values(), out=out, lse=lse) is None and torch.isnan(out).all()
    ref_out, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert_close_to_reference(w.run(*args.values(), out=out, lse=lse), ref_out)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_outputs_whose_elements_share_memory_are_refused(backend):
    """An expanded out (both sequences' rows in one place) or lse: one result would be lost. Refused by decode(),
    by run()'s full path and by its one-pass check (a plan made without out)."""
    from attnplan.problem import has_internal_overlap

    x = fp32_case()
    out = torch.full((1, 1, 4, 16), float("nan")).expand(2, 1, 4, 16)
    lse = torch.full((1, 1, 4), float("nan")).expand(2, 1, 4)
    good_out, good_lse = poisoned(x)
    for o, lo, what in ((out, None, "out"), (None, lse, "lse"), (good_out, lse, "lse")):
        refused(ValueError, f"{what} has elements that share memory", lambda: attnplan.decode(
            x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, out=o, lse=lo), good_out)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    strided = torch.full((2, 1, 4, 32), float("nan"))[..., :16]  # legal: distinct elements, accepted on every run
    for _ in range(2):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=strided)
    for o, lo, what in ((out, None, "out"), (None, lse, "lse"), (good_out, lse, "lse")):
        with pytest.raises(ValueError, match=f"{what} has elements that share memory"):
            w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=o, lse=lo)
    assert torch.isnan(good_out).all() and not torch.isnan(strided).any()
    assert not has_internal_overlap((2, 3, 4), (12, 4, 1)) and not has_internal_overlap((2, 1, 4), (64, 0, 1))
    assert has_internal_overlap((2, 3, 4), (4, 4, 1)) and has_internal_overlap((2, 4), (0, 1))


def test_a_failed_plan_leaves_no_plan_to_run(monkeypatch):
    """plan() that raises after its checks passed in part (here: binding the launch) must not leave the new
    inputs' signature paired with the previous plan: run() then refuses until a plan() succeeds."""
    x = fp32_case()
    y = make_inputs(4, 4, 2, 16, [3, 9, 1, 5], page_size=4, dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    real = attnplan.DecodeWrapper._bind

    def broken(self, *a, **k):
        raise RuntimeError("binding failed")
    monkeypatch.setattr(attnplan.DecodeWrapper, "_bind", broken)
    with pytest.raises(RuntimeError, match="binding failed"):
        w.plan(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table)
    for z in (y, x):
        with pytest.raises(attnplan.PlanNotReadyError):
            w.run(z.q, z.k_cache, z.v_cache, z.seq_lens, z.block_table)
        assert w.try_run(z.q, z.k_cache, z.v_cache, z.seq_lens, z.block_table) is None
    monkeypatch.setattr(attnplan.DecodeWrapper, "_bind", real)
    w.plan(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table)
    ref, _ = reference.attention(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table)
    assert_close_to_reference(w.run(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table), ref, torch.float32)


def test_kept_variant_tensors_resized_after_plan_are_refused():
    x = fp32_case()
    sinks = torch.zeros(4)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, sinks=sinks)
    sinks.set_(torch.zeros(1))
    with pytest.raises(ValueError, match="sinks must be a 1-D float32 tensor of 4 elements"):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    x8, k8, v8 = fp8_case()
    ks = torch.ones(2)
    w.plan(x8.q, k8, v8, x8.seq_lens, x8.block_table, k_scale=ks, v_scale=1.0)
    ks.set_(torch.ones(3))
    with pytest.raises(ValueError, match="k_scale must be a 1-D float32 tensor of 2 elements"):
        w.run(x8.q, k8, v8, x8.seq_lens, x8.block_table)


# -- the meta device, outputs torch guards, the config argument --------------------------------------------------

@pytest.mark.parametrize("host", [None, [13, 7]])
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "seq_lens", "block_table", "all"])
def test_meta_tensors_are_refused_by_name(name, host):
    """A tensor on the meta device has a shape and no data: refused by name before anything else reads it (not
    torch's NotImplementedError, nor an overlap of the empty byte ranges [0x0, ...) meta tensors report)."""
    x = fp32_case()
    args = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)
    for n in args if name == "all" else (name,):
        args[n] = args[n].to("meta")
    want = "q" if name == "all" else name
    for backend in ("reference", *kernel_backends("cpu")):
        with pytest.raises(ValueError, match=f"{want} is on the meta device \\(a shape without data\\)"):
            attnplan.decode(*args.values(), backend=backend, seq_lens_host=host)
        w = attnplan.DecodeWrapper(backend=backend)
        with pytest.raises(ValueError, match=f"{want} is on the meta device"):
            w.plan(*args.values(), seq_lens_host=host)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("splits,merge", [(1, "auto"), (3, "separate"), (3, "fused")])
def test_outputs_that_require_grad_or_are_inference_tensors_are_written_outside_grad_mode(backend, splits, merge):
    """The kernels write ``out`` and ``lse`` through their memory. With grad mode off, an ``out`` that requires grad
    (a leaf) and an ``lse`` made in inference mode are written like any buffer (so does the float64 reference
    backend, whose in-place torch ops refused both), and ``out`` itself is returned, with no autograd graph. With
    grad mode on, a buffer that requires grad is refused by name before any kernel runs, as torch's own ``out=``
    refuses it: written in place, it would hold a result autograd knows nothing of."""
    x = fp32_case(lens=(13, 7))
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    ctx = attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False}, split={"merge": merge}))
    out = torch.full_like(x.q, float("nan")).requires_grad_()
    with torch.inference_mode():
        lse = torch.full(x.q.shape[:3], float("nan"))

    def call(o, l):
        return attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=o, lse=l, backend=backend,
                               num_splits=splits, config=ctx)

    with pytest.raises(ValueError, match="out requires grad: attnplan writes it in place"):
        call(out, lse)
    with pytest.raises(ValueError, match="lse requires grad"):
        call(None, torch.zeros(x.q.shape[:3]).requires_grad_())
    assert torch.isnan(out.detach()).all() and torch.isnan(lse).all()  # nothing ran
    with torch.no_grad():
        got = call(out, lse)
    assert got is out and out.requires_grad and out.grad_fn is None and lse.is_inference()
    assert_close_to_reference(out.detach(), ref, torch.float32)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)


@pytest.mark.parametrize("name", ["out", "lse"])
def test_run_refuses_outputs_that_require_grad_in_grad_mode(name):
    """``run()`` after a ``plan()``: an output buffer that requires grad, while grad mode is on, leaves the one-pass
    check for the full path, which refuses it by name; it stays unwritten. Under ``torch.no_grad()`` the same call
    writes it."""
    x = fp32_case(lens=(13, 7))
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[13, 7])
    bufs = {"out": torch.full_like(x.q, float("nan")), "lse": torch.full(x.q.shape[:3], float("nan"))}
    bufs[name].requires_grad_()
    with pytest.raises(ValueError, match=f"{name} requires grad"):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, **bufs)
    assert torch.isnan(bufs["out"].detach()).all() and torch.isnan(bufs["lse"].detach()).all()
    with torch.no_grad():
        got = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, **bufs)
    assert_close_to_reference(got.detach(), ref, torch.float32)
    assert torch.allclose(bufs["lse"].detach().double(), ref_lse, atol=1e-4)


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "sinks"])
def test_inputs_that_require_grad_are_refused_while_grad_mode_is_on(name):
    """attnplan computes no gradients: with grad mode on, an input that requires grad is refused by name by plan() and
    decode() (also where decode() repeats its last call's plan, which skips plan()), instead of an output silently
    detached from it; under ``torch.no_grad()`` the same tensors are served and equal the reference."""
    x = fp32_case(lens=(13, 7))
    hq = x.q.shape[2]
    args = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, sinks=torch.randn(hq) if name == "sinks" else None)
    ctx = attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    host = [13, 7]
    grad = {**args, name: args[name].clone().requires_grad_()}

    def call(a, **kw):
        return attnplan.decode(a["q"], a["k_cache"], a["v_cache"], x.seq_lens, x.block_table, sinks=a["sinks"],
                               backend="reference", config=ctx, **kw)

    call(args, seq_lens_host=host)  # the pooled wrapper now repeats this call's plan for the same inputs
    for kw in ({"seq_lens_host": host}, {}):  # the repeat first: a plan() that raises leaves no plan to repeat
        with pytest.raises(ValueError, match=f"{name} requires grad: attnplan computes no gradients"):
            call(grad, **kw)
    w = attnplan.DecodeWrapper(ctx, backend="reference")
    with pytest.raises(ValueError, match=f"{name} requires grad"):
        w.plan(grad["q"], grad["k_cache"], grad["v_cache"], x.seq_lens, x.block_table, sinks=grad["sinks"])
    with torch.no_grad():
        got = call(grad, seq_lens_host=host)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                 sinks=args["sinks"])
    assert_close_to_reference(got, ref, torch.float32)


@pytest.mark.parametrize("bad", [5, 2.5, b"plans/default.yaml", ["c.yaml"], {"split": {"num_splits": 2}}])
def test_a_config_of_another_kind_is_refused_by_name(bad):
    x = fp32_case()
    with pytest.raises(TypeError, match=f"config must be an attnplan Config, a Context, a path to a YAML file or None "
                                        f"\\(the default context\\), got {type(bad).__name__}"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference", config=bad)
    with pytest.raises(TypeError, match="config must be an attnplan Config"):
        attnplan.DecodeWrapper(bad)


@pytest.mark.parametrize("bad,exc,needle", [
    ([5, 9, 1], ValueError, r"seq_lens must hold 2 lengths \(one per sequence of the plan\), got 3"),
    ([5], ValueError, "seq_lens must hold 2 lengths"),
    ([-1, 9], ValueError, r"seq_lens\[0\] = -1 is outside \[0, 12\]"),
    ([5, 13], ValueError, r"seq_lens\[1\] = 13 is outside \[0, 12\]"),  # the cache's capacity, not its bucket's (16)
    ([5, 10**30], ValueError, r"seq_lens\[1\] = 10+ is outside"),
    ([5.0, 9.0], TypeError, r"seq_lens\[0\] must be an int"),
    ("59", TypeError, "seq_lens must be a list, tuple"),
    ([5, None], TypeError, r"seq_lens\[1\] must be an int"),
    (torch.empty(2, dtype=torch.int32, device="meta"), ValueError, "seq_lens must hold lengths to explain, got a "
                                                                   "meta tensor"),
    ("masked", TypeError, "seq_lens must be .* got a numpy masked array"),
])
def test_explain_refuses_lengths_the_plan_cannot_run(bad, exc, needle):
    """explain(seq_lens) describes the schedule at lengths the plan could run: ``batch`` ints in ``[0, capacity]``;
    anything else is refused by name (not truncated, nor explained for another batch or an impossible length)."""
    x = make_inputs(2, 4, 2, 16, [5, 9], page_size=4, dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=3)
    good = w.explain([5, 9])
    for kind in ((5, 9), torch.tensor([5, 9]), _np().array([5, 9]) if _np() else [5, 9]):
        assert w.explain(kind) == good
    if isinstance(bad, str) and bad == "masked":
        if _np() is None:
            pytest.skip("needs numpy")
        bad = _np().ma.masked_array([5, 9], mask=[False, True])  # its masked entry read as None
    with pytest.raises(exc, match=needle):
        w.explain(bad)
    if "13" not in needle:
        with pytest.raises(exc, match=needle.replace("12", "16")):  # the plan alone knows its capacity's bucket
            w.plan_.explain(bad)
    assert w.plan_.explain([5, 16]) and w.explain([5, 12])


@pytest.mark.parametrize("bad", [4096, 1, 0, None, "no", 1.0])
def test_plan_capacity_must_be_a_bool(bad):
    """``capacity`` chooses a capacity plan; the capacity itself is the cache's. A number (a capacity in tokens, as
    a caller may read it) or a string ("no" is truthy) is refused by name instead of picking a mode."""
    x = make_inputs(2, 4, 2, 16, [5, 9], page_size=4, dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(TypeError, match=f"capacity must be a bool .*got {type(bad).__name__}"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=bad)
    assert w.plan_ is None
    assert w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True).capacity_mode


def test_error_messages_show_values_bounded():
    """Values shown in error messages are bounded: a long list is cut as it is built, a huge int named by its size,
    and a value whose repr raises by its type (the error being raised is not replaced by another)."""
    from attnplan._repr import short_repr

    class Hostile:
        def __repr__(self):
            raise RuntimeError("repr")

    assert short_repr(list(range(10**6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"
    assert short_repr(2**5000) == "an int of 5001 bits"
    assert short_repr([10**5000]) == "a list"
    assert len(short_repr("x" * 500, limit=40)) == 40
    assert "Hostile" in short_repr(Hostile())


def _nested(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's "prototype stage" notice of the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([t])


@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_sparse_and_nested_tensors_are_refused_naming_the_argument(kind):
    """A sparse tensor has no data pointer and no strides, a nested one (whose layout says strided) no single shape:
    every entry point refuses either with a TypeError naming the argument, never torch's own error from inside a
    check (for a nested tensor, an "Internal error ... Please file an issue")."""
    from attnplan import PartialState, merge_states

    conv = (lambda t: t.to_sparse()) if kind == "sparse" else _nested

    o, lse = torch.randn(1, 1, 2, 3, 4), torch.randn(1, 1, 2, 3)
    for name, call in (("o", lambda: PartialState(conv(o), lse)),
                       ("lse", lambda: PartialState(o, conv(lse))),
                       ("sinks", lambda: merge_states(PartialState(o, lse), conv(torch.zeros(2)))),
                       ("indptr", lambda: merge_states(PartialState(o, lse), indptr=conv(torch.tensor([0, 3]))))):
        with pytest.raises(TypeError, match=name):
            call()
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 8, 1, 16)
    sl = torch.tensor([4], dtype=torch.int32)
    args = {"q": q, "k_cache": k, "v_cache": k.clone(), "seq_lens": sl}
    for name in args:
        bad = {**args, name: conv(args[name])}
        with pytest.raises(TypeError, match=f"{name} must be a dense"):
            attnplan.decode(*bad.values(), None, backend="reference")
        w = attnplan.DecodeWrapper(backend="reference")
        with pytest.raises(TypeError, match=f"{name} must be a dense"):
            w.plan(*bad.values(), seq_lens_host=[4])
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(*args.values(), seq_lens_host=[4])
    with pytest.raises(TypeError, match="q must be a dense"):
        w.run(conv(q), k, args["v_cache"], sl)
    for name, kw in (("out", dict(out=conv(torch.zeros_like(q)))),
                     ("lse", dict(lse=conv(torch.zeros(1, 1, 2))))):
        with pytest.raises(TypeError, match=f"{name} must be a dense"):
            w.run(*args.values(), **kw)
        with pytest.raises(TypeError, match=f"{name} must be a dense"):
            attnplan.decode(*args.values(), None, backend="reference", **kw)
    with pytest.raises(TypeError, match="sinks must be a dense"):
        attnplan.decode(*args.values(), None, backend="reference", sinks=conv(torch.zeros(2)))
    x, k8, v8 = fp8_case()
    for name in ("k_scale", "v_scale"):
        scales = {"k_scale": torch.ones(2), "v_scale": torch.ones(2), name: conv(torch.ones(2))}
        with pytest.raises(TypeError, match=f"{name} must be a dense"):
            attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", **scales)


class _NoStorage(torch.Tensor):
    """A wrapper subclass without memory of its own, as ``DTensor`` is: torch ops unwrap it to its inner tensor, and
    its data pointer is 0 (or raises), which a kernel would read as the address of its elements."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(t):
            return t.inner if isinstance(t, _NoStorage) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tensors_without_memory_of_their_own_are_refused_by_name(backend):
    """A wrapper subclass with no storage (a ``DTensor``, a tensor under ``torch.func.vmap``) has no address the kernels
    could read or write. ``decode()``, ``plan()``, ``run()`` (after a plan of plain tensors, whose one-pass check
    would otherwise find the same shapes, strides and alignment) refuse each input and output by name with a
    ``TypeError``, before any kernel runs; ``try_run()`` answers ``None``."""
    x = fp32_case(lens=(13, 7))
    args = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)
    hq = x.q.shape[2]
    assert not _NoStorage(x.q).data_ptr()  # what the checks see
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(*args.values(), seq_lens_host=[13, 7])
    attnplan.decode(*args.values(), backend=backend)  # the pool now keeps a wrapper for these signatures
    for name in args:
        bad = {**args, name: _NoStorage(args[name])}
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory of its own"):
            attnplan.decode(*bad.values(), backend=backend)
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory"):
            w.run(*bad.values())
        assert w.try_run(*bad.values()) is None
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory"):
            attnplan.DecodeWrapper(backend=backend).plan(*bad.values(), seq_lens_host=[13, 7])
    for name, buf in (("out", torch.full_like(x.q, float("nan"))), ("lse", torch.full(x.q.shape[:3], float("nan")))):
        kw = {name: _NoStorage(buf)}
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory"):
            w.run(*args.values(), **kw)
        assert w.try_run(*args.values(), **kw) is None
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory"):
            attnplan.decode(*args.values(), backend=backend, **kw)
        assert torch.isnan(buf).all()
    with pytest.raises(TypeError, match="sinks is a _NoStorage without memory"):
        attnplan.decode(*args.values(), backend=backend, sinks=_NoStorage(torch.zeros(hq)))
    with pytest.raises(TypeError, match="q is a .* without memory of its own"):
        torch.func.vmap(lambda q: attnplan.decode(q, *list(args.values())[1:], backend=backend))(x.q.unsqueeze(0))


def test_fp8_scale_tensors_without_memory_of_their_own_are_refused_by_name():
    x, k8, v8 = fp8_case()
    for name in ("k_scale", "v_scale"):
        scales = {"k_scale": torch.ones(2), "v_scale": torch.ones(2)}
        scales[name] = _NoStorage(scales[name])
        with pytest.raises(TypeError, match=f"{name} is a _NoStorage without memory"):
            attnplan.decode(x.q, k8, v8, x.seq_lens, x.block_table, backend="reference", **scales)


@pytest.mark.parametrize("bad,exc,needle", [
    ("", ValueError, "unknown backend ''"),
    ("Triton", ValueError, "unknown backend 'Triton'"),
    (0, TypeError, "backend must be a backend name .* got int 0"),
    (False, TypeError, "got bool False"),
    (["triton"], TypeError, "got list"),
    ({"name": "triton"}, TypeError, "got dict"),
    pytest.param(10**5000, TypeError, "got int an int of 16610 bits", id="huge_int"),  # its decimal repr raises
    pytest.param("x" * 10**5, ValueError, r"unknown backend 'xxxx.*\.\.\.", id="long_name"),  # shown bounded
])
def test_a_backend_that_names_no_backend_is_refused(bad, exc, needle):
    """Only ``None`` means the config's order: an empty or false name is refused like an unknown one, and a value of
    another type by a ``TypeError`` naming the argument (not ``unhashable type`` from inside a lookup)."""
    x = fp32_case()
    with pytest.raises(exc, match=needle):
        attnplan.DecodeWrapper(backend=bad)
    with pytest.raises(exc, match=needle):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=bad)
    with pytest.raises(exc, match=needle):
        attnplan.backends.get_backend(bad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_length_one_axes_may_have_any_stride(backend):
    """Along an axis of length one only index 0 is read, so its stride is free: one sequence's ``seq_lens`` and
    block table and one head's ``sinks``, each a view with stride 2 there, decode exactly as their contiguous
    copies do, and within the float64 reference's tolerance."""
    x = make_inputs(1, 1, 1, 16, [3], page_size=4, dtype=torch.float32, generator=torch.Generator().manual_seed(5))
    sl = torch.tensor([3, 0], dtype=torch.int32)[::2]
    bt = strided(x.block_table)
    sinks = strided(torch.tensor([0.5]))
    assert sl.stride() == (2,) and bt.shape == (1, 1) and bt.stride()[1] == 2 and sinks.stride() == (2,)
    got = attnplan.decode(x.q, x.k_cache, x.v_cache, sl, bt, sinks=sinks, backend=backend)
    want = attnplan.decode(x.q, x.k_cache, x.v_cache, sl.contiguous(), bt.contiguous(), sinks=sinks.contiguous(),
                           backend=backend)
    assert torch.equal(got, want)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, sl.contiguous(), bt.contiguous(), sinks=sinks.contiguous())
    assert_close_to_reference(got, ref, torch.float32)


def test_validate_inputs_refuses_a_page_size_that_is_not_a_power_of_two():
    """The input contract's own check (``DecodeProblem`` repeats it): a paged cache of 3-token pages."""
    from attnplan.problem import validate_inputs

    x = make_inputs(2, 4, 2, 16, [5, 9], page_size=4, dtype=torch.float32)
    k3, v3 = x.k_cache[:, :3], x.v_cache[:, :3]
    with pytest.raises(ValueError, match=r"page_size \(k_cache.shape\[1\]\) must be a power of two, got 3"):
        validate_inputs(x.q, k3, v3, x.seq_lens, x.block_table)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_q_len_at_its_largest_is_served_and_one_more_is_refused(backend):
    """``MAX_Q_LEN`` queries per sequence (speculative verification) decode against the reference; one more is
    refused by name."""
    from attnplan.problem import MAX_Q_LEN, validate_inputs

    g = torch.Generator().manual_seed(7)
    x = make_inputs(1, 2, 1, 16, [MAX_Q_LEN + 5], q_len=MAX_Q_LEN, page_size=4, dtype=torch.float32, generator=g)
    assert validate_inputs(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)["q_len"] == MAX_Q_LEN
    out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert_close_to_reference(out, ref, torch.float32)
    q17 = torch.zeros(1, MAX_Q_LEN + 1, 2, 16)
    with pytest.raises(ValueError, match="q_len"):
        validate_inputs(q17, x.k_cache, x.v_cache, x.seq_lens, x.block_table)


def test_effective_window_keeps_small_windows_and_clamps_long_ones_to_the_same_positions():
    """Below 2^30 a window is itself; from there it is ``max(2^30, min(window, capacity))``, so a plan's key does not
    depend on how far past the capacity a window reaches."""
    from attnplan.problem import WINDOW_CLAMP, effective_window, validate_inputs

    assert WINDOW_CLAMP == 2**30
    assert effective_window(-1, 4096) == -1 and effective_window(0, 4096) == 0
    assert effective_window(2**30 - 1, 4096) == 2**30 - 1
    assert effective_window(2**30, 4096) == 2**30 and effective_window(2**40, 4096) == 2**30
    assert effective_window(2**40, 2**31) == 2**31 and effective_window(2**31 - 7, 2**31) == 2**31 - 7
    x = make_inputs(2, 4, 2, 16, [5, 9], dtype=torch.float32)
    assert validate_inputs(x.q, x.k_cache, x.v_cache, x.seq_lens, window_left=2**40)["window_left"] == 2**30
