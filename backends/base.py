"""The backend interface every attnplan backend implements.

Support is declared as data and refusals come back as reasons (xformers' ``xformers/ops/fmha/common.py`` habit):
``supports(problem)`` returns a list of strings, empty when the backend can serve the problem.

Kernel contract shared by all backends (what "executes the plan as given" means); the schedule's integers are
defined once in :mod:`attnplan.schedule` and every backend computes exactly those:

* **Grid**: ``plan.grid = (plan.schedule.max_units * num_kv_heads,)`` (the launch's KV heads), 1-D. ``partial`` and
  ``merge`` take the plan of one launch (``plan.launches``; a plan of several launches runs through ``run``).
  Program ``p`` serves grid slot ``s = p // num_kv_heads`` for KV head ``h = p % num_kv_heads``: every query head
  of ``h``'s GQA group and all ``q_len`` queries of the sequence of the unit the slot runs. Slot ``s`` runs unit
  ``u = s`` (packed: the slots past the batch's units come last), except where the prologue knows the batch's
  ``U`` units and the grid holds more than ``pack`` slots per unit: there :func:`attnplan.schedule.slot_unit`
  spreads the units over the slots. Unit ``u``'s state goes to workspace slot ``u`` either way.
* **Prologue** (``plan.schedule.max_units_per_seq > 1``): the program reads ``seq_lens`` (all ``batch`` of them,
  from device memory, at every launch) and ``workspace.targets``, and computes the schedule: each sequence's
  granules, the batch's total, the granules per unit, each sequence's units and the slot of its first unit
  ``first[b]`` (:func:`attnplan.schedule.first_slots`: longest units first in a batch of at most 32, else the
  exclusive prefix sum in index order), hence the sequence ``b`` whose slots ``[first[b], first[b] + units[b])``
  hold ``u``, its unit index ``j = u - first[b]`` and token range ``[start, end)``. A program whose slot runs no unit
  (past the batch's ``U`` units, or between spread units) exits at once, writing nothing. Program 0 also writes
  ``workspace.meta`` (``first[b]`` at ``b``, ``units[b]`` at ``batch + b``) when the plan's merge is ``separate``. With
  ``max_units_per_seq == 1`` (single pass) there is no prologue: ``u = b``, ``[start, end) = [base_b, seq_lens[b])``.
* **Lengths**: every length read from ``seq_lens`` (prologue, single pass, a unit's rows) is clamped into ``[0,
  capacity]`` (:attr:`DecodeInputs.capacity`, a kernel argument), so ``L`` below is always the clamped length and a
  length written on the device beyond the cache (after ``plan()``, or at a CUDA-graph replay) gives attention over
  the clamped span, never a read outside the cache; every program of a launch derives the same schedule from it.
* **Rows**: query ``i`` of sequence ``b`` (length ``L``) sees positions ``< L - q_len + i + 1`` (and, with a sliding
  window, ``>= L - q_len + i - window_left``). A row with no visible position in the unit gets the empty state
  ``o = 0, lse = -inf``; a program reads no KV outside ``[start, end)``. Positions a row cannot see never affect it,
  NaN included.
* **Output**: a sequence with ``units[b] == 1`` is written directly: ``out[b, i, hq, :]`` in q's dtype and, if
  requested, ``lse[b, i, hq]`` fp32, the sink applied (:func:`attnplan.state.merge_states`'s sink rule). Otherwise
  the unit writes its normalized fp32 partial state into ``workspace.state`` slot ``u`` (``o[0, i, hq, u, :]``,
  ``lse[0, i, hq, u]``, natural-log LSE, no sink), and the merge combines slots ``[first[b], first[b] +
  units[b])`` of each row in slot order: ``separate``, a merge kernel over all rows that reads ``workspace.meta``
  and skips rows of one-unit sequences; ``fused``, after its state is stored and fenced the program increments
  ``workspace.counters[b * num_kv_heads + h]`` (acquire-release); the one that brings it to ``units[b]`` merges
  the (sequence, KV head)'s rows and resets the counter to 0 (zero at rest: graph replays work). A backend may merge
  a sequence of more than :data:`~attnplan.planner.FUSED_TEAM_UNITS` units in two levels (cuda_ptx): team ``j`` (its
  units ``16 j ..``) counts in ``counters[(batch + first[b] + 16 j) * num_kv_heads + h]``, its last program
  merges the team's states in slot order into a team state written over the team's first slot, then counts the
  team in the (sequence, KV head)'s counter, whose last merges the team states in team order. Either order is fixed
  by the slots alone (deterministic).
* **Query blocks** (``plan.q_block``): when one program cannot hold the GQA group x ``q_len`` rows
  (:meth:`Backend.q_block`), ``run`` launches the kernels once per block of whole queries, each launch the
  problem with that block's ``q_len`` and lengths ``max(0, L - (q_len - i1))`` (``L`` clamped into ``[0,
  capacity]`` first), so its queries see what they see in the whole problem. The kernels never know; each launch reads the KV again (speculative verification with a
  large GQA group, e.g. 8 query heads per KV head x 16 tokens).
* **Head blocks** (``plan.head_block``): when one query's GQA group alone is more rows than a program holds
  (:meth:`Backend.head_block`), ``run`` launches once per query, KV head and block of that KV head's query heads,
  each launch the problem of one KV head and the block's query heads (views of q, the caches, ``out``, ``lse``,
  the sinks and fp8 scales, and the workspace). The kernels never know; each launch reads its KV head again
  (multi-query attention with many heads, e.g. Falcon-7B's 71 query heads on one KV head).
* ``run`` launches on torch's current stream, allocates nothing and never syncs the host.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnplan.planner import SplitPlan
from attnplan.problem import DecodeProblem, kv_capacity

#: the largest int32: the kernels' ``capacity`` argument is at most this (it clamps no int32 length from above)
INT32_MAX = 2**31 - 1
from attnplan.state import PartialState

__all__ = ["Backend", "DecodeInputs", "Workspace", "one_launch"]


def one_launch(plan: SplitPlan) -> None:
    """Raise ``ValueError`` for a plan of several launches (query or head blocks) handed to a backend's ``partial``
    or ``merge``, which launch one plan's grid: such a plan runs through :meth:`Backend.run` (or each of its
    ``plan.launches`` on its slice of the inputs); launched whole, it would leave rows unwritten."""
    if plan.multi_launch:
        raise ValueError(f"a plan of {len(plan.launches)} launches (query or head blocks) runs through Backend.run, "
                         "not partial() / merge(): launch each of plan.launches on its slice of the inputs")


@dataclass(frozen=True)
class Workspace:
    """The device buffers a plan needs, allocated by ``plan()`` and reused by every ``run()``.

    Attributes:
        state: the ragged :class:`~attnplan.PartialState`: ``o [1, q_len, num_q_heads, max_units, head_dim]`` fp32,
            ``lse [1, q_len, num_q_heads, max_units]`` fp32; ``None`` for a single-pass plan.
        meta: int32 ``[2 * batch]``: ``first[b]`` then ``units[b]`` (sequence ``b``'s states in slots ``[first[b],
            first[b] + units[b])``), written by program 0 for the separate merge; ``None`` otherwise.
        counters: int32 ``[SplitPlan.sync_words]``, zero at rest: the fused merge's completion counters (one per
            (sequence, KV head), then the two-level merge's team counters); ``None`` otherwise.
        targets: int32 ``[64]`` (``NUM_TARGETS``): the schedule's targets table on the device, 32 near-uniform
            buckets then 32 long-tailed ones.
        targets_host: the same values on the host (so checking a workspace reads nothing from the device).
        lens: int32 ``[query blocks - 1, batch]``: the lengths of a plan with query blocks (``SplitPlan.q_block``),
            written before each block's first launch but the last block's; ``None`` otherwise. With several launches
            (query or head blocks) ``meta`` and ``counters`` hold one table per launch, one after another.
    """

    state: PartialState | None
    meta: torch.Tensor | None
    counters: torch.Tensor | None
    targets: torch.Tensor
    targets_host: tuple = ()
    lens: torch.Tensor | None = None

    @staticmethod
    @torch.inference_mode(False)
    def allocate(plan: SplitPlan, device: torch.device) -> "Workspace":
        """Buffers for ``plan`` on ``device`` (the state uninitialized: kernels write what they own). On a GPU the
        targets table is copied from pinned host memory without blocking (ordered before later launches on the
        current stream), so allocating never syncs the host. The buffers are ordinary tensors even when made under
        ``torch.inference_mode()``: a workspace is reused by later calls, in any mode, which write some of it with
        torch's in-place ops (an inference tensor refuses those outside inference mode)."""
        p = plan.problem
        state = None if plan.single_pass else PartialState.empty(1, p.q_len, p.num_q_heads, plan.state_slots,
                                                                 p.head_dim, device=device)
        meta = torch.zeros(plan.meta_words, dtype=torch.int32, device=device) if plan.meta_words else None
        counters = torch.zeros(plan.sync_words, dtype=torch.int32, device=device) if plan.sync_words else None
        targets = torch.tensor(plan.schedule.targets, dtype=torch.int32)
        if torch.device(device).type == "cuda":  # from pinned memory without blocking: no host sync
            targets = targets.pin_memory().to(device, non_blocking=True)
        else:
            targets = targets.to(device)
        return Workspace(state, meta, counters, targets, plan.schedule.targets, Workspace.launch_lens(plan, device))

    @staticmethod
    def launch_lens(plan: SplitPlan, device: torch.device) -> torch.Tensor | None:
        """The uninitialized int32 ``[query blocks - 1, batch]`` buffer of a plan with query blocks (:attr:`lens`;
        every run writes it before reading), ``None`` for a plan without."""
        if not plan.lens_words:
            return None
        return torch.empty(len(plan.q_blocks) - 1, plan.problem.batch, dtype=torch.int32, device=device)

    def launch(self, plan: SplitPlan, j: int) -> "Workspace":
        """The buffers launch ``j`` of a plan of several launches (query or head blocks) uses (views, no device
        memory): the state's rows of its queries and query heads, its meta and counters tables. Made once per
        (workspace, plan) and kept (a backend that keys launch constants on the workspace object finds the same one at
        every run)."""
        memo = self.__dict__.get("_launch_memo")
        if memo is None or memo[0] is not plan:
            memo = (plan, tuple(self._launch_buffers(plan, i) for i in range(len(plan.launches))))
            object.__setattr__(self, "_launch_memo", memo)  # a memo, not a field
        return memo[1][j]

    def _launch_buffers(self, plan: SplitPlan, j: int) -> "Workspace":
        i0, i1, h0, h1, _, _, one = plan.launches[j]
        st = self.state
        if st is not None:  # contiguous: whole heads, or one query (SplitPlan.validate)
            st = PartialState(st.o[:, i0:i1, h0:h1], st.lse[:, i0:i1, h0:h1])
        meta, counters = self.meta, self.counters
        if one.meta_words:
            meta = meta[j * one.meta_words:(j + 1) * one.meta_words]
        if one.sync_words:
            counters = counters[j * one.sync_words:(j + 1) * one.sync_words]
        return Workspace(st, meta, counters, self.targets, self.targets_host)

    def serves(self, plan: SplitPlan, device: torch.device) -> bool:
        """Whether these buffers are large enough for ``plan`` on ``device`` (same targets)."""
        p = plan.problem
        if self.targets.device != torch.device(device) or self.targets_host != plan.schedule.targets:
            return False
        if plan.lens_words and (self.lens is None or self.lens.device != torch.device(device)
                                or tuple(self.lens.shape) != (len(plan.q_blocks) - 1, p.batch)):
            return False
        if plan.single_pass:
            return True
        st = self.state
        return (st is not None and tuple(st.lse.shape[1:3]) == (p.q_len, p.num_q_heads)
                and st.o.shape[-1] == p.head_dim and st.num_splits >= plan.state_slots
                and (self.meta is not None and self.meta.numel() >= plan.meta_words or not plan.meta_words)
                and (self.counters is not None and self.counters.numel() >= plan.sync_words or not plan.sync_words))


