"""Compile the Triton split-KV partial kernel for sm_90 on a machine without a GPU and print what the
compiler made of it: shared memory (the cp.async ring), cp.async and vector-load counts, mma count,
fp8 conversions. A diagnostic for changes that should not need a GPU to check their premise (e.g.
NOTES.md change 6: an fp8 tile of 64 tokens keeps half the bytes of a bf16 one in its ring).

    python benchmarks/triton_compile_stats.py

Arguments are specialized the way Triton specializes a real launch (pointers and the strides that
are multiples of 16 marked divisible by 16); without that, Triton emits scalar loads and does not
pipeline them, and the numbers say nothing about a GPU run.
"""

import argparse
import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnplan.backends.triton import kernels

_INTS = ["stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
         "stride_vh", "stride_btb", "stride_ob", "stride_ot", "stride_oh", "stride_os", "stride_lb", "stride_lt",
         "stride_lh", "stride_ls", "stride_outb", "stride_outt", "stride_outh", "stride_lob", "stride_lot",
         "stride_loh", "chunk_size", "num_splits", "num_kv_heads", "lock_offset"]
#: strides that are not multiples of 16 elements in general (LSE strides, the block table's row)
_NOT_DIVISIBLE = ("_lh", "_ls", "_lt", "_loh", "_lot", "_btb")


def compile_stats(kv: str, block_n: int, stages: int, paged: bool = False, head_dim: int = 128, group: int = 4,
                  warps: int = 4, arch: int = 90) -> dict:
    """Compile one specialization (q bf16, KV ``kv`` = ``"bf16"`` or ``"fp8e4nv"``) and count what matters."""
    sig = {"Q": "*bf16", "K": "*" + kv, "V": "*" + kv, "SEQ_LENS": "*i32", "BLOCK_TABLE": "*i32", "O": "*fp32",
           "LSE": "*fp32", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "SINKS": "*fp32", "OUT": "*bf16", "LSE_OUT": "*fp32",
           "COUNTERS": "*i32", "sm_scale_log2": "fp32", "window_left": "i32", "soft_cap": "fp32"}
    sig.update({n: "i32" for n in _INTS})
    const = dict(Q_LEN=1, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_DV=head_dim, N_COLS=1,
                 BLOCK_M=max(16, group), BLOCK_N=block_n, PAGE_SIZE=16 if paged else 1, PAGED=paged, WRITE_LSE=True,
                 UPCAST=False, DOT_PRECISION="tf32", WINDOW=False, SOFTCAP=False, FP8=kv != "bf16", SINKS_ON=False,
                 MERGE="none", WRITE_OUT_LSE=False)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    div = [n for n in names if sig[n].startswith("*") or (n.startswith("stride") and not n.endswith(_NOT_DIVISIBLE))]
    src = ASTSource(fn=kernels.split_kv_partial_kernel, signature=sig, constexprs=const,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = [line.strip() for line in c.asm["ptx"].split("\n")]
    return {"kv": kv, "block_n": block_n, "stages": stages, "paged": paged, "smem_bytes": c.metadata.shared,
            "cp_async": sum(line.startswith(("cp.async", "@")) and "cp.async" in line for line in ptx),
            "ld_global_v4": sum("ld.global" in line and ".v4" in line for line in ptx),
            "mma": sum("mma" in line for line in ptx), "cvt_e4m3": sum("e4m3" in line for line in ptx)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    print(f"{'kv':8s} {'block_n':>7s} {'stages':>6s} {'paged':>5s} {'smem B':>7s} {'cp.async':>8s} {'mma':>4s} {'e4m3 cvt':>8s}")
    for kv, bn, st, paged in itertools.chain(
            [("bf16", 64, 3, False), ("bf16", 64, 2, True)],
            itertools.product(["fp8e4nv"], [64, 128], [2, 3], [False, True])):
        s = compile_stats(kv, bn, st, paged, arch=args.arch)
        print(f"{kv:8s} {bn:7d} {st:6d} {str(paged):>5s} {s['smem_bytes']:7d} {s['cp_async']:8d} {s['mma']:4d} {s['cvt_e4m3']:8d}")


if __name__ == "__main__":
    main()
