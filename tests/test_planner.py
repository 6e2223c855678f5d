"""The split planner: program counting per KV head, coverage, single pass, forcing, serialization."""

import dataclasses
import json

import pytest
import torch

import attnplan
from attnplan.device import DeviceInfo
from attnplan.planner import SplitPlan, make_plan

H200_LIKE = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
KERNEL = {"block_n": 64}


def P(**kw):
    base = dict(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, q_len=1, page_size=16,
                q_dtype="bfloat16", kv_dtype="bfloat16", max_kv_len=32768)
    base.update(kw)
    return attnplan.DecodeProblem(**base)


CFG = attnplan.load_config()


def test_programs_counted_per_kv_head_and_fill_the_device():
    """cases.yaml heuristic-counts-q-heads: batch 1, 32/8/128, 32K on 132 SMs."""
    plan = make_plan(P(), H200_LIKE, CFG, "triton", KERNEL)
    assert plan.grid == (plan.num_splits, 8, 1)
    assert plan.num_programs == 1 * 8 * plan.num_splits
    assert plan.num_programs >= 132, plan.explain()
    # counting query heads (32) would have stopped at ~132 / 32 = 4 splits
    assert plan.num_splits > 132 // 32


@pytest.mark.parametrize("max_kv_len", [1, 15, 16, 17, 1000, 4096, 131072])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_chunks_cover_every_token_and_align(max_kv_len, batch):
    plan = make_plan(P(batch=batch, max_kv_len=max_kv_len), H200_LIKE, CFG, "triton", KERNEL)
    assert plan.chunk_size % 64 == 0 and plan.chunk_size % 16 == 0
    assert plan.num_splits * plan.chunk_size >= max_kv_len
    # no split that is empty for the longest sequence: the last split starts before its end
    assert (plan.num_splits - 1) * plan.chunk_size < max(max_kv_len, 1)


def test_single_pass_when_batch_fills_the_device():
    plan = make_plan(P(batch=64, max_kv_len=4096), H200_LIKE, CFG, "triton", KERNEL)
    assert plan.single_pass and plan.num_splits == 1 and plan.merge_grid == (0,) and plan.workspace_bytes == 0


def test_single_pass_for_short_sequences():
    plan = make_plan(P(max_kv_len=64), H200_LIKE, CFG, "triton", KERNEL)
    assert plan.single_pass


def test_long_tailed_batch_splits_the_long_sequence():
    """16 sequences x 8 heads = 128 programs nearly fill 132 SMs, but one 128K sequence among short
    ones would leave a single program streaming 32 MiB: the planner splits."""
    plan = make_plan(P(batch=16, max_kv_len=131072, total_kv_len=131072 + 15 * 500), H200_LIKE, CFG, "triton", KERNEL)
    assert plan.num_splits >= 8, plan.explain()


def test_forced_and_disabled_splits():
    plan = make_plan(P(max_kv_len=40), H200_LIKE, CFG, "triton", {"block_n": 16}, num_splits=16)
    assert plan.num_splits == 16 and plan.policy == "forced" and plan.chunk_size == 16
    plan = make_plan(P(), H200_LIKE, CFG.with_overrides(split={"num_splits": 1}), "triton", KERNEL)
    assert plan.num_splits == 1 and plan.policy == "no-split" and plan.single_pass


def test_min_chunk_and_max_splits_respected():
    cfg = CFG.with_overrides(split={"max_splits": 4})
    plan = make_plan(P(max_kv_len=131072), H200_LIKE, cfg, "triton", KERNEL)
    assert plan.num_splits <= 4
    cfg = CFG.with_overrides(split={"min_chunk_tokens": 4096})
    plan = make_plan(P(max_kv_len=16384), H200_LIKE, cfg, "triton", KERNEL)
    assert plan.chunk_size >= 4096


def test_plan_is_frozen_serializable_and_explained():
    plan = make_plan(P(), H200_LIKE, CFG, "triton", KERNEL)
    again = SplitPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    with pytest.raises(Exception):
        plan.num_splits = 3  # frozen
    text = plan.explain()
    for word in ("GQA group 4", "132 SMs", "split", "grid", "predicted"):
        assert word in text


