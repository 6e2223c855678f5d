"""Compile the Triton kernels for a GPU architecture on a machine without one (no launch).

Triton's interpreter (``TRITON_INTERPRET=1``, what CPU-only CI runs) executes kernels as numpy
code and skips the compiler's checks: a loop-carried variable whose type changes, a constexpr
branch that does not type-check, a layout the backend cannot lower. :func:`compile_partial`
runs the real compiler pipeline (TTIR, TTGIR, LLVM IR, PTX and, with ``ptxas`` present, the
cubin) for one specialization, so those errors surface in CI, not on the first GPU run.

Arguments are specialized the way Triton specializes a real launch (pointers and the strides that
are multiples of 16 marked divisible by 16, the unit strides of ``seq_lens`` and the block table's
columns passed as the constant 1); without that, Triton emits scalar loads and does not pipeline
them, and compile statistics (``benchmarks/triton_compile_stats.py``) say nothing about a GPU run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@functools.lru_cache(maxsize=None)
def _sibling(name: str):
    """This package's module ``name``: imported as usual, or, in the child of :func:`compile_cases` (run by path),
    loaded from its file alone (``kernels`` imports only Triton, ``raw`` nothing), not through the attnplan package,
    whose import (torch, numba) costs ~2 s of the child's ~3."""
    if __package__:
        import importlib

        return importlib.import_module(f".{name}", __package__)
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"attnplan_offline_{name}",
                                                  os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_kernels = _sibling("kernels")

__all__ = ["compile_partial", "compile_merge", "compile_cases"]

_PARTIAL_INTS = ["batch", "ws_slots", "min_unit_granules", "max_units_per_seq", "last_page", "capacity", "stride_sl",
                 "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
                 "stride_vh", "stride_btb", "stride_btc", "stride_outb", "stride_outt", "stride_outh", "stride_lob",
                 "stride_lot"]
_MERGE_INTS = ["batch", "ws_slots", "stride_outb", "stride_outt", "stride_outh", "stride_lob", "stride_lot"]
#: strides that are not multiples of 16 elements in general (LSE strides, the block table's, seq_lens')
_NOT_DIVISIBLE = ("_lob", "_lot", "_btb", "_btc", "_sl")


def _jit_kernels():
    """The kernels module, checked to hold real ``JITFunction`` objects: under ``TRITON_INTERPRET=1``
    ``@triton.jit`` makes interpreter objects and the interpreter's patches also break compilation,
    so offline compiles run in a process without it (:func:`compile_cases`)."""
    from triton.runtime.jit import JITFunction

    if not isinstance(_kernels.split_kv_partial_kernel, JITFunction):
        raise RuntimeError("offline Triton compiles need TRITON_INTERPRET unset (use compile_cases)")
    return _kernels


def _override(defaults: dict, overrides: dict) -> dict:
    """``defaults`` updated by ``overrides``; a name that is not one of the kernel's constexprs raises ValueError."""
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"unknown constexpr(s) {sorted(unknown)}; the kernel's are {sorted(defaults)}")
    return {**defaults, **overrides}


