"""Public API: dispatch, :func:`decode` (one call) and :class:`DecodeWrapper` (plan once, run many).

``plan()`` does all host work (validation, which reads ``seq_lens``/``block_table`` unless the caller
gives ``seq_lens_host``, backend choice, planning through the plan cache, workspace allocation,
binding the launches); ``run()`` checks shapes, dtypes and devices against the plan and launches,
with no allocation and no host sync, so it can be captured in a CUDA graph (FlashInfer's plan/run
split).

Host cost: a repeated ``plan()`` with host lengths is O(1) Python on a plan-cache hit (the static checks
are memoized on the inputs' signature, the backend choice per problem bucket and device, the workspace
and the bound launches are reused; the previous call's backend and cache key serve while its inputs
repeat, and a backend's ``prepare`` runs once per plan and device) and synchronizes nothing; ``run()``
reads each argument's shape, strides, dtype, device and data pointer once, compares them with the planned
values (any difference takes the full checks, which raise their own errors) and launches through the
backend's bound launch (:meth:`Backend.bind <attnplan.backends.base.Backend.bind>` where the
backend has one); :func:`decode` keeps its wrappers per context and input signature, so a repeated call
is one signature, a plan-cache hit and a run.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from .backends import Backend, DecodeInputs, Workspace, check_backend_name, get_backend
from .cache import PlanCache, check_plan
from .config import Config, device_table, load_config
from .device import DeviceInfo, device_info
from .planner import DeviceKey, SplitPlan, check_num_splits, entry_options, launch_problem_of, make_plan
from .state import PartialState
from .problem import (DecodeProblem, as_host_lengths, check_addressable, check_no_grad, check_not_lazy, check_sm_scale,
                      check_strided, check_variant_tensors, default_sm_scale, explain_lengths, has_internal_overlap,
                      host_lengths, OverlapError, is_contiguous_layout, len_bucket, mean_bucket, overlap_error,
                      rows_16_byte, same_signature, signature_change, torch_dtype, validate_inputs, validate_outputs,
                      validate_values)

__all__ = ["decode", "DecodeWrapper", "select_backend", "NoBackendError", "PlanNotReadyError", "Context",
           "default_context", "plan_problem", "DECODE_WRAPPERS"]


class NoBackendError(RuntimeError):
    """No configured backend is available and supports the problem; the message lists each reason."""


class PlanNotReadyError(RuntimeError):
    """``run()`` was called without a plan (for CUDA graphs: call ``plan()`` before capture)."""


#: most wrappers :func:`decode` keeps per context (each holds its workspace), least recently used dropped first
DECODE_WRAPPERS = 16


@dataclass
class Context:
    """A configuration with its plan cache. :func:`default_context` serves calls that pass no config.

    Besides the plan cache it memoizes what a plan-cache hit must not recompute: the backend chosen per (problem
    bucket, capacity, device, forced backend, graph mode), the device facts per device, and the
    :class:`DecodeWrapper` s :func:`decode` reuses (at most :data:`DECODE_WRAPPERS`, keyed by the inputs'
    signature and the forced backend; :meth:`release_wrappers` drops them and their workspaces).
    """

    config: Config
    cache: PlanCache

    def __post_init__(self) -> None:
        self._fp: dict[str, str] = {}
        self._selected: dict[tuple, tuple] = {}
        self._devices: dict[torch.device, tuple] = {}
        # hash of (signature, backend) -> (that key, wrapper); insertion order = least recently given back first
        self._wrappers: dict[int, tuple[tuple, DecodeWrapper]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def from_config(config: Config) -> "Context":
        """A context of ``config`` with the plan cache its ``plan_cache`` section describes (folder, disk on or off,
        memory entries).

        Raises:
            ConfigError: the cache folder (``plan_cache.dir``, else ``$ATTNPLAN_CACHE_DIR``) starts with a ``~user``
                that cannot be expanded.
        """
        pc = config.plan_cache
        return Context(config, PlanCache(pc.dir, disk=pc.enabled and pc.disk, memory_entries=pc.memory_entries))

    def release_wrappers(self) -> None:
        """Forget the wrappers :func:`decode` keeps (their workspaces are freed with them)."""
        with self._lock:
            self._wrappers.clear()

    def _take_wrapper(self, h: int, key: tuple) -> "DecodeWrapper | None":
        """The kept wrapper for ``key`` (``h``: its hash), removed from the pool while a call uses it (so two threads
        never share one), or ``None``. The pool is keyed by the hash, computed once per call (hashing a signature
        costs about as much as comparing one); an entry of another key with the same hash is dropped."""
        with self._lock:
            e = self._wrappers.pop(h, None)
        if e is not None and e[0] == key:
            return e[1]
        return None

    def _give_wrapper(self, h: int, key: tuple, w: "DecodeWrapper") -> None:
        with self._lock:
            self._wrappers[h] = (key, w)
            while len(self._wrappers) > DECODE_WRAPPERS:
                del self._wrappers[next(iter(self._wrappers))]

    def device_facts(self, device: torch.device) -> tuple[DeviceInfo, str, str]:
        """``(DeviceInfo, its plan-cache key part, its device table's text)`` for ``device``, computed once per
        device and generation of the device tables (:func:`reload_device_tables`; a CUDA device without an index is
        resolved to the current device each time)."""
        facts = self._devices.get(device)
        if facts is None or facts[3] != _TABLES[0]:
            dev_info = device_info(device)
            facts = (dev_info, _device_key(dev_info),
                     _table_text(dev_info.slug()) if dev_info.compute_capability != (0, 0) else "", _TABLES[0])
            if torch.device(device).type != "cuda" or torch.device(device).index is not None:
                self._devices[device] = facts
        return facts[:3]

    def select(self, bucket_key: tuple, capacity: int, device: torch.device, backend: str | None, graph: bool,
               problem, rows16: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Backend, list, str]:
        """:func:`select_backend` memoized per (problem bucket, capacity, device, forced backend, graph mode, inputs'
        layout ``rows16``): a backend's reasons depend only on the problem's bucketed fields, the layout, its
        availability on the device (and on the process's ``TRITON_INTERPRET`` / ``NUMBA_ENABLE_CUDASIM``, read at a
        context's first selection for that key). ``problem``: a callable returning the :class:`DecodeProblem` (made
        only on a miss).

        Returns ``(backend, skipped, the backend's plan_key_extra())``; raises what :func:`select_backend` raises
        (nothing is memoized then)."""
        key = (bucket_key, capacity, device, backend, graph, rows16)
        hit = self._selected.get(key)
        if hit is None:
            be, skipped = select_backend(problem(), device, self.config, backend, graph, rows16)
            hit = (be, skipped, be.plan_key_extra())
            if len(self._selected) >= 4096:
                self._selected.clear()
            self._selected[key] = hit
        return hit[0], list(hit[1]), hit[2]

    def planning_fingerprint(self, backend: str) -> str:
        """The config's planning inputs for ``backend`` (part of the plan-cache key), computed once. The keys that
        are accepted with no effect (``deterministic``, ``split.partition``) are left out, so setting them does not
        plan again."""
        fp = self._fp.get(backend)
        if fp is None:
            c = self.config
            fp = self._fp[backend] = json.dumps([c.split.model_dump(exclude={"partition"}), c.cost_model.model_dump(),
                                                 c.options(backend).model_dump()], sort_keys=True)
        return fp


_DEFAULT: Context | None = None
_DEFAULT_LOCK = threading.Lock()


def default_context() -> Context:
    """The process-wide context built from ``plans/default.yaml`` and ``$ATTNPLAN_CONFIG`` (and the cache directory,
    ``$ATTNPLAN_CACHE_DIR``) as they are at the first call, made once: threads calling it at once get the same
    context, and later changes of the variables do not affect it (pass a config or a :class:`Context` instead).

    Raises:
        ConfigError: ``$ATTNPLAN_CONFIG`` names a file that does not load (nothing is kept: the next call tries
            again).
    """
    global _DEFAULT
    ctx = _DEFAULT
    if ctx is None:
        with _DEFAULT_LOCK:
            ctx = _DEFAULT
            if ctx is None:
                ctx = _DEFAULT = Context.from_config(load_config())
    return ctx


def _context(config: Config | Context | str | os.PathLike | None) -> Context:
    """The context of a ``config`` argument. Raises ``TypeError`` naming it for anything else, and
    :class:`~attnplan.config.ConfigError` for a file that does not load."""
    if config is None:
        return default_context()
    if isinstance(config, Context):
        return config
    if isinstance(config, Config):
        return Context.from_config(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be an attnplan Config, a Context, a path to a YAML file or None (the default "
                        f"context), got {type(config).__name__}")
    return Context.from_config(load_config(config))


def dispatch_order(config: Config, fp8_kv: bool, arch: str | None = None) -> list[str]:
    """The backends to try, in order: ``config.backends``, with first, in their lists' order, for a 1-byte (fp8) KV
    cache the backends of ``config.backends_fp8_kv``, then on a GPU of architecture ``arch`` (``"sm_90"``; ``None``
    off a GPU) those of ``config.backends_by_arch[arch]``. Only backends in ``config.backends`` are ever used: a
    user's ``backends: [triton, reference]`` keeps fp8 caches and sm_90 GPUs off cuda_ptx even though the defaults
    name it first there.

    Raises:
        TypeError: ``arch`` is neither a str nor None.
    """
    if arch is not None and not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'sm_90' or None, got {type(arch).__name__}")
    order = list(config.backends)
    by_arch = (config.backends_by_arch or {}).get(arch, ())
    first = [*(config.backends_fp8_kv or ()), *by_arch] if fp8_kv else list(by_arch)
    first = [b for i, b in enumerate(first) if b in order and b not in first[:i]]
    return first + [b for b in order if b not in first]


def select_backend(problem: DecodeProblem, device: torch.device, config: Config,
                   backend: str | None = None, graph: bool = False,
                   rows16: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Backend, list[tuple[str, list[str]]]]:
    """First backend of the config's order (or only ``backend`` when forced) that is available on
    ``device`` and supports ``problem`` and the inputs' layout, in :func:`dispatch_order`. ``graph``: the plan is
    for CUDA-graph capture (a capacity plan on a CUDA device), so a backend that cannot run under capture
    (``graph_safe = False``) is skipped with that reason. ``rows16``: for q, k_cache and v_cache, whether they can
    be read in 16-byte vectors (:func:`attnplan.problem.rows_16_byte`; a backend that needs it,
    :meth:`Backend.layout_reasons`, is skipped for a strided view that cannot). Unless forced, a backend that would
    read the KV more than once per step (launches per block of queries or of a GQA group's query heads:
    :meth:`Backend.kv_passes`) is passed over for a later one that holds the step in one launch, with that reason; when none does (the float64 fallback aside), the one with
    the fewest passes serves (the first of those in the order).

    Returns:
        ``(backend, skipped)`` where ``skipped`` lists ``(name, reasons)`` of each earlier backend.
    Raises:
        NoBackendError: none fits; the message gives the problem and every backend's reasons.
        TypeError, ValueError: ``backend`` is not a backend's name (``None`` walks the order; ``""`` is refused), or
            ``device`` is not a ``torch.device``.
    """
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    arch = device_info(device).arch if device.type == "cuda" else None
    order = [backend] if backend is not None else \
        dispatch_order(config, torch_dtype(problem.kv_dtype).itemsize == 1, arch)
    skipped: list[tuple[str, list[str]]] = []
    blocked: tuple[int, Backend, list] | None = None  # the backend with the fewest query blocks, what it skipped
    for name in order:
        be = get_backend(name)
        ok, why = be.available(device)
        if not ok:
            skipped.append((name, [why]))
            continue
        reasons = be.supports(problem) + be.layout_reasons(rows16)
        if graph and not be.graph_safe:
            reasons = [*reasons, "not graph-safe: it cannot run under CUDA-graph capture (a capacity plan)"]
        if reasons:
            skipped.append((name, reasons))
            continue
        if backend is not None:
            return be, skipped
        if blocked is not None and be.fallback:
            break  # the float64 fallback is never preferred to a kernel backend's query blocks
        n = be.kv_passes(problem)
        if n > 1:
            if blocked is None or n < blocked[0]:
                blocked = (n, be, list(skipped))
            hb = be.head_block(problem)
            how = (f"blocks of {hb} query heads, one query per launch" if hb else
                   f"launches of {be.q_block(problem)} queries")
            skipped.append((name, [f"GQA group x q_len = {problem.group_size * problem.q_len} rows need {how} (the "
                                   f"KV read {n} times); a later backend may hold them in one"]))
            continue
        return be, skipped
    if blocked is not None:
        return blocked[1], blocked[2]
    detail = "\n".join(f"  {n}: " + "; ".join(r) for n, r in skipped)
    raise NoBackendError(
        f"no backend can run this decode problem on {device}: batch {problem.batch}, heads "
        f"{problem.num_q_heads}/{problem.num_kv_heads}, head_dim {problem.head_dim}, q_len {problem.q_len}, "
        f"{'page ' + str(problem.page_size) if problem.paged else 'contiguous'}, q {problem.q_dtype}, kv {problem.kv_dtype}\n{detail}"
    )


def _tuned_options(dev_info: DeviceInfo, backend: str, problem: DecodeProblem,
                   batch_free: bool = False) -> tuple[dict, str]:
    """Kernel options from the device's tuned table (``plans/<device>.yaml``), and the table's
    text for the cache key. Tables are measured at head_dim 128; larger heads use the backend's own.

    Keys per backend: ``contiguous`` / ``paged``, and optionally ``contiguous_filled`` /
    ``paged_filled`` for problems whose ``batch x num_kv_heads`` alone fills the SMs (no split:
    residency matters more than pipeline depth there), and ``contiguous_fp8`` / ``paged_fp8`` for a
    1-byte KV cache (without them, the 2-byte entry with ``block_n`` doubled). ``batch_free``: never the
    ``_filled`` entry (batch-invariant plans).
    """
    if dev_info.compute_capability == (0, 0):
        return {}, ""
    opts, text = _tuned_lookup(dev_info.slug(), backend, problem.paged,
                               not batch_free and problem.batch * problem.num_kv_heads >= dev_info.sm_count,
                               torch_dtype(problem.kv_dtype).itemsize == 1, problem.head_dim <= 128)
    return dict(opts), text


@functools.lru_cache(maxsize=256)
def _tuned_lookup(slug: str, backend: str, paged: bool, filled: bool, fp8: bool, tuned_head: bool) -> tuple[tuple, str]:
    """:func:`_tuned_options` for the few facts it depends on, cached (a plan-cache hit stays cheap)."""
    table = device_table(slug)
    if not table:
        return (), ""
    per_backend = (table.get("kernel_options") or {}).get(backend) or {}  # empty sections: read as {}
    layout = "paged" if paged else "contiguous"
    if fp8 and f"{layout}_fp8" in per_backend:
        opts = dict(per_backend[f"{layout}_fp8"] or {})
    else:
        opts = dict((per_backend.get(f"{layout}_filled") if filled and f"{layout}_filled" in per_backend
                     else per_backend.get(layout)) or {})
        if fp8 and opts.get("block_n"):
            # tables measured with a 2-byte cache: a 1-byte cache keeps a tile's bytes (and so the
            # bytes in flight per program) by doubling its tokens
            opts["block_n"] = 2 * int(opts["block_n"])
    return (tuple(opts.items()) if tuned_head else ()), _table_text(slug)


@functools.lru_cache(maxsize=64)
def _device_key(dev_info: DeviceInfo) -> str:
    """The device part of the plan-cache key (computed once per device)."""
    return repr(sorted(dev_info.fingerprint().items()))


#: the generation of the device tables: :func:`reload_device_tables` moves it, and memos made under an older one
#: (:meth:`Context.device_facts`, a wrapper's last plan-cache key, :func:`decode`'s last plan) are not used
_TABLES = [0]


def reload_device_tables() -> None:
    """Read the device tables (``plans/<device>.yaml``, :func:`attnplan.config.device_table`) again at the next plan:
    forgets the memoized tables and every view the planner keeps of them (the plan-cache key's table text, the
    tuned kernel options, the parsed split-table rows, each context's device facts, the wrappers' memos of their
    last plan-cache key and :func:`decode`'s of its last plan, the op's per-signature plans). Call it after writing
    a table or changing ``$ATTNPLAN_CACHE_DIR``; ``attnplan tune`` does. The plan cache keys plans by the table's
    text, so a plan of the old table is not served for the new one; a plan a wrapper already holds runs until its
    next ``plan()``, and a captured graph keeps its own."""
    import sys

    from . import planner

    _TABLES[0] += 1
    ops = sys.modules.get("attnplan.ops")
    if ops is not None:
        ops.clear_op_plans()
    device_table.cache_clear()
    _table_text.cache_clear()
    _tuned_lookup.cache_clear()
    planner._ROWS.clear()


@functools.lru_cache(maxsize=None)
def _table_text(slug: str) -> str:
    """The device table as canonical text, part of the plan-cache key (computed once: a cache hit must stay cheap)."""
    return json.dumps(device_table(slug), sort_keys=True, default=str)


def plan_problem(problem: DecodeProblem, backend: Backend, device: torch.device, ctx: Context, *,
                 capacity_mode: bool = False, num_splits: int | None = None, dev_info: DeviceInfo | None = None) -> SplitPlan:
    """Plan ``problem`` for ``backend`` through ``ctx``'s plan cache (bucketed lengths). ``problem`` is planned as
    given: :class:`DecodeWrapper` and :func:`decode` first round a live problem's capacity up to its power-of-two
    bucket (:func:`~attnplan.problem.len_bucket`), so the plans they cache have such capacities.

    Kernel options: the config's ``backend_options`` where set, else the device's tuned table
    (``kernel_options.<backend>.<layout>``), else the backend's defaults. A plan whose split count comes from a
    tuned row that carries kernel options (``attnplan tune --row-options``) runs the row's options over the
    table's, unless the config sets any of the backend's options, the options raise ``ValueError`` for this
    problem's kernel, or the plan with them would come from another row (:func:`attnplan.planner.entry_options`).
    Such a miss plans twice. A batch-invariant plan takes no option that depends on the batch (no row options, no
    ``*_filled`` table entry).

    Raises:
        ValueError: the config's options do not fit the backend's kernel for this problem.
    """
    if dev_info is None:
        dev_info, dkey, table_text = ctx.device_facts(torch.device(device))
    else:
        dkey = _device_key(dev_info)
        table_text = _table_text(dev_info.slug()) if dev_info.compute_capability != (0, 0) else ""
    extra = backend.plan_key_extra()
    return _plan_cached(lambda: problem, problem.bucket_key(), problem.capacity, backend, device, ctx, dev_info,
                        dkey, table_text, extra, capacity_mode, num_splits)


def _plan_key(bucket_key: tuple, capacity: int, backend: Backend, ctx: Context, device_key: str, table_text: str,
              extra: str, capacity_mode: bool, num_splits: int | None) -> tuple:
    """The plan-cache key of :func:`_plan_cached` (see :mod:`attnplan.cache`)."""
    return (device_key, backend.name, bucket_key, capacity, capacity_mode,
            -1 if num_splits is None else num_splits, ctx.planning_fingerprint(backend.name), table_text, extra)


def _plan_cached(get_problem, bucket_key: tuple, capacity: int, backend: Backend, device: torch.device, ctx: Context,
                 dev_info: DeviceInfo, device_key: str, table_text: str, extra: str, capacity_mode: bool,
                 num_splits: int | None) -> SplitPlan:
    """:func:`plan_problem` from the problem's bucket key and capacity; ``get_problem()`` makes the problem, called
    only on a miss (a cache hit must cost microseconds: its key is built from the live problem's bucket, the same
    as the bucketed problem's, and no problem is made). ``extra``: the backend's ``plan_key_extra()``."""
    key = _plan_key(bucket_key, capacity, backend, ctx, device_key, table_text, extra, capacity_mode, num_splits)
    if ctx.config.plan_cache.enabled:
        plan = ctx.cache.hit(key)
        if plan is not None:
            return plan

    def build() -> SplitPlan:
        problem = get_problem()
        bucketed = problem.bucketed()
        invariant = ctx.config.split.batch_invariant
        tuned, _ = _tuned_options(dev_info, backend.name, bucketed, batch_free=invariant)
        user = {k: v for k, v in ctx.config.options(backend.name).model_dump().items() if v is not None}
        # the config's choice wins over the table's values of options that name the same thing
        tuned = {k: v for k, v in tuned.items()
                 if not any(k in group and group & user.keys() for group in backend.option_aliases)}

        # queries (and a GQA group's query heads) in blocks where the backend's program cannot hold them all: the
        # kernel options are the launch's
        q_block, head_block = backend.q_block(bucketed), backend.head_block(bucketed)
        q_block = 0 if q_block >= bucketed.q_len else q_block
        launch = launch_problem_of(bucketed, q_block, head_block)

        def plan_with(opts: dict) -> SplitPlan:
            kernel = backend.kernel_config(launch, opts, device)
            return make_plan(bucketed, dev_info, ctx.config, backend.name, kernel,
                             capacity_mode=capacity_mode, num_splits=num_splits,
                             merge_strategies=backend.merge_strategies,
                             fused_merge_parallelism=backend.fused_merge_parallelism,
                             fused_merge_max_chunk=backend.fused_merge_max_chunk,
                             q_block=q_block, head_block=head_block)

        plan = plan_with({**tuned, **user})
        # the tuned row's own kernel options (planner.entry_options) go with its split count: only for a plan that
        # row made, kept only if the same row makes the plan again (a windowed problem plans its window's span),
        # and not over options the config sets (e.g. cuda_ptx's threads and num_warps name the same thing)
        row = entry_options(plan.table_entry) if plan.policy == "tuned" and not invariant else {}
        if row and not user:
            try:
                again = plan_with({**tuned, **row})
            except ValueError:  # options measured at other heads that do not fit this problem's kernel
                return plan
            if again.policy == "tuned" and again.table_entry == plan.table_entry:
                return again
        return plan

    if not ctx.config.plan_cache.enabled:
        ctx.cache.stats.misses += 1
        return build()
    def check(p: SplitPlan) -> None:  # a plan read from disk
        if p.device != DeviceKey.of(dev_info):  # its kernel options were checked for the device it names
            raise ValueError(f"plan for device {tuple(p.device)}, not {tuple(DeviceKey.of(dev_info))}")
        check_plan_serves(p, get_problem(), backend)

    return ctx.cache.get_or_create(key, build, validate=check)


def check_plan_serves(p: SplitPlan, problem: DecodeProblem, backend: Backend) -> None:
    """That a plan not made here (read from disk, or given to :meth:`DecodeWrapper.use_plan`) serves ``problem`` on
    ``backend``: :meth:`SplitPlan.validate`, the backend's name, one of its merges, and its query and head blocks (a
    plan of other blocks would launch more rows than a program holds).

    Raises:
        TypeError: a plan field of the wrong type (:meth:`SplitPlan.check_types`).
        ValueError: naming what does not fit.
    """
    p.validate(problem)
    if p.backend != backend.name:  # the kernel-option limits checked on reading are the named backend's
        raise ValueError(f"plan for backend {p.backend!r}, not {backend.name!r}")
    if p.merge != "none" and p.merge not in backend.merge_strategies:
        raise ValueError(f"plan merge {p.merge!r} is not one of {backend.name}'s "
                         f"{sorted(backend.merge_strategies)}")
    qb, hb = backend.q_block(problem), backend.head_block(problem)
    want = 0 if qb >= problem.q_len else qb
    if p.q_block != want:
        raise ValueError(f"plan q_block {p.q_block} is not {want}: {backend.name} holds {qb} of the "
                         f"{problem.q_len} queries per launch")
    if p.head_block != hb:
        raise ValueError(f"plan head_block {p.head_block} is not {backend.name}'s {hb} query heads per launch")


def _scale_tensor(scale, hkv: int, device) -> torch.Tensor | None:
    """A per-tensor float scale becomes a ``[num_kv_heads]`` fp32 tensor once, at plan time."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((hkv,), float(scale), dtype=torch.float32, device=device)


_INPUTS = ("q", "k_cache", "v_cache", "seq_lens", "block_table")
_F32 = torch.float32


def _not_a_tensor(name: str, t) -> TypeError:
    return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _extent(shape, strides, itemsize: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 when it has no element)."""
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * itemsize


def _any_lazy(q, k_cache, v_cache, seq_lens, block_table) -> bool:
    """Whether an input (tensors; ``block_table`` may be ``None``) is a lazily negated view (``Tensor.is_neg()``):
    it has the signature of the tensor it views, so checks reused by signature must not accept it. O(1)."""
    return (q.is_neg() or k_cache.is_neg() or v_cache.is_neg() or seq_lens.is_neg()
            or (block_table is not None and block_table.is_neg()))


def _outputs_fit(qsig: tuple, out, lse) -> bool:
    """Whether :func:`validate_outputs` passes ``out`` and ``lse`` for a 4-D q of signature ``qsig`` (its
    :func:`~attnplan.problem.tensor_signature`): the same tests, with q's shape, dtype and device taken from the
    signature instead of read again. ``False`` sends the caller to :func:`validate_outputs`, which raises."""
    _, shape, _, dtype, device, _ = qsig
    T = torch.Tensor
    try:
        if out is not None and not (isinstance(out, T) and out.shape == shape and out.dtype == dtype
                                    and out.device == device and (shape[3] <= 1 or out.stride(3) == 1)
                                    and (out.is_contiguous() or not has_internal_overlap(shape, out.stride()))
                                    and not out.is_neg() and not out.requires_grad):
            return False
        return lse is None or (isinstance(lse, T) and lse.dtype == _F32 and lse.shape == shape[:3]
                               and lse.device == device and (shape[2] <= 1 or lse.stride(2) == 1)
                               and (lse.is_contiguous() or not has_internal_overlap(shape[:3], lse.stride()))
                               and not lse.is_neg() and not lse.requires_grad)
    except RuntimeError:  # a tensor without one shape (nested) or strides (sparse): validate_outputs names it
        return False


class DecodeWrapper:
    """Plan once per step (or once for a CUDA graph), run allocation-free.

    Args:
        config: a :class:`~attnplan.config.Config`, a YAML path, a :class:`Context`, or ``None``
            for the default context (``plans/default.yaml`` + ``$ATTNPLAN_CONFIG``).
        backend: force one backend by name (its refusal reasons become the error); ``None``
            walks the config's order.

    Raises:
        TypeError: ``backend`` is neither ``None`` nor a ``str``, or ``config`` is none of the above.
        ValueError: ``backend`` is no backend's name.
        ConfigError: ``config`` is a path to a bad config file (:func:`~attnplan.config.load_config`), or, with
            ``None``, ``$ATTNPLAN_CONFIG`` is (:func:`default_context`).

    Threads: a wrapper is not thread-safe; use one per thread (or per stream), as :func:`decode` and the Hugging
    Face integration do. Wrappers of one :class:`Context` may run in different threads at once (the context, its
    plan cache and the backends are shared safely). Two threads must not call one wrapper's methods at the same
    time: its runs share one workspace (the partial states, the merge's table and the fused merge's counters), and
    ``run(out=None)``'s buffer, so overlapping runs give wrong results; ``plan()`` replaces what ``run()`` reads.
    ``run()`` and ``try_run()`` take no lock (they cost microseconds); their one-pass check and the launch it
    passes read one snapshot made by ``plan()``, and ``run()``'s full path another, so a run (with ``out`` given)
    that overlaps a ``plan()`` for other inputs launches the binding its check compared the inputs with, never one
    made for another signature or scale.

    Copies: a wrapper is neither copied nor pickled (``copy.copy``, ``copy.deepcopy`` and ``pickle`` raise
    ``TypeError``): a copy would share its workspace, ``run(out=None)``'s buffer and bound launches with the original.
    Make a new wrapper of the same config instead; its plan (``plan_``, a :class:`SplitPlan`) copies and pickles, and
    the new wrapper's :meth:`use_plan` takes it after a ``plan()`` of the same inputs.

    Example::

        w = attnplan.DecodeWrapper()
        w.plan(q, k_cache, v_cache, seq_lens, block_table, seq_lens_host=lens)  # host work, no sync
        out = w.run(q, k_cache, v_cache, seq_lens, block_table)               # launches only
    """

    def _refuse_copy(self, *_):
        raise TypeError("a DecodeWrapper cannot be copied or pickled: a copy would share its workspace, its output "
                        "buffer and its bound launches; make a new DecodeWrapper(config) (its plan_, a SplitPlan, "
                        "can be copied, pickled and passed to use_plan())")

    __copy__ = __deepcopy__ = __reduce_ex__ = _refuse_copy

    def __init__(self, config: Config | Context | str | None = None, *, backend: str | None = None):
        if backend is not None:
            check_backend_name(backend)
        self.ctx = _context(config)
        self.forced_backend = backend
        self.plan_: SplitPlan | None = None
        self.backend: Backend | None = None
        self.skipped: list[tuple[str, list[str]]] = []
        self.workspace: Workspace | None = None
        self._out: torch.Tensor | None = None
        self._own_out: torch.Tensor | None = None  # the last buffer plan() made itself (not a caller's out)
        self._lens_host: list | None = None  # plan()'s seq_lens_host, copied (explain() converts them to ints)
        self._sig: tuple | None = None
        self._sm_scale = 0.0
        self._variant: dict = {}
        # plan()'s memos (a repeated plan() with the same inputs is O(1)): the static checks' inputs and result,
        # the (plan, workspace, device) the workspace was checked for, the float scales' tensors, the variant key,
        # the bound launch and what it was bound to
        self._static_key: tuple | None = None
        self._static: dict | None = None
        self._bucket_parts: tuple = ()
        self._ws_for: tuple = ()
        self._scales: dict = {}
        self._variant_key: tuple = ()
        self._launcher = None
        self._bound_to: tuple = ()
        self._forget = None  # weakref.finalize dropping the bound plan's launch constants (Backend.forget)
        # run()'s constants for the planned signature: each input's byte extent and the out extent's terms
        self._extents: tuple = ()
        self._q_terms: tuple = ()
        # the previous plan()'s hit steps (see _plan), the (plan, backend, device) prepare() last ran for, and run()'s
        # one-pass check (_make_fast: None while a plan() is in progress or after one failed, and for plans with sink
        # or scale tensors) with the binding it was made for
        self._hit_memo: tuple = ()
        self._out_strides_ok: tuple | None = None  # run()'s one-pass check: (q's shape, out strides) found fine
        self._prepared: tuple = ()
        self._fast: tuple | None = None
        self._fast_made: tuple | None = None
        # run()'s full path reads the last complete plan's state from one snapshot (_snapshot), kept until the next
        # plan() completes: a run overlapping a plan() never pairs one plan's signature with another's launch
        self._snap: tuple | None = None
        self._fast_src: tuple | None = None
        # decode()'s last plan() on this wrapper with host lengths: (signature, scalars, lengths, plan, the device
        # tables' generation); a call that repeats all of them (the layers of one step) has that plan already
        self._repeat: tuple = ()

    @staticmethod
    def _signature(q, k_cache, v_cache, seq_lens, block_table) -> tuple:
        """What ``run()`` must find as ``plan()`` saw it: shape, strides, dtype, device and 16-byte
        alignment of the data pointer of q, k_cache, v_cache, seq_lens and block_table, each as
        :func:`attnplan.problem.tensor_signature` gives it (O(1), no allocation, no sync). Raises
        ``TypeError`` naming an argument that is not a tensor."""
        return DecodeWrapper._signature_ptrs(q, k_cache, v_cache, seq_lens, block_table)[0]

    @staticmethod
    def _signature_ptrs(q, k_cache, v_cache, seq_lens, block_table) -> tuple[tuple, tuple]:
        """:meth:`_signature` and the five data pointers (0 for ``None``), in one pass over the tensors
        (written out: this is most of ``run()``'s host time)."""
        T = torch.Tensor
        if not isinstance(q, T):
            raise _not_a_tensor("q", q)
        if not isinstance(k_cache, T):
            raise _not_a_tensor("k_cache", k_cache)
        if not isinstance(v_cache, T):
            raise _not_a_tensor("v_cache", v_cache)
        if not isinstance(seq_lens, T):
            raise _not_a_tensor("seq_lens", seq_lens)
        try:
            pq, pk, pv, ps = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_lens.data_ptr()
            if block_table is None:
                sb, pb = None, 0
            elif not isinstance(block_table, T):
                raise _not_a_tensor("block_table", block_table)
            else:
                pb = block_table.data_ptr()
                sb = ("block_table", block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
                      not pb & 15)
            if not (pq and pk and pv and ps) or (block_table is not None and not pb):
                # address 0: a tensor without elements, or a wrapper subclass without memory (refused by name)
                DecodeWrapper._refuse_unreadable(q, k_cache, v_cache, seq_lens, block_table)
            return ((("q", q.shape, q.stride(), q.dtype, q.device, not pq & 15),
                     ("k_cache", k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, not pk & 15),
                     ("v_cache", v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, not pv & 15),
                     ("seq_lens", seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.device, not ps & 15),
                     sb),
                    (pq, pk, pv, ps, pb))
        except RuntimeError:  # a tensor without a data pointer (sparse, another layout) or without one shape (nested)
            DecodeWrapper._refuse_unreadable(q, k_cache, v_cache, seq_lens, block_table)
            raise

    @staticmethod
    def _refuse_unreadable(q, k_cache, v_cache, seq_lens, block_table) -> None:
        """Raise ``TypeError`` naming the first of the inputs the kernels cannot read: not dense
        (:func:`~attnplan.problem.check_strided`) or without memory of its own
        (:func:`~attnplan.problem.check_addressable`). Off the hot path: only where a data pointer raised or was 0."""
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens),
                        ("block_table", block_table)):
            if t is not None:
                check_strided(t, name)
                check_addressable(t, name)

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor | None = None, *, sm_scale: float | None = None,
             num_splits: int | None = None, capacity: bool = False, window_left: int = -1,
             logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
             k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
             seq_lens_host=None) -> SplitPlan:
        """Validate the inputs, choose a backend, plan (through the cache), size the workspace and bind the
        launches.

        Args:
            q, k_cache, v_cache, seq_lens, block_table: see :mod:`attnplan.problem`.
            sm_scale: score scale, default ``1/sqrt(head_dim)``.
            num_splits: 0 = heuristic, 1 = no split, >1 = forced (FlashAttention's convention);
                ``None`` takes the config's ``split.num_splits``.
            capacity: ``True``: plan for the cache's capacity (every length up to it) instead of the live
                lengths: the plan to capture in a CUDA graph (a ``bool``: the capacity is the cache's, never given
                here as a number).
            window_left: sliding window in tokens (query at position ``p`` sees ``[p - window_left, p]``),
                ``-1`` = none; the plan covers only the window.
            logits_soft_cap: ``cap * tanh(score / cap)`` on the scaled scores, ``0`` = off.
            sinks: ``[num_q_heads]`` fp32 sink logits (gpt-oss), kept by reference for ``run()``.
            k_scale, v_scale: dequantization scales of a ``float8_e4m3fn`` cache: floats (per
                tensor) or fp32 ``[num_kv_heads]`` tensors (kept by reference).
            seq_lens_host: ``seq_lens`` as host integers (``batch`` ints), when the caller has them: planning
                then reads nothing from the GPU and never synchronizes the host, plan-cache miss and new workspace
                included (a tensor ``sinks`` / ``k_scale`` / ``v_scale`` is read once, at the first plan that
                sees it). The caller vouches that they equal ``seq_lens`` and that the block table's entries are
                valid: they are not read (no check); the kernels clamp every page index into ``[0, num_pages)``,
                so a bad entry reads a wrong page but never outside the cache. Without ``seq_lens_host``,
                ``seq_lens`` and the block table are read and checked (one host sync).
        Returns:
            the :class:`SplitPlan` (also kept as ``self.plan_``).
        Raises:
            TypeError, ValueError: bad inputs (named argument, value and expectation), before any kernel; an input
                that requires grad while grad mode is on (attnplan computes no gradients:
                :func:`attnplan.problem.check_no_grad`).
            NoBackendError: no backend fits.
        """
        return self._plan(None, q, k_cache, v_cache, seq_lens, block_table, sm_scale, num_splits, capacity,
                          window_left, logits_soft_cap, sinks, k_scale, v_scale, seq_lens_host)

    def _plan(self, sig, q, k_cache, v_cache, seq_lens, block_table, sm_scale, num_splits, capacity, window_left,
              logits_soft_cap, sinks, k_scale, v_scale, seq_lens_host) -> SplitPlan:
        """:meth:`plan`; ``sig``: the inputs' :meth:`_signature` when the caller has it (else ``None``). A plan()
        that raises leaves no plan behind: its checks may have passed in part and replaced some of the previous
        plan's state (the signature, the output buffer), so run() must not pair the new inputs with the old plan."""
        try:
            return self._plan_body(sig, q, k_cache, v_cache, seq_lens, block_table, sm_scale, num_splits, capacity,
                                   window_left, logits_soft_cap, sinks, k_scale, v_scale, seq_lens_host)
        except BaseException:
            self._fast = self.plan_ = self._sig = self._snap = None
            self._launcher, self._bound_to, self._hit_memo, self._repeat = None, (), (), ()
            raise

    def _plan_body(self, sig, q, k_cache, v_cache, seq_lens, block_table, sm_scale, num_splits, capacity,
                   window_left, logits_soft_cap, sinks, k_scale, v_scale, seq_lens_host) -> SplitPlan:
        """:meth:`_plan` until it raises."""
        self._fast = None  # run() takes its full path until this plan is complete
        if capacity is not True and capacity is not False:  # e.g. capacity=4096, read as tokens: it is not
            raise TypeError(f"capacity must be a bool (True: plan for every length up to the cache's capacity, "
                            f"k_cache.shape[1] or max_pages_per_seq * page_size; False: the live lengths), got "
                            f"{type(capacity).__name__} {capacity!r:.60}")
        if not isinstance(num_splits, int) and hasattr(num_splits, "__index__"):  # a numpy integer, as window_left
            try:
                num_splits = operator.index(num_splits)
            except TypeError:  # a float tensor, an array of several: not an int, refused below by name
                pass
        check_num_splits(num_splits)
        # -- the static checks (attnplan.problem.validate_inputs), memoized: they depend only on what the key holds
        # (the inputs' signature, the scalars by type and value); tensor sinks / scales always take the full path
        if sig is None:
            try:
                sig = self._signature(q, k_cache, v_cache, seq_lens, block_table)
            except TypeError:
                sig = None  # validate_inputs raises the precise error
        last = self._sig
        if sig is not None and sig is not last and sig == last:
            sig = last  # the planned signature again: compared once here, then by identity (the memos, run())
        skey = None
        if sig is not None and sinks is None and not isinstance(k_scale, torch.Tensor) \
                and not isinstance(v_scale, torch.Tensor):
            skey = (sig, type(window_left), window_left, type(logits_soft_cap), logits_soft_cap, type(sm_scale),
                    sm_scale, type(k_scale), k_scale, type(v_scale), v_scale)
        if skey is not None and skey == self._static_key and not _any_lazy(q, k_cache, v_cache, seq_lens, block_table):
            static = self._static  # (a lazily negated view has the same signature: the full checks refuse it)
        else:
            static = validate_inputs(q, k_cache, v_cache, seq_lens, block_table, window_left=window_left,
                                     soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                     sm_scale=sm_scale)
            self._static_key, self._static = skey, static
            # what the plan-cache key and the scale take from the static fields: the bucket key around its two
            # lengths (DecodeProblem.static_bucket_key's order), the default score scale
            bk = DecodeProblem.static_bucket_key(static, 0, 0)
            self._bucket_parts = (bk[:8], bk[10:], float(default_sm_scale(static["head_dim"])))
        check_no_grad(q, k_cache, v_cache, sinks, k_scale, v_scale)  # not memoized: grad mode is a thread's state
        # -- the lengths: host ints checked in Python (no tensor, no device read), else validate_values
        num_pages = sig[1][1][0] if block_table is not None else 0  # k_cache.shape[0]
        fast = None
        if seq_lens_host is not None:
            if type(seq_lens_host) is not list and type(seq_lens_host) is not tuple:
                # read once (an iterator would be spent by a second pass), as ints (or a TypeError naming it)
                seq_lens_host = as_host_lengths(seq_lens_host)
            fast = host_lengths(static, seq_lens_host, num_pages)
        if fast is not None:
            lens_host, max_len, total = fast
        else:
            max_len, total = validate_values(static, seq_lens, block_table, num_pages, seq_lens_host)
            lens_host = None if seq_lens_host is None else list(seq_lens_host)
        if capacity:
            max_len, total = static["capacity"], static["capacity"] * static["batch"]
        # -- backend and plan: the problem itself is made only when a memo or the plan cache misses
        sq = sig[0]  # q's (name, shape, strides, dtype, device, aligned)
        dev = sq[4]
        ctx = self.ctx
        head, tail, default_scale = self._bucket_parts
        b_max, b_mean = len_bucket(max_len), mean_bucket(total, static["batch"], max_len)
        cap = static["capacity"] if static["capacity"] > 0 else max_len
        if not capacity:
            # a live plan is made for its capacity's power-of-two bucket (len_bucket), like its lengths: it serves
            # every capacity of the bucket, so a cache that grows a token per step (transformers' DynamicCache)
            # plans once per bucket, not once per token
            cap = len_bucket(cap)
        # the previous plan()'s backend choice and cache key serve again when what they were derived from repeats:
        # the static checks' result (the same dict: the same signature and scalars), the length buckets, capacity,
        # mode, split count, forced backend and context (Context.select and device_facts are memos of exactly these;
        # a tensor's device is always indexed). The plan cache itself is still asked (its hit count, its LRU order).
        plan = None
        hm = self._hit_memo
        if hm and hm[0] is static and hm[1] == b_max and hm[2] == b_mean and hm[3] == cap and hm[4] == capacity \
                and hm[5] == num_splits and hm[6] == self.forced_backend and hm[7] is ctx and hm[8] is self.backend \
                and ctx.config.plan_cache.enabled and hm[10] == _TABLES[0]:
            plan = ctx.cache.hit(hm[9])
        if plan is None:
            made: list[DecodeProblem] = []

            def problem() -> DecodeProblem:
                if not made:
                    made.append(DecodeProblem(max_kv_len=max_len, total_kv_len=total, **{**static, "capacity": cap}))
                return made[0]

            bkey = head + (b_max, b_mean) + tail
            rows16 = (rows_16_byte(sq), rows_16_byte(sig[1]), rows_16_byte(sig[2]))
            self.backend, self.skipped, extra = ctx.select(bkey, cap, dev, self.forced_backend,
                                                           capacity and dev.type == "cuda", problem, rows16)
            dev_info, dkey, table_text = ctx.device_facts(dev)
            plan = _plan_cached(problem, bkey, cap, self.backend, dev, ctx, dev_info, dkey, table_text, extra,
                                capacity, num_splits)
            self._hit_memo = (static, b_max, b_mean, cap, capacity, num_splits, self.forced_backend, ctx,
                              self.backend, _plan_key(bkey, cap, self.backend, ctx, dkey, table_text, extra, capacity,
                                                      num_splits), _TABLES[0])
        prepare = getattr(self.backend, "prepare", None)
        pm = self._prepared
        if prepare is not None and not (pm and pm[0] is plan and pm[1] is self.backend and pm[2] == dev):
            # compile / load kernels now, never inside a CUDA-graph capture; once per plan and device (a backend keeps
            # what it loaded: a plan-cache hit need not look it up again); each launch's with query blocks
            for launch in plan.launches:
                prepare(launch.plan, dev)
            self._prepared = (plan, self.backend, dev)
        ws_for = self._ws_for
        if not (ws_for and ws_for[0] is plan and ws_for[1] is self.workspace and ws_for[2] == dev):
            if self.workspace is None or not self.workspace.serves(plan, dev):
                self.workspace = Workspace.allocate(plan, dev)
            self._ws_for = (plan, self.workspace, dev)
        self._lens_host = lens_host
        if sig is not self._sig and sig != self._sig:
            self._sig = sig
            self._extents = tuple(0 if t is None else _extent(t[1], t[2], t[3].itemsize) for t in sig)
            self._q_terms = (tuple(n - 1 for n in sq[1]), sq[3].itemsize)
        o = self._out
        if o is None or o.shape != sq[1] or o.dtype != sq[3] or o.device != dev:
            with torch.inference_mode(False):  # reused by later runs in any mode (Workspace.allocate)
                self._out = self._own_out = torch.empty_like(q)
        elif o is self._own_out:  # made here (dense: numel x itemsize bytes), not a caller's out set by decode()
            # a new one where it is q's memory (a run()'s result passed back as q: run() would refuse the overlap)
            pq, po = q.data_ptr(), o.data_ptr()
            if po < pq + self._extents[0] and pq < po + o.numel() * sq[3].itemsize:
                with torch.inference_mode(False):
                    self._out = self._own_out = torch.empty_like(q)
        self._sm_scale = default_scale if sm_scale is None else float(sm_scale)
        ks = k_scale if k_scale is None or isinstance(k_scale, torch.Tensor) else \
            self._scale(k_scale, static["num_kv_heads"], dev)
        vs = v_scale if v_scale is None or isinstance(v_scale, torch.Tensor) else \
            self._scale(v_scale, static["num_kv_heads"], dev)
        vkey = (static["window_left"], static["soft_cap"], sinks, ks, vs)
        vk = self._variant_key
        if not (vk and vk[0] == vkey[0] and vk[1] == vkey[1] and vk[2] is sinks and vk[3] is ks and vk[4] is vs):
            self._variant_key = vkey
            self._variant = dict(window_left=vkey[0], soft_cap=vkey[1], sinks=sinks, k_scale=ks, v_scale=vs)
        self._bind(plan, q, k_cache, v_cache, seq_lens, block_table)
        self.plan_ = plan
        if self._fast_src is not self._bound_to:  # _bind replaces _bound_to whenever what run() relies on changes
            self._fast_made, self._fast_src = self._make_fast(), self._bound_to
        self._snapshot()
        self._fast = self._fast_made
        return plan

    def use_plan(self, plan: SplitPlan) -> SplitPlan:
        """Serve the inputs of the last :meth:`plan` with ``plan`` instead of the plan it made: e.g. an edited copy
        of :attr:`plan_` (``dataclasses.replace``: another schedule, split count or kernel options, to time or test
        it) or one read back with :meth:`SplitPlan.from_dict`. It is checked as a plan file is
        (:func:`attnplan.cache.check_plan`: the plan's consistency, a finite prediction, sizes bounded by what the
        problem can need, kernel options its backend accepts unchanged) and against the planned inputs
        (:func:`check_plan_serves`). The inputs' signature, scalars and variants stay ``plan()``'s; the kernels are
        compiled or loaded now (not under a CUDA-graph capture) and a workspace is allocated when the current one
        does not serve ``plan``. Later :meth:`run` and :meth:`try_run` calls launch ``plan`` through the backend's
        unbound path (``Backend.run``: the same kernels, more host work per call than a bound launch) until the next
        :meth:`plan`, which plans afresh.

        Returns:
            ``plan``, now :attr:`plan_`.
        Raises:
            PlanNotReadyError: no ``plan()`` was made, or a CUDA graph is being captured.
            TypeError: ``plan`` is not a :class:`SplitPlan`.
            ValueError: ``plan`` is for another backend or another device (its ``device`` key: name, SMs, compute
                capability, driver; its kernel options and grid were chosen for that device, as a plan file's
                are; ``dataclasses.replace(plan, device=wrapper.plan_.device)`` runs it here anyway), fails the
                plan-file checks, or does not serve the planned problem on it (naming what does not fit);
                ``TypeError`` for a field of the wrong type.
        """
        if self.plan_ is None or self.backend is None or self.workspace is None:
            raise PlanNotReadyError("DecodeWrapper.use_plan() called before plan()")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise PlanNotReadyError("DecodeWrapper.use_plan() called during CUDA graph capture (it may compile kernels "
                                    "and allocate a workspace): call it before capturing")
        if not isinstance(plan, SplitPlan):
            raise TypeError(f"plan must be a SplitPlan, got {type(plan).__name__}")
        plan.check_types()
        if plan.backend != self.backend.name:
            raise ValueError(f"the plan is for backend {plan.backend!r}, this wrapper's inputs were planned on "
                             f"{self.backend.name!r}")
        if plan.device != self.plan_.device:
            raise ValueError(f"the plan is for device {tuple(plan.device)}, the planned inputs are on "
                             f"{tuple(self.plan_.device)}: plan() here, or dataclasses.replace(plan, device=...) to "
                             f"run it here anyway")
        if plan.problem != self.plan_.problem:
            a, b = vars(self.plan_.problem), vars(plan.problem) if hasattr(plan.problem, "__dict__") else {}
            diff = [f"{k} {a[k]!r:.40} (the plan: {b.get(k)!r:.40})" for k in a if b.get(k) != a[k]]
            raise ValueError(f"the plan is for another problem than the planned inputs: {'; '.join(diff[:4])}")
        check_plan(plan, self.plan_.problem)
        check_plan_serves(plan, self.plan_.problem, self.backend)
        dev = self.workspace.targets.device
        for launch in plan.launches:
            self.backend.prepare(launch.plan, dev)
        if not self.workspace.serves(plan, dev):
            self.workspace = Workspace.allocate(plan, dev)
        # no bound launch (it holds the previous plan): run() launches through Backend.run
        self._launcher, self._bound_to, self._hit_memo, self._repeat = None, (), (), ()
        if self._forget is not None:
            self._forget()
        self._forget = weakref.finalize(self, self.backend.forget, plan, self.workspace)
        self._prepared, self._ws_for = (plan, self.backend, dev), (plan, self.workspace, dev)
        self.plan_ = plan
        # run()'s one-pass check (and try_run()) for the planned inputs, made again: it launches this plan unbound; the
        # next plan() binds again (its _bind sees no binding) and makes its own
        self._snapshot()
        self._fast = self._fast_made = self._make_fast()
        self._fast_src = self._bound_to
        return plan

    def _no_self_overlap(self, shape, strides) -> bool:
        """Whether a strided ``out`` of ``shape`` has no elements that share memory; remembered for the next run()
        (the one-pass check then compares the strides only)."""
        if has_internal_overlap(shape, strides):
            return False
        self._out_strides_ok = (shape, strides)
        return True

    def _snapshot(self) -> None:
        """What run()'s full path reads, taken together once a plan is complete (one assignment)."""
        self._snap = (self._sig, self._extents, self._q_terms, self._sm_scale, self._variant, self.backend,
                      self.plan_, self.workspace, self._launcher)

    def _make_fast(self) -> tuple | None:
        """The planned values :meth:`run`'s one-pass check compares with, flat (see :meth:`run`): per input its
        shape, strides, dtype, device and alignment (the block table's ``None`` when there is none), the inputs'
        byte extents, the out extent's terms, lse's planned shape and whether the backend is graph-safe; then what
        the launch uses, the bound launch and ``(backend, plan, workspace, score scale, variants)``, so a run launches
        exactly the binding its check passed for, whatever a ``plan()`` does meanwhile. ``None`` (the full path
        every time) for a binding with sink or scale tensors, or a score scale that is not a finite float."""
        var, sm = self._variant, self._sm_scale
        if var["sinks"] is not None or var["k_scale"] is not None or var["v_scale"] is not None \
                or type(sm) is not float or sm - sm != 0.0:
            return None
        sq, sk, sv, ss, sb = self._sig
        (d0, d1, d2, d3), isz = self._q_terms

        def fields(t):  # a C-contiguous tensor's strides as None: Tensor.is_contiguous() checks them (same_signature)
            return (t[1], None if is_contiguous_layout(t[1], t[2]) else t[2], *t[3:])

        return (*fields(sq), *fields(sk), *fields(sv), *fields(ss), *(fields(sb) if sb is not None else (None,) * 5),
                *self._extents, d0, d1, d2, d3, isz, math.prod(sq[1]) * isz, sq[1][:3], self.backend.graph_safe,
                self._launcher, (self.backend, self.plan_, self.workspace, sm, var))

    def _scale(self, scale, hkv: int, device) -> torch.Tensor | None:
        """:func:`_scale_tensor`, reusing the tensor of the same float scale (a plan-cache hit allocates nothing)."""
        if scale is None or isinstance(scale, torch.Tensor):
            return scale
        key = (float(scale), hkv, device)
        t = self._scales.get(key)
        if t is None:
            if len(self._scales) >= 8:
                self._scales.clear()
            t = self._scales[key] = _scale_tensor(scale, hkv, device)
        return t

    def _bind(self, plan: SplitPlan, q, k_cache, v_cache, seq_lens, block_table) -> None:
        """The backend's bound launch (``Backend.bind``, where it has one) for this plan, workspace, signature,
        score scale and variants; kept while they stay the same."""
        # plan() keeps its signature, variant and workspace objects while they stay the same: identity suffices
        to = (plan, self.workspace, self._sig, self._variant, self.backend, self._sm_scale)
        b = self._bound_to
        if b and b[0] is plan and b[1] is self.workspace and b[2] is self._sig and b[3] is self._variant \
                and b[4] is self.backend and b[5] == self._sm_scale:
            return
        self._bound_to = to
        previous = self._launcher if b and b[4] is self.backend else None
        self._launcher = None
        if self._forget is not None:  # the previous plan's launch constants in the backend hold its workspace
            self._forget()
            self._forget = None
        # what the backend keeps for this (plan, workspace) (Backend.run's launch constants, which hold the workspace's
        # tensors; per workspace view for several launches) is forgotten with the wrapper or its next binding: a
        # wrapper's workspace dies with it, also one allocated in a torch.compile CUDA-graph pool
        self._forget = weakref.finalize(self, self.backend.forget, plan, self.workspace)
        if not plan.multi_launch:  # a plan of several launches launches through Backend.run
            try:
                inputs = DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, self._sm_scale, **self._variant)
                self._launcher = self.backend.bind(plan, self.workspace, inputs, previous=previous)
            except ValueError:  # the backend's own run() raises it, with its message, when run() is called
                self._launcher = None

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the planned kernels on the current stream: no allocation, no host sync.

        The kernels read ``seq_lens`` and the block table on the device at every launch; each length is read
        clamped into ``[0, capacity]`` and each page index into ``[0, num_pages)``, so values written after
        ``plan()`` outside those ranges give attention over the clamped span (or a wrong page), never a read
        outside the cache (:mod:`attnplan.problem`'s input contract).

        Args:
            out: ``[batch, q_len, num_q_heads, head_dim]`` in q's dtype; ``None`` writes the
                wrapper's own buffer (valid until the next ``run``; a view op in place on it, such as ``transpose_``
                or ``set_``, makes the next ``run`` raise ``ValueError``: take a view instead).
            lse: optional ``[batch, q_len, num_q_heads]`` fp32 to receive the natural-log LSE.
        Returns:
            ``out``.
        Raises:
            PlanNotReadyError: no ``plan()`` was made (under capture: plan before capturing), or the planned
                backend cannot run under the CUDA-graph capture in progress (plan with ``capacity=True``).
            TypeError: an argument is not a tensor, or a tensor without memory of its own (a wrapper subclass such as
                ``DTensor``: :func:`attnplan.problem.check_addressable`).
            ValueError: the shape, strides, dtype, device or 16-byte alignment of q, k_cache, v_cache,
                seq_lens or block_table differ from the planned ones (named; the strides of a tensor C-contiguous
                now and at plan() may differ along axes of length one, see
                :func:`attnplan.problem.same_signature`); one of them is a lazily negated view (``Tensor.is_neg()``,
                which the signature does not show); ``out`` / ``lse`` have the
                wrong shape, dtype, device or last-axis stride, require grad while grad mode is on, or overlap an
                input or each other. All before any kernel runs.
        """
        f = self._fast
        if f is not None:
            o = self._run_fast(f, q, k_cache, v_cache, seq_lens, block_table, out, lse)
            if o is not None:
                return o
        if self._snap is None:
            capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
            raise PlanNotReadyError(
                "DecodeWrapper.run() called before plan()" + (
                    " during CUDA graph capture: call plan(..., capacity=True) before capturing" if capturing else ""))
        # -- argument checks: O(1) host work, no allocation, no sync (this runs under CUDA-graph capture) --
        sig, ptrs = self._signature_ptrs(q, k_cache, v_cache, seq_lens, block_table)
        return self._run(sig, ptrs, q, k_cache, v_cache, seq_lens, block_table, out, lse, False)

    def try_run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                lse: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`run` where the inputs are exactly what :meth:`plan` saw, else ``None`` (nothing launched, nothing
        raised): for a caller that re-plans on any change instead of comparing the inputs itself first (a model's
        layers calling one wrapper, whose cache grows a token per step). Same arguments as :meth:`run`; after a
        ``None``, ``plan()`` then ``run()`` give the result (or ``run()``'s error).

        It answers ``None`` also where :meth:`run` would take its full path for these inputs (and launch or raise
        there): a plan with sinks or fp8 scales (float scales too: they are kept as tensors), where it always
        answers ``None`` (a caller that re-plans on ``None`` re-plans every call: use :meth:`run` there); a backend
        that cannot run under the capture in progress (:meth:`run` raises ``PlanNotReadyError``). Strided ``out``
        and ``lse`` that :meth:`run` accepts are served; the wrapper's own buffer changed in place since (a view op
        on the tensor an earlier call returned) answers ``None``.

        Args:
            q, k_cache, v_cache, seq_lens, block_table, out, lse: as :meth:`run` (``out``: ``[batch, q_len,
                num_q_heads, head_dim]`` in q's dtype or ``None``; ``lse``: fp32 ``[batch, q_len, num_q_heads]``).
        Returns:
            ``out`` (the wrapper's own buffer when ``out`` is ``None``) once the kernels are launched, else ``None``.
        Raises:
            nothing of its own: a launch error from the backend or the driver propagates, as from :meth:`run`."""
        f = self._fast
        if f is None:
            return None
        return self._run_fast(f, q, k_cache, v_cache, seq_lens, block_table, out, lse)

    def _run_fast(self, f: tuple, q, k_cache, v_cache, seq_lens, block_table, out, lse) -> torch.Tensor | None:
        """:meth:`run`'s one-pass check against ``f`` (:meth:`_make_fast`) and launch: ``out`` (or the wrapper's
        buffer) when every check passed and the kernels were launched, else ``None`` (the full path decides)."""
        # -- the one-pass check: every field the full path checks, read once and compared with the planned value
        # (dtypes are singletons: identity); any difference, non-tensor or overlap leaves for run()'s full path,
        # which raises its own error (or, where this test is stricter, decides). No tuple is built but the pointers
        # handed to the launch.
        # A stride of None: the planned tensor is C-contiguous, and so must this one be (Tensor.is_contiguous(),
        # cheaper than reading the strides; same_signature() is the full path's equal rule).
        (qs, qst, qd, qv, qa, ks, kst, kd, kv, ka, vs, vst, vd, vv, va, ss, sst, sd, sv, sa, bs, bst, bd, bv, ba,
         e0, e1, e2, e3, e4, d0, d1, d2, d3, isz, nbytes, ls3, graph_safe, launcher, launch) = f
        T = torch.Tensor
        if isinstance(q, T) and isinstance(k_cache, T) and isinstance(v_cache, T) and isinstance(seq_lens, T) \
                and (isinstance(block_table, T) if bs is not None else block_table is None):
            ok = False
            try:
                p0, p1, p2, p3 = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_lens.data_ptr()
                p4 = block_table.data_ptr() if bs is not None else 0
                o = self._out if out is None else out
                # a pointer of 0 (a wrapper subclass without memory, or no elements): the full path decides
                if p0 and p1 and p2 and p3 and (p4 or bs is None) \
                        and q.shape == qs and (q.is_contiguous() if qst is None else q.stride() == qst) \
                        and q.dtype is qd and q.device == qv and (not p0 & 15) is qa \
                        and k_cache.shape == ks \
                        and (k_cache.is_contiguous() if kst is None else k_cache.stride() == kst) \
                        and k_cache.dtype is kd and k_cache.device == kv and (not p1 & 15) is ka \
                        and v_cache.shape == vs \
                        and (v_cache.is_contiguous() if vst is None else v_cache.stride() == vst) \
                        and v_cache.dtype is vd and v_cache.device == vv and (not p2 & 15) is va \
                        and seq_lens.shape == ss \
                        and (seq_lens.is_contiguous() if sst is None else seq_lens.stride() == sst) \
                        and seq_lens.dtype is sd and seq_lens.device == sv and (not p3 & 15) is sa \
                        and (bs is None or (block_table.shape == bs
                                            and (block_table.is_contiguous() if bst is None
                                                 else block_table.stride() == bst)
                                            and block_table.dtype is bd and block_table.device == bv
                                            and (not p4 & 15) is ba and not block_table.is_neg())) \
                        and not (q.is_neg() or k_cache.is_neg() or v_cache.is_neg() or seq_lens.is_neg()) \
                        and (out is None or (isinstance(out, T) and not out.is_neg())) \
                        and o.shape == qs and o.dtype is qd and o.device == qv and not o.requires_grad \
                        and (lse is None or (isinstance(lse, T) and lse.dtype is _F32 and lse.shape == ls3
                                             and lse.device == qv and not lse.is_neg() and not lse.requires_grad)):
                    a0 = o.data_ptr()
                    if o.is_contiguous():  # its bytes: exactly its numel's (its last stride 1 where it matters)
                        a1 = a0 + nbytes
                        ok = True
                    else:
                        s = o.stride()
                        a1 = a0 + (d0 * s[0] + d1 * s[1] + d2 * s[2] + d3 * s[3] + 1) * isz
                        m = self._out_strides_ok  # the last strided out found free of self-overlap, for this shape
                        # (the own buffer too: the caller holds it, and an in-place view op changes its strides)
                        ok = (qs[3] <= 1 or s[3] == 1) and ((m is not None and m[0] is qs and m[1] == s)
                                                            or self._no_self_overlap(qs, s))
                    ok = ok and a0 != 0 \
                        and not (e0 and a0 < p0 + e0 and p0 < a1) and not (e1 and a0 < p1 + e1 and p1 < a1) \
                        and not (e2 and a0 < p2 + e2 and p2 < a1) and not (e3 and a0 < p3 + e3 and p3 < a1) \
                        and not (e4 and a0 < p4 + e4 and p4 < a1)
                    if ok and lse is not None:
                        t = lse.stride()
                        c0 = lse.data_ptr()
                        c1 = c0 + (d0 * t[0] + d1 * t[1] + d2 * t[2] + 1) * 4
                        ok = c0 != 0 and (qs[2] <= 1 or t[2] == 1) and not (a0 < c1 and c0 < a1) \
                            and (lse.is_contiguous() or not has_internal_overlap(ls3, t)) \
                            and not (e0 and c0 < p0 + e0 and p0 < c1) and not (e1 and c0 < p1 + e1 and p1 < c1) \
                            and not (e2 and c0 < p2 + e2 and p2 < c1) and not (e3 and c0 < p3 + e3 and p3 < c1) \
                            and not (e4 and c0 < p4 + e4 and p4 < c1)
            except RuntimeError:  # no data pointer (sparse) or no one shape (nested): the full path names it
                return None
            if ok and (graph_safe or not q.is_cuda or not torch.cuda.is_current_stream_capturing()):
                if launcher is not None:
                    launcher(q, k_cache, v_cache, seq_lens, block_table, o, lse, (p0, p1, p2, p3, p4))
                else:
                    be, plan, ws, sm, var = launch
                    be.run(plan, DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, sm, **var), ws, o, lse)
                return o
        return None

    def _run(self, sig, ptrs, q, k_cache, v_cache, seq_lens, block_table, out, lse, outputs_checked: bool):
        """:meth:`run` after the signature; ``outputs_checked``: the caller (:func:`decode`) has just run
        :func:`validate_outputs` on these ``q``, ``out`` and ``lse``. Everything it reads of the plan comes from
        one snapshot of the last complete ``plan()`` (:meth:`_snapshot`)."""
        snap = self._snap
        if snap is None:
            raise PlanNotReadyError("DecodeWrapper.run() called before plan() (or after a plan() that raised)")
        psig, extents, q_terms, sm, var, backend, plan, workspace, launcher = snap
        if sig is not psig and not same_signature(psig, sig):  # equal, or equal but length-one strides
            raise ValueError(f"run() inputs differ from the planned ones: {signature_change(psig, sig)}; "
                             "call plan() again")
        if _any_lazy(q, k_cache, v_cache, seq_lens, block_table):  # a view the signature does not tell apart
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens),
                            ("block_table", block_table)):
                if t is not None:
                    check_not_lazy(name, t)
        own = out is None
        if own:  # the wrapper's own buffer, made by plan() for q's planned shape, dtype and device
            out = self._out  # not in the snapshot: decode() hands each call's own buffer through it
            if not outputs_checked and not _outputs_fit(psig[0], out, lse):
                self._check_outputs(psig, q, None, lse)
                try:  # run() handed it out: an in-place view op there (transpose_, set_, resize_) changes it here
                    validate_outputs(q, out, None)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"the wrapper's own output buffer (returned by an earlier run()) was changed in "
                                  f"place: {e}; plan() again makes a new one, or pass out=") from None
        elif not outputs_checked:
            self._check_outputs(psig, q, out, lse)
        if type(sm) is not float or sm - sm != 0.0:  # not a finite float: the full check decides (and raises)
            check_sm_scale(sm)
        sinks, k_scale, v_scale = var["sinks"], var["k_scale"], var["v_scale"]
        if sinks is not None or k_scale is not None or v_scale is not None:
            check_variant_tensors(q, sinks, k_scale, v_scale, psig[1][1][2])
        try:
            self._check_overlap(extents, q_terms, out, lse, ptrs, sinks, k_scale, v_scale)
        except OverlapError as e:
            if not own:
                raise
            # plan() makes a new buffer where the kept one is q's memory; against another input it keeps it
            raise OverlapError(f"{e} (out here is the wrapper's own buffer, which holds the last run()'s result: "
                               + ("plan() with these inputs makes a new one, or "
                                  if (e.output, e.other) == ("out", "q") else "") + "pass out=)",
                               e.output, e.other) from None
        if not backend.graph_safe and q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise PlanNotReadyError(f"backend {backend.name} cannot run under CUDA-graph capture; plan with "
                                    "capacity=True before capturing (it picks a graph-safe backend)")
        # -- end of argument checks --
        if launcher is not None:
            launcher(q, k_cache, v_cache, seq_lens, block_table, out, lse, ptrs)
        else:
            inputs = DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, sm, **var)
            backend.run(plan, inputs, workspace, out, lse)
        return out

    @staticmethod
    def _check_outputs(psig, q, out, lse) -> None:
        """:func:`validate_outputs` (the same errors): q matches the planned signature ``psig`` here, so what it
        compares ``out`` and ``lse`` with is read from that signature; any difference goes to the full check."""
        if not _outputs_fit(psig[0], out, lse):
            validate_outputs(q, out, lse)

    @staticmethod
    def _check_overlap(extents, q_terms, out, lse, ptrs, sinks, k_scale, v_scale) -> None:
        """:func:`attnplan.problem.check_no_overlap` for ``run()``'s tensors, with the same order and errors, from
        the data pointers and the planned inputs' byte extents (``extents``; ``q_terms``: q's last indices and
        element size; every tensor is on q's device here: the signature and the output checks said so; a tensor's
        bytes lie within its storage's, so comparing the tensors' ranges alone decides the same)."""
        (d0, d1, d2, d3), isz = q_terms
        s = out.stride()
        a0 = out.data_ptr()
        if not a0:
            check_addressable(out, "out")
        a1 = a0 + (d0 * s[0] + d1 * s[1] + d2 * s[2] + d3 * s[3] + 1) * isz
        c0 = c1 = 0
        if lse is not None:
            s = lse.stride()
            c0 = lse.data_ptr()
            if not c0:
                check_addressable(lse, "lse")
            c1 = c0 + (d0 * s[0] + d1 * s[1] + d2 * s[2] + 1) * 4
            if a0 < c1 and c0 < a1:
                raise overlap_error("out", a0, a1, "lse", c0, c1)
        if sinks is None and k_scale is None and v_scale is None:
            # the tests of the loops below, written out (no list built): nothing overlaps, the common case, returns
            e0, e1, e2, e3, e4 = extents
            p0, p1, p2, p3, p4 = ptrs
            if not ((e0 and a0 < p0 + e0 and p0 < a1) or (e1 and a0 < p1 + e1 and p1 < a1)
                    or (e2 and a0 < p2 + e2 and p2 < a1) or (e3 and a0 < p3 + e3 and p3 < a1)
                    or (e4 and a0 < p4 + e4 and p4 < a1)) \
                    and (lse is None or not ((e0 and c0 < p0 + e0 and p0 < c1) or (e1 and c0 < p1 + e1 and p1 < c1)
                                             or (e2 and c0 < p2 + e2 and p2 < c1) or (e3 and c0 < p3 + e3 and p3 < c1)
                                             or (e4 and c0 < p4 + e4 and p4 < c1))):
                return
        ins = [(n, p, p + e) for n, p, e in zip(_INPUTS, ptrs, extents) if e]
        if sinks is not None or k_scale is not None or v_scale is not None:
            for n, t in (("sinks", sinks), ("k_scale", k_scale), ("v_scale", v_scale)):
                if t is not None and t.numel():
                    p = t.data_ptr()
                    ins.append((n, p, p + _extent(t.shape, t.stride(), t.element_size())))
        for n, b0, b1 in ins:
            if a0 < b1 and b0 < a1:
                raise overlap_error("out", a0, a1, n, b0, b1)
        if lse is not None:
            for n, b0, b1 in ins:
                if c0 < b1 and b0 < c1:
                    raise overlap_error("lse", c0, c1, n, b0, b1)

    def explain(self, seq_lens=None) -> str:
        """The plan's :meth:`SplitPlan.explain` at ``seq_lens`` (``batch`` ints in ``[0, capacity]``, the capacity
        of the cache ``plan()`` saw: a list, tuple, numpy array or tensor; default: the ``seq_lens_host`` given to
        ``plan()``, else the planned lengths), plus the dispatch order where the config's per-architecture or fp8
        lists changed it (:func:`dispatch_order`) and why earlier backends were skipped.

        Raises:
            TypeError, ValueError: ``seq_lens`` is not ``batch`` ints in ``[0, capacity]``
                (:func:`attnplan.problem.explain_lengths`).
        """
        if self.plan_ is None:
            return "no plan yet"
        lens = self._lens_host if seq_lens is None else \
            explain_lengths(seq_lens, self.plan_.problem.batch, self._static["capacity"])
        text = self.plan_.explain(lens)
        if self.forced_backend is None:
            c, arch = self.ctx.config, self.plan_.device.arch
            fp8 = torch_dtype(self.plan_.problem.kv_dtype).itemsize == 1
            order = dispatch_order(c, fp8, arch)
            if order != list(c.backends):
                why = [w for w, on in (("backends_fp8_kv", fp8 and c.backends_fp8_kv),
                                       (f"backends_by_arch.{arch}", (c.backends_by_arch or {}).get(arch))) if on]
                text += f"\ndispatch order {', '.join(order)} ({' and '.join(why)} first)"
        return text + "".join(f"\nskipped {n}: " + "; ".join(r) for n, r in self.skipped)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor | None = None, *, sm_scale: float | None = None,
           out: torch.Tensor | None = None, lse: torch.Tensor | None = None, backend: str | None = None,
           num_splits: int | None = None, config: Config | Context | str | None = None, window_left: int = -1,
           logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
           k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
           seq_lens_host=None) -> torch.Tensor:
    """Split-KV decode attention in one call (plan through the cache, then run).

    The context keeps the :class:`DecodeWrapper` s of earlier calls (at most :data:`DECODE_WRAPPERS`, keyed by the
    inputs' signature and ``backend``; :meth:`Context.release_wrappers` frees them and their workspaces), so a
    repeated call with the same shapes is a plan-cache hit and a run. A ``config`` given as a :class:`Config` or a
    path makes a new context (and so a new plan cache) on every call; pass a :class:`Context` to reuse one.

    Args:
        q: ``[batch, q_len, num_q_heads, head_dim]`` fp16 / bf16 / fp32.
        k_cache, v_cache: contiguous ``[batch, max_kv_len, num_kv_heads, head_dim]``, or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]`` with ``block_table``; q's dtype.
        seq_lens: ``[batch]`` int32, valid KV tokens per sequence (0 allowed).
        block_table: ``[batch, max_pages_per_seq]`` int32 for a paged cache, else ``None``.
        sm_scale: score scale, default ``1/sqrt(head_dim)``.
        out: optional output buffer (q's shape and dtype); ``None``: a new tensor.
        lse: optional ``[batch, q_len, num_q_heads]`` fp32 buffer for the natural-log LSE
            (``-inf`` for rows with no visible KV position).
        backend: force a backend by name; ``None`` follows the config's order.
        num_splits: 0 = heuristic, 1 = no split, >1 = forced; ``None`` = config.
        config: Config, YAML path, Context or ``None`` (default context).
        window_left, logits_soft_cap, sinks, k_scale, v_scale: attention variants, see
            :meth:`DecodeWrapper.plan` (fp8 caches: ``k_cache.dtype == torch.float8_e4m3fn``).
        seq_lens_host: ``seq_lens`` as host ints when known: then nothing is read from the device and the call
            never synchronizes the host (beyond a new kernel specialization's one-time compile and load); the
            caller vouches for the lengths and for the block table's entries, which are not checked (the kernels
            clamp every page index into
            ``[0, num_pages)``: a bad entry reads a wrong page, never outside the cache); see
            :meth:`DecodeWrapper.plan`. Without it the call synchronizes the host once, reading ``seq_lens``
            (and the block table) to check them.
    Returns:
        ``out`` in q's dtype. Query ``i`` of a sequence of length ``L`` attends to KV positions
        ``< L - q_len + i + 1``; a row with none gets zeros.
    Raises:
        TypeError, ValueError: bad inputs, before any kernel runs (among them: an input, ``out`` or ``lse`` that
            requires grad while grad mode is on, since attnplan computes no gradients; a tensor without memory of its
            own, such as a ``DTensor``; a ``backend`` that names no backend; a ``config`` of another type).
        NoBackendError: no backend fits.
        ConfigError: ``config`` (or, with ``None``, ``$ATTNPLAN_CONFIG``) is a path to a file that does not load.
        PlanNotReadyError: under CUDA-graph capture, a backend that cannot be captured (:meth:`DecodeWrapper.run`).
    """
    # -- argument checks (the inputs' own: DecodeWrapper.plan; out / lse overlap: DecodeWrapper.run) --
    check_sm_scale(sm_scale)
    if backend is not None:
        check_backend_name(backend)
    try:
        sig, ptrs = DecodeWrapper._signature_ptrs(q, k_cache, v_cache, seq_lens, block_table)
    except TypeError:
        sig = ptrs = None  # plan() raises the precise error (after the output checks, as below)
    if sig is not None and len(sig[0][1]) == 4:  # q is a 4-D tensor: its signature has what out / lse must match
        if (out is not None or lse is not None) and not _outputs_fit(sig[0], out, lse):
            validate_outputs(q, out, lse)
    elif sig is None and isinstance(q, torch.Tensor) and q.dim() == 4:
        validate_outputs(q, out, lse)
    elif out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    # -- end of argument checks --
    ctx = _context(config)
    w = None
    if sig is not None:
        key = (sig, backend)
        h = hash(key)
        w = ctx._take_wrapper(h, key)
        if w is not None:
            # its key holds its own planned signature (see below), equal to this one: plan() and run() compare by
            # identity from here on
            sig = w._sig
    if w is None:
        w = DecodeWrapper(ctx, backend=backend)
    # the plan() this wrapper made last, when this call repeats everything it depended on (the layers of one step
    # call with the same shapes, scalars and lengths): the same signature (by identity: the pool's key compared it),
    # the scalars by type and value, host lengths of equal values that are all Python ints (their sum an int: what
    # host_lengths accepts), no sink or scale tensors (their values are checked per tensor version), inputs that are
    # not lazily negated views, and a plan cache that is on (a cache that is off rebuilds at every plan())
    scalars = rep = None
    lt = type(seq_lens_host)
    if (lt is list or lt is tuple) and sig is not None and sinks is None and not isinstance(k_scale, torch.Tensor) \
            and not isinstance(v_scale, torch.Tensor):
        scalars = (type(window_left), window_left, type(logits_soft_cap), logits_soft_cap, type(sm_scale), sm_scale,
                   type(k_scale), k_scale, type(v_scale), v_scale, type(num_splits), num_splits)
        rep = w._repeat
        try:
            if not (rep and rep[0] is sig and rep[3] is w.plan_ and rep[4] == _TABLES[0] and rep[1] == scalars
                    and rep[2] == (seq_lens_host if lt is tuple else tuple(seq_lens_host))
                    and type(sum(seq_lens_host)) is int and ctx.config.plan_cache.enabled
                    and not _any_lazy(q, k_cache, v_cache, seq_lens, block_table)):
                rep = None
        except Exception:  # lengths or scalars that do not compare: plan() decides (and raises its own error)
            rep = None
    w._out = out  # the caller's buffer (plan() then allocates none), or None: plan() allocates a new one
    try:
        if rep is None:
            w._plan(sig, q, k_cache, v_cache, seq_lens, block_table, sm_scale, num_splits, False, window_left,
                    logits_soft_cap, sinks, k_scale, v_scale, seq_lens_host)
            sig = w._sig
            if scalars is not None:
                w._repeat = (sig, scalars, tuple(seq_lens_host), w.plan_, _TABLES[0])
        else:
            check_no_grad(q, k_cache, v_cache)  # the one check of plan() that depends on more than the repeated key
            ctx.cache.stats.hits += 1  # served by the plan its cache gave for these inputs: counted as the hit it is
            if out is None:
                w._out = torch.empty_like(q)
        # plan() validated the signature's tensors and this function out / lse: run() goes straight to its checks
        res = w._run(sig, ptrs, q, k_cache, v_cache, seq_lens, block_table, out, lse, True)
    finally:
        w._out = None  # the result belongs to the caller: the next call must not write it
    if sig is not None:
        ctx._give_wrapper(h, (w._sig, backend), w)  # w._sig == sig (plan() made it so); kept by identity
    return res