def test_plan_depends_on_device_sm_count():
    small = DeviceInfo("small", 16, (8, 6), 100 * 1024, 4 * 2**20, 900.0)
    a = make_plan(P(), H200_LIKE, CFG, "triton", KERNEL)
    b = make_plan(P(), small, CFG, "triton", KERNEL)
    assert a.num_splits > b.num_splits


def test_tuned_device_table_is_read(tmp_path):
    """plans/<device>.yaml constants replace the config's defaults on that device only."""
    from attnplan.planner import cost_model_for

    cm, bw = cost_model_for(H200_LIKE, CFG)
    cm2, bw2 = cost_model_for(attnplan.CPU_STANDIN, CFG)
    assert cm2 == CFG.cost_model and bw2 == attnplan.CPU_STANDIN.mem_bandwidth_gbs
    assert bw > 0


def test_tuned_kernel_options_come_from_the_device_table():
    from attnplan.api import _tuned_options

    contig = P(page_size=None)
    opts, text = _tuned_options(H200_LIKE, "triton", contig)
    assert opts == {"block_n": 64, "num_warps": 4, "num_stages": 3} and "kernel_options" in text
    assert _tuned_options(H200_LIKE, "triton", P())[0]["num_stages"] == 2
    assert _tuned_options(H200_LIKE, "triton", P(head_dim=256, num_q_heads=16))[0] == {}
    assert _tuned_options(attnplan.CPU_STANDIN, "triton", contig) == ({}, "")
    # a 1-byte (fp8) cache keeps the tile's bytes: block_n doubled from the 2-byte entry
    fp8 = _tuned_options(H200_LIKE, "triton", P(page_size=None, kv_dtype="float8_e4m3fn"))[0]
    assert fp8 == {**opts, "block_n": 2 * opts["block_n"]}


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


def test_partition_axis_forced_only_where_implemented():
    only_k = make_plan(P(), H200_LIKE, CFG.with_overrides(split={"partition": "split_v"}), "triton", KERNEL)
    assert only_k.partition == "split_k"  # the backend offers split_k only
    both = frozenset({"split_k", "split_v"})
    v = make_plan(P(), H200_LIKE, CFG.with_overrides(split={"partition": "split_v"}), "x", KERNEL, partitions=both)
    assert v.partition == "split_v" and "split-v" in v.explain()
    auto = make_plan(P(), H200_LIKE, CFG, "x", {**KERNEL, "partition": "split_v"}, partitions=both)
    assert auto.partition == "split_v"
    assert make_plan(P(), H200_LIKE, CFG, "x", KERNEL, partitions=both).partition == "split_k"


def test_tuned_options_for_problems_that_fill_the_device():
    from attnplan.api import _tuned_options

    assert _tuned_options(H200_LIKE, "triton", P(page_size=None, batch=64))[0]["num_stages"] == 2
    assert _tuned_options(H200_LIKE, "triton", P(page_size=None, batch=1))[0]["num_stages"] == 3


def test_cost_model_by_backend_overrides_device_constants(monkeypatch):
    """A tuned table's per-backend constants apply to that backend's plans only."""
    import attnplan.config
    from attnplan.planner import cost_model_for

    table = {"cost_model": {"sat_programs_per_sm": 2.0, "programs_per_sm": 4, "mem_bandwidth_gbs": 4400.0},
             "cost_model_by_backend": {"cuda_ptx": {"sat_programs_per_sm": 4.0}}}
    monkeypatch.setattr(attnplan.planner, "device_table", lambda slug: table)
    assert cost_model_for(H200_LIKE, CFG, "triton")[0].sat_programs_per_sm == 2.0
    assert cost_model_for(H200_LIKE, CFG, "cuda_ptx")[0].sat_programs_per_sm == 4.0
    assert cost_model_for(H200_LIKE, CFG, "cuda_ptx")[1] == 4400.0
    more = make_plan(P(max_kv_len=131072, total_kv_len=131072), H200_LIKE, CFG, "cuda_ptx", KERNEL)
    fewer = make_plan(P(max_kv_len=131072, total_kv_len=131072), H200_LIKE, CFG, "triton", KERNEL)
    assert more.num_splits > fewer.num_splits