@dataclass(frozen=True)
class DecodeInputs:
    """The tensors of one decode step (shapes in :mod:`attnplan.problem`).

    Attributes:
        q: ``[batch, q_len, num_q_heads, head_dim]``.
        k_cache, v_cache: contiguous ``[batch, max_kv_len, num_kv_heads, head_dim]`` or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]``; unit stride in head_dim.
        seq_lens: ``[batch]`` int32 on the same device.
        block_table: ``[batch, max_pages_per_seq]`` int32, or ``None`` for a contiguous cache.
        sm_scale: score scale (float).
        window_left: sliding window in tokens (query at position ``p`` sees ``[p - window_left, p]``),
            ``-1`` = none; units then start at ``base = max(0, seq_len - q_len - window_left)``.
        soft_cap: ``cap * tanh(score / cap)`` on the scaled scores, ``0`` = off.
        sinks: ``[num_q_heads]`` fp32 sink logits (joins the softmax denominator at merge /
            single-pass epilogue only; partial states never include it), or ``None``.
        k_scale, v_scale: ``[num_kv_heads]`` fp32 dequantization scales of an fp8 cache, or ``None``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor | None
    sm_scale: float
    window_left: int = -1
    soft_cap: float = 0.0
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def capacity(self) -> int:
        """Tokens a sequence of the cache holds (:func:`attnplan.problem.kv_capacity`; shapes only, no device
        access), at most :data:`INT32_MAX` (the kernels' int32 argument, which then clamps no length from above).
        Every kernel clamps each length it reads from ``seq_lens`` into ``[0, capacity]``."""
        return min(kv_capacity(self.k_cache, self.block_table), INT32_MAX)


class Backend(abc.ABC):
    """Base class. Subclasses set the class attributes (support as data) and implement
    :meth:`available`, :meth:`kernel_config`, :meth:`partial` and (for the separate merge) :meth:`merge`."""

    name: ClassVar[str]
    #: dtypes of q and the KV cache this backend serves
    dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16", "float32"})
    #: head dims served (inclusive bounds) and their required multiple
    min_head_dim: ClassVar[int] = 16
    max_head_dim: ClassVar[int] = 256
    head_dim_multiple: ClassVar[int] = 8
    #: largest GQA group x q_len one program holds (more queries go in several launches: :meth:`q_block`, and a
    #: larger GQA group in blocks of its query heads: :meth:`head_block`)
    max_rows_per_program: ClassVar[int] = 128
    #: whether ``partial`` can run on CUDA graphs' capture stream
    graph_safe: ClassVar[bool] = True
    #: whether the kernels read q, k_cache and v_cache in 16-byte vectors, so that each one's data pointer and every
    #: stride of an axis longer than one must be a multiple of 16 bytes (:meth:`layout_reasons`); False: any
    #: strides with a unit last one
    vector_rows: ClassVar[bool] = False
    #: serves nearly anything, slowly (the float64 reference): dispatch never passes over a kernel backend for it
    fallback: ClassVar[bool] = False
    #: attention variants served (:attr:`attnplan.DecodeProblem.variants`): window, softcap, sinks, fp8_kv
    variants: ClassVar[frozenset[str]] = frozenset()
    #: cross-program merges implemented: ``"separate"`` (:meth:`merge`), ``"fused"`` (inside :meth:`partial`)
    merge_strategies: ClassVar[frozenset[str]] = frozenset({"separate"})
    #: the planner's cost model charges the fused merge's last program one dependent round trip per
    #: split and pass; a backend whose last program reads many splits per round trip divides that
    #: serialized cost by this (1: splits one after another, as triton's)
    fused_merge_parallelism: ClassVar[int] = 1
    #: longest chunk (tokens) for which the planner's ``auto`` considers the fused merge (0: no cap)
    fused_merge_max_chunk: ClassVar[int] = 0
    #: kernel options that name the same thing (e.g. cuda_ptx's ``num_warps`` and ``threads``): where the config
    #: sets one of a group, the tuned table's values for the others are dropped (the config's choice wins)
    option_aliases: ClassVar[tuple[frozenset[str], ...]] = ()
    #: entries a backend's ``_launches`` table (launch constants per plan and workspace) holds before it is cleared;
    #: :meth:`run` raises it on the instance to twice a plan's launches, so a plan of more launches than the table
    #: holds finds its constants again at every run instead of refilling the table
    launch_table_max: int = 64

    @abc.abstractmethod
    def available(self, device: torch.device) -> tuple[bool, str]:
        """Whether the backend can run on tensors on ``device``, with the reason when it cannot."""

    def layout_reasons(self, rows16: tuple[bool, bool, bool]) -> list[str]:
        """Why this backend cannot read inputs of this layout (empty if it can). ``rows16``: for q, k_cache and
        v_cache, whether the data pointer and every stride of an axis longer than one are multiples of 16 bytes
        (:func:`attnplan.problem.rows_16_byte`); dispatch asks at ``plan()``, so a strided view a backend cannot read
        goes to the next backend instead of failing at ``run()``."""
        if not self.vector_rows:
            return []
        return [f"{n}: its data pointer or a stride is not a multiple of 16 bytes (the kernels' 16-byte vector "
                "loads); pass a contiguous tensor" for n, ok in zip(("q", "k_cache", "v_cache"), rows16) if not ok]

    def supports(self, problem: DecodeProblem) -> list[str]:
        """Reasons this backend cannot serve ``problem`` (empty list: it can)."""
        reasons = []
        if problem.q_dtype not in self.dtypes:
            reasons.append(f"q_dtype {problem.q_dtype} not in {sorted(self.dtypes)}")
        if problem.kv_dtype not in self.dtypes and problem.kv_dtype != "float8_e4m3fn":  # fp8: the fp8_kv variant
            reasons.append(f"kv_dtype {problem.kv_dtype} not in {sorted(self.dtypes)}")
        d = problem.head_dim
        if not (self.min_head_dim <= d <= self.max_head_dim) or d % self.head_dim_multiple:
            reasons.append(f"head_dim {d} not in [{self.min_head_dim}, {self.max_head_dim}] "
                           f"as a multiple of {self.head_dim_multiple}")
        missing = problem.variants - self.variants
        if missing:
            reasons.append(f"variants {sorted(missing)} not served (serves {sorted(self.variants) or 'none'})")
        return reasons

    def rows_per_program(self, problem: DecodeProblem) -> int:
        """Most GQA group x q_len rows one program holds for ``problem`` (:attr:`max_rows_per_program`; a backend
        whose limit depends on the dtypes or head_dim overrides this)."""
        return self.max_rows_per_program

    def head_block(self, problem: DecodeProblem) -> int:
        """Query heads of one GQA group one launch serves: 0 when the whole group fits one program
        (:meth:`rows_per_program`), else ``ceil(group / blocks)`` for the fewest blocks that fit, so no block is
        larger than it must be (the last may be smaller: 71 heads over 64 rows go as 36 + 35, 130 as 44 + 44 + 42);
        the plan then launches once per query, KV head and block (:attr:`attnplan.SplitPlan.head_block`)."""
        g, rows = problem.group_size, max(1, self.rows_per_program(problem))
        if g <= rows:
            return 0
        return -(-g // -(-g // rows))

    def q_block(self, problem: DecodeProblem) -> int:
        """Most queries of a sequence one launch serves for ``problem``: ``problem.q_len`` when the GQA group x
        ``q_len`` rows fit one program (:meth:`rows_per_program`), else as many as fit (the plan then launches
        the kernels once per block of queries, :attr:`attnplan.SplitPlan.q_block`); 1 when the GQA group alone
        does not fit (:meth:`head_block`)."""
        rows = max(1, self.rows_per_program(problem))
        return max(1, min(problem.q_len, rows // (self.head_block(problem) or problem.group_size)))

    def kv_passes(self, problem: DecodeProblem) -> int:
        """How many times a step reads each KV head: once per block of queries (:meth:`q_block`) times once per
        block of a GQA group's query heads (:meth:`head_block`); 1 when one launch serves the step."""
        hb = self.head_block(problem)
        return -(-problem.q_len // self.q_block(problem)) * (-(-problem.group_size // hb) if hb else 1)

    def plan_key_extra(self) -> str:
        """What besides the problem, the device and the config changes this backend's kernel options in this process
        (part of the plan-cache key; e.g. Triton's interpreter plans other tiles). Default: ``""``."""
        return ""

    def bind(self, plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs, previous=None):
        """A bound launch of ``plan`` on ``workspace`` for inputs of ``inputs``' signature: a callable
        ``(q, k_cache, v_cache, seq_lens, block_table, out, lse, ptrs=None)`` that launches what :meth:`run` would,
        with the checks that do not involve the outputs done once here (``DecodeWrapper.plan()`` calls this,
        its ``run()`` calls the result; ``previous``: the binding this one replaces, whose prepared state may be
        kept). Default: ``None``, no bound launch (``run()`` goes through :meth:`run`).

        Raises:
            ValueError: the inputs or workspace do not serve the plan (``run()`` then raises the same through
                :meth:`run`).
        """
        return None

    def prepare(self, plan: SplitPlan, device: torch.device) -> None:
        """Compile and load what ``plan`` will launch (called by ``plan()``, outside any capture).
        Default: nothing (kernels compile at their first launch)."""

    def prepare_merge(self, plan: SplitPlan, device: torch.device) -> None:
        """Compile and load only ``plan``'s separate merge (:meth:`merge` alone on a merge-only plan, e.g. context
        parallelism's, whose GQA group x q_len rows need not fit one partial program). Default: nothing."""

    @abc.abstractmethod
    def kernel_config(self, problem: DecodeProblem, options: dict, device: torch.device) -> dict:
        """Kernel options for ``problem``: at least ``block_n`` (tokens per KV tile; the schedule's granule is a
        multiple of it); ``options`` are the config's ``backend_options`` for this backend (``None`` = choose).

        Raises:
            ValueError: an option does not fit this problem's kernel (names the option).
        """

    @abc.abstractmethod
    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The scheduled partial kernel (module docstring): one-unit sequences into ``out`` / ``lse``, the others'
        units into ``workspace.state``; ``workspace.meta`` for the separate merge; the fused merge inside."""

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """The separate merge kernel: rows of sequences with ``units[b] >= 2`` (``workspace.meta``) into ``out``
        ``[B, Q, H, D]`` (q's dtype) and, if given, ``lse [B, Q, H]`` fp32; ``sinks [H]`` fp32 join the denominator.
        Only for plans whose merge is ``separate``."""
        raise NotImplementedError(f"{self.name} has no separate merge")

    def forget(self, plan: SplitPlan, workspace: Workspace) -> None:
        """Drop what this backend keeps for ``(plan, workspace)`` and, with several launches, for each launch's plan and
        workspace view: launch constants that hold the workspace's tensors (a backend's ``_launches`` table keyed by
        ``(id(plan), id(workspace))``). Called when the workspace's owner lets it go."""
        launches = getattr(self, "_launches", None)
        if not isinstance(launches, dict):
            return
        launches.pop((id(plan), id(workspace)), None)
        if plan.multi_launch:
            for j, launch in enumerate(plan.launches):
                launches.pop((id(launch.plan), id(workspace.launch(plan, j))), None)

    def run(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
            lse: torch.Tensor | None = None) -> None:
        """Execute ``plan``: the partial kernel, then the separate merge if the plan has one. Launch-only.

        A plan with several launches (``plan.q_block``, ``plan.head_block``) runs each of ``plan.launches`` in
        order: launch ``(i0, i1, h0, h1, k0, k1)`` on ``q[:, i0:i1, h0:h1]``, ``out`` and ``lse`` likewise, the
        caches' KV heads ``[k0, k1)`` (and their fp8 scales, ``sinks[h0:h1]``), with the lengths ``max(0, L - (q_len
        - i1))`` of the lengths ``L`` clamped into ``[0, capacity]`` as the kernels clamp them (two small torch
        kernels into ``workspace.lens`` per block of queries, the clamp before the subtraction so nothing wraps in
        int32; none for the last block, whose kernels read ``seq_lens`` and clamp it) and ``workspace.launch(plan,
        j)``'s buffers."""
        if not plan.multi_launch:
            self.partial(plan, inputs, workspace, out, lse)
            if plan.merge == "separate":
                self.merge(plan, workspace, out, lse, inputs.sinks)
            return
        if 2 * len(plan.launches) > self.launch_table_max:  # room for this plan's launches and another's
            self.launch_table_max = 2 * len(plan.launches)
        p = plan.problem
        q_len, qb = p.q_len, plan.q_block or p.q_len
        lens, lens_for = inputs.seq_lens, q_len
        for j, (i0, i1, h0, h1, k0, k1, one) in enumerate(plan.launches):
            if i1 != lens_for:  # this block of queries' lengths, written once before its first launch
                lens_for, lens = i1, inputs.seq_lens
                if i1 < q_len:  # max(0, clamp(L, 0, capacity) - d) = clamp(L, d, max(capacity, d)) - d
                    lens = workspace.lens[i0 // qb]
                    d = q_len - i1
                    torch.clamp(inputs.seq_lens, min=d, max=max(inputs.capacity, d), out=lens)
                    lens.sub_(d)
            x = inputs
            if not plan.head_block:
                x = dataclasses.replace(x, q=x.q[:, i0:i1], seq_lens=lens)
                o, lo = out[:, i0:i1], None if lse is None else lse[:, i0:i1]
            else:  # one query block, one KV head, one block of its query heads
                ks, vs = x.k_scale, x.v_scale
                x = DecodeInputs(x.q[:, i0:i1, h0:h1], x.k_cache[:, :, k0:k1], x.v_cache[:, :, k0:k1], lens,
                                 x.block_table, x.sm_scale, x.window_left, x.soft_cap,
                                 None if x.sinks is None else x.sinks[h0:h1], None if ks is None else ks[k0:k1],
                                 None if vs is None else vs[k0:k1])
                o, lo = out[:, i0:i1, h0:h1], None if lse is None else lse[:, i0:i1, h0:h1]
            sinks = x.sinks
            ws = workspace.launch(plan, j)
            self.partial(one, x, ws, o, lo)
            if one.merge == "separate":
                self.merge(one, ws, o, lo, sinks)
