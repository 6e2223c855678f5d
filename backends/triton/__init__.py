"""The ``triton`` backend: ``@triton.jit`` split-KV partial, merge and single-pass kernels.

Runs on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` (the interpreter; CI's mode).
Precision: fp32 inputs use ``tl.dot(..., input_precision="ieee")`` so compiled code and the
interpreter agree (no TF32; cases.yaml interpreter-vs-gpu-tf32). Under the interpreter, bf16
operands are widened to fp32 before ``tl.dot`` because Triton's interpreter (3.6, 3.9) returns
garbage from ``tl.dot`` on bf16 operands; the compiled GPU path keeps bf16 tensor-core dots.

Partitions (``plan.partition``, seed 000). ``split_k`` (default): one program per split covers all
head_dim columns. ``split_v``: Triton cannot address warps, so the workers are *column programs*:
each split gets ``plan.column_programs = ceil(head_dim / block_dv)`` programs (grid axis 0 =
``split * column_programs + column``); each scores the chunk against full K rows (QK^T recomputed,
K read once per column program) and accumulates P.V for its ``block_dv`` columns only, with its own
running max and sum and no cross-program reduction; column program 0 writes the lse. ``block_dv``
(option ``backend_options.triton.block_dv``, a power of two of at least 16 for ``tl.dot``) defaults
to half the padded head_dim: 2 column programs (1 for head_dim 16). Partial states are unchanged.

Merges (``plan.merge``): ``separate`` (merge kernel), ``fused`` (the last program of each (sequence,
KV head), by a completion counter, merges in split order) and ``atomic`` (opt-in, non-deterministic:
every program merges its state into a per-(sequence, KV head, column program) accumulator under a
spin lock, in completion order; the last one writes the output and leaves counter and lock at zero).
"""

from __future__ import annotations

import os

import torch

from attnplan.problem import torch_dtype

from attnplan.backends.base import Backend, DecodeInputs
from attnplan.planner import SplitPlan
from attnplan.state import PartialState

