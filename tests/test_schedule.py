"""The device-side schedule's invariants (attnplan.schedule), for many length vectors, and the plans that use it.

Every backend computes the schedule of :func:`attnplan.schedule.schedule_units` on the device; these tests pin that
function: coverage (every visible position in exactly one unit), bounds (units per sequence, total units against
the plan's slots), order, balance, and batch invariance when the schedule has no targets.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from attnplan.config import load_config
from attnplan.device import CPU_STANDIN, DeviceInfo
from attnplan.planner import SplitPlan, _bucket_granules, make_plan
from attnplan.problem import DecodeProblem
from attnplan.schedule import (LONGEST_FIRST_BATCH, NUM_BUCKETS, NUM_TARGETS, Schedule, bucket_of, bucket_range,
                               check_invariants, is_long_tailed, max_units_bound, schedule_units)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
H200 = DeviceInfo("NVIDIA H200", 132, (9, 0), 232448, 60 * 2**20, 4800.0, "cuda-13.0")


@st.composite
def balanced_schedules(draw, max_batch: int = 12):
    granule = draw(st.sampled_from([16, 32, 64, 128]))
    min_c = draw(st.integers(1, 4))
    s_cap = draw(st.integers(1, 64))
    batch = draw(st.integers(1, max_batch))
    raw = draw(st.lists(st.integers(0, 300), min_size=NUM_TARGETS, max_size=NUM_TARGETS))
    targets = (0, *raw[1:])
    policy = "single" if s_cap == 1 else "balanced"
    if policy == "single":
        targets = (0,) * NUM_TARGETS
    bound = batch if s_cap == 1 else max(batch, max_units_bound(targets, batch, s_cap))
    return Schedule(policy, granule, min_c, s_cap, targets, bound), batch


@given(sched_batch=balanced_schedules(), data=st.data(), q_len=st.integers(1, 4),
       window=st.sampled_from([-1, 0, 5, 100]))
@SETTINGS
def test_invariants_hold_for_any_lengths(sched_batch, data, q_len, window):
    sched, batch = sched_batch
    lens = data.draw(st.lists(st.integers(0, 5000), min_size=batch, max_size=batch))
    u = check_invariants(lens, sched, q_len, window)
    for b, length in enumerate(lens):  # coverage, position by position, against the visible span
        base = max(0, length - q_len - window) if window >= 0 else 0
        covered = torch.zeros(max(length, 1), dtype=torch.int64)
        for j in range(int(u.indptr[b]), int(u.indptr[b + 1])):
            covered[int(u.start[j]):int(u.end[j])] += 1
        assert covered[base:length].eq(1).all() and covered[:base].eq(0).all()


@given(sched_batch=balanced_schedules(), data=st.data(), q_len=st.integers(1, 4),
       window=st.sampled_from([-1, 0, 5, 100]), capacity=st.integers(0, 3000))
@SETTINGS
def test_capacity_clamps_device_lengths_as_the_kernels_read_them(sched_batch, data, q_len, window, capacity):
    """With ``capacity`` every length is read as ``min(max(L, 0), capacity)`` (the kernels' clamp of lengths written
    on the device): any int32 length, negative or past the cache, gives the schedule of the clamped lengths, whose
    invariants hold and whose units lie inside ``[0, capacity]``; lengths within ``[0, capacity]`` are unchanged.
    Without ``capacity`` a negative length is refused, as before."""
    sched, batch = sched_batch
    lens = data.draw(st.lists(st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-3, capacity + 3)),
                              min_size=batch, max_size=batch))
    clamped = [min(max(x, 0), capacity) for x in lens]
    u = check_invariants(lens, sched, q_len, window, capacity=capacity)
    want = schedule_units(clamped, sched, q_len, window)
    for f in ("base", "granules", "unit_granules", "units", "indptr", "seq", "start", "end", "first", "slot"):
        assert torch.equal(getattr(u, f), getattr(want, f)), f
    assert u.total_granules == want.total_granules and u.granules_per_unit == want.granules_per_unit
    assert int(u.end.max()) <= capacity and int(u.start.min()) >= 0
    assert u.num_units <= sched.max_units
    inside = [min(x, capacity) for x in clamped]  # already in range: the same schedule with or without capacity
    assert torch.equal(schedule_units(inside, sched, q_len, window, capacity=capacity).end,
                       schedule_units(inside, sched, q_len, window).end)
    if min(lens) < 0:
        with pytest.raises(ValueError, match=">= 0"):
            schedule_units(lens, sched, q_len, window)
    with pytest.raises(ValueError, match="capacity"):
        schedule_units(lens, sched, q_len, window, capacity=-1)


@given(sched_batch=balanced_schedules(max_batch=70), data=st.data(), window=st.sampled_from([-1, 0, 100]))
@SETTINGS
def test_slots_longest_units_first(sched_batch, data, window):
    """A batch of at most LONGEST_FIRST_BATCH sequences takes the slots in order of decreasing granules per unit,
    ties by index: sequence b's first slot is the units of the sequences before it in that order, counted here pair
    by pair; a larger batch takes them in index order. Each unit's slot is its sequence's first slot plus its
    index, and the slots are a permutation of [0, U)."""
    sched, batch = sched_batch
    lens = data.draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 20000)), min_size=batch,
                              max_size=batch))
    u = schedule_units(lens, sched, 1, window)
    cb, un = u.unit_granules.tolist(), u.units.tolist()
    for b in range(batch):
        if batch <= LONGEST_FIRST_BATCH:
            want = sum(un[i] for i in range(batch) if cb[i] > cb[b] or (cb[i] == cb[b] and i < b))
        else:
            want = sum(un[:b])
        assert int(u.first[b]) == want, (b, cb, un)
        lo, hi = int(u.indptr[b]), int(u.indptr[b + 1])
        assert u.slot[lo:hi].tolist() == list(range(want, want + hi - lo))
    assert sorted(u.slot.tolist()) == list(range(u.num_units))
    assert u.by_slot()[u.slot].tolist() == list(range(u.num_units))


def test_slots_put_a_long_sequences_units_first():
    """One long sequence among short ones: its units take slots 0.., the short ones' single units follow in index
    order, and an empty sequence's unit is last."""
    targets = tuple([0] + [64] * (NUM_TARGETS - 1))
    sched = Schedule("balanced", 64, 1, 256, targets, max_units_bound(targets, 6, 256))
    u = check_invariants([300, 900, 0, 64000, 700, 700], sched)
    n_long = int(u.units[3])
    assert n_long > 1 and int(u.first[3]) == 0
    assert [int(u.first[b]) for b in (1, 4, 5, 0, 2)] == list(range(n_long, n_long + 5))


