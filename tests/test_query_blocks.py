"""Query blocks: a GQA group x q_len larger than one program holds is served in several launches of whole queries
(``SplitPlan.q_block``), on every backend, against the float64 reference.

The launch of queries ``[i0, i1)`` is the problem with ``q_len = i1 - i0`` and lengths ``max(0, L - (q_len - i1))``:
query ``i`` then sees exactly the positions it sees in the whole problem (``< L - q_len + i + 1``, and the window's
lower bound). The cases cover blocks that divide ``q_len`` and one that does not, lengths shorter than ``q_len``
(the clamp) and 0, the variants (window, soft-cap, sinks), both merges and a capacity plan reused at other lengths.
Outputs and the workspace start poisoned (NaN, -7), so an unwritten or leaked row shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.api import Context, plan_problem
from attnplan.backends import DecodeInputs, get_backend
from attnplan.config import load_config
from attnplan.device import DeviceInfo
from attnplan.planner import SplitPlan
from attnplan.problem import DecodeProblem
from attnplan.testing import assert_close_to_reference, make_inputs, poison, poisoned_workspace, problem_of

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
CPU = torch.device("cpu")


def _problem(hq, hkv, q_len, dtype="bfloat16", kv_dtype=None, **kw) -> DecodeProblem:
    return DecodeProblem(2, hq, hkv, 64, q_len, 16, dtype, kv_dtype or dtype, 256, 512, capacity=256, **kw)


# -- the plan ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_len, want_blocks", [(16, ((0, 8), (8, 16))), (15, ((0, 8), (8, 15))), (8, ((0, 8),))])
def test_plan_splits_queries_into_launches(q_len, want_blocks):
    """numba holds 64 rows per program: group 8 gets 8 queries per launch; the launches' plans are the problem at
    their q_len, the workspace the whole problem's, with one meta / counter table per launch."""
    be = get_backend("numba")
    prob = _problem(64, 8, q_len)
    assert be.supports(prob) == [] and be.q_block(prob) == min(q_len, 8)
    plan = plan_problem(prob, be, CPU, Context.from_config(load_config()), num_splits=3)
    assert plan.q_blocks == want_blocks and plan.q_block == (0 if q_len == 8 else 8)
    n = len(want_blocks)
    assert [(la.i0, la.i1) for la in plan.launches] == list(want_blocks)
    for i0, i1, h0, h1, k0, k1, one in plan.launches:
        assert (h0, h1, k0, k1) == (0, 64, 0, 8) and plan.head_block == 0
        assert one.problem == dataclasses.replace(plan.problem, q_len=i1 - i0) and one.q_block == 0
        assert one.schedule == plan.schedule and one.kernel == plan.kernel
    assert plan.meta_words == 2 * prob.batch * n and plan.lens_words == prob.batch * (n - 1)
    assert plan.workspace_bytes == (plan.state_slots * q_len * 64 * 65 + plan.meta_words + plan.lens_words + 64) * 4 \
        or plan.merge != "separate"
    again = SplitPlan.from_dict(plan.to_dict())
    assert again == plan and again.q_blocks == plan.q_blocks
    if n > 1:
        assert f"queries in {n} launches of up to 8" in plan.explain()


def test_explain_of_several_launches_gives_the_cost_model_per_launch():
    """The cost model's candidate times are one launch's; the plan's prediction is the step's, every launch (a
    device without a split table: the cost model plans)."""
    gpu = DeviceInfo("Test GPU without a table", 132, (9, 0), 227 * 1024, 60 * 2**20, 4800.0, "cuda-13.0")
    ctx = Context.from_config(load_config(plan_cache={"disk": False}))
    for hq, hkv, q_len in ((160, 1, 1), (64, 4, 16)):  # head blocks, query blocks
        prob = DecodeProblem(8, hq, hkv, 128, q_len, 16, "bfloat16", "bfloat16", 4096, 4096 + 16)
        plan = plan_problem(prob, get_backend("triton"), CPU, ctx, dev_info=gpu)
        n = len(plan.launches)
        assert n == 2 and plan.candidates
        assert f"(splits: chunk tokens, predicted us of one launch; {n} launches per step)" in plan.explain()
        best = min(t for _, _, t in plan.candidates)
        chosen = min((s, t) for s, _, t in plan.candidates if t <= 1.02 * best)[1]  # the fewest splits within 2%
        assert plan.predicted_us == pytest.approx(n * chosen, rel=1e-3)


def test_plan_q_block_is_checked():
    be = get_backend("numba")
    plan = plan_problem(_problem(64, 8, 16), be, CPU, Context.from_config(load_config()), num_splits=2)
    for bad in (16, 17, -1):
        with pytest.raises(ValueError, match="q_block"):
            dataclasses.replace(plan, q_block=bad).validate()
    for bad in (True, 2.0):  # not an int: the field's type
        with pytest.raises(TypeError, match="plan q_block must be an int"):
            dataclasses.replace(plan, q_block=bad).validate()
    d = plan.to_dict()
    d.pop("q_block")
    with pytest.raises(KeyError, match="q_block"):
        SplitPlan.from_dict(d)


