"""The split planner: from a problem, a device and the config to a frozen, cached `SplitPlan`.

Method (DESIGN.md "Planner"; seed 000's decision path; seed 003 §05; FlashAttention's
``num_splits_heuristic``): programs are counted per KV head, ``batch x num_kv_heads x splits``,
because one program serves a whole GQA group (so each KV byte is read once; counting query
heads would under-split GQA, cases.yaml heuristic-counts-q-heads). Each candidate split count is
scored by a small cost model in microseconds and the smallest split count within 2% of the best
is taken (fewer splits = less workspace and merge traffic for the same time):

    T(n) = launch + waves(n) * program_us                         partial kernel fixed costs
         + max(kv_bytes / (BW_eff * min(1, live(n) / (SMs * sat))),  bandwidth-bound time
               chunk_bytes(n) / bw_per_program)                      critical path of one chunk
         + [n > 1] * (launch + merge_bytes(n) / BW_eff)             merge kernel

With a split-V partition whose workers are programs (Triton: ``c`` column programs per split, each
owning ``block_dv`` V / output columns and recomputing QK^T over full K rows), programs are
``batch x num_kv_heads x splits x c`` and K is read ``c`` times: ``kv_bytes`` counts
``(c + 1) / 2`` times the K + V bytes, a program's chunk ``K + V / c``.

Worked example (batch 1, 32/8/128 bf16, 32K tokens, 132 SMs, 4.35 TB/s, default constants):
8 KV heads give 8 programs unsplit, so one program would have to stream 16 MiB alone (~570 us);
at 17 splits the 136 programs cover every SM and the step is bandwidth-bound (~35 us); more
splits buy nothing, so the planner stops near there.

A plan is parametric in the live lengths (vLLM's Triton decode, DESIGN.md): it fixes the chunk
size in tokens and the most splits a sequence may have; a program ``s`` of sequence ``b`` covers
``[s * chunk, min((s + 1) * chunk, seq_lens[b]))`` and writes an empty state when that range is
empty. So one plan serves every step whose lengths fall in its bucket, and CUDA-graph replays.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from .config import Config, CostModel, device_table
from .device import DeviceInfo
from .problem import DecodeProblem, torch_dtype

__all__ = ["SplitPlan", "make_plan", "PLAN_VERSION", "cost_model_for", "split_table_layout", "split_row_heads",
           "entry_options", "table_candidates"]

PLAN_VERSION = 1  # new fields default to the old meaning (column_programs=1: grid axis 0 = splits)


@dataclass(frozen=True)
class SplitPlan:
    """A frozen, serializable split-KV plan.

    Attributes:
        backend: name of the backend the plan is for.
        problem: the bucketed problem fields (:meth:`DecodeProblem.bucket`) plus ``capacity``.
        device: the device fingerprint (:meth:`DeviceInfo.fingerprint`).
        num_splits: most splits per sequence = the split axis of the grid and of the workspace.
        chunk_size: tokens per split; a multiple of the page size and of ``block_n``.
        single_pass: one chunk per sequence, the partial kernel writes the output, no merge.
        grid: the partial kernel's launch grid ``(num_splits * column_programs, num_kv_heads, batch)``;
            one program per (split, column slice, KV head, sequence), serving the whole GQA group and
            all ``q_len`` queries; axis 0 is ``split * column_programs + column``.
        merge_grid: merge-kernel grid ``(batch * q_len * num_q_heads,)``; ``(0,)`` if single pass or
            the merge runs inside the partial kernel (fused, atomic).
        kernel: backend kernel options (``block_n``, ``num_warps``, ``num_stages``, ``threads``;
            Triton's ``block_dv``: V columns per column program, ``None`` under split_k).
        workspace_bytes: bytes of the :class:`~attnplan.PartialState` buffer (:attr:`state_slots`
            slots) plus the in-kernel merge's int32 :attr:`sync_words` (0 if single pass).
        predicted_us: the cost model's time for a step at the planned lengths, microseconds.
        policy: ``"heuristic"`` (cost model), ``"tuned"`` (the device's measured split table, see
            ``table_entry``), ``"forced"`` (config ``split.num_splits``) or ``"no-split"``.
        table_entry: for ``"tuned"``: the table row used, ``(pairs, kv_len, programs_per_sm, ...)``.
        candidates: ``(splits, chunk_tokens, predicted_us)`` of the split counts scored.
        capacity_mode: sized for the cache capacity (CUDA-graph capture) instead of live lengths.
        merge: ``"separate"`` (a merge kernel) or ``"fused"`` (the last program of each
            (sequence, KV head) to finish, by an atomic completion counter, merges that group's
            rows in fixed split order: one launch fewer, still deterministic; the counter resets
            itself for the next launch or graph replay), or ``"atomic"`` (opt-in, config
            ``split.merge: atomic`` with ``deterministic: false``; never chosen by the planner: each
            program merges its state into a per-(sequence, KV head, column slice) fp32 accumulator
            under a spin lock, in completion order, so reruns may differ bitwise within rounding; the
            last program writes the output and resets the counter and lock). ``"none"`` for single pass.
        partition: work partition inside a program (seed 000): ``"split_k"`` (warps take different
            KV positions, states merged through shared memory at the end) or ``"split_v"`` (each warp
            owns a slice of the head_dim columns of V and the output and recomputes the scores:
            redundant QK^T, no cross-warp reduction). Backends declare which they implement. Triton
            cannot address warps: its split-V workers are *column programs* (see ``column_programs``).
        column_programs: programs per split that share its KV chunk, each owning ``kernel["block_dv"]``
            columns of V and of the output (Triton's split-V); 1 otherwise.
        partition_why: where ``partition`` came from (config, kernel option, default, or a fallback).
        version: :data:`PLAN_VERSION`.
    """

    backend: str
    problem: dict
    device: dict
    num_splits: int
    chunk_size: int
    single_pass: bool
    grid: tuple[int, int, int]
    merge_grid: tuple[int]
    kernel: dict
    workspace_bytes: int
    predicted_us: float
    policy: str
    candidates: tuple[tuple[int, int, float], ...] = field(default=())
    capacity_mode: bool = False
    merge: str = "separate"
    partition: str = "split_k"
    column_programs: int = 1
    partition_why: str = ""
    table_entry: tuple = ()
    version: int = PLAN_VERSION

    @property
    def max_tokens(self) -> int:
        """Longest sequence this plan can serve (``num_splits * chunk_size`` tokens)."""
        return self.num_splits * self.chunk_size

    @property
    def num_programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def state_slots(self) -> int:
        """Split slots of the :class:`~attnplan.PartialState` workspace: ``num_splits``, or for the
        atomic merge one accumulator slot per column program (0 for single pass)."""
        return 0 if self.single_pass else self.column_programs if self.merge == "atomic" else self.num_splits

    @property
    def sync_words(self) -> int:
        """int32 words of the in-kernel merge's zeroed sync buffer: fused, one completion counter per
        (sequence, KV head); atomic, a counter then a lock per (sequence, KV head, column program)."""
        groups = self.grid[1] * self.grid[2]
        return {"fused": groups, "atomic": 2 * groups * self.column_programs}.get(self.merge, 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["grid"] = list(self.grid)
        d["merge_grid"] = list(self.merge_grid)
        d["candidates"] = [list(c) for c in self.candidates]
        d["table_entry"] = list(self.table_entry)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "SplitPlan":
        """Rebuild a plan from :meth:`to_dict` output. Raises ``KeyError``/``TypeError`` on bad input."""
        d = dict(d)
        d["grid"] = tuple(d["grid"])
        d["merge_grid"] = tuple(d["merge_grid"])
        d["candidates"] = tuple(tuple(c) for c in d.get("candidates", ()))
        d["table_entry"] = tuple(d.get("table_entry", ()))
        return SplitPlan(**d)

    def explain(self) -> str:
        """Why this split: the shapes, the program count against the SMs, and the scored candidates."""
        p, dev = self.problem, self.device
        group = p["num_q_heads"] // p["num_kv_heads"]
        base = p["batch"] * p["num_kv_heads"]
        lines = [
            f"backend {self.backend} on {dev['name']} ({dev['sm_count']} SMs, cc {dev['cc'][0]}.{dev['cc'][1]})",
            f"problem: batch {p['batch']}, heads {p['num_q_heads']}/{p['num_kv_heads']} (GQA group {group}), "
            f"head_dim {p['head_dim']}, q_len {p['q_len']}, "
            f"{'paged, page ' + str(p['page_size']) if p['page_size'] else 'contiguous'}, q {p['q_dtype']} / kv {p['kv_dtype']}, "
            f"planned for KV length <= {p['max_kv_len']} tokens (mean bucket {p['mean_kv_len']})"
            + (" [capacity plan for CUDA graphs]" if self.capacity_mode else ""),
            f"programs without splitting: batch x kv_heads = {base} (one program per GQA group) vs {dev['sm_count']} SMs",
        ]
        if self.policy == "forced":
            lines.append(f"split count forced by config: {self.num_splits}")
        elif self.policy == "no-split":
            lines.append("splitting disabled by config (split.num_splits = 1)")
        if self.policy == "tuned":
            w, kv, ppsm = self.table_entry[:3]
            lines.append(f"split count from the device's measured split table: nearest entry {w} (sequence, KV head) pairs x "
                         f"KV {kv} tokens, best at {ppsm:g} programs per SM (attnplan tune)")
            actual = self.num_programs / dev["sm_count"]
            if abs(actual - ppsm) > 0.25 * ppsm:
                lines.append(f"  ... runs at {actual:.2f} programs per SM: the table's count was clamped by "
                             "split.max_splits or the length, or rounded by chunk alignment")
            if opts := entry_options(self.table_entry):
                ran = all(self.kernel.get(k) == v for k, v in opts.items())
                lines.append(f"  the entry's kernel options, measured with its split count: {opts} "
                             + ("(applied)" if ran else "(not applied: the config sets the backend's options, the "
                                "plan is not split-K, or they do not fit this problem's kernel)"))
        if self.candidates and self.policy == "heuristic":
            best = min(c[2] for c in self.candidates)
            shown = sorted(self.candidates, key=lambda c: c[2])[:5]
            lines.append("cost model (splits: chunk tokens, predicted us): " + ", ".join(
                f"{n}: {c}, {t:.1f}" for n, c, t in sorted(shown)))
            lines.append(f"chose the fewest splits within 2% of the best ({best:.1f} us)")
        cols = self.column_programs
        merge = {"fused": "merge fused into the last program of each group (fixed split order)",
                 "atomic": "atomic merge: each program merges its state into the accumulator of its (sequence, "
                           "KV head, column program) under a spin lock, in completion order (NOT bitwise reproducible; chosen by config split.merge: atomic "
                           "with deterministic: false); the last program writes the output"}
        lines.append(
            f"=> {self.num_splits} split(s) of {self.chunk_size} tokens; grid {self.grid} = {self.num_programs} programs"
            + (f" ({self.num_splits} splits x {cols} column programs)" if cols > 1 else "") + "; "
            + ("single pass (the partial kernel writes the output, no merge)" if self.single_pass
               else merge.get(self.merge, f"merge kernel grid {self.merge_grid}")
               + f", workspace {self.workspace_bytes / 2**20:.2f} MiB")
        )
        d, why = p["head_dim"], self.partition.replace("_", "-")
        if "block_dv" not in self.kernel:  # a backend whose split-V workers are warps
            why += (" (warps take different KV positions; states merged through shared memory)" if self.partition == "split_k"
                    else " (each warp owns head_dim columns and recomputes the scores; no cross-warp reduction)")
        elif self.partition == "split_k":
            why += " (one program per split covers all head_dim columns; its warps are the compiler's)"
        else:
            why += (f" ({cols} column program(s) per split, each owns {self.kernel['block_dv']} of the {d} V/output "
                    f"columns and recomputes QK^T over full K rows: programs x{cols}, K bytes x{cols} "
                    f"(KV traffic x{(cols + 1) / 2:g} in the cost model); no cross-program reduction, lse written by "
                    "column program 0)")
        lines.append(f"inside a program: {why}" + (f"; chosen by {self.partition_why}" if self.partition_why else ""))
        lines.append(f"kernel options {self.kernel}; predicted {self.predicted_us:.1f} us per step")
        return "\n".join(lines)


def cost_model_for(device: DeviceInfo, config: Config, backend: str | None = None) -> tuple[CostModel, float]:
    """The cost model for ``device`` (and ``backend``) and its read bandwidth in GB/s.

    The tuned table ``plans/<device>.yaml`` wins over the config's defaults: its ``cost_model``,
    then ``cost_model_by_backend.<backend>`` (constants measured for one backend's kernels, e.g. the
    programs per SM its kernel needs to saturate bandwidth). An explicit ``mem_bandwidth_gbs`` in
    either wins over the device's estimate.
    """
    table = device_table(device.slug()) if device.compute_capability != (0, 0) else {}
    over = {**(table.get("cost_model") or {}), **((table.get("cost_model_by_backend") or {}).get(backend) or {})}
    cm = CostModel.model_validate({**config.cost_model.model_dump(), **over}) if over else config.cost_model
    return cm, float(cm.mem_bandwidth_gbs or device.mem_bandwidth_gbs)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _cost_us(problem: DecodeProblem, device: DeviceInfo, cm: CostModel, bw_gbs: float,
             splits: int, chunk: int, cols: int = 1, merges: tuple[str, ...] = ("separate", "fused"),
             fused_parallelism: int = 1, fused_max_chunk: int = 0) -> float:
    """Predicted step time in microseconds (the module docstring's T(n)); ``cols`` column programs per
    split (Triton split-V), the merge term is the cheapest of ``merges``."""
    bw = bw_gbs * 1e3 * cm.bandwidth_fraction  # bytes per microsecond
    hkv, batch = problem.num_kv_heads, problem.batch
    max_len, total = max(problem.max_kv_len, 1), max(problem.total_kv_len, 1)
    # live programs: each sequence's ceil(len / chunk) programs; sum approximated from the total.
    live = hkv * cols * min(batch * splits, max(batch, math.ceil(total / chunk)))
    paged = problem.paged
    per_sm = cm.paged_programs_per_sm if paged and cm.paged_programs_per_sm else cm.programs_per_sm
    resident = device.sm_count * per_sm
    programs = hkv * batch * splits * cols
    waves = math.ceil(programs / resident)
    kv_bytes = total * hkv * problem.kv_bytes_per_token * (cols + 1) / 2  # K read by every column program
    sat = cm.paged_sat_programs_per_sm if paged and cm.paged_sat_programs_per_sm else cm.sat_programs_per_sm
    occupancy = min(1.0, live / (device.sm_count * sat))
    bw_per_program = bw / (device.sm_count * sat)
    chunk_bytes = min(chunk, max_len) * problem.kv_bytes_per_token * (1 + 1 / cols) / 2  # all of K, 1/cols of V
    if 2 * total >= batch * max_len:
        # near-uniform lengths: programs run in waves of `resident`; a wave of n programs streams
        # n chunks at the device's bandwidth, but no program faster than its own rate, so a last
        # wave of a few long programs costs a whole program (wave quantization, NOTES.md change 7)
        def wave(n: int) -> float:
            return max(n * chunk_bytes / bw, chunk_bytes / bw_per_program)

        full, rest = divmod(programs, resident)
        stream = full * wave(resident) + (wave(rest) if rest else 0.0)
    else:  # long-tailed lengths: short sequences' programs finish early and free their slots
        stream = max(kv_bytes / (bw * occupancy), chunk_bytes / bw_per_program)
    t = cm.launch_us + waves * cm.program_us + stream
    if splits > 1:
        costs = _merge_cost_us(problem, cm, bw, bw_per_program, splits, cols, fused_parallelism)
        t += min(costs[m] for m in _merges_for(merges, chunk, fused_max_chunk))
    return t


def _merges_for(merges: tuple[str, ...], chunk: int, fused_max_chunk: int) -> tuple[str, ...]:
    """``merges`` without ``fused`` where the backend caps its chunk (``fused_max_chunk`` tokens, 0 = no cap)."""
    if fused_max_chunk and chunk > fused_max_chunk:
        return tuple(m for m in merges if m != "fused")
    return merges


def _merge_cost_us(problem: DecodeProblem, cm: CostModel, bw: float, bw_per_program: float, splits: int,
                   cols: int = 1, fused_parallelism: int = 1) -> dict:
    """Cost of each merge strategy after the partial kernel, microseconds.

    separate: one more launch, then all rows' states read at full bandwidth.
    fused: no launch; the last program of each (sequence, KV head) reads its group's states alone
    (at one program's bandwidth, and a dependent load per split and pass: ``merge_split_latency_us``),
    while the other groups' last programs do the same in parallel. Measured on the H200 under graph
    replay (benchmarks/results/2026-11-30-merge): the fused merge was 1-8 us slower than a separate
    merge kernel at every point, so with the measured latency the model picks ``separate`` there.
    ``fused_parallelism`` (the backend's :attr:`~attnplan.backends.base.Backend.fused_merge_parallelism`)
    divides that serialized part: a last program whose threads read many splits per round trip.
    atomic (not measured; only costed for its own plans, never chosen): the ``splits`` programs of a
    (sequence, KV head, column program) pass its lock one after another, each with two dependent
    round trips (lock, accumulator load) and a read and write of its group's accumulator columns.
    """
    rows = problem.batch * problem.q_len * problem.num_q_heads
    state_bytes = (problem.head_dim + 1) * 4 * splits
    out_bytes = problem.head_dim * torch_dtype(problem.q_dtype).itemsize
    group_rows = problem.q_len * problem.group_size
    acc_bytes = 2 * (problem.head_dim / cols + 1) * 4  # one program's accumulator columns, read and written
    return {"separate": cm.launch_us + rows * (2 * state_bytes + out_bytes) / bw,
            "fused": cm.program_us + (2 * splits * cm.merge_split_latency_us
                                      + group_rows * (state_bytes + out_bytes) / bw_per_program) / fused_parallelism,
            "atomic": splits * (2 * cm.merge_split_latency_us + group_rows * acc_bytes / bw_per_program)
                      + group_rows * out_bytes / cols / bw_per_program}


#: a split-table entry serves problems within this factor of its work and length (log-space box)
TABLE_REACH = 4.0


def split_table_layout(layout: str, kv_itemsize: int) -> str:
    """The key of a split table's rows: ``layout`` (``"contiguous"`` or ``"paged"``), with ``"_fp8"``
    for a 1-byte KV cache (``kv_itemsize`` in bytes), as ``attnplan tune`` writes and the planner reads."""
    return layout + ("_fp8" if kv_itemsize == 1 else "")


def split_row_heads(row) -> tuple[int | None, int]:
    """``(group, head_dim)`` a split-table row was measured with: its fifth and sixth fields, or
    ``(None, 128)`` for a row written before rows carried them (any group, head_dim 128)."""
    return (row[4], row[5]) if len(row) >= 6 else (None, 128)


def entry_options(entry) -> dict:
    """The kernel options a split-table row (``SplitPlan.table_entry``) carries: its optional seventh field, a
    mapping such as ``{"num_warps": 8, "num_stages": 2}`` written by ``attnplan tune --row-options``; ``{}`` for a
    row without one (or with anything else there).

    The row's split count was measured with those options, so :func:`attnplan.api.plan_problem` runs them with
    it: only for a split-K plan that row makes (policy ``"tuned"``, the same row again once the options are
    applied), and not when the config sets the backend's options or the options do not fit the problem's kernel
    (``ValueError`` from the backend's ``kernel_config``). Why per row: in results/2026-11-30-s9-call1, cuda_ptx
    with 8 KV warps per program beat the table's 4 warps, each at its best split count, by 3-11% at 16-64
    (sequence, KV head) pairs and 1K-16K tokens, while single passes that fill the SMs keep 4 warps, 3 programs
    resident per SM (benchmarks/NOTES.md, session 9, change 25).
    """
    return dict(entry[6]) if len(entry) >= 7 and isinstance(entry[6], dict) else {}


def _table_entry(problem: DecodeProblem, device: DeviceInfo, backend: str, cols: int) -> tuple | None:
    """The nearest entry of the device's measured split table for ``problem`` (the first of
    :func:`table_candidates`), or ``None`` (cost model)."""
    near = table_candidates(problem, device, backend, cols)
    return near[0][1] if near else None


def table_candidates(problem: DecodeProblem, device: DeviceInfo, backend: str, cols: int) -> list[tuple[float, tuple]]:
    """The entries of the device's measured split table that may serve ``problem``, nearest first, as
    ``(distance, row)``: ``distance`` is dimensionless (a sum of absolute natural-log ratios, below), ``row`` the
    table row as a tuple; equal distances keep table order. Empty where the table does not apply. ``cols``: column
    programs per split (1 for split-K). A missing table or section gives an empty list, not an error.

    ``plans/<device>.yaml`` key ``split_table.<backend>.<layout>``: rows ``[pairs, kv_len,
    programs_per_sm, us, group, head_dim, options]`` written by ``attnplan tune`` (``pairs`` = batch x KV heads;
    the best split count of an exhaustive search, as programs per SM; ``group`` = the GQA group size and
    ``head_dim`` of the heads it was measured with; rows without them count as head_dim 128, any group;
    ``options``, optional: the kernel options that split count was measured with, :func:`entry_options`);
    a 1-byte (fp8) cache reads ``<layout>_fp8`` (``attnplan tune --kv-dtype float8_e4m3fn``) and has no
    table without it. Used for the table's own conditions only: split-K (one column program),
    near-uniform lengths (the mean at least half the maximum on the bucketed problem the planner sees,
    i.e. a live mean above about a quarter of the maximum), rows of the problem's head_dim (rows measured
    at head_dim <= 128 serve every head_dim <= 128), and an entry within :data:`TABLE_REACH` of the
    problem in both pairs and length. The nearest wins: log distance in pairs plus log distance in
    length plus half the log distance of the group sizes (so at the same point a row of the problem's
    own group wins, and one grid step away a row of another group may), ties going to a tagged row of
    the problem's own head_dim. The group term exists because the best split depends on the group's
    work per token too: in results/2026-11-30-s5-call4, 32/32/128 and 16/8/256 planned from other heads'
    rows or the cost model missed the best by 5-25%.
    """
    itemsize = torch_dtype(problem.kv_dtype).itemsize
    if device.compute_capability == (0, 0) or cols != 1 \
            or itemsize not in (1, 2) or problem.total_kv_len * 2 < problem.batch * problem.max_kv_len:
        return []
    layout = split_table_layout("paged" if problem.paged else "contiguous", itemsize)
    rows = ((device_table(device.slug()).get("split_table") or {}).get(backend) or {}).get(layout) or []
    work, kv = problem.batch * problem.num_kv_heads, max(problem.max_kv_len, 1)
    near = []
    for row in rows:
        group, head_dim = split_row_heads(row)
        if not (head_dim == problem.head_dim or (head_dim <= 128 and problem.head_dim <= 128)):
            continue
        dw, dk = abs(math.log(row[0] / work)), abs(math.log(row[1] / kv))
        dg = abs(math.log(group / problem.group_size)) if group else 0.0
        # equal distances: a tagged row of the problem's own head_dim before an untagged or other one
        d = dw + dk + 0.5 * dg + (0.0 if group and head_dim == problem.head_dim else 1e-3)
        if max(dw, dk) <= math.log(TABLE_REACH):
            near.append((d, tuple(row)))
    near.sort(key=lambda t: t[0])  # stable: of equal distances the first row in the table wins
    return near


def make_plan(problem: DecodeProblem, device: DeviceInfo, config: Config, backend: str, kernel: dict,
              *, capacity_mode: bool = False, num_splits: int | None = None,
              merge_strategies: frozenset[str] = frozenset({"separate"}),
              partitions: frozenset[str] = frozenset({"split_k"}), fused_merge_parallelism: int = 1,
              fused_merge_max_chunk: int = 0) -> SplitPlan:
    """Plan a problem (usually already :meth:`DecodeProblem.bucketed`).

    Args:
        problem: shapes, dtypes and the lengths to plan for (``max_kv_len`` tokens).
        device: the device the kernels run on.
        config: split policy and cost-model constants.
        backend: backend name recorded in the plan.
        kernel: the backend's kernel options; ``kernel["block_n"]`` (tokens) aligns chunks.
        capacity_mode: mark the plan as sized for the cache capacity (CUDA graphs).
        num_splits: overrides ``config.split.num_splits`` (0 = heuristic, 1 = no split, >1 forced).
        merge_strategies: the merge strategies the backend implements (``"separate"``, ``"fused"``,
            ``"atomic"``); ``config.split.merge`` picks one (a strategy the backend lacks falls back to
            ``separate``), ``auto`` the cheaper of separate / fused by the cost model (never atomic).
        partitions: the intra-program partitions the backend implements; ``config.split.partition``
            forces one it has, ``auto`` takes ``kernel["partition"]`` or else ``split_k`` (the measured
            default until a tuned table says otherwise: ``kernel_options.<backend>.<layout>.partition``).
            A backend whose split-V workers are programs gives ``kernel["block_dv"]`` (V columns per
            column program): under ``split_v`` the plan gets ``ceil(head_dim / block_dv)`` column
            programs per split, under ``split_k`` one and ``block_dv = None``.
        fused_merge_parallelism: the backend's
            :attr:`~attnplan.backends.base.Backend.fused_merge_parallelism` (divides the fused merge's
            serialized cost in the cost model; 1 = splits read one after another).
        fused_merge_max_chunk: the backend's :attr:`~attnplan.backends.base.Backend.fused_merge_max_chunk`:
            longest chunk (tokens) for which ``auto`` and the split search consider ``fused`` (0 = no cap).
    Returns:
        the :class:`SplitPlan`. Never empty work for a non-empty sequence: ``num_splits * chunk_size``
        always covers ``problem.max_kv_len``.
    """
    cm, bw = cost_model_for(device, config, backend)
    want_p = config.split.partition
    why_p = "config split.partition"
    if want_p == "auto":
        want_p, why_p = kernel.get("partition", "split_k"), ("kernel option partition" if "partition" in kernel
                                                             else "default (split.partition: auto)")
    partition = want_p if want_p in partitions else "split_k"
    if partition != want_p:
        why_p = f"the fallback ({why_p} asks for {want_p}, which {backend} does not implement)"
    kernel, cols = dict(kernel), 1
    if "block_dv" in kernel:  # split-V workers are programs: column programs per split
        if partition == "split_v":
            cols = -(-problem.head_dim // int(kernel["block_dv"]))
        else:
            kernel["block_dv"] = None
    merges = ("atomic",) if config.split.merge == "atomic" and "atomic" in merge_strategies else ("separate", "fused")
    forced = config.split.num_splits if num_splits is None else num_splits
    align = math.lcm(int(kernel["block_n"]), problem.page_size or 1)
    # with a sliding window the chunks start at the window's first position: plan its span only
    max_len = max(problem.visible_span, 1)
    if problem.window_left >= 0:
        problem = replace(problem, max_kv_len=max_len,
                          total_kv_len=min(problem.total_kv_len, problem.batch * max_len))
    candidates: list[tuple[int, int, float]] = []
    # most splits the planner itself makes: chunks of at least min_chunk_tokens (aligned), max_splits
    limit = max(1, min(config.split.max_splits, max_len // _align_up(config.split.min_chunk_tokens, align)))
    if forced >= 1:
        splits = forced
        chunk = _align_up(max(-(-max_len // splits), 1), align)
        policy = "forced" if forced > 1 else "no-split"
        if forced == 1:
            chunk = _align_up(max_len, align)
        predicted = _cost_us(problem, device, cm, bw, splits, chunk, cols, merges, fused_merge_parallelism,
                             fused_merge_max_chunk)
    elif (entry := _table_entry(problem, device, backend, cols)) is not None:
        policy = "tuned"
        work = problem.batch * problem.num_kv_heads
        want = min(limit, max(1, round(entry[2] * device.sm_count / work)))
        chunk = _align_up(-(-max_len // want), align)
        splits = -(-max_len // chunk)
        predicted = _cost_us(problem, device, cm, bw, splits, chunk, cols, merges, fused_merge_parallelism,
                             fused_merge_max_chunk)
    else:
        policy = "heuristic"
        seen = set()
        for n in range(1, limit + 1):
            chunk = _align_up(-(-max_len // n), align)
            n_eff = -(-max_len // chunk)
            if n_eff in seen:
                continue
            seen.add(n_eff)
            candidates.append((n_eff, chunk, round(_cost_us(problem, device, cm, bw, n_eff, chunk, cols, merges,
                                                            fused_merge_parallelism, fused_merge_max_chunk), 3)))
        best = min(c[2] for c in candidates)
        splits, chunk, predicted = min((c for c in candidates if c[2] <= best * 1.02), key=lambda c: c[0])
    single = splits == 1
    rows = problem.batch * problem.q_len * problem.num_q_heads
    merge = "none"
    if not single:
        want = config.split.merge
        if want == "auto":
            costs = _merge_cost_us(problem, cm, bw * 1e3 * cm.bandwidth_fraction,
                                   bw * 1e3 * cm.bandwidth_fraction / (device.sm_count * cm.sat_programs_per_sm), splits,
                                   fused_parallelism=fused_merge_parallelism)
            allowed = _merges_for(("separate", "fused"), chunk, fused_merge_max_chunk)
            merge = min((c, m) for m, c in costs.items() if m in merge_strategies and m in allowed)[1]
        else:
            merge = want if want in merge_strategies else "separate"
    bucket = problem.bucket()
    bucket["capacity"] = problem.capacity
    plan = SplitPlan(
        backend=backend, problem=bucket, device=device.fingerprint(), num_splits=splits, chunk_size=chunk,
        single_pass=single, grid=(splits * cols, problem.num_kv_heads, problem.batch),
        merge_grid=(0,) if single or merge in ("fused", "atomic") else (rows,), kernel=kernel, workspace_bytes=0,
        predicted_us=float(predicted), policy=policy, candidates=tuple(candidates), capacity_mode=capacity_mode,
        merge=merge, partition=partition, column_programs=cols, partition_why=why_p,
        table_entry=tuple(entry) if policy == "tuned" else (),
    )
    # the PartialState workspace (or the atomic merge's accumulator) plus the in-kernel merge's sync words
    return replace(plan, workspace_bytes=rows * plan.state_slots * (problem.head_dim + 1) * 4 + plan.sync_words * 4)
