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

__all__ = ["SplitPlan", "make_plan", "PLAN_VERSION", "cost_model_for"]

PLAN_VERSION = 1


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
        grid: partial-kernel grid ``(num_splits, num_kv_heads, batch)``; one program per
            (split, KV head, sequence), serving the whole GQA group and all ``q_len`` queries.
        merge_grid: merge-kernel grid ``(batch * q_len * num_q_heads,)``; ``(0,)`` if single pass.
        kernel: backend kernel options (``block_n``, ``num_warps``, ``num_stages``, ``threads``).
        workspace_bytes: bytes of the :class:`~attnplan.PartialState` buffer (0 if single pass).
        predicted_us: the cost model's time for a step at the planned lengths, microseconds.
        policy: ``"heuristic"``, ``"forced"`` (config ``split.num_splits``) or ``"no-split"``.
        candidates: ``(splits, chunk_tokens, predicted_us)`` of the split counts scored.
        capacity_mode: sized for the cache capacity (CUDA-graph capture) instead of live lengths.
        merge: ``"separate"`` (a merge kernel) or ``"fused"`` (the last program of each
            (sequence, KV head) to finish, by an atomic completion counter, merges that group's
            rows in fixed split order: one launch fewer, still deterministic; the counter resets
            itself for the next launch or graph replay). ``"none"`` for single pass.
        partition: work partition inside a program (seed 000): ``"split_k"`` (warps take different
            KV positions, states merged through shared memory at the end) or ``"split_v"`` (each warp
            owns a slice of the head_dim columns of V and the output and recomputes the scores:
            redundant QK^T, no cross-warp reduction). Backends declare which they implement.
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
    version: int = PLAN_VERSION

    @property
    def max_tokens(self) -> int:
        """Longest sequence this plan can serve (``num_splits * chunk_size`` tokens)."""
        return self.num_splits * self.chunk_size

    @property
    def num_programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["grid"] = list(self.grid)
        d["merge_grid"] = list(self.merge_grid)
        d["candidates"] = [list(c) for c in self.candidates]
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
        if self.candidates and self.policy == "heuristic":
            best = min(c[2] for c in self.candidates)
            shown = sorted(self.candidates, key=lambda c: c[2])[:5]
            lines.append("cost model (splits: chunk tokens, predicted us): " + ", ".join(
                f"{n}: {c}, {t:.1f}" for n, c, t in sorted(shown)))
            lines.append(f"chose the fewest splits within 2% of the best ({best:.1f} us)")
        lines.append(
            f"=> {self.num_splits} split(s) of {self.chunk_size} tokens; grid {self.grid} = {self.num_programs} programs; "
            + ("single pass (the partial kernel writes the output, no merge)" if self.single_pass
               else (f"merge fused into the last program of each group" if self.merge == "fused"
                     else f"merge kernel grid {self.merge_grid}") + f", workspace {self.workspace_bytes / 2**20:.2f} MiB")
        )
        lines.append(f"inside a program: {self.partition.replace('_', '-')} "
                     + ("(warps take different KV positions; states merged through shared memory)" if self.partition == "split_k"
                        else "(each warp owns head_dim columns and recomputes the scores; no cross-warp reduction)"))
        lines.append(f"kernel options {self.kernel}; predicted {self.predicted_us:.1f} us per step")
        return "\n".join(lines)


def cost_model_for(device: DeviceInfo, config: Config) -> tuple[CostModel, float]:
    """The cost model for ``device`` and its read bandwidth in GB/s.

    The tuned table ``plans/<device>.yaml`` wins over the config's defaults; an explicit
    ``cost_model.mem_bandwidth_gbs`` in either wins over the device's estimate.
    """
    table = device_table(device.slug()).get("cost_model") if device.compute_capability != (0, 0) else None
    cm = CostModel.model_validate({**config.cost_model.model_dump(), **table}) if table else config.cost_model
    return cm, float(cm.mem_bandwidth_gbs or device.mem_bandwidth_gbs)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _cost_us(problem: DecodeProblem, device: DeviceInfo, cm: CostModel, bw_gbs: float,
             splits: int, chunk: int) -> float:
    bw = bw_gbs * 1e3 * cm.bandwidth_fraction  # bytes per microsecond
    hkv, batch = problem.num_kv_heads, problem.batch
    max_len, total = max(problem.max_kv_len, 1), max(problem.total_kv_len, 1)
    # live programs: each sequence's ceil(len / chunk) programs; sum approximated from the total.
    live = hkv * min(batch * splits, max(batch, math.ceil(total / chunk)))
    resident = device.sm_count * cm.programs_per_sm
    waves = math.ceil(hkv * batch * splits / resident)
    kv_bytes = total * hkv * problem.kv_bytes_per_token
    sat = cm.paged_sat_programs_per_sm if problem.paged and cm.paged_sat_programs_per_sm else cm.sat_programs_per_sm
    occupancy = min(1.0, live / (device.sm_count * sat))
    bw_per_program = bw / (device.sm_count * sat)
    chunk_bytes = min(chunk, max_len) * problem.kv_bytes_per_token
    rows = batch * problem.q_len * problem.num_q_heads
    t = cm.launch_us + waves * cm.program_us + max(kv_bytes / (bw * occupancy), chunk_bytes / bw_per_program)
    if splits > 1:
        t += min(_merge_cost_us(problem, cm, bw, bw_per_program, splits).values())
    return t


