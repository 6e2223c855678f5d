"""Public API: dispatch, :func:`decode` (one call) and :class:`DecodeWrapper` (plan once, run many).

``plan()`` does all host work (validation that reads ``seq_lens``/``block_table``, backend
choice, planning through the plan cache, workspace allocation); ``run()`` checks shapes, dtypes
and devices against the plan and launches, with no allocation and no host sync, so it can be
captured in a CUDA graph (FlashInfer's plan/run split, STYLE.md habit 6).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from .backends import Backend, DecodeInputs, Workspace, get_backend
from .cache import PlanCache
from .config import Config, device_table, load_config
from .device import DeviceInfo, device_info
from .planner import SplitPlan, entry_options, make_plan
from .problem import DecodeProblem, default_sm_scale, torch_dtype, validate_inputs, validate_values

__all__ = ["decode", "DecodeWrapper", "select_backend", "NoBackendError", "PlanNotReadyError", "Context",
           "default_context", "plan_problem"]


class NoBackendError(RuntimeError):
    """No configured backend is available and supports the problem; the message lists each reason."""


class PlanNotReadyError(RuntimeError):
    """``run()`` was called without a plan (for CUDA graphs: call ``plan()`` before capture)."""


@dataclass
class Context:
    """A configuration with its plan cache. :func:`default_context` serves calls that pass no config."""

    config: Config
    cache: PlanCache

    @staticmethod
    def from_config(config: Config) -> "Context":
        pc = config.plan_cache
        return Context(config, PlanCache(pc.dir, disk=pc.enabled and pc.disk, memory_entries=pc.memory_entries))

    def planning_fingerprint(self, backend: str) -> str:
        """The config's planning inputs for ``backend`` (part of the plan-cache key)."""
        fp = self.__dict__.setdefault("_fp", {})
        if backend not in fp:
            c = self.config
            fp[backend] = json.dumps([c.split.model_dump(), c.cost_model.model_dump(),
                                      c.options(backend).model_dump(), c.deterministic], sort_keys=True)
        return fp[backend]


_DEFAULT: Context | None = None