@pytest.mark.parametrize("name", ["triton", "numba", "cuda_ptx"])
def test_group_larger_than_a_program_goes_in_head_blocks(name):
    """A GQA group that alone exceeds the rows of one program is served in blocks of its query heads, as even as
    whole heads allow, one query per launch; a group that fits keeps whole groups."""
    be = get_backend(name)
    most = be.max_rows_per_program
    for hq, q_len, hb, passes in ((2 * most, 1, most, 2), (most + 1, 3, most // 2 + 1, 6), (3 * most - 1, 2, most, 6)):
        prob = _problem(hq, 1, q_len)
        assert be.supports(prob) == []
        assert (be.head_block(prob), be.q_block(prob), be.kv_passes(prob)) == (hb, 1, passes)
    fits = _problem(most, 1, 2)
    assert be.supports(fits) == [] and (be.head_block(fits), be.q_block(fits), be.kv_passes(fits)) == (0, 1, 2)


def test_plan_splits_a_gqa_group_into_head_blocks():
    """numba holds 64 rows: GQA group 72 over 2 KV heads at q_len 2 goes in 2 (queries) x 2 (KV heads) x 2 (blocks
    of 36 heads) launches, in that order, each the problem of its slice; one meta / counter table per launch."""
    be = get_backend("numba")
    prob = _problem(144, 2, 2)
    for merge in ("separate", "fused"):
        plan = plan_problem(prob, be, CPU, Context.from_config(load_config(split={"merge": merge})), num_splits=3)
        assert (plan.q_block, plan.head_block, plan.head_blocks) == (1, 36, ((0, 36), (36, 72)))
        want = [(i, i + 1, k * 72 + g, k * 72 + g + 36, k, k + 1) for i in range(2) for k in range(2) for g in (0, 36)]
        assert [tuple(la[:6]) for la in plan.launches] == want and plan.multi_launch
        for la in plan.launches:
            assert la.plan.problem == dataclasses.replace(prob, q_len=1, num_q_heads=36, num_kv_heads=1)
            assert (la.plan.q_block, la.plan.head_block, la.plan.schedule) == (0, 0, plan.schedule)
        assert plan.launch_problem.num_q_heads == 36 and plan.grid == (plan.schedule.max_units,)  # a launch's
        n = len(want)
        assert plan.meta_words == (2 * prob.batch * n if plan.merge == "separate" else 0)
        # the fused counters of each of the n launches: its (sequence, KV head) pairs (one KV head), then one per
        # unit slot (the two-level merge's team counters)
        assert plan.sync_words == ((prob.batch + plan.schedule.max_units) * n if plan.merge == "fused" else 0)
        assert plan.lens_words == prob.batch
        assert SplitPlan.from_dict(plan.to_dict()) == plan
        assert f"{n} launches, one per query, KV head and block of up to 36" in plan.explain()
        assert "pairs: 2 per launch (one program per head block and unit)" in plan.explain()
    odd = plan_problem(_problem(71, 1, 1), be, CPU, Context.from_config(load_config()), num_splits=2)
    assert (odd.q_block, odd.head_block) == (0, 36)
    assert [(la.h0, la.h1, la.plan.problem.num_q_heads) for la in odd.launches] == [(0, 36, 36), (36, 71, 35)]
    assert odd.launches[0].plan.kernel == odd.launches[1].plan.kernel


def test_plan_head_block_is_checked():
    be = get_backend("numba")
    plan = plan_problem(_problem(144, 2, 2), be, CPU, Context.from_config(load_config()), num_splits=2)
    for bad in (72, 73, -1):
        with pytest.raises(ValueError, match="head_block"):
            dataclasses.replace(plan, head_block=bad).validate()
    for bad in (True, 2.0):  # not an int: the field's type
        with pytest.raises(TypeError, match="plan head_block must be an int"):
            dataclasses.replace(plan, head_block=bad).validate()
    for q_block in (2, 0):  # several queries in one launch of a head block: refused
        with pytest.raises(ValueError, match="one query at a time"):
            dataclasses.replace(plan, problem=dataclasses.replace(plan.problem, q_len=4), q_block=q_block).validate()
    # make_plan launches a head block's queries one at a time, whatever q_block it is given
    from attnplan.planner import make_plan
    from attnplan.device import device_info
    one = plan.launch_problem
    for asked in (0, 2):
        made = make_plan(plan.problem, device_info(CPU), load_config(), "numba", plan.kernel, q_block=asked,
                         head_block=36, num_splits=2)
        assert (made.q_block, made.head_block, made.launch_problem) == (1, 36, one)
    d = plan.to_dict()
    d.pop("head_block")
    with pytest.raises(KeyError, match="head_block"):
        SplitPlan.from_dict(d)


# -- the kernels ---------------------------------------------------------------------------------------------

#: (backend, heads, q_len, lens, variants, splits): the backend's rows per program exceeded 2x (or 2x with a shorter
#: last block); lengths below q_len (3) and 0 exercise the clamp
CASES = [
    ("triton", (16, 1), 16, (40, 3, 0), {}, 3),
    ("triton", (32, 2), 15, (37, 15), dict(window_left=9, soft_cap=20.0, sinks=True), 0),
    ("numba", (8, 1), 16, (40, 3, 0), {}, 3),
    ("numba", (16, 2), 15, (37, 15), dict(window_left=9, soft_cap=20.0, sinks=True), 2),  # launches over 2 KV heads
]


def _inputs(heads, q_len, lens, variants, dtype=torch.float16, seed=0, capacity=None, device=DEVICE) -> DecodeInputs:
    """Seeded inputs on ``device`` (the test machine's: the kernel backends run CPU tensors only in the interpreter
    and the simulator; the cuda_ptx host emulation takes ``CPU``)."""
    g = torch.Generator().manual_seed(seed)
    x = make_inputs(len(lens), heads[0], heads[1], 32, list(lens), q_len=q_len, page_size=16, dtype=dtype,
                    generator=g, capacity=capacity, device=device)
    sinks = (torch.randn(heads[0], generator=g) * 2).float().to(device) if variants.get("sinks") else None
    return dataclasses.replace(x, window_left=variants.get("window_left", -1),
                               soft_cap=variants.get("soft_cap", 0.0), sinks=sinks)


def _reference(x: DecodeInputs):
    return reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                               window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks)


def _check(out, lse, x):
    ref, ref_lse = _reference(x)
    assert_close_to_reference(out, ref, x.q.dtype)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


#: CASES in the full tier: numba's plain case (query blocks of a plain problem on numba, lengths below q_len and 0:
#: MORE's numba-g9-q16-plain, three launches; separate-merge reruns bitwise: numba's variants case on a GPU)
FULL_CASES = {("numba", (8, 1), 16)}


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("name, heads, q_len, lens, variants, splits",
                         [pytest.param(*c, id=f"{c[0]}-g{c[1][0] // c[1][1]}-q{c[2]}" + "-variants" * bool(c[4]),
                                       marks=pytest.mark.full if c[:3] in FULL_CASES else ()) for c in CASES])
def test_query_blocks_match_reference(name, heads, q_len, lens, variants, splits, merge):
    if name not in kernel_backends(DEVICE):
        pytest.skip(f"{name} unavailable on {DEVICE}")
    be = get_backend(name)
    if merge not in be.merge_strategies:
        pytest.skip(f"{name} has no {merge} merge")
    x = _inputs(heads, q_len, lens, variants)
    x = dataclasses.replace(x, **{f: getattr(x, f).to(DEVICE) for f in ("q", "k_cache", "v_cache", "seq_lens",
                                                                          "block_table")},
                            sinks=None if x.sinks is None else x.sinks.to(DEVICE))
    w = attnplan.DecodeWrapper(load_config(split={"merge": merge}), backend=name)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=splits,
                  window_left=x.window_left, logits_soft_cap=x.soft_cap, sinks=x.sinks)
    assert plan.q_block and len(plan.q_blocks) == 2, plan.q_blocks
    outs = []
    # reruns are bitwise identical (fixed merge order, per-launch tables); numba in the CPU simulator runs once (its
    # reruns, bitwise under thread switches, are test_numba_backend's; the per-launch tables rerun on triton here)
    for _ in range(1 if name == "numba" and DEVICE == "cpu" else 2):
        out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=DEVICE))
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        _check(out.cpu(), lse.cpu(), dataclasses.replace(x, **{f: getattr(x, f).cpu() for f in (
            "q", "k_cache", "v_cache", "seq_lens", "block_table")}, sinks=None if x.sinks is None else x.sinks.cpu()))
        outs.append((out, lse))
    assert all(torch.equal(o, outs[0][0]) and torch.equal(l_, outs[0][1]) for o, l_ in outs[1:])


