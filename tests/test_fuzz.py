"""Property-based tests (hypothesis).

Part 1: random shapes, lengths, page tables and split counts, each backend against the float64
reference.

Part 2, the hostile-input fuzzer: random bad or unusual inputs to ``attnplan.decode``,
``DecodeWrapper.plan`` / ``run``, ``torch.ops.attnplan.decode``, the plan cache (corrupt plan files in
a temporary cache folder), the YAML config and the command line. Every drawn case must end in one
of two outcomes: a ``ValueError`` / ``TypeError`` / ``ConfigError`` that names the offending argument
(or key) and is raised before any kernel runs (a NaN-poisoned ``out`` / ``lse`` is untouched, the
inputs are bitwise unchanged), or a result equal to the float64 reference within
``attnplan.testing.TOLERANCES``. For decode inputs the test also knows which outcome the input
contract (``attnplan.problem``) prescribes, so an over-eager refusal fails as well as a missed one.

CI runs a fixed, small, seeded budget on the CPU (``reference``, ``triton`` under ``TRITON_INTERPRET=1``,
``numba`` under ``NUMBA_ENABLE_CUDASIM=1``; hypothesis ``derandomize=True``, no example database, so
every run draws the same cases); the whole file takes about a minute of one CPU core. Set
``ATTNPLAN_FUZZ_EXAMPLES`` (part 1) and ``ATTNPLAN_FUZZ_HOSTILE_EXAMPLES`` (part 2) for longer runs,
``ATTNPLAN_FUZZ_RANDOM=1`` for fresh (unseeded) draws of part 2;
the tests marked ``gpu`` run the hostile decode fuzzer on the GPU backends (``cuda_ptx`` included)
with a larger budget.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.problem import dtype_name
from attnplan.state import PartialState, merge_states
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
EXAMPLES = int(os.environ.get("ATTNPLAN_FUZZ_EXAMPLES", "8"))
#: numba-cuda compiles each new specialization for ~5-10 s on a GPU, and almost every drawn problem
#: is a new one: its GPU budget is a quarter of the others' unless set on its own
NUMBA_EXAMPLES = int(os.environ.get("ATTNPLAN_FUZZ_EXAMPLES_NUMBA", str(max(4, EXAMPLES // 4) if HAS_CUDA else EXAMPLES)))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
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


@st.composite
def large_group_problems(draw):
    """GQA groups x q_len beyond one program's rows (64 for numba and cuda_ptx, 128 for triton): the plans go in
    query blocks and head blocks (Falcon-7B's 71 query heads on one KV head among them). On the CPU q_len stops at 3
    (48 x 3 and 71 x 2 rows still pass triton's 128): the interpreter's cost grows with the rows, and
    ``test_query_blocks.py`` checks 16 queries a sequence."""
    p = draw(problems())
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([24, 48, 71, 130]))
    q_len = draw(st.sampled_from([1, 2, 3, 8] if HAS_CUDA else [1, 2, 3]))
    p.update(hq=hkv * group, hkv=hkv, q_len=q_len, d=draw(st.sampled_from([16, 32] if not HAS_CUDA else [64, 128])),
             batch=min(p["batch"], 2), lens=p["lens"][:2])
    return p


FUZZ_GROUPS = settings(FUZZ, max_examples=max(4, EXAMPLES // 2))


@pytest.mark.parametrize("backend", kernel_backends(DEVICE))
@FUZZ_GROUPS
@given(p=large_group_problems())
def test_fuzz_large_gqa_groups_against_reference(backend, p):
    _check(backend, p)
    b, n = get_backend(backend), p["q_len"] * (p["hq"] // p["hkv"])
    if n > b.max_rows_per_program:
        event(f"{backend}: {'head blocks' if p['hq'] // p['hkv'] > b.max_rows_per_program else 'query blocks'}")


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


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
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
    fin = ~torch.isinf(a[1])
    assert torch.allclose(a[1][fin], b[1][fin], atol=1e-12)  # the LSE too, not only which rows are empty
    assert not torch.isnan(a[0]).any() and not torch.isnan(a[1]).any()
    keep = ~mask
    if keep.any():
        c = merge_states(PartialState(o[..., keep, :], lse[..., keep]))
        assert torch.allclose(a[0], c[0], atol=1e-12) and torch.allclose(a[1], c[1])
    else:
        assert torch.all(a[0] == 0) and torch.all(torch.isneginf(a[1]))



# =====================================================================================================
# Part 2: the hostile-input fuzzer
# =====================================================================================================

import json  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

import attnplan.ops  # noqa: E402,F401  (registers torch.ops.attnplan.decode)
from attnplan.api import Context  # noqa: E402
from attnplan.cache import PlanCache  # noqa: E402
from attnplan.config import ConfigError, load_config  # noqa: E402
from attnplan.planner import PLAN_VERSION  # noqa: E402
from attnplan.testing import TOLERANCES  # noqa: E402

def event(what: str) -> None:
    """hypothesis' event statistics (``--hypothesis-show-statistics``), outside a hypothesis test a no-op."""
    if currently_in_test_context():
        _event(what)


HOSTILE_EXAMPLES = int(os.environ.get("ATTNPLAN_FUZZ_HOSTILE_EXAMPLES", "0")) or None
#: ATTNPLAN_FUZZ_RANDOM=1 draws fresh cases each run (exploration; CI keeps the seeded draw)
SEEDED = dict(deadline=None, derandomize=not os.environ.get("ATTNPLAN_FUZZ_RANDOM"), database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def budget(cpu: int, gpu: int | None = None) -> settings:
    """``cpu`` examples on the CPU (``gpu`` on a GPU), or ``$ATTNPLAN_FUZZ_HOSTILE_EXAMPLES``."""
    return settings(max_examples=HOSTILE_EXAMPLES or (gpu or 4 * cpu if HAS_CUDA else cpu), **SEEDED)


FP8 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")
#: the exceptions a refusal may be (ConfigError is a ValueError)
REFUSALS = (ValueError, TypeError)

#: stride mutations: name -> (argument, refused?) ; "refused" ones break a unit-stride rule, the others are free
STRIDES = {
    "seq_lens strided": "seq_lens", "block_table column-major": "block_table", "out last axis strided": "out",
    "lse last axis strided": "lse", "sinks strided": "sinks", "k_scale strided": "k_scale",
    "q head stride": None, "K and V interleaved": None, "K head stride": None, "block_table row stride": None,
    "out leading strides": None, "lse leading strides": None,
}
ALIASES = ["out=q", "out in k_cache", "out in v_cache", "lse in out", "lse in q", "out in block_table"]
#: run() with one input changed after plan(): name -> the argument the refusal must name
RUN_CHANGES = {"k_cache last axis stride 2": "k_cache", "seq_lens int64": "seq_lens", "q misaligned": "q",
               "block_table column-major": "block_table", "v_cache fewer pages": "v_cache",
               "v_cache other dtype": "v_cache", "q from a new buffer": None}


@st.composite
def hostile_decodes(draw, entries=("decode", "wrapper", "run-changed", "op")):
    """One decode call: a small problem, its attention parameters, stride changes, aliasing and the entry point,
    each drawn mostly legal and sometimes hostile."""
    entry = draw(st.sampled_from(entries))
    kind = draw(st.sampled_from(["fp32", "fp16", "fp16", "fp8"])) if entry != "op" else draw(st.sampled_from(["fp32", "fp16"]))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    batch, q_len = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    page = draw(st.sampled_from([None, 4]))
    c = dict(entry=entry, kind=kind, hq=hkv * group, hkv=hkv, batch=batch, q_len=q_len, page=page,
             lens=draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch)),
             splits=draw(st.sampled_from([0, 1, 3])), seed=draw(st.integers(0, 2**16)),
             sm_scale=draw(st.sampled_from([None, None, 0.3, 0.0, -0.5, NAN, INF, -INF])))
    legal_or = lambda legal, hostile: draw(st.sampled_from([legal] * 3 + hostile))  # noqa: E731
    if entry == "op":
        c.update(soft_cap=0.0, window=-1, sinks=None, scales=None, strides=draw(st.sets(st.sampled_from(
            ["seq_lens strided", "block_table column-major", "q head stride", "K and V interleaved",
             "block_table row stride"]), max_size=2)), alias=None)
        return c
    if entry == "run-changed":  # a legal plan and run, then one input changed: the change is the hostile part
        c.update(sm_scale=draw(st.sampled_from([None, 0.3, -0.5])), soft_cap=0.0, window=-1, sinks=None,
                 scales=(0.5, [1.0] * hkv) if kind == "fp8" else None, strides=set(), alias=None,
                 page=4 if draw(st.booleans()) else page,
                 change=draw(st.sampled_from(sorted(RUN_CHANGES))))  # each change is also pinned (PINNED)
        return c
    c["soft_cap"] = legal_or(0.0, [4.0, INF, NAN, -1.0])
    c["window"] = legal_or(-1, [0, 5, 10**9, -2, True, 2.5])
    c["sinks"] = draw(st.sampled_from([None, None, "values"])) and draw(
        st.lists(st.sampled_from([0.0, 1.5, -INF, -INF, NAN, INF]), min_size=c["hq"], max_size=c["hq"]))
    if kind == "fp8":
        scale = st.one_of(st.sampled_from([1.0, 0.5, 2.0, 0.0, -1.0, NAN, INF]),
                          st.lists(st.sampled_from([1.0, 0.5, 0.0, -1.0, NAN, INF]), min_size=hkv, max_size=hkv))
        c["scales"] = (legal_or(0.5, [draw(scale)]), legal_or([1.0] * hkv, [draw(scale)]))
    else:
        c["scales"] = None
    c["strides"] = draw(st.sets(st.sampled_from(sorted(STRIDES)), max_size=2))
    c["alias"] = draw(st.sampled_from([None] * 5 + ALIASES))
    c["change"] = None
    return c


def _with_stride(t, axis):
    """``t``'s values in a view whose ``axis`` has stride 2 (same shape, a new storage)."""
    big = torch.zeros(*t.shape[:axis], 2 * t.shape[axis], *t.shape[axis + 1:], dtype=t.dtype, device=t.device)
    view = big.narrow(axis, 0, 2 * t.shape[axis])[(slice(None),) * axis + (slice(None, None, 2),)]
    view.copy_(t)
    return view


def _build(c, device):
    """The tensors and keyword arguments of case ``c``, and the names the input contract says must be refused
    (empty: the call is legal and must match the reference)."""
    qdt = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float16}[c["kind"]]
    x = make_inputs(c["batch"], c["hq"], c["hkv"], 16, c["lens"], q_len=c["q_len"], page_size=c["page"], dtype=qdt,
                    device=device, generator=torch.Generator().manual_seed(c["seed"]))
    a = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)
    bad: set[str] = set()
    kw: dict = {}
    if c["kind"] == "fp8":
        a["k_cache"], a["v_cache"] = (x.k_cache.float() / 2).to(FP8), (x.v_cache.float() * 2).to(FP8)
        for name, sc in zip(("k_scale", "v_scale"), c["scales"]):
            vals = sc if isinstance(sc, list) else [sc]
            if isinstance(sc, list):
                kw[name] = torch.tensor(sc, dtype=torch.float32, device=device)
            else:
                kw[name] = sc
            if not all(math.isfinite(v) and v > 0 for v in vals):
                bad.add(name)
    if c["sm_scale"] is not None:
        kw["sm_scale"] = c["sm_scale"]
        if not math.isfinite(c["sm_scale"]):
            bad.add("sm_scale")
    if c["soft_cap"]:
        kw["logits_soft_cap"] = c["soft_cap"]
        if not (math.isfinite(c["soft_cap"]) and c["soft_cap"] >= 0):
            bad.add("logits_soft_cap")
    if c["window"] != -1 or isinstance(c["window"], bool):
        kw["window_left"] = c["window"]
        if isinstance(c["window"], bool) or not isinstance(c["window"], int) or c["window"] < -1:
            bad.add("window_left")
    if c["sinks"]:
        kw["sinks"] = torch.tensor(c["sinks"], dtype=torch.float32, device=device)
        if any(math.isnan(v) or v == INF for v in c["sinks"]):
            bad.add("sinks")
    out = torch.full_like(x.q, NAN)
    lse = torch.full(x.q.shape[:3], NAN, dtype=torch.float32, device=device)
    for m in sorted(c["strides"]):
        if m == "seq_lens strided":
            a["seq_lens"] = _with_stride(a["seq_lens"], 0)
        elif m == "block_table column-major" and a["block_table"] is not None:
            a["block_table"] = a["block_table"].t().contiguous().t()
        elif m == "out last axis strided":
            out = _with_stride(out, 3)
        elif m == "lse last axis strided":
            lse = _with_stride(lse, 2)
        elif m == "sinks strided" and "sinks" in kw:
            kw["sinks"] = _with_stride(kw["sinks"], 0)
        elif m == "k_scale strided" and isinstance(kw.get("k_scale"), torch.Tensor):
            kw["k_scale"] = _with_stride(kw["k_scale"], 0)
        elif m == "q head stride":
            a["q"] = _with_stride(a["q"], 2)
        elif m == "K and V interleaved" and a["k_cache"].dtype != FP8:
            kv = torch.stack([a["k_cache"], a["v_cache"]], dim=2)
            a["k_cache"], a["v_cache"] = kv[:, :, 0], kv[:, :, 1]
        elif m == "K head stride":
            a["k_cache"] = _with_stride(a["k_cache"], 2)
        elif m == "block_table row stride" and a["block_table"] is not None:
            a["block_table"] = _with_stride(a["block_table"], 0)
        elif m == "out leading strides":
            out = _with_stride(_with_stride(out, 0), 2)
        elif m == "lse leading strides":
            lse = _with_stride(lse, 1)
    for name, t, axis in (("seq_lens", a["seq_lens"], 0), ("block_table", a["block_table"], 1), ("out", out, 3),
                          ("lse", lse, 2), ("sinks", kw.get("sinks"), 0), ("k_scale", kw.get("k_scale"), 0)):
        if isinstance(t, torch.Tensor) and t.shape[axis] > 1 and t.stride(axis) != 1:
            bad.add(name)
    alias = c["alias"]
    if alias == "out=q":
        out = a["q"]
    elif alias in ("out in k_cache", "out in v_cache") and a["k_cache"].dtype == x.q.dtype:
        t = a["k_cache" if alias == "out in k_cache" else "v_cache"]
        flat = torch.zeros(t.numel() + x.q.numel(), dtype=t.dtype, device=device)
        a["k_cache" if alias == "out in k_cache" else "v_cache"] = flat[: t.numel()].view(t.shape).copy_(t)
        out = flat[t.numel() // 2: t.numel() // 2 + x.q.numel()].view(x.q.shape)
    elif alias == "lse in out" and x.q.dtype == torch.float32 and out.is_contiguous():
        lse = out.view(-1)[: lse.numel()].view(lse.shape)
    elif alias == "lse in q" and x.q.dtype == torch.float32 and a["q"].is_contiguous():
        lse = a["q"].view(-1)[: lse.numel()].view(lse.shape)
    elif alias == "out in block_table" and a["block_table"] is not None:
        bt = a["block_table"]
        flat = torch.zeros(bt.numel() + 2 * x.q.numel(), dtype=torch.int32, device=device)
        a["block_table"] = flat[: bt.numel()].view(bt.shape).copy_(bt)
        out = flat.view(x.q.dtype)[: x.q.numel()].view(x.q.shape)
    else:
        alias = None
    if alias is not None:
        bad |= {"out", "lse"}  # the message names the output and what it overlaps
    return a, kw, out, lse, bad


def _bits(t):
    """The bytes of ``t``'s elements in order (a fresh CPU copy: NaN compares equal to itself)."""
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1)).view(torch.uint8)


