"""Where tuned device tables are read from and written to: the user's table directory
(``$ATTNPLAN_CACHE_DIR/plans``) first, the packaged ``plans/<device>.yaml`` second; ``attnplan tune``
writes to the user's directory, never into the installed package."""

from __future__ import annotations

import dataclasses
import warnings
from importlib import resources

import pytest
import torch
import yaml

import attnplan
import attnplan.tune as tune
from attnplan.config import ConfigError, device_table
from attnplan.device import DeviceInfo, user_table_path

H200 = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4800.0, "cuda-13.0")
PACKAGED = resources.files("attnplan.plans") / "h200.yaml"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user cache directory; the memoized tables are cleared before and after the test."""
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(tmp_path))
    attnplan.reload_device_tables()
    yield tmp_path
    attnplan.reload_device_tables()


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(table))


def test_user_table_path_follows_the_cache_dir(user_dir):
    assert user_table_path("h200") == user_dir / "plans" / "h200.yaml"


def test_packaged_table_is_read_when_the_user_has_none(user_dir):
    packaged = yaml.safe_load(PACKAGED.read_text())
    assert device_table("h200") == packaged and "split_table" in packaged
    assert device_table("no-such-device") == {}


def test_user_table_replaces_the_packaged_one(user_dir):
    """A user table is the whole table (no merge with the packaged one), and the planner plans from it."""
    from attnplan.planner import cost_model_for

    _write(user_dir / "plans" / "h200.yaml", {"cost_model": {"sat_programs_per_sm": 7.5, "mem_bandwidth_gbs": 1234.0}})
    assert device_table("h200") == {"cost_model": {"sat_programs_per_sm": 7.5, "mem_bandwidth_gbs": 1234.0}}
    cm, bw = cost_model_for(H200, attnplan.load_config())
    assert cm.sat_programs_per_sm == 7.5 and bw == 1234.0
    (user_dir / "plans" / "h200.yaml").unlink()
    attnplan.reload_device_tables()
    assert device_table("h200") == yaml.safe_load(PACKAGED.read_text())


def test_invalid_user_table_names_the_file(user_dir):
    path = user_dir / "plans" / "h200.yaml"
    _write(path, {"cost_model": {"programs_per_sm": 0}})
    with pytest.raises(ConfigError, match=rf"{path}.*\n  programs_per_sm: .*greater than or equal to 1"):
        device_table("h200")
    attnplan.reload_device_tables()
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=rf"invalid device table \({path}\): top level must be a mapping"):
        device_table("h200")


def test_tune_writes_to_the_user_directory_unless_given_a_path(user_dir, tmp_path_factory):
    target, reads = tune.table_paths("h200")
    assert target == reads == str(user_dir / "plans" / "h200.yaml")
    other = str(tmp_path_factory.mktemp("elsewhere") / "t.yaml")
    assert tune.table_paths("h200", other) == (other, reads)
    assert not str(target).startswith(str(resources.files("attnplan")))


def test_tune_starts_from_packaged_then_user_then_target(user_dir, tmp_path_factory):
    packaged = yaml.safe_load(PACKAGED.read_text())
    user = user_dir / "plans" / "h200.yaml"
    assert tune.start_table("h200", str(user)) == packaged  # nothing of the user's yet
    _write(user, {"kernel_options": {"triton": {"contiguous": {"num_warps": 8}}}})
    t = tune.start_table("h200", str(user))
    assert t["kernel_options"] == {"triton": {"contiguous": {"num_warps": 8}}} and t["split_table"] == packaged["split_table"]
    other = tmp_path_factory.mktemp("elsewhere") / "t.yaml"
    _write(other, {"split_table": {}})
    t = tune.start_table("h200", str(other))
    assert t["split_table"] == {} and t["kernel_options"] == {"triton": {"contiguous": {"num_warps": 8}}}


def test_new_user_table_keeps_the_packaged_header_and_is_read_back(user_dir, monkeypatch):
    """``_write_table`` into a missing folder: made atomically (through the cache's atomic writer: a temporary file
    replaced into place), with the packaged file's provenance comments and the tune's stamp; the planner's table is
    then that file."""
    import attnplan.cache

    written, real = [], attnplan.cache.atomic_write
    monkeypatch.setattr(attnplan.cache, "atomic_write", lambda p, t, **kw: written.append(str(p)) or real(p, t, **kw))
    path = user_table_path("h200")
    table = tune.start_table("h200", str(path))
    table["cost_model"] = {**table["cost_model"], "sat_programs_per_sm": 3.25}
    tune._write_table(str(path), table, "h200")
    assert written == [str(path)]
    text = path.read_text()
    packaged_header = [ln for ln in PACKAGED.read_text().splitlines(keepends=True) if ln.startswith("#")][:3]
    assert text.startswith("".join(packaged_header)) and "# Written by `attnplan tune`" in text
    assert text.count("# Written by `attnplan tune`") == 1
    attnplan.reload_device_tables()
    assert device_table("h200")["cost_model"]["sat_programs_per_sm"] == 3.25
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


ROW = [32, 32768, 2.0, 100.0, 4, 128]


SPLIT = r"split_table\.triton\."


def _rows(*rows, layout="paged"):
    return {"split_table": {"triton": {layout: list(rows)}}}


@pytest.mark.parametrize("table,where", [
    (_rows(ROW[:1] + [0] + ROW[2:], layout="contiguous"),
     SPLIT + r"contiguous\[0\]: .*kv_len must be an int in \[1, 2\^31\)"),
    (_rows([10**30] + ROW[1:]), r"pairs must be an int in \[1, 2\^31\), got 10{30}"),
    ({"split_tabel": {"triton": {"paged": [ROW]}}}, r"unknown section 'split_tabel'; did you mean 'split_table'\?"),
    ({"cost_model": {}, 7: None}, r"unknown section 7 \(known sections: cost_model, "),
    (_rows(ROW, ROW[:2] + [float("nan")] + ROW[3:]),
     SPLIT + r"paged\[1\]: .*programs_per_sm must be a finite number > 0"),
    (_rows(ROW[:2] + [-5.0] + ROW[3:]), r"programs_per_sm must be a finite number > 0"),
    (_rows([True] + ROW[1:]), r"pairs must be an int in \[1, 2\^31\), got True"),
    (_rows(ROW[:5] + [-1]), r"head_dim must be an int in \[1, 2\^31\)"),
    (_rows(ROW + [{"num_warps": [4]}]), r"option 'num_warps' must map a name to a JSON scalar"),
    (_rows(ROW, ROW[:2] + [12.0, 60.0] + ROW[4:]), r"paged\[0\] and \[1\] are both rows of 32 pairs x 32768"),
    ({"split_table": {"triton": [ROW]}}, r"split_table\.triton must be a mapping, got list"),
    ({"split_table": {"triton": {"paged": {"a": 1}}}}, SPLIT + r"paged must be a list of rows"),
    ({"kernel_options": ["a"]}, r"kernel_options must be a mapping, got list"),
    ({"kernel_options": {"triton": {"paged": {"num_warps": [4]}}}},
     r"kernel_options\.triton\.paged\.num_warps must be a JSON scalar"),
    # kernel options outside what the backend's ``backend_options`` model takes (a config file's ranges)
    ({"kernel_options": {"triton": {"contiguous": {"block_n": 24}}}},
     r"kernel_options\.triton\.contiguous\.block_n: must be a power of two \(got 24\)"),
    ({"kernel_options": {"triton": {"paged": {"num_warps": 3}}}}, r"kernel_options\.triton\.paged\.num_warps: .*got 3"),
    ({"kernel_options": {"triton": {"paged": {"num_stages": True}}}}, r"num_stages: a boolean is not allowed"),
    ({"kernel_options": {"cuda_ptx": {"paged": {"num_wraps": 4}}}}, r"num_wraps: unknown key; did you mean 'num_warps'"),
    (_rows(ROW + [{"num_warps": 3}]), SPLIT + r"paged\[0\]\.options\.num_warps: .*got 3"),
    ({"split_table": {"cuda_ptx": {"paged": [ROW + [{"num_stages": -5}]]}}},
     r"split_table\.cuda_ptx\.paged\[0\]\.options\.num_stages: .*greater than or equal to 1"),
    ({"cost_model_by_backend": ["triton"]}, r"cost_model_by_backend must be a mapping, got list"),
    ({"cost_model_by_backend": {"triton": [1]}}, r"cost_model_by_backend\.triton must be a mapping"),
    ({"measured": "h200"}, r"measured must be a mapping, got str"),
])
def test_a_bad_table_section_or_row_is_refused_naming_the_file_and_the_row(user_dir, table, where):
    """Every section and split-table row is checked when the table is read (a hand-edited table's defect is a
    ``ConfigError`` naming the file and the key or row, never a planner crash or a silently used row), and
    ``attnplan tune`` reads its starting table through the same check, before any GPU work."""
    path = user_dir / "plans" / "h200.yaml"
    _write(path, table)
    with pytest.raises(ConfigError, match=rf"invalid device table \({path}\): .*{where}"):
        device_table("h200")
    with pytest.raises(ConfigError, match=where):
        tune.start_table("h200", str(path))


def test_null_kernel_options_mean_the_backends_default(user_dir):
    """``num_stages: null`` (a table's or a row's option) is a JSON scalar meaning "the backend's default", as in a
    config's ``backend_options``: the table loads and the planner plans."""
    from attnplan import api
    from attnplan.backends import get_backend
    from attnplan.problem import DecodeProblem

    _write(user_dir / "plans" / "h200.yaml", {"kernel_options": {"triton": {"contiguous": {"num_stages": None}}},
                                             **_rows(ROW + [{"num_warps": None}], layout="contiguous")})
    assert device_table("h200")["kernel_options"]["triton"]["contiguous"] == {"num_stages": None}
    prob = DecodeProblem(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=32768,
                         total_kv_len=4 * 32768, page_size=None)
    ctx = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    plan = api.plan_problem(prob, get_backend("triton"), torch.device("cpu"), ctx, dev_info=H200)
    assert plan.policy == "tuned" and plan.table_entry.options == (("num_warps", None),)


