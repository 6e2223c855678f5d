"""The ``triton`` backend: ``@triton.jit`` split-KV partial, merge and single-pass kernels.

Runs on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` (the interpreter; CI's mode).
Precision: fp32 inputs use ``tl.dot(..., input_precision="ieee")`` so compiled code and the
interpreter agree (no TF32; cases.yaml interpreter-vs-gpu-tf32). Under the interpreter, bf16
operands are widened to fp32 before ``tl.dot`` because Triton's interpreter (3.6, 3.9) returns
garbage from ``tl.dot`` on bf16 operands; the compiled GPU path keeps bf16 tensor-core dots.
"""

from __future__ import annotations

import os

import torch

from attnplan.backends.base import Backend, DecodeInputs
from attnplan.planner import SplitPlan
from attnplan.state import PartialState

__all__ = ["TritonBackend"]

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


class TritonBackend(Backend):
    """Split-KV decode in Triton. One program per (split, KV head, sequence); the whole GQA group
    and all queries of a sequence are the rows of one ``tl.dot`` tile (at least 16 rows)."""

    name = "triton"
    min_head_dim = 16
    max_head_dim = 256
    head_dim_multiple = 8
    max_rows_per_program = 128
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})
    merge_strategies = frozenset({"separate", "fused"})

    def __init__(self) -> None:
        self._triton = None

    def _kernels(self):
        if self._triton is None:
            from . import kernels
            self._triton = kernels
        return self._triton

    def available(self, device: torch.device) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return False, f"triton is not importable: {e}"
        device = torch.device(device)
        if device.type == "cuda":
            if _interpreting():
                return True, ""
            return (True, "") if torch.cuda.is_available() else (False, "CUDA is not available")
        if device.type == "cpu":
            return (True, "") if _interpreting() else (False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
        return False, f"unsupported device type {device.type}"

    def kernel_config(self, problem, options: dict, device) -> dict:
        interp = _interpreting() or torch.device(device).type != "cuda"
        if interp:
            block_n, warps, stages = 16, 1, 1
        else:
            # measured on an H200 (benchmarks/results/2026-11-30-sweep-triton): BLOCK_N 64 with
            # 4 warps is best or within 4% everywhere; 3 stages for contiguous caches, 2 for paged.
            block_n = 64 if problem.head_dim <= 128 else 32
            warps = 4
            stages = 2 if problem.paged or problem.head_dim > 128 else 3
        return {
            "block_n": options.get("block_n") or block_n,
            "num_warps": options.get("num_warps") or warps,
            "num_stages": options.get("num_stages") or stages,
        }

    # -- launches ---------------------------------------------------------------------------------
    def _launch_partial(self, plan: SplitPlan, x: DecodeInputs, o: torch.Tensor, lse: torch.Tensor | None,
                        o_strides: tuple, lse_strides: tuple, single: bool = False,
                        fused: tuple | None = None) -> None:
        k = self._kernels()
        q = x.q
        _, q_len, hq, d = q.shape
        hkv = x.k_cache.shape[2]
        group = hq // hkv
        interp = _interpreting()
        fp32 = q.dtype == torch.float32
        upcast = interp and q.dtype == torch.bfloat16
        bt = x.block_table if x.block_table is not None else x.seq_lens  # dummy pointer when contiguous
        kc = plan.kernel
        fp8 = x.k_cache.dtype == torch.float8_e4m3fn
        sinks_on = (single or fused is not None) and x.sinks is not None
        dummy = x.seq_lens
        out, out_lse, counters = fused if fused is not None else (o, None, dummy)
        ol = out_lse if out_lse is not None else dummy
        k.split_kv_partial_kernel[plan.grid](
            q, x.k_cache, x.v_cache, x.seq_lens, bt, o, lse if lse is not None else o,
            x.k_scale if fp8 else dummy, x.v_scale if fp8 else dummy, x.sinks if sinks_on else dummy,
            out, ol, counters,
            x.sm_scale * _LOG2E, max(x.window_left, 0), float(x.soft_cap),
            q.stride(0), q.stride(1), q.stride(2),
            x.k_cache.stride(0), x.k_cache.stride(1), x.k_cache.stride(2),
            x.v_cache.stride(0), x.v_cache.stride(1), x.v_cache.stride(2),
            bt.stride(0),
            *o_strides, *lse_strides,
            out.stride(0), out.stride(1), out.stride(2),
            *((out_lse.stride(0), out_lse.stride(1), out_lse.stride(2)) if out_lse is not None else (0, 0, 0)),
            plan.chunk_size, plan.num_splits, hkv,
            Q_LEN=q_len, GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)),
            BLOCK_M=max(16, _next_pow2(q_len * group)), BLOCK_N=kc["block_n"],
            PAGE_SIZE=x.k_cache.shape[1] if x.paged else 1, PAGED=x.paged,
            WRITE_LSE=lse is not None, UPCAST=upcast,
            DOT_PRECISION="ieee" if (fp32 or upcast) else "tf32",
            WINDOW=x.window_left >= 0, SOFTCAP=x.soft_cap > 0, FP8=fp8, SINKS_ON=sinks_on,
            FUSED_MERGE=fused is not None, WRITE_OUT_LSE=out_lse is not None,
            num_warps=kc["num_warps"], num_stages=kc["num_stages"],
        )

    def partial(self, plan: SplitPlan, inputs: DecodeInputs, state: PartialState) -> None:
        o, lse = state.o, state.lse
        self._launch_partial(plan, inputs, o, lse, (o.stride(0), o.stride(1), o.stride(2), o.stride(3)),
                             (lse.stride(0), lse.stride(1), lse.stride(2), lse.stride(3)))

    def partial_fused_merge(self, plan: SplitPlan, inputs: DecodeInputs, state: PartialState, out: torch.Tensor,
                            lse: torch.Tensor | None, counters: torch.Tensor) -> None:
        o, ls = state.o, state.lse
        self._launch_partial(plan, inputs, o, ls, (o.stride(0), o.stride(1), o.stride(2), o.stride(3)),
                             (ls.stride(0), ls.stride(1), ls.stride(2), ls.stride(3)), fused=(out, lse, counters))

    def single_pass(self, plan: SplitPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        ls = (lse.stride(0), lse.stride(1), lse.stride(2), 0) if lse is not None else (0, 0, 0, 0)
        self._launch_partial(plan, inputs, out, lse, (out.stride(0), out.stride(1), out.stride(2), 0), ls, single=True)

    def merge(self, plan: SplitPlan, state: PartialState, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        k = self._kernels()
        o, ls = state.o, state.lse
        b, q_len, hq, _, d = o.shape
        lo = lse if lse is not None else out
        lo_strides = (lse.stride(0), lse.stride(1), lse.stride(2)) if lse is not None else (0, 0, 0)
        k.merge_kernel[(b * q_len * hq,)](
            o, ls, out, lo, sinks if sinks is not None else ls, plan.num_splits,
            o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            ls.stride(0), ls.stride(1), ls.stride(2), ls.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            *lo_strides,
            NUM_HEADS=hq, Q_LEN=q_len, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)),
            BLOCK_S=min(32, max(2, _next_pow2(plan.num_splits))), WRITE_LSE=lse is not None, SINKS_ON=sinks is not None,
            num_warps=1 if _interpreting() else 4,
        )
