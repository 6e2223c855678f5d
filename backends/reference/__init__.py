"""The ``reference`` backend: the CPU float64 implementation behind the backend interface.

Slow and exact; always available. It copies inputs to the CPU, so it syncs the host and is
not capturable in a CUDA graph (``graph_safe = False``).
"""

from __future__ import annotations

import torch

from attnplan import reference
from attnplan.backends.base import Backend, DecodeInputs
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
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})

    def available(self, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def kernel_config(self, problem, options, device) -> dict:
        return {"block_n": 16}

    def partial(self, plan: SplitPlan, inputs: DecodeInputs, state: PartialState) -> None:
        x = inputs
        st = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size,
                               plan.num_splits, window_left=x.window_left, soft_cap=x.soft_cap, k_scale=x.k_scale,
                               v_scale=x.v_scale)
        state.o[:, :, :, : plan.num_splits].copy_(st.o)
        state.lse[:, :, :, : plan.num_splits].copy_(st.lse)

    def merge(self, plan: SplitPlan, state: PartialState, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        sub = PartialState(state.o[:, :, :, : plan.num_splits], state.lse[:, :, :, : plan.num_splits])
        o, l = reference.merge(sub, sinks)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)

    def single_pass(self, plan: SplitPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        x = inputs
        o, l = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                   window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks, k_scale=x.k_scale,
                                   v_scale=x.v_scale)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
