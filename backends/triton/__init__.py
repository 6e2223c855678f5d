"""The ``triton`` backend: ``@triton.jit`` scheduled split-KV partial kernel and merge kernel.

Runs on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` (the interpreter; CI's mode).
Precision: fp32 inputs use ``tl.dot(..., input_precision="ieee")`` so compiled code and the interpreter agree (no
TF32: on a GPU a TF32 dot of fp32 inputs misses the fp32 tolerance). Under the interpreter, bf16 operands are
widened to fp32 before ``tl.dot`` because Triton's interpreter (3.6, 3.9) returns garbage from ``tl.dot`` on bf16
operands; the compiled GPU path keeps bf16 tensor-core dots.

The kernels follow :mod:`attnplan.backends.base`'s contract: a 1-D grid of ``max_units x num_kv_heads`` programs
that compute the device-side schedule (:mod:`attnplan.schedule`) from the live ``seq_lens`` at every launch;
sequences with one unit are written directly, the others' units go to the ragged workspace and are merged by the
separate merge kernel (``plan.merge == "separate"``) or by the last program of each (sequence, KV head)
(``"fused"``, a completion counter, fixed unit order). ``run`` launches only: no allocation, no host sync; the
plan-derived launch constants are computed once per (plan, workspace).
"""

from __future__ import annotations

import os

import torch

from attnplan.backends.base import Backend, DecodeInputs, Workspace
from attnplan.planner import SplitPlan
from attnplan.problem import torch_dtype

__all__ = ["TritonBackend", "merge_geometry"]

