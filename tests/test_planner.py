"""The split planner (v2 plan: a device-side schedule's constants), its measured split table, and tune's pure functions.

Planner tests run on a synthetic device (132 SMs, 4.35 TB/s) whose device table is a dict built in the test
(the ``table`` fixture), so they check the planner's rules, not whatever the shipped ``plans/h200.yaml`` holds;
tests of the shipped table itself are named ``test_shipped_h200_table_*``. What a plan does at given lengths is read
from :func:`attnplan.schedule.schedule_units` (the schedule every backend computes on the device).
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnplan
import attnplan.api as api
import attnplan.planner as planner
from attnplan.backends.reference import ReferenceBackend
from attnplan.config import MAX_SPLITS
from attnplan.device import DeviceInfo
from attnplan.planner import SplitPlan, TableRow, make_plan
from attnplan.schedule import (NUM_TARGETS, bucket_of, check_invariants, first_slots, is_long_tailed,
                               schedule_units)

GPU = DeviceInfo("Test GPU", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
H200 = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0), 227 * 1024, 50 * 2**20, 3350.0, "cuda-13.0")
KERNEL = {"block_n": 64}
CFG = attnplan.load_config()


def P(**kw):
    base = dict(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, q_len=1, page_size=16,
                q_dtype="bfloat16", kv_dtype="bfloat16", max_kv_len=32768)
    base.update(kw)
    if "total_kv_len" not in kw:
        base["total_kv_len"] = base["batch"] * base["max_kv_len"]
    return attnplan.DecodeProblem(**base)


def units(plan, lens) -> list[int]:
    """Units per sequence the plan's schedule gives ``lens``."""
    p = plan.problem
    return schedule_units(lens, plan.schedule, p.q_len, p.window_left).units.tolist()


def chosen(plan) -> int:
    """The cost model's rule applied to the plan's own candidates: the fewest splits within 2% of the best."""
    best = min(c[2] for c in plan.candidates)
    return min(n for n, _, t in plan.candidates if t <= 1.02 * best)


def _clear_tables():
    planner._ROWS.clear()
    for f in (api._tuned_lookup, api._table_text):
        f.cache_clear()


@pytest.fixture
def table(monkeypatch):
    """The device table every planner lookup reads (a dict the test fills); parsed rows are re-read at every lookup,
    so a test may change the dict between plans."""
    t: dict = {}

    def lookup(slug):
        planner._ROWS.clear()
        return t
    monkeypatch.setattr(planner, "device_table", lookup)
    monkeypatch.setattr(api, "device_table", lookup)
    _clear_tables()
    yield t
    _clear_tables()


# -- how many programs: counted per KV head, filling the SMs ------------------------------------------------------

def test_programs_counted_per_kv_head_fill_the_sms(table):
    """Batch 1, 32/8/128, 32K tokens on 132 SMs: one program serves a whole GQA group, so 8 (sequence, KV head)
    pairs need ~17+ units each to cover the SMs. Counting the 32 query heads instead would stop at ~4 splits (the
    under-split Dao-AILab/flash-attention#2901 fixes in FlashAttention's ROCm/CK heuristic, which counted query
    heads)."""
    plan = make_plan(P(), GPU, CFG, "x", KERNEL)
    (n,) = units(plan, [32768])
    assert n * 8 >= 132, plan.explain()
    assert n > 132 // 32
    assert plan.grid == (plan.schedule.max_units * 8,) and plan.num_programs == plan.grid[0]
    assert plan.schedule.max_units >= n


def test_batch_times_kv_heads_that_fill_the_sms_run_single_pass(table):
    """64 sequences x 8 KV heads = 512 programs cover 132 SMs: a live plan of uniform lengths does not split (no
    workspace but the targets table, no merge)."""
    plan = make_plan(P(batch=64, max_kv_len=4096), GPU, CFG, "x", KERNEL)
    assert plan.single_pass and plan.policy == "no-split" and plan.merge == "none"
    assert plan.num_splits == 1 and plan.grid == (64 * 8,) and plan.state_slots == 0
    assert plan.workspace_bytes == 4 * NUM_TARGETS and plan.meta_words == plan.sync_words == 0
    assert "no merge (the cost model's split count at the planned lengths is 1)" in plan.explain()
    assert make_plan(P(max_kv_len=64), GPU, CFG, "x", KERNEL).single_pass  # one granule: nothing to split


def test_fewer_sms_fewer_units(table):
    small = DeviceInfo("small", 16, (8, 6), 100 * 1024, 4 * 2**20, 900.0)
    a, b = make_plan(P(), GPU, CFG, "x", KERNEL), make_plan(P(), small, CFG, "x", KERNEL)
    assert units(a, [32768])[0] > units(b, [32768])[0]
    assert max(a.schedule.targets) > max(b.schedule.targets)


# -- the cost model: fewest splits within 2% of the best ---------------------------------------------------------

def test_cost_model_takes_the_fewest_splits_within_two_percent(table, monkeypatch):
    """With a cost curve that flattens, the planner takes the smallest split count within 2% of the best, not the
    best: 3 splits at 50.5 us beat 5 at 49.9 (threshold 50.9); 2 at 60 are out."""
    curve = {1: 100.0, 2: 60.0, 3: 50.5, 4: 50.0, 5: 49.9}
    monkeypatch.setattr(planner, "_cost_us", lambda prob, dev, cm, bw, splits, *a, **k: curve.get(splits, 80.0))
    cfg = CFG.with_overrides(split={"max_splits": 5})
    plan = make_plan(P(max_kv_len=4096), GPU, cfg, "x", KERNEL)
    assert plan.policy == "heuristic" and chosen(plan) == 3
    assert [c[0] for c in plan.candidates] == [1, 2, 3, 4, 5]
    assert units(plan, [4096]) == [3]
    assert plan.predicted_us == 50.5


def test_cost_model_candidates_are_aligned_to_the_granule(table):
    """Candidates are split counts after aligning chunks to the granule (lcm of block_n and the page size): each
    distinct count once, each chunk a multiple of the granule covering the length."""
    plan = make_plan(P(max_kv_len=8192, page_size=32), GPU, CFG, "x", {"block_n": 48})
    g = plan.schedule.granule
    assert g == 96
    seen = [n for n, _, _ in plan.candidates]
    assert len(seen) == len(set(seen))
    for n, chunk, _ in plan.candidates:
        assert chunk % g == 0 and n * chunk >= 8192 and (n - 1) * chunk < 8192


# -- the measured split table: nearest row within reach ----------------------------------------------------------

def test_split_table_row_sets_the_split_where_it_applies(table):
    """The nearest row within 4x (pairs and length) sets programs per SM: splits = round(ppsm x SMs / pairs), then
    aligned to whole granules; a long-tailed batch the row of a uniform batch at its longest length; elsewhere (out
    of reach, other head_dim, other backend, fp8 without its own rows) the cost model."""
    table["split_table"] = {"triton": {"paged": [[8, 131072, 4.0, 131.5], [32, 32768, 8.0, 0.0]],
                                       "contiguous": [[8, 131072, 2.0, 0.0]]}}
    big = P(max_kv_len=131072)
    plan = make_plan(big, GPU, CFG, "triton", KERNEL)
    assert plan.policy == "tuned" and plan.table_entry == TableRow(8, 131072, 4.0, 131.5)
    # round(4.0 x 132 / 8) = 66 splits of 1986 tokens -> chunks of 32 granules (2048 tokens) -> 64 units
    assert units(plan, [131072]) == [64]
    assert "measured split table" in plan.explain() and "4 programs per SM (131.5 us measured there)" in plan.explain()
    b4 = make_plan(P(batch=4, max_kv_len=32768), GPU, CFG, "triton", KERNEL)
    assert b4.policy == "tuned" and b4.table_entry.pairs == 32
    assert units(b4, [32768] * 4) == [32] * 4  # round(8 x 132 / 32) = 33 -> 1024-token chunks -> 32
    contig = make_plan(P(page_size=None, max_kv_len=65536), GPU, CFG, "triton", KERNEL)
    assert contig.policy == "tuned" and units(contig, [65536]) == [32]  # 33 -> 2048-token chunks -> 32
    tail = make_plan(P(batch=4, max_kv_len=131072, total_kv_len=131072 + 3000), GPU, CFG, "triton", KERNEL)
    assert tail.policy == "tuned" and tail.table_entry == TableRow(8, 131072, 4.0, 131.5)  # a tie: the first row
    assert "a long-tailed batch" in tail.explain() and not tail.schedule.single_pass
    # out of reach (16x fewer tokens), large heads, another backend: the cost model
    assert make_plan(P(max_kv_len=4096), GPU, CFG, "triton", KERNEL).policy == "heuristic"
    assert make_plan(P(head_dim=256, num_q_heads=16, max_kv_len=131072), GPU, CFG, "triton",
                     KERNEL).policy == "heuristic"
    assert make_plan(big, GPU, CFG, "cuda_ptx", KERNEL).policy == "heuristic"
    fp8 = P(max_kv_len=131072, kv_dtype="float8_e4m3fn")
    assert make_plan(fp8, GPU, CFG, "triton", KERNEL).policy == "heuristic"
    table["split_table"]["triton"]["paged_fp8"] = [[8, 131072, 2.0, 0.0]]
    f = make_plan(fp8, GPU, CFG, "triton", KERNEL)
    assert f.policy == "tuned" and f.table_entry == TableRow(8, 131072, 2.0, 0.0)
    assert units(f, [131072]) == [33]  # round(2 x 132 / 8) = 33 -> chunks of 63 granules (4032 tokens) -> 33
    assert SplitPlan.from_dict(json.loads(plan.to_json())) == plan  # a tuned plan survives the cache's JSON


