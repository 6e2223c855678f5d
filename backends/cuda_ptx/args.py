"""Kernel arguments: the parameter lists of ``decode.cu``'s entries, their values from tensors, and the packing for
``cuLaunchKernel`` (plain Python, no GPU needed).

:data:`PARTIAL_SIGNATURE` / :data:`MERGE_SIGNATURE` name each parameter and its kind in order (the compile tests check
them against the PTX entries: :func:`expected_param_sizes`); :func:`partial_args` / :func:`merge_args` list the values
from the tensors (data pointers, strides in elements; no device access, no sync); :class:`PackedArgs` lays them out as
``kernelParams`` (one 8-byte slot per argument plus an array of pointers to the slots); :func:`check_layout` checks
that a tensor can be read with the kernels' vector loads.

64 bits: every stride is an int64 argument and the kernels form every offset into a cache, the block table, q, out
or the workspace as a 64-bit product (page x page stride, sequence x sequence stride, token x token stride, head x
head stride, slot x slot stride); only offsets inside one tile or page (at most ``(tile - 1) x token stride +
head_dim`` elements, checked by the backend) and token positions are 32-bit. Token positions stay below 2**31
because a cache holds at most :data:`MAX_KV_TOKENS` tokens per sequence (the backend refuses more, naming the
tensor): the rings and the block-table window run at most a few million tokens past a unit's end. The 32-bit
scalars are packed so that every value the planner and the input validation allow fits: ``window_left`` as
``min(window_left, capacity)`` (a window at least the cache's capacity restricts nothing); the schedule's integers
are below 2**31 by :class:`~attnplan.schedule.Schedule`'s own checks.

Page indices: ``last_page`` is a paged cache's ``k_cache.shape[0] - 1`` (0 for a contiguous cache, which never
reads it); the kernels clamp every entry they read from the block table into ``[0, last_page]`` (negative -> 0, past
the cache -> ``last_page``), as :mod:`attnplan.reference` does, so an out-of-range entry reads a wrong page of the
cache and never memory outside it.

Lengths: the last parameter but one, ``capacity``, is :func:`kv_capacity` (the tokens a sequence of the cache holds);
the kernels clamp every length they read from ``seq_lens`` into ``[0, capacity]`` (``schedule.cuh``, ``seq_len_at``),
as :mod:`attnplan.reference` does, so a length written on the device beyond the cache (after ``plan()``, or at a
CUDA-graph replay) gives attention over the clamped span and never a read outside the cache. The last,
``spread_slots``, bounds the grid slots the prologue spreads a batch's units over (``attnplan.schedule.slot_unit``'s
``window``; 0: the whole grid).
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from attnplan.backends.base import INT32_MAX
from attnplan.problem import LOG2E, kv_capacity

from .spec import KernelSpec

__all__ = ["PARTIAL_SIGNATURE", "MERGE_SIGNATURE", "PROBE_SIGNATURE", "PackedArgs", "partial_args", "merge_args",
           "probe_args", "schedule_ints", "check_layout", "expected_param_sizes", "kv_capacity", "MAX_KV_TOKENS"]

#: most tokens a cache may hold per sequence (contiguous: ``k_cache.shape[1]``; paged: ``block_table.shape[1] x
#: page_size``), so that the kernels' 32-bit token positions, which run ahead of a chunk by the rings and the
#: block-table window (under 2**22 tokens for any specialization), stay below 2**31
MAX_KV_TOKENS = 2**30



#: (name, kind) of each partial / single-pass kernel parameter, in order; kinds: ptr, i32, f32, i64. The single pass
#: reads the first 34 (``granule`` / ``max_units_per_seq`` = 1 / ``o_ss`` = ``l_ss`` = 0 as its one split's chunk
#: arithmetic), in the order it had before the device-side schedule (``decode.cu`` says why); the schedule's and the
#: workspace's follow, then ``last_page`` (a paged cache's ``pages - 1``, the clamp of every block-table entry; 0
#: and unread for a contiguous cache) and ``capacity`` (:func:`kv_capacity`, the clamp of every length), which both
#: kernels read.
PARTIAL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("q", "ptr"), ("k_cache", "ptr"), ("v_cache", "ptr"), ("seq_lens", "ptr"), ("block_table", "ptr"),
    ("out", "ptr"), ("out_lse", "ptr"), ("sinks", "ptr"), ("k_scale", "ptr"), ("v_scale", "ptr"),
    ("scale_log2", "f32"), ("softcap_log2", "f32"), ("granule", "i32"), ("max_units_per_seq", "i32"),
    ("num_kv_heads", "i32"), ("window_left", "i32"),
    ("q_sb", "i64"), ("q_si", "i64"), ("q_sh", "i64"),
    ("k_s0", "i64"), ("k_s1", "i64"), ("k_sh", "i64"),
    ("v_s0", "i64"), ("v_s1", "i64"), ("v_sh", "i64"),
    ("bt_sb", "i64"),
    ("out_sb", "i64"), ("out_si", "i64"), ("out_sh", "i64"), ("o_ss", "i64"),
    ("ol_sb", "i64"), ("ol_si", "i64"), ("ol_sh", "i64"), ("l_ss", "i64"),
    # the schedule's and the merges' (the single pass reads none of them)
    ("targets", "ptr"), ("meta", "ptr"), ("counters", "ptr"), ("ws_o", "ptr"), ("ws_lse", "ptr"),
    ("batch", "i32"), ("min_unit_granules", "i32"), ("balanced", "i32"),
    ("o_si", "i64"), ("o_sh", "i64"),
    ("l_si", "i64"), ("l_sh", "i64"),
    # last, so that the parameters before them keep their order (and ptxas its register allocation)
    ("last_page", "i32"), ("capacity", "i32"),
    # the spread's window (attnplan.schedule.slot_unit): after the rest, read once by the prologue
    ("spread_slots", "i32"),
)
#: (name, kind) of each merge kernel parameter, in order
MERGE_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("o", "ptr"), ("lse", "ptr"), ("meta", "ptr"), ("out", "ptr"), ("out_lse", "ptr"), ("sinks", "ptr"),
    ("batch", "i32"), ("q_len", "i32"), ("num_heads", "i32"),
    ("o_si", "i64"), ("o_sh", "i64"), ("o_ss", "i64"),
    ("l_si", "i64"), ("l_sh", "i64"), ("l_ss", "i64"),
    ("out_sb", "i64"), ("out_si", "i64"), ("out_sh", "i64"),
    ("ol_sb", "i64"), ("ol_si", "i64"), ("ol_sh", "i64"),
)
#: (name, kind) of each schedule probe parameter (a probe spec's ``attnplan_schedule_probe``), in order
PROBE_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("seq_lens", "ptr"), ("targets", "ptr"), ("meta", "ptr"), ("probe_units", "ptr"), ("res", "ptr"),
    ("batch", "i32"), ("window_left", "i32"), ("granule", "i32"), ("min_unit_granules", "i32"),
    ("max_units_per_seq", "i32"), ("balanced", "i32"), ("capacity", "i32"), ("slots", "i32"),
)
_SLOT_FORMAT = {"ptr": "Q", "i64": "q", "i32": "i4x", "f32": "f4x"}


@functools.lru_cache(maxsize=16)
def _struct_for(kinds: tuple[str, ...]) -> struct.Struct:
    return struct.Struct("<" + "".join(_SLOT_FORMAT[k] for k in kinds))


@functools.lru_cache(maxsize=16)
def _layout_for(signature: tuple[tuple[str, str], ...]):
    """A signature's packing, computed once: its struct, pointer slots, slot offsets and ``void*[n]`` array type."""
    kinds = tuple(k for _, k in signature)
    return (_struct_for(kinds), tuple(i for i, k in enumerate(kinds) if k == "ptr"),
            tuple(8 * i for i in range(len(kinds))), ctypes.c_void_p * len(kinds))


