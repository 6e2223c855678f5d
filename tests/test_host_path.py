"""The host path of eager decode: what a repeated ``plan()`` / ``run()`` / ``decode()`` does on the host.

- With ``seq_lens_host`` the block table is not read; every kernel backend clamps the page indices it loads into
  ``[0, num_pages)``, so a bad entry reads a wrong page, never outside the cache (checked against the float64
  reference on the host-clamped table).
- The fast paths (memoized static checks, host lengths checked in Python, the run-time checks from the planned
  signature) raise exactly what the general checks raise, and the memos follow every change of the inputs.
- ``decode()`` reuses its wrappers per context and input signature and never hands out a buffer twice.
- The bound launches (Triton's compiled-kernel launcher, numba's marshalled arguments, cuda_ptx's packed
  ``kernelParams``) are used only for the layout they were made for: checked on the CPU with stand-ins for the
  compiled kernels (for cuda_ptx: for the driver's launches, whose parameter bytes must be the unbound path's), and
  on a GPU for real, with ``torch.cuda.set_sync_debug_mode("error")`` around plan / run / decode on every backend.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import threading
import types

import pytest

import torch

import attnplan
from attnplan import problem as P
from attnplan import reference
from attnplan.backends import DecodeInputs, Workspace, get_backend
from attnplan.planner import KernelOptions
from attnplan.testing import assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA, kernel_backends

CPU_BACKENDS = kernel_backends("cpu")
KERNELS = [b for b in ("triton", "numba") if b in CPU_BACKENDS]


def _ref(x, block_table=None, sm_scale=None):
    bt = x.block_table if block_table is None else block_table
    return reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, x.sm_scale if sm_scale is None else sm_scale)


# -- the page clamp ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("q_len,splits", [(1, 1), (1, 3), (2, 2)])
def test_bad_block_table_entries_read_a_clamped_page(backend, q_len, splits, gen):
    """Entries below 0 and at or past num_pages (negative, huge, just past the end) in the pages a sequence uses:
    with host lengths plan() does not read the table, and the kernels read page 0 / the last page instead, so the
    output is the reference's on the table clamped into [0, num_pages)."""
    x = make_inputs(2, 8, 2, 32, [45, 38], q_len=q_len, page_size=16, dtype=torch.float32, generator=gen)
    num_pages = x.k_cache.shape[0]
    bt = x.block_table
    bt[0, 0], bt[0, 2], bt[1, 1] = -5, num_pages + 7, 2**31 - 1
    bt[1, 2] = num_pages  # just past the end
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, num_splits=splits, seq_lens_host=[45, 38])
    out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, out=out, lse=lse)
    ref, ref_lse = _ref(x, bt.clamp(0, num_pages - 1))
    assert_close_to_reference(out, ref, torch.float32)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


# -- the length clamp ---------------------------------------------------------------------------------------

#: tokens per sequence the clamp tests' caches hold; the lengths written on the device after plan(): one past the
#: capacity, the largest int32, a negative one, one within (the host lengths plan() saw were all within)
CLAMP_CAP = 48
CLAMP_HOST = [40, 17, 5, 33]
CLAMP_DEVICE = [CLAMP_CAP + 1, 2**31 - 1, -5, 33]


def _clamp_inputs(page, q_len, gen, device="cpu"):
    """Inputs of 4 sequences (fp16, 4 query heads on 1 KV head, head_dim 32) whose cache holds CLAMP_CAP tokens each,
    laid out so that a read past a sequence's capacity finds NaN: a contiguous k / v is the first CLAMP_CAP positions
    of a longer tensor whose other positions are NaN; a paged block table is the first columns of a wider table whose
    other columns name a page of NaN (the cache's last page, which no sequence maps)."""
    x = make_inputs(4, 4, 1, 32, CLAMP_HOST, q_len=q_len, page_size=page, dtype=torch.float16, capacity=CLAMP_CAP,
                    generator=gen)
    if page is None:  # views of the first CLAMP_CAP positions (made on the device: a copy would drop the NaN tail)
        k, v = (torch.cat([t, torch.full_like(t[:, :16], float("nan"))], 1).to(device)[:, :CLAMP_CAP]
                for t in (x.k_cache, x.v_cache))
        bt = None
    else:
        k, v = (torch.cat([t, torch.full_like(t[:1], float("nan"))]).to(device) for t in (x.k_cache, x.v_cache))
        cols = x.block_table.shape[1]
        wide = torch.full((4, cols + 2), k.shape[0] - 1, dtype=torch.int32)
        wide[:, :cols] = x.block_table
        bt = wide.to(device)[:, :cols]
        assert cols * page == CLAMP_CAP and bt.stride(0) == cols + 2
    return DecodeInputs(x.q.to(device), k, v, x.seq_lens.to(device), bt, x.sm_scale)


def _emulated_cuda_ptx():
    """The cuda_ptx kernels' text in the host emulation (a backend instance of its own), or a skip."""
    emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler for the cuda_ptx host emulation")
    return emulate.EmulatedCudaPtxBackend()


CLAMP_BACKENDS = ["reference", *KERNELS, "cuda_ptx"]


def _clamp_params():
    """(how, q_len, page, backend): every combination, the kernel backends' q_len 2 of the single pass and the
    capacity plan in the full tier (each path's clamp runs at q_len 1 on both layouts, and the clamped length's
    q_len offset at q_len 2 in the split plan's kernels)."""
    return [pytest.param(how, q, page, be, id=f"{how}-{q}-{'paged' if page else 'contiguous'}-{be}",
                         marks=pytest.mark.full if be != "reference" and q == 2 and how != "split" else ())
            for how in ("single", "split", "capacity") for q in (1, 2) for page in (None, 16) for be in CLAMP_BACKENDS]


@pytest.mark.parametrize("how,q_len,page,backend", _clamp_params())
def test_device_lengths_outside_the_capacity_are_clamped(backend, page, q_len, how, gen):
    """Lengths written into ``seq_lens`` after plan() (host lengths within the capacity) one past the capacity, at
    2^31 - 1 and negative are read clamped into [0, capacity] by every kernel: the output is the reference's on the
    clamped lengths, never a read outside the cache (whose positions past the capacity hold NaN here). A single
    pass, a split of several units per sequence (num_splits 3: the prologue's schedule) and a capacity plan; the
    kernel backends (cuda_ptx's kernel text in the host emulation) and the reference backend."""
    from attnplan.api import Context, plan_problem
    from attnplan.testing import poisoned_workspace, problem_of

    x = _clamp_inputs(page, q_len, gen)
    out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], dtype=torch.float32))
    kw = {"capacity": True} if how == "capacity" else {"num_splits": 1 if how == "single" else 3}
    if backend == "cuda_ptx":  # the emulated backend, outside the wrapper: planned and run as the wrapper would
        be = _emulated_cuda_ptx()
        prob = dataclasses.replace(problem_of(x), capacity=CLAMP_CAP)  # the cache's, as plan() sees it
        if how == "capacity":
            prob = dataclasses.replace(prob, max_kv_len=CLAMP_CAP, total_kv_len=4 * CLAMP_CAP)
        ctx = Context.from_config(attnplan.load_config(plan_cache={"enabled": False}))
        plan = plan_problem(prob, be, torch.device("cpu"), ctx, capacity_mode=how == "capacity",
                            num_splits=kw.get("num_splits"))
        x.seq_lens.copy_(torch.tensor(CLAMP_DEVICE, dtype=torch.int32))
        be.run(plan, x, poisoned_workspace(plan, torch.device("cpu")), out, lse)
    else:
        w = attnplan.DecodeWrapper(backend=backend)
        args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        plan = w.plan(*args, seq_lens_host=CLAMP_HOST, **kw)
        x.seq_lens.copy_(torch.tensor(CLAMP_DEVICE, dtype=torch.int32))
        w.run(*args, out=out, lse=lse)
    assert plan.single_pass == (how == "single") and plan.capacity_mode == (how == "capacity")
    clamped = torch.tensor([min(max(n, 0), CLAMP_CAP) for n in CLAMP_DEVICE], dtype=torch.int32)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, clamped, x.block_table, x.sm_scale)
    assert not ref.isnan().any()
    assert_close_to_reference(out, ref, torch.float16)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("page", [None, 16])