_LOG2E = 1.4426950408889634
#: most sequences the prologue reads per step (one ``tl.arange`` block; larger batches loop)
MAX_BLOCK_B = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def merge_geometry(rows: int, num_splits: int, head_dim: int, sm_count: int) -> tuple[int, int, int]:
    """The merge kernel's ``(column slices per row, BLOCK_D, BLOCK_S)``: its grid is ``(rows, slices)``,
    each program merges ``BLOCK_D`` output columns over a row's units, ``BLOCK_S`` units per load.

    ``num_splits``: the most units a row can have (``plan.schedule.max_units_per_seq``). One program per row with
    32 units per load is the default. When the rows do not fill the SMs (``rows < sm_count``; e.g. one sequence and
    one KV head: 8 rows), each row is cut into up to ``head_dim / 16`` column slices (at most about ``2 * sm_count``
    programs in all) and each program loads up to 256 units at once (``BLOCK_S * BLOCK_D <= 4096`` fp32 per load),
    so a row over hundreds of units costs one or two memory round trips instead of ``num_splits / 32`` (measured on
    an H200: 6.0-10.8 us at 8 rows x 128-256 splits with one program per row). ``sm_count`` 0 (unknown) keeps the
    default.
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


class _Launch:
    """What a (plan, workspace) pair fixes for the partial and merge launches, computed once."""

    __slots__ = ("plan", "workspace", "grid", "const", "ints", "ws", "merge_grid", "merge_const", "q_shape")


class TritonBackend(Backend):
    """Split-KV decode in Triton. One program per (work unit, KV head); the whole GQA group and all queries of a
    sequence are the rows of one ``tl.dot`` tile (at least 16 rows)."""

    name = "triton"
    min_head_dim = 16
    max_head_dim = 256
    head_dim_multiple = 8
    max_rows_per_program = 128
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})
    merge_strategies = frozenset({"separate", "fused"})

    def __init__(self) -> None:
        self._triton = None
        self._launches: dict[tuple[int, int], _Launch] = {}

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
        """``block_n`` (KV tokens per tile), ``num_warps`` and ``num_stages``; ``options`` (the config's or a tuned
        table's) win where set."""
        interp = _interpreting() or torch.device(device).type != "cuda"
        if interp:
            block_n, warps, stages = 16, 1, 1
        else:
            # measured on an H200: BLOCK_N 64 with 4 warps is best or within 4% everywhere; 3 stages for contiguous
            # caches, 2 for paged
            block_n = 64 if problem.head_dim <= 128 else 32
            if torch_dtype(problem.kv_dtype).itemsize == 1:
                block_n *= 2  # a 1-byte cache keeps the tile's bytes (and so the bytes in flight) per program
            warps = 4
            stages = 2 if problem.paged or problem.head_dim > 128 else 3
        return {
            "block_n": options.get("block_n") or block_n,
            "num_warps": options.get("num_warps") or warps,
            "num_stages": options.get("num_stages") or stages,
        }

    # -- launch constants ---------------------------------------------------------------------------
    def _launch(self, plan: SplitPlan, workspace: Workspace) -> _Launch:
        key = (id(plan), id(workspace))
        hit = self._launches.get(key)
        if hit is not None and hit.plan is plan and hit.workspace is workspace:
            return hit
        p, s, kc = plan.problem, plan.schedule, plan.kernel
        hkv, d = p.num_kv_heads, p.head_dim
        group = p.num_q_heads // hkv
        ws = workspace.state
        if plan.single_pass:
            ws_o = ws_lse = workspace.targets
            slots = 0
        else:
            if ws is None or tuple(ws.o.shape[1:3]) != (p.q_len, p.num_q_heads) or ws.o.shape[4] != d \
                    or ws.num_splits < s.max_units or not (ws.o.is_contiguous() and ws.lse.is_contiguous()):
                raise ValueError(f"workspace does not serve the plan: need a contiguous state [1, {p.q_len}, "
                                 f"{p.num_q_heads}, >= {s.max_units}, {d}] (Workspace.allocate)")
            ws_o, ws_lse, slots = ws.o, ws.lse, ws.num_splits
        if plan.merge == "separate" and workspace.meta is None or plan.merge == "fused" and workspace.counters is None:
            raise ValueError(f"workspace has no {'meta' if plan.merge == 'separate' else 'counters'} for the "
                             f"{plan.merge} merge")
        interp = _interpreting()
        upcast = interp and p.q_dtype == "bfloat16"
        L = _Launch()
        L.plan, L.workspace, L.grid = plan, workspace, plan.grid
        L.q_shape = (p.batch, p.q_len, p.num_q_heads, d)
        L.const = dict(
            Q_LEN=p.q_len, GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)),
            BLOCK_M=max(16, _next_pow2(p.q_len * group)), BLOCK_N=kc["block_n"],
            BLOCK_B=min(MAX_BLOCK_B, max(16, _next_pow2(p.batch))), ONE_BLOCK=p.batch <= MAX_BLOCK_B,
            GRANULE=s.granule,
            PAGE_SIZE=p.page_size or 1, PAGED=bool(p.page_size), MULTI=not s.single_pass, BALANCED=any(s.targets),
            MERGE=plan.merge, UPCAST=upcast, DOT_PRECISION="ieee" if (p.q_dtype == "float32" or upcast) else "tf32",
            WINDOW=p.window_left >= 0, SOFTCAP=p.soft_cap > 0, FP8=p.kv_dtype == "float8_e4m3fn",
            num_warps=kc.get("num_warps", 1 if interp else 4), num_stages=kc.get("num_stages", 1 if interp else 2))
        L.ints = (p.batch, slots, s.min_unit_granules, s.max_units_per_seq)
        dummy = workspace.targets
        L.ws = (workspace.targets, workspace.meta if workspace.meta is not None else dummy,
                workspace.counters if workspace.counters is not None else dummy, ws_o, ws_lse)
        if plan.merge == "separate":
            rows = p.batch * p.q_len * p.num_q_heads
            slices, block_d, block_s = merge_geometry(rows, s.max_units_per_seq, d, plan.device.sm_count)
            L.merge_grid = (rows, slices)
            L.merge_const = dict(NUM_HEADS=p.num_q_heads, Q_LEN=p.q_len, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s,
                                 num_warps=1 if interp else 4)
        else:
            L.merge_grid = L.merge_const = None
        if len(self._launches) >= 64:
            self._launches.clear()
        self._launches[key] = L
        return L

    # -- launches ---------------------------------------------------------------------------------
    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The scheduled partial kernel (:mod:`attnplan.backends.base`): one-unit sequences into ``out``
        ``[B, Q, H, D]`` (q's dtype) and ``lse [B, Q, H]`` fp32 (if given), the others' units into the workspace;
        ``workspace.meta`` for the separate merge; the fused merge inside.

        ``out``'s three leading strides and ``lse``'s two are honoured (their last axes have unit stride), as are
        q's, the cache's and the block table's strides and ``seq_lens``'s.

        Raises:
            ValueError: q's shape is not the plan's, or ``workspace`` does not serve the plan.
        """
        x = inputs
        L = self._launch(plan, workspace)
        q, k, v, sl, bt = x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table
        if q.shape != L.q_shape:
            raise ValueError(f"q has shape {tuple(q.shape)}, the plan {L.q_shape}: re-plan")
        targets, meta, counters, ws_o, ws_lse = L.ws
        fp8 = L.const["FP8"]
        sinks = x.sinks
        if bt is None:
            bt, bts = targets, (0, 0)
        else:
            bts = bt.stride()
        ls = lse.stride() if lse is not None else (0, 0)
        ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), out.stride()
        self._kernels().split_kv_partial_kernel[L.grid](
            q, k, v, sl, bt, targets, meta, counters, ws_o, ws_lse, out, lse if lse is not None else targets,
            x.k_scale if fp8 else targets, x.v_scale if fp8 else targets, sinks if sinks is not None else targets,
            x.sm_scale * _LOG2E, max(x.window_left, 0), float(x.soft_cap), *L.ints,
            sl.stride(0), qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], bts[0], bts[1],
            os_[0], os_[1], os_[2], ls[0], ls[1],
            WRITE_LSE=lse is not None, SINKS_ON=sinks is not None, **L.const)

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """The separate merge kernel: the rows of sequences with two or more units (``workspace.meta``) into ``out``
        ``[B, Q, H, D]`` and, if given, ``lse [B, Q, H]`` fp32; ``sinks [H]`` fp32 join the denominator. Rows of
        one-unit sequences are left as the partial kernel wrote them.

        Raises:
            ValueError: the plan's merge is not ``separate``, or ``workspace`` does not serve the plan.
        """
        L = self._launch(plan, workspace)
        if L.merge_grid is None:
            raise ValueError(f"plan merge is {plan.merge!r}: no separate merge to launch")
        targets, meta, _, ws_o, ws_lse = L.ws
        os_ = out.stride()
        ls = lse.stride() if lse is not None else (0, 0)
        self._kernels().merge_kernel[L.merge_grid](
            ws_o, ws_lse, meta, out, lse if lse is not None else targets, sinks if sinks is not None else targets,
            L.ints[0], L.ints[1], os_[0], os_[1], os_[2], ls[0], ls[1],
            WRITE_LSE=lse is not None, SINKS_ON=sinks is not None, **L.merge_const)