class PackedArgs:
    """Kernel arguments laid out for ``cuLaunchKernel(kernelParams=...)``.

    Each argument takes one 8-byte little-endian slot of :attr:`buffer` (pointers and int64 as 8
    bytes, int32 and float32 in the low 4 bytes); :attr:`pointers` is the ``void*[n]`` array of the
    slots' addresses, and :attr:`kernel_params` its address (what cuLaunchKernel takes). The driver
    copies the values during the call, so the object only has to outlive the call.

    Args:
        signature: ``(name, kind)`` pairs, kinds ``ptr`` / ``i64`` / ``i32`` / ``f32``.
        values: one value per argument (ints for pointers; ``None`` = null pointer).
    Raises:
        ValueError: the counts differ. struct.error: a value does not fit its kind.
    """

    def __init__(self, signature: tuple[tuple[str, str], ...], values: list):
        if len(signature) != len(values):
            raise ValueError(f"{len(values)} kernel arguments for a signature of {len(signature)}")
        st, ptr_slots, offsets, array_t = _layout_for(signature)
        if None in values:  # null pointers (None elsewhere: struct.error below)
            values = list(values)
            for i in ptr_slots:
                if values[i] is None:
                    values[i] = 0
        self.signature = signature
        self.buffer = ctypes.create_string_buffer(st.size)
        st.pack_into(self.buffer, 0, *values)
        base = ctypes.addressof(self.buffer)
        self.pointers = array_t(*[base + o for o in offsets])

    @property
    def kernel_params(self) -> int:
        return ctypes.addressof(self.pointers)

    def value(self, name: str):
        """Read an argument back from its slot (tests)."""
        for i, (n, k) in enumerate(self.signature):
            if n == name:
                addr = self.pointers[i]
                return struct.unpack("<" + _SLOT_FORMAT[k][0], ctypes.string_at(addr, 8 if k in ("ptr", "i64") else 4))[0]
        raise KeyError(name)