@given(st.lists(st.integers(0, 20000), min_size=1, max_size=16), st.integers(1, 16), st.integers(1, 8))
@SETTINGS
def test_no_targets_means_batch_invariant(lens, chunk_granules, s_cap):
    """With all targets zero a sequence's units depend on its own length alone: the same sequence with other
    batchmates (and another batch size) gets the same token ranges."""
    sched = Schedule("batch_invariant", 64, chunk_granules, s_cap, (0,) * NUM_TARGETS, 64 * s_cap)
    alone = schedule_units([lens[0]], sched)
    mates = schedule_units(lens + [lens[0]], sched)
    last = len(lens)
    lo, hi = int(mates.indptr[last]), int(mates.indptr[last + 1])
    assert mates.start[lo:hi].tolist() == alone.start.tolist() and mates.end[lo:hi].tolist() == alone.end.tolist()


def test_balanced_spreads_a_long_sequence_and_packs_short_ones():
    """One 128K sequence among 15 short ones: the long one gets many units, each short one one unit, and no unit is
    longer than about the batch's work / target."""
    targets = tuple([0] + [264] * (NUM_TARGETS - 1))
    sched = Schedule("balanced", 64, 1, 256, targets, max_units_bound(targets, 16, 256))
    lens = [131072] + [500] * 15  # 8 granules each, below the 9 granules per unit
    u = check_invariants(lens, sched)
    assert int(u.units[0]) >= 100 and u.units[1:].eq(1).all()
    c = u.granules_per_unit
    assert c == math.ceil(u.total_granules / 264)
    assert int((u.end - u.start).max()) <= c * 64