def _refused_correctly(err: Exception, names: set[str], out, lse, before: dict, a: dict) -> None:
    msg = str(err)
    assert any(n in msg for n in names), f"refusal does not name any of {sorted(names)}: {msg}"
    for name, t in a.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(_bits(t), before[name]), f"{name} changed before the refusal"
    for name, t in (("out", out), ("lse", lse)):
        shared = any(t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for v in a.values()
                     if isinstance(v, torch.Tensor)) if isinstance(t, torch.Tensor) else True
        if not shared:  # an output carved from an input was checked with the inputs above
            assert torch.isnan(t.float()).all(), f"{name} was written before the refusal"


def _matches_reference(a, kw, out, lse, dtype):
    rkw = dict(window_left=kw.get("window_left", -1), soft_cap=kw.get("logits_soft_cap", 0.0), sinks=kw.get("sinks"),
               k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"))
    ref, ref_lse = reference.attention(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"],
                                       kw.get("sm_scale"), **rkw)
    assert_close_to_reference(out, ref, dtype)
    if lse is not None:
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")


def _supported(backend, a, kw) -> bool:
    from attnplan.problem import validate_inputs

    try:
        static = validate_inputs(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"],
                                 window_left=kw.get("window_left", -1), soft_cap=kw.get("logits_soft_cap", 0.0),
                                 sinks=kw.get("sinks"), k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"))
    except REFUSALS:
        return True  # refused by validation: the call must refuse too
    return not get_backend(backend).supports(attnplan.DecodeProblem(max_kv_len=1, **static))


def check_hostile_decode(backend: str, c: dict, device: str) -> None:
    a, kw, out, lse, bad = _build(c, device)
    if not _supported(backend, a, kw):
        event("not served by the backend")
        return
    before = {n: _bits(t) for n, t in a.items() if isinstance(t, torch.Tensor)}
    entry, dtype = c["entry"], a["q"].dtype
    if entry == "op":
        return _check_op(backend, c, a, bad, before)
    ctx = Context(load_config(), PlanCache(disk=False))
    if entry == "decode":
        call = lambda: attnplan.decode(**a, **kw, out=out, lse=lse, backend=backend,  # noqa: E731
                                       num_splits=c["splits"], config=ctx)
    else:
        w = attnplan.DecodeWrapper(ctx, backend=backend)
        plan_kw = {k: v for k, v in kw.items()}

        def call():
            w.plan(**a, **plan_kw, num_splits=c["splits"])
            return w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"], out=out, lse=lse)
    if bad:
        event(f"{entry}: refused")
        with pytest.raises(REFUSALS) as e:
            call()
        _refused_correctly(e.value, bad, out, lse, before, a)
        return
    event(f"{entry}: computed")
    call()
    _matches_reference(a, kw, out, lse, dtype)
    if entry == "run-changed":
        _check_run_change(w, c, a, kw, device, dtype)


def _check_run_change(w, c, a, kw, device, dtype):
    """After a legal plan and run, run() with one input changed: refused by name unless only its data moved."""
    change = c["change"]
    b = dict(a)
    if change == "k_cache last axis stride 2":
        b["k_cache"] = _with_stride(a["k_cache"], 3)
    elif change == "seq_lens int64":
        b["seq_lens"] = a["seq_lens"].long()
    elif change == "q misaligned":
        flat = torch.zeros(a["q"].numel() + 1, dtype=a["q"].dtype, device=device)
        b["q"] = flat[1:].view(a["q"].shape).copy_(a["q"])
    elif change == "block_table column-major" and a["block_table"] is not None:
        b["block_table"] = a["block_table"].t().contiguous().t()
    elif change == "v_cache fewer pages":
        b["v_cache"] = a["v_cache"][:-1]
    elif change == "v_cache other dtype":
        b["v_cache"] = a["v_cache"].to(torch.bfloat16 if a["v_cache"].dtype != torch.bfloat16 else torch.float16)
    elif change == "q from a new buffer":
        b["q"] = torch.empty_strided(a["q"].shape, a["q"].stride(), dtype=a["q"].dtype, device=device).copy_(a["q"])
    sig = lambda d: w._signature(d["q"], d["k_cache"], d["v_cache"], d["seq_lens"], d["block_table"])  # noqa: E731
    out = torch.full_like(a["q"], NAN)
    if sig(b) != sig(a):
        before = {n: _bits(t) for n, t in b.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(ValueError, match="call plan") as e:
            w.run(b["q"], b["k_cache"], b["v_cache"], b["seq_lens"], b["block_table"], out=out)
        _refused_correctly(e.value, {RUN_CHANGES[change] or "q"}, out, None, before, b)
    else:
        w.run(b["q"], b["k_cache"], b["v_cache"], b["seq_lens"], b["block_table"], out=out)
        _matches_reference(b, kw, out, None, dtype)


def _check_op(backend, c, a, bad, before):
    scale = c["sm_scale"]  # None: 1/sqrt(head_dim); every finite float is the scale (0 and negative too)
    if scale is not None and not math.isfinite(scale):
        bad = bad | {"sm_scale"}
    attnplan.ops.clear_op_plans()
    call = lambda: torch.ops.attnplan.decode(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"],  # noqa: E731
                                             a["block_table"], scale, backend)
    if a["q"].is_cuda and not get_backend(backend).graph_safe and not bad:
        # the op plans for the capacity (graph replay) on a GPU: a backend that cannot run under capture is refused
        event("op: backend not graph-safe, refused")
        with pytest.raises(attnplan.NoBackendError, match="not graph-safe"):
            call()
        return
    if bad:
        event("op: refused")
        with pytest.raises(REFUSALS) as e:
            call()
        _refused_correctly(e.value, bad, None, None, before, a)
        return
    event("op: computed")
    out = call()
    _matches_reference(a, {"sm_scale": scale}, out, None, a["q"].dtype)
    out = call()  # the cached plan, no validation: the same answer
    _matches_reference(a, {"sm_scale": scale}, out, None, a["q"].dtype)


HOSTILE_CPU_BACKENDS = ["reference", *kernel_backends("cpu")] if not HAS_CUDA else []
#: the pinned examples run everywhere (on a GPU without numba: its compile per specialization takes seconds)
REGRESSION_BACKENDS = ["reference", *[b for b in kernel_backends(DEVICE) if not (HAS_CUDA and b == "numba")]]


@pytest.mark.parametrize("backend", HOSTILE_CPU_BACKENDS)
@budget(cpu=40)
@given(c=hostile_decodes())
def test_fuzz_hostile_decode_inputs(backend, c):
    """Strides, non-finite parameters, aliasing and run()-after-plan() changes on decode / plan+run / the op."""
    check_hostile_decode(backend, c, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda_ptx", "reference"])
@budget(cpu=30, gpu=80)
@given(c=hostile_decodes())
def test_fuzz_hostile_decode_inputs_gpu(backend, c):
    """The same fuzzer on the GPU backends (cuda_ptx runs only there); NVRTC / Triton compile each new
    specialization once (a few seconds), most drawn cases are refused before any compile."""
    if not get_backend(backend).available(torch.device("cuda"))[0]:
        pytest.skip(f"{backend} is not available")
    check_hostile_decode(backend, c, "cuda")


@pytest.mark.gpu
@budget(cpu=10, gpu=15)
@given(c=hostile_decodes())
def test_fuzz_hostile_decode_inputs_gpu_numba(c):
    """numba-cuda compiles each new specialization for ~5-10 s on a GPU: a smaller budget."""
    if not get_backend("numba").available(torch.device("cuda"))[0]:
        pytest.skip("numba is not available")
    check_hostile_decode("numba", c, "cuda")


# -- regression: each example of the report, pinned ---------------------------------------------------------

def _pinned(**kw):
    base = dict(entry="decode", kind="fp32", hq=4, hkv=2, batch=2, q_len=1, page=4, lens=[13, 7], splits=0, seed=1,
                sm_scale=None, soft_cap=0.0, window=-1, sinks=None, scales=None, strides=set(), alias=None, change=None)
    return {**base, **kw}


PINNED = {
    "seq_lens [::2]": _pinned(strides={"seq_lens strided"}),
    "column-major block table": _pinned(strides={"block_table column-major"}),
    "strided out": _pinned(strides={"out last axis strided"}),
    "strided lse": _pinned(strides={"lse last axis strided"}),
    "strided sinks": _pinned(sinks=[0.0, 1.0, -INF, 2.0], strides={"sinks strided"}),
    "strided k_scale": _pinned(kind="fp8", scales=([1.0, 0.5], 1.0), strides={"k_scale strided"}),
    "run K stride 2": _pinned(entry="run-changed", change="k_cache last axis stride 2"),
    "run q misaligned": _pinned(entry="run-changed", change="q misaligned"),
    "run V other dtype": _pinned(entry="run-changed", change="v_cache other dtype"),
    "run V fewer pages": _pinned(entry="run-changed", change="v_cache fewer pages"),
    "run seq_lens int64": _pinned(entry="run-changed", change="seq_lens int64"),
    "run block table column-major": _pinned(entry="run-changed", change="block_table column-major"),
    "run q new buffer": _pinned(entry="run-changed", change="q from a new buffer"),
    "soft cap inf": _pinned(soft_cap=INF), "soft cap nan": _pinned(soft_cap=NAN), "soft cap -1": _pinned(soft_cap=-1.0),
    "sm_scale nan": _pinned(sm_scale=NAN), "sm_scale inf": _pinned(sm_scale=INF),
    "sm_scale 0": _pinned(sm_scale=0.0), "sm_scale negative": _pinned(sm_scale=-0.5),
    "fp8 scale nan": _pinned(kind="fp8", scales=(NAN, 1.0)), "fp8 scale 0": _pinned(kind="fp8", scales=(1.0, 0.0)),
    "fp8 scale -1 tensor": _pinned(kind="fp8", scales=([1.0, -1.0], 1.0)),
    "fp8 scale inf tensor": _pinned(kind="fp8", scales=(1.0, [INF, 1.0])),
    "sinks nan": _pinned(sinks=[0.0, NAN, 0.0, 0.0]), "sinks +inf": _pinned(sinks=[0.0, 0.0, INF, 0.0]),
    "sinks -inf": _pinned(sinks=[-INF, -INF, 0.5, -INF]),
    "window True": _pinned(window=True), "window 2.5": _pinned(window=2.5), "window -2": _pinned(window=-2),
    "window huge": _pinned(window=10**9),
    "out=q single pass": _pinned(splits=1, alias="out=q"),
    "lse in out": _pinned(alias="lse in out"), "out in k_cache": _pinned(alias="out in k_cache"),
    "op strided seq_lens": _pinned(entry="op", strides={"seq_lens strided"}),
    "op nan scale": _pinned(entry="op", sm_scale=NAN),
}


@pytest.mark.parametrize("backend", REGRESSION_BACKENDS)
@pytest.mark.parametrize("name", sorted(PINNED))
def test_hostile_decode_regressions(backend, name):
    check_hostile_decode(backend, PINNED[name], DEVICE)


@pytest.mark.parametrize("backend", REGRESSION_BACKENDS)
@pytest.mark.parametrize("change", ["v_cache other dtype", "v_cache fewer pages"])
def test_op_regressions_after_a_valid_call(backend, change):
    """After a valid first call of the op, a bf16 V returned inf and a V with fewer pages read out of bounds."""
    a, *_ = _build(_pinned(), DEVICE)
    attnplan.ops.clear_op_plans()
    torch.ops.attnplan.decode(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"], None, backend)
    v = a["v_cache"].to(torch.bfloat16) if change == "v_cache other dtype" else a["v_cache"][:-1]
    with pytest.raises(REFUSALS, match="v_cache"):
        torch.ops.attnplan.decode(a["q"], a["k_cache"], v, a["seq_lens"], a["block_table"], None, backend)


# -- the plan cache: corrupt or hostile plan files in a temporary cache folder --------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**40, -2**40, 17, 1024]),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)


@st.composite
def plan_file_edits(draw):
    """An edit of a valid plan file: replace the whole text, or set / delete one field (top level, plan, the
    plan's problem, schedule or kernel options) to any JSON value."""
    kind = draw(st.sampled_from(["bytes", "json", "set", "set", "set", "delete"]))
    if kind == "bytes":
        return ("bytes", draw(st.binary(max_size=40)))
    if kind == "json":
        return ("json", draw(json_values))
    where = draw(st.sampled_from(["top", "plan", "plan", "problem", "schedule", "schedule", "kernel"]))
    return (kind, where, draw(st.integers(0, 63)), draw(json_values))


def _apply_edit(text: str, edit) -> bytes:
    if edit[0] == "bytes":
        return edit[1]
    if edit[0] == "json":
        return json.dumps(edit[1]).encode()
    kind, where, pick, value = edit
    data = json.loads(text)
    plan = data["plan"]
    d = {"top": data, "plan": plan, "problem": plan["problem"], "schedule": plan["schedule"],
         "kernel": plan["kernel"]}[where]
    key = sorted(d)[pick % len(d)]
    if kind == "delete":
        del d[key]
    else:
        d[key] = value
    return json.dumps(data).encode()


def check_plan_file_edit(tmp_path: Path, backend: str, edit) -> None:
    device = "cpu" if backend == "reference" else DEVICE
    x = make_inputs(2, 2, 1, 16, [21, 6], page_size=4, dtype=torch.float32, device=device,
                    generator=torch.Generator().manual_seed(7))
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    cfg = load_config(plan_cache={"dir": str(tmp_path)})
    run = lambda: attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend,  # noqa: E731
                                  num_splits=2, config=Context.from_config(cfg), out=out, lse=lse)
    out, lse = torch.full_like(x.q, NAN), torch.full(x.q.shape[:3], NAN, device=device)
    run()
    (f,) = list((tmp_path / f"v{PLAN_VERSION}").glob("*.json"))
    f.write_bytes(_apply_edit(f.read_text(), edit))
    out, lse = torch.full_like(x.q, NAN), torch.full(x.q.shape[:3], NAN, device=device)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run()  # never an exception...
    assert_close_to_reference(out, ref, torch.float32)  # ...and never a wrong answer
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    PlanCache(tmp_path).clear()


@budget(cpu=15)
@given(edit=plan_file_edits())
def test_fuzz_hostile_plan_files(tmp_path_factory, edit):
    check_plan_file_edit(tmp_path_factory.mktemp("plans"), "reference", edit)


@pytest.mark.skipif(not kernel_backends(DEVICE), reason="no kernel backend here")
@budget(cpu=6)
@given(edit=plan_file_edits())
def test_fuzz_hostile_plan_files_kernel(tmp_path_factory, edit):
    """The same on a kernel backend, whose launch grid and tiles come from the plan file."""
    check_plan_file_edit(tmp_path_factory.mktemp("plans"), kernel_backends(DEVICE)[0], edit)


# -- the config: hostile YAML ----------------------------------------------------------------------------

REAL_KEYS = {
    None: ["version", "backends", "backends_fp8_kv", "backends_by_arch", "deterministic", "split", "cost_model",
           "plan_cache", "backend_options"],
    "split": ["partition", "merge", "num_splits", "max_splits", "min_chunk_tokens"],
    "cost_model": ["launch_us", "program_us", "programs_per_sm", "paged_programs_per_sm", "sat_programs_per_sm",
                   "paged_sat_programs_per_sm", "bandwidth_fraction", "mem_bandwidth_gbs", "merge_split_latency_us",
                   "tail_target_scale", "tail_programs_per_sm", "tail_min_unit_tokens"],
    "plan_cache": ["enabled", "disk", "memory_entries"],
    "backend_options": ["triton", "numba", "cuda_ptx", "reference"],
    "options": ["block_n", "num_warps", "num_stages", "threads", "lanes", "unroll", "mma", "pdl", "passes", "block_dv"],
}
yaml_scalars = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 16, 17, 32, 64, 100, 128, 1024, 10**9, -1, 0.5, 2.0, 1e-300, 1e400, -1e400,
                     float("nan"), True, False, None, "", "4", "auto", "split_k", "split_v", "separate", "fused",
                     "atomic", "triton", "numba", "cuda_ptx", "reference", "cudnn"]),
    st.text(max_size=6))


@st.composite
def yaml_documents(draw, depth=0, section=None):
    """A mapping shaped like a config (real keys mostly, junk sometimes) with hostile values."""
    keys = REAL_KEYS["options" if section in ("triton", "numba", "cuda_ptx", "reference") else section]
    n = draw(st.integers(0, 3))
    doc = {}
    for _ in range(n):
        key = draw(st.sampled_from(keys)) if draw(st.integers(0, 5)) else draw(st.text(max_size=5))
        sub = key in REAL_KEYS or key in REAL_KEYS["backend_options"]
        if depth < 2 and sub and draw(st.integers(0, 3)):
            doc[key] = draw(yaml_documents(depth=depth + 1, section=key))
        elif key in ("backends", "backends_fp8_kv"):
            doc[key] = draw(st.lists(st.one_of(yaml_scalars, st.lists(yaml_scalars, max_size=2)), max_size=5))
        else:
            doc[key] = draw(st.one_of(yaml_scalars, st.lists(yaml_scalars, max_size=3)))
    return doc


HOSTILE_TEXTS = [
    "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join(["*" + chr(97 + i)] * 9) + "]\n" for i in range(8)),
    "split: " + "[" * 3000 + "]" * 3000, "split:\n\tnum_splits: 2", "- 1\n- 2", "null", "'text'", "a: \x00",
    "? [a]\n: 1", "split: {num_splits: 2", "backend_options: &o {triton: *o}",
]