def _compile(fn, sig: dict, const: dict, arch: int, warps: int, stages: int):
    sig = {**sig, **{k: "constexpr" for k in const}}
    names = list(sig)
    div = [n for n in names if sig[n].startswith("*") or (n.startswith("stride") and not n.endswith(_NOT_DIVISIBLE))]
    src = ASTSource(fn=fn, signature=sig, constexprs=const,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def compile_partial(q: str = "bf16", kv: str = "bf16", *, arch: int = 90, warps: int = 4, stages: int = 3,
                    **constexprs):
    """Compile ``split_kv_partial_kernel`` for ``sm_<arch>``; returns Triton's ``CompiledKernel``
    (``.asm["ptx"]``, ``.metadata.shared`` in bytes).

    Args:
        q: q / output element type in Triton's names (``"bf16"``, ``"fp16"``).
        kv: cache element type (``"bf16"``, ``"fp16"``, ``"fp8e4nv"`` for float8_e4m3fn).
        constexprs: overrides of the kernel's constexpr arguments (defaults: q_len 1, GQA group 4, 8 KV heads,
            head_dim 128, block_n 64, contiguous cache, a balanced multi-unit schedule with the separate merge, no
            variant).
    Raises:
        triton.compiler.errors.CompilationError: the specialization does not compile.
        ValueError: a name in ``constexprs`` is not one of the kernel's constexprs.
        RuntimeError: called under ``TRITON_INTERPRET=1`` (use :func:`compile_cases`).
    """
    sig = {"Q": "*" + q, "K": "*" + kv, "V": "*" + kv, "SEQ_LENS": "*i32", "BLOCK_TABLE": "*i32", "TARGETS": "*i32",
           "META": "*i32", "COUNTERS": "*i32", "WS_O": "*fp32", "WS_LSE": "*fp32", "OUT": "*" + q,
           "LSE_OUT": "*fp32", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "SINKS": "*fp32", "sm_scale_log2": "fp32",
           "window_left": "i32", "soft_cap": "fp32"}
    sig.update({n: "i32" for n in _PARTIAL_INTS})
    group = constexprs.get("GROUP", 4)
    q_len = constexprs.get("Q_LEN", 1)
    d = constexprs.get("HEAD_DIM", 128)
    const = dict(Q_LEN=q_len, GROUP=group, NUM_KV_HEADS=8, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
                 BLOCK_M=max(16, triton.next_power_of_2(group * q_len)), BLOCK_N=64, BLOCK_B=1024, ONE_BLOCK=True, GRANULE=64,
                 PAGE_SIZE=1, PAGED=False, MULTI=True, BALANCED=True, MERGE="separate", WRITE_LSE=True, UPCAST=False,
                 DOT_PRECISION="tf32", WINDOW=False, SOFTCAP=False, FP8=kv.startswith("fp8"), SINKS_ON=False,
                 FUSED_UNROLL=None,
                 stride_sl=1, stride_btc=1)  # unit strides: Triton passes an int argument equal to 1 as a constant
    const = _override(const, constexprs)
    if const["FUSED_UNROLL"] is None:  # the backend's choice for these tiles
        const["FUSED_UNROLL"] = _kernels.fused_unroll(const["BLOCK_M"], const["BLOCK_D"])
    return _compile(_jit_kernels().split_kv_partial_kernel, sig, const, arch, warps, stages)


def compile_merge(out: str = "bf16", *, head_dim: int = 128, arch: int = 90, **constexprs):
    """Compile ``merge_kernel`` for ``sm_<arch>`` (out element type ``out``); as :func:`compile_partial`."""
    sig = {"WS_O": "*fp32", "WS_LSE": "*fp32", "META": "*i32", "OUT": "*" + out, "LSE_OUT": "*fp32",
           "SINKS": "*fp32"}
    sig.update({n: "i32" for n in _MERGE_INTS})
    const = dict(NUM_HEADS=32, Q_LEN=1, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=32,
                 WRITE_LSE=True, SINKS_ON=False)
    return _compile(_jit_kernels().merge_kernel, sig, _override(const, constexprs), arch, 4, 1)


def _entry_param_sizes(ptx: str, entry: str) -> list[int]:
    """Sizes in bytes of the PTX entry's ``.param`` declarations, in order."""
    head = ptx[ptx.index(entry):]
    head = head[:head.index(")")]
    sizes = []
    for line in head.splitlines():
        line = line.strip()
        if line.startswith(".param"):
            ty = line.split()[1]
            sizes.append(int("".join(ch for ch in ty if ch.isdigit())) // 8)
    return sizes


def _derived_param_sizes(c) -> list[int] | None:
    """Sizes of the parameters the raw launch derives from Triton's signature and metadata (``raw.param_kinds``),
    ``None`` where it refuses the kernel."""
    kinds = _sibling("raw").param_kinds(c.src, c.metadata)
    return None if kinds is None else [size for _, _, size in kinds]


def _run_case(case: dict) -> dict:
    try:
        if case["kind"] == "partial":
            c = compile_partial(case.get("q", "bf16"), case.get("kv", "bf16"), arch=case.get("arch", 90),
                                **case.get("const", {}))
            entry = ".entry split_kv_partial_kernel"
        else:
            c = compile_merge(case.get("out", "bf16"), arch=case.get("arch", 90), **case.get("const", {}))
            entry = ".entry merge_kernel"
        ptx = c.asm["ptx"]
        return {"ok": entry in ptx, "error": "" if entry in ptx else "entry missing from PTX",
                "shared_bytes": c.metadata.shared, "ptx_params": _entry_param_sizes(ptx, entry),
                "derived_params": _derived_param_sizes(c)}
    except Exception as e:  # noqa: BLE001 - reported per case
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}


def compile_cases(cases: list[dict], timeout: float = 900) -> list[dict]:
    """Compile each case (``{"kind": "partial" | "merge", "q", "kv", "out", "arch", "const": {...}}``)
    in one child process without ``TRITON_INTERPRET``; returns ``{"ok", "error", "shared_bytes"}`` per
    case, in order.

    Raises:
        RuntimeError: the child process failed as a whole (its stderr attached).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(cases), capture_output=True,
                       text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"offline compile process failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps([_run_case(c) for c in json.loads(sys.stdin.read())]))
