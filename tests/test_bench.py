"""The benchmarks' host-side code (``benchmarks/``), on the CPU: rows of the results CSV, the speedup, merging runs,
the printed table, the plot, the grid statistics, the peers' dense copies of the cache, what the results record of a
plan, and the GPU-only scripts' imports, CPU exits and pure functions (bench_merge, sanitize, paged_order)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from attnplan import reference
from attnplan.testing import assert_close_to_reference, make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode as bd  # noqa: E402
import grid_stats  # noqa: E402
import peers  # noqa: E402


def _point(heads=(32, 8, 128), layout="contig", kind="uniform", batch=1, kv=4096, ours=(10.0, 20.0), peer=12.0, read=5.0):
    """A measured point as ``bench_decode.main`` builds it; 512 B per token per KV head of K + V."""
    nbytes = batch * kv * heads[1] * heads[2] * 4
    return {"heads": list(heads), "layout": layout, "kind": kind, "batch": batch, "kv_len": kv, "total_kv": batch * kv,
            "bytes": nbytes, "bound": {"read_us": read, "floor_us": 3.8},
            "results": {"sdpa_cudnn": {"graph_us": peer, "eager_us": 50.0},
                        "sdpa_flash": {"error": "refused"},
                        "triton": {"graph_us": ours[0], "plan": {"num_splits": 256, "units": 16}},
                        "cuda_ptx": {"graph_us": ours[1], "plan": {"num_splits": 256, "units": 8}}}}


def test_row_times_splits_and_speedup():
    row = bd.to_row(_point(ours=(10.04, 20.0), peer=12.0), ["triton", "cuda_ptx"], 4000.0)
    assert row["heads"] == "32/8/128" and row["kv"] == 4096 and row["bytes"] == 4096 * 8 * 128 * 4
    assert row["triton_us"] == 10.0 and row["triton_splits"] == 16 and row["cuda_ptx_splits"] == 8
    assert row["sdpa_flash_us"] == "" and "sdpa_flash_splits" not in row
    assert row["speedup"] == round(12.0 / 10.04, 4)  # from the unrounded time
    assert row["read_us"] == 5.0 and row["floor_us"] == 3.8
    none = bd.to_row({**_point(), "results": {"triton": {"error": "x"}, "sdpa_cudnn": {"graph_us": 3.0}}}, ["triton"], 1.0)
    assert none["speedup"] == "" and none["triton_us"] == ""


def test_csv_round_trip_and_merge(tmp_path):
    """write_results: a run replaces the files; with merge, its points replace the old rows of the same point and
    the others stay, and the JSON lists both runs."""
    ours = ["triton", "cuda_ptx"]
    first = [bd.to_row(_point(kv=kv, peer=12.0), ours, 4000.0) for kv in (1024, 4096)]
    prefix = str(tmp_path / "grid")
    bd.write_results(prefix, first, {"command": "first"})
    back = bd.read_csv(prefix + ".csv")
    assert back == first
    second = [bd.to_row(_point(kv=4096, peer=30.0), ours, 4000.0), bd.to_row(_point(heads=(8, 1, 128)), ours, 4000.0)]
    rows = bd.write_results(prefix, second, {"command": "second"}, merge=True)
    assert [(r["heads"], r["kv"], r["speedup"]) for r in bd.read_csv(prefix + ".csv")] == \
        [("32/8/128", 1024, 1.2), ("32/8/128", 4096, 3.0), ("8/1/128", 4096, 1.2)] == \
        [(r["heads"], r["kv"], r["speedup"]) for r in rows]
    meta = json.loads(Path(prefix + ".json").read_text())
    assert [r["command"] for r in meta["runs"]] == ["first", "second"] and "speedup" in meta["columns"]
    bd.write_results(prefix, first[:1], {"command": "third"})
    assert len(bd.read_csv(prefix + ".csv")) == 1 and len(json.loads(Path(prefix + ".json").read_text())["runs"]) == 1


def test_summary_prints_speedups_bounds_and_geomeans(capsys):
    rows = [bd.to_row(_point(kv=kv, ours=(10.0 * i, 20.0 * i), peer=12.0 * i, read=5.0 * i), ["triton", "cuda_ptx"], 4000.0)
            for i, kv in enumerate((1024, 4096), start=1)]
    rows.append(bd.to_row(_point(heads=(8, 1, 128), ours=(40.0, 20.0), peer=10.0), ["triton", "cuda_ptx"], 4000.0))
    # a varlen point: the padded SDPA peer is timed but not the best peer; FlashInfer is
    varlen = _point(kind="varlen", kv=8192, ours=(30.0, 25.0), peer=5.0)
    varlen["results"]["flashinfer"] = {"graph_us": 50.0}
    rows.append(bd.to_row(varlen, ["triton", "cuda_ptx"], 4000.0))
    assert rows[-1]["speedup"] == 2.0
    bd.summary(rows, {"triton", "cuda_ptx"})
    out = capsys.readouterr().out
    assert "1.20x" in out and "0.50x" in out
    assert "32/8/128 uniform: best attnplan vs best peer: geometric mean 1.200x, min 1.20x over 2 points" in out
    # uniform and varlen apart: (1.2 * 1.2 * 0.5)^(1/3)
    assert "all uniform: geometric mean 0.896x, min 0.50x over 3 points; 2 at 0.95x or better" in out
    assert "all varlen: geometric mean 2.000x, min 2.00x over 1 points" in out
    assert "5.0 (2.40x)" in out and "3.8-3.8 us" in out


def test_rows_of_another_kv_dtype_or_q_len_do_not_replace_a_point():
    """A run merged into the grid with an fp8 cache or several queries keeps its own rows beside the bf16 q_len-1
    rows of the same point; a row written before these columns existed is a bf16 q_len-1 row."""
    ours = ["triton", "cuda_ptx"]
    bf16 = bd.to_row(_point(), ours, 4000.0)
    fp8 = bd.to_row({**_point(ours=(5.0, 6.0)), "kv_dtype": "float8_e4m3fn"}, ours, 4000.0)
    q4 = bd.to_row({**_point(ours=(7.0, 8.0)), "q_len": 4}, ours, 4000.0)
    merged = bd.merge_rows([bf16], [fp8, q4])
    assert len(merged) == 3 and {(r["kv_dtype"], r["q_len"]) for r in merged} == {
        ("bfloat16", 1), ("float8_e4m3fn", 1), ("bfloat16", 4)}
    old = {k: v for k, v in bf16.items() if k not in ("kv_dtype", "q_len")}
    assert bd._key(old) == bd._key({k: str(v) for k, v in bf16.items()})


def test_the_output_check_is_per_sequence():
    """The benchmarks' check (:func:`attnplan.testing.max_seq_rel_error`): a long sequence's output read in part or
    not at all is caught (its elements are small: an absolute bound passes it); bf16 rounding is not."""
    from attnplan.testing import BENCH_CHECK_REL, max_seq_rel_error

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 1, 8, 64, generator=g)
    ref[2] *= 0.01  # a long sequence: small outputs
    assert max_seq_rel_error(ref.bfloat16(), ref) < BENCH_CHECK_REL
    wrong = ref.clone()
    wrong[2] = 0.0
    assert float((wrong - ref).abs().max()) < 0.05 and max_seq_rel_error(wrong, ref) > 0.5


def test_plot_writes_a_small_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [bd.to_row(_point(layout=lay, batch=b, kv=kv), ["triton", "cuda_ptx"], 4000.0)
            for lay in ("contig", "paged16") for b in (1, 16) for kv in (4096, 32768, 131072)]
    bd.plot(rows, str(tmp_path / "p.png"))
    size = (tmp_path / "p.png").stat().st_size
    assert 1000 < size < 200_000


def test_grid_stats_and_baseline_comparison():
    ours = ["triton", "cuda_ptx"]
    base = [bd.to_row(_point(kv=kv, ours=(10.0, 11.0), peer=p), ours, 4000.0) for kv, p in ((1024, 12.0), (4096, 9.0))]
    big = bd.to_row(_point(batch=64, kv=131072, ours=(2000.0, 1900.0), peer=1850.0), ours, 4697.0)
    s = grid_stats.stats(base + [big])
    assert s["all"]["points"] == 3 and s["at_095"] == 2 and [u[0] for u in s["under_095"]] == [0.9]
    assert s["big"] == 1 and s["big_at_092"] == 1  # 64 x 131072 x 8 x 128 x 4 B in 1,900 us: 94% of 4,697 GB/s
    assert s["backends"]["cuda_ptx"]["min"] == pytest.approx(9.0 / 11.0)
    new = [bd.to_row(_point(kv=1024, ours=(11.0, 12.0), peer=12.0), ours, 4000.0), base[1]]
    c = grid_stats.compare(new, base, tolerance=0.05)
    assert c["by_heads"]["32/8/128"]["ours"] == pytest.approx(math.sqrt(1.1))
    assert c["by_heads"]["32/8/128"]["peers"] == pytest.approx(1.0)
    assert [m[0] for m in c["moved"]] == [pytest.approx(1.1)]


def test_grid_stats_kind_keeps_one_kind_of_point(tmp_path, capsys):
    """``--kind uniform`` states the uniform points alone (the README's headline), without the long-tailed ones."""
    ours = ["triton", "cuda_ptx"]
    rows = [bd.to_row(_point(kv=1024, ours=(10.0, 11.0), peer=12.0), ours, 4000.0),
            bd.to_row(_point(kv=4096, ours=(10.0, 11.0), peer=5.0), ours, 4000.0)]
    rows[1]["kind"] = "varlen"
    bd.write_results(str(tmp_path / "g"), rows, {"command": "test"})
    assert grid_stats.main([str(tmp_path / "g.csv"), "--kind", "uniform"]) == 0
    assert "| all | 1 | 1.200x | 1.20x |" in capsys.readouterr().out
    assert grid_stats.main([str(tmp_path / "g.csv")]) == 0
    assert "| all | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        grid_stats.main([str(tmp_path / "g.csv"), "--kind", "longtail"])


def test_grid_stats_by_layout_has_a_row_per_heads_and_layout(tmp_path, capsys):
    """``--by-layout`` (the benchmarks README's table): one row per heads configuration and cache layout."""
    ours = ["triton", "cuda_ptx"]
    rows = [bd.to_row(_point(layout=lay, kv=kv, ours=(10.0, 11.0), peer=peer), ours, 4000.0)
            for lay, kv, peer in (("contig", 1024, 12.0), ("contig", 4096, 15.0), ("paged16", 1024, 9.0))]
    bd.write_results(str(tmp_path / "g"), rows, {"command": "test"})
    assert grid_stats.main([str(tmp_path / "g.csv"), "--by-layout"]) == 0
    out = capsys.readouterr().out
    assert "| heads | layout | points | geomean | min |" in out
    assert f"| 32/8/128 | contig | 2 | {math.sqrt(1.2 * 1.5):.3f}x | 1.20x |" in out
    assert "| 32/8/128 | paged16 | 1 | 0.900x | 0.90x |" in out and "| all | | 3 |" in out


#: GQA groups FlashInfer's CUDA-core decode dispatches to (``DISPATCH_GQA_GROUP_SIZE`` in FlashInfer's
#: ``include/flashinfer/utils.cuh``); its tensor-core decode takes any group
FLASHINFER_CORE_GROUPS = {1, 2, 3, 4, 8}


def test_committed_baseline_is_complete():
    """The committed decode-grid baseline: at least 100 distinct points, every contender timed at every point
    (FlashInfer's tensor-core decode at every paged one, its CUDA-core decode at every paged one of a group it
    dispatches to: 28/4/128's group 7 is not), a speedup per point, and the command, environment and commit of each
    of its runs."""
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    rows = bd.read_csv(str(root / "decode_grid.csv"))
    assert len(rows) >= 100 and len({bd._key(r) for r in rows}) == len(rows)
    for r in rows:
        assert all(r[f"{n}_us"] != "" for n in ("triton", "cuda_ptx", "sdpa_cudnn", "sdpa_flash")), r
        if r["layout"].startswith("paged"):
            hq, hkv, _ = (int(v) for v in r["heads"].split("/"))
            assert r["flashinfer_tc_us"] != "", r
            assert r["flashinfer_us"] != "" or hq // hkv not in FLASHINFER_CORE_GROUPS, r
        assert r["speedup"] != "" and r["read_us"] != ""
    for run in json.loads((root / "decode_grid.json").read_text())["runs"]:
        assert run["command"].startswith("python benchmarks/bench_decode.py")
        assert run["env"]["gpu"] and run["env"]["commit"] and run["env"]["torch"] and run["env"]["triton"]


@pytest.mark.parametrize("page", [None, 4])
def test_dense_copies_hold_each_sequence_padded_to_the_longest(page, gen):
    """The peers' dense [B, H, L, D] copies: q transposed, and per sequence its first seq_len KV rows (gathered
    through the block table for a paged cache) equal the reference's gather."""
    x = make_inputs(3, 8, 2, 16, [7, 13, 1], page_size=page, dtype=torch.bfloat16, generator=gen)
    ((q, k, v),) = peers.dense_copies([x])
    assert q.shape == (3, 8, 1, 16) and k.shape == v.shape == (3, 2, 13, 16)
    assert torch.equal(q, x.q.transpose(1, 2))
    for b, n in enumerate([7, 13, 1]):
        rk, rv = reference.gather_kv(x.k_cache, x.v_cache, b, n, x.block_table)
        assert torch.equal(k[b, :, :n].transpose(0, 1).double(), rk.double())
        assert torch.equal(v[b, :, :n].transpose(0, 1).double(), rv.double())


# -- what the results record of a plan, and the GPU-only scripts on the CPU ---------------------------------------

def _wrapper_plan(lens, num_splits=None, capacity=False, page=4):
    import attnplan

    x = make_inputs(len(lens), 8, 2, 16, lens, page_size=page, dtype=torch.float32, capacity=max(lens) + 40)
    w = attnplan.DecodeWrapper(attnplan.load_config(plan_cache={"disk": False}), backend="reference")
    return w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=num_splits, capacity=capacity)