def test_query_blocks_capacity_plan_serves_other_lengths():
    """A capacity plan (the one a CUDA graph captures) with query blocks, reused at new lengths without re-planning:
    each launch's lengths are recomputed from seq_lens at every run."""
    name = "triton"
    if name not in kernel_backends(DEVICE):
        pytest.skip(f"{name} unavailable on {DEVICE}")
    x = _inputs((16, 1), 16, (64, 64), {}, capacity=64)
    w = attnplan.DecodeWrapper(backend=name)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert plan.capacity_mode and len(plan.q_blocks) == 2
    for lens in ((64, 1), (0, 17), (40, 63)):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=DEVICE))
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        _check(out, lse, x)


@pytest.mark.parametrize("name", ["triton", "numba", "cuda_ptx"])
def test_query_blocks_clamp_device_lengths_into_the_capacity(name):
    """Lengths outside ``[0, capacity]`` written on the device after the plan (one past it, 2^31 - 1, negative, the
    smallest int32) with query blocks: a block's lengths are ``max(0, clamp(L, 0, capacity) - (q_len - i1))``,
    computed without an int32 wrap, so each block's queries see what they see in the whole problem at the clamped
    lengths (the last block's kernels read ``seq_lens`` and clamp it themselves); the outputs equal the reference's
    on the clamped lengths."""
    be = _head_block_backend(name, 8)  # 8 rows: group 4 x 4 queries in 2 launches of 2 queries
    cap = 48
    x = _inputs((4, 1), 4, (40, 20, 5, 1, 33), {}, capacity=cap)
    ctx = Context.from_config(load_config(split={"merge": "separate"}, plan_cache={"enabled": False}))
    plan = plan_problem(dataclasses.replace(problem_of(x), capacity=cap), be, torch.device(DEVICE), ctx,
                        num_splits=2)  # the cache's capacity, as plan() sees it
    assert plan.q_blocks == ((0, 2), (2, 4)) and x.block_table.shape[1] * 16 == cap
    ws = poisoned_workspace(plan, torch.device(DEVICE))
    lens = [cap + 1, 2**31 - 1, -5, -2**31, 33]
    x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=DEVICE))
    be.run(plan, x, ws, out, lse)
    clamped = [min(max(n, 0), cap) for n in lens]
    assert ws.lens[0].tolist() == [max(0, n - 2) for n in clamped]
    _check(out.cpu(), lse.cpu(), dataclasses.replace(x, **{f: getattr(x, f).cpu() for f in (
        "q", "k_cache", "v_cache", "block_table")}, seq_lens=torch.tensor(clamped, dtype=torch.int32)))


