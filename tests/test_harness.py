"""The test harness itself (``tests/conftest.py``): seeds derived from the test id, reproducible and
reported on failure; the failure log, written by the run that sets it and never by the inner pytest sessions
these tests run."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from conftest import seed_of

pytest_plugins = ["pytester"]


@pytest.fixture
def inner(pytester, monkeypatch):
    """``pytester`` for an inner pytest session with this conftest, away from the outer run's settings: no seed
    offset, and no ``ATTNPLAN_FAILURE_LOG`` (the inner sessions fail on purpose; their failures are not the outer
    run's)."""
    monkeypatch.delenv("ATTNPLAN_TEST_SEED", raising=False)
    monkeypatch.delenv("ATTNPLAN_FAILURE_LOG", raising=False)
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    return pytester


def test_seed_is_crc32_of_the_test_id_plus_the_offset(monkeypatch):
    nodeid = "tests/test_backends.py::test_decode_matches_reference[triton-fp16-gqa4-4x1-contig-d16-q1-len1_37_0-mqa-s0]"
    monkeypatch.delenv("ATTNPLAN_TEST_SEED", raising=False)
    assert seed_of(nodeid) == zlib.crc32(nodeid.encode())
    assert seed_of(nodeid) == seed_of(nodeid) and seed_of(nodeid) != seed_of(nodeid + "x")
    monkeypatch.setenv("ATTNPLAN_TEST_SEED", "7")
    assert seed_of(nodeid) == (zlib.crc32(nodeid.encode()) + 7) % 2**32
    assert seed_of(nodeid, offset=0) == zlib.crc32(nodeid.encode())
    monkeypatch.setenv("ATTNPLAN_TEST_SEED", "seven")
    with pytest.raises(ValueError, match="ATTNPLAN_TEST_SEED must be an integer, got 'seven'"):
        seed_of(nodeid)


def test_gen_draws_the_same_inputs_on_every_run_and_reports_its_seed_on_failure(inner, monkeypatch):
    """An inner pytest session with this conftest: two runs of a test draw the same numbers, another test
    draws others, ``ATTNPLAN_TEST_SEED`` changes them, and a failing test's report names its seed."""
    pytester = inner
    pytester.makepyfile(test_draws="""
        import json, os, torch

        def _log(name, gen):
            with open(os.environ["DRAWS_LOG"], "a") as f:
                f.write(json.dumps([name, torch.rand(3, generator=gen).tolist()]) + "\\n")

        def test_a(gen):
            _log("a", gen)

        def test_b(gen):
            _log("b", gen)

        def test_fails(gen):
            assert torch.rand(1, generator=gen).item() > 2.0
    """)
    log = pytester.path / "draws.jsonl"
    monkeypatch.setenv("DRAWS_LOG", str(log))
    first = pytester.runpytest("-p", "no:cacheprovider")
    first.assert_outcomes(passed=2, failed=1)
    seed = seed_of("test_draws.py::test_fails", offset=0)
    first.stdout.fnmatch_lines(["*attnplan generator seed*", f"*seed {seed} *ATTNPLAN_TEST_SEED=0*test_draws.py::test_fails*"])
    pytester.runpytest("-p", "no:cacheprovider", "-k", "test_a")
    monkeypatch.setenv("ATTNPLAN_TEST_SEED", "1")
    pytester.runpytest("-p", "no:cacheprovider", "-k", "test_a")
    import json

    draws = [json.loads(line) for line in log.read_text().splitlines()]
    (a1, b1, a2, a3) = [d for _, d in draws]
    assert [n for n, _ in draws] == ["a", "b", "a", "a"]
    assert a1 == a2 and a1 != b1 and a3 != a1


def test_failure_log_is_the_setting_runs_own(tmp_path, monkeypatch, request):
    """With ``ATTNPLAN_FAILURE_LOG`` set for the outer run, an inner session's failing test (through the ``inner``
    fixture) leaves the outer log alone; the inner session's own log, set for it, gets the failure as it happens
    (its test id, phase and assertion), and nothing of its passing test."""
    outer = tmp_path / "outer-failures.log"
    monkeypatch.setenv("ATTNPLAN_FAILURE_LOG", str(outer))
    pytester = request.getfixturevalue("inner")
    pytester.makepyfile(test_logged="""
        def test_passes():
            pass

        def test_fails():
            assert 1 == 2, "the inner failure"
    """)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=1)
    assert not outer.exists()
    own = tmp_path / "inner-failures.log"
    monkeypatch.setenv("ATTNPLAN_FAILURE_LOG", str(own))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=1)
    text = own.read_text()
    assert text.startswith("==== test_logged.py::test_fails (call)\n") and "the inner failure" in text
    assert "test_passes" not in text and not outer.exists()


def test_ci_runs_the_readme_test_command_verbatim():
    """``.ci/run`` ends with the README's test command, character for character, and that command runs the
    suite in two pytest-xdist workers with the interpreter and the simulator switched on."""
    root = Path(__file__).resolve().parents[1]
    command = (root / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (root / "README.md").read_text()
    assert f"```bash\n{command}\n```" in readme
    assert command.endswith("TRITON_INTERPRET=1 NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -n 2")