def test_plan_record_keeps_the_v2_plan_and_the_units_that_ran():
    from attnplan.schedule import schedule_units

    lens = [3000, 5, 0, 700]
    for num_splits, capacity in ((None, False), (None, True), (3, False), (1, False)):
        plan = _wrapper_plan(lens, num_splits, capacity)
        rec = bd.plan_record(plan, lens)
        assert set(rec) == {"num_splits", "policy", "merge", "num_programs", "kernel", "predicted_us", "units",
                            "launches"} and rec["launches"] == 1
        assert rec["num_splits"] == plan.num_splits and rec["policy"] == plan.schedule.policy
        assert rec["merge"] == plan.merge and rec["num_programs"] == plan.num_programs == plan.grid[0]
        assert rec["kernel"] == dict(plan.kernel) and json.loads(json.dumps(rec)) == rec
        assert rec["units"] == int(schedule_units(lens, plan.schedule).units.max())
    assert bd.plan_record(_wrapper_plan(lens, 3), lens)["units"] == 3
    assert bd.plan_record(_wrapper_plan(lens, 1), lens) | {"predicted_us": 0} == {
        "num_splits": 1, "policy": "single", "merge": "none", "num_programs": 4 * 2, "kernel": {"block_n": 16},
        "predicted_us": 0, "units": 1, "launches": 1}