def test_query_blocks_keep_one_launch_table_per_workspace():
    """The launches' workspace views are made once per (workspace, plan): a backend that keys its launch constants
    on the workspace object (triton) finds them again at every run instead of filling its table."""
    if "triton" not in kernel_backends(DEVICE):
        pytest.skip("triton unavailable")
    x = _inputs((16, 1), 9, (20, 5), {})  # 144 rows: launches of 8 and 1 queries
    w = attnplan.DecodeWrapper(load_config(split={"merge": "fused"}), backend="triton")  # no merge kernel to run
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2)
    assert len(plan.launches) == 2
    views = [w.workspace.launch(plan, j) for j in range(len(plan.launches))]
    for _ in range(2):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    assert [w.workspace.launch(plan, j) for j in range(len(plan.launches))] == views
    assert all(a is b for a, b in zip(views, [w.workspace.launch(plan, j) for j in range(len(plan.launches))]))
    keys = {k for k in w.backend._launches if k[1] in {id(v) for v in views}}
    assert len(keys) == len(views)
    assert views[0].state.o.data_ptr() == w.workspace.state.o.data_ptr()
    assert views[1].state.o.data_ptr() == w.workspace.state.o[:, 8].data_ptr()


@pytest.mark.parametrize("name", ["triton", "cuda_ptx"])
def test_a_plan_of_more_launches_than_the_table_keeps_its_constants(name):
    """q_len 3 x 3 KV heads x 2 head blocks = 18 launches, more than the launch table's entries (cut from the default
    64 to 16 on this fresh backend, so the plan stays small in the interpreter and the emulation): every launch's
    constants are found again at the next run (the table grows for the plan instead of being cleared mid-run)."""
    be = _head_block_backend(name, 4)
    assert be.launch_table_max == 64  # the default the cut stands in for
    be.launch_table_max = 16
    x = _inputs((15, 3), 3, (20,), {}, dtype=torch.float32)
    x = dataclasses.replace(x, **{f: getattr(x, f).to(DEVICE) for f in ("q", "k_cache", "v_cache", "seq_lens",
                                                                         "block_table")})
    ctx = Context.from_config(load_config(split={"merge": "separate"}, plan_cache={"enabled": False}))
    plan = plan_problem(problem_of(x), be, torch.device(DEVICE), ctx, num_splits=2)
    assert len(plan.launches) == 18 > be.launch_table_max
    ws = poisoned_workspace(plan, torch.device(DEVICE))
    outs = []
    for _ in range(2):
        out = poison(torch.empty_like(x.q))
        be.run(plan, x, ws, out)
        outs.append(out)
        if len(outs) == 1:
            first = dict(be._launches)
            keys = {(id(la.plan), id(ws.launch(plan, j))) for j, la in enumerate(plan.launches)}
            assert keys <= set(first)
    assert all(be._launches[k] is first[k] for k in keys)  # none recomputed
    ref, _ = _reference(dataclasses.replace(x, **{f: getattr(x, f).cpu() for f in ("q", "k_cache", "v_cache",
                                                                                  "seq_lens", "block_table")}))
    assert_close_to_reference(outs[0].cpu(), ref, torch.float32)
    assert torch.equal(outs[0], outs[1])


# -- head blocks: a GQA group larger than a program -----------------------------------------------------------

#: (backend, rows per program, heads, q_len, lens, variants, fp8, splits): rows cut to 4 so GQA groups of 5-6 go in
#: head blocks (3 + 3, and 3 + 2: a smaller last block), over 2 KV heads (each launch's KV-head slice, its fp8 scales
#: and sinks), with query blocks of one query and lengths below q_len and 0
HEAD_CASES = [
    ("triton", 4, (12, 2), 2, (40, 1, 0), {}, False, 2),
    ("triton", 4, (10, 2), 2, (37, 15), dict(window_left=9, soft_cap=20.0, sinks=True), True, 2),
    ("numba", 4, (12, 2), 2, (40, 1, 0), {}, False, 2),
    ("numba", 4, (10, 2), 2, (37, 15), dict(window_left=9, soft_cap=20.0, sinks=True), True, 2),
    ("cuda_ptx", 4, (12, 2), 2, (40, 2, 0), dict(sinks=True), False, 3),
    # 3 + 3 (one emulated specialization per merge); the smaller last block (3 + 2) with these variants in the full
    # tier (a plain smaller last block: Falcon-7B's below)
    ("cuda_ptx", 4, (12, 2), 1, (37, 15), dict(window_left=9, soft_cap=20.0), True, 2),
    ("cuda_ptx", 4, (10, 2), 1, (37, 15), dict(window_left=9, soft_cap=20.0), True, 2),
    ("cuda_ptx", None, (71, 1), 1, (33, 0), {}, False, 2),  # Falcon-7B's 71 query heads on one KV head: 36 + 35
]


def _head_block_backend(name: str, rows: int | None):
    """A fresh backend (``EmulatedCudaPtxBackend`` for cuda_ptx on the CPU) holding ``rows`` rows per program."""
    if name == "cuda_ptx" and DEVICE == "cpu":
        emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
        if emulate.compiler() is None:
            pytest.skip("no C++ compiler for the host emulation")
        be = emulate.EmulatedCudaPtxBackend()
    else:
        if name not in kernel_backends(DEVICE):
            pytest.skip(f"{name} unavailable on {DEVICE}")
        be = type(get_backend(name))()
    if rows is not None:
        be.max_rows_per_program = rows
    return be