def test_measured_split_table_drives_the_split_where_it_applies(monkeypatch):
    """`attnplan tune`'s split table: nearest entry within reach sets programs per SM; elsewhere the cost model."""
    import attnplan.planner as planner

    table = {"split_table": {"triton": {"paged": [[8, 131072, 4.0], [32, 32768, 8.0]],
                                        "contiguous": [[8, 131072, 2.0]]}}}
    monkeypatch.setattr(planner, "device_table", lambda slug: table)
    big = P(max_kv_len=131072, total_kv_len=131072)
    plan = make_plan(big, H200_LIKE, CFG, "triton", KERNEL)
    assert plan.policy == "tuned" and plan.table_entry == (8, 131072, 4.0)
    assert plan.num_splits == 64  # round(4.0 * 132 / 8) = 66 splits of 1986 tokens -> 2048-token chunks -> 64
    assert "measured split table" in plan.explain() and "4 programs per SM" in plan.explain()
    b4 = make_plan(P(batch=4, max_kv_len=32768, total_kv_len=4 * 32768), H200_LIKE, CFG, "triton", KERNEL)
    assert b4.policy == "tuned" and b4.table_entry[0] == 32 and b4.num_splits == 32  # 33 -> 1024-token chunks
    contig = make_plan(P(page_size=None, max_kv_len=65536, total_kv_len=65536), H200_LIKE, CFG, "triton", KERNEL)
    assert contig.policy == "tuned" and contig.num_splits == 32  # 33 -> 2048-token chunks
    # out of reach (16x fewer tokens), long-tailed lengths, large heads, other backends: the cost model
    assert make_plan(P(max_kv_len=4096, total_kv_len=4096), H200_LIKE, CFG, "triton", KERNEL).policy == "heuristic"
    assert make_plan(P(batch=4, max_kv_len=131072, total_kv_len=131072 + 3000), H200_LIKE, CFG, "triton",
                     KERNEL).policy == "heuristic"
    assert make_plan(P(head_dim=256, num_q_heads=16, max_kv_len=131072, total_kv_len=131072), H200_LIKE, CFG,
                     "triton", KERNEL).policy == "heuristic"
    assert make_plan(big, H200_LIKE, CFG, "cuda_ptx", KERNEL).policy == "heuristic"
    # an fp8 cache has its own rows (`tune --kv-dtype float8_e4m3fn`); without them, the cost model
    fp8 = P(max_kv_len=131072, total_kv_len=131072, kv_dtype="float8_e4m3fn")
    assert make_plan(fp8, H200_LIKE, CFG, "triton", KERNEL).policy == "heuristic"
    table["split_table"]["triton"]["paged_fp8"] = [[8, 131072, 2.0]]
    f = make_plan(fp8, H200_LIKE, CFG, "triton", KERNEL)
    assert f.policy == "tuned" and f.table_entry == (8, 131072, 2.0) and f.num_splits == 33  # round(2 * 132 / 8)
    # a plan from the table survives the cache's JSON round trip
    assert SplitPlan.from_dict(json.loads(plan.to_json())) == plan


def test_tune_split_table_keeps_the_best_split_per_point():
    from attnplan.tune import split_table

    rows = [{"layout": "paged", "batch": 4, "kv": 32768, "splits": s, "programs": 32 * s, "ppsm": round(32 * s / 132, 3), "us": us}
            for s, us in ((9, 176.0), (17, 162.0), (33, 135.0), (66, 150.0))]
    rows += [{"layout": "contiguous", "batch": 1, "kv": 4096, "splits": 16, "programs": 128, "ppsm": 0.97, "us": 14.0}]
    assert split_table(rows, (32, 8, 128)) == {"paged": [[32, 32768, round(32 * 33 / 132, 3), 135.0, 4, 128]],
                                               "contiguous": [[8, 4096, 0.97, 14.0, 4, 128]]}


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