def test_bench_merge_compares_the_backends_merges():
    import bench_merge

    from attnplan.backends import get_backend

    assert bench_merge.strategies("reference") == sorted(get_backend("reference").merge_strategies) + ["auto"]
    assert "separate" in bench_merge.strategies("reference")
    plan = _wrapper_plan([3000, 5], 7)
    assert bench_merge.plan_label(plan, [3000, 5]) == f"7u {plan.merge}"
    assert bench_merge.plan_label(_wrapper_plan([3000, 5], 1), [3000, 5]) == "1u none"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit")
@pytest.mark.parametrize("script,argv", [("bench_merge", []), ("sanitize", ["--backend", "reference"]),
                                         ("bench_decode", ["--out", ""]), ("plan_vs_forced", [])])
def test_gpu_scripts_exit_on_the_cpu(script, argv, capsys):
    import importlib

    assert importlib.import_module(script).main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_sanitize_cases_run_on_the_reference_backend(monkeypatch):
    """The sanitizer's workload (its short cases, live and capacity plans; the strided layouts) through the reference
    backend on the CPU: the cases plan and decode, and the checks against the float64 reference run."""
    import sanitize

    short = [c for c in sanitize.CASES if max(c["lens"]) <= 600]
    assert 3 <= len(short) < len(sanitize.CASES)
    monkeypatch.setattr(sanitize, "CASES", short)
    n, merges = sanitize.run_cases("reference", "cpu", torch.Generator().manual_seed(0))
    assert merges == ["separate"] and n == 2 * len(short)
    assert sanitize.run_layout_cases("reference", "cpu", torch.Generator().manual_seed(1), large=False) == 4