def test_empty_sections_plan_as_absent(user_dir):
    """``kernel_options:`` or ``split_table:`` left with nothing under them (e.g. every entry commented out) read as
    empty sections: the planner plans from the cost model with the backend's default options."""
    from attnplan import api
    from attnplan.backends import get_backend
    from attnplan.problem import DecodeProblem

    _write(user_dir / "plans" / "h200.yaml", {"cost_model": None, "kernel_options": {"triton": None},
                                             "split_table": {"triton": {"paged": None}}, "measured": None})
    prob = DecodeProblem(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=32768,
                         total_kv_len=4 * 32768, page_size=16)
    ctx = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    plan = api.plan_problem(prob, get_backend("triton"), torch.device("cpu"), ctx, dev_info=H200)
    assert plan.policy != "tuned" and plan.num_splits >= 1


def test_reload_device_tables_makes_an_edited_table_plan(user_dir, monkeypatch):
    """After a table is rewritten, :func:`attnplan.reload_device_tables` makes an existing context plan from the new
    rows: the plan-cache key's table text (through the context's memo of its device facts), the kernel options and
    the parsed rows are all read again. The device is the H200 (its facts stand in for the CPU's)."""
    from attnplan import api
    from attnplan.backends import get_backend
    from attnplan.problem import DecodeProblem

    monkeypatch.setattr(api, "device_info", lambda device=None: H200)
    path = user_dir / "plans" / "h200.yaml"
    prob = DecodeProblem(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=32768,
                         total_kv_len=4 * 32768, page_size=None)
    ctx = api.Context.from_config(attnplan.load_config())

    def row_used():
        plan = api.plan_problem(prob, get_backend("triton"), torch.device("cpu"), ctx)
        return plan.policy, plan.table_entry.programs_per_sm

    _write(path, {"split_table": {"triton": {"contiguous": [ROW]}}})
    attnplan.reload_device_tables()
    assert row_used() == ("tuned", 2.0)
    _write(path, {"split_table": {"triton": {"contiguous": [ROW[:2] + [12.0] + ROW[3:]]}}})
    assert row_used() == ("tuned", 2.0)  # memoized until reloaded
    attnplan.reload_device_tables()
    assert row_used() == ("tuned", 12.0)