def test_split_table_prefers_rows_of_the_problems_own_heads(monkeypatch):
    """Rows carry the group and head_dim they were measured with: a problem takes its own heads' row at
    its point, else the nearest with half the group distance added; head_dim 256 only from head_dim-256
    rows; untagged rows lose ties to tagged ones."""
    import attnplan.planner as planner

    table = {"split_table": {"triton": {"contiguous": [
        [8, 131072, 2.0, 100.0, 4, 128], [4, 131072, 8.0, 100.0, 8, 128], [8, 131072, 4.0, 100.0, 1, 128],
        [8, 65536, 4.0, 100.0, 2, 256]]}}}
    monkeypatch.setattr(planner, "device_table", lambda slug: table)
    big = dict(page_size=None, max_kv_len=131072, total_kv_len=131072)
    g4 = make_plan(P(**big), H200_LIKE, CFG, "triton", KERNEL)  # 32/8: group 4
    assert g4.table_entry == (8, 131072, 2.0, 100.0, 4, 128)
    g8 = make_plan(P(num_q_heads=64, **big), H200_LIKE, CFG, "triton", KERNEL)  # 64/8: group 8, no own row at 8 pairs
    assert g8.table_entry == (8, 131072, 2.0, 100.0, 4, 128)  # same pairs, group 4 beats 4 pairs of group 8
    g1 = make_plan(P(num_q_heads=8, **big), H200_LIKE, CFG, "triton", KERNEL)  # 8/8: group 1
    assert g1.table_entry == (8, 131072, 4.0, 100.0, 1, 128)
    d256 = make_plan(P(num_q_heads=16, head_dim=256, **big), H200_LIKE, CFG, "triton", KERNEL)
    assert d256.policy == "tuned" and d256.table_entry == (8, 65536, 4.0, 100.0, 2, 256)
    assert make_plan(P(num_q_heads=16, head_dim=192, **big), H200_LIKE, CFG, "triton", KERNEL).policy == "heuristic"
    # untagged rows (tables written before the tags) count as head_dim 128, any group; a tagged row of the
    # problem's head_dim at the same point wins the tie
    table["split_table"]["triton"]["contiguous"] = [[8, 131072, 2.0]]
    assert make_plan(P(num_q_heads=8, **big), H200_LIKE, CFG, "triton", KERNEL).table_entry == (8, 131072, 2.0)
    table["split_table"]["triton"]["contiguous"] = [[8, 131072, 2.0], [8, 131072, 3.0, 90.0, 4, 128],
                                                    [8, 131072, 5.0, 90.0, 4, 64]]
    assert make_plan(P(**big), H200_LIKE, CFG, "triton", KERNEL).table_entry == (8, 131072, 3.0, 90.0, 4, 128)