#: HEAD_CASES in the full tier: numba's plain case (numba's head blocks: its variants case, blocks 3 + 2, and
#: test_head_blocks_through_the_wrapper, 33 + 32 with a length 0; numba's launch lengths below q_len: MORE's numba
#: cases; this case's lengths on head blocks: the triton and cuda_ptx plain cases), and cuda_ptx's variants case of a
#: smaller last block (its 3 + 3 case and Falcon-7B's 36 + 35 in the default run)
HEAD_FULL = {("numba", (12, 2)), ("cuda_ptx", (10, 2))}


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("name, rows, heads, q_len, lens, variants, fp8, splits",
                         [pytest.param(*c, id=f"{c[0]}-g{c[2][0] // c[2][1]}x{c[2][1]}-q{c[3]}"
                                       + "-variants" * bool(c[5]) + "-fp8" * c[6],
                                       marks=pytest.mark.full if (c[0], c[2]) in HEAD_FULL else ())
                          for c in HEAD_CASES])
def test_head_blocks_match_reference(name, rows, heads, q_len, lens, variants, fp8, splits, merge):
    be = _head_block_backend(name, rows)
    if merge not in be.merge_strategies:
        pytest.skip(f"{name} has no {merge} merge")
    x = _inputs(heads, q_len, lens, variants, dtype=torch.bfloat16)
    if fp8:  # per-KV-head scales: a launch given another KV head's scale is off by up to 2x
        g = torch.Generator().manual_seed(1)
        x = dataclasses.replace(x, k_cache=(x.k_cache.float() / 4).to(torch.float8_e4m3fn),
                                v_cache=(x.v_cache.float() * 2).to(torch.float8_e4m3fn),
                                k_scale=torch.rand(heads[1], generator=g) + 0.5,
                                v_scale=torch.rand(heads[1], generator=g) + 0.5)
    x = dataclasses.replace(x, **{f: None if getattr(x, f) is None else getattr(x, f).to(DEVICE)
                                  for f in ("q", "k_cache", "v_cache", "seq_lens", "block_table", "sinks", "k_scale",
                                            "v_scale")})
    prob = problem_of(x)
    # no plan cache: this backend's rows per program are cut, and its plans must not be found by other tests
    ctx = Context.from_config(load_config(split={"merge": merge}, plan_cache={"enabled": False}))
    plan = plan_problem(prob, be, torch.device(DEVICE), ctx, num_splits=splits)
    group, most = prob.group_size, be.rows_per_program(prob)
    assert plan.head_block == -(-group // -(-group // most)) and plan.merge == merge, plan
    assert len(plan.launches) == q_len * heads[1] * len(plan.head_blocks)
    ws = poisoned_workspace(plan, torch.device(DEVICE))
    outs = []
    for _ in range(2):  # reruns are bitwise identical
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], device=DEVICE))
        be.run(plan, x, ws, out, lse)
        ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(),
                                           x.block_table.cpu(), x.sm_scale, window_left=x.window_left,
                                           soft_cap=x.soft_cap, sinks=None if x.sinks is None else x.sinks.cpu(),
                                           k_scale=None if x.k_scale is None else x.k_scale.cpu(),
                                           v_scale=None if x.v_scale is None else x.v_scale.cpu())
        assert_close_to_reference(out.cpu(), ref, torch.bfloat16)
        assert_close_to_reference(lse.cpu(), ref_lse, torch.float32, "lse")
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("name", ["numba", "triton"])
def test_a_plan_of_several_launches_is_refused_by_partial_and_merge(name):
    """partial() / merge() launch one plan's grid: handed a whole plan of head or query blocks they would leave rows
    unwritten, so they refuse it (Backend.run launches each of plan.launches). (The reference backend serves any
    rows in one launch: it never makes such a plan.)"""
    if name not in kernel_backends(DEVICE):
        pytest.skip(f"{name} unavailable on {DEVICE}")
    be = get_backend(name)
    refused = 0
    for heads, q_len in (((144, 2), 1), ((64, 1), 3)):
        x = _inputs(heads, q_len, (20, 5), {})
        plan = plan_problem(problem_of(x), be, CPU, Context.from_config(load_config(split={"merge": "separate"})),
                            num_splits=2)
        if not plan.multi_launch:
            assert name == "triton"  # 72 rows fit a Triton program; numba's 64 do not
            continue
        ws = poisoned_workspace(plan, CPU)
        out = poison(torch.empty_like(x.q))
        with pytest.raises(ValueError, match="runs through Backend.run"):
            be.partial(plan, x, ws, out, None)
        with pytest.raises(ValueError, match="runs through Backend.run"):
            be.merge(plan, ws, out, None)
        assert torch.isnan(out).all()
        refused += 1
    assert refused >= 1, "neither problem made a plan of several launches: nothing was refused"