def test_tune_plans_with_the_table_it_builds_whatever_file_it_writes(user_dir):
    """``attnplan tune --out FILE``: inside :func:`attnplan.tune.table_override` the planner's table is the one the
    tune is building (its new kernel options and rows), not the user's or the packaged file; outside, the file
    again."""
    packaged = device_table("h200")
    building = {"kernel_options": {"triton": {"contiguous": {"num_warps": 8}}}, "split_table": {}}
    with tune.table_override("h200", building):
        assert device_table("h200") is building
        building["kernel_options"]["triton"]["contiguous"]["num_warps"] = 2
        attnplan.reload_device_tables()
        from attnplan.api import _tuned_lookup
        assert dict(_tuned_lookup("h200", "triton", False, False, False, True)[0]) == {"num_warps": 2}
    assert device_table("h200") == packaged


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_80gb_hbm3"), ("NVIDIA H100 PCIe", "h100_pcie"),
    ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090"), ("Tesla V100-SXM2-16GB", "tesla_v100_sxm2_16gb"), ("", "unknown"),
])
def test_a_table_file_is_named_by_the_whole_device_name(name, slug):
    """Models that share a first word (an H100's SXM and PCIe parts, GeForce cards) differ in SMs and bandwidth,
    so each reads its own table."""
    assert DeviceInfo(name, 132, (9, 0), 227 * 1024, 60 * 2**20, 4800.0, "").slug() == slug


