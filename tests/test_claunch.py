"""The driver launch through ctypes (attnplan.backends.cuda_ptx.claunch), on the CPU: its structures against
``cuda.h`` as a C compiler lays them out, and when it is used.

The launches themselves (bitwise the same outputs as cuda-python's, eagerly and under graph capture) are GPU tests in
test_host_path.py; the runtime's use of it (arguments as ints, int results, the context-error retry) is
test_host_path.py's bound-launch test, through both paths.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from attnplan.backends.cuda_ptx import claunch


def _cuda_h() -> str | None:
    """A ``cuda.h`` on this machine: Triton's bundled copy, else the CUDA toolkit's."""
    cands = []
    try:
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
    except ImportError:  # pragma: no cover - triton is a dependency
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "include"))
    cands.append("/usr/local/cuda/include")
    return next((d for d in cands if os.path.isfile(os.path.join(d, "cuda.h"))), None)


PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, id),
         offsetof(CUlaunchAttribute, value), sizeof(((CUlaunchAttribute *)0)->value));
  printf("%zu", sizeof(CUlaunchConfig));
#define F(n) printf(" %zu", offsetof(CUlaunchConfig, n));
  F(gridDimX) F(gridDimY) F(gridDimZ) F(blockDimX) F(blockDimY) F(blockDimZ) F(sharedMemBytes) F(hStream) F(attrs)
  F(numAttrs)
  printf("\n%d\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_launch_structures_are_laid_out_as_cuda_h(tmp_path):
    """``CUlaunchAttribute`` and ``CUlaunchConfig`` as ctypes declares them: every size and field offset equal to a C
    compiler's for ``cuda.h``, and the programmatic-serialization attribute's id."""
    inc, cc = _cuda_h(), shutil.which("gcc") or shutil.which("cc")
    if inc is None or cc is None:
        pytest.skip("needs cuda.h and a C compiler")
    src = tmp_path / "probe.c"
    src.write_text(PROBE)
    exe = tmp_path / "probe"
    subprocess.run([cc, "-I", inc, str(src), "-o", str(exe)], check=True, capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    A, C = claunch.LaunchAttributeC, claunch.LaunchConfigC
    assert [int(v) for v in lines[0].split()] == [ctypes.sizeof(A), A.id.offset, A.value.offset, A.value.size]
    names = ["gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ", "sharedMemBytes", "hStream",
             "attrs", "numAttrs"]
    assert [int(v) for v in lines[1].split()] == [ctypes.sizeof(C)] + [getattr(C, n).offset for n in names]
    assert int(lines[2]) == claunch.PROGRAMMATIC_STREAM_SERIALIZATION


def test_pdl_config_holds_one_attribute():
    """The PDL configuration: the launch geometry, the stream (0 as a null handle), one attribute whose value's first
    int is 1, and the attribute kept alive by the configuration."""
    c = claunch.DriverLaunch.pdl_config((5, 1, 2), (96, 1, 1), 49152, 0)
    assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.sharedMemBytes) == (5, 1, 2, 96, 49152)
    assert c.hStream is None and c.numAttrs == 1
    a = c.attrs[0]
    assert a.id == claunch.PROGRAMMATIC_STREAM_SERIALIZATION
    assert ctypes.c_int.from_buffer_copy(bytes(a)[8:12]).value == 1 and bytes(a)[12:] == bytes(60)
    assert ctypes.addressof(c._attr) == ctypes.addressof(a)


class _Fn:
    """A C function stand-in: ``argtypes`` / ``restype`` may be set."""


class _Lib:
    def __init__(self, names):
        for n in names:
            setattr(self, n, _Fn())


def test_driver_launch_is_looked_up_once_and_can_be_turned_off(monkeypatch):
    """:func:`claunch.driver_launch`: ``None`` without a driver library, or with an entry point missing, or with
    ``ATTNPLAN_DRIVER_LAUNCH=cuda-python``; else the library's two entry points with their argument types set; the
    answer is kept for the process."""
    loads = []

    def cdll(name, lib):
        loads.append(name)
        if lib is None:
            raise OSError(f"{name}: cannot open shared object file")
        return lib

    full = _Lib(["cuLaunchKernel", "cuLaunchKernelEx"])
    for env, lib, expect in [(None, None, None), ("ctypes", _Lib(["cuLaunchKernel"]), None), ("cuda-python", full, None),
                             (None, full, full)]:
        monkeypatch.setattr(claunch, "_LAUNCH", [])
        monkeypatch.setattr(claunch.ctypes, "CDLL", lambda name, lib=lib: cdll(name, lib))
        if env is None:
            monkeypatch.delenv(claunch.ENV, raising=False)
        else:
            monkeypatch.setenv(claunch.ENV, env)
        d = claunch.driver_launch()
        if expect is None:
            assert d is None
        else:
            assert d.launch is full.cuLaunchKernel and d.launch_ex is full.cuLaunchKernelEx
            assert len(full.cuLaunchKernel.argtypes) == 11 and full.cuLaunchKernel.restype is ctypes.c_int
            assert len(full.cuLaunchKernelEx.argtypes) == 4
        n = len(loads)
        assert claunch.driver_launch() is d and len(loads) == n  # looked up once
    assert loads == ["libcuda.so.1"] * 3  # the environment's cuda-python loads nothing
