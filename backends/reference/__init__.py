"""The ``reference`` backend: the CPU float64 implementation behind the backend interface.

It runs the plan's device-side schedule on the host (:func:`attnplan.schedule.schedule_units`): one float64 partial
state per work unit, one-unit sequences written directly, the others merged by the one merge contract
(:func:`attnplan.state.merge_states` over the ragged workspace), with every length clamped into ``[0, capacity]``
and every page index into ``[0, num_pages)`` as the kernels clamp them (:mod:`attnplan.reference`). Slow and exact;
always available. It copies inputs to the CPU, so it syncs the host and cannot be captured in a CUDA graph
(``graph_safe = False``).
"""

from __future__ import annotations

import torch

from attnplan import reference
from attnplan.backends.base import Backend, DecodeInputs, Workspace, one_launch
from attnplan.planner import SplitPlan
from attnplan.state import PartialState

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    name = "reference"
    min_head_dim = 1
    max_head_dim = 1 << 16
    head_dim_multiple = 1
    max_rows_per_program = 1 << 20
    graph_safe = False
    fallback = True
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})

    def available(self, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def kernel_config(self, problem, options, device) -> dict:
        return {"block_n": 16}

    # The outputs are written as the kernel backends write them, through their memory, whatever autograd says of
    # them: an ``out`` that requires grad (a leaf) or an inference-mode ``lse`` is written, not refused by torch's
    # in-place checks (torch.inference_mode: no graph recorded, inference tensors writable; the result is ``out``
    # itself, no grad_fn, as from triton).
    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        with torch.inference_mode():
            self._partial(plan, inputs, workspace, out, lse)

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        with torch.inference_mode():
            self._merge(plan, workspace, out, lse, sinks)

    def _partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                 lse: torch.Tensor | None) -> None:
        one_launch(plan)
        x = inputs
        st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                      plan.schedule, window_left=x.window_left, soft_cap=x.soft_cap,
                                      k_scale=x.k_scale, v_scale=x.v_scale)
        # one-unit sequences: written directly, the sink applied (merging one state is that state)
        o, ls = reference.merge(st, x.sinks, indptr=units.indptr)
        one = units.units == 1
        dev = out.device
        if bool(one.any()):
            idx = one.nonzero().flatten()
            out[idx.to(dev)] = o[idx].to(out.dtype).to(dev)
            if lse is not None:
                lse[idx.to(dev)] = ls[idx].to(lse.dtype).to(dev)
        if plan.single_pass:
            return
        ws = workspace.state
        slot = units.slot.to(ws.o.device)  # the kernels' workspace layout: unit j of b in slot first[b] + j
        ws.o.index_copy_(3, slot, st.o.to(ws.o.dtype).to(ws.o.device))
        ws.lse.index_copy_(3, slot, st.lse.to(ws.lse.dtype).to(ws.lse.device))
        if workspace.meta is not None:
            b = units.units.numel()
            workspace.meta[:b].copy_(units.first.to(torch.int32))
            workspace.meta[b:2 * b].copy_(units.units.to(torch.int32))
        if plan.merge == "fused":
            self._merge_rows(units.first, units.units, ws, out, lse, x.sinks)

    def _merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
               sinks: torch.Tensor | None = None) -> None:
        one_launch(plan)
        b = out.shape[0]
        meta = workspace.meta.to("cpu", torch.int64)
        self._merge_rows(meta[:b], meta[b:2 * b], workspace.state, out, lse, sinks)

    @staticmethod
    def _merge_rows(first, units, state: PartialState, out, lse, sinks) -> None:
        """Merge the rows of sequences with two or more units (the others were written directly); sequence ``b``'s
        states are workspace slots ``[first[b], first[b] + units[b])``."""
        first, units = first.to("cpu", torch.int64), units.to("cpu", torch.int64)
        many = units >= 2
        if not bool(many.any()):
            return
        # the slots in sequence order, the ragged layout of merge_states' indptr
        indptr = torch.zeros(units.numel() + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(units, 0)
        order = (torch.arange(int(indptr[-1])) + torch.repeat_interleave(first - indptr[:-1], units)).to(state.o.device)
        o, ls = reference.merge(PartialState(state.o.index_select(3, order), state.lse.index_select(3, order)), sinks,
                                indptr=indptr)
        idx = many.nonzero().flatten().to(out.device)
        out[idx] = o[many.nonzero().flatten()].to(out.dtype).to(out.device)
        if lse is not None:
            lse[idx] = ls[many.nonzero().flatten()].to(lse.dtype).to(lse.device)
