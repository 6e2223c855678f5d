"""``torch.ops.attnplan.decode``: the decode entry point as a ``torch.library`` custom op.

Registered with a fake (meta) implementation, so models calling it trace under
``torch.compile(fullgraph=True)`` without graph breaks, and capture in CUDA graphs that torch
makes (``mode="reduce-overhead"``): the op keeps one capacity plan per input signature, made on
the first (eager, warm-up) call, so later calls neither plan nor sync the host. The workspace's
partial states, the schedule's ``(indptr, units)`` table and the fused merge's counters are per-call
temporaries allocated through torch, so torch's graph memory pools own them; the schedule's
``targets`` table is constant per plan and is copied to the device once, with the plan (a
host-to-device copy during capture would be illegal). A call under capture with no plan for its
signature raises :class:`~attnplan.PlanNotReadyError`.

The plan key is everything validation depends on: the shape, strides, dtype, device and 16-byte
alignment of ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and ``block_table``
(:meth:`DecodeWrapper._signature <attnplan.DecodeWrapper>`), the score scale and the backend. A call
whose key is new is validated and planned (reading ``seq_lens`` and the block table, as ``plan()``
does); a call with a known key reuses the plan without reading any values, so the block-table
entries and lengths must stay valid for the cache, as for :meth:`attnplan.DecodeWrapper.run`.
"""

from __future__ import annotations

import math
import threading

import torch

from .api import DecodeWrapper, PlanNotReadyError
from .backends.base import DecodeInputs, Workspace
from .state import PartialState

__all__ = ["decode_op", "clear_op_plans"]

_WRAPPERS: dict[tuple, tuple] = {}  # signature -> (backend, plan, sm_scale, targets on the device)
_LOCK = threading.Lock()


def _signature(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend) -> tuple:
    """The op's plan key: every input's shape, strides, dtype, device and data-pointer alignment, the scale and the
    backend (O(1), no sync). Raises ``TypeError`` naming an argument that is not a tensor."""
    return (DecodeWrapper._signature(q, k_cache, v_cache, seq_lens, block_table), float(sm_scale), backend)


def clear_op_plans() -> None:
    """Forget the op's per-signature wrappers (their capacity plans and workspaces)."""
    with _LOCK:
        _WRAPPERS.clear()


@torch.library.custom_op("attnplan::decode", mutates_args=())
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor | None, sm_scale: float, backend: str) -> torch.Tensor:
    """Decode attention as a custom op: same tensors and result as :func:`attnplan.decode`.

    Args:
        q: ``[batch, q_len, num_q_heads, head_dim]``; k_cache / v_cache: contiguous or paged
            cache (q's dtype); seq_lens: ``[batch]`` int32; block_table: ``[batch, pages]``
            int32 or ``None``; sm_scale: score scale (``<= 0`` means ``1/sqrt(head_dim)``);
            backend: backend name or ``""`` for the config's order.
    Returns:
        a new ``[batch, q_len, num_q_heads, head_dim]`` tensor in q's dtype.
    Raises:
        PlanNotReadyError: first call for this signature happens during CUDA-graph capture.
        TypeError, ValueError: bad inputs (see :mod:`attnplan.problem`), or ``sm_scale`` not finite,
            before any kernel runs.
    """
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite (<= 0 = 1/sqrt(head_dim)), got {sm_scale!r}")
    scale = None if sm_scale <= 0 else sm_scale
    key = _signature(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend)
    entry = _WRAPPERS.get(key)
    if entry is None:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise PlanNotReadyError("attnplan::decode called for a new input signature during CUDA graph capture; "
                                    "run the model once eagerly (torch.compile's warm-up does) before capturing")
        w = DecodeWrapper(backend=backend or None)
        plan = w.plan(q, k_cache, v_cache, seq_lens, block_table, sm_scale=scale, capacity=True)
        # keep the plan and its constant targets table only: the wrapper's other buffers, held across calls,
        # would escape torch's graph memory pools
        entry = (w.backend, plan, w._sm_scale, w.workspace.targets)
        with _LOCK:
            _WRAPPERS[key] = entry
        del w
    be, plan, sm, targets = entry
    # per-call temporaries (allocated through torch, so torch.compile's CUDA graphs own them): the ragged partial
    # states [1, q_len, num_q_heads, max_units, head_dim] and the (indptr, units) table are written by the partial
    # kernel before they are read; the fused merge's completion counters must start at zero
    _, ql, hq, d = q.shape
    state = None if plan.single_pass else PartialState.empty(1, ql, hq, plan.state_slots, d, device=q.device)
    meta = torch.empty(plan.meta_words, dtype=torch.int32, device=q.device) if plan.meta_words else None
    counters = torch.zeros(plan.sync_words, dtype=torch.int32, device=q.device) if plan.sync_words else None
    ws = Workspace(state, meta, counters, targets, plan.schedule.targets)
    out = torch.empty_like(q)
    be.run(plan, DecodeInputs(q, k_cache, v_cache, seq_lens, block_table, sm), ws, out, None)
    return out


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, seq_lens, block_table, sm_scale, backend):
    return torch.empty_like(q)
