"""Split an ncu source page (SASS, ``ncu --import R --page source --csv --print-source sass``; see
``benchmarks/ncu_partial.sh`` with ``NCU_SOURCE``) into the kernel's prologue, main loop and epilogue, and print
each region's share of the warp-stall samples with its top stall reasons. The main loop runs from the first to the
last instruction executed at least ``--loop-factor`` (8) times as often as the kernel's entry (once per warp per
tile, against once per warp: a warp of the profiled step streams 16 tiles); the prologue is what comes before it,
the epilogue what comes after (the end merge's own short loops included). Also counts the executed instructions
before the first cp.async (``LDGSTS``).

    python benchmarks/diag/ncu_sass_regions.py results/2026-11-30-s6-call1/ncu-cuda_ptx-32768-sass.csv.gz [--loop-factor 8]

Made the session-6 NOTES numbers (prologue 7.5%, epilogue 7.4% of the samples, 382 instructions before the first
cp.async at b1 32K).
"""

import csv
import gzip
import io


def main(path: str, loop_factor: int = 8) -> None:
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    rows = list(csv.reader(io.StringIO(raw.read())))
    hdr, data = rows[1], rows[2:]
    i_samp = hdr.index("Warp Stall Sampling (All Samples)")
    i_exec = hdr.index("Instructions Executed")
    stalls = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    execd = [int(r[i_exec] or 0) for r in data]
    entry = execd[0]
    loop = [j for j, e in enumerate(execd) if e >= loop_factor * entry]
    first, last = loop[0], loop[-1]
    regions = {"prologue": range(0, first), "loop": range(first, last + 1), "epilogue": range(last + 1, len(data))}
    total = sum(int(r[i_samp] or 0) for r in data)
    print(f"{path}: {len(data)} SASS instructions, {total} stall samples, loop = instructions {first}-{last}")
    for name, rng in regions.items():
        agg: dict[str, int] = {}
        for j in rng:
            for i in stalls:
                agg[hdr[i]] = agg.get(hdr[i], 0) + int(data[j][i] or 0)
        n = sum(agg.values())
        top = ", ".join(f"{k[6:]} {v}" for k, v in sorted(agg.items(), key=lambda x: -x[1])[:5])
        print(f"  {name:9s} {n:6d} samples ({n / total:5.1%}): {top}")
    ldgsts = next(j for j, r in enumerate(data) if "LDGSTS" in r[1])
    before = sum(1 for j in range(ldgsts) if execd[j] > 0)
    print(f"  executed instructions before the first LDGSTS (cp.async): {before}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--loop-factor", type=int, default=8)
    a = ap.parse_args()
    main(a.csv, a.loop_factor)