def test_forced_gives_equal_units_up_to_the_count():
    sched = Schedule("forced", 16, 1, 4, (0,) * NUM_TARGETS, 12)
    u = check_invariants([100, 16, 0], sched)
    assert u.units.tolist() == [4, 1, 1]
    assert (u.end - u.start)[:4].tolist() == [32, 32, 32, 4]  # 7 granules in units of 2


def test_bucket_of():
    """``bit_length(T + T // 2)``: ``bucket_range`` gives each bucket's ends, and a power of two of granules sits
    at most 6.1% above its bucket's geometric middle (``3 / 2^1.5`` for long buckets)."""
    assert [bucket_of(t) for t in (0, 1, 2, 3, 4, 5, 6, 255, 256, 341, 342)] == [0, 1, 2, 3, 3, 3, 4, 9, 9, 9, 10]
    assert bucket_of(1 << 40) == NUM_BUCKETS - 1 == 31 and NUM_TARGETS == 64
    assert bucket_range(0) == (0, 0) and bucket_range(3) == (3, 5) and bucket_range(31) == (715827883, None)
    for k in range(1, NUM_BUCKETS - 1):
        lo, hi = bucket_range(k)
        assert bucket_of(lo - 1) == k - 1 and bucket_of(lo) == bucket_of(hi) == k and bucket_of(hi + 1) == k + 1, k
    for n in range(2, 30):
        lo, hi = bucket_range(bucket_of(1 << n))
        assert 1.0 <= (1 << n) / math.sqrt(lo * hi) <= 1.061, n
    for bad in (-1, NUM_BUCKETS):
        with pytest.raises(ValueError, match="bucket"):
            bucket_range(bad)


def test_schedule_refuses_bad_fields():
    good = dict(policy="balanced", granule=64, min_unit_granules=1, max_units_per_seq=8,
                targets=(0,) * NUM_TARGETS, max_units=8)
    Schedule(**good)
    for key, bad in (("policy", "stream_k"), ("granule", 0), ("max_units", -1), ("targets", (0,) * 3),
                     ("min_unit_granules", True), ("max_units_per_seq", 2.0)):
        with pytest.raises(ValueError, match=key if key != "targets" else "targets"):
            Schedule(**{**good, key: bad})
    with pytest.raises(ValueError, match="single"):
        Schedule(**{**good, "policy": "single"})


# -- plans: the planner's max_units bounds every length vector up to the capacity -----------------------------------

PLAN_SHAPES = [  # (batch, hq, hkv, d, q_len, page, capacity)
    (1, 32, 8, 128, 1, 16, 131072), (4, 8, 1, 128, 1, None, 65536), (16, 64, 8, 128, 1, 16, 131072),
    (64, 28, 4, 128, 4, 16, 32768), (3, 16, 8, 256, 1, 32, 90000), (256, 32, 32, 128, 1, 16, 4096),
]