def test_head_blocks_through_the_wrapper():
    """numba's real limit (64 rows): a GQA group of 65 query heads through ``DecodeWrapper`` (plan, bind-free runs
    of the launches, a rerun) against the reference; the plan says how it launches."""
    if "numba" not in kernel_backends(DEVICE):
        pytest.skip(f"numba unavailable on {DEVICE}")
    x = _inputs((65, 1), 1, (21, 0), dict(sinks=True))
    x = dataclasses.replace(x, **{f: getattr(x, f).to(DEVICE) for f in ("q", "k_cache", "v_cache", "seq_lens",
                                                                          "block_table", "sinks")})
    w = attnplan.DecodeWrapper(load_config(plan_cache={"enabled": False}), backend="numba")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2, sinks=x.sinks)
    assert (plan.head_block, len(plan.launches)) == (33, 2) and "GQA group of 65 query heads" in plan.explain()
    for lens in ((21, 0), (3, 21)):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=DEVICE))
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        _check(out.cpu(), lse.cpu(), dataclasses.replace(x, **{f: getattr(x, f).cpu() for f in (
            "q", "k_cache", "v_cache", "seq_lens", "block_table", "sinks")}))


# -- cuda_ptx: the kernel text in the host emulation ---------------------------------------------------------

# both kernel modes and both merges, on the diagonal in the default run (the launches of the blocks are
# Backend.run's whatever the kernel; each mode with each merge on plain launches: tests/test_cuda_ptx_emulation.py)
@pytest.mark.parametrize("mma,merge", [pytest.param(False, "separate", id="separate-split_k"),
                                       pytest.param(True, "separate", id="separate-mma", marks=pytest.mark.full),
                                       pytest.param(False, "fused", id="fused-split_k", marks=pytest.mark.full),
                                       pytest.param(True, "fused", id="fused-mma")])
def test_cuda_ptx_query_blocks_in_emulation(mma, merge):
    """cuda_ptx holds 64 rows (32 with an fp8 cache at head_dim 128): group 8 x 16 queries goes in two launches of
    8; the emulated kernels (the real kernel text compiled for the CPU) against the reference, poisoned workspace."""
    emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler for the host emulation")
    be = emulate.EmulatedCudaPtxBackend()
    x = _inputs((8, 1), 16, (40, 3, 0), dict(sinks=True), dtype=torch.bfloat16, device=CPU)
    prob = problem_of(x)
    ctx = Context.from_config(load_config(split={"merge": merge}, backend_options={"cuda_ptx": {"mma": mma}}))
    plan = plan_problem(prob, be, CPU, ctx, num_splits=3)
    assert plan.q_block == 8 and plan.merge == merge and plan.kernel["mma"] == mma
    ws = poisoned_workspace(plan, CPU)
    out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3]))
    be.run(plan, x, ws, out, lse)
    _check(out, lse, x)
    assert torch.equal(ws.lens[0], (x.seq_lens - 8).clamp(min=0))


# -- GPU: CUDA graphs, no syncs, a serving shape -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "numba", "cuda_ptx"])
def test_query_blocks_capture_replay_without_syncs(name):
    """Speculative verification at Llama-70B's heads (64/8, 16 queries: 128 rows per KV head): a capacity plan
    captured in a CUDA graph replays correctly at new lengths, and run() never synchronizes the host."""
    if name not in kernel_backends("cuda"):
        pytest.skip(f"{name} unavailable")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = make_inputs(3, 64, 8, 128, [4096, 4096, 4096], q_len=16, page_size=16, dtype=torch.bfloat16, device="cuda",
                    generator=g)
    w = attnplan.DecodeWrapper(backend=name)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert (plan.q_block != 0) == (w.backend.q_block(plan.problem) < 16)
    _capture_replay_without_syncs(w, x, ((4096, 16, 0), (17, 4000, 2048)))


def _capture_replay_without_syncs(w, x: DecodeInputs, length_vectors, sinks=None):
    """Run ``w`` (planned on ``x`` with ``capacity=True``) once, capture its run() in a CUDA graph, replay it at each
    length vector against the float64 reference (outputs poisoned with NaN before each replay), then run() once
    more under ``torch.cuda.set_sync_debug_mode("error")``."""
    out = torch.empty_like(x.q)
    lse = torch.empty(x.q.shape[:3], device="cuda")
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    for lens in length_vectors:
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = reference.attention(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.seq_lens.cpu(),
                                           x.block_table.cpu(), x.sm_scale,
                                           sinks=None if sinks is None else sinks.cpu())
        assert_close_to_reference(out.cpu(), ref, torch.bfloat16)
        assert_close_to_reference(lse.cpu(), ref_lse, torch.float32, "lse")
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "numba", "cuda_ptx"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_head_blocks_capture_replay_without_syncs(name, q_len):
    """Falcon-7B's heads (71 query heads on one KV head, head_dim 64) and a 144-head group over 2 KV heads: more
    rows than a cuda_ptx or numba program holds, so head blocks there (triton holds 128 rows: one launch at 71). A
    capacity plan captured in a CUDA graph replays correctly at new lengths, and run() never synchronizes."""
    if name not in kernel_backends("cuda"):
        pytest.skip(f"{name} unavailable")
    for hq, hkv, d in ((71, 1, 64), (288, 2, 128)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = make_inputs(3, hq, hkv, d, [2048] * 3, q_len=q_len, page_size=16, dtype=torch.bfloat16, device="cuda",
                        generator=g)
        sinks = torch.randn(hq, device="cuda")
        w = attnplan.DecodeWrapper(backend=name)
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True, sinks=sinks)
        assert plan.head_block == w.backend.head_block(plan.problem)
        assert plan.head_block or name == "triton"
        _capture_replay_without_syncs(w, x, ((2048, 2, 0), (17, 2000, 1024)), sinks)