def test_reference_clamps_lengths_into_the_capacity(page, gen):
    """The float64 reference reads lengths as the kernels do: ``attention()`` and ``partial()`` given lengths outside
    ``[0, capacity]`` (one past it, 2^31 - 1, negative) give exactly their result on the clamped lengths, without
    reading the cache's NaN past the capacity."""
    x = _clamp_inputs(page, 1, gen)
    raw = torch.tensor(CLAMP_DEVICE, dtype=torch.int32)
    clamped = torch.tensor([min(max(n, 0), CLAMP_CAP) for n in CLAMP_DEVICE], dtype=torch.int32)
    got = reference.attention(x.q, x.k_cache, x.v_cache, raw, x.block_table, x.sm_scale)
    want = reference.attention(x.q, x.k_cache, x.v_cache, clamped, x.block_table, x.sm_scale)
    assert not want[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_numba_token_offset_clamps_the_page():
    """The numba kernels' offset function (compiled with numba.njit, as the GPU compile types it) clamps the page
    id read from the block table into [0, last_page]."""
    import numba
    import numpy

    from attnplan.backends.numba import kernels

    token_offset = numba.njit(kernels._make_token_offset(True))
    s0, s1 = numpy.int32(1000), numpy.int32(10)
    table = numpy.array([[-3, 7, 99]], dtype=numpy.int32)
    assert token_offset(table, 0, numpy.int32(17), 4, 50, s0, s1, 0) == 7 * 1000 + 1 * 10
    assert token_offset(table, 0, numpy.int32(5), 4, 50, s0, s1, 0) == 0 * 1000 + 5 * 10
    assert token_offset(table, 0, numpy.int32(33), 4, 50, s0, s1, 0) == 50 * 1000 + 1 * 10


def test_host_lengths_do_not_read_the_device(monkeypatch, gen):
    """plan() and decode() with host lengths never call the device read; a bad table is then not an error, while
    without host lengths it still raises the same error as before."""
    x = make_inputs(2, 4, 1, 16, [20, 7], page_size=8, dtype=torch.float32, generator=gen)
    bt = x.block_table.clone()
    bt[1, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 10000 is outside \[0, num_pages="):
        attnplan.DecodeWrapper(backend="reference").plan(x.q, x.k_cache, x.v_cache, x.seq_lens, bt)

    def no_read(*a, **k):
        raise AssertionError("read seq_lens / block_table from the device")

    monkeypatch.setattr(P, "_read_values", no_read)
    w = attnplan.DecodeWrapper(backend=KERNELS[0] if KERNELS else "reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, seq_lens_host=[20, 7])
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, seq_lens_host=(20, 7))
    with pytest.raises(AssertionError, match="read seq_lens"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, bt)


def test_a_paged_cache_without_pages_is_refused_with_host_lengths():
    q = torch.zeros(1, 1, 4, 16)
    k = torch.zeros(0, 8, 1, 16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    w = attnplan.DecodeWrapper(backend="reference")
    for lens in ([5], [0]):  # the plan would serve any length up to the table's capacity: refused even at 0
        with pytest.raises(ValueError, match=r"a paged k_cache needs at least one page \(k_cache.shape\[0\] = 0\)"):
            w.plan(q, k, k, sl * lens[0] // 5, bt, seq_lens_host=lens)
    w.plan(q, k, k, sl * 0, bt[:, :0], seq_lens_host=[0])  # a table of no pages: capacity 0, nothing to read
    with pytest.raises(ValueError, match=r"k_cache has no pages \(num_pages = k_cache.shape\[0\] = 0\) but "
                                         r"seq_lens\[0\] = 5 needs at least one"):  # validate_values' own check
        P.validate_values(dict(batch=1, capacity=16, page_size=8), sl, bt, 0, [5])


# -- the fast checks raise what the general checks raise ---------------------------------------------------

STATIC = dict(batch=3, capacity=64, page_size=16)


@pytest.mark.parametrize("host", [[5, 0, 64], (5, 0, 64), [True, 2, 3], [0, 0, 0]])
def test_host_lengths_fast_path_agrees_with_the_general_path(host):
    sl = torch.zeros(3, dtype=torch.int32)
    fast = P.host_lengths(STATIC, host, num_pages=10)
    assert fast is not None
    assert fast[1:] == P.validate_values(STATIC, sl, None, 10, torch.tensor([int(v) for v in host]))
    assert fast[0] == list(host) and fast[0] is not host


@pytest.mark.parametrize("host,match", [
    ([5, -1, 3], r"seq_lens must be >= 0, got \[5, -1, 3\]"),
    ([5, 65, 3], r"seq_lens\[1\] = 65 exceeds the cache capacity 64 tokens"),
    ([5, 3], r"seq_lens_host must hold 3 lengths \(one per sequence\), got 2"),
    ((5, 3, 1, 1), r"seq_lens_host must hold 3 lengths"),
])
def test_host_lengths_errors_are_the_general_paths(host, match):
    sl = torch.zeros(3, dtype=torch.int32)
    assert P.host_lengths(STATIC, host, num_pages=10) is None
    with pytest.raises(ValueError, match=match):
        P.validate_values(STATIC, sl, torch.zeros(3, 4, dtype=torch.int32), 10, host)


@pytest.mark.parametrize("host", [torch.tensor([5, 1, 2]), range(3), iter([4, 1, 2])])
def test_other_host_length_kinds_take_the_general_path(host, gen):
    """Integer tensors, ranges and iterators are converted as before (the general path); an iterator is read
    once. (Floats are refused, not truncated: test_validation.py.)"""
    x = make_inputs(3, 4, 1, 16, [5, 1, 2], dtype=torch.float32, capacity=8, generator=gen)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, seq_lens_host=host)
    assert len(w._lens_host) == 3


def _errors(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


def test_run_checks_raise_the_general_checks_errors(gen):
    """run()'s output and overlap checks (computed from the planned signature) raise word for word what
    validate_outputs / check_no_overlap raise on the same tensors."""
    x = make_inputs(2, 8, 2, 16, [9, 4], page_size=8, dtype=torch.float16, generator=gen)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[9, 4])
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    big = torch.empty(2, 1, 8, 32, dtype=torch.float16)
    lse = torch.empty(2, 1, 8)
    buf = torch.empty(4096, dtype=torch.uint8)
    out_in_buf = buf[:512].view(torch.float16).view(2, 1, 8, 16)
    cases = [
        (x.q.clone(), None), (x.q.float(), None), (x.q[..., :8], None), (big[..., ::2], None), (big[..., :16], lse),
        ([1], None), (None, "lse"), (x.q, None), (x.k_cache.reshape(-1)[: x.q.numel()].view(x.q.shape), None),
        (None, lse[:, :, :4]), (None, lse.double()), (None, torch.empty(2, 1, 16)[..., ::2]),
        (out_in_buf, buf[256:320].view(torch.float32).view(2, 1, 8)),
        (x.q.clone(), x.k_cache.reshape(-1)[:32].view(torch.float32).view(2, 1, 8)),
    ]
    for out, ls in cases:
        got = _errors(lambda: w.run(*args, out=out, lse=ls))
        target = w._out if out is None else out

        def general():
            P.validate_outputs(x.q, out, ls)
            P.check_no_overlap((("out", target), ("lse", ls)),
                               (("q", x.q), ("k_cache", x.k_cache), ("v_cache", x.v_cache), ("seq_lens", x.seq_lens),
                                ("block_table", x.block_table), ("sinks", None), ("k_scale", None), ("v_scale", None)))
        want = _errors(general)
        assert got == want, (getattr(out, "shape", out), getattr(ls, "shape", ls))
        assert want is not None or out is not None and out.shape == x.q.shape


def _planned(gen, backend="reference"):
    x = make_inputs(2, 8, 2, 16, [9, 4], page_size=8, dtype=torch.float16, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[9, 4])
    assert w._fast is not None, "run()'s one-pass check is not in use"
    return x, w


def _both_paths(w, fn):
    """``fn``'s error with run()'s one-pass check, then with the full path alone."""
    fast = _errors(fn)
    saved, w._fast = w._fast, None
    try:
        full = _errors(fn)
    finally:
        w._fast = saved
    return fast, full


def test_run_one_pass_check_raises_what_the_full_path_raises(gen):
    """Every kind of bad run() argument (another shape, strides, dtype, alignment, a missing or extra block table, a
    non-tensor, bad out / lse, overlapping buffers) raises word for word what the full path raises; good ones pass
    on both."""
    x, w = _planned(gen)
    q, k, v, sl, bt = x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table
    raw = torch.empty(q.numel() * 2 + 8, dtype=torch.uint8)
    misaligned = raw[2:2 + q.numel() * 2].view(torch.float16).view(q.shape)
    wide = torch.empty(bt.shape[0], bt.shape[1] * 2, dtype=torch.int32)[:, ::2]
    big = torch.empty(2, 1, 8, 32, dtype=torch.float16)
    inputs = [
        (q.clone(), k, v, sl, bt), (q.float(), k, v, sl, bt), (misaligned, k, v, sl, bt), (q[:1], k, v, sl, bt),
        (q, k.clone(), v, sl, bt), (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, sl, bt),
        (q, k, v.transpose(0, 1).contiguous().transpose(0, 1), sl, bt),
        (q, k, v, sl.long(), bt), (q, k, v, sl[:1], bt), (q, k, v, sl, None), (q, k, v, sl, wide),
        (q, k, v, sl, bt.long()), ([1], k, v, sl, bt), (q, "k", v, sl, bt), (q, k, v, 3, bt), (q, k, v, sl, [0]),
    ]
    for args in inputs:
        fast, full = _both_paths(w, lambda: w.run(*args))
        assert fast == full, [getattr(a, "shape", a) for a in args]
    lse = torch.empty(2, 1, 8)
    outputs = [
        (None, None), (q.clone(), None), (None, lse), (q.clone(), lse), (q.float(), None), (big[..., ::2], None),
        (big[..., :16], lse), ("out", None), (None, "lse"), (None, lse[:, :, :4]), (None, lse.double()),
        (None, torch.empty(2, 1, 16)[..., ::2]), (q, None), (k.reshape(-1)[: q.numel()].view(q.shape), None),
        (None, q.reshape(-1)[:32].view(torch.float32).view(2, 1, 8)), (big[..., :16], big[..., 0].float()),
        (misaligned, None),
    ]
    for out, ls in outputs:
        fast, full = _both_paths(w, lambda: w.run(q, k, v, sl, bt, out=out, lse=ls))
        assert fast == full, (getattr(out, "shape", out), getattr(ls, "shape", ls))


def test_try_run_launches_only_what_run_would_and_answers_none_otherwise(gen, monkeypatch):
    """try_run() before any plan, and with every kind of bad argument of the test above (each of which run()
    refuses), answers None and launches nothing; with the planned inputs it launches once and returns the output
    run() returns (the output written: equal to the reference); a failed plan() leaves it answering None."""
    assert attnplan.DecodeWrapper(backend="reference").try_run(*[torch.empty(1)] * 4) is None
    x, w = _planned(gen)
    q, k, v, sl, bt = x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table
    launches = []
    real = w.backend.run
    monkeypatch.setattr(w.backend, "run", lambda *a, **kw: (launches.append(1), real(*a, **kw))[1])
    misaligned = torch.empty(q.numel() * 2 + 8, dtype=torch.uint8)[2:2 + q.numel() * 2].view(torch.float16) \
        .view(q.shape)
    big = torch.empty(2, 1, 8, 32, dtype=torch.float16)
    lse = torch.empty(2, 1, 8)
    bad = [
        ((q.float(), k, v, sl, bt), {}), ((misaligned, k, v, sl, bt), {}), ((q[:1], k, v, sl, bt), {}),
        ((q, k.transpose(1, 2).contiguous().transpose(1, 2), v, sl, bt), {}), ((q, k, v, sl.long(), bt), {}),
        ((q, k, v, sl, None), {}), ((q, k, v, sl, bt.long()), {}), (([1], k, v, sl, bt), {}),
        ((q, k, v, sl, bt), {"out": q.float()}), ((q, k, v, sl, bt), {"out": big[..., ::2]}),
        ((q, k, v, sl, bt), {"out": q}), ((q, k, v, sl, bt), {"lse": lse.double()}),
        ((q, k, v, sl, bt), {"out": k.reshape(-1)[: q.numel()].view(q.shape)}),
    ]
    for args, kw in bad:
        assert _errors(lambda: w.run(*args, **kw)) is not None, (args, kw)
        assert w.try_run(*args, **kw) is None and not launches, ([getattr(a, "shape", a) for a in args], kw)
    out = poison(torch.empty_like(q))
    assert w.try_run(q, k, v, sl, bt, out=out, lse=lse) is out and len(launches) == 1
    assert_close_to_reference(out, _ref(x)[0], torch.float16)
    assert w.try_run(q, k, v, sl, bt) is w._out and len(launches) == 2
    with pytest.raises(ValueError):
        w.plan(q, k, v, sl, bt, seq_lens_host=[9, 4], sm_scale=float("nan"))
    assert w.try_run(q, k, v, sl, bt) is None and len(launches) == 2


def test_run_catches_inputs_changed_in_place(gen):
    """The one-pass check reads the tensors themselves on every call: an input changed in place after plan() (the
    same Python object with other strides, shape, dtype or storage) is refused as by the full path; a new storage
    of the same layout is run."""
    x, w = _planned(gen)
    args = [x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table]
    w.run(*args)

    def changes():
        yield 0, lambda t: t.as_strided_(t.shape, (t.stride(0), t.stride(1), 1, t.shape[2]), 0)  # heads, dims swapped
        yield 1, lambda t: t.resize_(t.shape[0] - 1, *t.shape[1:])  # fewer pages
        yield 3, lambda t: setattr(t, "data", t.data.long())  # another dtype, the same object
        yield 4, lambda t: t.set_(torch.empty(t.numel() * 4 + 4, dtype=torch.uint8)[4:].view(torch.int32)
                                  .view(t.shape))  # a misaligned storage
        yield 2, lambda t: t.t_() if t.dim() == 2 else t.transpose_(1, 2)  # a transposed view in place

    for i, change in changes():
        saved = args[i]
        t = saved.clone()
        args[i] = t
        w.plan(*args, seq_lens_host=[9, 4])
        w.run(*args)
        change(t)
        fast, full = _both_paths(w, lambda: w.run(*args))
        assert fast == full and fast is not None and fast[0] is ValueError, (i, fast)
        assert "differ from the planned ones" in fast[1]
        args[i] = saved
    w.plan(*args, seq_lens_host=[9, 4])
    k2 = x.k_cache.clone()
    args[1] = k2
    out = w.run(*args)  # another storage, the planned layout: run, reading k2
    ref, _ = _ref(x)
    assert_close_to_reference(out, ref, torch.float16)


def test_is_contiguous_layout_is_torchs_rule():
    """attnplan.problem.is_contiguous_layout (the full path's reading of a signature) says what
    Tensor.is_contiguous() (the one-pass check's) says, over random shapes (axes of length 0, 1 and more) and
    strides, so both paths accept the same inputs."""
    from attnplan.problem import is_contiguous_layout

    rng = random.Random(0)
    for _ in range(3000):
        nd = rng.randint(1, 4)
        shape = [rng.choice((0, 1, 1, 2, 3, 4)) for _ in range(nd)]
        if rng.random() < 0.5:  # often the contiguous strides, with the length-1 axes' changed
            strides, run = [], 1
            for n in reversed(shape):
                strides.insert(0, run if n != 1 or rng.random() < 0.5 else rng.randint(0, 50))
                run *= max(n, 1)
        else:
            strides = [rng.randint(0, 30) for _ in range(nd)]
        t = torch.empty(0).as_strided(shape, strides) if 0 in shape else \
            torch.empty(1 + sum((n - 1) * st for n, st in zip(shape, strides))).as_strided(shape, strides)
        assert is_contiguous_layout(shape, strides) == t.is_contiguous(), (shape, strides)


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_run_accepts_other_strides_along_axes_of_length_one(backend, gen):
    """A C-contiguous input whose strides differ from the planned ones only along axes of length one (where only
    index 0 is read: e.g. q from ``[B, H, 1, D].transpose(1, 2)``) is the planned layout: both of run()'s paths run it
    and read it right (a bound launch keeps the planned strides: index 0 is all it reads along those axes), also
    changed so in place; a non-contiguous one is refused by both (above)."""
    x, w = _planned(gen, backend)
    ref, _ = _ref(x)
    q2 = torch.empty(x.q.shape[0], x.q.shape[2], 1, x.q.shape[3], dtype=x.q.dtype).transpose(1, 2)
    q2.copy_(x.q)
    assert q2.is_contiguous() and q2.stride() != x.q.stride()
    q3 = x.q.clone()
    args = [q3, x.k_cache, x.v_cache, x.seq_lens, x.block_table]
    w.plan(*args, seq_lens_host=[9, 4])
    q3.as_strided_(q3.shape, (q3.stride(0), 999, *q3.stride()[2:]))  # the planned object, changed in place

    def no_full_path(*a):
        raise AssertionError("run() left its one-pass check")

    for q in (q2, q3):
        args[0] = q
        fast, full = _both_paths(w, lambda: w.run(*args))
        assert fast is None and full is None, (fast, full)
        for path in ("fast", "full"):
            saved = w._fast
            if path == "full":
                w._fast = None
            else:  # the one-pass check accepts it itself: the full path (which reads the signature) is not taken
                w._signature_ptrs = no_full_path
            try:
                out = w.run(*args, out=torch.full_like(x.q, float("nan")))
            finally:
                w._fast = saved
                w.__dict__.pop("_signature_ptrs", None)
            assert_close_to_reference(out, ref, torch.float16)


def test_plan_hit_memo_follows_buckets_and_prepares_once(monkeypatch, gen):
    """A repeated plan() reuses the previous call's backend choice and cache key only while its inputs repeat: each
    call still counts a plan-cache hit, a length of another bucket or another split count plans anew, and prepare()
    runs once per plan and device."""
    be = KERNELS[0] if KERNELS else "reference"
    x = make_inputs(2, 8, 2, 32, [40, 7], page_size=16, dtype=torch.float32, capacity=256, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ctx = attnplan.Context.from_config(attnplan.load_config())
    prepared = []
    backend = get_backend(be)
    real = backend.prepare
    monkeypatch.setattr(backend, "prepare", lambda plan, device: (prepared.append(plan), real(plan, device)))
    w = attnplan.DecodeWrapper(ctx, backend=be)
    p1 = w.plan(*args, seq_lens_host=[40, 7])
    hits = ctx.cache.stats.hits
    for lens in ([41, 7], [60, 3], [64, 0]):  # the same buckets (max 64, mean 32)
        assert w.plan(*args, seq_lens_host=lens) is p1
    assert ctx.cache.stats.hits == hits + 3 and prepared == [p1]
    p2 = w.plan(*args, seq_lens_host=[200, 7])  # another max bucket
    assert p2 is not p1 and p2.problem.max_kv_len == 256 and prepared == [p1, p2]
    p3 = w.plan(*args, seq_lens_host=[200, 7], num_splits=1)
    assert p3.num_splits == 1 and prepared == [p1, p2, p3]
    assert w.plan(*args, seq_lens_host=[40, 7]) is p1 and prepared == [p1, p2, p3, p1]
    ctx.cache.clear()  # the memo keeps the key, never the plan: a cleared cache plans again
    p4 = w.plan(*args, seq_lens_host=[40, 7])
    assert p4 is not p1 and p4.to_dict() == p1.to_dict()
    out = w.run(*args)
    ref, _ = reference.attention(*args, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("order", ["near first", "tail first"])
def test_plan_keys_tell_a_long_tailed_batch_from_a_near_uniform_one(order, gen):
    """Lengths of one pair of power-of-two buckets (longest 64, mean 32) may be near-uniform (mean at least half
    the longest) or long-tailed; the wrapper's plan-cache key says which, as the problem's own key does
    (problem.mean_bucket), so neither batch is served the other's plan whatever came first (a long-tailed batch
    given a near-uniform batch's single pass runs its longest sequence in one program)."""
    x = make_inputs(4, 8, 2, 32, [60, 30, 20, 18], page_size=16, dtype=torch.float32, capacity=256, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(attnplan.Context.from_config(attnplan.load_config()), backend="reference")
    near, tail = [60, 30, 20, 18], [60, 20, 20, 17]  # means 32 and 29.25: 2 x total >= / < 4 x 60
    plans = {}
    for lens in ([near, tail] if order == "near first" else [tail, near]):
        plans[tuple(lens)] = p = w.plan(*args, seq_lens_host=lens)
        b = p.problem
        assert (2 * b.total_kv_len < b.batch * b.max_kv_len) == (2 * sum(lens) < 4 * max(lens))
        assert w.plan(*args, seq_lens_host=lens) is p  # the memo's key is the same key
    assert plans[tuple(near)] is not plans[tuple(tail)]


def test_a_failed_plan_leaves_no_plan(gen):
    """A plan() that raises leaves no plan (the wrapper's state may be partly updated: pairing these inputs with the
    previous plan could launch it on inputs it was not made for): run() refuses until the next good plan(), which
    restores the one-pass check."""
    x, w = _planned(gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    with pytest.raises(ValueError, match="seq_lens_host must hold 2"):
        w.plan(*args, seq_lens_host=[9, 4, 1])
    assert w._fast is None and w.plan_ is None
    with pytest.raises(attnplan.PlanNotReadyError):
        w.run(*args)
    ref, _ = _ref(x)
    w.plan(*args, seq_lens_host=[9, 4])
    assert w._fast is not None
    assert_close_to_reference(w.run(*args), ref, torch.float16)


class _PlansWhenChecked(torch.Tensor):
    """An ``out`` whose ``is_neg()`` (read by run()'s one-pass check, before the launch) first calls ``replan()``:
    a ``plan()`` of another thread landing between a run's check and its launch, made deterministic."""

    replan = None

    def is_neg(self):
        f, type(self).replan = type(self).replan, None
        if f is not None:
            f()
        return False


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_a_run_launches_the_binding_its_check_passed_for(backend, gen):
    """A wrapper shared by two threads is unsupported (DecodeWrapper's docstring), but a plan() that lands between a
    run()'s one-pass check and its launch must not make the run launch the new binding on the inputs checked against
    the old one (a binding holds its inputs' strides, capacity and scale: on a GPU another signature's binding reads
    and writes out of bounds). The run launches the binding it checked: here the old score scale's."""
    x = make_inputs(2, 8, 2, 16, [9, 4], page_size=8, dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(*args, sm_scale=0.5, seq_lens_host=[9, 4])
    assert w._fast is not None
    out = poison(torch.empty_like(x.q)).as_subclass(_PlansWhenChecked)
    _PlansWhenChecked.replan = lambda: w.plan(*args, sm_scale=0.125, seq_lens_host=[9, 4])
    w.run(*args, out=out)
    assert _PlansWhenChecked.replan is None and w._sm_scale == 0.125, "the plan() did not land inside the run"
    assert_close_to_reference(out.as_subclass(torch.Tensor), _ref(x, sm_scale=0.5)[0], torch.float32)
    assert_close_to_reference(w.run(*args), _ref(x, sm_scale=0.125)[0], torch.float32)


def test_decode_output_checks_are_validate_outputs(gen):
    """decode()'s output checks, made from the inputs' signature, raise what validate_outputs raises, before any
    other check (a bad config path, a bad input) and after the score scale's."""
    x = make_inputs(2, 8, 2, 16, [9, 4], page_size=8, dtype=torch.float16, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    big = torch.empty(2, 1, 8, 32, dtype=torch.float16)
    lse = torch.empty(2, 1, 8)
    for out, ls in [(x.q.float(), None), (big[..., ::2], None), ("out", None), (None, "lse"), (None, lse.double()),
                    (None, lse[:, :, :4]), (None, torch.empty(2, 1, 16)[..., ::2]), (big[..., :16], lse[:1])]:
        want = _errors(lambda: P.validate_outputs(x.q, out, ls))
        assert want is not None
        assert _errors(lambda: attnplan.decode(*args, out=out, lse=ls, backend="reference",
                                               config="/nonexistent.yaml", seq_lens_host=[9, 4])) == want
        assert _errors(lambda: attnplan.decode(x.q, x.k_cache, "v", x.seq_lens, x.block_table, out=out,
                                               lse=ls)) == want
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        attnplan.decode(*args, out="out", sm_scale=float("inf"))


def test_decode_pool_never_serves_another_key_of_the_same_hash(gen):
    """The pool is keyed by the key's hash; an entry whose key differs (a hash collision) is dropped, not used."""
    ctx = attnplan.Context.from_config(attnplan.load_config())
    w = attnplan.DecodeWrapper(ctx, backend="reference")
    ctx._give_wrapper(7, ("a", None), w)
    assert ctx._take_wrapper(7, ("b", None)) is None and not ctx._wrappers
    ctx._give_wrapper(7, ("a", None), w)
    assert ctx._take_wrapper(7, ("a", None)) is w


def test_memoized_plans_follow_every_change(gen):
    """A wrapper planned again and again (memo hits) follows new lengths (same and new bucket), a new score scale, a
    new window and a new split count, matching the reference each time."""
    be = KERNELS[0] if KERNELS else "reference"
    x = make_inputs(2, 8, 2, 32, [40, 7], page_size=16, dtype=torch.float32, capacity=96, generator=gen)
    w = attnplan.DecodeWrapper(backend=be)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    for lens, scale, window, splits in [([40, 7], None, -1, None), ([41, 7], None, -1, None), ([90, 3], None, -1, None),
                                        ([90, 3], 0.05, -1, None), ([90, 3], 0.05, 20, None), ([90, 3], 0.05, 20, 2),
                                        ([33, 0], None, -1, 3), ([33, 0], None, -1, 3)]:
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        w.plan(*args, sm_scale=scale, window_left=window, num_splits=splits, seq_lens_host=lens)
        out = w.run(*args)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table,
                                     x.sm_scale if scale is None else scale, window_left=window)
        assert_close_to_reference(out, ref, torch.float32)


def test_static_checks_memo_keeps_type_errors(gen):
    """The memo is keyed by the scalars' types too: a bool window after an int one still raises."""
    x = make_inputs(1, 4, 1, 16, [9], dtype=torch.float32, generator=gen)
    w = attnplan.DecodeWrapper(backend="reference")
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens)
    w.plan(*args, window_left=1, seq_lens_host=[9])
    with pytest.raises(TypeError, match="window_left must be an int"):
        w.plan(*args, window_left=True, seq_lens_host=[9])
    with pytest.raises(ValueError, match="logits_soft_cap must be a finite float"):
        w.plan(*args, logits_soft_cap=float("nan"), seq_lens_host=[9])
    with pytest.raises(ValueError, match="logits_soft_cap must be a finite float"):
        w.plan(*args, logits_soft_cap=float("nan"), seq_lens_host=[9])


# -- decode() keeps its wrappers ---------------------------------------------------------------------------

def test_decode_reuses_one_wrapper_per_signature(monkeypatch, gen):
    from attnplan.backends import Workspace

    be = KERNELS[0] if KERNELS else "reference"
    ctx = attnplan.Context.from_config(attnplan.load_config())
    allocs = []
    real = Workspace.allocate
    monkeypatch.setattr(Workspace, "allocate", staticmethod(lambda plan, dev: allocs.append(1) or real(plan, dev)))
    x = make_inputs(2, 2, 1, 32, [40, 7], page_size=16, dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ref, _ = _ref(x)
    first = attnplan.decode(*args, backend=be, config=ctx, seq_lens_host=[40, 7], num_splits=2)
    second = attnplan.decode(*args, backend=be, config=ctx, seq_lens_host=[40, 7], num_splits=2)
    assert first is not second and first.data_ptr() != second.data_ptr()  # a new result each call
    assert_close_to_reference(first, ref, torch.float32)
    assert_close_to_reference(second, ref, torch.float32)
    assert len(allocs) == 1 and len(ctx._wrappers) == 1
    out = poison(torch.empty_like(x.q))
    assert attnplan.decode(*args, backend=be, config=ctx, seq_lens_host=[40, 7], num_splits=2, out=out) is out
    assert_close_to_reference(out, ref, torch.float32)
    assert len(allocs) == 1 and ctx.cache.stats.hits >= 2
    # another signature, another wrapper; the pool stays bounded; release_wrappers empties it
    for b in range(1, attnplan.api.DECODE_WRAPPERS + 3):
        y = make_inputs(b, 2, 1, 32, [5] * b, dtype=torch.float32, generator=gen)
        attnplan.decode(y.q, y.k_cache, y.v_cache, y.seq_lens, backend=be, config=ctx, seq_lens_host=[5] * b)
    assert len(ctx._wrappers) == attnplan.api.DECODE_WRAPPERS
    ctx.release_wrappers()
    assert not ctx._wrappers


def test_decode_repeating_a_call_reuses_its_plan_and_replans_on_any_change(monkeypatch, gen):
    """The layers of one step call decode() with the same shapes, scalars and host lengths: the wrapper's last plan
    serves them without plan() (counted as plan-cache hits). Any change plans again: other lengths (equal values of
    another type too), another scalar type or value, a lazily negated input, sink tensors."""
    be = KERNELS[0] if KERNELS else "reference"
    ctx = attnplan.Context.from_config(attnplan.load_config())
    planned = []
    real = attnplan.DecodeWrapper._plan_body
    monkeypatch.setattr(attnplan.DecodeWrapper, "_plan_body", lambda self, *a: planned.append(1) or real(self, *a))
    x = make_inputs(2, 8, 2, 32, [40, 7], page_size=16, dtype=torch.float32, generator=gen, capacity=64)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)

    def call(lens, **kw):
        n = len(planned)
        out = poison(torch.empty_like(x.q))
        assert attnplan.decode(*args, backend=be, config=ctx, seq_lens_host=lens, out=out, **kw) is out
        return out, len(planned) - n

    ref, _ = _ref(x)
    hits = ctx.cache.stats.hits
    for i, (lens, kw, replans) in enumerate([
            ([40, 7], {}, 1), ([40, 7], {}, 0), ((40, 7), {}, 0), ([40, 7], dict(sm_scale=0.25), 1),
            ([40, 7], dict(sm_scale=0.25), 0), ([40, 7], dict(window_left=-1), 1), ([40, 7], dict(window_left=-1), 0),
            ([40, 7], dict(num_splits=2), 1), ([40, 7], dict(num_splits=2), 0), ([40, 7], dict(num_splits=2.0), 1)]):
        n0 = len(planned)
        try:
            out, n = call(lens, **kw)
        except ValueError:  # num_splits 2.0: refused by plan(), not served by the repeat
            out, n = None, len(planned) - n0
        assert n == replans, (i, lens, kw)
        if out is not None:
            r = ref if "sm_scale" not in kw else _ref(x, sm_scale=0.25)[0]
            assert_close_to_reference(out, r, torch.float32)
    assert ctx.cache.stats.hits > hits
    call([40, 7])
    n = len(planned)
    try:  # equal lengths that are not all ints: plan() decides (the general path converts or refuses them)
        call([40.0, 7])
    except (TypeError, ValueError):
        pass
    assert len(planned) == n + 1
    # other lengths: planned again, and the result is for those lengths
    x.seq_lens.copy_(torch.tensor([33, 0], dtype=torch.int32))
    out, n = call([33, 0])
    assert n == 1
    assert_close_to_reference(out, _ref(x)[0], torch.float32)
    # a lazily negated q has the same signature: refused, not served by the repeat
    with pytest.raises(ValueError, match="q is a lazily negated"):
        attnplan.decode(torch._neg_view(x.q), *args[1:], backend=be, config=ctx, seq_lens_host=[33, 0])
    out, n = call([33, 0], sinks=torch.zeros(8))
    out, n = call([33, 0], sinks=torch.zeros(8))
    assert n == 1  # tensor sinks: plan() every time (their values are checked per tensor version)


def test_decode_does_not_keep_a_wrapper_that_failed(gen):
    ctx = attnplan.Context.from_config(attnplan.load_config())
    x = make_inputs(1, 4, 1, 16, [9], dtype=torch.float32, generator=gen)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, backend="reference", config=ctx, seq_lens_host=[99])
    assert not ctx._wrappers
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor, got list"):
        attnplan.decode(x.q, [1], x.v_cache, x.seq_lens, backend="reference", config=ctx)


@pytest.mark.parametrize("backend", kernel_backends("cuda" if HAS_CUDA else "cpu"))
def test_a_dropped_wrapper_leaves_no_workspace_behind(backend, gen):
    """The bound launch lives in its wrapper, and what a launch through the unbound path (``Backend.run``) leaves in
    the backend (launch constants per (plan, workspace), holding the workspace's tensors) is forgotten with the
    wrapper: a wrapper planned (and run) then dropped leaves no reference to its workspace in the backend.
    torch.ops.attnplan.decode plans with a throw-away wrapper during torch.compile's CUDA-graph warm-up, whose
    buffers live in the graph's pool and must die (cuda_ptx's bound launch had kept them: torch then raised
    "tensor(s) in the cudagraph pool not tracked as outputs")."""
    import gc
    import weakref

    dev = "cuda" if HAS_CUDA else "cpu"
    x = make_inputs(2, 8, 2, 32, [40, 7], dtype=torch.float16 if HAS_CUDA else torch.float32, generator=gen,
                    device=dev)
    for runs in (0, 2, "unbound"):
        w = attnplan.DecodeWrapper(attnplan.load_config(split={"merge": "separate"}), backend=backend)
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=2, seq_lens_host=[40, 7])
        for _ in range(runs if runs != "unbound" else 1):
            w.run(x.q, x.k_cache, x.v_cache, x.seq_lens)
        if runs == "unbound":
            out = poison(torch.empty_like(x.q))
            w.backend.run(w.plan_, x, w.workspace, out)  # keeps the launch constants, by (plan, workspace)
            assert_close_to_reference(out, _ref(x)[0], x.q.dtype)
        refs = [weakref.ref(t) for t in (w.workspace.targets, w.workspace.state.o)]
        del w
        gc.collect()
        assert all(r() is None for r in refs), f"a workspace tensor outlived its wrapper ({runs} runs)"


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_use_plan_serves_the_planned_inputs_with_another_plan(backend, gen, monkeypatch):
    """``use_plan`` swaps the plan of a planned (and run, so bound) wrapper for another plan of the same problem: the
    next run() launches that plan on a workspace that serves it, right; a plan of another problem or backend, or
    another device, or none planned yet, is refused before anything changes; the next plan() plans afresh."""
    x = make_inputs(3, 8, 2, 32, [70, 5, 33], page_size=16, dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    cfg = attnplan.load_config(plan_cache={"enabled": False})
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    with pytest.raises(attnplan.PlanNotReadyError, match="before plan"):
        w.use_plan(None)
    one = w.plan(*args, num_splits=1)
    w.run(*args)
    other = attnplan.DecodeWrapper(cfg, backend=backend).plan(*args, num_splits=4)
    assert other.num_splits != one.num_splits and other.problem == one.problem
    assert w.use_plan(other) is other and w.plan_ is other and w.workspace.serves(other, x.q.device)
    seen = []
    real = type(w.backend).run
    monkeypatch.setattr(type(w.backend), "run", lambda self, plan, *a, **k: seen.append(plan) or real(self, plan, *a, **k))
    out = w.run(*args, out=poison(torch.empty_like(x.q)))
    assert seen == [other]
    assert_close_to_reference(out, _ref(x)[0], torch.float32)
    y = make_inputs(3, 8, 4, 32, [70, 5, 33], page_size=16, dtype=torch.float32, generator=gen)  # 4 KV heads
    elsewhere = attnplan.DecodeWrapper(cfg, backend=backend).plan(y.q, y.k_cache, y.v_cache, y.seq_lens,
                                                                   y.block_table, num_splits=4)
    with pytest.raises(ValueError, match="another problem"):
        w.use_plan(elsewhere)
    moved = dataclasses.replace(other, device=other.device._replace(sm_count=other.device.sm_count + 1))
    with pytest.raises(ValueError, match="for device .* the planned inputs are on"):
        w.use_plan(moved)
    if backend != "reference":
        ref_plan = attnplan.DecodeWrapper(cfg, backend="reference").plan(*args)
        with pytest.raises(ValueError, match="for backend 'reference'"):
            w.use_plan(ref_plan)
    if backend == "numba":  # a merge the backend does not have is refused here, not at the next run()
        with pytest.raises(ValueError, match="merge 'fused' is not one of numba's"):
            w.use_plan(dataclasses.replace(other, merge="fused"))
    with pytest.raises(TypeError, match="SplitPlan"):
        w.use_plan(other.to_dict() if hasattr(other, "to_dict") else {})
    assert w.plan_ is other
    with monkeypatch.context() as m:  # never under a capture (it may compile and allocate)
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(attnplan.PlanNotReadyError, match="during CUDA graph capture"):
            w.use_plan(one)
    assert w.plan_ is other
    assert w.plan(*args, num_splits=1).num_splits == one.num_splits and w.plan_ is not other


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_use_plan_checks_a_plan_as_a_plan_file_and_try_run_serves_it(backend, gen):
    """``use_plan`` runs the plan-file checks (``cache.check_plan``): kernel options the backend would not make, a
    non-finite prediction, more unit slots than the problem can need, and a balanced schedule whose zero targets
    would make more units than its slots (units of ``min_unit_granules``: the workspace overflows) are refused,
    with the wrapper's plan unchanged; ``try_run`` then launches the plan that was given."""
    x = make_inputs(4, 8, 2, 32, [300, 300, 7, 300], page_size=16, dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(attnplan.load_config(plan_cache={"enabled": False}), backend=backend)
    p = w.plan(*args, capacity=True)
    s = p.schedule
    bad = [dataclasses.replace(p, predicted_us=float("nan")),
           dataclasses.replace(p, schedule=dataclasses.replace(s, max_units=s.max_units + 1)),
           dataclasses.replace(p, schedule=dataclasses.replace(s, targets=(0,) * len(s.targets), max_units=4))]
    if backend == "triton":
        bad.append(dataclasses.replace(p, kernel=KernelOptions({**p.kernel, "num_warps": 3})))
    if backend != "reference":
        bad.append(dataclasses.replace(p, kernel=KernelOptions({**p.kernel, "bogus": 1})))
    for plan in bad:
        with pytest.raises(ValueError):
            w.use_plan(plan)
        assert w.plan_ is p
    # zero targets with the slots they need: accepted, and right
    zero = dataclasses.replace(s, targets=(0,) * len(s.targets))
    other = dataclasses.replace(p, schedule=dataclasses.replace(zero, max_units=dataclasses.replace(
        p, schedule=dataclasses.replace(zero, max_units=10 ** 6)).units_bound))
    assert other.schedule.max_units > max(4, s.max_units)  # 5 + 5 + 1 + 5 units of 4 granules at these lengths
    w.use_plan(other)
    out = w.try_run(*args, out=poison(torch.empty_like(x.q)))
    assert out is not None and w.plan_ is other
    assert_close_to_reference(out, _ref(x)[0], torch.float32)


def test_use_plan_refuses_a_field_of_the_wrong_type_by_name(gen):
    """A plan edited with fields of the wrong type (a plain dict for the kernel options or the schedule, a list for
    the device, a string prediction, version or flag, junk candidates) is refused with ``TypeError`` naming the field,
    before any comparison with the planned plan; the wrapper keeps its plan, and the same values in the right types
    are served."""
    x = make_inputs(1, 4, 2, 32, [50], page_size=16, dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(attnplan.load_config(plan_cache={"enabled": False}), backend="reference")
    p = w.plan(*args, num_splits=2)
    for field, value in (("kernel", dict(p.kernel)), ("schedule", p.schedule.to_dict()), ("device", list(p.device)),
                         ("predicted_us", "1"), ("version", str(p.version)), ("capacity_mode", "yes"),
                         ("candidates", "x"), ("q_block", 0.0), ("merge", 3), ("table_entry", "row")):
        with pytest.raises(TypeError, match=f"plan {field} must be"):
            w.use_plan(dataclasses.replace(p, **{field: value}))
        assert w.plan_ is p
    same = dataclasses.replace(p, kernel=KernelOptions(dict(p.kernel)), device=type(p.device)(*p.device))
    assert w.use_plan(same) is same


# -- Triton's direct launch: the logic, with a stand-in for the compiled kernel ----------------------------

class _FakeCompiled:
    """Stands in for a Triton ``CompiledKernel``: records direct launches."""

    def __init__(self, log):
        self.function, self.packed_metadata, self.log = object(), object(), log

    def run(self, *a):
        self.log.append(("direct", a))


class _FakeJit:
    """Stands in for a ``JITFunction``: ``kernel[grid](*args, **kw)`` records the launch, returns a compiled kernel."""

    def __init__(self, real, log):
        params = inspect.signature(real.fn).parameters
        self.arg_names = list(params)
        self.constexprs = [i for i, p in enumerate(params.values()) if "constexpr" in str(p.annotation)]
        # the parameters Triton does not specialize on (@triton.jit(do_not_specialize=...); the interpreter keeps it
        # among its keyword arguments)
        self.unspecialized = set(getattr(real, "do_not_specialize", None)
                                 or getattr(real, "kwargs", {}).get("do_not_specialize") or ())
        self.log = log
        self.compiled = _FakeCompiled(log)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return self.compiled
        return launch


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs the Triton interpreter")
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_direct_launch_is_used_only_for_its_layout(monkeypatch, splits, gen):
    from attnplan.backends.triton import BoundLaunch, kernels

    be = get_backend("triton")
    log: list = []
    fake = types.SimpleNamespace(split_kv_partial_kernel=_FakeJit(kernels.split_kv_partial_kernel, log),
                                 merge_kernel=_FakeJit(kernels.merge_kernel, log))
    monkeypatch.setattr(be, "_kernels", lambda: fake)
    cfg = attnplan.load_config(split={"merge": "separate"})
    x = make_inputs(2, 8, 2, 32, [60, 20], page_size=16, dtype=torch.float32, generator=gen)
    w = attnplan.DecodeWrapper(cfg, backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=splits, seq_lens_host=[60, 20])
    bl = w._launcher
    assert isinstance(bl, BoundLaunch)
    # Triton's own default hooks (an empty knobs.HookChain in recent Triton, None in older ones), its debug knob off
    from triton import knobs
    hooks = types.SimpleNamespace(launch_enter_hook=knobs.runtime.launch_enter_hook,
                                  launch_exit_hook=knobs.runtime.launch_exit_hook, debug=False)
    bl.hooks, bl.current_device, bl.current_stream = hooks, (lambda: 0), (lambda d: 77)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    merges = 1 if plan.merge == "separate" else 0

    def run(out, lse=None, q=None):
        log.clear()
        w.run(q if q is not None else x.q, *args[1:], out=out, lse=lse)
        return [e[0] for e in log]

    L = be._launch(plan, w.workspace)
    names = fake.split_kv_partial_kernel.arg_names
    mnames = fake.merge_kernel.arg_names

    def expected(q, out, lse):
        """What the JIT path would be given for these tensors, constexprs appended in parameter order."""
        xi = attnplan.backends.DecodeInputs(q, *args[1:], w._sm_scale)
        pos = be._partial_args(L, xi, out, lse)
        kw = {**L.const, "WRITE_LSE": lse is not None, "SINKS_ON": False}
        res = [pos + tuple(kw[n] for n in names[len(pos):])]
        if merges:
            mpos = be._merge_args(L, out, lse, None)
            mkw = {**L.merge_const, "WRITE_LSE": lse is not None, "SINKS_ON": False}
            res.append(mpos + tuple(mkw[n] for n in mnames[len(mpos):]))
        return res

    def same(direct, jit):
        """The direct launch passes the JIT's arguments, tensors as their data pointers (ints)."""
        want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in jit)
        return len(direct) == len(want) and all(type(u) is type(v) and u == v for u, v in zip(direct, want))

    out = torch.empty_like(x.q)
    assert run(out) == ["jit"] * (1 + merges)  # first: through the JIT, which compiles
    for q2 in (x.q, x.q.clone()):
        out2 = torch.empty_like(x.q)
        assert run(out2, q=q2) == ["direct"] * (1 + merges)  # same layout: the compiled kernel directly
        a = log[0][1]
        assert a[:4] == (plan.grid[0], 1, 1, 77) and a[4] is fake.split_kv_partial_kernel.compiled.function
        want = expected(q2, out2, None)
        assert same(a[9:], want[0])
        if merges:
            m = log[1][1]
            assert m[:3] == tuple(L.merge_grid) + (1,) * (3 - len(L.merge_grid)) and same(m[9:], want[1])
    # another layout of out (strides, a 16-byte misaligned pointer), an lse: the JIT again, once
    wide = torch.empty(2, 1, 8, 48)[..., :32]
    assert run(wide) == ["jit"] * (1 + merges) and run(wide) == ["direct"] * (1 + merges)
    shifted = torch.empty(x.q.numel() + 1)[1:].view(x.q.shape)
    assert shifted.data_ptr() % 16 and run(shifted) == ["jit"] * (1 + merges)
    lse = torch.empty(2, 1, 8)
    assert run(out, lse) == ["jit"] * (1 + merges) and run(out, lse) == ["direct"] * (1 + merges)
    # a launch hook (profilers: a plain function, or one added to Triton's chain), the debug knob, another
    # device: the JIT
    default_enter = hooks.launch_enter_hook
    hooks.launch_enter_hook = lambda *a: None
    assert run(out) == ["jit"] * (1 + merges)
    if hasattr(default_enter, "add"):
        chain = type(default_enter)()
        chain.add(lambda *a: None)
        hooks.launch_enter_hook = chain
        assert run(out) == ["jit"] * (1 + merges)
        hooks.launch_enter_hook = type(default_enter)()  # emptied again: direct
        assert run(out) == ["direct"] * (1 + merges)
    hooks.launch_enter_hook, hooks.debug = None, True
    assert run(out) == ["jit"] * (1 + merges)
    hooks.debug = False
    bl.current_device = lambda: 1
    assert run(out) == ["jit"] * (1 + merges)


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs the Triton interpreter")
def test_triton_direct_launch_refuses_a_kernel_of_another_shape(monkeypatch, gen):
    """A compiled kernel whose constexpr parameters are not the trailing ones (another Triton layout) is never
    launched directly."""
    from attnplan.backends.triton import kernels

    be = get_backend("triton")
    log: list = []
    fp = _FakeJit(kernels.split_kv_partial_kernel, log)
    fp.constexprs = fp.constexprs[1:]
    monkeypatch.setattr(be, "_kernels", lambda: types.SimpleNamespace(split_kv_partial_kernel=fp,
                                                                      merge_kernel=_FakeJit(kernels.merge_kernel, log)))
    x = make_inputs(1, 8, 2, 32, [30], dtype=torch.float32, generator=gen)
    w = attnplan.DecodeWrapper(backend="triton")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=1, seq_lens_host=[30])
    bl = w._launcher
    bl.hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False)
    bl.current_device, bl.current_stream = (lambda: 0), (lambda d: 0)
    for _ in range(3):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens)
    assert [e[0] for e in log] == ["jit"] * 3 and not bl.direct


# -- numba's direct launch: the marshalling template, with stand-ins for numba's objects -------------------

class _FakeArray:
    """numba's array type stand-in."""


class _FakeKernel:
    """Stands in for numba's compiled ``_Kernel``: ``_prepare_args`` lays arguments out as numba's does (arrays as
    meminfo, parent, size, itemsize, pointer, shape, strides in bytes)."""

    debug = cooperative = False
    extensions = ()

    def __init__(self, args):
        self.argument_types = tuple(_FakeArray() if isinstance(a, torch.Tensor) else int for a in args)
        self._codelibrary = types.SimpleNamespace(get_cufunc=lambda: types.SimpleNamespace(kernel="handle"))

    def _prepare_args(self, ty, val, stream, retr, out):
        if isinstance(ty, _FakeArray):
            out += [0, 0, val.numel(), val.element_size(), val.data_ptr(), *val.shape,
                    *(s * val.element_size() for s in val.stride())]
        else:
            out.append(("c_int", val))


class _FakeDispatcher:
    def __init__(self):
        self.overloads = {}

    def typeof_pyval(self, a):
        return ("array", a.dtype, a.dim()) if isinstance(a, torch.Tensor) else type(a)

    def __getitem__(self, cfg):
        grid, block, stream = cfg
        return types.SimpleNamespace(griddim=tuple(grid) + (1,) * (3 - len(grid)), blockdim=(block, 1, 1),
                                     sharedmem=0, stream=("core", stream))


def test_numba_direct_template_patches_only_the_call_pointers():
    """The template is numba's own marshalling of the first call; later calls replace exactly the pointers that come
    from the call's tensors (checked against a fresh marshalling of the new tensors), and a marshalling whose
    pointer is not where expected gives no template."""
    from attnplan.backends import numba as nb

    launched = []
    api = types.SimpleNamespace(launch=lambda *a: launched.append(a), LaunchConfig=lambda **kw: ("config", kw),
                                CUDA_CORE_GE_1_0=True)
    q, out, ws = torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(5)
    args = (q, out, ws, 7)
    tensors = ((q, "q"), (out, "out"), (ws, None), (None, None))
    kern = _FakeDispatcher()
    kern.overloads[tuple(kern.typeof_pyval(a) for a in args)] = _FakeKernel(args)
    orig = nb._launch_api
    try:
        nb._launch_api = lambda: (api, _FakeArray)
        d = nb._direct(kern, args, tensors, (4,), 32, "stream")
        assert d is not None and d.handle == "handle" and d.config[1]["grid"] == (4, 1, 1)
        q2, out2 = torch.ones(2, 3), torch.ones(2, 3)
        src = [None] * len(nb._ROLES)
        src[nb._ROLE_INDEX["q"]], src[nb._ROLE_INDEX["out"]] = q2, out2
        a = d.template.copy()
        for pos, i in d.patch:
            a[pos] = src[i].data_ptr()  # BoundLaunch writes the same pointers (from the wrapper's or its own reads)
        fresh = []
        for t, ty, v in zip(tensors, kern.overloads[tuple(kern.typeof_pyval(x) for x in args)].argument_types,
                            (q2, out2, ws, 7)):
            _FakeKernel(args)._prepare_args(ty, v, None, [], fresh)
        assert a == fresh
        # a pointer numba put elsewhere: no template
        bad = _FakeKernel(args)
        bad._prepare_args = lambda ty, val, s, r, o: o.extend([0] * 7 if isinstance(ty, _FakeArray) else [1])
        kern.overloads[tuple(kern.typeof_pyval(x) for x in args)] = bad
        assert nb._direct(kern, args, tensors, (4,), 32, "stream") is None
    finally:
        nb._launch_api = orig


# -- cuda_ptx's bound launch: the packed bytes, with the driver's launches captured (no GPU) -----------------

try:
    from attnplan.backends.cuda_ptx import runtime as _cuda_rt
    _cuda_rt.bindings()
    HAS_CUDA_PYTHON = True
except Exception:  # noqa: BLE001
    HAS_CUDA_PYTHON = False
needs_cuda_python = pytest.mark.skipif(not HAS_CUDA_PYTHON, reason="cuda-python not importable")
#: the stream handle torch's current stream stands in with
STREAM = 77


class _Driver:
    """cuda-python's driver module with the context query answered and the two launches captured as (function,
    grid, block, dynamic shared memory, stream, the ``kernelParams`` slots' bytes, PDL); the rest is cuda-python's
    (the PDL launch configuration is its real structure)."""

    def __init__(self, real, log: list):
        self._real, self.log = real, log

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cuCtxGetCurrent(self):
        return self._real.CUresult.CUDA_SUCCESS, 1

    @staticmethod
    def _params(fn, params: int) -> bytes:
        import ctypes

        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        return b"".join(ctypes.string_at(slots[i], 8) for i in range(fn[1]))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.log.append((fn[0], (gx, gy, gz), (bx, by, bz), smem, int(stream), self._params(fn, params), False))
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, config, fn, params, extra):
        c = config
        self.log.append((fn[0], (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                         c.sharedMemBytes, int(c.hStream), self._params(fn, params), True))
        return (self._real.CUresult.CUDA_SUCCESS,)


def _cuda_ptx_stand_in(monkeypatch, pdl_supported: bool = True):
    """A cuda_ptx backend on CPU tensors whose device runtime is real but for the driver (:class:`_Driver`) and
    the loaded functions (``(spec name, parameter count)``); torch's current device 0 and stream :data:`STREAM`.
    Returns ``(backend, launches, unbound)``: the captured launches, and one entry per launch that went through
    ``DeviceRuntime.launch`` (the unbound path's)."""
    from attnplan.backends.cuda_ptx import CudaPtxBackend
    from attnplan.backends.cuda_ptx import args as A
    from attnplan.backends.cuda_ptx import nvrtc as N

    R = _cuda_rt
    real, _ = R.bindings()
    launches: list = []
    unbound: list = []
    monkeypatch.setattr(R, "bindings", lambda: (_Driver(real, launches), None))
    rt = object.__new__(R.DeviceRuntime)
    rt.index, rt._ctx_int, rt._tls, rt.pdl_supported = 0, 1, threading.local(), pdl_supported
    rt.function = lambda spec: (spec.name, len(A.MERGE_SIGNATURE if spec.kind == "merge" else A.PARTIAL_SIGNATURE))
    rt.launch = lambda *a: (unbound.append(a[0].name), R.DeviceRuntime.launch(rt, *a))
    be = CudaPtxBackend(N.CompileCache(disk=False))
    be._runtime_for = lambda device: rt
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=STREAM))
    return be, launches, unbound


def _cuda_ptx_plan(be, x, splits, merge):
    """A CPU stand-in plan of ``x``'s problem: ``splits`` forced, or a capacity plan where ``splits`` is None."""
    from attnplan.device import CPU_STANDIN
    from attnplan.planner import make_plan
    from attnplan.testing import problem_of

    prob = problem_of(x)
    kc = be.kernel_config(prob, {}, torch.device("cpu"))
    return make_plan(prob, CPU_STANDIN, attnplan.load_config(split={"merge": merge}), "cuda_ptx", kc,
                     num_splits=splits, capacity_mode=splits is None, merge_strategies=be.merge_strategies)


@pytest.mark.parametrize("hkv", [1, 2, 8])
def test_cuda_ptx_spread_slots_for_plans_that_may_see_long_tailed_batches(hkv):
    """The partial kernel's ``spread_slots`` (:func:`~attnplan.backends.cuda_ptx.spread_slots`, the last argument the
    launch packs): :func:`~attnplan.schedule.spread_window` of the plan's SMs and KV heads for a capacity plan and
    for a live plan of a long-tailed batch (0 at one KV head), 0 for a uniform live plan and a single pass."""
    from attnplan.backends.cuda_ptx import CudaPtxBackend, spread_slots
    from attnplan.backends.cuda_ptx import nvrtc as N
    from attnplan.device import CPU_STANDIN
    from attnplan.planner import make_plan
    from attnplan.problem import DecodeProblem
    from attnplan.schedule import spread_window

    be = CudaPtxBackend(N.CompileCache(disk=False))
    cfg = attnplan.load_config()

    def plan_of(lens, capacity_mode=False, splits=None):
        prob = DecodeProblem(batch=len(lens), num_q_heads=4 * hkv, num_kv_heads=hkv, head_dim=128,
                             max_kv_len=max(lens), total_kv_len=sum(lens), page_size=16, capacity=4096)
        kc = be.kernel_config(prob, {}, torch.device("cpu"))
        return make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, capacity_mode=capacity_mode, num_splits=splits,
                         merge_strategies=be.merge_strategies)

    window = spread_window(CPU_STANDIN.sm_count, hkv)
    assert (window == 0) == (hkv == 1)
    capacity = plan_of([4096] * 4, capacity_mode=True)
    tail = plan_of([4096] + [64] * 7)
    uniform = plan_of([4096] * 4)
    single = plan_of([4096] * 4, splits=1)
    assert not capacity.single_pass and capacity.capacity_mode and tail.problem.long_tailed
    assert not uniform.problem.long_tailed and single.single_pass
    assert spread_slots(capacity) == window and spread_slots(tail) == window
    assert spread_slots(uniform) == 0 and spread_slots(single) == 0


def _packed_launches(be, plan, ws, x, out, lse, pdl_supported):
    """What the unbound path launches for these tensors, from the argument lists alone: the specs the plan runs,
    their launch configurations, :func:`partial_args` / :func:`merge_args` packed by :class:`PackedArgs`, PDL for the
    separate merge where the plan and the device have it."""
    from attnplan.backends.cuda_ptx import args as A
    from attnplan.backends.cuda_ptx import spec as S
    from attnplan.backends.cuda_ptx import spread_slots

    p, dev, st = plan.problem, ws.targets.device, ws.state
    spec = be.spec_for("partial", plan, dev)
    cfg = S.partial_launch_config(spec, plan.schedule.max_units, p.num_kv_heads)
    vals = A.partial_args(spec, x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, out, lse,
                          schedule=None if plan.single_pass else plan.schedule,
                          targets=None if plan.single_pass else ws.targets,
                          meta=ws.meta if plan.merge == "separate" else None,
                          counters=ws.counters if plan.merge == "fused" else None,
                          ws_o=None if st is None else st.o, ws_lse=None if st is None else st.lse,
                          window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks, k_scale=x.k_scale,
                          v_scale=x.v_scale, spread_slots=spread_slots(plan))
    res = [(spec.name, cfg.grid, cfg.block, cfg.smem, STREAM, A.PackedArgs(A.PARTIAL_SIGNATURE, vals).buffer.raw,
            False)]
    if plan.merge == "separate" and not plan.single_pass:
        ms = be.spec_for("merge", plan, dev)
        mc = S.merge_launch_config(ms, p.batch * p.q_len * p.num_q_heads)
        mv = A.merge_args(st.o, st.lse, ws.meta, out, lse, x.sinks)
        res.append((ms.name, mc.grid, mc.block, mc.smem, STREAM, A.PackedArgs(A.MERGE_SIGNATURE, mv).buffer.raw,
                    bool(plan.kernel.get("pdl", True)) and pdl_supported))
    return res


def _fresh(x):
    """Inputs of the same layout in other storage (the binding's sinks and scales kept)."""
    y = DecodeInputs(x.q.clone(), x.k_cache.clone(), x.v_cache.clone(), x.seq_lens.clone(),
                     None if x.block_table is None else x.block_table.clone(), x.sm_scale, x.window_left, x.soft_cap,
                     x.sinks, x.k_scale, x.v_scale)
    for a, b in ((x.q, y.q), (x.k_cache, y.k_cache), (x.seq_lens, y.seq_lens)):
        assert a.stride() == b.stride() and a.data_ptr() != b.data_ptr() and b.data_ptr() % 16 == 0
    return y


def _ptrs(x):
    return tuple(0 if t is None else t.data_ptr() for t in (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table))


# (merge, splits, page, lse, sinks, fp8, variant kw, pdl on the device, the plan's pdl option)
BOUND_CASES = {
    "single-paged": ("separate", 1, 16, False, False, False, {}, True, True),
    "single-contig-lse-sinks": ("separate", 1, None, True, True, False, {}, True, True),
    "separate-paged-lse-pdl": ("separate", 4, 16, True, False, False, {}, True, True),
    "separate-contig-sinks-nopdl-device": ("separate", 3, None, False, True, False, {}, False, True),
    "separate-paged-pdl-off": ("separate", 4, 16, True, True, False, {}, True, False),
    "fused-paged-lse-sinks": ("fused", 4, 16, True, True, False, {}, True, True),
    "fused-contig-window-softcap": ("fused", 3, None, True, False, False,
                                    {"window_left": 40, "soft_cap": 30.0}, True, True),
    "fp8-separate-paged-scales-sinks": ("separate", 4, 16, True, True, True, {}, True, True),
    "fp8-single-contig-scales": ("separate", 1, None, False, False, True, {}, True, True),
    # a capacity plan (splits None): the balanced schedule, and the spread's window in the last argument
    "capacity-separate-paged-lse": ("separate", None, 16, True, False, False, {}, True, True),
}


@needs_cuda_python
@pytest.mark.parametrize("case", list(BOUND_CASES))
def test_cuda_ptx_bound_launch_packs_the_unbound_paths_bytes(monkeypatch, case, gen):
    """For every kind of plan, the bound launch's driver launches (function, grid, block, shared memory, stream,
    every ``kernelParams`` byte, PDL) equal, call after call with new q / caches / seq_lens / block table / out /
    lse tensors of the same layout, both what the unbound path launches for the same tensors and what
    ``partial_args`` / ``merge_args`` packed by ``PackedArgs`` give; the first call takes the unbound path, the
    later ones do not."""
    import dataclasses

    from attnplan.backends.cuda_ptx import BoundLaunch
    from attnplan.planner import KernelOptions

    merge, splits, page, with_lse, with_sinks, fp8, kw, pdl_dev, pdl_plan = BOUND_CASES[case]
    be, launches, unbound = _cuda_ptx_stand_in(monkeypatch, pdl_supported=pdl_dev)
    x = make_inputs(2, 8, 2, 64, [70, 33], q_len=2 if merge == "fused" else 1, page_size=page,
                    dtype=torch.bfloat16, generator=gen)
    hq, hkv = 8, 2
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    kc, vc, ks, vs = x.k_cache, x.v_cache, None, None
    if fp8:
        kc, vc = x.k_cache.float().to(torch.float8_e4m3fn), x.v_cache.float().to(torch.float8_e4m3fn)
        ks, vs = torch.rand(hkv, generator=gen) + 0.5, torch.rand(hkv, generator=gen) + 0.5
    x = DecodeInputs(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, sinks=sinks, k_scale=ks, v_scale=vs, **kw)
    plan = _cuda_ptx_plan(be, x, splits, merge)
    if not pdl_plan:
        plan = dataclasses.replace(plan, kernel=KernelOptions({**plan.kernel, "pdl": False}))
    assert plan.single_pass == (splits == 1) and (plan.single_pass or plan.merge == merge)
    ws = Workspace.allocate(plan, torch.device("cpu"))
    bl = be.bind(plan, ws, x)
    assert isinstance(bl, BoundLaunch)
    bl.raw_stream = lambda index: STREAM

    def outputs():
        return torch.empty_like(x.q), (torch.empty(x.q.shape[:3]) if with_lse else None)

    def bound(y, out, lse, give_ptrs=True):
        launches.clear()
        bl(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table, out, lse, _ptrs(y) if give_ptrs else None)
        return list(launches)

    def through_run(y, out, lse):
        launches.clear()
        be.run(plan, y, ws, out, lse)
        return list(launches)

    kernels = 2 if plan.merge == "separate" and not plan.single_pass else 1
    out, lse = outputs()
    first = bound(x, out, lse)
    assert len(unbound) == kernels and len(first) == kernels  # the unbound path, once per kernel
    assert first == _packed_launches(be, plan, ws, x, out, lse, pdl_dev)
    assert [e[6] for e in first] == [False] + [pdl_dev and pdl_plan] * (kernels - 1)
    for i in range(3):
        y = _fresh(x)
        out2, lse2 = outputs()
        got = bound(y, out2, lse2, give_ptrs=i != 1)
        assert len(unbound) == kernels, "a prepared layout took the unbound path"
        want = _packed_launches(be, plan, ws, y, out2, lse2, pdl_dev)
        assert got == want
        assert got == through_run(y, out2, lse2)
        assert all(g[5] != f[5] for g, f in zip(got, first))  # the pointers did change
        del unbound[kernels:]
    for t in (sinks, ks, vs):  # a variant tensor's storage replaced in place: its new pointer is launched
        if t is not None:
            t.set_(t.clone())
            got = bound(x, out, lse)
            assert len(unbound) == kernels and got == _packed_launches(be, plan, ws, x, out, lse, pdl_dev)


@needs_cuda_python
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_ptx_bound_launch_makes_the_context_current_only_when_a_launch_fails(monkeypatch, pdl):
    """The bound launch does not ask for the current context: a launch that fails (this device's context not
    current) makes it current and launches once more; a second failure raises DriverError; a success needs neither
    the query nor a second launch."""
    from attnplan.backends.cuda_ptx._bindings import DriverError
    from attnplan.backends.cuda_ptx.spec import LaunchConfig

    R = _cuda_rt
    real, _ = R.bindings()
    calls: list[str] = []
    results = []

    class Driver:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuCtxGetCurrent(self):
            calls.append("query")
            return real.CUresult.CUDA_SUCCESS, 2  # another context than the runtime's (1)

        def cuCtxSetCurrent(self, ctx):
            calls.append("set")
            return (real.CUresult.CUDA_SUCCESS,)

        def cuLaunchKernel(self, *args):
            calls.append("launch")
            return (results.pop(0),)

        def cuLaunchKernelEx(self, *args):
            calls.append("launch pdl")
            return (results.pop(0),)

    monkeypatch.setattr(R, "bindings", lambda: (Driver(), None))
    rt = object.__new__(R.DeviceRuntime)
    rt.index, rt._ctx_int, rt._ctx, rt._tls, rt.pdl_supported = 0, 1, 1, threading.local(), True
    cfg = LaunchConfig((1, 1, 1), (32, 1, 1), 0)
    ok, bad = real.CUresult.CUDA_SUCCESS, real.CUresult.CUDA_ERROR_INVALID_CONTEXT
    launch = "launch pdl" if pdl else "launch"
    results[:] = [ok]
    rt.launch_current("fn", "k", cfg, 0, STREAM, pdl)
    assert calls == [launch]
    for first in (bad, real.CUresult.CUDA_ERROR_INVALID_HANDLE):  # another context's function: made current
        calls.clear()
        results[:] = [first, ok]
        rt.launch_current("fn", "k", cfg, 0, STREAM, pdl)
        assert calls == [launch, "query", "set", launch]
    calls.clear()
    results[:] = [bad, bad]
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_CONTEXT"):
        rt.launch_current("fn", "k", cfg, 0, STREAM, pdl)
    assert calls == [launch, "query", "set", launch]
    calls.clear()  # any other error is the launch's own: raised as it is, no retry
    results[:] = [real.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES]
    with pytest.raises(DriverError, match="CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        rt.launch_current("fn", "k", cfg, 0, STREAM, pdl)
    assert calls == [launch]


@needs_cuda_python
def test_cuda_ptx_bound_launch_new_layouts_take_the_unbound_path_first(monkeypatch, gen):
    """Each new output layout (out's strides, a 16-byte misaligned out, an lse, lse's strides) goes through the
    unbound path once, then the bound one with the unbound path's bytes; another current device takes the unbound
    path; after MAX_LAYOUTS layouts a new one stays on the unbound path."""
    from attnplan.backends.cuda_ptx.bound import MAX_LAYOUTS

    be, launches, unbound = _cuda_ptx_stand_in(monkeypatch)
    x = make_inputs(2, 8, 2, 64, [70, 33], page_size=16, dtype=torch.bfloat16, generator=gen)
    plan = _cuda_ptx_plan(be, x, 4, "separate")
    ws = Workspace.allocate(plan, torch.device("cpu"))
    bl = be.bind(plan, ws, x)
    bl.raw_stream = lambda index: STREAM
    b, q, h, d = x.q.shape

    def call(out, lse=None):
        """(took the unbound path, launches equal the packed argument lists')"""
        launches.clear()
        n = len(unbound)
        bl(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out, lse, _ptrs(x))
        return len(unbound) > n, launches == _packed_launches(be, plan, ws, x, out, lse, True)

    layouts = [
        (torch.empty_like(x.q), None),
        (torch.empty(b, q, h, d + 16, dtype=x.q.dtype)[..., :d], None),                    # out's strides
        (torch.empty(x.q.numel() + 1, dtype=x.q.dtype)[1:].view(x.q.shape), None),        # misaligned out
        (torch.empty_like(x.q), torch.empty(b, q, h)),                                     # an lse
        (torch.empty_like(x.q), torch.empty(b, q + 1, h)[:, :q]),                          # lse's strides
    ]
    assert layouts[2][0].data_ptr() % 16
    for out, lse in layouts:
        assert call(out, lse) == (True, True)
        assert call(out, lse) == (False, True)
        assert call(torch.empty_like(out), None if lse is None else torch.empty_like(lse)) == (False, True)
    assert len(bl.direct) == len(layouts)
    bl.current_device = lambda: 1
    assert call(*layouts[0]) == (True, True)
    bl.current_device = lambda: 0
    for pad in range(1, MAX_LAYOUTS + 3):
        call(torch.empty(b, q, h, d + 8 * pad, dtype=x.q.dtype)[..., :d])
    assert len(bl.direct) == MAX_LAYOUTS
    late = torch.empty(b, q, h, d + 8 * (MAX_LAYOUTS + 5), dtype=x.q.dtype)[..., :d]
    assert call(late) == (True, True) and call(late) == (True, True)


@needs_cuda_python
def test_cuda_ptx_bind_raises_what_the_unbound_path_raises(monkeypatch, gen):
    """bind() runs partial()'s checks of the inputs and the workspace (the same ValueError, so the wrapper falls back
    to the unbound path, which raises it at run()); on CPU tensors the real backend refuses to bind."""
    from attnplan.backends.cuda_ptx import CudaPtxBackend
    from attnplan.backends.cuda_ptx import nvrtc as N

    x = make_inputs(2, 8, 2, 64, [70, 33], page_size=16, dtype=torch.bfloat16, generator=gen)
    real = CudaPtxBackend(N.CompileCache(disk=False))
    be, launches, unbound = _cuda_ptx_stand_in(monkeypatch)
    plan = _cuda_ptx_plan(be, x, 4, "separate")
    ws = Workspace.allocate(plan, torch.device("cpu"))
    with pytest.raises(ValueError, match="only on CUDA tensors"):
        real.bind(plan, ws, x)
    shifted = torch.empty(x.q.numel() + 1, dtype=x.q.dtype)[1:].view(x.q.shape)
    bad = [
        DecodeInputs(shifted, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale),
        DecodeInputs(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, window_left=8),
        DecodeInputs(x.q, x.k_cache, x.v_cache, x.seq_lens[:1], x.block_table, x.sm_scale),
        DecodeInputs(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sinks=torch.zeros(3)),
    ]
    for y in bad:
        with pytest.raises(ValueError) as unbound_error:
            be.partial(plan, y, ws, torch.empty_like(x.q), None)
        with pytest.raises(ValueError) as bind_error:
            be.bind(plan, ws, y)
        assert str(bind_error.value) == str(unbound_error.value)
    small = Workspace.allocate(_cuda_ptx_plan(be, x, 1, "separate"), torch.device("cpu"))
    with pytest.raises(ValueError, match="workspace has no state"):
        be.bind(plan, small, x)
    assert not launches


@needs_cuda_python
@pytest.mark.parametrize("merge,splits", [("separate", 4), ("fused", 4), ("separate", 1)])
def test_decode_wrapper_runs_cuda_ptx_through_its_bound_launch(monkeypatch, merge, splits, gen):
    """DecodeWrapper.plan() binds cuda_ptx's launches and run() calls them: the first run() of a layout goes through
    the unbound path, later ones launch the prepared arguments, byte for byte the unbound path's for the call's
    tensors (new q, out and lse); a new plan() for another signature binds again."""
    from attnplan import backends as B
    from attnplan.backends.cuda_ptx import BoundLaunch

    be, launches, unbound = _cuda_ptx_stand_in(monkeypatch)
    be.available = lambda device: (True, "")
    be.prepare = lambda plan, device: None  # nothing to compile or load
    monkeypatch.setitem(B._instances, "cuda_ptx", be)
    x = make_inputs(2, 8, 2, 64, [70, 33], page_size=16, dtype=torch.bfloat16, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    cfg = attnplan.load_config(split={"merge": merge}, plan_cache={"disk": False})
    w = attnplan.DecodeWrapper(attnplan.Context.from_config(cfg), backend="cuda_ptx")
    plan = w.plan(*args, seq_lens_host=[70, 33], num_splits=splits)
    assert w.backend is be and plan.single_pass == (splits == 1)
    bl = w._launcher
    assert isinstance(bl, BoundLaunch)
    bl.raw_stream = lambda index: STREAM
    kernels = 2 if plan.merge == "separate" and not plan.single_pass else 1
    out, lse = torch.empty_like(x.q), torch.empty(x.q.shape[:3])
    w.run(*args, out=out, lse=lse)
    assert len(unbound) == kernels and len(bl.direct) == 1
    for _ in range(2):
        q2, out2, lse2 = x.q.clone(), torch.empty_like(x.q), torch.empty(x.q.shape[:3])
        launches.clear()
        assert w.run(q2, *args[1:], out=out2, lse=lse2) is out2
        got = list(launches)
        assert len(unbound) == kernels, "run() did not use the bound launch"
        launches.clear()
        be.run(plan, DecodeInputs(q2, *args[1:], w._sm_scale, **w._variant), w.workspace, out2, lse2)
        assert got == launches and len(got) == kernels
        del unbound[kernels:]
    x3 = make_inputs(3, 8, 2, 64, [70, 33, 5], page_size=16, dtype=torch.bfloat16, generator=gen)
    w.plan(x3.q, x3.k_cache, x3.v_cache, x3.seq_lens, x3.block_table, seq_lens_host=[70, 33, 5], num_splits=splits)
    assert isinstance(w._launcher, BoundLaunch) and w._launcher is not bl


class _RawDriver:
    """Stands in for cuda-python's driver module for Triton's raw launch: ``CUfunction`` of an int handle, each
    function's parameter sizes (``cuFuncGetParamInfo``) from ``sizes``, and ``cuLaunchKernel`` recording the
    function, grid, block, shared memory, stream and each parameter's bytes; it returns ``status`` (one for every
    function, or a dict of function handle -> status, 0 where absent)."""

    def __init__(self, real, sizes: dict, log: list):
        self._real, self.sizes, self.log, self.status = real, sizes, log, 0
        self.CUresult = real.CUresult

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def CUfunction(handle):
        return int(handle)

    def cuFuncGetParamInfo(self, fn, i):
        sizes = self.sizes[fn]
        return (0, 8 * i, sizes[i]) if i < len(sizes) else (1, 0, 0)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        import ctypes

        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        vals = [ctypes.string_at(slots[i], n) for i, n in enumerate(self.sizes[fn])]
        self.log.append(("raw", fn, (gx, gy, gz), (bx, by, bz), smem, stream, vals))
        status = self.status.get(fn, 0) if isinstance(self.status, dict) else self.status
        return (self._real.CUresult(status),)


class _FakeJitRaw(_FakeJit):
    """:class:`_FakeJit` whose compiled kernel also has what the raw launch reads: the specialization's signature
    (:func:`_triton_signature`), metadata (4 warps, ``4096 + handle`` bytes of shared memory, no scratch) and a
    function handle, whose parameter sizes it enters in ``sizes`` (with ``extra_param``: another handle, taking one
    parameter more)."""

    def __init__(self, real, log, handle: int, sizes: dict):
        super().__init__(real, log)
        self.handle, self.sizes, self.sig, self.extra_param = handle, sizes, None, False

    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def raw_ready(*args, **kw):
            ck = launch(*args, **kw)
            full = args + tuple(kw[n] for n in self.arg_names[len(args):])
            self.sig = _triton_signature(self.arg_names, set(self.constexprs), full, self.unspecialized)
            ck.src = types.SimpleNamespace(signature=self.sig)
            ck.metadata = types.SimpleNamespace(num_warps=4, shared=4096 + self.handle, num_ctas=1,
                                                global_scratch_size=0, profile_scratch_size=0, launch_pdl=False,
                                                launch_cooperative_grid=False)
            ck.function = self.handle + 100 * self.extra_param  # a function of its own: the first keeps its sizes
            self.sizes[ck.function] = [len(b) for b in _param_bytes(self.sig, full)] + [8] * self.extra_param
            return ck
        return raw_ready


def _triton_signature(names, constexprs, values, unspecialized=()) -> dict:
    """The signature Triton gives a specialization of these argument values: ``constexpr`` for constexprs and for
    ints equal to 1 (but those of ``unspecialized`` parameters), pointer types for tensors, ``i32`` / ``fp32`` for
    ints and floats."""
    sig = {}
    for i, (n, v) in enumerate(zip(names, values)):
        if i in constexprs or (type(v) is int and v == 1 and n not in unspecialized):
            sig[n] = "constexpr"
        elif isinstance(v, torch.Tensor):
            sig[n] = "*fp32"
        elif type(v) is int:
            sig[n] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[n] = "fp32"
    return sig


def _param_bytes(sig: dict, values) -> list[bytes]:
    """Each parameter's bytes as the compiled kernel takes them: no constexprs, data pointers of tensors, then the two
    (null) scratch pointers."""
    import struct

    res = []
    for ty, v in zip(sig.values(), values):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            res.append(struct.pack("<Q", v.data_ptr()))
        else:
            res.append(struct.pack({"i32": "<i", "i64": "<q", "fp32": "<f"}[ty], v))
    return res + [bytes(8), bytes(8)]


def _raw_stand_ins(monkeypatch) -> types.SimpleNamespace:
    """Triton's compiled kernels (:class:`_FakeJitRaw`, handles 1001 / 1002) and cuda-python's driver
    (:class:`_RawDriver`) stood in for, for the triton backend: ``be``, the shared launch ``log``, ``jits`` (partial,
    merge), the driver ``drv`` and ``hooks``, Triton's own default launch hooks with its debug knob off (what a
    binding's ``hooks`` holds on a GPU)."""
    from attnplan.backends.cuda_ptx import _bindings
    from attnplan.backends.triton import kernels
    from triton import knobs

    be = get_backend("triton")
    log: list = []
    sizes: dict = {}
    jits = {"partial": _FakeJitRaw(kernels.split_kv_partial_kernel, log, 1001, sizes),
            "merge": _FakeJitRaw(kernels.merge_kernel, log, 1002, sizes)}
    monkeypatch.setattr(be, "_kernels", lambda: types.SimpleNamespace(split_kv_partial_kernel=jits["partial"],
                                                                      merge_kernel=jits["merge"]))
    drv = _RawDriver(_bindings.bindings()[0], sizes, log)
    monkeypatch.setattr(_bindings, "_BINDINGS", (drv, None))
    hooks = types.SimpleNamespace(launch_enter_hook=knobs.runtime.launch_enter_hook,
                                  launch_exit_hook=knobs.runtime.launch_exit_hook, debug=False)
    return types.SimpleNamespace(be=be, log=log, jits=jits, drv=drv, hooks=hooks)


@needs_cuda_python
@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs the Triton interpreter")
@pytest.mark.parametrize("page,with_lse,with_sinks", [(16, True, True), (None, False, False)],
                         ids=["paged-lse-sinks", "contiguous"])
def test_triton_raw_launch_packs_what_tritons_launcher_is_given(monkeypatch, page, with_lse, with_sinks, gen):
    """With Triton's compiled kernels and cuda-python's driver stood in for: a layout's later calls go through one
    ``cuLaunchKernel`` per kernel whose parameter bytes are, call after call with new q / caches / seq_lens / block
    table / out tensors, exactly the JIT arguments of those tensors less the constexprs (data pointers for tensors)
    plus two null scratch pointers; the grid, block (num_warps x 32) and shared memory are the compiled kernel's. A
    context error falls back to Triton's launcher for that call (for both kernels, or for the merge alone where only
    its launch fails); another driver error raises; a function whose parameters (as the driver reports them) differ
    from the derived ones is never launched raw. Paged with an lse and sinks (the variant pointers), and
    contiguous (the block table's stand-in)."""
    from attnplan.backends.cuda_ptx._bindings import DriverError
    from attnplan.backends.triton import BoundLaunch

    st = _raw_stand_ins(monkeypatch)
    be, log, jits, drv = st.be, st.log, st.jits, st.drv
    cfg = attnplan.load_config(split={"merge": "separate"})
    x = make_inputs(2, 8, 2, 32, [60, 20], page_size=page, dtype=torch.float32, generator=gen)
    sinks = torch.randn(8, generator=gen) if with_sinks else None
    w = attnplan.DecodeWrapper(cfg, backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=4, seq_lens_host=[60, 20],
                  sinks=sinks)
    assert plan.merge == "separate"
    new_lse = (lambda: torch.empty(2, 1, 8)) if with_lse else (lambda: None)
    bl = w._launcher
    assert isinstance(bl, BoundLaunch) and bl.raw
    bl.hooks, bl.current_device, bl.current_stream = st.hooks, (lambda: 0), (lambda d: 77)
    L = be._launch(plan, w.workspace)

    def run(y, out, lse):
        log.clear()
        w.run(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table, out=out, lse=lse)
        return [e[0] for e in log]

    lse = new_lse()
    out = torch.empty_like(x.q)
    assert run(x, out, lse) == ["jit", "jit"]
    (entry,) = bl.direct.values()
    assert entry[2] is not None and entry[3] is not None, "the raw launches were not prepared"
    for _ in range(2):
        y, out2, lse2 = _fresh(x), torch.empty_like(x.q), new_lse()
        assert run(y, out2, lse2) == ["raw", "raw"]
        xi = DecodeInputs(y.q, y.k_cache, y.v_cache, y.seq_lens, y.block_table, w._sm_scale, sinks=sinks)
        pos = be._partial_args(L, xi, out2, lse2)
        kw = {**L.const, "WRITE_LSE": with_lse, "SINKS_ON": with_sinks}
        full = pos + tuple(kw[n] for n in jits["partial"].arg_names[len(pos):])
        _, fn, grid, block, smem, stream, vals = log[0]
        assert fn == 1001 and grid == tuple(plan.grid) + (1,) * (3 - len(plan.grid)) and block == (128, 1, 1)
        assert smem == 4096 + 1001 and stream == 77 and vals == _param_bytes(jits["partial"].sig, full)
        mpos = be._merge_args(L, out2, lse2, sinks)
        mkw = {**L.merge_const, "WRITE_LSE": with_lse, "SINKS_ON": with_sinks}
        mfull = mpos + tuple(mkw[n] for n in jits["merge"].arg_names[len(mpos):])
        _, fn, grid, _, _, _, vals = log[1]
        assert fn == 1002 and grid == tuple(L.merge_grid) + (1,) * (3 - len(L.merge_grid))
        assert vals == _param_bytes(jits["merge"].sig, mfull)
    drv.status = 201  # CUDA_ERROR_INVALID_CONTEXT: nothing enqueued, Triton's launcher launches both
    assert run(x, out, lse) == ["raw", "direct", "direct"]
    drv.status = 2  # CUDA_ERROR_OUT_OF_MEMORY: raised, naming the launch
    with pytest.raises(DriverError, match="cuLaunchKernel"):
        run(x, out, lse)
    drv.status = {1002: 201}  # the merge's launch alone: the partial's raw launch stands, Triton's launches the merge
    assert run(x, out, lse) == ["raw", "raw", "direct"]
    drv.status = {1002: 2}
    with pytest.raises(DriverError, match="merge"):
        run(x, out, lse)
    drv.status = 0
    # another layout, whose loaded partial function takes one parameter more than derived: Triton's launcher
    jits["partial"].extra_param = True
    out3 = torch.empty(2, 1, 8, 48)[..., :32]
    assert run(x, out3, lse) == ["jit", "jit"] and run(x, out3, lse) == ["direct", "direct"]
    assert run(x, out, lse) == ["raw", "raw"]  # the first layout's still raw


@needs_cuda_python
@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs the Triton interpreter")
@pytest.mark.parametrize("page,merge,with_lse,with_sinks", [(None, "separate", False, False),
                                                             (16, "fused", True, True), (8, "separate", True, False)],
                         ids=["contiguous", "paged16-fused-lse-sinks", "paged8-lse"])
def test_triton_rebind_keeps_the_compiled_kernels_of_an_equal_specialization(monkeypatch, page, merge, with_lse,
                                                                             with_sinks, gen):
    """A wrapper re-planned for a KV cache one token longer (transformers' DynamicCache: a new
    ``[b, kv_heads, L + 1, d]`` tensor, read as the transposed view, so new shapes and strides every step; a paged
    cache with more pages and a wider block table) keeps the plan and workspace; its new binding takes the previous
    one's compiled kernels, so the first run launches raw (no JIT, no driver query), with exactly the JIT arguments
    of the new tensors. A scalar argument whose specialization class changes (q's batch stride no longer a multiple
    of 16) goes through the JIT again."""
    from attnplan.backends.triton import BoundLaunch, spec_classes

    st = _raw_stand_ins(monkeypatch)
    be, log, jits, drv, hooks = st.be, st.log, st.jits, st.drv, st.hooks
    queries = []
    info = drv.cuFuncGetParamInfo
    drv.cuFuncGetParamInfo = lambda fn, i: (queries.append(fn), info(fn, i))[1]
    cfg = attnplan.load_config(split={"merge": merge})
    w = attnplan.DecodeWrapper(cfg, backend="triton")
    b, hq, hkv, d = 2, 8, 2, 32
    q = torch.randn(b, 1, hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    kernels_per_run = 2 if merge == "separate" else 1

    def step(L, q):
        """Plan for caches of L tokens, run twice; the launches' kinds."""
        if page is None:  # transposed views of [b, hkv, L, d]
            k, v = (torch.randn(b, hkv, L, d, generator=gen).transpose(1, 2) for _ in range(2))
            bt = None
        else:  # a page more than the sequences need, the pages shuffled
            per_seq = -(-L // page)
            k, v = (torch.randn(b * per_seq + 1, page, hkv, d, generator=gen) for _ in range(2))
            bt = torch.randperm(b * per_seq + 1, generator=gen)[:b * per_seq].to(torch.int32).view(b, per_seq)
        lens = torch.full((b,), L, dtype=torch.int32)
        plan = w.plan(q, k, v, lens, bt, num_splits=4, seq_lens_host=[L] * b, sinks=sinks)
        assert plan.merge == merge
        bl = w._launcher
        assert isinstance(bl, BoundLaunch)
        bl.hooks, bl.current_device, bl.current_stream = hooks, (lambda: 0), (lambda dev: 77)
        kinds = []
        for _ in range(2):
            out, lse = torch.empty_like(q), torch.empty(b, 1, hq) if with_lse else None
            log.clear()
            w.run(q, k, v, lens, bt, out=out, lse=lse)
            kinds.append([e[0] for e in log])
        L_ = be._launch(plan, w.workspace)
        pos = be._partial_args(L_, DecodeInputs(q, k, v, lens, bt, w._sm_scale, sinks=sinks), out, lse)
        kw = {**L_.const, "WRITE_LSE": with_lse, "SINKS_ON": with_sinks}
        full = pos + tuple(kw[n] for n in jits["partial"].arg_names[len(pos):])
        assert log[0][1] == 1001 and log[0][6] == _param_bytes(jits["partial"].sig, full)
        if merge == "separate":
            mpos = be._merge_args(L_, out, lse, sinks)
            mkw = {**L_.merge_const, "WRITE_LSE": with_lse, "SINKS_ON": with_sinks}
            mfull = mpos + tuple(mkw[n] for n in jits["merge"].arg_names[len(mpos):])
            assert log[1][1] == 1002 and log[1][6] == _param_bytes(jits["merge"].sig, mfull)
        return plan, bl, kinds

    jit, raw = ["jit"] * kernels_per_run, ["raw"] * kernels_per_run
    # lengths of one power-of-two bucket (one plan), a new cache size every step (paged: more pages too)
    # (paged 8: not 57 tokens, whose 17 pages make the last page index 16, a multiple of 16: another specialization)
    lengths = {None: (40, 41, 57, 64), 16: (33, 49), 8: (33, 41, 49)}[page]
    plan, bl, kinds = step(lengths[0], q)
    assert kinds == [jit, raw] and queries
    for L in lengths[1:]:
        queries.clear()
        plan2, bl2, kinds = step(L, q)
        assert plan2 is plan and bl2 is not bl and bl2.L is bl.L
        assert kinds == [raw, raw] and not queries, "the new binding asked the JIT or the driver"
        bl = bl2
    # q's batch stride 264 (not a multiple of 16): another specialization, so the JIT compiles it
    q_odd = torch.randn(b, 1, hq, d + 1, generator=gen)[..., :d]
    assert spec_classes((q_odd.stride(0),)) != spec_classes((q.stride(0),))
    _, bl3, kinds = step(60, q_odd)
    assert bl3.L is bl.L and kinds == [jit, raw]


@needs_cuda_python
@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs the Triton interpreter")
def test_triton_rebind_falls_back_to_the_jit_where_the_packing_refuses_a_value(monkeypatch, gen):
    """A rebind whose re-packing fails (as packing a score scale beyond fp32 would) keeps no kernel, and plan() does
    not raise: the next run goes through the JIT, as a new binding's first run would."""
    from attnplan.backends.triton import raw as raw_mod

    st = _raw_stand_ins(monkeypatch)
    log, hooks = st.log, st.hooks
    w = attnplan.DecodeWrapper(attnplan.load_config(split={"merge": "separate"}), backend="triton")
    x = make_inputs(2, 8, 2, 32, [60, 20], dtype=torch.float32, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens)
    w.plan(*args, num_splits=4, seq_lens_host=[60, 20], sm_scale=0.125)
    bl = w._launcher
    bl.hooks, bl.current_device, bl.current_stream = hooks, (lambda: 0), (lambda d: 7)
    w.run(*args)
    assert bl.direct
    def refuse(self, values):
        raise OverflowError("float too large to pack with f format")

    monkeypatch.setattr(raw_mod.RawKernel, "with_values", refuse)
    w.plan(*args, num_splits=4, seq_lens_host=[60, 20], sm_scale=0.25)
    assert w._launcher is not bl and not w._launcher.direct
    w._launcher.hooks, w._launcher.current_device, w._launcher.current_stream = hooks, (lambda: 0), (lambda d: 7)
    log.clear()
    w.run(*args)
    assert [e[0] for e in log] == ["jit", "jit"]


def test_spec_classes_separate_what_triton_specializes_on():
    """Ints by 1 / multiple of 16 / width, floats not at all, other values by type and value."""
    from attnplan.backends.triton import spec_classes

    c = spec_classes
    assert c((32, 2.5)) == c((4096, -1e9)) and c((0,)) == c((16,)) and c((7,)) == c((9,))
    assert c((1,)) != c((17,)) and c((16,)) != c((8,)) and c((2 ** 31,)) != c((2 ** 31 - 16,))
    assert c((2 ** 63,)) != c((2 ** 62,)) and c((True,)) != c((1,)) and c((True,)) != c((False,))
    assert c((1.0,)) != c((1,))


def test_spec_classes_are_at_least_as_fine_as_tritons_own_rule():
    """Values of equal classes get equal specializations from the installed Triton's own rule (where it exposes
    it): a Triton whose rule grows a distinction that ``spec_classes`` lacks fails here."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        pytest.skip("this Triton does not expose native_specialize_impl")
    from attnplan.backends.triton import spec_classes

    rnd = random.Random(7)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31,
              -2 ** 31 - 16, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 16, 0.0, 1.0, 0.125, -3.5, 1e30]
    values += [rnd.randrange(-2 ** 40, 2 ** 40) for _ in range(300)] + [16 * rnd.randrange(2 ** 36) for _ in range(100)]
    seen: dict = {}
    for v in values:
        spec = native_specialize_impl(CUDABackend, v, False, True, True)
        assert seen.setdefault(spec_classes((v,)), spec) == spec, (v, spec, seen[spec_classes((v,))])


# -- on a GPU: no host sync, and the direct launches right ---------------------------------------------------

GPU_BACKENDS = ["triton", "numba", "cuda_ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_gpu_triton_rebind_over_a_growing_cache_matches_the_reference(merge, monkeypatch):
    """A cache one token longer every step, as transformers' DynamicCache grows it (a new ``[b, kv_heads, L, d]``
    tensor read as the transposed view): one wrapper re-planned each step keeps its plan, and its new binding the
    compiled kernels (launched directly from the first run: the JIT launches only the first step's); every step's
    output, written into poisoned memory, equals the float64 reference."""
    be = get_backend("triton")
    jit = []
    for name in ("_launch_partial", "_launch_merge"):
        real = getattr(be, name)
        monkeypatch.setattr(be, name, lambda *a, _real=real, _name=name: (jit.append(_name), _real(*a))[1])
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, hq, hkv, d = 2, 32, 8, 128
    w = attnplan.DecodeWrapper(attnplan.load_config(split={"merge": merge}), backend="triton")
    k, v = (torch.randn(b, hkv, 2000, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plans = set()
    for step, L in enumerate(range(2000, 2006)):
        if step:
            k, v = (torch.cat([t, torch.randn(b, hkv, 1, d, generator=gen, device="cuda", dtype=t.dtype)], 2)
                    for t in (k, v))
        q = torch.randn(b, 1, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        plans.add(id(w.plan(q, kt, vt, lens, seq_lens_host=[L] * b)))
        if step:
            assert w._launcher.direct, "the new binding did not keep the compiled kernels"
        out = poison(torch.empty_like(q))
        jit.clear()
        w.run(q, kt, vt, lens, out=out)
        assert bool(jit) == (step == 0), jit
        ref, _ = reference.attention(q.cpu(), kt.cpu(), vt.cpu(), lens.cpu(), None, 1 / d ** 0.5)
        assert_close_to_reference(out.cpu(), ref, torch.bfloat16)
    assert len(plans) == 1 and w.plan_.merge in (merge, "none")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_host_lengths_plan_run_decode_never_sync(backend, page):
    """After a first plan and run (compiles, allocates), plan() with host lengths, run() and decode() with host
    lengths run under ``torch.cuda.set_sync_debug_mode("error")``; the results match the reference, through the
    direct launches (new q and out tensors every step), a misaligned out (another specialization) and an lse."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [3000, 17, 0, 900]
    x = make_inputs(4, 32, 8, 128, lens, page_size=page, dtype=torch.bfloat16, device="cuda", capacity=4096,
                    generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ctx = attnplan.Context.from_config(attnplan.load_config())
    w = attnplan.DecodeWrapper(ctx, backend=backend)
    w.plan(*args, seq_lens_host=lens)
    # a 2-byte offset: another pointer alignment, so another Triton specialization
    shifted = torch.empty(x.q.numel() + 1, dtype=x.q.dtype, device="cuda")[1:].view(x.q.shape)
    lse = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda")
    w.run(*args)  # first launches of each layout (compiles) outside the sync check
    w.run(*args, out=shifted)
    w.run(*args, out=torch.empty_like(x.q), lse=lse)
    attnplan.decode(*args, backend=backend, config=ctx, seq_lens_host=lens)
    torch.cuda.synchronize()
    ref, ref_lse = _ref(x)
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            q = x.q.clone()
            w.plan(q, *args[1:], seq_lens_host=lens)
            out = torch.empty_like(q)
            outs.append(w.run(q, *args[1:], out=out))
            outs.append(attnplan.decode(q, *args[1:], backend=backend, config=ctx, seq_lens_host=lens))
        for _ in range(2):
            outs.append(w.run(*args, out=shifted))
            outs.append(w.run(*args, out=torch.empty_like(x.q), lse=lse))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for o in outs:
        assert_close_to_reference(o, ref, torch.bfloat16)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    assert w._launcher is not None and len(w._launcher.direct) >= 2, "the direct launches were not used"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "sinks-lse", "fp8-scales"])
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_triton_raw_launch_matches_tritons_launcher(variant, page):
    """On a GPU, Triton's bound launch goes through one ``cuLaunchKernel`` per kernel (the raw launch is prepared for
    the partial and the merge kernel), and its outputs are bitwise those of Triton's own launcher (the same binding
    with ``raw`` off) and close to the reference, step after step with new q and out tensors, in this thread and in
    a new one (whose current context may not be set)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [2500, 31, 0, 1200]
    fp8 = variant == "fp8-scales"
    x = make_inputs(4, 32, 8, 128, lens, page_size=page, dtype=torch.bfloat16, device="cuda", capacity=4096,
                    generator=gen)
    if fp8:
        x = DecodeInputs(x.q, x.k_cache.to(torch.float8_e4m3fn), x.v_cache.to(torch.float8_e4m3fn), x.seq_lens,
                         x.block_table, x.sm_scale)
    kw = {}
    if variant == "sinks-lse":
        kw["sinks"] = torch.randn(32, device="cuda", generator=gen)
    if fp8:
        kw["k_scale"] = torch.rand(8, device="cuda", generator=gen) + 0.5
        kw["v_scale"] = torch.rand(8, device="cuda", generator=gen) + 0.5
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    cfg = attnplan.load_config(split={"merge": "separate"})
    ws = []
    for raw in (True, False):
        w = attnplan.DecodeWrapper(cfg, backend="triton")
        w.plan(*args, num_splits=4, seq_lens_host=lens, **kw)
        w._launcher.raw = raw
        ws.append(w)
    lse_on = variant == "sinks-lse"
    res = [[], []]
    for step in range(3):
        q = x.q.clone()
        for i, w in enumerate(ws):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda") if lse_on else None
            w.run(q, *args[1:], out=out, lse=lse)
            res[i].append((out, lse))
    # the same layout from a new thread (its tensors made here, so the thread's first CUDA call is the run)
    out_t = torch.empty_like(x.q)
    lse_t = torch.empty(x.q.shape[:3], dtype=torch.float32, device="cuda") if lse_on else None
    box = []
    t = threading.Thread(target=lambda: box.append(ws[0].run(*args, out=out_t, lse=lse_t)))
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert ws[0]._launcher.direct and all(e[2] is not None and e[3] is not None
                                          for e in ws[0]._launcher.direct.values()), "no raw launches on this GPU"
    assert all(e[2] is None for e in ws[1]._launcher.direct.values())
    ref, ref_lse = _ref(x) if not kw else (None, None)
    for (o1, l1), (o2, l2) in zip(*res):
        assert torch.equal(o1, o2) and (l1 is None or torch.equal(l1, l2))
    assert torch.equal(box[0], res[1][0][0]) and (lse_t is None or torch.equal(lse_t, res[1][0][1]))
    if ref is not None:
        assert_close_to_reference(res[0][0][0], ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_bad_block_table_entries_never_fault(backend):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = make_inputs(3, 32, 8, 128, [2000, 700, 33], page_size=16, dtype=torch.float16, device="cuda",
                    generator=gen)
    num_pages = x.k_cache.shape[0]
    bt = x.block_table
    bt[0, 3], bt[1, 0], bt[2, 2] = -1, num_pages, 2**31 - 1
    out = poison(torch.empty_like(x.q))
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, backend=backend, out=out, seq_lens_host=[2000, 700, 33])
    torch.cuda.synchronize()
    ref, _ = _ref(x, bt.clamp(0, num_pages - 1))
    assert_close_to_reference(out, ref, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_plan_misses_with_host_lengths_never_sync(backend):
    """plan() with host lengths for buckets it has not seen (plan-cache misses, new workspaces) synchronizes
    nothing either (Workspace.allocate copies its targets table without blocking), and the wrapper's workspace
    serves each plan with the plan's targets."""

    gen = torch.Generator(device="cuda").manual_seed(7)
    x = make_inputs(2, 32, 8, 128, [20, 20], page_size=16, dtype=torch.float16, device="cuda", capacity=65536,
                    generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False})),
                               backend=backend)
    w.plan(*args, seq_lens_host=[20, 20])
    torch.cuda.synchronize()
    plans = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for lens in ([300, 20], [5000, 4000], [65536, 1], [0, 0]):
            plans.append((w.plan(*args, seq_lens_host=lens), w.workspace))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for plan, ws in plans:
        assert ws.serves(plan, x.q.device) and ws.targets.tolist() == list(plan.schedule.targets)


def test_a_strided_view_cuda_ptx_cannot_read_goes_to_the_next_backend(monkeypatch, gen):
    """cuda_ptx reads q and the caches in 16-byte vectors. A view whose rows are not whole vectors (an fp8 cache in a
    pool of 72-byte rows, a bf16 q sliced from 68-element rows) is passed over at plan() with that reason, and the
    next backend serves it right; forced, cuda_ptx refuses it at plan(), not at run(). Whole rows still go to it."""
    from attnplan import backends as B

    be = _emulated_cuda_ptx()
    be.prepare = lambda plan, device: None  # nothing to compile: the aligned case is only planned
    monkeypatch.setitem(B._instances, "cuda_ptx", be)
    x = make_inputs(1, 8, 2, 64, [40], dtype=torch.bfloat16, generator=gen)
    f8 = torch.float8_e4m3fn

    def pooled(t, pad):  # the same values in a pool of wider rows (unit last stride, the other strides free)
        pool = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)
        view = pool[..., :t.shape[-1]]
        view.copy_(t)
        return view

    k8, v8 = x.k_cache.float().to(f8), x.v_cache.float().to(f8)
    cases = {"k_cache": (x.q, pooled(k8, 8), pooled(v8, 8)), "q": (pooled(x.q, 4), k8, v8)}
    ctx = attnplan.Context.from_config(attnplan.load_config(backends=["cuda_ptx", "triton", "numba", "reference"],
                                                            plan_cache={"disk": False}))
    for name, (q, k, v) in cases.items():
        ref, _ = reference.attention(q, k, v, x.seq_lens, None, k_scale=1.0, v_scale=1.0)
        w = attnplan.DecodeWrapper(ctx)
        w.plan(q, k, v, x.seq_lens, None, k_scale=1.0, v_scale=1.0)
        assert w.backend.name != "cuda_ptx"
        assert any(n == "cuda_ptx" and any(r.startswith(f"{name}: ") for r in why) for n, why in w.skipped), w.skipped
        assert_close_to_reference(w.run(q, k, v, x.seq_lens, None), ref, torch.bfloat16)
        with pytest.raises(attnplan.NoBackendError, match="not a multiple of 16 bytes"):
            attnplan.DecodeWrapper(ctx, backend="cuda_ptx").plan(q, k, v, x.seq_lens, None, k_scale=1.0, v_scale=1.0)
    w = attnplan.DecodeWrapper(ctx)
    w.plan(x.q, k8, v8, x.seq_lens, None, k_scale=1.0, v_scale=1.0)
    assert w.backend.name == "cuda_ptx"


@pytest.mark.parametrize("backend", ["reference", *kernel_backends("cpu")])
def test_buffers_made_under_inference_mode_serve_calls_outside_it(backend, gen):
    """decode() shares its wrappers between threads, and a wrapper's workspace and output buffer outlive the call
    that made them: made under ``torch.inference_mode()``, they must serve a later call under ``no_grad`` (the
    query-block plan writes its workspace's lengths with torch's in-place ops; the reference backend writes every
    buffer so)."""
    x = make_inputs(1, 64, 1, 16, [20], q_len=4, dtype=torch.float16, capacity=24, generator=gen)  # query blocks
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens)
    ctx = attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    ref = reference.attention(*args, None, x.sm_scale)[0]
    got = {}

    def call(mode, key):
        with mode():
            got[key] = attnplan.decode(*args, backend=backend, config=ctx).clone()

    for i, mode in enumerate((torch.inference_mode, torch.no_grad)):  # one thread each, one pooled wrapper
        t = threading.Thread(target=call, args=(mode, i))
        t.start()
        t.join()
    assert set(got) == {0, 1}, "a call raised"
    assert torch.equal(got[0], got[1])
    assert_close_to_reference(got[1], ref, torch.float16)
    w = attnplan.DecodeWrapper(ctx, backend=backend)
    with torch.inference_mode():
        w.plan(*args, seq_lens_host=[20])
    with torch.no_grad():
        assert torch.equal(w.run(*args), got[0])  # the wrapper's own output buffer