@pytest.mark.parametrize("shape", PLAN_SHAPES, ids=lambda s: "b{}-{}x{}-d{}-q{}-p{}-cap{}".format(*s))
@pytest.mark.parametrize("device", [CPU_STANDIN, H200], ids=["cpu", "h200"])
@pytest.mark.parametrize("capacity_mode", [True, False], ids=["capacity", "live"])
def test_plan_bounds_hold_for_random_lengths(shape, device, capacity_mode):
    b, hq, hkv, d, ql, page, cap = shape
    cfg = load_config()
    live = max(1, cap // 3)
    prob = DecodeProblem(b, hq, hkv, d, ql, page, max_kv_len=cap if capacity_mode else live,
                         total_kv_len=b * (cap if capacity_mode else live), capacity=cap).bucketed()
    plan = make_plan(prob, device, cfg, "triton", {"block_n": 64}, capacity_mode=capacity_mode,
                     merge_strategies=frozenset({"separate", "fused"}))
    plan.validate(prob)
    assert plan.schedule.granule % 64 == 0 and plan.schedule.granule % (page or 1) == 0
    if capacity_mode:
        assert not plan.single_pass, "a capacity plan must be able to spread a long sequence"
    g = torch.Generator().manual_seed(b * 1000 + cap)
    for _ in range(25):
        lens = torch.randint(0, cap + 1, (b,), generator=g)
        if bool(torch.rand(1, generator=g) < 0.3):
            lens = torch.where(torch.rand(b, generator=g) < 0.8, lens % 64, lens)
        check_invariants(lens, plan.schedule, ql, prob.window_left)
    check_invariants([cap] * b, plan.schedule, ql)
    check_invariants([0] * b, plan.schedule, ql)


def test_capacity_plan_schedules_uniform_batches_like_live_plans():
    """On the H200 table a capacity plan gives a uniform batch the units a live plan gives it (the targets are the
    live plans' split counts), at the table's measured points."""
    cfg = load_config()
    same = total = 0
    for backend in ("triton", "cuda_ptx"):
        for page in (16, None):
            for b in (1, 4, 16, 64):
                cap = DecodeProblem(b, 32, 8, 128, 1, page, max_kv_len=131072, capacity=131072).bucketed()
                cplan = make_plan(cap, H200, cfg, backend, {"block_n": 64}, capacity_mode=True)
                for length in (1024, 4096, 16384, 65536, 131072):
                    live = DecodeProblem(b, 32, 8, 128, 1, page, max_kv_len=length, capacity=131072).bucketed()
                    lplan = make_plan(live, H200, cfg, backend, {"block_n": 64})
                    a = schedule_units([length] * b, lplan.schedule).units.tolist()
                    c = schedule_units([length] * b, cplan.schedule).units.tolist()
                    same += a == c
                    total += 1
    assert same >= 0.95 * total, f"only {same} of {total} uniform points schedule alike"


def test_batch_invariant_plan_and_forced_plan():
    cfg = load_config(split={"batch_invariant": True, "invariant_chunk_tokens": 1000})
    prob = DecodeProblem(8, 32, 8, 128, 1, 16, max_kv_len=32768, capacity=32768).bucketed()
    plan = make_plan(prob, H200, cfg, "triton", {"block_n": 64}, capacity_mode=True)
    assert plan.policy == "batch-invariant" and plan.schedule.policy == "batch_invariant"
    assert plan.schedule.min_unit_granules * plan.schedule.granule == 1024 and plan.merge == "separate"
    assert not any(plan.schedule.targets)
    forced = make_plan(prob, H200, load_config(), "triton", {"block_n": 64}, num_splits=5)
    assert forced.policy == "forced" and forced.num_splits == 5
    assert schedule_units([32768, 10], forced.schedule).units.tolist() == [5, 1]


def test_plan_round_trips_and_validates_strictly():
    prob = DecodeProblem(4, 32, 8, 128, 1, 16, max_kv_len=8192, capacity=8192).bucketed()
    plan = make_plan(prob, H200, load_config(), "triton", {"block_n": 64, "num_warps": 4}, capacity_mode=True)
    again = SplitPlan.from_dict(plan.to_dict())
    assert again == plan and hash(again) == hash(plan)
    d = plan.to_dict()
    # each refusal's own type and message (from_dict documents KeyError / ValueError / TypeError by cause)
    for mutate, err, msg in ((lambda d: d.pop("schedule"), KeyError, r"\['schedule'\] missing or unknown"),
                             (lambda d: d.update(extra=1), KeyError, r"\['extra'\] missing or unknown"),
                             (lambda d: d.update(version=1), ValueError, "plan version 1 is not"),
                             (lambda d: d["schedule"].update(max_units=1), ValueError, "max_units 1 must cover"),
                             (lambda d: d["kernel"].update(block_n=48), ValueError, "block_n 48 must be"),
                             (lambda d: d.update(merge="atomic"), ValueError, "merge 'atomic'"),
                             (lambda d: d.update(problem=[1, 2]), TypeError, "problem must be a mapping"),
                             # nested mappings and scalars name their field
                             (lambda d: d.update(schedule={}), KeyError, "plan schedule: key policy missing"),
                             (lambda d: d.update(kernel="x"), TypeError, "plan kernel must be a mapping"),
                             (lambda d: d.update(version=str(d["version"])), TypeError, "plan version must be"),
                             (lambda d: d.update(merge=3), TypeError, "plan merge must be"),
                             (lambda d: d.update(q_block=0.0), TypeError, "plan q_block must be"),
                             (lambda d: d["problem"].update(batch="4"), TypeError, "plan problem: .*batch"),
                             (lambda d: d["schedule"].update(granule="64"), ValueError, "plan schedule: .*granule")):
        bad = plan.to_dict()
        mutate(bad)
        with pytest.raises(err, match=msg):
            SplitPlan.from_dict(bad)
    with pytest.raises(ValueError, match="num_kv_heads"):
        plan.validate(DecodeProblem(4, 32, 4, 128, 1, 16, max_kv_len=8192, capacity=8192))
    assert "heaviest program" in plan.explain([8192, 100, 0, 50])


# -- the reference backend runs the schedule: end to end against the float64 reference ------------------------------

CASES = [  # (lens, q_len, page, window, num_splits, capacity)
    ([100, 0, 37, 700], 1, 16, -1, None, False), ([100, 0, 37, 700], 1, 16, -1, None, True),
    ([5000, 3, 0, 64], 4, None, -1, 3, False), ([300, 299, 1], 2, 8, 40, None, True),
    ([0, 0], 1, 16, -1, None, True), ([1024], 3, 32, 7, 8, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{'_'.join(map(str, c[0][:3]))}-q{c[1]}-p{c[2]}-w{c[3]}-"
                                                      f"s{c[4]}-{'cap' if c[5] else 'live'}")
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["balanced", "invariant"])
def test_reference_backend_runs_the_schedule(case, batch_invariant, gen):
    import attnplan
    from attnplan import reference
    from attnplan.testing import assert_close_to_reference, make_inputs

    lens, q_len, page, window, splits, capacity = case
    cfg = load_config(split={"batch_invariant": batch_invariant, "invariant_chunk_tokens": 64})
    x = make_inputs(len(lens), 8, 2, 32, lens, q_len=q_len, page_size=page, dtype=torch.float32, generator=gen,
                    capacity=max(lens) + 5)
    sinks = torch.randn(8, generator=gen)
    w = attnplan.DecodeWrapper(cfg, backend="reference")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=splits, capacity=capacity,
                  window_left=window, sinks=sinks)
    out = torch.full_like(x.q, float("nan"))
    lse = torch.full(x.q.shape[:3], float("nan"))
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, window_left=window,
                                       sinks=sinks)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")
    if w.workspace is not None and w.workspace.meta is not None:  # the run took the plan's units, not others
        units = schedule_units(x.seq_lens.tolist(), plan.schedule, q_len, window)
        b = len(lens)
        assert w.workspace.meta[:b].tolist() == units.first.tolist()
        assert w.workspace.meta[b:2 * b].tolist() == units.units.tolist()


