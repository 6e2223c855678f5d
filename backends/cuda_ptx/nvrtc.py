"""NVRTC compilation of the ``cuda_ptx`` kernels, with an in-memory and on-disk compile cache.

Method (FlashInfer's ``jit/core.py`` load / build / lock contract, adapted to NVRTC):

* **Target.** The source is compiled to a **cubin** (SASS) for the device's exact architecture
  (``--gpu-architecture=sm_90`` on H200) and read with ``nvrtcGetCUBIN``. A cubin needs no driver
  JIT, so an NVRTC newer than the driver (pip NVRTC 13.5 on a CUDA 13.0 driver) still produces code
  the driver loads; PTX from a newer NVRTC would carry a PTX ISA version the older driver rejects.
  **PTX is only a fallback** for a device architecture that this
  NVRTC cannot emit SASS for (a device newer than NVRTC): then PTX for the newest virtual
  architecture NVRTC knows below the device is produced and the driver JIT-compiles it at load.
* **Cache.** In memory (per process) and on disk: ``$ATTNPLAN_CACHE_DIR/nvrtc`` when set, else the
  user cache directory (``platformdirs.user_cache_dir("attnplan")/nvrtc``). File names spell the
  specialization, the architecture, the NVRTC version and a hash of (source, every header, options,
  target, NVRTC version, file format), so nothing compiled for one architecture, option set or header
  text is ever loaded for another. Builds run under a ``filelock`` lock, files are
  written atomically (temporary file + ``os.replace``), and each file carries a SHA-256 of its
  image: a corrupt or truncated file is rebuilt with a warning. A failed compile writes nothing.
* **Errors.** A compile error raises :class:`~._bindings.NvrtcError` whose message and ``log``
  attribute hold NVRTC's program log.

Every compile passes ``--ptxas-options=-v`` so the cache stores the kernel's registers, spills and
shared memory (:func:`parse_ptxas_info`), which the CPU tests check.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ._bindings import NvrtcError, bindings, check_nvrtc

__all__ = [
    "CompileTarget", "Compiled", "CompileCache", "CacheStats", "compile_source", "cubin_resources", "select_target",
    "nvrtc_version", "supported_archs", "parse_ptxas_info", "default_cache_dir", "CACHE_FORMAT",
]

#: bumped whenever the on-disk file layout changes; part of every cache key
CACHE_FORMAT = 1
_MAGIC = b"ATTNPLAN-NVRTC\n"


@dataclass(frozen=True)
class CompileTarget:
    """What NVRTC is asked to produce.

    Attributes:
        arch: ``"sm_90"`` (cubin) or ``"compute_90"`` (PTX fallback).
        kind: ``"cubin"`` or ``"ptx"``.
    """

    arch: str
    kind: str

    @property
    def option(self) -> str:
        return f"--gpu-architecture={self.arch}"


@dataclass(frozen=True)
class Compiled:
    """A compiled image and what ptxas reported.

    Attributes:
        image: cubin bytes, or NUL-terminated PTX bytes for the PTX fallback.
        target: the :class:`CompileTarget`.
        log: NVRTC's program log (ptxas ``-v`` lines for cubins).
        resources: :func:`parse_ptxas_info` of the log, keyed by kernel name. When the log holds no ptxas report
            (cubins only), :func:`cubin_resources` of the image instead (``"from": "cubin"``). NVRTC 13.0 with
            driver 580 (seen on H200 machines) sometimes prints none: always for a program compiled again in the
            process, even with an extra unused macro, and for some programs compiled once
            (``benchmarks/diag/nvrtc_log_probe.py`` shows it). Empty if the cubin
            cannot be read either (pyelftools missing, an unknown record layout): the image is good regardless.
        source: ``"compiled"``, ``"memory"`` or ``"disk"`` (where this object came from).
        path: the on-disk cache file, or ``None``.
    """

    image: bytes
    target: CompileTarget
    log: str
    resources: dict
    source: str = "compiled"
    path: str | None = None


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)``. Raises :class:`NvrtcError` if NVRTC cannot be loaded."""
    _, nvrtc = bindings()
    try:
        major, minor = check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except NvrtcError:
        raise
    except Exception as e:  # noqa: BLE001 - library not found, symbol missing
        raise NvrtcError(f"NVRTC cannot be loaded: {type(e).__name__}: {e}") from None
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """SASS architectures this NVRTC can target (``[75, 80, ..., 90, ...]``)."""
    _, nvrtc = bindings()
    try:
        return tuple(sorted(int(a) for a in check_nvrtc(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")))
    except NvrtcError:
        raise
    except Exception as e:  # noqa: BLE001
        raise NvrtcError(f"NVRTC cannot be loaded: {type(e).__name__}: {e}") from None


def select_target(cc: tuple[int, int], archs: "list[int] | tuple[int, ...] | None" = None) -> CompileTarget:
    """The target for a device of compute capability ``cc``: a cubin for ``sm_<cc>`` when NVRTC
    supports it, else PTX for the newest supported architecture not above ``cc``.

    Raises:
        NvrtcError: NVRTC supports no architecture at or below ``cc``.
    """
    archs = supported_archs() if archs is None else sorted(archs)
    want = cc[0] * 10 + cc[1]
    if want in archs:
        return CompileTarget(f"sm_{want}", "cubin")
    below = [a for a in archs if a <= want]
    if not below:
        raise NvrtcError(f"NVRTC {nvrtc_version()} supports architectures {archs}, none at or below sm_{want}")
    return CompileTarget(f"compute_{below[-1]}", "ptx")


_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_BARRIERS = re.compile(r"used (\d+) barriers")


def parse_ptxas_info(log: str) -> dict[str, dict]:
    """Parse ``ptxas -v`` output (NVRTC's log with ``--ptxas-options=-v``, or ``nvcc -Xptxas -v``).

    Returns:
        ``{kernel: {"arch", "registers", "spill_stores", "spill_loads", "stack", "smem", "barriers"}}``
        (bytes for the sizes; ``smem`` is static shared memory).
    """
    out: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"arch": m.group(2), "registers": 0, "spill_stores": 0,
                                              "spill_loads": 0, "stack": 0, "smem": 0, "barriers": 0})
            continue
        if cur is None:
            continue
        m = _PTXAS_STACK.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(x) for x in m.groups())
        m = _PTXAS_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            s = _PTXAS_SMEM.search(line)
            cur["smem"] = int(s.group(1)) if s else 0
            b = _PTXAS_BARRIERS.search(line)
            cur["barriers"] = int(b.group(1)) if b else 0
    return out