def test_a_table_of_the_old_short_name_is_named_in_a_warning(user_dir):
    """A user table written under the device name's first word (an earlier attnplan's name) is not read, since
    the models of that word share it; the lookup says so instead of planning silently without it (a device with no
    packaged table: an A100 SXM4 80GB, whose earlier name was a100.yaml)."""
    _write(user_dir / "plans" / "a100.yaml", {"cost_model": {"sat_programs_per_sm": 7.5}})
    with pytest.warns(UserWarning, match="a100.yaml is not read.*rename it to a100_sxm4_80gb.yaml"):
        assert device_table("a100_sxm4_80gb") == {}
    _write(user_dir / "plans" / "a100_sxm4_80gb.yaml", {"cost_model": {"sat_programs_per_sm": 6.5}})
    attnplan.reload_device_tables()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device_table("a100_sxm4_80gb") == {"cost_model": {"sat_programs_per_sm": 6.5}}
        assert device_table("h200")  # one word: no other name to look for


@pytest.mark.parametrize("argv,msg", [(["--heads", "32,8"], "num_q_heads,num_kv_heads,head_dim"),
                                      (["--heads", "30,8,128"], "multiple of num_kv_heads"),
                                      (["--heads", "abc"], "positive integers"), (["--batches", "1,,4"], "positive"),
                                      (["--kv", "4k"], "positive integers"), (["--iters", "-3"], "positive integers"),
                                      (["--iters", "0"], "positive integers"), (["--max-gb", "nan"], "finite"),
                                      (["--max-gb", "-1"], "above 0"), (["--backends", "bogus"], "distinct names"),
                                      (["--backends", ""], "distinct names"),
                                      (["--backends", "triton,triton"], "distinct names"),
                                      (["--backends", "reference"], "distinct names"),
                                      (["--repeats", "0"], "positive integers")])
def test_tune_bad_grid_arguments_are_usage_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        tune.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("case", ["out in a missing folder", "out a folder", "json a folder", "json in a file",
                                  "empty grid", "writable"])