def test_long_tailed_batches_read_the_second_targets_table():
    """A batch whose mean is below half its longest sequence (padding slots count) reads targets[32 + k]; a
    near-uniform batch reads targets[k]."""
    uniform, tail = [0] + [8] * (NUM_BUCKETS - 1), [0] + [40] * (NUM_BUCKETS - 1)
    sched = Schedule("balanced", 16, 1, 64, tuple(uniform + tail), max_units_bound(uniform + tail, 4, 64))
    near = schedule_units([1600, 1600, 1200, 900], sched)  # 331 granules, mean above half of 100
    assert not is_long_tailed(near.total_granules, 4, 100) and near.granules_per_unit == math.ceil(331 / 8)
    far = schedule_units([1600, 16, 0, 0], sched)  # mean below half the longest: the second table
    assert is_long_tailed(far.total_granules, 4, 100) and far.granules_per_unit == math.ceil(101 / 40)
    assert not is_long_tailed(0, 4, 0)


def test_planner_scales_the_long_tailed_table():
    base = load_config()
    scaled = load_config(cost_model={"tail_target_scale": 2.0})
    prob = DecodeProblem(16, 32, 8, 128, 1, 16, max_kv_len=65536, capacity=65536).bucketed()
    a = make_plan(prob, CPU_STANDIN, base, "triton", {"block_n": 64}, capacity_mode=True).schedule
    b = make_plan(prob, CPU_STANDIN, scaled, "triton", {"block_n": 64}, capacity_mode=True).schedule
    assert a.targets[:NUM_BUCKETS] == a.targets[NUM_BUCKETS:] == b.targets[:NUM_BUCKETS]
    assert b.targets[NUM_BUCKETS + 1:] == tuple(2 * t for t in a.targets[1:NUM_BUCKETS])
    assert b.max_units >= max(b.targets) + 0 and b.max_units > a.max_units