def test_paged_order_imports_and_keys_its_timings():
    import paged_order

    assert paged_order.tag("triton", 0) == "triton" and paged_order.tag("cuda_ptx", 2) == "cuda_ptx_s2"


def test_environment_records_the_commit_it_is_told(monkeypatch):
    """``$ATTNPLAN_COMMIT`` wins over the checkout's git (a copied tree's .git may be another commit's)."""
    monkeypatch.setenv("ATTNPLAN_COMMIT", "abc1234")
    assert bd.environment()["commit"] == "abc1234"
    monkeypatch.delenv("ATTNPLAN_COMMIT")
    got = bd.environment()["commit"]
    assert got != "abc1234" and (got is None or len(got.split("+")[0]) >= 7)


def test_longtail_summary_states_each_config_against_the_default():
    """``--configs``: each file's capacity plan is a variant keyed by its stem, summarized per backend as the geometric
    mean over the point's vectors of its time over the default capacity plan's."""
    import bench_longtail as bl

    key = bl.config_key("benchmarks/configs/tail-programs.yaml")
    assert key == "cfg_tail-programs"
    vs = [{"read_us": 10.0, "cuda_ptx_capacity_us": 20.0, "cuda_ptx_live_us": 20.0, f"cuda_ptx_{key}_us": 18.0},
          {"read_us": 10.0, "cuda_ptx_capacity_us": 40.0, "cuda_ptx_live_us": 40.0, f"cuda_ptx_{key}_us": 40.0 * 1.1}]
    s = bl.summarize({"vectors": vs}, ["cuda_ptx"], (), ["benchmarks/configs/tail-programs.yaml"])
    assert s[f"cuda_ptx_{key}_over_cap"] == pytest.approx(math.sqrt(0.9 * 1.1))
    assert "cuda_ptx_tail2_over_cap" not in s and s["capacity_us"] == pytest.approx(30.0)