def test_table_candidates_are_the_rows_in_reach_nearest_first(monkeypatch):
    """``table_candidates`` lists the rows that may serve a problem with their distances, nearest first, equal
    distances in table order (so ``_table_entry``, its first, keeps the first of tied rows); rows beyond
    ``TABLE_REACH`` in pairs or length and rows of another head_dim are left out; it is empty where the table
    does not apply (long-tailed lengths, a CPU)."""
    import math

    import attnplan.planner as planner

    rows = [[4, 65536, 0.5, 1.0, 4, 128], [16, 65536, 6.0, 1.0, 4, 128], [8, 16384, 1.0, 1.0, 4, 128],
            [8, 65536, 2.0, 1.0, 4, 128], [8, 1024, 3.0, 1.0, 4, 128], [8, 65536, 9.0, 1.0, 2, 256]]
    monkeypatch.setattr(planner, "device_table", lambda slug: {"split_table": {"triton": {"contiguous": rows}}})
    prob = P(page_size=None, batch=1, max_kv_len=45000, total_kv_len=45000)  # 8 pairs, 45000 tokens
    near = planner.table_candidates(prob, H200_LIKE, "triton", 1)
    # distances: log(65536 / 45000) = 0.38; log(45000 / 16384) = 1.01; log 2 + 0.38 = 1.07 for 4 and 16 pairs
    assert [r for _, r in near] == [tuple(rows[3]), tuple(rows[2]), tuple(rows[0]), tuple(rows[1])]
    d = [x for x, _ in near]
    assert d == sorted(d) and math.isclose(d[0], math.log(65536 / 45000))
    assert d[2] == d[3]  # 4 and 16 pairs: equidistant, kept in table order
    assert planner._table_entry(prob, H200_LIKE, "triton", 1) == tuple(rows[3])
    b2 = P(page_size=None, batch=2, num_q_heads=16, num_kv_heads=8, max_kv_len=65536, total_kv_len=2 * 65536)
    assert planner._table_entry(b2, H200_LIKE, "triton", 1) == tuple(rows[1])  # 16 pairs at distance 0
    assert planner.table_candidates(P(page_size=None, batch=4, max_kv_len=45000, total_kv_len=45000 + 3 * 100),
                                    H200_LIKE, "triton", 1) == []  # long-tailed lengths: the cost model
    cpu = dataclasses.replace(H200_LIKE, compute_capability=(0, 0))
    assert planner.table_candidates(prob, cpu, "triton", 1) == []


def test_tune_inputs_and_planning_for_an_fp8_cache():
    """`tune --kv-dtype float8_e4m3fn` builds e4m3 caches with per-head scales that plan and decode."""
    from attnplan.tune import _inputs, _plan, _table_key

    x = _inputs("paged", 2, 40, (8, 2, 64), torch.Generator().manual_seed(0), "float8_e4m3fn", device="cpu")
    assert x.k_cache.dtype == x.v_cache.dtype == torch.float8_e4m3fn and tuple(x.k_scale.shape) == (2,)
    w = attnplan.DecodeWrapper(backend="reference")
    plan = _plan(w, x, 2)
    assert plan.num_splits == 2 and plan.problem["kv_dtype"] == "float8_e4m3fn"
    out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ref, _ = attnplan.reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None,
                                          k_scale=x.k_scale, v_scale=x.v_scale)
    attnplan.testing.assert_close_to_reference(out, ref, torch.bfloat16)
    assert _table_key("paged", "float8_e4m3fn") == "paged_fp8" and _table_key("paged", "bfloat16") == "paged"
    with pytest.raises(SystemExit):  # the option sweep is bf16 only
        from attnplan.tune import main
        main(["--kv-dtype", "float8_e4m3fn"])


def test_bucket_key_is_the_bucket_in_order():
    p = P(max_kv_len=3000, total_kv_len=2500)
    assert p.bucket_key() == tuple(p.bucket().values())
    assert p.bucketed().bucket_key() == p.bucket_key()


def test_fused_merge_parallelism_moves_the_merge_choice():
    """The cost model charges the fused merge's last program one round trip per split; a backend whose
    last program reads many splits at once (cuda_ptx's merge_row: fused_merge_parallelism 16, fitted to
    results/2026-11-30-s4-call5, where its fused merge was 1.1-2.1 us faster than the merge kernel up to
    16 splits) gets ``fused`` at short KV, and still ``separate`` at 64 splits; parallelism 1 (triton,
    fused 1-8 us slower) never gets it."""
    both = frozenset({"separate", "fused"})
    forced = {n: make_plan(P(page_size=None, max_kv_len=4096), H200_LIKE, CFG, "x", KERNEL, num_splits=n,
                           merge_strategies=both, fused_merge_parallelism=16) for n in (16, 64)}
    assert forced[16].merge == "fused" and forced[64].merge == "separate"
    serial = make_plan(P(page_size=None, max_kv_len=4096), H200_LIKE, CFG, "x", KERNEL, num_splits=16,
                       merge_strategies=both, fused_merge_parallelism=1)
    assert serial.merge == "separate"