#: 132 SMs and no device table (the cost model plans): plans of several sequences are scheduled, not single passes
_GPU132 = DeviceInfo("Test GPU", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")


@given(lens=st.lists(st.integers(0, 131072), min_size=16, max_size=16))
@settings(max_examples=40, deadline=None)
def test_planner_floors_and_caps_the_long_tailed_table(lens):
    """``tail_programs_per_sm`` raises each long-tailed target to that many programs per SM (x SMs / KV heads units),
    ``tail_min_unit_tokens`` caps it at the bucket's representative tokens / that size (the cap wins); the uniform
    table and the off defaults are untouched; any length vector is still covered exactly once by the schedule."""
    prob = DecodeProblem(16, 32, 8, 128, 1, 16, max_kv_len=131072, capacity=131072).bucketed()
    plan = lambda **cm: make_plan(prob, _GPU132, load_config(cost_model=cm), "triton", {"block_n": 64},  # noqa: E731
                                  capacity_mode=True).schedule
    a, b = plan(), plan(tail_programs_per_sm=5.0, tail_min_unit_tokens=2048)
    assert b.targets[:NUM_BUCKETS] == a.targets[:NUM_BUCKETS]
    floor = math.ceil(5.0 * 132 / 8)
    for k in range(1, NUM_BUCKETS):
        t = a.targets[NUM_BUCKETS + k]
        if not t:
            assert b.targets[NUM_BUCKETS + k] == 0
            continue
        t_rep = _bucket_granules(k, 16 * 131072 // a.granule)  # at most the capacity plan's top total
        assert b.targets[NUM_BUCKETS + k] == max(1, min(max(t, floor), t_rep * a.granule // 2048)), k
    assert any(b.targets[NUM_BUCKETS + k] > a.targets[NUM_BUCKETS + k] for k in range(NUM_BUCKETS))
    assert any(b.targets[NUM_BUCKETS + k] < a.targets[NUM_BUCKETS + k] for k in range(NUM_BUCKETS))
    assert b.max_units >= max(b.targets)
    check_invariants(lens, b)


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_uniform_live_plan_sizes_its_grid_for_the_batches_it_serves(data):
    """A live plan whose mean and longest lengths share one bucket keeps its long-tailed table equal to the uniform
    one, so its grid is not sized for twice the units (the scaled table); a plan whose mean bucket is lower, and a
    capacity plan, keep the scale. Any batch of the plan's bucket (its longest and its mean in the planned
    power-of-two bucket, short members allowed) reads the uniform table and fits the grid; so does any other batch."""
    scaled = load_config(cost_model={"tail_target_scale": 2.0})
    batch = data.draw(st.integers(2, 16), label="batch")
    hi = 1 << data.draw(st.integers(10, 16), label="log2 length")
    prob = DecodeProblem(batch, 32, 8, 128, 1, 16, max_kv_len=hi, capacity=hi).bucketed()
    plan = make_plan(prob, _GPU132, scaled, "triton", {"block_n": 64}, num_splits=0)
    s = plan.schedule
    assert not s.single_pass
    assert s.targets[NUM_BUCKETS:] == s.targets[:NUM_BUCKETS]
    assert s.max_units <= max(s.targets[:NUM_BUCKETS]) + batch
    lens = [data.draw(st.integers(hi // 2 + 1, hi), label="longest")]
    lens += data.draw(st.lists(st.integers(0, hi), min_size=batch - 1, max_size=batch - 1), label="rest")
    lens = sorted(lens, reverse=True)
    in_bucket = sum(lens) > batch * (hi // 2)  # the mean in the bucket too
    if in_bucket:
        u = check_invariants(lens, s)
        assert not is_long_tailed(u.total_granules, batch, int(u.granules.max()))
    other = data.draw(st.lists(st.integers(0, prob.capacity), min_size=batch, max_size=batch), label="other")
    check_invariants(other, s)
    half = dataclasses.replace(prob, total_kv_len=batch * (hi // 2))
    for p, capacity in ((half, False), (prob, True)):
        t = make_plan(p, _GPU132, scaled, "triton", {"block_n": 64}, capacity_mode=capacity).schedule
        assert not t.single_pass
        assert t.targets[NUM_BUCKETS + 1:] == tuple(max(1, round(2 * v)) if v else 0 for v in t.targets[1:NUM_BUCKETS])


@given(slots=st.integers(1, 3000), data=st.data())
@settings(max_examples=300, deadline=None)
def test_slot_unit_spreads_units_over_the_slots(slots, data):
    """``slot_unit`` maps exactly ``U`` of the ``slots`` slots onto the units ``0 .. U-1``, one each, in order,
    slot 0 to unit 0. With ``S = min(slots, window)`` (``window`` 0: ``S = slots``), more than ``pack`` of the
    first ``S`` slots per unit are spread over those ``S`` slots only, no two working slots closer than ``floor(S /
    U)``; fewer are packed, the first ``U`` slots working."""
    from attnplan.schedule import slot_unit

    num_units = data.draw(st.integers(1, slots), label="units")
    pack = data.draw(st.sampled_from([1, 2]), label="pack")
    window = data.draw(st.sampled_from([0, 1, num_units, slots]) | st.integers(0, 2 * slots), label="window")
    spread = min(slots, window) if window else slots
    got = [slot_unit(s, num_units, slots, pack, window) for s in range(slots)]
    working = [s for s, u in enumerate(got) if u >= 0]
    assert [got[s] for s in working] == list(range(num_units))
    assert working[0] == 0 and got[0] == 0
    assert working[-1] < max(spread, num_units)
    if spread <= pack * num_units:
        assert working == list(range(num_units))
    else:
        gaps = [b - a for a, b in zip(working, working[1:])]
        assert all(g >= spread // num_units for g in gaps)
    with pytest.raises(ValueError):
        slot_unit(0, slots + 1, slots)
    with pytest.raises(ValueError):
        slot_unit(0, 0, slots)
    with pytest.raises(ValueError):
        slot_unit(0, 1, slots, window=-1)


def test_spread_window_values_and_refusals():
    """:func:`~attnplan.schedule.spread_window`: ``ceil(SPREAD_PROGRAMS_PER_SM x SMs / KV heads)`` slots, at least 1,
    from ``SPREAD_MIN_KV_HEADS`` KV heads on; 0 (the whole grid) below; bad arguments are refused."""
    from attnplan.schedule import SPREAD_MIN_KV_HEADS, SPREAD_PROGRAMS_PER_SM, spread_window

    assert SPREAD_MIN_KV_HEADS == 2 and SPREAD_PROGRAMS_PER_SM == 2  # the values below are for these
    assert spread_window(132, 8) == 33  # 264 programs over 8 KV heads
    assert spread_window(132, 7) == 38  # 264 / 7 = 37.7, rounded up
    assert spread_window(132, 2) == 132
    assert spread_window(132, 1) == 0
    assert spread_window(1, 64) == 1
    for bad in ((0, 8), (132, 0)):
        with pytest.raises(ValueError):
            spread_window(*bad)