@st.composite
def config_files(draw):
    kind = draw(st.sampled_from(["doc", "doc", "doc", "text", "bytes"]))
    if kind == "doc":
        return yaml.safe_dump(draw(yaml_documents()), allow_unicode=True).encode()
    if kind == "text":
        return draw(st.sampled_from(HOSTILE_TEXTS)).encode()
    return draw(st.binary(max_size=60))


@budget(cpu=60)
@given(text=config_files())
def test_fuzz_hostile_config(tmp_path_factory, text):
    """A config file loads into a Config that plans and computes correctly, or is a ConfigError naming the file,
    quickly and briefly; never another exception."""
    import time

    f = tmp_path_factory.mktemp("cfg") / "c.yaml"
    f.write_bytes(text)
    t = time.perf_counter()
    try:
        cfg = load_config(f)
    except ConfigError as e:
        event("ConfigError: " + str(e).splitlines()[0].split(": ")[0][:40].replace(str(f), "FILE"))
        assert str(f) in str(e) and len(str(e)) < 4000
        assert time.perf_counter() - t < 5.0
        return
    assert time.perf_counter() - t < 5.0
    event("loaded")
    ctx = Context(cfg, PlanCache(disk=False))
    x = make_inputs(1, 4, 2, 16, [23], page_size=4, dtype=torch.float32)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for backend in ("reference", *[b for b in kernel_backends("cpu") if b in cfg.backends][:1]):
        try:
            out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend, config=ctx)
        except ValueError as e:  # options that do not fit this problem's kernel: named
            assert "backend_options" in str(e) or "option" in str(e), str(e)
            continue
        assert_close_to_reference(out, ref, torch.float32)