def test_even_load_splits_leave_no_sm_far_above_the_mean():
    """``even_load_splits`` returns the first count from ``asked`` whose programs load the SMs within the bound,
    within ``most``; ``asked`` itself where it already does or none does."""
    from attnplan.planner import EVEN_LOAD_MAX_IMBALANCE as MAX, even_load_splits, load_imbalance

    assert load_imbalance(132, 132) == 1.0 and load_imbalance(264, 132) == 1.0
    assert load_imbalance(96, 132) == pytest.approx(132 / 96) and load_imbalance(133, 132) == pytest.approx(264 / 133)
    assert MAX == 1.10 and load_imbalance(240, 132) == pytest.approx(1.10)
    assert even_load_splits(5, 48, 132, 64) == 5  # 240 programs: exactly 1.10x, within the bound
    assert even_load_splits(3, 48, 132, 64) == 5  # 144 (1.83x) and 192 (1.38x) are not
    assert even_load_splits(3, 48, 132, 4) == 3  # nothing even within 4 splits: the row's count stands
    assert even_load_splits(1, 96, 132, 64) == 4  # 384 programs: 3 on the busiest SM, 2.9 on average
    assert even_load_splits(1, 192, 132, 64) == 2 and even_load_splits(1, 128, 132, 64) == 1


def test_a_row_carried_to_another_pair_count_loads_the_sms_evenly(table):
    """A row's split count carried to a problem of another pair count is raised until its programs load the SMs
    within ``EVEN_LOAD_MAX_IMBALANCE``, unless that would cut units below ``EVEN_LOAD_MIN_CHUNK`` tokens; at the row's
    own pair count the row is taken as measured. Measured on an H200 (cuda_ptx, 90K tokens): 64/8/128 at 96 pairs took
    the 128-pair rows' single pass (96 programs on 132 SMs), 1.09x slower than 9 splits."""
    table["split_table"] = {"triton": {"contiguous": [[128, 131072, 0.97, 500.0, 8, 128]]}}

    def plan(batch, kv):
        return make_plan(P(batch=batch, num_q_heads=64, page_size=None, max_kv_len=kv), GPU, CFG, "triton", KERNEL)
    own = plan(16, 131072)  # 128 pairs: round(0.97 x 132 / 128) = 1, as measured
    assert own.policy == "tuned" and own.schedule.single_pass
    carried = plan(12, 131072)  # 96 pairs: 1 split leaves 36 SMs idle; 4 splits put 3 programs on the busiest SM
    assert carried.policy == "tuned" and units(carried, [131072] * 12) == [4] * 12
    assert "carried from 128 to 96 pairs" in carried.explain() and "carried" not in own.explain()
    assert planner.load_imbalance(96 * 4, 132) <= planner.EVEN_LOAD_MAX_IMBALANCE
    shorter = plan(12, 1 << 16)  # 64K tokens: 4 splits of 16K tokens
    assert shorter.table_entry.kv_len == 131072 and units(shorter, [1 << 16] * 12) == [4] * 12
    table["split_table"]["triton"]["contiguous"] = [[128, 8192, 0.97, 40.0, 8, 128]]
    # 4K tokens: only 2 units of 2K tokens are allowed, and 1 or 2 load the SMs alike: the row stands
    assert plan(12, 4096).schedule.single_pass


def test_split_table_reach_is_four_times_in_pairs_and_length(table):
    table["split_table"] = {"triton": {"contiguous": [[8, 16384, 1.0, 10.0, 4, 128]]}}

    def policy(**kw):
        return make_plan(P(page_size=None, **kw), GPU, CFG, "triton", KERNEL).policy
    assert policy(max_kv_len=65536) == "tuned" and policy(max_kv_len=4096) == "tuned"  # exactly 4x
    assert policy(max_kv_len=131072) == "heuristic" and policy(max_kv_len=2048) == "heuristic"
    assert policy(batch=4, max_kv_len=16384) == "tuned"  # 32 pairs: 4x
    assert policy(batch=8, max_kv_len=16384) == "heuristic"  # 64 pairs: 8x


def test_split_table_prefers_rows_of_the_problems_own_heads(table):
    """Rows carry the group and head_dim they were measured with: a problem takes its own heads' row at its point,
    else the nearest with half the group distance added; head_dim 256 only from head_dim-256 rows; untagged rows
    lose ties to tagged ones."""
    table["split_table"] = {"triton": {"contiguous": [
        [8, 131072, 2.0, 100.0, 4, 128], [4, 131072, 8.0, 100.0, 8, 128], [8, 131072, 4.0, 100.0, 1, 128],
        [8, 65536, 4.0, 100.0, 2, 256]]}}
    big = dict(page_size=None, max_kv_len=131072)
    g4 = make_plan(P(**big), GPU, CFG, "triton", KERNEL)  # 32/8: group 4
    assert g4.table_entry == (8, 131072, 2.0, 100.0, 4, 128, ())
    g8 = make_plan(P(num_q_heads=64, **big), GPU, CFG, "triton", KERNEL)  # 64/8: group 8, no own row at 8 pairs
    assert g8.table_entry[:6] == (8, 131072, 2.0, 100.0, 4, 128)  # same pairs, group 4 beats 4 pairs of group 8
    g1 = make_plan(P(num_q_heads=8, **big), GPU, CFG, "triton", KERNEL)  # 8/8: group 1
    assert g1.table_entry[:6] == (8, 131072, 4.0, 100.0, 1, 128)
    d256 = make_plan(P(num_q_heads=16, head_dim=256, **big), GPU, CFG, "triton", KERNEL)
    assert d256.policy == "tuned" and d256.table_entry[:6] == (8, 65536, 4.0, 100.0, 2, 256)
    assert make_plan(P(num_q_heads=16, head_dim=192, **big), GPU, CFG, "triton", KERNEL).policy == "heuristic"
    # untagged rows count as head_dim 128, any group; a tagged row of the problem's head_dim at the same point wins
    table["split_table"]["triton"]["contiguous"] = [[8, 131072, 2.0, 90.0]]
    assert make_plan(P(num_q_heads=8, **big), GPU, CFG, "triton", KERNEL).table_entry[:3] == (8, 131072, 2.0)
    table["split_table"]["triton"]["contiguous"] = [[8, 131072, 2.0, 90.0], [8, 131072, 3.0, 90.0, 4, 128],
                                                    [8, 131072, 5.0, 90.0, 4, 64]]
    assert make_plan(P(**big), GPU, CFG, "triton", KERNEL).table_entry[:6] == (8, 131072, 3.0, 90.0, 4, 128)


def test_table_candidates_are_the_rows_in_reach_nearest_first(table):
    """``table_candidates`` lists the rows that may serve a problem with their distances, nearest first, equal
    distances in table order (so ``_table_entry``, its first, keeps the first of tied rows); rows beyond
    ``TABLE_REACH`` in pairs or length and rows of another head_dim are left out; it is empty where the table
    does not apply (long-tailed lengths, a CPU)."""
    rows = [[4, 65536, 0.5, 1.0, 4, 128], [16, 65536, 6.0, 1.0, 4, 128], [8, 16384, 1.0, 1.0, 4, 128],
            [8, 65536, 2.0, 1.0, 4, 128], [8, 1024, 3.0, 1.0, 4, 128], [8, 65536, 9.0, 1.0, 2, 256]]
    table["split_table"] = {"triton": {"contiguous": rows}}
    prob = P(page_size=None, batch=1, max_kv_len=45000)  # 8 pairs, 45000 tokens
    near = planner.table_candidates(prob, GPU, "triton")
    tr = [TableRow.from_row(r) for r in rows]
    # distances: log(65536 / 45000) = 0.38; log(45000 / 16384) = 1.01; log 2 + 0.38 = 1.07 for 4 and 16 pairs
    assert [r for _, r in near] == [tr[3], tr[2], tr[0], tr[1]]
    d = [x for x, _ in near]
    assert d == sorted(d) and math.isclose(d[0], math.log(65536 / 45000))
    assert d[2] == d[3]  # 4 and 16 pairs: equidistant, kept in table order
    assert planner._table_entry(prob, GPU, "triton") == tr[3]
    b2 = P(page_size=None, batch=2, num_q_heads=16, num_kv_heads=8, max_kv_len=65536)
    assert planner._table_entry(b2, GPU, "triton") == tr[1]  # 16 pairs at distance 0
    assert planner.table_candidates(P(page_size=None, batch=4, max_kv_len=45000, total_kv_len=45000 + 3 * 100),
                                    GPU, "triton") == []  # long-tailed lengths: the cost model
    cpu = dataclasses.replace(GPU, compute_capability=(0, 0))
    assert planner.table_candidates(prob, cpu, "triton") == []


