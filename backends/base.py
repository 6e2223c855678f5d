"""The backend interface every attnplan backend implements (DESIGN.md "Backends").

Support is declared as data and refusals come back as reasons (xformers' habit, STYLE.md):
``supports(problem)`` returns a list of strings, empty when the backend can serve the problem.

Kernel contract shared by all backends (what "executes the plan as given" means):

* Grid ``plan.grid = (num_splits * plan.column_programs, num_kv_heads, batch)``; program
  ``(s * column_programs + c, h, b)`` serves every query head of KV head ``h``'s GQA group and all
  ``q_len`` queries of sequence ``b`` (``column_programs`` is 1 except for Triton's split-V, whose
  column program ``c`` owns V / output columns ``[c * block_dv, (c + 1) * block_dv)``).
* Its chunk is ``[s * plan.chunk_size, min((s + 1) * plan.chunk_size, seq_lens[b]))``, read from
  ``seq_lens`` in device memory at run time, except that the last split (``s == num_splits - 1``)
  runs on to ``seq_lens[b]``: a sequence that outgrew the plan's bucket is still computed exactly
  (only more slowly), never truncated. Query ``i`` additionally sees only positions
  ``< seq_lens[b] - q_len + i + 1``.
* Rows with no visible position in the chunk write ``o = 0, lse = -inf`` (the empty state) and
  read no KV; programs whose chunk starts past the sequence read nothing at all.
* Multi-split plans write :class:`~attnplan.PartialState` (fp32 ``o`` normalized, natural-log
  ``lse``) at split index ``s``; the merge applies :func:`attnplan.state.merge_states`'s contract.
  Single-pass plans (``plan.single_pass``) write ``out`` (q's dtype) and ``lse`` directly.
* ``run`` launches on torch's current stream, allocates nothing and never syncs the host.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnplan.planner import SplitPlan
from attnplan.problem import DecodeProblem
from attnplan.state import PartialState

__all__ = ["Backend", "DecodeInputs"]


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
            ``-1`` = none. Split ``s`` then covers ``[base + s * chunk, ...)`` with
            ``base = max(0, seq_len - q_len - window_left)``: no chunk lies before the window.
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


class Backend(abc.ABC):
    """Base class. Subclasses set the class attributes (support as data) and implement
    :meth:`available`, :meth:`kernel_config`, :meth:`partial`, :meth:`merge` and
    :meth:`single_pass`."""

    name: ClassVar[str]
    #: dtypes of q and the KV cache this backend serves
    dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16", "float32"})
    #: head dims served (inclusive bounds) and their required multiple
    min_head_dim: ClassVar[int] = 16
    max_head_dim: ClassVar[int] = 256
    head_dim_multiple: ClassVar[int] = 8
    #: largest GQA group x q_len one program holds
    max_rows_per_program: ClassVar[int] = 128
    #: whether ``partial`` can run on CUDA graphs' capture stream
    graph_safe: ClassVar[bool] = True
    #: attention variants served (:attr:`attnplan.DecodeProblem.variants`): window, softcap, sinks, fp8_kv
    variants: ClassVar[frozenset[str]] = frozenset()
    #: cross-program merge strategies implemented (``"separate"``; ``"fused"`` and ``"atomic"`` need
    #: :meth:`partial_fused_merge`)
    merge_strategies: ClassVar[frozenset[str]] = frozenset({"separate"})
    #: the planner's cost model charges the fused merge's last program one dependent round trip per
    #: split and pass; a backend whose last program reads many splits per round trip divides that
    #: serialized cost by this (1: splits one after another, as triton's)
    fused_merge_parallelism: ClassVar[int] = 1
    #: longest chunk (tokens) for which the planner's ``auto`` considers the fused merge (0: no cap)
    fused_merge_max_chunk: ClassVar[int] = 0
    #: intra-program work partitions implemented (:attr:`attnplan.SplitPlan.partition`)
    partitions: ClassVar[frozenset[str]] = frozenset({"split_k"})
    #: kernel options that name the same thing (e.g. cuda_ptx's ``num_warps`` and ``threads``): where the config
    #: sets one of a group, the tuned table's values for the others are dropped (the config's choice wins)
    option_aliases: ClassVar[tuple[frozenset[str], ...]] = ()

    @abc.abstractmethod
    def available(self, device: torch.device) -> tuple[bool, str]:
        """Whether the backend can run on tensors on ``device``, with the reason when it cannot."""

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
        rows = problem.group_size * problem.q_len
        if rows > self.max_rows_per_program:
            reasons.append(f"GQA group x q_len = {rows} rows exceeds {self.max_rows_per_program} per program")
        return reasons

    def prepare(self, plan: SplitPlan, device: torch.device) -> None:
        """Compile and load what ``plan`` will launch (called by ``plan()``, outside any capture).
        Default: nothing (kernels compile at their first launch)."""

    @abc.abstractmethod
    def kernel_config(self, problem: DecodeProblem, options: dict, device: torch.device) -> dict:
        """Kernel options for ``problem``: at least ``block_n`` (tokens, chunks align to it);
        ``options`` are the config's ``backend_options`` for this backend (``None`` = choose)."""

    @abc.abstractmethod
    def partial(self, plan: SplitPlan, inputs: DecodeInputs, state: PartialState) -> None:
        """Write every split's partial state into ``state`` (``o [B, Q, H, S, D]``, ``lse [B, Q, H, S]``, fp32)."""

    @abc.abstractmethod
    def merge(self, plan: SplitPlan, state: PartialState, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """Merge ``state``'s first ``plan.num_splits`` splits into ``out [B, Q, H, D]`` (q's dtype)
        and, if given, ``lse [B, Q, H]`` fp32; ``sinks [H]`` fp32 join the denominator (see
        :func:`attnplan.state.merge_states`)."""

    @abc.abstractmethod
    def single_pass(self, plan: SplitPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """One chunk per sequence: write ``out`` and ``lse`` directly, no workspace, no merge."""

    def partial_fused_merge(self, plan: SplitPlan, inputs: DecodeInputs, state: PartialState, out: torch.Tensor,
                            lse: torch.Tensor | None, counters: torch.Tensor) -> None:
        """Partial states plus the merge inside the same launch (``plan.merge`` ``"fused"`` or ``"atomic"``).

        fused: every program writes its split's state into ``state``; the last program of each
        (sequence, KV head) group, by an atomic completion counter, merges the group in split order.
        atomic (non-deterministic): ``state`` holds ``plan.state_slots`` accumulator slots (one per
        column program); each program merges its own state into its slot under a spin lock, in
        completion order; the last one writes ``out`` / ``lse``. ``counters``: at least
        ``plan.sync_words`` int32, zero before the launch and left zero after (graph replays).
        Only for backends whose :attr:`merge_strategies` include the plan's strategy.
        """
        raise NotImplementedError(f"{self.name} has no fused merge")

    def run(self, plan: SplitPlan, inputs: DecodeInputs, workspace: PartialState | None,
            out: torch.Tensor, lse: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> None:
        """Execute ``plan``: single pass, or partial into ``workspace`` then merge. Launch-only."""
        if plan.single_pass:
            self.single_pass(plan, inputs, out, lse)
        elif plan.merge in ("fused", "atomic"):
            self.partial_fused_merge(plan, inputs, workspace, out, lse, counters)
        else:
            self.partial(plan, inputs, workspace)
            if inputs.sinks is None:
                self.merge(plan, workspace, out, lse)
            else:
                self.merge(plan, workspace, out, lse, inputs.sinks)