def test_longtail_variants_name_the_points_that_moved(capsys):
    """The variants' summary: per backend and config, the geometric mean and range of time / the default's, then
    each point that moved by more than 2% (and only those), named by heads, batch and distribution."""
    import bench_longtail as bl

    key = bl.config_key("warps4.yaml")
    points = [{"heads": [16, 8, 256], "batch": 16, "dist": "bimodal", "summary": {f"cuda_ptx_{key}_over_cap": 0.912}},
              {"heads": [8, 1, 128], "batch": 64, "dist": "one_long", "summary": {f"cuda_ptx_{key}_over_cap": 1.005}},
              {"heads": [8, 1, 128], "batch": 16, "dist": "lognormal", "summary": {f"cuda_ptx_{key}_over_cap": 1.03}},
              {"heads": [8, 1, 128], "batch": 16, "dist": "bimodal", "summary": {}}]
    bl.print_variants(points, [(key, "warps4.yaml")], ["cuda_ptx", "triton"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cuda_ptx warps4.yaml: time / plan's 0.981 (geomean over 3 points, 0.912-1.030; "
                             "faster at 1, slower at 1)")
    assert out[1] == "  moved by more than 2%: 16/8/256 b16 bimodal 0.912, 8/1/128 b16 lognormal 1.030"
    assert len(out) == 2  # no triton line: it has no such rows


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_longtail_rescaled_plan_is_the_plan_that_runs(backend, gen, monkeypatch):
    """``bench_longtail.scaled_plan`` swaps a planned and run wrapper's capacity plan for one with its long-tailed
    targets scaled: the next run() launches that plan (not the bound launch or the one-pass check's launch tuple of
    the old one, which had made every rescaled timing the old plan's)."""
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1")
    import attnplan
    import bench_longtail as bl
    from attnplan import load_config
    from attnplan.schedule import NUM_BUCKETS

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_inputs(4, 4, 1, 32, [600, 3, 0, 9], page_size=16, dtype=torch.float32, device=dev, generator=gen,
                    capacity=1024)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    w = attnplan.DecodeWrapper(load_config(plan_cache={"enabled": False}), backend=backend)
    old = w.plan(*args, capacity=True)
    w.run(*args)  # binds the launch and makes the one-pass check
    bl.scaled_plan(w, 2.0)
    tail, old_tail = w.plan_.schedule.targets[NUM_BUCKETS:], old.schedule.targets[NUM_BUCKETS:]
    assert any(old_tail) and tail == tuple(2 * t for t in old_tail)
    seen = []
    real = type(w.backend).run
    monkeypatch.setattr(type(w.backend), "run",
                        lambda self, plan, *a, **k: seen.append(plan) or real(self, plan, *a, **k))
    out = w.run(*args).clone()
    assert len(seen) == 1 and seen[0] is w.plan_ and seen[0] is not old
    ref, _ = reference.attention(*args, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float32)


def test_kv_layout_head_major_view():
    """kv_layout.py's head-major cache: the values of a token-major cache stored head by head, viewed in the
    token-major shape through strides (no copy between the view and the storage)."""
    from kv_layout import head_major

    for shape in ((2, 5, 3, 4), (7, 16, 2, 8)):  # [B, T, Hkv, D] and [pages, page, Hkv, D]
        t = torch.randn(shape)
        hm, view = head_major(t)
        n, tok, h, d = shape
        assert hm.shape == (n, h, tok, d) and hm.is_contiguous()
        assert view.shape == t.shape and torch.equal(view, t) and view.data_ptr() == hm.data_ptr()
        assert view.stride() == (h * tok * d, d, tok * d, 1)


def test_ncu_sass_regions_and_reasons(tmp_path):
    """ncu_sass.py on a small SASS source CSV: stall columns (not the "Not Issued" ones) summed per reason and per
    region; regions split after a call / return / exit, before a region's first cp.async (copies interleaved with
    other code stay in one region, predicated ones included), at a dropped short row and at lines with neither
    executions nor samples; warnings before the kernel line skipped and a second kernel's lines not read."""
    import csv

    import ncu_sass

    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_no_inst", "stall_long_sb (Not Issued)"]
    body = [  # Address, Source, all samples, executed, long_sb, no_inst, long_sb not issued (must be ignored)
        ["0x0", "LDC R1, c[0x0][0x28]", "3", "4", "0", "3", "9"],            # 0
        ["0x10", "CALL.REL.NOINC 0x100", "0", "4", "0", "0", "9"],           # 1: ends region 0-1
        ["0x20", "IMAD R2, R3, R4, RZ", "5", "4", "5", "0", "9"],            # 2
        ["0x30", "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "0", "4", "0", "0", "0"],  # 3: starts a region
        ["0x40", "IMAD R5, R6, R7, RZ", "2", "4", "1", "1", "0"],            # 4
        ["0x50", "@!UP1 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]", "0", "4", "0", "0", "0"],  # 5: same region
        ["0x60", "WARPSYNC.ALL", "7", "4", "7", "0", "9"],                   # 6
        ["0x70", "RET.REL.NODEC R4, 0x0", "0", "4", "0", "0", "0"],          # 7: ends region 3-7
        ["0x80", "IADD3 R1, R1, 0x1, RZ", "1", "4", "0", "1", "0"],          # 8
        ["0x90"],                                                            # 9: short row, dropped: a gap
        ["0xa0", "IADD3 R2, R2, 0x1, RZ", "4", "4", "4", "0", "0"],          # 10
        ["0xb0", "EXIT", "0", "4", "0", "0", "0"],                           # 11
        ["0xc0", "BRA 0xc0", "0", "0", "0", "0", "0"],                       # 12: never executed
    ]
    p = tmp_path / "k-sass.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["==WARNING== a warning"], ["Kernel Name", "attnplan_decode_partial"], head, *body,
                     ["Kernel Name", "another"], head, ["0x0", "EXIT", "99", "1", "99", "0", "0"]])
    kernel, ins = ncu_sass.read_sass_csv(str(p))
    assert kernel == "attnplan_decode_partial" and len(ins) == 12 and [i.index for i in ins][8:10] == [8, 10]
    assert ins[0].samples == {"no_inst": 3} and ins[6].samples == {"long_sb": 7}
    assert ins[5].opcode == "LDGSTS.E.BYPASS.128" and ins[7].opcode == "RET.REL.NODEC"
    regs = ncu_sass.regions(ins)
    assert [(a, b) for a, b, _ in regs] == [(0, 1), (2, 2), (3, 7), (8, 8), (10, 11)]
    assert regs[2][2] == {"long_sb": 8, "no_inst": 1} and regs[4][2] == {"long_sb": 4}
    text = ncu_sass.report(str(p), top=2)
    assert "22 samples" in text and "long_sb 77.3%" in text and "no_inst 22.7%" in text
    assert "[LDGSTS.E.BYPASS.128 .. RET.REL.NODEC]" in text and "[IADD3 .. EXIT]" in text
    bad = tmp_path / "bad.csv"
    bad.write_text("Address,Source\n0x0,EXIT\n")
    with pytest.raises(ValueError, match="not an ncu SASS source CSV"):
        ncu_sass.read_sass_csv(str(bad))
