"""Shared test setup: an isolated plan/compile cache directory, the gpu marker, backend lists, and
the seeded generator of random inputs.

``ATTNPLAN_FAILURE_LOG=path`` appends each failure's report to ``path`` as it happens (for runs that a time
limit may cut short before pytest's summary).

CI runs on CPU with TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 (README's test command);
tests marked ``gpu`` are skipped there and run on a GPU machine, and so are those marked ``full`` (variants of a
path the default run checks, e.g. another architecture's compile of the same spec) unless ``--full`` or
``ATTNPLAN_FULL_TESTS=1`` asks for them.

Seeds: each test's generator is seeded from its own id (CRC32 of ``request.node.nodeid``), so a
rerun of one test, alone or under pytest-xdist in any worker and order, draws the same inputs. The
environment variable ``ATTNPLAN_TEST_SEED`` (an integer, default 0) is added to every seed to draw
other inputs; a failing test's report carries a section with its seed and how to reproduce it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib

import pytest
import torch

# Keep tests away from the user's cache before attnplan is imported anywhere. The folder made here is removed
# when this process exits; xdist workers inherit the variable, so they share the controller's folder.
if "ATTNPLAN_CACHE_DIR" not in os.environ:
    _TEST_CACHE_DIR = tempfile.mkdtemp(prefix="attnplan-test-cache-")
    os.environ["ATTNPLAN_CACHE_DIR"] = _TEST_CACHE_DIR
    atexit.register(shutil.rmtree, _TEST_CACHE_DIR, ignore_errors=True)

HAS_CUDA = torch.cuda.is_available()
#: the full tier (tests marked ``full``: a variant of a path the default run checks already, e.g. another GPU
#: architecture's compile of the same spec) runs where there is a GPU, with ``--full`` or ATTNPLAN_FULL_TESTS=1
FULL_ENV = os.environ.get("ATTNPLAN_FULL_TESTS", "") not in ("", "0")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked full (the default on a machine with a CUDA GPU)")


def full_tier(config) -> bool:
    """Whether this run includes the tests marked ``full`` (a GPU machine, ``--full`` or ATTNPLAN_FULL_TESTS=1)."""
    return HAS_CUDA or FULL_ENV or config.getoption("--full")


def pytest_collection_modifyitems(config, items):
    full = full_tier(config)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_full = pytest.mark.skip(reason="full tier: a variant of a path the default run checks (--full runs it)")
    for item in items:
        if not HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif not full and "full" in item.keywords:
            item.add_marker(skip_full)


@pytest.fixture
def device() -> str:
    """Where kernel tests put tensors: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


#: the stash key of a test's generator seed (read by :func:`pytest_runtest_makereport`)
SEED_KEY = pytest.StashKey[int]()


def seed_of(nodeid: str, offset: int | None = None) -> int:
    """The generator seed of the test ``nodeid``: CRC32 of its UTF-8 bytes plus ``offset`` (default:
    ``$ATTNPLAN_TEST_SEED`` or 0), modulo 2**32.

    Raises:
        ValueError: ``$ATTNPLAN_TEST_SEED`` is set but not an integer.
    """
    if offset is None:
        raw = os.environ.get("ATTNPLAN_TEST_SEED", "0") or "0"
        try:
            offset = int(raw)
        except ValueError:
            raise ValueError(f"ATTNPLAN_TEST_SEED must be an integer, got {raw!r}") from None
    return (zlib.crc32(nodeid.encode()) + offset) % 2**32


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`seed_of` of this test's id: the same inputs on every
    run of this test (whatever the worker or order), other inputs with ``ATTNPLAN_TEST_SEED``."""
    seed = seed_of(request.node.nodeid)
    request.node.stash[SEED_KEY] = seed
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the generator seed to the report of a failing test that drew from ``gen``."""
    report = yield
    seed = item.stash.get(SEED_KEY, None)
    if seed is not None and report.failed:
        offset = os.environ.get("ATTNPLAN_TEST_SEED", "0") or "0"
        report.sections.append(("attnplan generator seed", f"seed {seed} (CRC32 of the test id + ATTNPLAN_TEST_SEED="
                                f"{offset}); rerun: ATTNPLAN_TEST_SEED={offset} python -m pytest '{item.nodeid}'"))
    log = os.environ.get("ATTNPLAN_FAILURE_LOG")
    if log and report.failed:  # at once, so a run cut short by a time limit still shows why its tests failed
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
    return report


def kernel_backends(device: str) -> list[str]:
    """Kernel backends available on ``device`` (from each backend's own ``available``)."""
    from attnplan.backends import get_backend

    return [n for n in ("triton", "numba", "cuda_ptx") if get_backend(n).available(torch.device(device))[0]]


def run_spawned(target, arg_tuples, timeout: float = 120) -> list:
    """Run ``target(*args, queue)`` in one spawned process per ``args`` in ``arg_tuples`` and return
    what each put on the queue (in arrival order), after checking every process exited with 0."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in arg_tuples]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results
