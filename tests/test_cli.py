"""The command line: `attnplan run` on the CPU, `plans show|clear`, the `tune` hand-off and its pure functions."""

import json
import os

import torch

import pytest

import attnplan
from attnplan import cli
from attnplan.api import Context
from attnplan.config import MAX_SPLITS

from conftest import HAS_CUDA


#: tests of the CPU run's own messages (the interpreter / simulator fallback notes, cuda_ptx skipped for CPU tensors,
#: the long-run warning): on a GPU machine the same command runs on the GPU and says other things
CPU_MODE_ONLY = pytest.mark.skipif(HAS_CUDA, reason="the CPU run's messages; on a GPU machine the run is on the GPU")


def test_run_default_checks_against_reference(capsys):
    assert cli.main(["run"]) == 0
    out = capsys.readouterr().out
    assert "backend:" in out and "PASS" in out and "split" in out


def test_run_checks_the_lse_values_too(capsys, monkeypatch):
    """A backend whose LSE is off (here in base 2, where the contract is the natural log) fails the check, though its
    output and its -inf rows are right."""
    import attnplan.api

    run = attnplan.api.DecodeWrapper.run

    def base2_lse(self, *a, lse=None, **kw):
        out = run(self, *a, lse=lse, **kw)
        if lse is not None:
            lse.mul_(1.4426950408889634)
        return out

    monkeypatch.setattr(attnplan.api.DecodeWrapper, "run", base2_lse)
    assert cli.main(["run", "--backend", "reference", "--batch", "2", "--kv-lens", "40,0", "--iters", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_run_explains_the_schedule_at_its_own_lengths(capsys):
    """``attnplan run`` passes its lengths on the host, so the plan's schedule line is evaluated at them (3 + 2 + 1
    units here), not at the planned powers of two (256 tokens for every sequence: 3 units each)."""
    assert cli.main(["run", "--batch", "3", "--kv-lens", "200,61,1", "--num-splits", "3"]) == 0
    out = capsys.readouterr().out
    assert "at these lengths: 6 units (1-3 per sequence)" in out and "at planned lengths" not in out


def test_run_json_and_options(capsys):
    rc = cli.main(["run", "--model", "qwen2.5-7b", "--batch", "2", "--kv-lens", "40,0", "--page-size", "0",
                   "--dtype", "fp16", "--num-splits", "3", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["heads"] == [28, 4, 128] and rep["check"]["pass"]
    assert rep["plan"]["policy"] == "forced" and rep["plan"]["schedule"]["max_units_per_seq"] == 3
    assert rep["kv_lens"] == [40, 0]


def test_run_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--kv-lens", "3,4", "--batch", "3"])
    assert cli.main(["run", "--backend", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_plans_show_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plan_cache:\n  dir: {tmp_path}\n")
    assert cli.main(["--config", str(cfg), "run", "--kv-lens", "20", "--batch", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["--config", str(cfg), "plans", "show"]) == 0
    shown = capsys.readouterr().out
    assert "1 plan file" in shown and "GQA group 4" in shown
    assert cli.main(["--config", str(cfg), "plans", "clear"]) == 0
    assert "removed 1" in capsys.readouterr().out


@pytest.mark.parametrize("cmd,module", [("tune", "attnplan.tune")])
def test_tool_options_reach_the_tool(cmd, module, monkeypatch):
    """``attnplan tune --json x --iters 3``: options first in the tail reach the tool's own parser."""
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda a: seen.append(a) or 0)
    monkeypatch.setattr(cli, "_cpu_mode", lambda: False)
    monkeypatch.setenv("ATTNPLAN_CONFIG", "unset")  # restored (removed) after the test
    assert cli.main(["--config", "x.yaml", cmd, "--json", "out.json", "--iters", "3"]) == 0
    assert seen == [["--config", "x.yaml", "--json", "out.json", "--iters", "3"]]  # the tool's own --config
    assert os.environ["ATTNPLAN_CONFIG"] == "unset"  # the hand-off changes no environment
    assert cli.main(["--config", "", cmd, "--iters", "3"]) == 0  # an empty path too: the tool refuses it by name
    assert seen[-1] == ["--config", "", "--iters", "3"]


def test_tune_takes_config_after_the_subcommand(tmp_path, monkeypatch, capsys):
    """``attnplan tune --config FILE``: tune's own parser takes ``--config`` with its meaning before the subcommand
    (``main`` hands the file to the tool's planning contexts as ``$ATTNPLAN_CONFIG``; parsing, failed or not, changes
    no environment); a file the config loader rejects is a usage error naming it, before any GPU work."""
    import attnplan.device
    from attnplan import tune

    monkeypatch.setenv("ATTNPLAN_CONFIG", "unset")  # restored after the test
    good = tmp_path / "good.yaml"
    good.write_text("split:\n  num_splits: 1\n")
    args = tune.parse_args(["--config", str(good), "--iters", "3"])
    assert args.config == str(good) and args.iters == 3 and os.environ["ATTNPLAN_CONFIG"] == "unset"
    bad = tmp_path / "bad.yaml"
    bad.write_text("split:\n  num_splitz: 1\n")
    with pytest.raises(SystemExit) as e:
        tune.parse_args(["--config", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "bad.yaml" in err and "num_splitz" in err
    assert os.environ["ATTNPLAN_CONFIG"] == "unset"

    class NoGPU(Exception):
        pass

    def no_gpu(*a, **k):
        raise NoGPU
    monkeypatch.setattr(attnplan.device, "device_info", no_gpu)
    with pytest.raises(NoGPU):  # main sets it before any GPU work
        tune.main(["--config", str(good)])
    assert os.environ["ATTNPLAN_CONFIG"] == str(good)
    with pytest.raises(SystemExit) as e:  # through the command line: tune's help, which lists --config
        cli.main(["tune", "--config", str(good), "--help"])
    assert e.value.code == 0 and "--config CONFIG" in capsys.readouterr().out


def test_time_report_counts_bytes_and_bandwidth(monkeypatch):
    """The GPU timing branch of `attnplan run`, with the CUDA-event timer replaced (CPU)."""
    import argparse

    import attnplan
    import attnplan.timing
    from attnplan.testing import make_inputs

    calls = []
    monkeypatch.setattr(attnplan.timing, "time_cuda",
                        lambda fn, iters: (calls.append(fn(0)), {"median_us": 100.0, "min_us": 90.0, "p90_us": 120.0,
                                                                 "iters": iters})[1])
    x = make_inputs(2, 8, 2, 64, [1000, 24], page_size=16, dtype=torch.bfloat16)
    w = attnplan.DecodeWrapper(backend="reference")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    rep = cli._time_report(w, x, argparse.Namespace(iters=7), [1000, 24])
    kv = 1024 * 2 * 2 * 64 * 2  # tokens x kv heads x (K and V) x head_dim x 2 bytes
    qo = 2 * 2 * 8 * 64 * 2
    assert rep["bytes"] == kv + qo and rep["iters"] == 7 and len(calls) == 1
    assert rep["gbs"] == pytest.approx((kv + qo) / 100e-6 / 1e9)


def test_tune_option_grid_parsing():
    """``--option-grid``: integers become ints, names keep their values; a malformed entry is an argparse error."""
    import argparse

    from attnplan.tune import parse_option_grid

    assert parse_option_grid("num_warps=4,8;num_stages=2, 3;") == {"num_warps": [4, 8], "num_stages": [2, 3]}
    assert parse_option_grid("num_warps=-2,x") == {"num_warps": [-2, "x"]}
    # values that are not plain ASCII integers stay strings (int() of them raised ValueError, or read '٣' as 3)
    assert parse_option_grid("a=--1,\u00b2,\u0663," + "9" * 5001) == {"a": ["--1", "\u00b2", "\u0663", "9" * 5001]}
    for bad in ("", ";", "num_warps", "num_warps=", "=4", "num_warps=4;num_warps=8"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_option_grid(bad)
    from attnplan.tune import _int_list

    assert _int_list("1, 4,16") == (1, 4, 16)
    for bad in ("0", "\u00b2", "\u0663", "9" * 5001, "1,,2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _int_list(bad)


def test_bench_is_no_longer_a_subcommand(capsys):
    """The benchmark is the script benchmarks/bench_decode.py: ``attnplan bench`` is a usage error."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert e.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


# -- bad arguments: argparse's usage error or one line, never a traceback ---------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["run", "--batch", "0"], "--batch: 0 is out of range"),
    (["run", "--batch", "-3"], "--batch"),
    (["run", "--check-seqs", "0"], "--check-seqs: 0 is out of range"),
    (["run", "--check-seqs", "-1"], "--check-seqs: -1 is out of range"),
    (["run", "--max-kv", "0"], "--max-kv"),
    (["run", "--q-len", "17"], "--q-len: 17 is out of range"),
    (["run", "--q-len", "0"], "--q-len"),
    (["run", "--page-size", "3"], "--page-size: 3 is not a power of two"),
    (["run", "--page-size", "-16"], "--page-size"),
    (["run", "--num-splits", "-1"], "--num-splits"),
    (["run", "--num-splits", "5000"], "--num-splits"),
    (["run", "--num-splits", str(MAX_SPLITS + 1)], f"--num-splits: {MAX_SPLITS + 1} is out of range: 0..{MAX_SPLITS}"),
    ([], "the following arguments are required: {run,plans,tune}"),
    (["--config", "c.yaml"], "the following arguments are required: {run,plans,tune}"),
    (["run", "--kv-lens", "3,x"], "--kv-lens: 'x' is not an integer"),
    (["run", "--kv-lens", "3,-4"], "--kv-lens"),
    (["run", "--kv-lens", "3,,4"], "--kv-lens"),
    (["run", "--kv-lens", ""], "--kv-lens"),
    (["run", "--iters", "-1"], "--iters"),
    (["run", "--seed", "abc"], "--seed"),
    (["run", "--kv-lens", "3,4", "--batch", "3"], "--kv-lens gives 2 lengths but --batch is 3"),
    (["run", "--kv-lens", "2147483648", "--explain"], "--kv-lens: 2147483648 is out of range: a KV length in "
                                                      "[0, 2147483647] (seq_lens are int32)"),
    (["run", "--max-kv", "2147483648"], "--max-kv: 2147483648 is out of range: a KV length in [1, 2147483647]"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["run", "--backend", "nope", "--kv-lens", "8"], "unknown backend"),
    (["--config", "/nonexistent/c.yaml", "run"], "cannot read attnplan config"),
    (["run", "--config", "/nonexistent/c.yaml"], "cannot read attnplan config"),
    (["plans", "show", "--config", "/nonexistent/c.yaml"], "cannot read attnplan config"),
    (["--config", "", "run", "--kv-lens", "8"], "the path is empty"),
    (["plans", "show", "--config", ""], "the path is empty"),
    (["run", "--backend", "triton", "--model", "phi-3-mini", "--dtype", "fp32", "--kv-lens", "8",
      "--config", "__BAD__"], "attnplan config"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, argv, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text("split: {partition: split_v}\n")
    argv = [str(bad) if a == "__BAD__" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnplan: error: ") and needle in err and "Traceback" not in err


def test_batch_is_inferred_from_kv_lens(capsys):
    assert cli.main(["run", "--kv-lens", "20,0,7,33,5", "--json", "--page-size", "0"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["batch"] == 5 and rep["kv_lens"] == [20, 0, 7, 33, 5] and rep["check"]["sequences"] == 4


@CPU_MODE_ONLY
def test_explain_prints_the_plan_and_skipped_backends_without_computing(tmp_path, capsys, monkeypatch):
    import attnplan

    monkeypatch.setattr(attnplan.DecodeWrapper, "run", lambda *a, **k: pytest.fail("--explain computed"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("backends: [cuda_ptx, triton, reference]\n")
    assert cli.main(["run", "--explain", "--kv-lens", "300", "--batch", "1", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "(sequence, KV head) pairs: 8" in out and "programs" in out and "skipped cuda_ptx:" in out
    assert "check vs" not in out
    assert cli.main(["run", "--explain", "--json", "--kv-lens", "300", "--batch", "1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "split" in rep["explain"] and "check" not in rep


def test_config_is_accepted_after_the_subcommand(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"backends: [reference]\nplan_cache:\n  dir: {tmp_path}\n")
    assert cli.main(["run", "--kv-lens", "20", "--batch", "1", "--json", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference"
    assert cli.main(["plans", "show", "--config", str(cfg)]) == 0
    assert "1 plan file" in capsys.readouterr().out


@CPU_MODE_ONLY
def test_falling_to_the_reference_backend_is_said_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("backends: [triton, reference]\n")
    assert cli.main(["run", "--kv-lens", "20", "--batch", "1", "--config", str(cfg)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "slow float64 reference backend" in err[0]
    assert "TRITON_INTERPRET=1" in err[0] and "NUMBA_ENABLE_CUDASIM=1" in err[0] and "triton:" in err[0]
    assert cli.main(["run", "--kv-lens", "20", "--batch", "1", "--backend", "reference"]) == 0
    assert "reference backend" not in capsys.readouterr().err  # forced: no note


@CPU_MODE_ONLY
def test_a_large_cpu_run_prints_the_plan_and_warns_before_computing(capsys, monkeypatch):
    import attnplan

    monkeypatch.setattr(cli, "CPU_WARN_MACS", 1000)
    seen = {}
    real_run = attnplan.DecodeWrapper.run

    def run(self, *a, **k):
        seen.update(capsys.readouterr()._asdict())  # what was printed before the kernels ran
        return real_run(self, *a, **k)
    monkeypatch.setattr(attnplan.DecodeWrapper, "run", run)
    assert cli.main(["run", "--kv-lens", "40", "--batch", "1"]) == 0
    assert "plan:" in seen["out"] and "programs" in seen["out"]
    assert "warning: 40 KV tokens x 32 query heads x head_dim 128" in seen["err"] and "may take minutes" in seen["err"]
    assert "PASS" in capsys.readouterr().out


def test_plans_show_and_clear_survive_hostile_files(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plan_cache:\n  dir: {tmp_path}\n")
    assert cli.main(["--config", str(cfg), "run", "--kv-lens", "20", "--batch", "1"]) == 0
    from attnplan.planner import PLAN_VERSION

    folder = tmp_path / f"v{PLAN_VERSION}"  # hostile contents under the cache's own file names
    (folder / ("a" * 32 + ".json")).write_bytes(b"\xff\xfe")
    (folder / ("b" * 32 + ".json")).write_text("null")
    (folder / ("c" * 32 + ".json")).write_text(json.dumps({"plan_version": 1, "library": "0.1.0",
                                                           "plan": {"grid": [1, 1, 1]}}))
    (folder / ".tmp-x.json").write_text("{")
    capsys.readouterr()
    assert cli.main(["--config", str(cfg), "plans", "show"]) == 0
    out = capsys.readouterr().out
    assert "5 plan file(s)" in out and out.count("unreadable:") == 4 and "GQA group 4" in out
    assert f"written by plan format 1 / attnplan '0.1.0', not format {PLAN_VERSION}" in out \
        and "`attnplan plans clear` removes it" in out
    # --limit and --backend: a shared cache's listing cut short, or one backend's plans (unreadable files have none)
    assert cli.main(["--config", str(cfg), "plans", "show", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "5 plan file(s)" in out and "the first 2 shown (3 more: --limit)" in out and out.count("\n== ") == 2
    assert cli.main(["--config", str(cfg), "plans", "show", "--backend", "numba"]) == 0
    out = capsys.readouterr().out
    assert "0 for backend 'numba'" in out and "\n== " not in out
    # a later word "tune" is another command's argument (here not a backend's name), not the tune subcommand
    with pytest.raises(SystemExit) as e:
        cli.main(["--config", str(cfg), "plans", "show", "--backend", "tune", "--limit", "0"])
    assert e.value.code == 2 and "argument --backend: invalid choice: 'tune'" in capsys.readouterr().err
    # ... and the options after it still count (a hand-off at that word would drop --config and run backend "tune")
    assert cli.main(["run", "--backend", "tune", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read attnplan config" in capsys.readouterr().err
    # the filters are show's: with clear they are refused before anything is removed (clear removes every backend's)
    for extra in (["--backend", "numba"], ["--limit", "1"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["--config", str(cfg), "plans", "clear", *extra])
        assert e.value.code == 2 and "`plans clear` removes every plan file" in capsys.readouterr().err
    assert cli.main(["--config", str(cfg), "plans", "show"]) == 0
    assert "5 plan file(s)" in capsys.readouterr().out
    ran = [e["plan"]["backend"] for e in Context.from_config(attnplan.load_config(str(cfg))).cache.entries()
           if "plan" in e]
    assert len(ran) == 1 and ran[0] != "numba"
    assert cli.main(["--config", str(cfg), "plans", "show", "--backend", ran[0]]) == 0
    out = capsys.readouterr().out
    assert f"1 for backend '{ran[0]}'" in out and out.count("\n== ") == 1 and "unreadable" not in out
    real_unlink = Path.unlink
    b_json = "b" * 32 + ".json"
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if self.name == b_json else real_unlink(self, missing_ok))
    assert cli.main(["--config", str(cfg), "plans", "clear"]) == 1
    out = capsys.readouterr().out
    assert "removed 4 plan file(s)" in out and "could not remove" in out and f"{b_json}: Permission denied" in out


def test_plans_clear_touches_only_the_caches_own_files(tmp_path, capsys):
    """A cache directory shared with other files (``plan_cache.dir`` set to a project folder): ``plans show`` lists
    and ``plans clear`` removes only ``v<N>/<32 hex digits>.json`` plans and ``v<N>/.tmp-*.json`` leftovers, in
    version folders that are not links; a cache path that cannot be listed (a file) is reported, and both fail."""
    cfg = tmp_path / "c.yaml"
    cache = tmp_path / "project"
    cfg.write_text(f"plan_cache:\n  dir: {cache}\n")
    assert cli.main(["--config", str(cfg), "run", "--kv-lens", "20", "--batch", "1"]) == 0
    keep = [cache / "vendor" / "package.json", cache / "videos" / "meta.json", cache / "v9" / "notes.json",
            tmp_path / "elsewhere" / "settings.json"]
    for f in keep:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}")
    keep.append(tmp_path / "elsewhere" / ("e" * 32 + ".json"))  # a plan's name, behind a linked version folder
    keep[-1].write_text("{}")
    (cache / "v99").symlink_to(tmp_path / "elsewhere")
    capsys.readouterr()
    assert cli.main(["--config", str(cfg), "plans", "show"]) == 0
    assert "(1 plan file(s))" in capsys.readouterr().out
    assert cli.main(["--config", str(cfg), "plans", "clear"]) == 0
    assert "removed 1 plan file(s)" in capsys.readouterr().out and all(f.is_file() for f in keep)
    cfg.write_text(f"plan_cache:\n  dir: {keep[0]}\n")  # a file where the folder should be
    assert cli.main(["--config", str(cfg), "plans", "show"]) == 1
    assert "cannot list the cache" in capsys.readouterr().err
    assert cli.main(["--config", str(cfg), "plans", "clear"]) == 1
    assert "could not remove" in capsys.readouterr().out and keep[0].is_file()


def test_a_cli_started_with_stdout_closed_ends_quietly(tmp_path):
    """`attnplan plans show >&-`: Python starts with ``sys.stdout = None``; the command's output goes nowhere and it
    ends with its own status, no traceback."""
    import subprocess
    import sys

    code = "import attnplan.cli as c; raise SystemExit(c.main(['plans', 'show']))"
    p = subprocess.run(["bash", "-c", f'"{sys.executable}" -c "{code}" >&-'], capture_output=True, text=True,
                       env={**os.environ, "ATTNPLAN_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr


def test_a_closed_pipe_ends_the_cli_quietly(tmp_path):
    """`attnplan plans show | head`: the reader closes the pipe early; the CLI stops with status 0 and no error
    (the writes after the reader left go to /dev/null), as Python's docs advise for SIGPIPE."""
    import subprocess
    import sys

    # block-buffered stdout (no PYTHONUNBUFFERED): the tail left in Python's buffer after the reader is gone fails
    # at the flush, the common case; a long output fails while printing
    code = ("import sys, time, attnplan.cli as c\n"
            "def show(args):\n"
            "    for i in range(int(sys.argv[1])):\n"
            "        print('plan line', i)\n"
            "    sys.stdout.flush()\n"
            "    time.sleep(1.0)\n"
            "    print('the tail, still in the buffer')\n"
            "    return 0\n"
            "c._plans = show\n"
            "raise SystemExit(c.main(['plans', 'show']))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    for lines in (5, 200000):
        p = subprocess.Popen([sys.executable, "-c", code, str(lines)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**env, "ATTNPLAN_CACHE_DIR": str(tmp_path)})
        p.stdout.readline()
        p.stdout.close()  # the reader goes away
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) == 0, err
        assert "Broken pipe" not in err and "BrokenPipeError" not in err and "error" not in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "1048576", "--max-kv", "1", "--explain"], "q and out 16.0"),
    (["--batch", "1048576", "--max-kv", "1"], "K and V caches 64.0"),
    (["--kv-lens", "2147483647", "--batch", "1"], "K and V caches 8192.0"),
    (["--kv-lens", "300000", "--batch", "64", "--page-size", "0"], "K and V caches 73.2"),
])
def test_a_workload_too_large_for_the_memory_is_a_usage_error_before_any_allocation(capsys, monkeypatch, argv,
                                                                                     needle):
    """The tensors' bytes (q and out, the largest workspace, the caches and the block table; with --explain no
    caches) are checked against the memory before anything is drawn: argparse's usage error naming the sizes and
    the limit, never an OOM kill."""
    import attnplan
    import attnplan.testing

    monkeypatch.setattr(cli, "_memory_limit", lambda cpu: (4 << 30, "the test's 4 GiB"))
    monkeypatch.setattr(attnplan.testing, "make_inputs", lambda *a, **k: pytest.fail("inputs were allocated"))
    monkeypatch.setattr(attnplan.DecodeWrapper, "plan", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(SystemExit) as e:
        cli.main(["run", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "this workload needs about" in err and needle in err and "but the test's 4 GiB is the limit (4.0 GiB)" in err


def test_the_memory_check_counts_the_configs_forced_split_count(tmp_path, capsys, monkeypatch):
    """A config's forced ``split.num_splits`` sizes the partial states even past its ``split.max_splits`` (which limits
    the planner's own counts, not a forced one): 4,096 sequences of 16K tokens forced to 1,024 units need ~69 GB of
    states where 2 units would need 135 MB."""
    import attnplan

    cfg = tmp_path / "c.yaml"
    cfg.write_text("split: {num_splits: 1024, max_splits: 2}\n")
    monkeypatch.setattr(cli, "_memory_limit", lambda cpu: (4 << 30, "the test's 4 GiB"))
    monkeypatch.setattr(attnplan.DecodeWrapper, "plan", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--config", str(cfg), "run", "--batch", "4096", "--kv-lens", "16384", "--explain"])
    assert e.value.code == 2 and "lse and the partial states" in capsys.readouterr().err


def test_explain_plans_on_views_without_allocating_the_caches(capsys, monkeypatch):
    """--explain plans on stride-0 views of one row of q and of the caches, with the lengths on the host: a
    100M-token cache (400 GB in bf16 for llama-3.1-8b's heads) explains in a moment, nothing drawn."""
    import attnplan.testing

    monkeypatch.setattr(attnplan.testing, "make_inputs", lambda *a, **k: pytest.fail("inputs were allocated"))
    for page in ("16", "0"):
        assert cli.main(["run", "--explain", "--kv-lens", "100000000", "--batch", "1", "--page-size", page]) == 0
        out = capsys.readouterr().out
        assert "plan:" in out and "100000000" in out and "(sequence, KV head) pairs: 8" in out


def test_run_warns_of_many_programs_however_short(capsys, monkeypatch):
    """The CPU warning counts programs too (one at least per sequence and KV head, ~10 ms each in the interpreter):
    1,000 empty sequences had no multiply-adds to warn of and took 82 s. Shown here with the threshold lowered;
    the same small run under the default threshold warns of nothing."""
    args = ["run", "--batch", "4", "--kv-lens", "0", "--page-size", "0", "--backend", "triton", "--iters", "0"]
    assert cli.main(args) == 0
    assert "may take minutes" not in capsys.readouterr().err
    monkeypatch.setattr(cli, "CPU_WARN_PROGRAMS", 8)
    assert cli.main(args) == 0
    assert "multiply-adds, 32 programs at least) on the CPU (triton in the interpreter / simulator) may take " \
           "minutes" in " ".join(capsys.readouterr().err.split())


def test_interrupted_run_prints_one_line(capsys, monkeypatch):
    """Ctrl-C during a command: one line on stderr and the shell's status for SIGINT (130), not a traceback."""
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["run"]) == 130
    assert capsys.readouterr().err == "attnplan: interrupted\n"


def test_plans_show_of_a_cache_path_that_is_a_file(tmp_path, monkeypatch, capsys):
    """A cache path that cannot be listed (here a file): one error line and status 1, as `plans clear` does, not a
    listing that counts the path as a plan file."""
    f = tmp_path / "afile"
    f.write_text("hi")
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(f))
    assert cli.main(["plans", "show"]) == 1
    cap = capsys.readouterr()
    assert "plan file" not in cap.out and cap.err.startswith(f"attnplan: error: plan cache {f}: cannot list the cache")