def _program_log(nvrtc, prog) -> str:
    size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    if not size or size <= 1:
        return ""
    buf = b" " * size
    check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\x00").decode(errors="replace").strip()


# EIATTR records of a cubin's .nv.info sections (NVIDIA's ELF notes; read as cuobjdump shows them): a 1-byte
# format, a 1-byte attribute, then 2 bytes (value, formats 1-3) or a 2-byte size and that many bytes (format 4)
_EIFMT_SVAL = 4
_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT, _EIATTR_NUM_BARRIERS = 0x11, 0x2F, 0x4C
#: shared memory sm_90+ cubins reserve per block inside each kernel's .nv.shared section (a
#: .nv.shared.reserved.* section marks them); ptxas's static "smem" leaves it out
_RESERVED_SMEM = 1024


def _eiattr_records(data: bytes):
    i = 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == _EIFMT_SVAL:
            n = int.from_bytes(data[i + 2:i + 4], "little")
            yield attr, data[i + 4:i + 4 + n]
            i += 4 + n
        elif fmt in (1, 2, 3):
            yield attr, int.from_bytes(data[i + 2:i + 4], "little")
            i += 4
        else:
            raise ValueError(f"unknown EIATTR format {fmt} at byte {i}")


def cubin_resources(image: bytes, arch: str) -> dict[str, dict]:
    """What ptxas reports, read from a cubin instead of NVRTC's log (:attr:`Compiled.resources` when the log has
    no report).

    Args:
        image: the cubin's bytes (an ELF image, as :func:`compile_source` returns for a cubin target).
        arch: its architecture, e.g. ``"sm_90"`` (copied into each entry; not read from the image).
    Returns:
        per kernel (an entry with a ``.nv.info.<kernel>`` section) ``{"arch", "registers", "spill_stores",
        "spill_loads", "stack", "smem", "barriers", "from": "cubin"}``, sizes in bytes, as
        :func:`parse_ptxas_info` gives them. Registers, the stack frame (spills live in it, so 0 means no spills
        and no stack) and the barrier count come from the ``.nv.info`` EIATTR records (REGCOUNT 0x2f,
        FRAME_SIZE 0x11, NUM_BARRIERS 0x4c); static shared memory is the size of ``.nv.shared.<kernel>`` less
        the block's reserved 1 KB on sm_90+. The spill byte counts are not in the cubin: 0 with a zero frame,
        else ``None``. Every compile test checks these against ptxas's printed report
        (``tests/test_cuda_ptx_compile.py``: ``_ptxas``, and the synthetic kernels of
        ``test_cubin_resources_with_spills_and_static_smem``). Parsed with pyelftools.
    Raises:
        ValueError: the image is not an ELF cubin, or holds an EIATTR record of an unknown format.
        ImportError: pyelftools is not installed.
    """
    import io

    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        elf = ELFFile(io.BytesIO(image))
        sections = {sec.name: sec for sec in elf.iter_sections()}
    except ELFError as e:
        raise ValueError(f"not a cubin: {e}") from None
    symtab = sections.get(".symtab")
    names = [sym.name for sym in symtab.iter_symbols()] if symtab is not None else []
    regs, frame = {}, {}
    if ".nv.info" in sections:
        for attr, val in _eiattr_records(sections[".nv.info"].data()):
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and isinstance(val, bytes) and len(val) == 8:
                sym, v = int.from_bytes(val[:4], "little"), int.from_bytes(val[4:], "little")
                if sym < len(names):
                    (regs if attr == _EIATTR_REGCOUNT else frame)[names[sym]] = v
    reserved = _RESERVED_SMEM if any(n.startswith(".nv.shared.reserved") for n in sections) else 0
    out = {}
    for sec_name, sec in sections.items():
        if not sec_name.startswith(".nv.info."):
            continue
        kernel = sec_name[len(".nv.info."):]
        barriers = next((v for a, v in _eiattr_records(sec.data()) if a == _EIATTR_NUM_BARRIERS), 0)
        shared = sections.get(f".nv.shared.{kernel}")
        stack = frame.get(kernel, 0)
        out[kernel] = {"arch": arch, "registers": regs.get(kernel, 0), "spill_stores": 0 if stack == 0 else None,
                       "spill_loads": 0 if stack == 0 else None, "stack": stack,
                       "smem": max(0, (shared["sh_size"] if shared is not None else 0) - reserved),
                       "barriers": int(barriers), "from": "cubin"}
    return out