def test_table_rows_parse_strictly():
    assert TableRow.from_row([8, 4096, 1.5, 9.0]) == TableRow(8, 4096, 1.5, 9.0, None, 128, ())
    assert TableRow.from_row([8, 4096, 1.5, 9.0, 4, 256, {"num_warps": 8, "num_stages": 2}]).options == (
        ("num_stages", 2), ("num_warps", 8))
    assert TableRow.from_row([8, 4096, 1.5, 9.0, 4, 256, [["num_warps", 8]]]).options == (("num_warps", 8),)
    shape = r"a split-table row is \[pairs, kv_len"
    for bad, msg in (([8, 4096, 1.5], shape), ("8,4096,1.5,9", shape), (None, shape),
                     ([8, "x", 1.5, 9.0], "kv_len must be an int in .*, got 'x'"),
                     ([8, 4096, 1.5, 9.0, 4, 128, "num_warps=8"], "options must be a mapping"),
                     ([8, 4096, 1.5, 9.0, 4, 128, [["num_warps"]]], "options must be a mapping")):
        with pytest.raises(ValueError, match=msg):  # the documented error, naming what is wrong
            TableRow.from_row(bad)


def test_cost_model_by_backend_overrides_device_constants(table):
    """A device table's per-backend constants apply to that backend's plans only."""
    from attnplan.planner import cost_model_for

    table.update({"cost_model": {"sat_programs_per_sm": 2.0, "programs_per_sm": 4, "mem_bandwidth_gbs": 4400.0},
                  "cost_model_by_backend": {"cuda_ptx": {"sat_programs_per_sm": 4.0}}})
    assert cost_model_for(GPU, CFG, "triton")[0].sat_programs_per_sm == 2.0
    assert cost_model_for(GPU, CFG, "cuda_ptx")[0].sat_programs_per_sm == 4.0
    assert cost_model_for(GPU, CFG, "cuda_ptx")[1] == 4400.0
    assert cost_model_for(attnplan.CPU_STANDIN, CFG, "cuda_ptx") == (CFG.cost_model,
                                                                     attnplan.CPU_STANDIN.mem_bandwidth_gbs)
    more = make_plan(P(max_kv_len=131072), GPU, CFG, "cuda_ptx", KERNEL)
    fewer = make_plan(P(max_kv_len=131072), GPU, CFG, "triton", KERNEL)
    assert units(more, [131072])[0] > units(fewer, [131072])[0]


# -- a tuned row's kernel options (plan_problem) -------------------------------------------------------------------

class RowOptionsBackend(ReferenceBackend):
    """A stand-in kernel backend for the API's row-options logic: options ``num_warps`` / ``threads`` (aliases, as
    cuda_ptx's), a KV tile of 16 tokens per warp, ``block_n`` a multiple of it (else ``ValueError``)."""

    name = "cuda_ptx"  # the config's options model for these keys
    option_aliases = (frozenset({"num_warps", "threads"}),)

    def kernel_config(self, problem, options, device):
        warps = options.get("num_warps") or (options["threads"] // 32 if options.get("threads") else 4)
        block_n = options.get("block_n") or 16 * warps
        if block_n % (16 * warps):
            raise ValueError(f"block_n {block_n} must be a multiple of 16 x num_warps")
        return {"block_n": block_n, "num_warps": warps, "threads": 32 * warps,
                "num_stages": options.get("num_stages") or 3}


def _plan_rows(page_size=None, cfg=None, window_left=-1, **kw):
    """plan_problem for the stand-in backend on the synthetic device: 16 sequences of 16K tokens, 8/1/128."""
    prob = P(batch=16, num_q_heads=8, num_kv_heads=1, page_size=page_size, max_kv_len=16384,
             window_left=window_left)
    ctx = api.Context.from_config(cfg or attnplan.load_config(plan_cache={"disk": False}))
    return api.plan_problem(prob, RowOptionsBackend(), torch.device("cpu"), ctx, dev_info=GPU, **kw)


def test_a_tuned_rows_kernel_options_go_with_its_split_count(table):
    """``tune --row-options`` writes the kernel options a row's split count was measured with as its seventh
    field; the planner runs them with that count over the table's per-layout options, and not when the count is
    forced, the config sets the backend's options itself, or the options do not fit the problem's kernel. Measured
    on an H200: cuda_ptx with 8 KV warps beat 4 warps, each at its best split count, by 3-11% at 16-64 pairs."""
    table.update({
        "kernel_options": {"cuda_ptx": {"contiguous": {"num_warps": 4}}},
        "split_table": {"cuda_ptx": {"contiguous": [[16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}]],
                                     "paged": [[16, 16384, 0.61, 42.2, 8, 128]]}}})
    p = _plan_rows()
    assert p.policy == "tuned" and dict(p.table_entry.options) == {"num_warps": 8}
    assert p.kernel["num_warps"] == 8 and p.kernel["threads"] == 256  # the row's, over the table's 4
    assert units(p, [16384] * 16) == [5] * 16  # round(0.61 x 132 / 16) = 5 units
    assert "{'num_warps': 8} (applied)" in p.explain()
    assert SplitPlan.from_dict(json.loads(p.to_json())) == p
    assert _plan_rows(page_size=16).kernel["num_warps"] == 4  # a row without options: the table's options
    forced = _plan_rows(num_splits=5)
    assert forced.policy == "forced" and forced.kernel["num_warps"] == 4
    own = _plan_rows(cfg=attnplan.load_config(plan_cache={"disk": False},
                                              backend_options={"cuda_ptx": {"threads": 64}}))
    assert own.policy == "tuned" and own.kernel["num_warps"] == 2  # the config's threads, not the row's warps
    assert "(not applied" in own.explain()
    table["split_table"]["cuda_ptx"]["contiguous"][0][6] = {"block_n": 24}  # not a multiple of the tile
    bad = _plan_rows()
    assert bad.policy == "tuned" and bad.kernel["num_warps"] == 4 and units(bad, [16384] * 16) == [5] * 16
    table["split_table"]["cuda_ptx"]["contiguous"][0][6] = "num_warps=8"  # not a mapping: refused by name
    with pytest.raises(ValueError, match="options must be a mapping"):
        _plan_rows()


def test_a_windowed_problem_takes_options_and_splits_from_one_row(table):
    """A sliding window plans its window's span, so its split count can come from another row than the full
    length's, or from the cost model: the options must come with the row that made the plan."""
    table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}], [16, 1024, 1.0, 12.0, 8, 128, {"num_warps": 2}]]}}})
    w = _plan_rows(window_left=1023)
    assert w.policy == "tuned" and w.table_entry.kv_len == 1024 and w.kernel["num_warps"] == 2
    tiny = _plan_rows(window_left=63)  # a 64-token span: no row within reach, the cost model plans one pass
    assert tiny.policy == "no-split" and tiny.table_entry is None and tiny.kernel["num_warps"] == 4


def test_capacity_plan_scales_rows_of_other_warps_to_its_own(table):
    """A capacity plan runs one row's options at every live length, so a bucket planned from a row measured with
    other warps per program gets that row's split count scaled by the ratio of warps (the same warps per SM,
    planner.row_programs_per_sm); a live plan, whose own row's options apply, is unchanged."""
    table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}], [16, 131072, 4.0, 252.0, 8, 128, {"num_warps": 2}]]}}})
    assert planner.row_programs_per_sm(planner.TableRow(16, 16384, 0.61, 40.6, 8, 128, (("num_warps", 8),)), 2) \
        == pytest.approx(2.44)
    assert planner.row_programs_per_sm(planner.TableRow(16, 16384, 0.61, 40.6, 8, 128, ()), 2) == 0.61
    # up to the saturation point (2.8 programs of 4 warps = 5.6 of 2): 0.61 x 4 stays under it
    assert planner.row_programs_per_sm(planner.TableRow(16, 16384, 0.61, 40.6, 8, 128, (("num_warps", 8),)), 2, 2.8) \
        == pytest.approx(2.44)
    past = planner.TableRow(512, 4096, 3.879, 250.0, 4, 128, (("num_warps", 8),))  # already past saturation
    assert planner.row_programs_per_sm(past, 4, 2.8) == pytest.approx(3.879)
    assert planner.row_programs_per_sm(past, 4) == pytest.approx(7.758)
    assert planner.row_programs_per_sm(planner.TableRow(16, 16384, 1.5, 40.6, 8, 128, (("num_warps", 8),)), 4, 2.0) \
        == pytest.approx(2.0)  # 3.0 capped at 2 programs of 4 warps
    assert planner.row_programs_per_sm(past, 16, 2.8) == pytest.approx(1.9395)  # scaled down: as the ratio says
    prob = P(batch=16, num_q_heads=8, num_kv_heads=1, page_size=None, max_kv_len=131072, capacity=131072)
    ctx = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    cap = api.plan_problem(prob, RowOptionsBackend(), torch.device("cpu"), ctx, dev_info=GPU, capacity_mode=True)
    assert cap.kernel["num_warps"] == 2 and dict(cap.table_entry.options) == {"num_warps": 2}
    live = _plan_rows()  # 16 x 16K: the 8-warp row's own plan, 5 units per sequence
    assert live.kernel["num_warps"] == 8 and units(live, [16384] * 16) == [5] * 16
    # at 16 x 16K the capacity plan's bucket comes from the same row, scaled to 2 warps: 4x the programs (the long
    # tail table's scale aside, a uniform batch reads the uniform targets)
    assert sum(units(cap, [16384] * 16)) >= 3.5 * 5 * 16
    # a live plan runs its row's split count as measured, whatever warps it runs (the config's 2 here)
    own = _plan_rows(cfg=attnplan.load_config(plan_cache={"disk": False},
                                              backend_options={"cuda_ptx": {"threads": 64}}))
    assert own.kernel["num_warps"] == 2 and units(own, [16384] * 16) == [5] * 16


