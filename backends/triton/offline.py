"""Compile the Triton kernels for a GPU architecture on a machine without one (no launch).

Triton's interpreter (``TRITON_INTERPRET=1``, what CPU-only CI runs) executes kernels as numpy
code and skips the compiler's checks: a loop-carried variable whose type changes, a constexpr
branch that does not type-check, a layout the backend cannot lower. :func:`compile_partial`
runs the real compiler pipeline (TTIR, TTGIR, LLVM IR, PTX and, with ``ptxas`` present, the
cubin) for one specialization, so those errors surface in CI, not on the first GPU run.

Arguments are specialized the way Triton specializes a real launch (pointers and the strides that
are multiples of 16 marked divisible by 16); without that, Triton emits scalar loads and does not
pipeline them, and compile statistics (``benchmarks/triton_compile_stats.py``) say nothing about a
GPU run.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kernels

__all__ = ["compile_partial", "compile_merge"]

_PARTIAL_INTS = ["stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
                 "stride_vt", "stride_vh", "stride_btb", "stride_ob", "stride_ot", "stride_oh", "stride_os",
                 "stride_lb", "stride_lt", "stride_lh", "stride_ls", "stride_outb", "stride_outt", "stride_outh",
                 "stride_lob", "stride_lot", "stride_loh", "chunk_size", "num_splits", "num_kv_heads", "lock_offset"]
#: strides that are not multiples of 16 elements in general (LSE strides, the block table's row)
_NOT_DIVISIBLE = ("_lh", "_ls", "_lt", "_loh", "_lot", "_btb")


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
        constexprs: overrides of the kernel's constexpr arguments (defaults: q_len 1, GQA group 4,
            head_dim 128, block_n 64, contiguous cache, separate merge, no variant).
    Raises:
        triton.compiler.errors.CompilationError: the specialization does not compile.
    """
    sig = {"Q": "*" + q, "K": "*" + kv, "V": "*" + kv, "SEQ_LENS": "*i32", "BLOCK_TABLE": "*i32", "O": "*fp32",
           "LSE": "*fp32", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "SINKS": "*fp32", "OUT": "*" + q,
           "LSE_OUT": "*fp32", "COUNTERS": "*i32", "sm_scale_log2": "fp32", "window_left": "i32", "soft_cap": "fp32"}
    sig.update({n: "i32" for n in _PARTIAL_INTS})
    group = constexprs.get("GROUP", 4)
    q_len = constexprs.get("Q_LEN", 1)
    d = constexprs.get("HEAD_DIM", 128)
    const = dict(Q_LEN=q_len, GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
                 BLOCK_DV=triton.next_power_of_2(d), N_COLS=1, BLOCK_M=max(16, triton.next_power_of_2(group * q_len)),
                 BLOCK_N=64, PAGE_SIZE=1, PAGED=False, WRITE_LSE=True, UPCAST=False, DOT_PRECISION="tf32",
                 WINDOW=False, SOFTCAP=False, FP8=kv.startswith("fp8"), SINKS_ON=False, MERGE="none",
                 WRITE_OUT_LSE=False)
    unknown = set(constexprs) - set(const)
    if unknown:
        raise ValueError(f"unknown constexpr(s) {sorted(unknown)}; the kernel's are {sorted(const)}")
    const.update(constexprs)
    return _compile(kernels.split_kv_partial_kernel, sig, const, arch, warps, stages)


def compile_merge(out: str = "bf16", *, head_dim: int = 128, arch: int = 90, **constexprs):
    """Compile ``merge_kernel`` for ``sm_<arch>`` (out element type ``out``); as :func:`compile_partial`."""
    sig = {"O_PART": "*fp32", "LSE_PART": "*fp32", "OUT": "*" + out, "LSE_OUT": "*fp32", "SINKS": "*fp32",
           "num_splits": "i32"}
    sig.update({n: "i32" for n in ["stride_pb", "stride_pt", "stride_ph", "stride_ps", "stride_lb", "stride_lt",
                                   "stride_lh", "stride_ls", "stride_outb", "stride_outt", "stride_outh",
                                   "stride_lob", "stride_lot", "stride_loh"]})
    const = dict(NUM_HEADS=32, Q_LEN=1, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=32,
                 WRITE_LSE=True, SINKS_ON=False)
    const.update(constexprs)
    return _compile(kernels.merge_kernel, sig, const, arch, 4, 1)
