"""Compile the Triton split-KV partial kernel for sm_90 on a machine without a GPU and print what the
compiler made of it: shared memory (the cp.async ring), cp.async and vector-load counts, mma count,
fp8 conversions. A diagnostic for changes that should not need a GPU to check their premise (e.g.
``benchmarks/NOTES.md``, fp8 tiles: an fp8 tile of 64 tokens keeps half the bytes of a bf16 one in its ring).

    python benchmarks/triton_compile_stats.py

Arguments are specialized the way Triton specializes a real launch (pointers and the strides that
are multiples of 16 marked divisible by 16); without that, Triton emits scalar loads and does not
pipeline them, and the numbers say nothing about a GPU run (``attnplan.backends.triton.offline``).
"""

import argparse
import itertools

from attnplan.backends.triton.offline import compile_partial


def compile_stats(kv: str, block_n: int, stages: int, paged: bool = False, head_dim: int = 128, group: int = 4,
                  warps: int = 4, arch: int = 90) -> dict:
    """Compile one specialization (q bf16, KV ``kv`` = ``"bf16"`` or ``"fp8e4nv"``) and count what matters."""
    c = compile_partial("bf16", kv, arch=arch, warps=warps, stages=stages, GROUP=group, HEAD_DIM=head_dim,
                        BLOCK_N=block_n, PAGE_SIZE=16 if paged else 1, PAGED=paged)
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