# -- the command line: hostile arguments --------------------------------------------------------------------

CLI_VALUES = st.sampled_from(["0", "-1", "1", "2", "3", "17", "x", "", "1e3", "2.5", "16", "4096", "-16", "3,4",
                              "0,0", "5,", ",", "99999999999999999999"])
CLI_OPTIONS = ["--batch", "--kv-lens", "--max-kv", "--q-len", "--page-size", "--num-splits", "--seed", "--iters",
               "--check-seqs", "--backend", "--dtype", "--model"]


@st.composite
def cli_argvs(draw):
    argv = ["run"]
    for opt in draw(st.lists(st.sampled_from(CLI_OPTIONS), max_size=3, unique=True)):
        argv += [opt, draw(CLI_VALUES)]
    if draw(st.integers(0, 3)):
        argv.append("--explain")  # most cases stop after planning (fast); the others compute a small problem
    return argv


@budget(cpu=25)
@given(argv=cli_argvs())
def test_fuzz_hostile_cli(argv):
    """Every bad argument is argparse's usage error (exit 2) or a one-line ``attnplan: error:`` (exit 2); good ones
    run (small sizes: the values are at most 4096 tokens, or refused)."""
    import contextlib
    import io

    from attnplan import cli

    big = {"4096", "99999999999999999999"}
    if any(a in big for a in argv) and "--explain" not in argv:
        argv = [*argv, "--explain"]  # no CPU computing of a GPU-sized problem in CI
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(argv + ["--backend", "reference"] if "--backend" not in argv else argv)
        except SystemExit as e:
            rc = e.code
            assert rc == 2 and "usage:" in err.getvalue(), err.getvalue()
    assert "Traceback" not in err.getvalue()
    event(f"exit status {rc}" + (" (usage)" if "usage:" in err.getvalue() else ""))
    assert rc in (0, 1, 2), (argv, rc, err.getvalue())
    if rc == 2 and "usage:" not in err.getvalue():
        assert err.getvalue().startswith("attnplan: error: "), err.getvalue()