def test_tune_refuses_unwritable_outputs_and_an_empty_grid_before_any_gpu_work(case, user_dir, monkeypatch, capsys):
    """``attnplan tune`` checks its outputs and its grid before the option sweep and the split search (minutes to
    hours on a GPU): an ``--out`` or ``--json`` it cannot write, and a grid with no point within ``--max-gb``, exit 2
    with the path or the limit named; a writable target goes on to the GPU work (stubbed here)."""
    import dataclasses

    import attnplan.device

    monkeypatch.setattr(attnplan.device, "device_info",
                        lambda *a, **k: dataclasses.replace(attnplan.device.CPU_STANDIN, name="NVIDIA Test GPU"))
    ran = []
    monkeypatch.setattr(tune, "_tune", lambda *a, **k: ran.append(a) or 0)
    (user_dir / "afile").write_text("x")
    (user_dir / "adir").mkdir()
    argv = {"out in a missing folder": ["--out", str(user_dir / "none" / "t.yaml")],
            "out a folder": ["--out", str(user_dir / "adir")],
            "json a folder": ["--out", str(user_dir / "t.yaml"), "--json", str(user_dir / "adir")],
            "json in a file": ["--out", str(user_dir / "t.yaml"), "--json", str(user_dir / "afile" / "r.json")],
            "empty grid": ["--out", str(user_dir / "t.yaml"), "--max-gb", "1e-12"],
            "writable": ["--out", str(user_dir / "t.yaml"), "--json", str(user_dir / "r.json")]}[case]
    rc = tune.main(["--no-options", *argv])
    err = capsys.readouterr().err
    if case == "writable":
        assert rc == 0 and len(ran) == 1 and not err
        return
    assert rc == 2 and not ran, err
    assert {"out in a missing folder": "cannot write --out", "out a folder": "attnplan tune: error:",
            "json a folder": "cannot write --json", "json in a file": "cannot write --json",
            "empty grid": "fits --max-gb 1e-12"}[case] in err
    assert not any(p.name.startswith(".tmp") for p in user_dir.rglob("*"))  # no probe left behind


def test_tune_times_a_points_candidates_round_robin_and_keeps_medians():
    """``interleaved_medians``: every candidate once, then every candidate again (a device drifting between them moves
    all alike), each candidate's median kept; one run per candidate without repeats; fewer than one refused."""
    calls = []
    series = {0: iter([11.0, 10.6, 11.4]), 1: iter([9.0, 30.0, 9.2]), 2: iter([12.0, 12.0, 12.0])}

    def timer(i):
        def t():
            calls.append(i)
            return next(series[i])
        return t

    medians, runs = tune.interleaved_medians([timer(i) for i in range(3)], repeats=3)
    assert calls == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert medians == [11.0, 9.2, 12.0]  # candidate 1's one slow timing (30) is dropped
    assert runs == [[11.0, 10.6, 11.4], [9.0, 30.0, 9.2], [12.0, 12.0, 12.0]]
    assert tune.interleaved_medians([lambda: 5], repeats=1) == ([5.0], [[5.0]])
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        tune.interleaved_medians([lambda: 5], repeats=0)
    assert tune.parse_args(["--repeats", "3"]).repeats == 3 and tune.parse_args([]).repeats == 1


@pytest.mark.parametrize("field,value,err", [
    ("sm_count", 0, ValueError), ("sm_count", -4, ValueError), ("sm_count", True, ValueError),
    ("sm_count", 132.0, ValueError), ("mem_bandwidth_gbs", 0.0, ValueError),
    ("mem_bandwidth_gbs", float("nan"), ValueError), ("mem_bandwidth_gbs", -1.0, ValueError),
    ("mem_bandwidth_gbs", float("inf"), ValueError), ("compute_capability", [9, 0], ValueError),
    ("compute_capability", (9,), ValueError), ("smem_per_block", -1, ValueError), ("l2_bytes", None, ValueError),
    ("name", None, TypeError), ("driver", 13, TypeError),
])
def test_device_facts_the_planner_divides_by_are_checked(field, value, err):
    """A hand-made DeviceInfo of 0 SMs, a zero / NaN / negative bandwidth or a malformed field is refused where it is
    made, naming the field (make_plan divided by them: ZeroDivisionError, or ``min()`` of an empty sequence); numpy
    integers and floats are facts like Python's."""
    with pytest.raises(err, match=field if err is ValueError else "must be strings"):
        dataclasses.replace(H200, **{field: value})
    import numpy as np

    odd = dataclasses.replace(H200, sm_count=np.int64(132), mem_bandwidth_gbs=np.float32(4800.0))
    assert odd.sm_count == 132
