"""Run the ``cuda_ptx`` kernels on a CPU: ``decode.cu`` compiled as host C++ (a check, not a backend).

``decode.cu`` builds with ``-DATTNPLAN_HOST_EMULATION`` against ``emulation/simt.h``, which runs
every CUDA thread of a block as a fiber, warp shuffles and barriers included, and checks every
shared-memory access and cp.async copy for races between warps (see that header for what the
emulation shows and what it cannot). :class:`EmulatedCudaPtxBackend` is
:class:`~attnplan.backends.cuda_ptx.CudaPtxBackend` with only the final launch replaced: the same
spec choice, input checks, :func:`~.args.partial_args` and :class:`~.args.PackedArgs`
``kernelParams`` array go to the emulated kernel instead of ``cuLaunchKernel``. It takes CPU tensors
and is slow (a few thousand tokens per second); tests use it to execute the real kernel text
against the float64 reference on machines without a GPU.

Needs a C++20 compiler (``$CXX`` or ``g++``) on x86-64 / aarch64 Linux (``ucontext``).

Raises:
    EmulationError: the compiler is missing or fails, or the emulated kernel reports an error
    (a read outside the inputs, a barrier deadlock).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import filelock
import torch

from . import CudaPtxBackend
from ._bindings import CudaPtxError
from .args import PackedArgs
from .spec import KernelSpec, LaunchConfig
from .source import kernel_program

__all__ = ["EmulationError", "EmulatedKernel", "EmulatedCudaPtxBackend", "compiler", "tensor_range"]

_HERE = Path(__file__).parent
_EMU_DIR = _HERE / "emulation"


class EmulationError(CudaPtxError):
    """The host emulation could not be built, or the emulated kernel reported an error."""


def compiler() -> str | None:
    """The C++ compiler the emulation uses (``$CXX`` or ``g++``), or ``None`` if there is none."""
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def tensor_range(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` the elements of ``t`` occupy (non-negative strides)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


#: compiler flags of every build (the precompiled header's too: GCC uses one only under the same flags); -Og builds
#: in about four fifths of -O1's time (-O0 in about nine tenths) and the emulated kernels run as fast
_FLAGS = ("-std=c++20", "-Og", "-fPIC", "-w", "-DATTNPLAN_HOST_EMULATION")
_STD_LOCK = threading.Lock()
#: one emulated launch at a time in the process: the harness keeps a launch's state (its parameters, the block order,
#: the readable ranges, the blocks' shared memory) in globals of its shared object, and ctypes releases the GIL
_LAUNCH_LOCK = threading.Lock()
_STD_HEADERS: dict[tuple[str, Path], Path | None] = {}


def _std_header(cxx: str, out_dir: Path) -> Path | None:
    """A header of the standard headers ``simt.h`` and ``harness.cpp`` include, precompiled once per compiler and
    ``out_dir`` (a ~30 MB ``.gch`` next to it), for the builds' ``-include``: each build then loads them instead
    of parsing them (about a quarter of a build's time). ``None`` if the precompilation fails (builds parse them).

    Included first, the standard headers change nothing in the kernel's code: they declare only ``std::`` names
    and the C library's, which ``simt.h`` includes first anyway, and their include guards make the later
    ``#include`` lines no-ops. GCC checks a ``.gch`` against the compiler and flags and ignores one that does not
    fit (the header's text is then parsed instead), so a stale one never changes a build.
    """
    with _STD_LOCK:
        key = (cxx, out_dir)
        if key in _STD_HEADERS and (_STD_HEADERS[key] is None or _STD_HEADERS[key].with_suffix(".h.gch").exists()):
            return _STD_HEADERS[key]  # (built again if the directory was emptied since)
        text = "".join(f"#include <{name}>\n" for name in dict.fromkeys(re.findall(
            r"^\s*#\s*include\s*<([^>]+)>", (_EMU_DIR / "simt.h").read_text() + (_EMU_DIR / "harness.cpp").read_text(),
            re.M)))
        digest = hashlib.sha256("\0".join((text, " ".join(_FLAGS), cxx)).encode()).hexdigest()[:16]
        header = out_dir / f"std-{digest}.h"
        gch = header.with_name(header.name + ".gch")
        result: Path | None = header
        with filelock.FileLock(str(header) + ".lock"):
            if not gch.exists():
                tmp_h = header.with_name(f"{header.stem}.{os.getpid()}.tmp.h")
                tmp_h.write_text(text)
                os.replace(tmp_h, header)
                tmp = gch.with_name(f"{gch.name}.{os.getpid()}.tmp")
                r = subprocess.run([cxx, *_FLAGS, "-x", "c++-header", str(header), "-o", str(tmp)], capture_output=True)
                if r.returncode:
                    tmp.unlink(missing_ok=True)
                    result = None
                else:
                    os.replace(tmp, gch)
        _STD_HEADERS[key] = result
        return result


class EmulatedKernel:
    """One :class:`KernelSpec` compiled for the host emulation (cached per source hash in ``build_dir``; one
    builder per shared object, across threads and processes, under a file lock).

    Args:
        spec: the specialization.
        build_dir: where shared objects go (default: ``$ATTNPLAN_CACHE_DIR/emulation`` or a temp dir).
    Raises:
        EmulationError: no compiler, or compilation failed (message has the compiler's output).
    """

    def __init__(self, spec: KernelSpec, build_dir: str | os.PathLike | None = None):
        cxx = compiler()
        if cxx is None:
            raise EmulationError("no C++ compiler ($CXX or g++) for the cuda_ptx host emulation")
        self.spec = spec
        defines = [o for o in spec.options() if o.startswith("-D")]
        h = hashlib.sha256()
        for part in (kernel_program().digest, (_EMU_DIR / "simt.h").read_text(), (_EMU_DIR / "harness.cpp").read_text(),
                     " ".join(defines), " ".join(_FLAGS), cxx):  # every header's text, through the program's digest
            h.update(part.encode())
        root = Path(build_dir) if build_dir else Path(os.environ.get("ATTNPLAN_CACHE_DIR") or tempfile.gettempdir())
        out_dir = root / "emulation"
        out_dir.mkdir(parents=True, exist_ok=True)
        so = out_dir / f"{spec.name}-{h.hexdigest()[:16]}.so"
        if not so.exists():
            # one builder per file: another process or thread building the same .so is waited for and its file loaded;
            # the temporary name is still per builder and os.replace publishes atomically (a reader never sees half)
            with filelock.FileLock(str(so) + ".lock"):
                if not so.exists():
                    pch = _std_header(cxx, out_dir)
                    tmp = so.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                    cmd = [cxx, *_FLAGS, "-shared", *(("-include", str(pch)) if pch else ()), *defines,
                           str(_EMU_DIR / "harness.cpp"), "-o", str(tmp)]
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode:
                        raise EmulationError(f"building the host emulation of {spec.name} failed:\n{' '.join(cmd)}\n"
                                             f"{r.stderr}")
                    os.replace(tmp, so)
        self.lib = ctypes.CDLL(str(so))
        self.lib.emu_launch.restype = ctypes.c_int
        self.lib.emu_launch.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int, ctypes.c_ulonglong,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.emu_constant.restype = ctypes.c_int
        self.lib.emu_constant.argtypes = [ctypes.c_char_p]
        self.lib.emu_block_order.restype = None
        self.lib.emu_block_order.argtypes = [ctypes.c_uint]

    def constant(self, name: str) -> int:
        """A kernel constant as the compiled kernel computes it: ``smem``, ``tile``, ``threads``, ``lpt``, ``rt``,
        ``mma``, ``ntw``, ``rs`` (merge kernels: ``threads``, ``teams``, ``smem``, ``chunk``); -1 for another name."""
        return int(self.lib.emu_constant(name.encode()))

    def launch(self, cfg: LaunchConfig, args: PackedArgs, readable: list[torch.Tensor], block_order: int = 0) -> None:
        """Run the grid; ``readable`` are the tensors cp.async / ``__ldg`` / ``__ldcg`` may read (and
        atomics update). ``block_order``: 0 runs the blocks in order (x fastest), another value in a
        permutation drawn from it (blocks run one at a time either way).

        Launches from several threads run one at a time (the harness's launch state is global).

        Raises:
            EmulationError: the kernel read outside ``readable`` or deadlocked at a barrier.
        """
        if cfg.block[1:] != (1, 1):
            raise EmulationError(f"block {cfg.block}: only 1-D blocks are emulated")
        ranges = [x for t in readable if t is not None for x in tensor_range(t)]
        arr = (ctypes.c_ulonglong * max(1, len(ranges)))(*ranges)
        err = ctypes.create_string_buffer(512)
        with _LAUNCH_LOCK:
            self.lib.emu_block_order(int(block_order))
            rc = self.lib.emu_launch(*cfg.grid, cfg.block[0], cfg.smem, args.kernel_params, ctypes.addressof(arr),
                                     len(ranges) // 2, err, len(err))
        if rc:
            raise EmulationError(f"emulated {self.spec.name} failed: {err.value.decode(errors='replace')}")


class EmulatedCudaPtxBackend(CudaPtxBackend):
    """:class:`CudaPtxBackend` whose launches run the host emulation on CPU tensors (tests only)."""

    name = "cuda_ptx"

    def __init__(self, build_dir: str | os.PathLike | None = None):
        super().__init__()
        self.build_dir = build_dir
        self.kernels: dict[KernelSpec, EmulatedKernel] = {}
        self._tls = threading.local()  # each thread's launch, its readable tensors (partial / merge set them)
        #: the order launches run their blocks in (:meth:`EmulatedKernel.launch`'s ``block_order``)
        self.block_order = 0

    @property
    def _readable(self) -> list[torch.Tensor]:
        """The tensors this thread's current launch may read (:meth:`EmulatedKernel.launch`'s ``readable``)."""
        return getattr(self._tls, "readable", [])

    @_readable.setter
    def _readable(self, tensors: list[torch.Tensor]) -> None:
        self._tls.readable = tensors

    def available(self, device: torch.device) -> tuple[bool, str]:
        if torch.device(device).type != "cpu":
            return False, "the cuda_ptx host emulation runs on CPU tensors"
        return (True, "") if compiler() else (False, "no C++ compiler for the cuda_ptx host emulation")

    def prebuild(self, specs, workers: int | None = None) -> None:
        """Build the emulations of ``specs`` now, several compiler processes at a time (each build
        takes ~1 s of one core), so that later launches only load them.

        Raises:
            EmulationError: a build failed.
        """
        from concurrent.futures import ThreadPoolExecutor

        todo = [s for s in dict.fromkeys(specs) if s not in self.kernels]
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            for spec, k in zip(todo, pool.map(lambda s: EmulatedKernel(s, self.build_dir), todo)):
                self.kernels[spec] = k

    def prepare(self, plan, device) -> None:
        """Build the emulations of every kernel ``plan`` launches (the GPU backend compiles and loads them)."""
        kinds = ("partial", "merge") if plan.merge == "separate" else ("partial",)
        self.prebuild([self.spec_for(k, plan, torch.device(device)) for k in kinds])

    def kernel(self, spec: KernelSpec) -> EmulatedKernel:
        k = self.kernels.get(spec)
        if k is None:
            k = self.kernels[spec] = EmulatedKernel(spec, self.build_dir)
        return k

    def bind(self, plan, workspace, inputs, previous=None) -> None:
        """No bound launch: every emulated launch goes through :meth:`partial` / :meth:`merge` (which tell the
        emulation the tensors it may read)."""
        return None

    def _launch(self, spec, cfg, signature, values, device, pdl: bool = False) -> None:
        self.kernel(spec).launch(cfg, PackedArgs(signature, values), self._readable, self.block_order)

    @staticmethod
    def _inputs(x) -> list:
        return [x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.k_scale, x.v_scale, x.sinks]

    @staticmethod
    def _workspace(ws) -> list:  # the fused merge reads the states back (ld.global.cg) and counts in the counters
        st = ws.state
        return [ws.targets, ws.meta, ws.counters, *(() if st is None else (st.o, st.lse))]

    def partial(self, plan, inputs, workspace, out, lse) -> None:
        self._readable = self._inputs(inputs) + self._workspace(workspace)
        super().partial(plan, inputs, workspace, out, lse)

    def merge(self, plan, workspace, out, lse, sinks=None) -> None:
        self._readable = self._workspace(workspace)
        super().merge(plan, workspace, out, lse, sinks)

    def probe(self, spec, seq_lens, schedule, probe_units, **kw):
        self._readable = []  # the prologue reads seq_lens and targets with plain loads
        return super().probe(spec, seq_lens, schedule, probe_units, **kw)
