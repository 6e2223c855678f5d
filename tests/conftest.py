"""Shared test setup: an isolated plan/compile cache directory, the gpu marker, backend lists.

CI runs on CPU with TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 (README's test command);
tests marked ``gpu`` are skipped there and run on the device machine.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Keep tests away from the user's cache before attnplan is imported anywhere.
os.environ.setdefault("ATTNPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="attnplan-test-cache-"))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where kernel tests put tensors: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded generator per test: fresh random inputs, reproducible on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


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