def default_context() -> Context:
    """The process-wide context built from ``plans/default.yaml`` and ``$ATTNPLAN_CONFIG``."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Context.from_config(load_config())
    return _DEFAULT


def _context(config: Config | Context | str | None) -> Context:
    if config is None:
        return default_context()
    if isinstance(config, Context):
        return config
    if isinstance(config, Config):
        return Context.from_config(config)
    return Context.from_config(load_config(config))


def dispatch_order(config: Config, fp8_kv: bool) -> list[str]:
    """The backends to try, in order: ``config.backends``; for a 1-byte (fp8) KV cache the
    backends listed in ``config.backends_fp8_kv`` come first, in that list's order. Only backends
    in ``config.backends`` are ever used: a user's ``backends: [triton, reference]`` keeps fp8
    caches off cuda_ptx even though the default ``backends_fp8_kv`` names it first."""
    order = list(config.backends)
    if not fp8_kv or not config.backends_fp8_kv:
        return order
    first = [b for b in config.backends_fp8_kv if b in order]
    return first + [b for b in order if b not in first]


def select_backend(problem: DecodeProblem, device: torch.device, config: Config,
                   backend: str | None = None, graph: bool = False) -> tuple[Backend, list[tuple[str, list[str]]]]:
    """First backend of the config's order (or only ``backend`` when forced) that is available on
    ``device`` and supports ``problem``, in :func:`dispatch_order`. ``graph``: the plan is for CUDA-graph capture
    (a capacity plan on a CUDA device), so a backend that cannot run under capture (``graph_safe = False``) is
    skipped with that reason.

    Returns:
        ``(backend, skipped)`` where ``skipped`` lists ``(name, reasons)`` of each earlier backend.
    Raises:
        NoBackendError: none fits; the message gives the problem and every backend's reasons.
        ValueError: ``backend`` is not a known backend name.
    """
    order = [backend] if backend else dispatch_order(config, torch_dtype(problem.kv_dtype).itemsize == 1)
    skipped: list[tuple[str, list[str]]] = []
    for name in order:
        be = get_backend(name)
        ok, why = be.available(device)
        if not ok:
            skipped.append((name, [why]))
            continue
        reasons = be.supports(problem)
        if graph and not be.graph_safe:
            reasons = [*reasons, "not graph-safe: it cannot run under CUDA-graph capture (a capacity plan)"]
        if reasons:
            skipped.append((name, reasons))
            continue
        return be, skipped
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
    per_backend = table.get("kernel_options", {}).get(backend, {})
    layout = "paged" if paged else "contiguous"
    if fp8 and f"{layout}_fp8" in per_backend:
        opts = dict(per_backend[f"{layout}_fp8"])
    else:
        opts = dict(per_backend.get(f"{layout}_filled") if filled and f"{layout}_filled" in per_backend
                    else per_backend.get(layout, {}))
        if fp8 and opts.get("block_n"):
            # tables measured with a 2-byte cache: a 1-byte cache keeps a tile's bytes (and so the
            # bytes in flight per program) by doubling its tokens
            opts["block_n"] = 2 * int(opts["block_n"])
    return (tuple(opts.items()) if tuned_head else ()), _table_text(slug)


@functools.lru_cache(maxsize=64)
def _device_key(dev_info: DeviceInfo) -> str:
    """The device part of the plan-cache key (computed once per device)."""
    return repr(sorted(dev_info.fingerprint().items()))


@functools.lru_cache(maxsize=None)
def _table_text(slug: str) -> str:
    """The device table as canonical text, part of the plan-cache key (computed once: a cache hit must stay cheap)."""
    return json.dumps(device_table(slug), sort_keys=True, default=str)


def plan_problem(problem: DecodeProblem, backend: Backend, device: torch.device, ctx: Context, *,
                 capacity_mode: bool = False, num_splits: int | None = None, dev_info: DeviceInfo | None = None) -> SplitPlan:
    """Plan ``problem`` for ``backend`` through ``ctx``'s plan cache (bucketed lengths).

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
    dev_info = dev_info or device_info(device)
    # the key is built from the live problem's bucket (the same as the bucketed problem's); the bucketed problem
    # itself is made only on a miss: a cache hit must cost microseconds
    table_text = _table_text(dev_info.slug()) if dev_info.compute_capability != (0, 0) else ""
    extra = backend.plan_key_extra() if hasattr(backend, "plan_key_extra") else ""
    key = (_device_key(dev_info), backend.name, problem.bucket_key(), problem.capacity, capacity_mode,
           -1 if num_splits is None else num_splits, ctx.planning_fingerprint(backend.name), table_text, extra)

    def build() -> SplitPlan:
        bucketed = problem.bucketed()
        invariant = ctx.config.split.batch_invariant
        tuned, _ = _tuned_options(dev_info, backend.name, bucketed, batch_free=invariant)
        user = {k: v for k, v in ctx.config.options(backend.name).model_dump().items() if v is not None}
        # the config's choice wins over the table's values of options that name the same thing
        tuned = {k: v for k, v in tuned.items()
                 if not any(k in group and group & user.keys() for group in backend.option_aliases)}

        def plan_with(opts: dict) -> SplitPlan:
            kernel = backend.kernel_config(bucketed, opts, device)
            return make_plan(bucketed, dev_info, ctx.config, backend.name, kernel,
                             capacity_mode=capacity_mode, num_splits=num_splits,
                             merge_strategies=backend.merge_strategies,
                             fused_merge_parallelism=backend.fused_merge_parallelism,
                             fused_merge_max_chunk=backend.fused_merge_max_chunk)

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
    return ctx.cache.get_or_create(key, build, validate=lambda p: p.validate(problem))