def test_fused_merge_max_chunk_caps_the_fused_choice():
    """A backend whose fused specialization streams long chunks slower (cuda_ptx: 2048 tokens) gets
    ``fused`` from ``auto`` only up to its cap."""
    both = frozenset({"separate", "fused"})

    def merge_at(kv):
        return make_plan(P(page_size=None, max_kv_len=kv), H200_LIKE, CFG, "x", KERNEL, num_splits=4,
                         merge_strategies=both, fused_merge_parallelism=16, fused_merge_max_chunk=2048).merge

    assert merge_at(4096) == "fused"       # 4 chunks of 1024 tokens
    assert merge_at(65536) == "separate"   # 4 chunks of 16384


def test_tune_fit_keeps_every_swept_option():
    """``tune --option-grid`` may sweep any backend option: the fit keeps configurations apart by every
    swept key and writes all of them."""
    from attnplan.tune import fit

    rows = [{"layout": "contiguous", "batch": 1, "kv": 32768, "passes": p, "num_warps": w, "splits": 32,
             "programs": 256, "us": us} for p, w, us in ((1, 4, 41.0), (2, 4, 44.0), (1, 2, 42.0), (2, 2, 40.0))]
    rows += [{"layout": "contiguous", "batch": 4, "kv": 32768, "passes": p, "num_warps": w, "splits": 8,
              "programs": 256, "us": us} for p, w, us in ((1, 4, 130.0), (2, 4, 150.0), (1, 2, 131.0), (2, 2, 129.0))]
    out = fit(rows, "cuda_ptx", 132, 8)
    assert out["kernel_options"]["cuda_ptx"]["contiguous"] == {"passes": 2, "num_warps": 2}


@pytest.fixture
def fake_h200_table(monkeypatch):
    """A stand-in for ``plans/h200.yaml`` (a dict the test may change), read by the planner and by the API's kernel
    options; the API's table caches are cleared around the test."""
    import attnplan.api as api
    import attnplan.planner as planner

    table = {}
    monkeypatch.setattr(planner, "device_table", lambda slug: table)
    monkeypatch.setattr(api, "device_table", lambda slug: table)
    for f in (api._tuned_lookup, api._table_text):
        f.cache_clear()
    yield table
    for f in (api._tuned_lookup, api._table_text):
        f.cache_clear()


def _plan_cuda_ptx(page_size=None, cfg=None, window_left=-1, **kw):
    """plan_problem for cuda_ptx on an H200-like device, 16 sequences of 16K tokens, 8/1/128."""
    from attnplan.api import Context, plan_problem
    from attnplan.backends import get_backend

    prob = P(batch=16, num_q_heads=8, num_kv_heads=1, page_size=page_size, max_kv_len=16384,
             total_kv_len=16 * 16384, window_left=window_left)
    ctx = Context.from_config(cfg or attnplan.load_config(plan_cache={"disk": False}))
    return plan_problem(prob, get_backend("cuda_ptx"), torch.device("cpu"), ctx, dev_info=H200_LIKE, **kw)