def _merge_cost_us(problem: DecodeProblem, cm: CostModel, bw: float, bw_per_program: float, splits: int) -> dict:
    """Cost of each merge strategy after the partial kernel, microseconds.

    separate: one more launch, then all rows' states read at full bandwidth.
    fused: no launch; the last program of each (sequence, KV head) reads its group's states alone
    (at one program's bandwidth, and a dependent load per split and pass: ``merge_split_latency_us``),
    while the other groups' last programs do the same in parallel. Measured on the H200 under graph
    replay (benchmarks/results/2026-11-30-merge): the fused merge was 1-8 us slower than a separate
    merge kernel at every point, so with the measured latency the model picks ``separate`` there.
    """
    rows = problem.batch * problem.q_len * problem.num_q_heads
    state_bytes = (problem.head_dim + 1) * 4 * splits
    out_bytes = problem.head_dim * torch_dtype(problem.q_dtype).itemsize
    group_rows = problem.q_len * problem.group_size
    return {"separate": cm.launch_us + rows * (2 * state_bytes + out_bytes) / bw,
            "fused": cm.program_us + 2 * splits * cm.merge_split_latency_us
                     + group_rows * (state_bytes + out_bytes) / bw_per_program}


def make_plan(problem: DecodeProblem, device: DeviceInfo, config: Config, backend: str, kernel: dict,
              *, capacity_mode: bool = False, num_splits: int | None = None,
              merge_strategies: frozenset[str] = frozenset({"separate"}),
              partitions: frozenset[str] = frozenset({"split_k"})) -> SplitPlan:
    """Plan a problem (usually already :meth:`DecodeProblem.bucketed`).

    Args:
        problem: shapes, dtypes and the lengths to plan for (``max_kv_len`` tokens).
        device: the device the kernels run on.
        config: split policy and cost-model constants.
        backend: backend name recorded in the plan.
        kernel: the backend's kernel options; ``kernel["block_n"]`` (tokens) aligns chunks.
        capacity_mode: mark the plan as sized for the cache capacity (CUDA graphs).
        num_splits: overrides ``config.split.num_splits`` (0 = heuristic, 1 = no split, >1 forced).
        merge_strategies: the merge strategies the backend implements (``"separate"``, ``"fused"``);
            ``config.split.merge`` picks one, ``auto`` the cheaper by the cost model.
        partitions: the intra-program partitions the backend implements; ``config.split.partition``
            forces one it has, ``auto`` takes ``split_k`` (the measured default until a tuned table
            says otherwise: ``kernel_options.<backend>.<layout>.partition``).
    Returns:
        the :class:`SplitPlan`. Never empty work for a non-empty sequence: ``num_splits * chunk_size``
        always covers ``problem.max_kv_len``.
    """
    cm, bw = cost_model_for(device, config)
    forced = config.split.num_splits if num_splits is None else num_splits
    align = math.lcm(int(kernel["block_n"]), problem.page_size or 1)
    # with a sliding window the chunks start at the window's first position: plan its span only
    max_len = max(problem.visible_span, 1)
    if problem.window_left >= 0:
        problem = replace(problem, max_kv_len=max_len,
                          total_kv_len=min(problem.total_kv_len, problem.batch * max_len))
    candidates: list[tuple[int, int, float]] = []
    if forced >= 1:
        splits = forced
        chunk = _align_up(max(-(-max_len // splits), 1), align)
        policy = "forced" if forced > 1 else "no-split"
        if forced == 1:
            chunk = _align_up(max_len, align)
        predicted = _cost_us(problem, device, cm, bw, splits, chunk)
    else:
        policy = "heuristic"
        limit = max(1, min(config.split.max_splits, -(-max_len // max(config.split.min_chunk_tokens, align))))
        seen = set()
        for n in range(1, limit + 1):
            chunk = _align_up(-(-max_len // n), align)
            n_eff = -(-max_len // chunk)
            if n_eff in seen:
                continue
            seen.add(n_eff)
            candidates.append((n_eff, chunk, round(_cost_us(problem, device, cm, bw, n_eff, chunk), 3)))
        best = min(c[2] for c in candidates)
        splits, chunk, predicted = min((c for c in candidates if c[2] <= best * 1.02), key=lambda c: c[0])
    single = splits == 1
    rows = problem.batch * problem.q_len * problem.num_q_heads
    ws = 0 if single else rows * splits * (problem.head_dim + 1) * 4
    merge = "none"
    if not single:
        want = config.split.merge
        if want == "auto":
            costs = _merge_cost_us(problem, cm, bw * 1e3 * cm.bandwidth_fraction,
                                   bw * 1e3 * cm.bandwidth_fraction / (device.sm_count * cm.sat_programs_per_sm), splits)
            merge = min((c, m) for m, c in costs.items() if m in merge_strategies)[1]
        else:
            merge = want if want in merge_strategies else "separate"
        if merge == "fused":
            ws += problem.batch * problem.num_kv_heads * 4  # completion counters
    want_p = config.split.partition
    if want_p == "auto":
        want_p = kernel.get("partition", "split_k")
    partition = want_p if want_p in partitions else "split_k"
    bucket = problem.bucket()
    bucket["capacity"] = problem.capacity
    return SplitPlan(
        backend=backend, problem=bucket, device=device.fingerprint(), num_splits=splits, chunk_size=chunk,
        single_pass=single, grid=(splits, problem.num_kv_heads, problem.batch),
        merge_grid=(0,) if single or merge == "fused" else (rows,), kernel=dict(kernel), workspace_bytes=ws,
        predicted_us=float(predicted), policy=policy, candidates=tuple(candidates), capacity_mode=capacity_mode,
        merge=merge, partition=partition,
    )