def _strides(t: torch.Tensor | None, n: int) -> list[int]:
    return [0] * n if t is None else [int(x) for x in t.stride()[:n]]


def check_layout(name: str, t: torch.Tensor, vec: int, align: int) -> None:
    """Check that the kernel may read ``t`` with ``align``-byte vectors of ``vec`` elements.

    Raises:
        ValueError: the last axis is not unit-stride, another stride is not a multiple of ``vec``
        elements, or the data pointer is not ``align``-byte aligned. Names the tensor and its strides.
    """
    if t.stride(-1) != 1:
        raise ValueError(f"cuda_ptx: {name} must have unit stride in its last axis, got strides {tuple(t.stride())}")
    bad = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if s % vec and n > 1]
    if bad or t.data_ptr() % align:
        raise ValueError(f"cuda_ptx: {name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, data_ptr "
                         f"{t.data_ptr():#x}) must be {align}-byte aligned with strides in multiples of {vec} "
                         "elements for the kernels' vector loads; pass a contiguous tensor")


def schedule_ints(schedule, batch: int) -> tuple[int, int, int, int, int]:
    """The kernels' schedule scalars of a plan's :class:`~attnplan.schedule.Schedule` (``None``: a single pass):
    ``(batch, granule, min_unit_granules, max_units_per_seq, balanced)``, ``balanced`` 1 when the targets are not
    all zero (the prologue then reads the batch's total)."""
    if schedule is None:
        return int(batch), 1, 1, 1, 0
    return (int(batch), int(schedule.granule), int(schedule.min_unit_granules), int(schedule.max_units_per_seq),
            int(any(schedule.targets)))