def test_a_long_tailed_key_stays_long_tailed():
    """The plan-cache key's mean bucket: a long-tailed batch (mean below half the longest) whose mean rounds up to
    half the longest's bucket gets a quarter, so its bucketed problem is long-tailed too; a near-uniform batch keeps
    its mean's bucket. The hit path's key (static_bucket_key) is the same."""
    from attnplan.problem import DecodeProblem, mean_bucket
    assert mean_bucket(16 * 21146, 16, 63952) == 16384  # mean 0.33 of the longest: 32K would say near-uniform
    assert mean_bucket(16 * 31000, 16, 33000) == 32768  # near-uniform across a power of two: kept
    assert mean_bucket(16 * 3000, 16, 131072) == 4096  # already a quarter or less: kept
    assert mean_bucket(16 * 40000, 16, 65536) == 65536
    for lens in ([63952] + [19225] * 15, [33000] * 8 + [29000] * 8, [131072] + [100] * 15, [20] * 3 + [16] * 5):
        prob = P(batch=len(lens), max_kv_len=max(lens), total_kv_len=sum(lens))
        b = prob.bucketed()
        assert (2 * b.total_kv_len < b.batch * b.max_kv_len) == (2 * sum(lens) < len(lens) * max(lens))
        static = {k: getattr(prob, k) for k in ("batch", "num_q_heads", "num_kv_heads", "head_dim", "q_len",
                                                "page_size", "q_dtype", "kv_dtype", "window_left", "soft_cap",
                                                "has_sinks", "kv_scale")}
        assert DecodeProblem.static_bucket_key(static, max(lens), sum(lens)) == prob.bucket_key() == b.bucket_key()


def test_a_long_tailed_live_plan_is_planned_as_a_capacity_plan(table):
    """A live long-tailed batch takes the split-table row of a uniform batch at its longest length, with the row's
    kernel options and its buckets scaled to them, never a single pass: its plan is the capacity plan of that
    length. Measured on an H200: 16/8/256 b16 with a mean of 0.33 of the longest ran its 64K row's single pass,
    1,104 us against 666 for its capacity plan; 8/1/128 b64 with one 128K sequence ran the cost model's split with
    the backend's default options, 50 against 40 us."""
    table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 65536, 0.12, 0.0, 8, 128, {"num_warps": 8}], [16, 16384, 4.0, 0.0, 8, 128, {"num_warps": 2}]]}}})
    ctx = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    lens = [63952, 40000] + [17850] * 14  # mean 0.33 of the longest
    base = dict(batch=16, num_q_heads=8, num_kv_heads=1, page_size=None, capacity=65536)
    prob = P(max_kv_len=max(lens), total_kv_len=sum(lens), **base)
    live = api.plan_problem(prob, RowOptionsBackend(), torch.device("cpu"), ctx, dev_info=GPU)
    assert not live.schedule.single_pass and live.policy == "tuned"
    assert live.table_entry.kv_len == 65536 and live.kernel["num_warps"] == 8  # the longest length's row, applied
    assert "a long-tailed batch" in live.explain(lens)
    cap = api.plan_problem(P(max_kv_len=65536, **base), RowOptionsBackend(), torch.device("cpu"), ctx, dev_info=GPU,
                           capacity_mode=True)
    assert cap.kernel == live.kernel and cap.merge == live.merge
    u_live, u_cap = units(live, lens), units(cap, lens)
    assert u_live == u_cap and max(u_live) > 1  # the long sequence spread, as the capacity plan spreads it
    # a near-uniform batch of the same buckets is still the row's single pass
    even = [64000] * 8 + [60000] * 8
    near = api.plan_problem(P(max_kv_len=max(even), total_kv_len=sum(even), **base), RowOptionsBackend(),
                            torch.device("cpu"), ctx, dev_info=GPU)
    assert near.schedule.single_pass and near.kernel["num_warps"] == 8


def test_batch_invariant_plans_take_no_row_options(table):
    table.update({"split_table": {"cuda_ptx": {"contiguous": [[16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}]]}}})
    p = _plan_rows(cfg=attnplan.load_config(plan_cache={"disk": False}, split={"batch_invariant": True}))
    assert p.policy == "batch-invariant" and p.table_entry is None and p.kernel["num_warps"] == 4


# -- policies ------------------------------------------------------------------------------------------------------

def test_forced_split_count(table):
    """``num_splits = n > 1``: up to n equal units per sequence, whatever the batch; a short sequence gets one unit
    per granule at most."""
    plan = make_plan(P(batch=3, max_kv_len=4096, page_size=None), GPU, CFG, "x", {"block_n": 16}, num_splits=16)
    assert plan.policy == "forced" and plan.schedule.policy == "forced" and plan.num_splits == 16
    assert not any(plan.schedule.targets) and plan.merge in ("separate", "fused")
    assert units(plan, [4096, 40, 0]) == [16, 3, 1]  # 40 tokens = 3 granules of 16; an empty sequence: 1 empty unit
    assert plan.schedule.max_units == 3 * 16
    assert "split count forced: up to 16 equal units" in plan.explain()
    cfg = CFG.with_overrides(split={"num_splits": 7})
    assert units(make_plan(P(max_kv_len=8192), GPU, cfg, "x", KERNEL), [8192]) == [7]


def test_no_split_policy(table):
    plan = make_plan(P(batch=2), GPU, CFG.with_overrides(split={"num_splits": 1}), "x", KERNEL)
    assert plan.policy == "no-split" and plan.single_pass and plan.merge == "none" and plan.grid == (2 * 8,)
    assert units(plan, [32768, 5]) == [1, 1]
    assert "no merge (num_splits = 1)" in plan.explain()
    cap = make_plan(P(batch=2, capacity=32768), GPU, CFG, "x", KERNEL, capacity_mode=True, num_splits=1)
    assert cap.single_pass  # num_splits 1 is single pass even for a capacity plan


def test_explain_names_why_a_plan_is_single_pass(table):
    """The cost model asks for splits at the planned lengths, but the targets give the middle of the lengths the plan
    serves (1/sqrt(2) of the planned ones) one unit per sequence: explain() says which of the three reasons made the
    plan single pass."""
    plan = make_plan(P(batch=48, num_q_heads=28, num_kv_heads=4, max_kv_len=1000).bucketed(), GPU, CFG, "x", KERNEL)
    assert plan.policy == "no-split" and plan.single_pass and chosen(plan) > 1
    text = plan.explain()
    assert "(the targets give one unit per sequence at the middle of the lengths the plan serves)" in text, text
    assert "cost model's split count" not in text and "num_splits = 1" not in text


def test_batch_invariant_policy(table):
    """``split.batch_invariant``: units of ``invariant_chunk_tokens`` (rounded up to the granule) from each
    sequence's own length, no targets, the separate merge even where ``auto`` would fuse."""
    cfg = CFG.with_overrides(split={"batch_invariant": True, "invariant_chunk_tokens": 1000})
    plan = make_plan(P(batch=4, max_kv_len=8192), GPU, cfg, "x", KERNEL, merge_strategies=frozenset({"separate",
                                                                                                   "fused"}))
    s = plan.schedule
    assert plan.policy == "batch-invariant" and s.policy == "batch_invariant" and not any(s.targets)
    assert s.min_unit_granules * s.granule == 1024 and plan.merge == "separate"
    assert units(plan, [8192, 1024, 1025, 0]) == [8, 1, 2, 1]
    alone = schedule_units([5000], s)
    mates = schedule_units([8192, 1, 5000, 3], s)
    assert mates.start[int(mates.indptr[2]):int(mates.indptr[3])].tolist() == alone.start.tolist()
    assert "batch-invariant: units of 1024 tokens" in plan.explain()


@pytest.mark.parametrize("batch,cap", [(64, 4096), (1, 64), (32, 131072), (4, 200)])
def test_capacity_plans_are_never_single_pass(table, batch, cap):
    """A capacity plan (for CUDA graphs) keeps a split schedule even where the planned lengths would run single pass,
    so a long sequence in a later batch is still spread: one sequence at the capacity among empty ones gets many
    units wherever the capacity spans several granules."""
    plan = make_plan(P(batch=batch, max_kv_len=cap, capacity=cap), GPU, CFG, "x", KERNEL, capacity_mode=True)
    assert plan.capacity_mode and not plan.single_pass and plan.merge != "none"
    lens = [cap] + [0] * (batch - 1)
    u = check_invariants(lens, plan.schedule)
    if cap >= 4 * 64:
        assert int(u.units[0]) > 1
    check_invariants([cap] * batch, plan.schedule)
    assert "capacity plan (CUDA graphs)" in plan.explain()