def _scale_tensor(scale, hkv: int, device) -> torch.Tensor | None:
    """A per-tensor float scale becomes a ``[num_kv_heads]`` fp32 tensor once, at plan time."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((hkv,), float(scale), dtype=torch.float32, device=device)


class DecodeWrapper:
    """Plan once per step (or once for a CUDA graph), run allocation-free.

    Args:
        config: a :class:`~attnplan.config.Config`, a YAML path, a :class:`Context`, or ``None``
            for the default context (``plans/default.yaml`` + ``$ATTNPLAN_CONFIG``).
        backend: force one backend by name (its refusal reasons become the error); ``None``
            walks the config's order.

    Example::

        w = attnplan.DecodeWrapper()
        w.plan(q, k_cache, v_cache, seq_lens, block_table)        # host work, may sync
        out = w.run(q, k_cache, v_cache, seq_lens, block_table)   # launches only
    """

    def __init__(self, config: Config | Context | str | None = None, *, backend: str | None = None):
        self.ctx = _context(config)
        self.forced_backend = backend
        self.plan_: SplitPlan | None = None
        self.backend: Backend | None = None
        self.skipped: list[tuple[str, list[str]]] = []
        self.workspace: Workspace | None = None
        self._out: torch.Tensor | None = None
        self._lens_host: list[int] | None = None
        self._sig: tuple | None = None
        self._sm_scale = 0.0

    @staticmethod
    def _signature(q, k_cache, v_cache, seq_lens, block_table) -> tuple:
        """What ``run()`` must find as ``plan()`` saw it: shape, strides, dtype, device and 16-byte
        alignment of the data pointer of q, k_cache, v_cache, seq_lens and block_table (O(1), no
        allocation, no sync). Raises ``TypeError`` naming an argument that is not a tensor."""
        from .problem import tensor_signature as sig

        return (sig("q", q), sig("k_cache", k_cache), sig("v_cache", v_cache), sig("seq_lens", seq_lens),
                sig("block_table", block_table))

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor | None = None, *, sm_scale: float | None = None,
             num_splits: int | None = None, capacity: bool = False, window_left: int = -1,
             logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
             k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
             seq_lens_host=None) -> SplitPlan:
        """Validate the inputs, choose a backend, plan (through the cache) and size the workspace.

        Args:
            q, k_cache, v_cache, seq_lens, block_table: see :mod:`attnplan.problem`.
            sm_scale: score scale, default ``1/sqrt(head_dim)``.
            num_splits: 0 = heuristic, 1 = no split, >1 = forced (FlashAttention's convention);
                ``None`` takes the config's ``split.num_splits``.
            capacity: plan for the cache's capacity (every length up to it) instead of the live
                lengths: the plan to capture in a CUDA graph.
            window_left: sliding window in tokens (query at position ``p`` sees ``[p - window_left, p]``),
                ``-1`` = none; the plan covers only the window.
            logits_soft_cap: ``cap * tanh(score / cap)`` on the scaled scores, ``0`` = off.
            sinks: ``[num_q_heads]`` fp32 sink logits (gpt-oss), kept by reference for ``run()``.
            k_scale, v_scale: dequantization scales of a ``float8_e4m3fn`` cache: floats (per
                tensor) or fp32 ``[num_kv_heads]`` tensors (kept by reference).
            seq_lens_host: ``seq_lens`` as host integers (a list of ``batch`` ints), when the caller
                has them: planning then reads nothing back from the GPU (no sync) unless a block
                table is given. The caller vouches that they equal ``seq_lens``.
        Returns:
            the :class:`SplitPlan` (also kept as ``self.plan_``).
        Raises:
            TypeError, ValueError: bad inputs (named argument, value and expectation), before any kernel.
            NoBackendError: no backend fits.
        """
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or not 0 <= num_splits <= 1024):
            raise ValueError(f"num_splits must be an int in [0, 1024] (0 = planner, 1 = no split, >1 = forced) "
                             f"or None (the config's split.num_splits), got {num_splits!r}")
        static = validate_inputs(q, k_cache, v_cache, seq_lens, block_table, window_left=window_left,
                                 soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                 sm_scale=sm_scale)
        num_pages = int(k_cache.shape[0]) if block_table is not None else 0
        max_len, total = validate_values(static, seq_lens, block_table, num_pages, seq_lens_host)
        if capacity:
            max_len, total = static["capacity"], static["capacity"] * static["batch"]
        problem = DecodeProblem(max_kv_len=max_len, total_kv_len=total, **static)
        graph = capacity and q.is_cuda
        self.backend, self.skipped = select_backend(problem, q.device, self.ctx.config, self.forced_backend, graph)
        plan = plan_problem(problem, self.backend, q.device, self.ctx, capacity_mode=capacity, num_splits=num_splits)
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:  # compile / load kernels now, never inside a CUDA-graph capture
            prepare(plan, q.device)
        if self.workspace is None or not self.workspace.serves(plan, q.device):
            self.workspace = Workspace.allocate(plan, q.device)
        self._lens_host = None if seq_lens_host is None else [int(x) for x in seq_lens_host]
        if self._out is None or self._out.shape != q.shape or self._out.dtype != q.dtype or self._out.device != q.device:
            self._out = torch.empty_like(q)
        self._sig = self._signature(q, k_cache, v_cache, seq_lens, block_table)
        self._sm_scale = float(default_sm_scale(static["head_dim"]) if sm_scale is None else sm_scale)
        hkv = static["num_kv_heads"]
        self._variant = dict(window_left=static["window_left"], soft_cap=static["soft_cap"], sinks=sinks,
                             k_scale=_scale_tensor(k_scale, hkv, q.device), v_scale=_scale_tensor(v_scale, hkv, q.device))
        self.plan_ = plan
        return plan

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the planned kernels on the current stream: no allocation, no host sync.

        Args:
            out: ``[batch, q_len, num_q_heads, head_dim]`` in q's dtype; ``None`` writes the
                wrapper's own buffer (valid until the next ``run``).
            lse: optional ``[batch, q_len, num_q_heads]`` fp32 to receive the natural-log LSE.
        Returns:
            ``out``.
        Raises:
            PlanNotReadyError: no ``plan()`` was made (under capture: plan before capturing).
            TypeError: an argument is not a tensor.
            ValueError: the shape, strides, dtype, device or 16-byte alignment of q, k_cache, v_cache,
                seq_lens or block_table differ from the planned ones (named); ``out`` / ``lse`` have the
                wrong shape, dtype, device or last-axis stride, or overlap an input or each other; the
                planned ``sm_scale`` is not finite. All before any kernel runs.
        """
        if self.plan_ is None:
            capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
            raise PlanNotReadyError(
                "DecodeWrapper.run() called before plan()" + (
                    " during CUDA graph capture: call plan(..., capacity=True) before capturing" if capturing else ""))
        # -- argument checks: O(1) host work, no allocation, no sync (this runs under CUDA-graph capture) --
        from .problem import check_no_overlap, check_sm_scale, check_variant_tensors, signature_change, validate_outputs

        sig = self._signature(q, k_cache, v_cache, seq_lens, block_table)
        if sig != self._sig:
            raise ValueError(f"run() inputs differ from the planned ones: {signature_change(self._sig, sig)}; "
                             "call plan() again")
        if out is None:  # the wrapper's own buffer, made by plan() for q's planned shape, dtype and device
            out = self._out
            validate_outputs(q, None, lse)
        else:
            validate_outputs(q, out, lse)
        check_sm_scale(self._sm_scale)
        var = self._variant
        check_variant_tensors(q, var["sinks"], var["k_scale"], var["v_scale"])
        check_no_overlap((("out", out), ("lse", lse)),
                         (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens),
                          ("block_table", block_table), ("sinks", var["sinks"]), ("k_scale", var["k_scale"]),
                          ("v_scale", var["v_scale"])))
        if not self.backend.graph_safe and q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise PlanNotReadyError(f"backend {self.backend.name} cannot run under CUDA-graph capture; plan with "
                                    "capacity=True before capturing (it picks a graph-safe backend)")
        # -- end of argument checks --
        inputs = DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, self._sm_scale, **self._variant)
        self.backend.run(self.plan_, inputs, self.workspace, out, lse)
        return out

    def explain(self, seq_lens=None) -> str:
        """The plan's :meth:`SplitPlan.explain` at ``seq_lens`` (host ints; default: the ``seq_lens_host`` given to
        ``plan()``, else the planned lengths), plus why earlier backends were skipped."""
        if self.plan_ is None:
            return "no plan yet"
        lens = self._lens_host if seq_lens is None else seq_lens
        skipped = "".join(f"\nskipped {n}: " + "; ".join(r) for n, r in self.skipped)
        return self.plan_.explain(lens) + skipped


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor | None = None, *, sm_scale: float | None = None,
           out: torch.Tensor | None = None, lse: torch.Tensor | None = None, backend: str | None = None,
           num_splits: int | None = None, config: Config | Context | str | None = None, window_left: int = -1,
           logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
           k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
           seq_lens_host=None) -> torch.Tensor:
    """Split-KV decode attention in one call (plan through the cache, then run).

    Args:
        q: ``[batch, q_len, num_q_heads, head_dim]`` fp16 / bf16 / fp32.
        k_cache, v_cache: contiguous ``[batch, max_kv_len, num_kv_heads, head_dim]``, or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]`` with ``block_table``; q's dtype.
        seq_lens: ``[batch]`` int32, valid KV tokens per sequence (0 allowed).
        block_table: ``[batch, max_pages_per_seq]`` int32 for a paged cache, else ``None``.
        sm_scale: score scale, default ``1/sqrt(head_dim)``.
        out: optional output buffer (q's shape and dtype).
        lse: optional ``[batch, q_len, num_q_heads]`` fp32 buffer for the natural-log LSE
            (``-inf`` for rows with no visible KV position).
        backend: force a backend by name; ``None`` follows the config's order.
        num_splits: 0 = heuristic, 1 = no split, >1 = forced; ``None`` = config.
        config: Config, YAML path, Context or ``None`` (default context).
        window_left, logits_soft_cap, sinks, k_scale, v_scale: attention variants, see
            :meth:`DecodeWrapper.plan` (fp8 caches: ``k_cache.dtype == torch.float8_e4m3fn``).
        seq_lens_host: ``seq_lens`` as host ints when known (no device read while planning), see
            :meth:`DecodeWrapper.plan`.
    Returns:
        ``out`` in q's dtype. Query ``i`` of a sequence of length ``L`` attends to KV positions
        ``< L - q_len + i + 1``; a row with none gets zeros.
    Raises:
        TypeError, ValueError: bad inputs, before any kernel runs. NoBackendError: no backend fits.
    """
    # -- argument checks (the inputs' own: DecodeWrapper.plan; out / lse overlap: DecodeWrapper.run) --
    from .problem import check_sm_scale, validate_outputs

    check_sm_scale(sm_scale)
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        validate_outputs(q, out, lse)
    elif out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    # -- end of argument checks --
    w = DecodeWrapper(config, backend=backend)
    if out is not None:
        w._out = out  # the caller's buffer: plan() then allocates no output of its own
    w.plan(q, k_cache, v_cache, seq_lens, block_table, sm_scale=sm_scale, num_splits=num_splits,
           window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
           seq_lens_host=seq_lens_host)
    return w.run(q, k_cache, v_cache, seq_lens, block_table, out=out, lse=lse)