def test_a_run_overlapping_a_plan_launches_the_plan_its_check_passed(monkeypatch, gen):
    """A run() (with out given) on the full path while another thread's plan() for inputs of another signature and
    scale completes between its check and its launch: it launches what its check compared the inputs with (one
    snapshot of the last complete plan), not the new plan's binding or scale."""
    from attnplan import api

    x = make_inputs(2, 4, 2, 16, [30, 17], dtype=torch.float32, capacity=32, generator=gen)
    kb = torch.randn(2, 2, 32, 16, generator=gen).transpose(1, 2)  # x.k_cache's shape, other strides
    vb = torch.randn(2, 2, 32, 16, generator=gen).transpose(1, 2)
    ctx = attnplan.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    w = attnplan.DecodeWrapper(ctx, backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, seq_lens_host=[30, 17])
    want = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, out=torch.empty_like(x.q)).clone()
    w._fast = None  # as while a plan() is in progress: run() takes its full path
    fit, paused, resume = api._outputs_fit, threading.Event(), threading.Event()

    def slow_fit(*a):  # right after run()'s signature check
        if threading.current_thread().name == "runner":
            paused.set()
            resume.wait(30)
        return fit(*a)

    monkeypatch.setattr(api, "_outputs_fit", slow_fit)
    out, errors = torch.full_like(x.q, float("nan")), []

    def runner():
        try:
            w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, out=out)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=runner, name="runner")
    t.start()
    assert paused.wait(30)
    w.plan(x.q, kb, vb, x.seq_lens, seq_lens_host=[30, 17], sm_scale=0.5)
    resume.set()
    t.join()
    assert not errors and torch.equal(out, want)