def test_a_tuned_rows_kernel_options_go_with_its_split_count(fake_h200_table):
    """``tune --row-options`` writes the kernel options a row's split count was measured with as its seventh
    field; the planner runs them with that count (results/2026-11-30-s9-call1: cuda_ptx with 8 KV warps at
    16 pairs x 16K) over the table's per-layout options, and not when the count is forced, the config sets the
    backend's options itself, the plan is split-V, or the options do not fit the problem's kernel."""
    fake_h200_table.update({
        "kernel_options": {"cuda_ptx": {"contiguous": {"num_warps": 4}}},
        "split_table": {"cuda_ptx": {"contiguous": [[16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}]],
                                     "paged": [[16, 16384, 0.61, 42.2, 8, 128]]}}})
    p = _plan_cuda_ptx()
    assert p.policy == "tuned" and p.table_entry[6] == {"num_warps": 8}
    assert p.kernel["num_warps"] == 8 and p.kernel["threads"] == 256  # the row's, over the table's 4
    assert p.num_splits == 5  # round(0.61 x 132 / 16) splits of 16384 tokens, chunks aligned to 8 warps x 16 tokens
    assert "{'num_warps': 8} (applied)" in p.explain()
    assert SplitPlan.from_dict(json.loads(p.to_json())) == p
    assert _plan_cuda_ptx(page_size=16).kernel["num_warps"] == 4  # a row without options: the table's options
    forced = _plan_cuda_ptx(num_splits=5)
    assert forced.policy == "forced" and forced.kernel["num_warps"] == 4
    own = _plan_cuda_ptx(cfg=attnplan.load_config(plan_cache={"disk": False},
                                                  backend_options={"cuda_ptx": {"threads": 64}}))
    assert own.policy == "tuned" and own.kernel["num_warps"] == 2  # the config's threads, not the row's warps
    assert "(not applied" in own.explain()
    split_v = _plan_cuda_ptx(cfg=attnplan.load_config(plan_cache={"disk": False}, split={"partition": "split_v"}))
    assert split_v.partition == "split_v" and split_v.kernel["num_warps"] == 4  # rows are measured split-K
    fake_h200_table["split_table"]["cuda_ptx"]["contiguous"][0][6] = {"block_n": 24}  # not a multiple of the tile
    bad = _plan_cuda_ptx()
    assert bad.policy == "tuned" and bad.kernel["num_warps"] == 4 and bad.num_splits == 5
    fake_h200_table["split_table"]["cuda_ptx"]["contiguous"][0][6] = "num_warps=8"  # not a mapping: no options
    assert _plan_cuda_ptx().kernel["num_warps"] == 4


def test_a_windowed_problem_takes_options_and_splits_from_one_row(fake_h200_table):
    """A sliding window plans its window's span, so its split count can come from another row than the full
    length's, or from the cost model: the options must come with the row that made the plan (review of change 25)."""
    fake_h200_table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8}], [16, 1024, 1.0, 12.0, 8, 128, {"num_warps": 2}]]}}})
    w = _plan_cuda_ptx(window_left=1023)
    assert w.policy == "tuned" and w.table_entry[1] == 1024 and w.kernel["num_warps"] == 2
    tiny = _plan_cuda_ptx(window_left=63)  # a 64-token span: no row within reach, the cost model plans it
    assert tiny.policy == "heuristic" and tiny.kernel["num_warps"] == 4


def test_tune_choice_keys_a_plan_by_the_options_it_runs(fake_h200_table):
    """The tune's quality check keys a plan by the options its kernel has, for the searched options and for its
    row's (a row's options reach the plan even when the search did not vary them)."""
    from attnplan.tune import _choice

    fake_h200_table.update({"split_table": {"cuda_ptx": {"contiguous": [
        [16, 16384, 0.61, 40.6, 8, 128, {"num_warps": 8, "num_stages": 2}]]}}})
    p = _plan_cuda_ptx()
    assert _choice(p, []) == ((("num_stages", 2), ("num_warps", 8)), 5)
    assert _choice(_plan_cuda_ptx(num_splits=3), []) == ((), 3)
    assert _choice(_plan_cuda_ptx(num_splits=3), ["num_warps"]) == ((("num_warps", 4),), 3)


def test_tune_split_table_records_the_best_rows_options():
    """With ``--row-options`` the best (options, split count) of a point wins and its options go into the row."""
    from attnplan.tune import split_table

    rows = [{"layout": "contiguous", "batch": 16, "kv": 16384, "options": {"num_warps": w}, "splits": s,
             "programs": 16 * s, "ppsm": round(16 * s / 132, 3), "us": us}
            for w, s, us in ((4, 13, 42.2), (4, 5, 44.0), (8, 5, 40.6), (8, 13, 43.0))]
    assert split_table(rows, (8, 1, 128)) == {"contiguous": [[16, 16384, round(80 / 132, 3), 40.6, 8, 128,
                                                              {"num_warps": 8}]]}
    # a search without --row-options records empty options: rows keep six fields
    plain = [dict(r, options={}) for r in rows if r["options"]["num_warps"] == 4]
    assert split_table(plain, (8, 1, 128)) == {"contiguous": [[16, 16384, round(208 / 132, 3), 42.2, 8, 128]]}
