"""The CUDA C program of the ``cuda_ptx`` kernels: ``decode.cu`` and the headers it includes, read from the package.

NVRTC gets the headers as named header sources (``nvrtcCreateProgram``'s ``headers`` / ``includeNames``), so no
include path and no file system access is needed at compile time; the compile cache's key covers every header's
text (:meth:`KernelProgram.digest`). The host emulation compiles the same files with a C++ compiler
(``emulation/harness.cpp`` includes ``decode.cu``, whose includes resolve next to it).

Example::

    prog = kernel_program()
    ptx = prog.compile(spec.options(), CompileTarget("compute_90", "ptx")).image
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from .nvrtc import CompileCache, CompileTarget, Compiled, compile_source

__all__ = ["KernelProgram", "kernel_program", "KERNEL_FILE"]

#: the translation unit NVRTC compiles (its headers are every ``*.cuh`` of the package)
KERNEL_FILE = "decode.cu"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*\n", re.M)


@dataclass(frozen=True)
class KernelProgram:
    """A CUDA C program: the main source and the headers it may include by name.

    Attributes:
        name: the main source's file name (NVRTC's program name), e.g. ``"decode.cu"``.
        source: its text.
        headers: ``(include name, text)`` pairs, sorted by name.
    """

    name: str
    source: str
    headers: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        """SHA-256 over the name, the source and every header (name and text): what changes the compiled image."""
        h = hashlib.sha256()
        for part in (self.name, self.source, *(x for pair in self.headers for x in pair)):
            h.update(hashlib.sha256(part.encode()).digest())
        return h.hexdigest()

    def compile(self, options: list[str], target: CompileTarget) -> Compiled:
        """Compile with NVRTC (no cache): :func:`~.nvrtc.compile_source` with the headers.

        Raises:
            NvrtcError: NVRTC is unusable or the compile fails (message with NVRTC's log).
        """
        return compile_source(self.source, self.name, options, target, headers=self.headers)

    def cached(self, cache: CompileCache, name: str, options: list[str], target: CompileTarget) -> Compiled:
        """Compile through ``cache`` (:meth:`~.nvrtc.CompileCache.get`; ``name`` spells the specialization).

        Raises:
            NvrtcError: the compile failed (nothing is cached).
        """
        return cache.get(name, self.source, options, target, program_name=self.name, headers=self.headers)

    def flattened(self) -> str:
        """One self-contained text: every ``#include "x"`` of one of the program's headers replaced by that header's
        text, recursively; a header with ``#pragma once`` only where it is first included (its pragma dropped), for
        tools that take a single file (``nvcc`` in the tests). The kernel-body fragments (no pragma) are expanded
        wherever they are included.

        Raises:
            ValueError: an include names a file that is not among the headers, or a header includes itself.
        """
        texts = dict(self.headers)
        done: set[str] = set()

        def expand(text: str, chain: tuple[str, ...]) -> str:
            def one(m: re.Match) -> str:
                inc = m.group(1)
                if inc not in texts:
                    raise ValueError(f"{self.name} includes {inc!r}, which is not one of its headers {sorted(texts)}")
                if inc in chain:
                    raise ValueError(f"{inc!r} includes itself ({' -> '.join((*chain, inc))})")
                body = texts[inc]
                if _PRAGMA_ONCE.search(body):
                    if inc in done:
                        return ""
                    done.add(inc)
                    body = _PRAGMA_ONCE.sub("", body)
                return expand(body, (*chain, inc))
            return _INCLUDE.sub(one, text)

        return expand(self.source, (self.name,))


@functools.lru_cache(maxsize=1)
def kernel_program() -> KernelProgram:
    """The kernels' program: :data:`KERNEL_FILE` and every ``*.cuh`` packaged next to this module."""
    root = resources.files(__package__)
    headers = tuple(sorted((f.name, f.read_text()) for f in root.iterdir() if f.name.endswith(".cuh")))
    return KernelProgram(KERNEL_FILE, root.joinpath(KERNEL_FILE).read_text(), headers)