def test_dispatch_prefers_a_backend_that_holds_the_queries_in_one_launch():
    """Launching once per block of queries reads the KV once per block: dispatch passes over such a backend for a
    later kernel backend that holds the whole GQA group x q_len (with the reason), never for the float64 fallback;
    a forced backend serves in blocks."""
    from attnplan.api import select_backend

    prob = _problem(64, 8, 16)  # 128 rows: numba 2 launches, triton 1
    be, skipped = select_backend(prob, torch.device(DEVICE), load_config(backends=["numba", "triton", "reference"]))
    assert be.name == "triton" and skipped[0][0] == "numba" and "launches of 8 queries (the KV read 2 times)" in \
        skipped[0][1][0]
    be, skipped = select_backend(prob, torch.device(DEVICE), load_config(backends=["numba", "reference"]))
    assert be.name == "numba" and skipped == []
    big = _problem(256, 8, 16)  # 512 rows: numba 8 launches, triton 4, only the fallback holds them in one
    be, skipped = select_backend(big, torch.device(DEVICE), load_config(backends=["numba", "triton", "reference"]))
    assert be.name == "triton" and [n for n, _ in skipped] == ["numba"]
    be, skipped = select_backend(big, torch.device(DEVICE), load_config(backends=["triton", "numba", "reference"]))
    assert be.name == "triton" and skipped == []
    be, _ = select_backend(prob, torch.device(DEVICE), load_config(), backend="numba")
    assert be.name == "numba"


# -- lifetimes, plan files, more shapes ------------------------------------------------------------------------

def test_blocked_wrapper_frees_its_workspace():
    """Backend.run's launches leave launch constants (with the workspace's views) in the backend's table: a wrapper
    with query blocks forgets them when it re-plans and when it dies, so its workspace is freed with it."""
    import gc
    import weakref

    if "triton" not in kernel_backends(DEVICE):
        pytest.skip("triton unavailable")
    be = get_backend("triton")
    x = _inputs((64, 1), 5, (20, 3), {})  # 320 rows: 3 launches of 2, 2 and 1 queries x 64 heads
    # the fused merge: no merge kernel of 640 rows in the interpreter (the table holds the same launches either way)
    w = attnplan.DecodeWrapper(load_config(split={"merge": "fused"}), backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=3)
    assert len(plan.launches) == 3
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    views = {id(w.workspace.launch(plan, j)) for j in range(3)}
    assert sum(k[1] in views for k in be._launches) == 3
    alive = weakref.ref(w.workspace.state.o)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2)  # a new plan: the old one's go
    assert not any(k[1] in views for k in be._launches)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    del w
    gc.collect()
    assert alive() is None, "the blocked wrapper's workspace outlived it"


def test_plan_file_with_other_query_blocks_is_rebuilt(tmp_path):
    """A plan file whose q_block is not the backend's (edited, or from another version of the backend) is unusable:
    rebuilt with a warning, never launched with more rows per program than the program holds."""
    import json

    cfg = load_config(plan_cache={"dir": str(tmp_path)})
    be = get_backend("numba")
    prob = _problem(64, 8, 16)
    plan = plan_problem(prob, be, CPU, Context.from_config(cfg), num_splits=2)
    assert plan.q_block == 8
    (f,) = list(tmp_path.glob("v*/*.json"))
    data = json.loads(f.read_text())
    data["plan"]["q_block"] = 0
    f.write_text(json.dumps(data))
    ctx = Context.from_config(cfg)
    with pytest.warns(RuntimeWarning, match="unusable"):
        again = plan_problem(prob, be, CPU, ctx, num_splits=2)
    assert again.q_block == 8 and ctx.cache.stats.rebuilt == 1


@pytest.mark.parametrize("field, value, needle", [
    ("head_block", 0, "plan head_block 0 is not numba's 36"),
    ("head_block", 40, "plan head_block 40 is not numba's 36"),
    # numba's options under the reference backend's name: refused on reading (the reference backend makes none of
    # them), before the backend asking compares the names
    ("backend", "reference", "kernel options lanes=2, .* are not the reference backend's"),
    ("merge", "fused", r"plan merge 'fused' is not one of numba's \['separate'\]"),
])
def test_plan_file_edited_to_misfit_its_backend_is_rebuilt(tmp_path, field, value, needle):
    """A plan file that validates on its own but not for the backend asking (other head blocks, another backend's
    name, which would skip this backend's kernel-option limits, a merge the backend lacks) is a miss with a
    warning naming why, then rebuilt, not a failure at every call."""
    import json

    cfg = load_config(plan_cache={"dir": str(tmp_path)}, split={"merge": "separate"})
    be = get_backend("numba")
    prob = _problem(72, 1, 1)
    plan = plan_problem(prob, be, CPU, Context.from_config(cfg), num_splits=2)
    assert (plan.head_block, plan.merge) == (36, "separate")
    (f,) = list(tmp_path.glob("v*/*.json"))
    data = json.loads(f.read_text())
    data["plan"][field] = value
    f.write_text(json.dumps(data))
    ctx = Context.from_config(cfg)
    with pytest.warns(RuntimeWarning, match=needle):
        again = plan_problem(prob, be, CPU, ctx, num_splits=2)
    assert again == plan and ctx.cache.stats.rebuilt == 1


