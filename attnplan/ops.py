"""``torch.ops.attnplan.decode``: the decode entry point as a ``torch.library`` custom op.

Registered with a fake (meta) implementation, so models calling it trace under
``torch.compile(fullgraph=True)`` without graph breaks, and capture in the CUDA graphs that torch
makes (``mode="reduce-overhead"``): the op keeps one capacity plan per input signature, made on
the first (eager, warm-up) call, so later calls neither plan nor sync the host, and a replay with other
lengths in ``seq_lens`` (up to the cache's capacity) is served by the same plan through the device-side schedule.
A call under CUDA-graph capture with no plan for its signature raises :class:`~attnplan.PlanNotReadyError`.

Device memory, by lifetime:

- per call, allocated through torch (``torch.empty``, so torch's CUDA-graph memory pools own them and a replay
  costs nothing for them): the ragged partial states ``[1, q_len, num_q_heads, max_units, head_dim]`` fp32 and the
  ``(first, units)`` table ``[2 * batch]`` int32 per launch of the separate merge, written by the partial kernel before
  they are read, and the output;
- per plan, constant: the schedule's ``targets`` table (int32 ``[NUM_TARGETS]`` of :mod:`attnplan.schedule`),
  copied to the device once, when the plan is made (a host-to-device copy under capture is illegal), and shared
  by every plan with the same table;
- per device and stream: the fused merge's completion counters (int32, ``SplitPlan.sync_words``: one per (sequence, KV
  head), then the two-level merge's teams'), zero at rest (the program that counts last resets each counter), as a
  hand-captured :class:`~attnplan.DecodeWrapper` keeps them, so no replay spends a memset on them. Calls on one stream
  run one after another, so they can share one buffer; calls on another stream get their own. A stream's buffer is made
  on its first call outside a capture; a capture on a stream that never ran the op (``torch.cuda.graph`` captures on
  its own stream unless given the warm-up stream) zeroes per-call counters instead, a memset node per call.
  torch.compile's CUDA-graph trees warm up and capture on one stream.

The call leaves no reference to its temporaries behind (a backend's launch cache entry for the call's workspace is
dropped), so they die with the call, as torch's graph pools expect.

Both kinds of long-lived tensors are allocated outside any CUDA-graph memory pool the calling thread is routed
to (torch.compile's CUDA-graph trees route their warm-up run's allocations to their private pool, where a tensor
kept beyond the run counts as a leak and its memory may be handed out again), and they are never freed, so a
captured graph never reads freed memory, even after its plan left the op's table (an LRU of
:data:`MAX_OP_PLANS` signatures).

The plan key is everything validation depends on: the shape, strides, dtype, device and 16-byte
alignment of ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and ``block_table``
(:meth:`DecodeWrapper._signature <attnplan.DecodeWrapper>`), the score scale (the one the kernels use: ``None``
keys as ``1/sqrt(head_dim)``) and the backend. A call
whose key is new is validated and planned (reading ``seq_lens`` and the block table, as ``plan()``
does); a call with a known key reuses the plan without reading any values, as
:meth:`attnplan.DecodeWrapper.run` does: the kernels clamp each length into ``[0, capacity]`` and each page index
into the cache, so a bad value gives attention over the clamped span, never a read outside the cache.

``sm_scale`` is ``float?``: ``None`` (the default) means ``1/sqrt(head_dim)``, and any other value is the scale as in
:func:`attnplan.decode`: 0, or a magnitude in ``[SM_SCALE_MIN, FP32_SCALED_MAX]``, negative ones included
(:func:`attnplan.problem.check_sm_scale`). (Until this schema a ``float`` whose ``<= 0`` values
meant the default, which made the scales 0 and below unreachable: a caller that passed ``0.0`` for the default
now passes ``None`` or leaves the argument out.)
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from .api import DecodeWrapper, PlanNotReadyError
from .backends.base import DecodeInputs, Workspace
from .problem import check_no_grad, default_sm_scale
from .state import PartialState

__all__ = ["decode_op", "clear_op_plans", "MAX_OP_PLANS"]

#: signatures whose plans the op keeps (least recently used first out); a model's layers share one
MAX_OP_PLANS = 256

_PLANS: OrderedDict[tuple, tuple] = OrderedDict()  # signature -> (backend, plan, sm_scale, targets on the device)
_TARGETS: dict[tuple, torch.Tensor] = {}  # (device, targets values) -> int32 tensor, never freed
_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, stream handle) -> zero-at-rest int32 tensor
_OUTGROWN: list[torch.Tensor] = []  # counters replaced by larger ones, kept: graphs captured with them read them
_LOCK = threading.Lock()


def _signature(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend) -> tuple:
    """The op's plan key: every input's shape, strides, dtype, device and data-pointer alignment, the scale the
    kernels use (``None`` resolved to ``1/sqrt(head_dim)``, so it shares a plan with that scale given explicitly) and
    the backend (O(1), no sync). Raises ``TypeError`` naming an argument that is not a tensor."""
    sig = DecodeWrapper._signature(q, k_cache, v_cache, seq_lens, block_table)
    return (sig, _scale(q, sm_scale), backend)


def _scale(q: torch.Tensor, sm_scale: float | None) -> float | None:
    """The score scale the kernels use: ``sm_scale``, or ``1/sqrt(head_dim)`` for ``None``; ``None`` where q has no
    head_dim to take it from (not 4-D, or head_dim 0), left to the planner's checks to name."""
    if sm_scale is not None:
        return float(sm_scale)
    return default_sm_scale(q.shape[-1]) if q.dim() == 4 and q.shape[-1] >= 1 else None