def compile_source(source: str, name: str, options: list[str], target: CompileTarget,
                   headers: Sequence[tuple[str, str]] = ()) -> Compiled:
    """Compile CUDA C ``source`` with NVRTC to ``target`` (no cache).

    Args:
        source: CUDA C source text.
        name: program name shown in NVRTC's messages, e.g. ``"decode.cu"``.
        options: NVRTC options besides the architecture (``-D...``, ``-std=c++17``).
        target: :func:`select_target`'s answer.
        headers: ``(include name, text)`` pairs: ``#include "name"`` resolves to ``text`` (NVRTC's named header
            sources); nothing else is resolved beyond NVRTC's built-ins.
    Returns:
        :class:`Compiled` with the cubin (or PTX) image, the log and the parsed ptxas resources.
    Raises:
        NvrtcError: any NVRTC call fails; for a compile error the message ends with NVRTC's log.
    """
    _, nvrtc = bindings()
    heads = [(n.encode(), t.encode()) for n, t in headers]
    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(heads), [t for _, t in heads],
                                                [n for n, _ in heads]), "nvrtcCreateProgram")
    try:
        opts = [target.option, *options]
        if target.kind == "cubin":
            opts.append("--ptxas-options=-v")
        enc = [o.encode() for o in opts]
        result = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        log = _program_log(nvrtc, prog)
        check_nvrtc(result, f"nvrtcCompileProgram({name}, {' '.join(opts)})", log=log or "(empty log)")
        if target.kind == "cubin":
            size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * size
            check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        else:
            size = check_nvrtc(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = b" " * size
            check_nvrtc(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        if not size or not image.strip(b"\x00 "):
            raise NvrtcError(f"NVRTC produced an empty {target.kind} for {name} ({' '.join(opts)})", log)
        image = bytes(image)
        resources = parse_ptxas_info(log)
        if not resources and target.kind == "cubin":  # no report in the log (see Compiled.resources)
            try:
                resources = cubin_resources(image, target.arch)
            except Exception:  # noqa: BLE001 - a diagnostic: never fail a good compile over it (pyelftools missing,
                resources = {}  # a record layout this reader does not know)
        return Compiled(image=image, target=target, log=log, resources=resources)
    finally:
        check_nvrtc(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")


def default_cache_dir() -> Path:
    """``$ATTNPLAN_CACHE_DIR/nvrtc`` if set, else ``platformdirs.user_cache_dir("attnplan")/nvrtc``."""
    env = os.environ.get("ATTNPLAN_CACHE_DIR")
    if env:
        return Path(env) / "nvrtc"
    import platformdirs

    return Path(platformdirs.user_cache_dir("attnplan")) / "nvrtc"


@dataclass
class CacheStats:
    """Compile-cache counters: ``memory_hits``, ``disk_hits``, ``compiles`` (misses), ``rebuilt``
    (corrupt or unreadable files replaced)."""

    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    rebuilt: int = 0


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:120]


@dataclass
class CompileCache:
    """In-memory + on-disk cache of NVRTC images.

    Args:
        directory: cache directory; ``None`` = :func:`default_cache_dir` (read when first needed).
        disk: whether to use the directory at all (``False``: memory only).

    Example::

        cache = CompileCache()
        img = cache.get("partial-bf16-d128", src, ["-DX=1"], select_target((9, 0)))
    """

    directory: str | os.PathLike | None = None
    disk: bool = True
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._mem: dict[str, Compiled] = {}
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return Path(self.directory) if self.directory is not None else default_cache_dir()

    @staticmethod
    def key(source: str, options: list[str], target: CompileTarget, version: tuple[int, int],
            headers: Sequence[tuple[str, str]] = ()) -> str:
        """SHA-256 over everything that changes the image: source, every header (name and text), options, target,
        NVRTC version, format."""
        h = hashlib.sha256()
        h.update(json.dumps({"format": CACHE_FORMAT, "source": hashlib.sha256(source.encode()).hexdigest(),
                             "headers": [[n, hashlib.sha256(t.encode()).hexdigest()] for n, t in headers],
                             "options": list(options), "arch": target.arch, "kind": target.kind,
                             "nvrtc": list(version)}, sort_keys=True).encode())
        return h.hexdigest()

    def file_for(self, name: str, key: str, target: CompileTarget, version: tuple[int, int]) -> Path:
        """Cache file: ``<specialization>.<arch>.nvrtc<maj>.<min>.<hash16>.<cubin|ptx>``."""
        return self.path / f"{_slug(name)}.{target.arch}.nvrtc{version[0]}.{version[1]}.{key[:16]}.{target.kind}"

    def get(self, name: str, source: str, options: list[str], target: CompileTarget,
            program_name: str = "decode.cu", headers: Sequence[tuple[str, str]] = ()) -> Compiled:
        """The compiled image for (source, headers, options, target): from memory, disk, or a fresh compile.

        Args:
            name: the specialization's name (spelled into the file name).
            source, options, target, headers: as for :func:`compile_source`.
            program_name: the program's name for NVRTC's messages.
        Raises:
            NvrtcError: the compile failed (nothing is cached).
        """
        version = nvrtc_version()
        key = self.key(source, options, target, version, headers)
        with self._lock:
            hit = self._mem.get(key)
        if hit is not None:
            self.stats.memory_hits += 1
            return hit
        if not self.disk:
            compiled = compile_source(source, program_name, options, target, headers)
            self.stats.compiles += 1
        else:
            compiled = self._get_disk(name, key, source, options, target, version, program_name, headers)
        with self._lock:
            self._mem[key] = compiled
        return compiled

    def invalidate(self, compiled: Compiled) -> None:
        """Forget an image (memory and disk), e.g. after the driver refused to load it."""
        with self._lock:
            for k, v in list(self._mem.items()):
                if v.image == compiled.image:
                    del self._mem[k]
        if compiled.path:
            try:
                os.unlink(compiled.path)
            except OSError:
                pass

    # -- disk ------------------------------------------------------------------------------------
    def _read(self, path: Path, target: CompileTarget) -> tuple[Compiled | None, bool]:
        """``(image, corrupt)``: the cached file, or ``None`` when absent or unusable (``corrupt`` set
        and a warning issued when the file exists but is damaged)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, False
        except OSError as e:
            warnings.warn(f"attnplan cuda_ptx: cannot read compile-cache file {path} ({e}); rebuilding",
                          RuntimeWarning, stacklevel=3)
            return None, True
        try:
            if not data.startswith(_MAGIC):
                raise ValueError("bad header")
            nl = data.index(b"\n", len(_MAGIC))
            meta = json.loads(data[len(_MAGIC):nl].decode())
            image = data[nl + 1:]
            if meta.get("format") != CACHE_FORMAT or len(image) != meta["size"] \
                    or hashlib.sha256(image).hexdigest() != meta["sha256"] or not image:
                raise ValueError("checksum or size mismatch")
            return Compiled(image=image, target=target, log=meta.get("log", ""),
                            resources=meta.get("resources", {}), source="disk", path=str(path)), False
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            warnings.warn(f"attnplan cuda_ptx: corrupt compile-cache file {path} ({e}); rebuilding",
                          RuntimeWarning, stacklevel=3)
            return None, True

    def _write(self, path: Path, compiled: Compiled) -> None:
        meta = {"format": CACHE_FORMAT, "size": len(compiled.image), "sha256": hashlib.sha256(compiled.image).hexdigest(),
                "arch": compiled.target.arch, "kind": compiled.target.kind, "log": compiled.log,
                "resources": compiled.resources}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n" + compiled.image)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _get_disk(self, name, key, source, options, target, version, program_name, headers) -> Compiled:
        import filelock

        path = self.file_for(name, key, target, version)
        hit, corrupt = self._read(path, target)
        if hit is not None:
            self.stats.disk_hits += 1
            return hit
        path.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(path) + ".lock"):
            hit, corrupt2 = self._read(path, target)  # another process may have built or fixed it
            if hit is not None:
                self.stats.disk_hits += 1
                return hit
            compiled = compile_source(source, program_name, options, target, headers)
            self.stats.compiles += 1
            self.stats.rebuilt += int(corrupt or corrupt2)
            try:
                self._write(path, compiled)
            except OSError as e:
                warnings.warn(f"attnplan cuda_ptx: cannot write compile-cache file {path} ({e}); "
                              "continuing without the disk cache", RuntimeWarning, stacklevel=3)
                return compiled
        return Compiled(image=compiled.image, target=target, log=compiled.log, resources=compiled.resources,
                        source="compiled", path=str(path))