__all__ = ["TritonBackend"]

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def merge_geometry(rows: int, num_splits: int, head_dim: int, sm_count: int) -> tuple[int, int, int]:
    """The merge kernel's ``(column slices per row, BLOCK_D, BLOCK_S)``: its grid is ``(rows, slices)``,
    each program merges ``BLOCK_D`` output columns over all splits, ``BLOCK_S`` splits per load.

    One program per row with 32 splits per load is the default. When the rows do not fill the SMs
    (``rows < sm_count``; e.g. one sequence and one KV head: 8 rows), each row is cut into up to
    ``head_dim / 16`` column slices (at most about ``2 * sm_count`` programs in all) and each program
    loads up to 256 splits at once (``BLOCK_S * BLOCK_D <= 4096`` fp32 per load), so a row over
    hundreds of splits costs one or two memory round trips instead of ``num_splits / 32``
    (measured on the H200, results/2026-11-30-s5-call1: 6.0-10.8 us at 8 rows x 128-256 splits, one
    program per row). ``sm_count`` 0 (unknown) keeps the default.
    """
    block_d = max(16, _next_pow2(head_dim))
    slices = 1
    if 0 < rows < sm_count:
        want = -(-2 * sm_count // rows)
        while slices * 2 <= min(block_d // 16, want):
            slices *= 2
    block_d //= slices
    block_s = min(max(2, _next_pow2(num_splits)), 32 if slices == 1 else min(256, max(32, 4096 // block_d)))
    return slices, block_d, block_s


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


class TritonBackend(Backend):
    """Split-KV decode in Triton. One program per (split, column program, KV head, sequence); the whole
    GQA group and all queries of a sequence are the rows of one ``tl.dot`` tile (at least 16 rows)."""

    name = "triton"
    min_head_dim = 16
    max_head_dim = 256
    head_dim_multiple = 8
    max_rows_per_program = 128
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})
    merge_strategies = frozenset({"separate", "fused", "atomic"})
    partitions = frozenset({"split_k", "split_v"})

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

    def plan_key_extra(self) -> str:
        """What besides the problem and config changes this backend's kernel options: the
        interpreter (``TRITON_INTERPRET=1`` plans 16-token tiles and one warp)."""
        return "interpreter" if _interpreting() else ""

    def kernel_config(self, problem, options: dict, device) -> dict:
        """``block_n``, ``num_warps``, ``num_stages``, ``block_dv`` (split_v's columns per column
        program; the planner sets it to ``None`` under split_k) and, when given (a tuned table), the
        ``partition``. Raises ``ValueError`` naming the option for a bad ``block_dv`` or ``partition``."""
        block_d = max(16, _next_pow2(problem.head_dim))
        block_dv = options.get("block_dv") or max(16, block_d // 2)
        if (block_dv & (block_dv - 1) or block_dv < 16) and options.get("partition", "split_v") == "split_v":
            raise ValueError(f"backend_options.triton.block_dv must be a power of two >= 16, got {block_dv}")
        partition = options.get("partition")
        if partition is not None and partition not in self.partitions:
            raise ValueError(f"kernel option triton partition {partition!r} must be one of {sorted(self.partitions)}")
        interp = _interpreting() or torch.device(device).type != "cuda"
        if interp:
            block_n, warps, stages = 16, 1, 1
        else:
            # measured on an H200 (benchmarks/results/2026-11-30-sweep-triton): BLOCK_N 64 with
            # 4 warps is best or within 4% everywhere; 3 stages for contiguous caches, 2 for paged.
            block_n = 64 if problem.head_dim <= 128 else 32
            if torch_dtype(problem.kv_dtype).itemsize == 1:
                block_n *= 2  # a 1-byte cache keeps the tile's bytes in flight (NOTES.md change 6)
            warps = 4
            stages = 2 if problem.paged or problem.head_dim > 128 else 3
        return {
            "block_n": options.get("block_n") or block_n,
            "num_warps": options.get("num_warps") or warps,
            "num_stages": options.get("num_stages") or stages,
            "block_dv": min(block_dv, block_d),
            **({"partition": partition} if partition else {}),
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
        block_d = max(16, _next_pow2(d))
        block_dv = kc.get("block_dv") or block_d
        cols = plan.column_programs
        if -(-d // block_dv) != cols or plan.grid[0] != plan.num_splits * cols:
            raise ValueError(f"plan has {cols} column programs of {block_dv} columns and grid {plan.grid}; "
                             f"inputs have head_dim {d}: re-plan")
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
            plan.chunk_size, plan.num_splits, hkv, plan.sync_words // 2 if plan.merge == "atomic" else 0,
            Q_LEN=q_len, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_DV=block_dv, N_COLS=cols,
            BLOCK_M=max(16, _next_pow2(q_len * group)), BLOCK_N=kc["block_n"],
            PAGE_SIZE=x.k_cache.shape[1] if x.paged else 1, PAGED=x.paged,
            WRITE_LSE=lse is not None, UPCAST=upcast,
            DOT_PRECISION="ieee" if (fp32 or upcast) else "tf32",
            WINDOW=x.window_left >= 0, SOFTCAP=x.soft_cap > 0, FP8=fp8, SINKS_ON=sinks_on,
            MERGE=plan.merge if fused is not None else "none", WRITE_OUT_LSE=out_lse is not None,
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
        rows = b * q_len * hq
        slices, block_d, block_s = merge_geometry(rows, plan.num_splits, d, int(plan.device.get("sm_count") or 0))
        k.merge_kernel[(rows, slices)](
            o, ls, out, lo, sinks if sinks is not None else ls, plan.num_splits,
            o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            ls.stride(0), ls.stride(1), ls.stride(2), ls.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            *lo_strides,
            NUM_HEADS=hq, Q_LEN=q_len, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=block_s, WRITE_LSE=lse is not None, SINKS_ON=sinks is not None,
            num_warps=1 if _interpreting() else 4,
        )