#: more shapes: uneven blocks with a short last one (group 9: 7 + 7 + 2 queries on numba), one query per launch
#: (group 64), window 0 and a window past the cache, a dominating sink and a -inf one, an fp8 cache
MORE = [
    ("numba", (9, 1), 16, (40, 3, 0, 16), {}, torch.float16, 3),
    ("numba", (64, 1), 4, (33, 2), dict(window_left=0, sinks=True), torch.bfloat16, 4),
    ("triton", (18, 1), 16, (40, 16, 1), dict(window_left=1000, soft_cap=5.0, sinks=True), torch.float16, 3),
    ("triton", (16, 1), 16, (37, 5), dict(fp8=True), torch.bfloat16, 2),
    ("numba", (16, 2), 16, (37, 5), dict(fp8=True, window_left=7), torch.float16, 2),
]


#: MORE in the full tier: numba's fp8 + window case (an fp8 cache with query blocks: triton's fp8 case; fp8 + window on
#: numba's launches of one query over 2 KV heads: HEAD_CASES' numba variants case)
MORE_FULL = {("numba", (16, 2))}


@pytest.mark.parametrize("name, heads, q_len, lens, variants, dtype, launches",
                         [pytest.param(*c, id=f"{c[0]}-g{c[1][0] // c[1][1]}-q{c[2]}-{'-'.join(c[4]) or 'plain'}",
                                       marks=pytest.mark.full if c[:2] in MORE_FULL else ()) for c in MORE])
def test_more_query_block_shapes_match_reference(name, heads, q_len, lens, variants, dtype, launches):
    if name not in kernel_backends(DEVICE):
        pytest.skip(f"{name} unavailable on {DEVICE}")
    x = _inputs(heads, q_len, lens, variants, dtype=dtype)
    if variants.get("sinks"):
        x.sinks[0], x.sinks[1] = 30.0, float("-inf")  # a sink that dominates, and none (+inf is refused)
    ks = vs = None
    if variants.get("fp8"):
        g = torch.Generator().manual_seed(1)
        ks = (torch.rand(heads[1], generator=g) + 0.5).float().to(DEVICE)
        vs = (torch.rand(heads[1], generator=g) + 0.5).float().to(DEVICE)
        x = dataclasses.replace(x, k_cache=(x.k_cache.float() / 4).to(torch.float8_e4m3fn),
                                v_cache=(x.v_cache.float() * 2).to(torch.float8_e4m3fn), k_scale=ks, v_scale=vs)
    w = attnplan.DecodeWrapper(backend=name)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=2 if launches else 0,
                  window_left=x.window_left, logits_soft_cap=x.soft_cap, sinks=x.sinks, k_scale=ks, v_scale=vs)
    assert len(plan.launches) == launches, plan.q_blocks
    out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=DEVICE))
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks,
                                       k_scale=ks, v_scale=vs)
    assert_close_to_reference(out, ref, x.q.dtype)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


def test_query_blocks_through_decode_and_the_op():
    """attnplan.decode (with and without host lengths) and torch.ops.attnplan.decode on a blocked problem; the op's
    per-call workspace leaves nothing in the backend's launch table."""
    import attnplan.ops  # noqa: F401 - registers the op

    if "triton" not in kernel_backends(DEVICE):
        pytest.skip("triton unavailable")
    x = _inputs((16, 1), 9, (40, 17), {})  # 144 rows: launches of 8 and 1 queries
    ref, _ = _reference(x)
    for lens_host in (None, [40, 17]):
        out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="triton",
                              seq_lens_host=lens_host)
        assert_close_to_reference(out, ref, x.q.dtype)
    be = get_backend("triton")
    before = set(be._launches)
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None, "triton")
    assert_close_to_reference(out, ref, x.q.dtype)
    assert set(be._launches) <= before


@pytest.mark.parametrize("name", ["numba", "cuda_ptx"])
def test_capacity_plan_with_blocks_on_numba_and_cuda_ptx(name):
    """The capacity plan reused at new lengths on the other backends (cuda_ptx in the host emulation, fused merge:
    its counters are zero again after every run)."""
    if name == "numba":
        if name not in kernel_backends(DEVICE):
            pytest.skip("numba unavailable")
        be, merge = get_backend(name), "separate"
    else:
        emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
        if emulate.compiler() is None:
            pytest.skip("no C++ compiler for the host emulation")
        be, merge = emulate.EmulatedCudaPtxBackend(), "fused"
    dev = torch.device(DEVICE) if name == "numba" else CPU
    # launches of 8 queries: 8 + 1 on numba, 8 + 8 on cuda_ptx (one emulated specialization for both)
    q_len = 9 if name == "numba" else 16
    x = _inputs((8, 1), q_len, (64, 64), dict(sinks=True), dtype=torch.bfloat16, capacity=64, device=dev)
    prob = dataclasses.replace(problem_of(x), max_kv_len=64, total_kv_len=128, capacity=64)
    plan = plan_problem(prob, be, dev, Context.from_config(load_config(split={"merge": merge})), capacity_mode=True)
    assert plan.q_block == 8 and plan.merge == merge
    ws = poisoned_workspace(plan, dev)
    for lens in ((64, 1), (0, 17), (40, 63)):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = poison(torch.empty_like(x.q)), poison(torch.empty(x.q.shape[:3], device=dev))
        be.run(plan, x, ws, out, lse)
        _check(out, lse, x)
        if ws.counters is not None:
            assert not ws.counters.any(), "fused-merge counters not zero at rest"