@pytest.mark.parametrize("name", [b for b in kernel_backends("cpu")])
def test_a_fork_while_another_thread_launches_leaves_the_child_a_free_lock(name):
    """The Triton interpreter and the numba simulator run one launch at a time under a process-wide lock. A child
    forked while another thread holds it must not inherit it held (no thread of the child would release it): the
    fork waits for the launch, and parent and child each get the lock free."""
    import multiprocessing

    if name == "triton":
        from attnplan.backends.triton import _INTERPRETER_LOCK as lock
    else:
        from attnplan.backends.numba.kernels import _SIM_LOCK as lock
    held, release = threading.Event(), threading.Event()

    def launcher():  # another thread in the middle of a launch
        with lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=launcher)
    t.start()
    assert held.wait(30)
    threading.Timer(0.3, release.set).start()  # the launch ends while the fork waits for it
    child = multiprocessing.get_context("fork").Process(target=_exit_with_lock_state, args=(lock,))
    child.start()
    child.join(60)
    t.join()
    assert child.exitcode == 0, "the child found the lock held"


def _exit_with_lock_state(lock) -> None:
    import os

    got = lock.acquire(timeout=5)
    os._exit(0 if got else 3)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_runs_result_passed_back_as_q_is_served_after_plan(backend, gen):
    """The wrapper's own output buffer (``run()`` without ``out``) passed back as the next q: ``run()`` refuses it (out
    would overlap q), and ``try_run()`` declines; ``plan()`` with it as q then makes a new buffer, so the run that
    follows is served, equals the reference and leaves that q as it was. Before, plan() kept the buffer, and every
    run() after it refused the overlap with an ``out`` the caller had not passed."""
    x = make_inputs(2, 4, 2, 32, [29, 11], page_size=8, dtype=torch.float32, generator=gen)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    o = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    q2 = o.clone()
    own = r"\(out here is the wrapper's own buffer, which holds the last run\(\)'s result: "
    with pytest.raises(P.OverlapError, match=r"out overlaps q .* " + own + r"plan\(\) with these inputs") as e:
        w.run(o, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert (e.value.output, e.value.other) == ("out", "q")
    # an lse inside that buffer: plan() would keep the buffer (it only replaces one that is q's memory), so no hint
    lse = o.view(-1)[:o.shape[0] * o.shape[1] * o.shape[2]].view(o.shape[:3])
    with pytest.raises(P.OverlapError, match=r"out overlaps lse .* " + own + r"pass out=\)$") as e:
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, lse=lse)
    assert (e.value.output, e.value.other) == ("out", "lse")
    assert w.try_run(o, x.k_cache, x.v_cache, x.seq_lens, x.block_table) is None
    w.plan(o, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    got = w.run(o, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert got.data_ptr() != o.data_ptr() and torch.equal(o, q2)
    ref, _ = reference.attention(q2, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(got, ref, torch.float32)
    assert w.try_run(o, x.k_cache, x.v_cache, x.seq_lens, x.block_table) is got


@pytest.mark.parametrize("backend", ["reference", *kernel_backends("cpu")])
def test_an_own_buffer_changed_in_place_is_refused_before_any_launch(backend, gen):
    """The wrapper's own output buffer, which ``run()`` without ``out`` returns, changed in place by the caller (a view
    op: ``transpose_``, ``squeeze_``, ``set_`` to a smaller storage, ``.data =``): the next ``run()`` raises a
    ValueError naming the own buffer, on the one-pass path and the full one, before any launch (the buffer's bytes stay
    as they were; triton wrote through the new strides, past the allocation, and corrupted the heap), and
    ``try_run()`` declines. A value change in place (``mul_``) is no change of layout: served. ``plan()`` again makes
    a new buffer, which is served and equals the reference."""
    x = make_inputs(4, 4, 2, 32, [60, 7, 0, 33], page_size=16, dtype=torch.float16, generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ref, _ = reference.attention(*args, x.sm_scale)
    w = attnplan.DecodeWrapper(backend=backend)
    w.plan(*args, seq_lens_host=[60, 7, 0, 33])
    half = torch.full((2, 1, 4, 32), 7.0, dtype=torch.float16)
    for change in (lambda o: o.transpose_(1, 2), lambda o: o.squeeze_(1), lambda o: o.set_(half),
                   lambda o: setattr(o, "data", torch.zeros(4, 1, 4, 16, dtype=torch.float16))):
        o = w.run(*args)
        assert o is w.run(*args) and o.mul_(1.0) is w.run(*args)  # served, the same buffer each time
        assert_close_to_reference(o, ref, torch.float16)
        change(o)
        o.fill_(3.0)
        before = o.clone()
        for path in ("fast", "full"):
            if path == "full":
                w._fast = None  # the full path's own check
            with pytest.raises(ValueError, match=r"own output buffer \(returned by an earlier run\(\)\) was changed "
                                                 r"in place: out must be .*plan\(\) again makes a new one"):
                w.run(*args)
            w._fast = w._fast_made
        assert torch.equal(o, before)
        assert w.try_run(*args) is None
        w.plan(*args, seq_lens_host=[60, 7, 0, 33])
        got = w.run(*args)
        assert got is not o
        assert_close_to_reference(got, ref, torch.float16)


def test_a_wrapper_is_neither_copied_nor_pickled_and_its_plan_is(gen):
    """copy.copy, copy.deepcopy and pickle of a DecodeWrapper raise a TypeError that says why (a copy would share the
    workspace, the output buffer and the bound launches; copy.copy did, so two wrappers overwrote each other's
    results; deepcopy and pickle failed on a lock inside the context, in pickle's words); its plan copies and pickles,
    and a new wrapper's use_plan() of the copy (after a plan() of its own) runs it equal to the reference."""
    import copy
    import pickle

    x = make_inputs(2, 4, 2, 32, [29, 11], page_size=8, dtype=torch.float32, generator=gen)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    for f in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="a DecodeWrapper cannot be copied or pickled: a copy would share its "
                                            "workspace"):
            f(w)
    for plan in (copy.deepcopy(w.plan_), pickle.loads(pickle.dumps(w.plan_))):
        assert plan == w.plan_
        w2 = attnplan.DecodeWrapper(backend="reference")
        w2.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=1)  # another plan, replaced
        w2.use_plan(plan)
        assert w2.plan_ == w.plan_
        got = w2.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(got, ref, torch.float32)