def partial_args(spec: KernelSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor | None, sm_scale: float,
                 out: torch.Tensor, out_lse: torch.Tensor | None, *, schedule=None, targets: torch.Tensor | None = None,
                 meta: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                 ws_o: torch.Tensor | None = None, ws_lse: torch.Tensor | None = None,
                 window_left: int = -1, soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 spread_slots: int = 0) -> list:
    """Argument values for :data:`PARTIAL_SIGNATURE` (no device access, no sync).

    Args:
        spec: a ``"partial"`` or ``"single"`` :class:`KernelSpec`.
        q: ``[B, Q, Hq, D]``; k_cache, v_cache: contiguous ``[B, T, Hkv, D]`` or paged
            ``[pages, page_size, Hkv, D]``; seq_lens ``[B]`` int32; block_table ``[B, max_pages]``
            int32 or ``None``.
        sm_scale: score scale; the kernel gets ``sm_scale * log2(e)`` (base-2 softmax).
        out: ``[B, Q, Hq, D]`` in q's dtype; out_lse: ``[B, Q, Hq]`` fp32 or ``None`` (rows of one-unit sequences,
            the single pass, the fused merge).
        schedule: the plan's :class:`~attnplan.schedule.Schedule` (``None`` for the single pass:
            :func:`schedule_ints`); targets: its int32 ``[64]`` table on the device; meta: int32 ``[2 B]`` for the
            separate merge (``None`` otherwise); counters: the fused merge's int32 ``[SplitPlan.sync_words]``
            (``None`` otherwise); ws_o / ws_lse: the ragged workspace ``o [1, Q, Hq, U, D]`` / ``lse [1, Q, Hq,
            U]`` fp32 (``None`` for the single pass).
        window_left: sliding window in tokens, -1 = none (used when ``spec.window``; any int >= -1: packed as
            ``min(window_left, kv_capacity(k_cache, block_table))``, the same visible positions for sequences up
            to the capacity); soft_cap: ``c`` of ``c * tanh(s / c)`` (used when ``spec.softcap``; the kernel gets
            ``c * log2(e)``).
        sinks: ``[num_q_heads]`` fp32 sink logits, joined where ``out`` is written (partial states exclude them).
        k_scale, v_scale: ``[num_kv_heads]`` fp32 dequantization scales of an fp8 cache (``spec.kv_fp8``).
        spread_slots: the most grid slots a batch of at most 32 sequences spreads its units over
            (:func:`attnplan.schedule.slot_unit`'s ``window``, :func:`attnplan.schedule.spread_window`); 0 = the
            whole grid.
    Strides are in elements. ``last_page`` is ``k_cache.shape[0] - 1`` for a paged cache (the clamp of the
    block-table entries), 0 for a contiguous one; ``capacity`` is :func:`kv_capacity` (the clamp of the lengths read
    from ``seq_lens``; at most ``2**31 - 1``, which clamps no int32 length from above).

    Raises:
        ValueError: ``window_left`` below -1, or ``spread_slots`` outside ``[0, 2^31)``.
    """
    if int(window_left) < -1:
        raise ValueError(f"window_left must be >= -1, got {window_left}")
    if not 0 <= int(spread_slots) <= INT32_MAX:
        raise ValueError(f"spread_slots must be in [0, 2^31), got {spread_slots}")
    window = int(window_left) if int(window_left) < 0 else min(int(window_left), kv_capacity(k_cache, block_table))
    bt = block_table
    batch, granule, min_c, max_per, balanced = schedule_ints(schedule, q.shape[0])
    o_si, o_sh, o_ss = (int(x) for x in ws_o.stride()[1:4]) if ws_o is not None else (0, 0, 0)
    l_si, l_sh, l_ss = (int(x) for x in ws_lse.stride()[1:4]) if ws_lse is not None else (0, 0, 0)
    return [
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_lens.data_ptr(),
        0 if bt is None else bt.data_ptr(), out.data_ptr(), _ptr(out_lse), _ptr(sinks), _ptr(k_scale), _ptr(v_scale),
        float(sm_scale) * LOG2E, float(soft_cap) * LOG2E, granule, max_per, int(k_cache.shape[2]), window,
        *_strides(q, 3), *_strides(k_cache, 3), *_strides(v_cache, 3),
        0 if bt is None else int(bt.stride(0)),
        *_strides(out, 3), o_ss, *_strides(out_lse, 3), l_ss,
        _ptr(targets), _ptr(meta), _ptr(counters), _ptr(ws_o), _ptr(ws_lse), batch, min_c, balanced,
        o_si, o_sh, l_si, l_sh,
        0 if bt is None else max(int(k_cache.shape[0]) - 1, 0), min(kv_capacity(k_cache, block_table), INT32_MAX),
        int(spread_slots),
    ]