def clear_op_plans() -> None:
    """Forget the op's per-signature plans (the shared device tables stay: captured graphs may read them)."""
    with _LOCK:
        _PLANS.clear()


def _capturing(q: torch.Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` for a CPU tensor)."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _outside_graph_pools(make, device: torch.device) -> torch.Tensor:
    """``make()`` run on a short-lived thread, so the tensor it returns comes from the caching allocator's ordinary
    pool, not from a CUDA-graph pool this thread's allocations are routed to (torch's allocator routes them by
    thread); the thread waits for its stream, so the values are on the device when it returns. On a CPU device,
    ``make()`` directly. Never call it during a capture."""
    if device.type != "cuda":
        return make()
    box: dict = {}

    def work():
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream(device).synchronize()
            box["t"] = t
        except BaseException as e:  # re-raised on the caller's thread
            box["e"] = e

    th = threading.Thread(target=work, name="attnplan-op-alloc")
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box["t"]


def _targets_tensor(values: tuple, device: torch.device) -> torch.Tensor:
    """The schedule's targets table on ``device``, one tensor per distinct table (made outside graph pools)."""
    key = (device, values)
    t = _TARGETS.get(key)
    if t is None:
        t = _outside_graph_pools(lambda: torch.tensor(values, dtype=torch.int32, device=device), device)
        with _LOCK:
            t = _TARGETS.setdefault(key, t)
    return t


def _counters(words: int, q: torch.Tensor) -> torch.Tensor:
    """``words`` zero-at-rest completion counters for the current stream of q's device: the stream's shared buffer
    (grown when too small; an outgrown one is kept, a captured graph may hold it), or, during a capture on a stream
    that has none large enough, a per-call ``torch.zeros`` (captured as a memset)."""
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
    key = (q.device, stream)
    t = _COUNTERS.get(key)
    if t is not None and t.numel() >= words:
        return t
    if _capturing(q):
        return torch.zeros(words, dtype=torch.int32, device=q.device)
    t = _outside_graph_pools(lambda: torch.zeros(max(words, 64), dtype=torch.int32, device=q.device), q.device)
    with _LOCK:
        old = _COUNTERS.get(key)
        if old is not None and old.numel() >= words:
            return old
        if old is not None:
            _OUTGROWN.append(old)
        _COUNTERS[key] = t
    return t


def _plan_entry(q, k_cache, v_cache, seq_lens, block_table, sm_scale: float | None, backend: str) -> tuple:
    """``(backend, plan, sm_scale, targets)`` for the call's signature: the cached entry, or a new capacity plan
    (validation, planning through the plan cache, kernels prepared), never during a capture."""
    key = _signature(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend)
    with _LOCK:
        entry = _PLANS.get(key)
        if entry is not None:
            _PLANS.move_to_end(key)
            return entry
    if _capturing(q):
        raise PlanNotReadyError("attnplan::decode called for a new input signature during CUDA graph capture; "
                                "run the model once eagerly (torch.compile's warm-up does) before capturing")
    w = DecodeWrapper(backend=backend or None)
    plan = w.plan(q, k_cache, v_cache, seq_lens, block_table, sm_scale=key[1], capacity=True)
    # keep the plan, not the wrapper: its buffers, held across calls, would escape torch's graph memory pools
    entry = (w.backend, plan, w._sm_scale, _targets_tensor(plan.schedule.targets, q.device))
    w.backend.forget(plan, w.workspace)  # nothing of the wrapper's workspace stays in the backend (see DecodeWrapper)
    del w
    with _LOCK:
        _PLANS[key] = entry
        while len(_PLANS) > MAX_OP_PLANS:
            _PLANS.popitem(last=False)
    return entry


@torch.library.custom_op("attnplan::decode", mutates_args=())
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor | None, sm_scale: float | None = None, backend: str = "") -> torch.Tensor:
    """Decode attention as a custom op: same tensors and result as :func:`attnplan.decode`.

    Args:
        q: ``[batch, q_len, num_q_heads, head_dim]``; k_cache / v_cache: contiguous
            ``[batch, capacity, num_kv_heads, head_dim]`` (any batch/token/head strides, unit stride in head_dim:
            transformers' ``[batch, num_kv_heads, capacity, head_dim]`` cache transposed) or paged cache (q's
            dtype); seq_lens: ``[batch]`` int32 on q's device, the valid tokens (``<=`` capacity; read by the
            kernels at every call or replay, a value outside ``[0, capacity]`` clamped into it); block_table:
            ``[batch, pages]`` int32 or ``None``; sm_scale: score scale, 0 or a magnitude in ``[SM_SCALE_MIN,
            FP32_SCALED_MAX]`` (negative ones too; :func:`attnplan.problem.check_sm_scale`), ``None`` (the default)
            for ``1/sqrt(head_dim)``; backend: backend name or ``""`` (the default) for the config's order.
    Returns:
        a new ``[batch, q_len, num_q_heads, head_dim]`` tensor in q's dtype (``torch.empty_like(q)``'s strides).
    Raises:
        PlanNotReadyError: first call for this signature happens during CUDA-graph capture.
        NoBackendError: no backend of the config's order (or ``backend``) serves the problem here.
        ConfigError: ``$ATTNPLAN_CONFIG`` names a file that does not load (:func:`attnplan.api.default_context`).
        TypeError, ValueError: bad inputs (see :mod:`attnplan.problem`), ``sm_scale`` out of that range, or a tensor
            on another device than q's (a meta tensor among real ones too), before any kernel runs.
        ValueError: under grad mode, an input that requires grad (attnplan computes no gradients). Autograd asks
            only after the forward, so the kernels have run (and the plan is cached) when it is raised; the output
            is dropped. :func:`attnplan.decode` refuses it before planning.
    """
    if sm_scale is not None and not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite (or None for 1/sqrt(head_dim)), got {sm_scale!r}")
    be, plan, sm, targets = _plan_entry(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend)
    _, ql, hq, d = q.shape
    state = None if plan.single_pass else PartialState.empty(1, ql, hq, plan.state_slots, d, device=q.device)
    meta = torch.empty(plan.meta_words, dtype=torch.int32, device=q.device) if plan.meta_words else None
    counters = _counters(plan.sync_words, q) if plan.sync_words else None
    ws = Workspace(state, meta, counters, targets, plan.schedule.targets, Workspace.launch_lens(plan, q.device))
    out = torch.empty_like(q)
    try:
        be.run(plan, DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, sm), ws, out, None)
    finally:
        # the backend's launch constants of this call's workspace (triton keeps the last pairs', with references to
        # the tensors): kept, the per-call temporaries would outlive the call (a leak in torch.compile's CUDA-graph
        # pool, whose checks raise on it) and evict the launches of long-lived wrappers
        be.forget(plan, ws)
    return out


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, seq_lens, block_table, sm_scale=None, backend=""):
    """The output's shape, dtype and device (fake tensors under ``torch.compile``, the meta device). Every tensor
    must be on q's device, as the real op requires: a real tensor among meta ones (the meta kernel runs for the mix)
    would otherwise get an uninitialized output.

    Raises:
        ValueError: a tensor on another device than q's (named).
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: every tensor must be on q's device")
    return torch.empty_like(q)


def _no_grad_context(ctx, inputs, output) -> None:
    """Autograd's context of a call that needs gradients (grad mode on and an input that requires grad; autograd
    calls this only then): refused at once, as :func:`attnplan.decode` refuses it, not at ``backward()``.

    Raises:
        ValueError: naming the input that requires grad.
    """
    q, k_cache, v_cache = inputs[:3]
    with torch.enable_grad():
        check_no_grad(q, k_cache, v_cache)
    raise ValueError("an input requires grad: attnplan computes no gradients; call it under torch.no_grad() or "
                     "torch.inference_mode()")


def _no_backward(ctx, grad):
    raise RuntimeError("attnplan computes no gradients")  # never reached: _no_grad_context raises first


decode_op.register_autograd(_no_backward, setup_context=_no_grad_context)