def test_long_tailed_batch_spreads_the_long_sequence(table):
    """16 sequences x 8 KV heads = 128 programs nearly fill 132 SMs, but one 128K sequence among short ones would
    leave a single program streaming 32 MiB: the balanced schedule gives it many units, each short one one."""
    plan = make_plan(P(batch=16, max_kv_len=131072, total_kv_len=131072 + 15 * 500), GPU, CFG, "x", KERNEL)
    u = units(plan, [131072] + [500] * 15)
    assert u[0] >= 8 and u[1:] == [1] * 15, plan.explain()
    assert "heaviest program" in plan.explain([131072] + [500] * 15)


def test_min_chunk_and_max_splits_are_respected(table):
    plan = make_plan(P(max_kv_len=131072), GPU, CFG.with_overrides(split={"max_splits": 4}), "x", KERNEL)
    assert plan.num_splits == 4 and units(plan, [131072]) == [4]
    plan = make_plan(P(max_kv_len=16384), GPU, CFG.with_overrides(split={"min_chunk_tokens": 4096}), "x", KERNEL)
    s = plan.schedule
    assert s.min_unit_granules * s.granule >= 4096 and units(plan, [16384])[0] <= 4
    assert all(c[1] >= 4096 for c in plan.candidates)


def test_a_tuned_row_is_capped_by_max_splits_and_predicts_what_runs(table):
    """A split-table row asking for more units than ``split.max_splits`` (round(4 x 132 / 8) = 66) runs max_splits,
    and the plan's prediction is the cost of those 8 units, not of the row's 66: several times the uncapped plan's."""
    table["split_table"] = {"triton": {"paged": [[8, 131072, 4.0, 131.5]]}}
    free = make_plan(P(max_kv_len=131072), GPU, CFG, "triton", KERNEL)
    capped = make_plan(P(max_kv_len=131072), GPU, CFG.with_overrides(split={"max_splits": 8}), "triton", KERNEL)
    assert free.policy == capped.policy == "tuned"
    assert units(capped, [131072]) == [8] and units(free, [131072]) == [64]
    assert capped.predicted_us > 1.5 * free.predicted_us, (capped.predicted_us, free.predicted_us)


@pytest.mark.parametrize("max_kv_len", [1, 15, 16, 17, 1000, 4096, 131072])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_granule_aligns_and_units_cover_every_token(table, max_kv_len, batch):
    plan = make_plan(P(batch=batch, max_kv_len=max_kv_len), GPU, CFG, "x", KERNEL)
    assert plan.schedule.granule % 64 == 0 and plan.schedule.granule % 16 == 0
    plan.validate(plan.problem)
    g = torch.Generator().manual_seed(batch * 7919 + max_kv_len)
    for lens in ([max_kv_len] * batch, torch.randint(0, max_kv_len + 1, (batch,), generator=g).tolist()):
        check_invariants(lens, plan.schedule)


def test_kernel_without_block_n_and_a_huge_capacity_are_refused(table):
    for bad in ({}, {"block_n": 0}, {"block_n": True}, {"block_n": "64"}):
        with pytest.raises(ValueError, match="block_n"):
            make_plan(P(), GPU, CFG, "x", bad)
    with pytest.raises(ValueError, match="2\\^31 granules"):
        make_plan(P(batch=1 << 16, max_kv_len=1 << 21, capacity=1 << 21), GPU, CFG, "x", {"block_n": 16},
                  capacity_mode=True)


# -- targets: a uniform batch gets the live plan's split -----------------------------------------------------------

def _bucket_length(k: int, granule: int, batch: int) -> int:
    """Tokens per sequence of a uniform batch of the granules bucket k's target is planned at (the one power of two
    the bucket holds, near the geometric middle of its totals)."""
    from attnplan.planner import _bucket_granules

    return _bucket_granules(k) * granule // batch


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_targets_give_a_uniform_batch_the_live_plans_split(table, batch):
    """For every bucket of total work, a live plan's target is the split its cost model picks for a uniform batch of
    that much work, times the batch: the schedule then gives each sequence of that uniform batch exactly the live
    plan's split count."""
    checked = 0
    for k in range(6, 16):
        length = _bucket_length(k, 64, batch)
        if length < 64:
            continue
        plan = make_plan(P(batch=batch, max_kv_len=length), GPU, CFG, "x", KERNEL)
        if plan.single_pass:
            continue
        u = schedule_units([length] * batch, plan.schedule)
        assert bucket_of(u.total_granules) == k
        assert u.units.tolist() == [chosen(plan)] * batch, (k, length, plan.schedule.targets[k])
        checked += 1
    assert checked >= 5


def test_a_uniform_batch_at_a_power_of_two_length_gets_the_live_plans_split(table):
    """A uniform batch of a power-of-two batch and length (where live plans are made, ``len_bucket``, and split-table
    rows measured) totals its bucket's power of two, where the bucket is planned: the schedule gives it exactly the
    split the live plan chooses. (Planned at the bucket's geometric middle, b1 32/8/128 at 4,096 tokens, 64 granules,
    chose 32 splits and ran 22: the middle's 30 units made granules per unit ceil(64 / 30) = 3.)"""
    checked = 0
    for b in (1, 4, 16):
        for length in (1024, 2048, 4096, 16384, 65536, 131072):
            plan = make_plan(P(batch=b, max_kv_len=length), GPU, CFG, "x", KERNEL)
            if plan.single_pass:
                continue
            assert units(plan, [length] * b) == [chosen(plan)] * b, (b, length)
            checked += 1
    assert checked >= 12


def test_a_capacity_plan_schedules_uniform_batches_like_live_plans(table):
    """Targets are the live plans' split counts, so a capacity plan gives a uniform batch the units a live plan made
    for that length gives it (where the live plan splits at all)."""
    compared = 0
    for b in (1, 4, 16):
        cap = make_plan(P(batch=b, max_kv_len=131072, capacity=131072), GPU, CFG, "x", KERNEL, capacity_mode=True)
        for length in (1024, 4096, 16384, 32768, 131072):
            live = make_plan(P(batch=b, max_kv_len=length, capacity=131072), GPU, CFG, "x", KERNEL)
            if live.single_pass:
                continue
            assert units(cap, [length] * b) == units(live, [length] * b), (b, length)
            compared += 1
    assert compared >= 12