def merge_args(o: torch.Tensor, lse: torch.Tensor, meta: torch.Tensor, out: torch.Tensor,
               out_lse: torch.Tensor | None, sinks: torch.Tensor | None = None) -> list:
    """Argument values for :data:`MERGE_SIGNATURE`: merge the ragged workspace ``o [1, Q, H, U, D]`` / ``lse [1, Q,
    H, U]`` into ``out [B, Q, H, D]`` and ``out_lse [B, Q, H]`` over the slots ``meta [2 B]`` names (``first[b]``
    then ``units[b]``, :func:`attnplan.schedule.first_slots`); ``sinks [H]`` fp32 contiguous join the denominator
    when given."""
    return [
        o.data_ptr(), lse.data_ptr(), meta.data_ptr(), out.data_ptr(), _ptr(out_lse), _ptr(sinks),
        int(out.shape[0]), int(o.shape[1]), int(o.shape[2]),
        *[int(x) for x in o.stride()[1:4]], *[int(x) for x in lse.stride()[1:4]], *_strides(out, 3),
        *_strides(out_lse, 3),
    ]


def probe_args(seq_lens: torch.Tensor, targets: torch.Tensor, meta: torch.Tensor | None, probe_units: torch.Tensor,
               res: torch.Tensor, schedule, window_left: int = -1, capacity: int = INT32_MAX, slots: int = 0) -> list:
    """Argument values for :data:`PROBE_SIGNATURE`: the schedule of the grid slots ``probe_units`` (int32 ``[n]``)
    into ``res`` (int32 ``[n, 8]``) for ``seq_lens`` (int32 ``[B]``) under ``schedule``, each length clamped into
    ``[0, capacity]`` (tokens; the default clamps only negative lengths); ``meta`` (int32 ``[2 B]``) is written when
    given. A window is packed as ``min(window_left, capacity)``, as :func:`partial_args` packs it. ``slots``: the
    unit slots a batch of at most 32 spreads its units over (the partial kernel's grid slots bounded by its
    ``spread_slots``: :func:`attnplan.schedule.slot_unit`'s ``min(slots, window)``); 0: each slot runs its own unit.

    Raises:
        ValueError: ``capacity`` negative, or ``slots`` outside ``[0, 2^31)`` (an int32 argument).
    """
    if int(capacity) < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if not 0 <= int(slots) <= INT32_MAX:
        raise ValueError(f"slots must be in [0, 2^31), got {slots}")
    cap = min(int(capacity), INT32_MAX)
    b, granule, min_c, max_per, balanced = schedule_ints(schedule, seq_lens.shape[0])
    window = max(int(window_left), -1)
    return [seq_lens.data_ptr(), targets.data_ptr(), _ptr(meta), probe_units.data_ptr(), res.data_ptr(), b,
            window if window < 0 else min(window, cap), granule, min_c, max_per, balanced, cap, int(slots)]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def expected_param_sizes(signature: tuple[tuple[str, str], ...]) -> list[int]:
    """Byte size of each parameter as the kernel declares it (for checking against the PTX)."""
    return [8 if k in ("ptr", "i64") else 4 for _, k in signature]
