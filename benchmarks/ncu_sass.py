"""Where a kernel's warps spend their stall samples, from Nsight Compute's SASS source page.

Reads the CSV that ``ncu --import <report> --page source --csv --print-source sass`` writes (``ncu_partial.sh``
with ``NCU_SOURCE=<backend>``: ``<report>-sass.csv``) and prints, for one kernel:

- the stall reasons over all samples (each sample is one warp's state at one sampling tick, ``selected`` the
  issuing one, so on a kernel whose warps run in lockstep a reason's share is about its share of the time);
- the executed code as regions: contiguous runs of listing lines with executions or samples, split after calls,
  returns and exits and before a region's first cp.async (``LDGSTS``); each region's share of the samples and its
  two largest reasons, which shows how far into the kernel the KV copies start and what the prologue waits on;
- the instructions holding the most samples, with their reasons: the jump targets of cold code show up here as
  ``no_inst`` (instruction fetch), a load's first use as ``long_sb``, a fence as ``membar``.

    python benchmarks/ncu_sass.py ncu/ncu-cuda_ptx-contiguous-b1-1024-sass.csv --top 15
"""

from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass, field

#: SASS opcodes that end a region (control leaves the straight code) or start the KV stream
_SPLIT = ("CALL", "RET", "EXIT")
_STREAM = "LDGSTS"


@dataclass
class Instruction:
    """One SASS line: its index in the listing, text, executions (warp level) and stall samples by reason."""

    index: int
    text: str
    executed: int
    samples: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.samples.values())

    @property
    def opcode(self) -> str:
        """The opcode without a predicate guard (``@P0``, ``@!UP1``) or modifiers' operands."""
        m = re.match(r"(?:@!?U?P\w+\s+)?(\S+)", self.text)
        return m.group(1) if m else ""


def read_sass_csv(path: str) -> tuple[str, list[Instruction]]:
    """``(kernel name, instructions)`` of the first kernel in an ncu SASS source CSV (lines before its
    ``"Kernel Name"`` line, such as ncu's warnings, are skipped; a second kernel's lines end it). Stall columns are
    the ``stall_*`` columns counting all samples (not the "(Not Issued)" ones), reasons named without ``stall_``.
    ``Instruction.index`` is the line's position among the kernel's SASS lines; a short row (fewer cells than the
    header) is dropped and leaves a gap there.

    Raises:
        ValueError: the file has no kernel line or no ``Source`` / stall columns.
    """
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    first = next((n for n, r in enumerate(rows) if r and r[0] == "Kernel Name"), None)
    if first is None or first + 1 >= len(rows):
        raise ValueError(f"{path}: not an ncu SASS source CSV (no 'Kernel Name' line)")
    rows = rows[first:]
    kernel = rows[0][1] if len(rows[0]) > 1 else ""
    header = rows[1]
    col = {h: i for i, h in enumerate(header)}
    if "Source" not in col:
        raise ValueError(f"{path}: no 'Source' column")
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    if not stalls:
        raise ValueError(f"{path}: no stall sampling columns (profile with source-level sampling)")
    ex_col = col.get("Instructions Executed")
    out = []
    for n, r in enumerate(rows[2:]):
        if r and r[0] == "Kernel Name":
            break  # the next kernel
        if len(r) < len(header):
            continue
        samples = {h[len("stall_"):]: int(r[col[h]] or 0) for h in stalls}
        executed = int(r[ex_col] or 0) if ex_col is not None else 0
        out.append(Instruction(n, r[col["Source"]].strip(), executed, {k: v for k, v in samples.items() if v}))
    return kernel, out


def regions(instrs: list[Instruction]) -> list[tuple[int, int, dict[str, int]]]:
    """``(first index, last index, samples by reason)`` of each region, in listing order: a region is a contiguous
    run of lines with executions or samples (a line with neither, or a dropped row, ends it), also ended after a
    call / return / exit and before its first ``LDGSTS`` (the copies interleaved with their address arithmetic
    after that stay in the region that starts with them)."""
    out: list[tuple[int, int, dict[str, int]]] = []
    cur: dict[str, int] | None = None
    start = last = -1
    has_stream = False
    for ins in instrs:
        if ins.executed <= 0 and ins.total == 0:
            continue
        stream = ins.opcode.startswith(_STREAM)
        if cur is not None and (stream and not has_stream or ins.index != last + 1):
            out.append((start, last, cur))
            cur = None
        if cur is None:
            cur, start, has_stream = {}, ins.index, False
        for k, v in ins.samples.items():
            cur[k] = cur.get(k, 0) + v
        last = ins.index
        has_stream = has_stream or stream
        if ins.opcode.startswith(_SPLIT):
            out.append((start, last, cur))
            cur = None
    if cur is not None:
        out.append((start, last, cur))
    return out


def _top(d: dict[str, int], n: int = 2) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n])


def report(path: str, top: int = 15, min_share: float = 0.01) -> str:
    """The three tables of the module docstring, as text; regions under ``min_share`` of the samples are not
    listed (one line counts them)."""
    kernel, instrs = read_sass_csv(path)
    at = {i.index: i for i in instrs}
    total = sum(i.total for i in instrs)
    if total == 0:
        return f"{kernel}: {len(instrs)} SASS lines, no stall samples"
    reasons: dict[str, int] = {}
    for i in instrs:
        for k, v in i.samples.items():
            reasons[k] = reasons.get(k, 0) + v
    lines = [f"{kernel}: {len(instrs)} SASS lines, {sum(1 for i in instrs if i.executed)} executed, {total} samples",
             "reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in
                                     sorted(reasons.items(), key=lambda kv: -kv[1]))]
    lines.append("regions (listing lines, share of samples, top reasons):")
    small = 0
    for a, b, d in regions(instrs):
        s = sum(d.values())
        if s < min_share * total:
            small += 1
            continue
        lines.append(f"  {a:5d}-{b:<5d} {100 * s / total:5.1f}%  {_top(d)}  [{at[a].opcode} .. {at[b].opcode}]")
    if small:
        lines.append(f"  ({small} regions under {100 * min_share:g}% each not shown)")
    lines.append(f"top {top} instructions:")
    for i in sorted(instrs, key=lambda i: -i.total)[:top]:
        lines.append(f"  {i.index:5d} {100 * i.total / total:5.1f}%  {i.text[:60]:60s} {_top(i.samples)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--min-share", type=float, default=0.01, help="hide regions under this share of the samples")
    args = ap.parse_args()
    print(report(args.csv, args.top, args.min_share))


if __name__ == "__main__":
    main()