# -- merge choice --------------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 300)), min_size=1, max_size=40))
def test_fused_merge_team_counters_never_overlap(seqs):
    """The two-level fused merge's team counters (``SplitPlan.sync_words``): team ``j`` of sequence ``b`` counts at
    ``batch + first[b] + j FUSED_TEAM_UNITS`` (its first unit's slot), where ``first`` comes from
    :func:`~attnplan.schedule.first_slots` (longest units first for batches of at most 32: not in sequence order). No
    two teams share a counter, none is a group counter, and all lie below ``batch + U`` for ``U`` units in all. This
    checks the layout ``sync_words`` sizes, with the index written out here as in ``decode.cu``; the kernel's own
    index is checked by the emulated two-level test, whose counters are left non-zero by a colliding index."""
    T = planner.FUSED_TEAM_UNITS
    cb = torch.tensor([c for c, _ in seqs], dtype=torch.int64)
    units = torch.tensor([n for _, n in seqs], dtype=torch.int64)
    first = first_slots(cb, units).tolist()
    batch, total = len(seqs), int(units.sum())
    idx = [batch + f + j * T for f, n in zip(first, units.tolist()) if n > T for j in range(-(-n // T))]
    assert len(set(idx)) == len(idx)
    assert all(batch <= i < batch + total for i in idx)


def test_fused_merge_parallelism_moves_the_merge_choice(table):
    """The cost model charges the fused merge's last program one round trip per split; a backend whose last program
    reads many splits at once (fused_merge_parallelism 16) gets ``fused`` at short KV and still ``separate`` at 64
    splits; parallelism 1 (splits one after another) does not get it. Measured on an H200: cuda_ptx's fused merge
    was 1.1-2.1 us faster than its merge kernel up to 16 splits, Triton's 1-8 us slower."""
    both = frozenset({"separate", "fused"})
    forced = {n: make_plan(P(page_size=None, max_kv_len=4096), GPU, CFG, "x", KERNEL, num_splits=n,
                           merge_strategies=both, fused_merge_parallelism=16) for n in (16, 64)}
    assert forced[16].merge == "fused" and forced[64].merge == "separate"
    # 8 (sequence, KV head) counters, then one per unit slot and KV head (the two-level fused merge's team counters)
    assert forced[16].schedule.max_units == 16 and forced[16].sync_words == 8 + 16 * 8 and forced[16].meta_words == 0
    assert forced[64].meta_words == 2 and forced[64].sync_words == 0
    serial = make_plan(P(page_size=None, max_kv_len=4096), GPU, CFG, "x", KERNEL, num_splits=16,
                       merge_strategies=both, fused_merge_parallelism=1)
    assert serial.merge == "separate"
    only = make_plan(P(page_size=None, max_kv_len=4096), GPU, CFG.with_overrides(split={"merge": "fused"}), "x",
                     KERNEL, num_splits=16)
    assert only.merge == "separate"  # a backend without the fused merge falls back


def test_fused_merge_max_chunk_caps_the_fused_choice(table):
    """A backend whose fused specialization streams long chunks slower gets ``fused`` from ``auto`` only up to its
    cap (in tokens)."""
    both = frozenset({"separate", "fused"})

    def merge_at(kv):
        return make_plan(P(page_size=None, max_kv_len=kv), GPU, CFG, "x", KERNEL, num_splits=4,
                         merge_strategies=both, fused_merge_parallelism=16, fused_merge_max_chunk=2048).merge

    assert merge_at(4096) == "fused"       # 4 chunks of 1024 tokens
    assert merge_at(65536) == "separate"   # 4 chunks of 16384


# -- validate, serialization, explain ------------------------------------------------------------------------------

def test_plan_is_frozen_hashable_and_round_trips(table):
    plan = make_plan(P(), GPU, CFG, "x", {"block_n": 64, "num_warps": 4})
    again = SplitPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan and hash(again) == hash(plan) and {plan: 1}[again] == 1
    assert plan.device.sm_count == 132 and plan.device.cc == (9, 0) and plan.kernel["num_warps"] == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.merge = "fused"
    with pytest.raises(TypeError):
        plan.kernel["block_n"] = 32


@pytest.mark.parametrize("field,value", [
    ("batch", 2), ("num_q_heads", 16), ("num_kv_heads", 4), ("head_dim", 64), ("q_len", 2), ("page_size", 32),
    ("q_dtype", "float16"), ("kv_dtype", "float16"), ("window_left", 100), ("soft_cap", 30.0), ("has_sinks", True),
])
def test_validate_refuses_a_problem_the_plan_does_not_fit(table, field, value):
    plan = make_plan(P(capacity=32768), GPU, CFG, "x", KERNEL)
    plan.validate(P(capacity=32768, max_kv_len=100))  # shorter live lengths: the plan serves them
    with pytest.raises(ValueError, match=field):
        plan.validate(P(capacity=32768, **{field: value}))
    with pytest.raises(ValueError, match="capacity"):
        plan.validate(P(capacity=65536, max_kv_len=65536))


def test_validate_refuses_an_inconsistent_plan(table):
    from attnplan.schedule import Schedule

    plan = make_plan(P(batch=2, capacity=32768), GPU, CFG, "x", KERNEL, capacity_mode=True)
    s = plan.schedule
    bad = {  # the plan, then the message validate() and from_dict() refuse it with (a ValueError each)
        "merge none with units": (dataclasses.replace(plan, merge="none"), "merge 'none' does not fit"),
        "block_n not dividing the granule": (dataclasses.replace(plan, kernel=planner.KernelOptions(block_n=48)),
                                             "block_n 48 must be a positive int dividing the granule"),
        "max_units below the bound": (
            dataclasses.replace(plan, schedule=dataclasses.replace(s, max_units=s.max_units - 1)),
            "below the schedule's bound"),
        "granule not a multiple of the page": (dataclasses.replace(plan, kernel=planner.KernelOptions(block_n=8),
                                                                   schedule=dataclasses.replace(s, granule=8)),
                                               "granule 8 must be a multiple of the page size 16"),
        "single pass over fewer slots than sequences": (dataclasses.replace(
            plan, merge="none", schedule=Schedule("single", s.granule, 1, 1, (0,) * NUM_TARGETS, 1)),
            "max_units 1 must cover the batch 2"),
        "single pass over more slots than sequences": (dataclasses.replace(
            plan, merge="none", schedule=Schedule("single", s.granule, 1, 1, (0,) * NUM_TARGETS, 3)),
            "one slot per sequence: max_units 3 is not the batch 2"),
        "unknown policy": (dataclasses.replace(plan, policy="magic"), "policy 'magic' unknown"),
        "tuned without its table row": (dataclasses.replace(plan, policy="tuned", table_entry=None),
                                        "names the split-table row it used"),
        "old version": (dataclasses.replace(plan, version=1), "plan version 1 is not"),
    }
    for name, (p, msg) in bad.items():
        with pytest.raises(ValueError, match=msg):
            p.validate()
        with pytest.raises(ValueError, match=msg):
            SplitPlan.from_dict(json.loads(json.dumps(p.to_dict())))


def test_from_dict_refuses_what_to_dict_never_writes(table):
    """A plan file's schedule with an unknown key, targets as a mapping, a key missing, or a predicted time as an int
    too large for a float: each the error from_dict() documents, naming the field (an unknown key was ignored, a
    mapping's keys taken as the targets, and a 400-digit time raised OverflowError)."""
    plan = make_plan(P(batch=2, capacity=32768), GPU, CFG, "x", KERNEL, capacity_mode=True)
    for edit, err, msg in (
            (lambda d: d["schedule"].update(zzz=1), ValueError, r"plan schedule: unknown schedule keys \['zzz'\]"),
            (lambda d: d["schedule"].update(targets=dict.fromkeys(range(NUM_TARGETS), 0)), TypeError,
             "schedule targets must be a list of ints, got dict"),
            (lambda d: d["schedule"].pop("granule"), KeyError, "plan schedule: key granule missing"),
            (lambda d: d.update(predicted_us=10**400), ValueError, "plan predicted_us must be a finite number"),
            (lambda d: d.update(candidates=[[2, 1024, 10**400]]), ValueError,
             "plan candidate predicted_us must be a finite number")):
        d = json.loads(plan.to_json())
        edit(d)
        with pytest.raises(err, match=msg):
            SplitPlan.from_dict(d)
    assert SplitPlan.from_dict(json.loads(plan.to_json())) == plan


def test_explain_lines(table):
    plan = make_plan(P(batch=2, max_kv_len=32768), GPU, CFG, "x", KERNEL)
    text = plan.explain()
    lines = text.splitlines()
    assert lines[0] == "backend x on Test GPU (132 SMs, compute capability 9.0)"
    assert "GQA group 4" in lines[1] and "paged, page 16" in lines[1] and "planned for sequences of up to 32768" in lines[1]
    assert lines[2] == "(sequence, KV head) pairs: 16 (one program per GQA group and unit) on 132 SMs"
    assert lines[3].startswith("cost model at the planned length") and "the fewest splits within 2%" in lines[3]
    s = plan.schedule
    assert f"grid {s.max_units} unit slots x 8 KV heads = {plan.num_programs} programs" in text
    n = units(plan, [32768, 32768])[0]
    assert f"at planned lengths: {2 * n} units ({n}-{n} per sequence) = {2 * n * 8} programs with work" in text
    assert "merge: " in text and "predicted" in lines[-1] and "workspace" in lines[-1]
    m = units(plan, [32768, 0])
    assert m[1] == 1 and m[0] > 1
    # the empty sequence's one unit reads nothing: not a program with work, and not in the mean
    assert (f"at these lengths: {sum(m)} units (1-{m[0]} per sequence) = {m[0] * 8} programs with work "
            f"(+8 of empty sequences); heaviest program") in plan.explain([32768, 0])
    # sizes under 0.1 MiB in KiB (both numbers of the line in one unit), and one KV head is one head
    small = make_plan(P(batch=2, num_q_heads=8, num_kv_heads=1, max_kv_len=300), GPU, CFG, "x", KERNEL)
    line = [ln for ln in small.explain([300, 100]).splitlines() if "heaviest program" in ln][0]
    assert "KiB of KV vs mean" in line and line.count(" KiB") == 2 and "MiB" not in line
    assert " x 1 KV head = " in small.explain()
    cpu = make_plan(P(), attnplan.CPU_STANDIN, CFG, "x", KERNEL)
    assert "stand-in" in cpu.explain() and "predicted" not in cpu.explain().splitlines()[-1]


# -- the shipped H200 table ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [H200, H100], ids=lambda d: d.slug())
def test_shipped_table_rows_parse_and_plan(device):
    """Every row of a packaged split table (plans/h200.yaml, plans/h100_80gb_hbm3.yaml) parses into a TableRow, and for
    every 2-byte row (the ``contiguous`` and ``paged`` sections, every head configuration) a uniform batch at its point
    (its pairs as 8 KV heads where they divide by 8, else one; its GQA group and head_dim) plans from that row and runs
    the row's own split count: ``round(programs per SM x SMs / pairs)``, aligned to whole granules. (With buckets
    planned at 1.4x a power-of-two total, the H100's 64K row of 32/8/128 at 4 sequences, 3 units, ran the 128K row's
    13.)"""
    from attnplan.config import device_table

    _clear_tables()
    sections = device_table(device.slug())["split_table"]
    heads = set()
    for backend, layouts in sections.items():
        for layout, rows in layouts.items():
            for r in rows:
                row = TableRow.from_row(r)
                assert row.pairs >= 1 and row.kv_len >= 1 and row.programs_per_sm > 0 and row.us > 0
            if layout not in ("contiguous", "paged"):
                continue
            for row in (TableRow.from_row(r) for r in rows):
                assert row.group is not None and row.head_dim is not None, (backend, layout, row)
                heads.add((row.group, row.head_dim))
                hkv = 8 if row.pairs % 8 == 0 else 1
                b, length = row.pairs // hkv, row.kv_len
                plan = make_plan(P(page_size=None if layout == "contiguous" else 16, batch=b, num_kv_heads=hkv,
                                   num_q_heads=row.group * hkv, head_dim=row.head_dim, max_kv_len=length),
                                 device, CFG, backend, KERNEL)
                entry = plan.table_entry
                assert plan.policy == "tuned" and entry is not None, (backend, layout, row)
                assert (entry.pairs, entry.kv_len, entry.group, entry.head_dim) == \
                    (row.pairs, row.kv_len, row.group, row.head_dim), (backend, layout, row)
                want = min(CFG.split.max_splits, length // 64,
                           max(1, round(row.programs_per_sm * device.sm_count / row.pairs)))
                chunk = -(-(-(-length // want)) // 64) * 64
                assert units(plan, [length] * b) == [-(-length // chunk)] * b, (backend, layout, row)
    # the table's 2-byte rows hold the benchmark grid's heads at least (32/8/128; 8/1/128 and 64/8/128; 28/4/128;
    # 32/32/128; 16/8/256)
    assert heads >= {(4, 128), (8, 128), (7, 128), (1, 128), (2, 256)}, heads


def test_explain_names_the_granules_per_unit_against_the_target():
    """explain()'s units line ends with the granules per unit the batch's total gets and the target it was divided
    into (whole granules per unit: a total just above a target gets 2 a unit, about half the units asked for); a
    schedule without targets (a forced split count) has no such clause."""
    plan = make_plan(P(batch=3, num_q_heads=8, num_kv_heads=1, max_kv_len=4096, page_size=None), GPU, CFG, "x",
                     KERNEL)
    assert plan.schedule.policy == "balanced"
    for lens in ([4096] * 3, [3000] * 3, [4096, 1, 0]):
        u = schedule_units(lens, plan.schedule)
        tail = is_long_tailed(u.total_granules, len(lens), int(u.granules.max()))
        assert u.target == plan.schedule.targets[bucket_of(u.total_granules) + NUM_TARGETS // 2 * tail] > 0
        assert u.granules_per_unit == max(plan.schedule.min_unit_granules, -(-u.total_granules // u.target))
        line = [ln for ln in plan.explain(lens).splitlines() if "lengths:" in ln][0]
        c = u.granules_per_unit
        assert line.endswith(f"; {c} granule{'s' * (c != 1)} per unit ({u.total_granules} granules, target "
                             f"{u.target} units)"), line
    forced = make_plan(P(batch=3, num_q_heads=8, num_kv_heads=1, max_kv_len=4096, page_size=None), GPU, CFG, "x",
                       KERNEL, num_splits=4)
    assert "granules per unit" not in forced.explain() and "granule per unit" not in forced.explain()


def test_shipped_h200_table_never_schedules_one_unit_per_sequence():
    """A uniform live plan whose targets give the middle of the lengths it serves one unit per
    sequence runs the single pass, not a scheduled grid of one unit each: e.g. 28/4/128 at 48 sequences of 3,000 tokens,
    where the even-load rule asks 2 splits at the bucket's 4,096 tokens and the bucket's targets give 1 (measured on
    an H200, paged: 75.2 us single pass against 82.7 scheduled)."""
    _clear_tables()
    seen = 0
    for backend in ("cuda_ptx", "triton"):  # the planned lengths and a uniform batch at the real length
        for hq, hkv, d in ((32, 8, 128), (28, 4, 128), (8, 1, 128), (32, 32, 128), (16, 8, 256)):
            for batch in (1, 3, 12, 48, 64):
                for kv in (1000, 3000, 4096, 12000, 65536, 90000):
                    for page in (None, 16):
                        prob = P(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                                 max_kv_len=kv).bucketed()
                        plan = make_plan(prob, H200, CFG, backend, KERNEL)
                        n = units(plan, [prob.max_kv_len] * batch)
                        assert plan.schedule.single_pass or max(n) > 1, (backend, hq, hkv, batch, kv, page)
                        if plan.schedule.single_pass and plan.policy == "tuned":
                            assert units(plan, [kv] * batch) == [1] * batch
                        seen += plan.policy == "tuned" and plan.schedule.single_pass
    assert seen > 50
    one = make_plan(P(batch=48, num_q_heads=28, num_kv_heads=4, max_kv_len=3000).bucketed(), H200, CFG, "cuda_ptx",
                    KERNEL)
    assert one.policy == "tuned" and one.schedule.single_pass and one.num_splits == 1
    assert "one unit per sequence: single pass" in one.explain()
    # a plan whose mean bucket is half its longest serves long-tailed batches: it stays scheduled, and the long
    # sequence of such a batch gets several units
    half = make_plan(P(batch=12, max_kv_len=8192, total_kv_len=12 * 4096).bucketed(), H200, CFG, "cuda_ptx", KERNEL)
    assert not half.schedule.single_pass
    assert units(half, [8192] + [2049] * 11)[0] > 1


def test_shipped_h200_table_gives_kernel_options():
    from attnplan.api import _tuned_options

    _clear_tables()
    contig = P(page_size=None)
    opts, text = _tuned_options(H200, "triton", contig)
    assert opts == {"block_n": 64, "num_warps": 4, "num_stages": 3} and "kernel_options" in text
    assert _tuned_options(H200, "triton", P())[0]["num_stages"] == 2
    assert _tuned_options(H200, "triton", P(head_dim=256, num_q_heads=16))[0] == {}
    assert _tuned_options(attnplan.CPU_STANDIN, "triton", contig) == ({}, "")
    # a 1-byte (fp8) cache keeps the tile's bytes: block_n doubled from the 2-byte entry
    fp8 = _tuned_options(H200, "triton", P(page_size=None, kv_dtype="float8_e4m3fn"))[0]
    assert fp8 == {**opts, "block_n": 2 * opts["block_n"]}
    # problems whose batch x KV heads fill the SMs take the `_filled` entry
    assert _tuned_options(H200, "triton", P(page_size=None, batch=64))[0]["num_stages"] == 2
    assert _tuned_options(H200, "triton", P(page_size=None, batch=64), batch_free=True)[0]["num_stages"] == 3


def test_shipped_h200_table_cost_model_applies_on_that_device_only():
    from attnplan.planner import cost_model_for

    _clear_tables()
    cm, bw = cost_model_for(H200, CFG)
    assert cm != CFG.cost_model and bw > 0
    assert cost_model_for(attnplan.CPU_STANDIN, CFG) == (CFG.cost_model, attnplan.CPU_STANDIN.mem_bandwidth_gbs)


def test_bucket_key_is_the_bucket_in_order():
    """bucket_key() holds bucket()'s values in its order (q and KV of different dtypes, so a swap shows)."""
    for p in (P(max_kv_len=3000, total_kv_len=2500),
              P(max_kv_len=3000, total_kv_len=2500, q_dtype="bfloat16", kv_dtype="float8_e4m3fn")):
        assert p.bucket_key() == tuple(p.bucket().values())
        assert p.bucketed().bucket_key() == p.bucket_key()


# -- tune's pure functions -----------------------------------------------------------------------------------------

def test_tune_units_per_sequence_is_the_schedules_count(table):
    """The tune records and deduplicates split counts by the units the schedule gives the point's length: a forced
    count whose equal units of whole granules cannot all have work runs fewer."""
    from attnplan.tune import units_per_sequence

    for n, want in ((1, 1), (3, 3), (40, 32), (64, 63), (100, 63)):  # 1000 tokens = 63 granules of 16
        plan = make_plan(P(batch=2, max_kv_len=1000, page_size=None), GPU, CFG, "x", {"block_n": 16}, num_splits=n)
        assert units_per_sequence(plan, 1000) == want == units(plan, [1000, 1000])[0]
    balanced = make_plan(P(max_kv_len=4096), GPU, CFG, "x", KERNEL)
    assert units_per_sequence(balanced, 4096) == units(balanced, [4096])[0]


def test_tune_fit_picks_best_geomean_options_and_saturation():
    from attnplan.tune import fit

    rows = []
    for kv, best_splits in ((131072, 33), (4096, 16)):
        for bn in (32, 64):
            for splits in (17, 33, 66):
                us = 100.0 * (1.0 if bn == 64 else 1.2) * (1.0 if splits == best_splits else 1.3)
                rows.append({"layout": "contiguous", "batch": 1, "kv": kv, "block_n": bn, "splits": splits,
                             "programs": 8 * splits, "us": us})
    rows.append({"layout": "contiguous", "batch": 1, "kv": 4096, "block_n": 128, "splits": 17, "error": "x"})
    f = fit(rows, "triton", 132, 8)
    assert f["kernel_options"]["triton"]["contiguous"] == {"block_n": 64}
    assert sorted(f["sat_by_layout"]["contiguous"]) == [8 * 17 / 132, 8 * 33 / 132]


def test_tune_fit_keeps_every_swept_option():
    """``tune --option-grid`` may sweep any backend option: the fit keeps configurations apart by every swept key
    and writes all of them."""
    from attnplan.tune import fit

    rows = [{"layout": "contiguous", "batch": 1, "kv": 32768, "passes": p, "num_warps": w, "splits": 32,
             "programs": 256, "us": us} for p, w, us in ((1, 4, 41.0), (2, 4, 44.0), (1, 2, 42.0), (2, 2, 40.0))]
    rows += [{"layout": "contiguous", "batch": 4, "kv": 32768, "passes": p, "num_warps": w, "splits": 8,
              "programs": 256, "us": us} for p, w, us in ((1, 4, 130.0), (2, 4, 150.0), (1, 2, 131.0), (2, 2, 129.0))]
    out = fit(rows, "cuda_ptx", 132, 8)
    assert out["kernel_options"]["cuda_ptx"]["contiguous"] == {"passes": 2, "num_warps": 2}
    # a broken timing (0, NaN, inf, not a number) is left out, and a row without an option is that option's None
    # (a time of 0 raised ZeroDivisionError, a row naming other options KeyError)
    broken = [{**rows[0], "us": us} for us in (0.0, float("nan"), float("inf"), "12")]
    odd = [{"layout": "contiguous", "batch": b, "kv": 32768, "splits": 8, "programs": 256, "us": 500.0}
           for b in (1, 4)]
    assert fit(rows + broken + odd, "cuda_ptx", 132, 8)["kernel_options"] == out["kernel_options"]


def test_tune_option_grids_sweep_kernel_options_only():
    from attnplan.config import OPTION_MODELS
    from attnplan.tune import OPTION_GRIDS

    for backend, grid in OPTION_GRIDS.items():
        assert set(grid) <= set(OPTION_MODELS[backend].model_fields), backend
        OPTION_MODELS[backend].model_validate({k: v[0] for k, v in grid.items()})


def test_tune_split_table_keeps_the_best_split_per_point():
    from attnplan.tune import split_table

    rows = [{"layout": "paged", "batch": 4, "kv": 32768, "splits": s, "programs": 32 * s,
             "ppsm": round(32 * s / 132, 3), "us": us} for s, us in ((9, 176.0), (17, 162.0), (33, 135.0), (66, 150.0))]
    rows += [{"layout": "contiguous", "batch": 1, "kv": 4096, "splits": 16, "programs": 128, "ppsm": 0.97, "us": 14.0}]
    assert split_table(rows, (32, 8, 128)) == {"paged": [[32, 32768, round(32 * 33 / 132, 3), 135.0, 4, 128]],
                                               "contiguous": [[8, 4096, 0.97, 14.0, 4, 128]]}


def test_tune_split_table_records_the_best_rows_options():
    """With ``--row-options`` the best (options, split count) of a point wins and its options go into the row."""
    from attnplan.tune import split_table

    rows = [{"layout": "contiguous", "batch": 16, "kv": 16384, "options": {"num_warps": w}, "splits": s,
             "programs": 16 * s, "ppsm": round(16 * s / 132, 3), "us": us}
            for w, s, us in ((4, 13, 42.2), (4, 5, 44.0), (8, 5, 40.6), (8, 13, 43.0))]
    assert split_table(rows, (8, 1, 128)) == {"contiguous": [[16, 16384, round(80 / 132, 3), 40.6, 8, 128,
                                                              {"num_warps": 8}]]}
    plain = [dict(r, options={}) for r in rows if r["options"]["num_warps"] == 4]
    assert split_table(plain, (8, 1, 128)) == {"contiguous": [[16, 16384, round(208 / 132, 3), 42.2, 8, 128]]}


def test_tune_table_rows_merge_by_point():
    """A later tune (other heads, another KV dtype) replaces the rows of the points it measured and keeps the rest."""
    from attnplan.tune import merge_rows

    old = [[8, 4096, 0.97, 14.0, 4, 128], [32, 32768, 8.0, 135.0, 4, 128]]
    assert merge_rows(old, [[8, 4096, 1.9, 13.0, 4, 128], [1, 131072, 2.0, 40.0, 8, 128]]) == [
        [1, 131072, 2.0, 40.0, 8, 128], [8, 4096, 1.9, 13.0, 4, 128], [32, 32768, 8.0, 135.0, 4, 128]]
    # another group or head_dim at the same (pairs, length) is another point: both rows stay
    assert merge_rows(old, [[8, 4096, 4.0, 50.0, 2, 256]]) == [
        [8, 4096, 4.0, 50.0, 2, 256], [8, 4096, 0.97, 14.0, 4, 128], [32, 32768, 8.0, 135.0, 4, 128]]
    # an untagged row (an older table) at a point the new tune measured is replaced, elsewhere kept
    assert merge_rows([[8, 4096, 1.0, 9.9], [16, 4096, 1.0, 9.9]], [[8, 4096, 4.0, 5.0, 4, 128]]) == [
        [8, 4096, 4.0, 5.0, 4, 128], [16, 4096, 1.0, 9.9]]


def test_tune_choice_keys_a_plan_by_the_options_it_runs(table):
    """The tune's quality check keys a plan by the options its kernel has, for the searched options and for its
    row's (a row's options reach the plan even when the search did not vary them), and by the units its schedule
    gives the point's length."""
    from attnplan.tune import _choice

    table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8, "num_stages": 2}]]}}})
    p = _plan_rows()
    assert _choice(p, [], 16384) == ((("num_stages", 2), ("num_warps", 8)), 5)
    assert _choice(_plan_rows(num_splits=3), [], 16384) == ((), 3)
    assert _choice(_plan_rows(num_splits=3), ["num_warps"], 16384) == ((("num_warps", 4),), 3)


def test_tune_inputs_and_planning_for_an_fp8_cache():
    """`tune --kv-dtype float8_e4m3fn` builds e4m3 caches with per-head scales that plan and decode."""
    from attnplan.tune import _inputs, _plan, _table_key, units_per_sequence

    x = _inputs("paged", 2, 40, (8, 2, 64), torch.Generator().manual_seed(0), "float8_e4m3fn", device="cpu")
    assert x.k_cache.dtype == x.v_cache.dtype == torch.float8_e4m3fn and tuple(x.k_scale.shape) == (2,)
    w = attnplan.DecodeWrapper(backend="reference")
    plan = _plan(w, x, 2)
    assert plan.num_splits == 2 and units_per_sequence(plan, 40) == 2 and plan.problem.kv_dtype == "float8_e4m3fn"
    out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ref, _ = attnplan.reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None,
                                          k_scale=x.k_scale, v_scale=x.v_scale)
    attnplan.testing.assert_close_to_reference(out, ref, torch.bfloat16)
    assert _table_key("paged", "float8_e4m3fn") == "paged_fp8" and _table_key("paged", "bfloat16") == "paged"
    from attnplan.tune import main, parse_args

    with pytest.raises(SystemExit) as e:  # the option sweep is bf16 only
        main(["--kv-dtype", "float8_e4m3fn"])
    assert e.value.code == 2  # argparse's usage error, before any GPU work
    assert parse_args(["--kv-dtype", "float8_e4m3fn", "--no-options"]).kv_dtype == "float8_e4m3fn"
    with pytest.raises(SystemExit):  # rows naming every option a kernel ran must not enter a table
        main(["--planner-options"])


def test_exported_helpers_refuse_bad_arguments_by_name():
    """``device_info``, ``select_backend`` and ``make_plan`` check their arguments: a string that names no device or
    a CUDA device this process cannot see is a ``ValueError``, a device of another type (an int, a string where a
    ``torch.device`` is wanted) or a kernel that is not a mapping a ``TypeError``, each naming the argument."""
    with pytest.raises(ValueError, match="names no device"):
        attnplan.device_info("junk")
    with pytest.raises(TypeError, match="device must be"):
        attnplan.device_info(3)
    assert attnplan.device_info("cpu") is attnplan.CPU_STANDIN
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"sees {n} CUDA device"):
        attnplan.device_info(f"cuda:{n}")
    prob = P()
    with pytest.raises(TypeError, match="device must be a torch.device"):
        attnplan.select_backend(prob, "cpu", CFG)
    with pytest.raises(TypeError, match="make_plan: kernel must be a Mapping"):
        make_plan(prob, GPU, CFG, "x", None)
    with pytest.raises(TypeError, match="make_plan: device must be a DeviceInfo"):
        make_plan(prob, "H200", CFG, "x", KERNEL)
    with pytest.raises(TypeError, match="make_plan: capacity_mode must be a bool, got numpy.bool"):
        make_plan(prob, GPU, CFG, "x", KERNEL, capacity_mode=np.bool_(True))
    with pytest.raises(TypeError, match="make_plan: config must be a Config, got NoneType"):
        make_plan(prob, GPU, None, "x", KERNEL)
    # num_splits in plan()'s range: a negative count is not the planner's 0, nor a count past MAX_SPLITS a plan that
    # the plan-file checks then refuse
    for bad in (-3, MAX_SPLITS + 1, True, 2.0):
        with pytest.raises(ValueError, match=r"make_plan: num_splits must be an int in \[0, 1024\]"):
            make_plan(prob, GPU, CFG, "x", KERNEL, num_splits=bad)
    assert make_plan(prob, GPU, CFG, "x", KERNEL, num_splits=MAX_SPLITS).schedule.policy == "forced"
    # a device's facts as numpy integers: the plan's key holds Python ints, and the plan passes its own checks
    odd = dataclasses.replace(GPU, sm_count=np.int64(132), compute_capability=(np.int64(9), np.int64(0)))
    plan = make_plan(prob, odd, CFG, "x", KERNEL, capacity_mode=True)
    plan.validate()
    assert type(plan.device.sm_count) is int and all(type(c) is int for c in plan.device.cc)
    with pytest.raises(TypeError, match="plan device sm_count must be an int, got numpy.int64"):
        dataclasses.replace(plan, device=plan.device._replace(sm_count=np.int64(132))).check_types()
