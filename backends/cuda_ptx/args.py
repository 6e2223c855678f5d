"""Kernel arguments: the parameter lists of ``decode.cu``'s entries, their values from tensors, and the packing for
``cuLaunchKernel`` (plain Python, no GPU needed).

:data:`PARTIAL_SIGNATURE` / :data:`MERGE_SIGNATURE` name each parameter and its kind in order (the compile tests check
them against the PTX entries: :func:`expected_param_sizes`); :func:`partial_args` / :func:`merge_args` list the values
from the tensors (data pointers, strides in elements; no device access, no sync); :class:`PackedArgs` lays them out as
``kernelParams`` (one 8-byte slot per argument plus an array of pointers to the slots); :func:`check_layout` checks
that a tensor can be read with the kernels' vector loads.

64 bits: every stride is an int64 argument and the kernels form every offset into a cache, the block table, q, out
or a state as a 64-bit product (page x page stride, sequence x sequence stride, token x token stride, head x head
stride, split x split stride); only offsets inside one tile or page (at most ``(tile - 1) x token stride +
head_dim`` elements, checked by the backend) and token positions are 32-bit. Token positions stay below 2**31 because
a cache holds at most :data:`MAX_KV_TOKENS` tokens per sequence (the backend refuses more, naming the tensor): the
rings and the block-table window run at most a few million tokens past a chunk's end. The 32-bit scalars are packed
so that every value the planner and the input validation allow fits: ``window_left`` as ``min(window_left,
capacity)`` (a window at least the cache's capacity restricts nothing), ``chunk_size`` as ``min(chunk_size,
MAX_KV_TOKENS)`` (a chunk at least the capacity makes one split of everything either way).
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from .spec import KernelSpec

__all__ = ["PARTIAL_SIGNATURE", "MERGE_SIGNATURE", "PackedArgs", "partial_args", "merge_args", "check_layout",
           "expected_param_sizes", "kv_capacity", "MAX_KV_TOKENS"]

#: most tokens a cache may hold per sequence (contiguous: ``k_cache.shape[1]``; paged: ``block_table.shape[1] x
#: page_size``), so that the kernels' 32-bit token positions, which run ahead of a chunk by the rings and the
#: block-table window (under 2**22 tokens for any specialization), stay below 2**31
MAX_KV_TOKENS = 2**30


def kv_capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Tokens a sequence of the cache can hold: ``k_cache.shape[1]`` (contiguous ``[B, T, Hkv, D]``), or
    ``block_table.shape[1] x page_size`` (paged ``[pages, page_size, Hkv, D]``). Shapes only: no device access."""
    if block_table is None:
        return int(k_cache.shape[1])
    return int(block_table.shape[1]) * int(k_cache.shape[1])

#: (name, kind) of each partial / single-pass kernel parameter, in order; kinds: ptr, i32, f32, i64
PARTIAL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("q", "ptr"), ("k_cache", "ptr"), ("v_cache", "ptr"), ("seq_lens", "ptr"), ("block_table", "ptr"),
    ("o", "ptr"), ("lse", "ptr"), ("sinks", "ptr"), ("k_scale", "ptr"), ("v_scale", "ptr"),
    ("scale_log2", "f32"), ("softcap_log2", "f32"), ("chunk_size", "i32"), ("num_splits", "i32"),
    ("num_kv_heads", "i32"), ("window_left", "i32"),
    ("q_sb", "i64"), ("q_si", "i64"), ("q_sh", "i64"),
    ("k_s0", "i64"), ("k_s1", "i64"), ("k_sh", "i64"),
    ("v_s0", "i64"), ("v_s1", "i64"), ("v_sh", "i64"),
    ("bt_sb", "i64"),
    ("o_sb", "i64"), ("o_si", "i64"), ("o_sh", "i64"), ("o_ss", "i64"),
    ("l_sb", "i64"), ("l_si", "i64"), ("l_sh", "i64"), ("l_ss", "i64"),
    # the fused merge's (null / 0 otherwise): out, out_lse, counters
    ("out", "ptr"), ("out_lse", "ptr"), ("counters", "ptr"),
    ("out_sb", "i64"), ("out_si", "i64"), ("out_sh", "i64"),
    ("ol_sb", "i64"), ("ol_si", "i64"), ("ol_sh", "i64"),
)
#: (name, kind) of each merge kernel parameter, in order
MERGE_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("o", "ptr"), ("lse", "ptr"), ("out", "ptr"), ("out_lse", "ptr"), ("sinks", "ptr"),
    ("num_splits", "i32"), ("q_len", "i32"), ("num_heads", "i32"),
    ("o_sb", "i64"), ("o_si", "i64"), ("o_sh", "i64"), ("o_ss", "i64"),
    ("l_sb", "i64"), ("l_si", "i64"), ("l_sh", "i64"), ("l_ss", "i64"),
    ("out_sb", "i64"), ("out_si", "i64"), ("out_sh", "i64"),
    ("ol_sb", "i64"), ("ol_si", "i64"), ("ol_sh", "i64"),
)
_SLOT_FORMAT = {"ptr": "Q", "i64": "q", "i32": "i4x", "f32": "f4x"}
_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=16)
def _struct_for(kinds: tuple[str, ...]) -> struct.Struct:
    return struct.Struct("<" + "".join(_SLOT_FORMAT[k] for k in kinds))


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
        kinds = tuple(k for _, k in signature)
        st = _struct_for(kinds)
        vals = [0 if v is None and k == "ptr" else v for v, k in zip(values, kinds)]
        self.signature = signature
        self.buffer = ctypes.create_string_buffer(st.size)
        st.pack_into(self.buffer, 0, *vals)
        base = ctypes.addressof(self.buffer)
        n = len(kinds)
        self.pointers = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))

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


def partial_args(spec: KernelSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor | None, sm_scale: float,
                 o: torch.Tensor, lse: torch.Tensor | None, chunk_size: int, num_splits: int, *,
                 window_left: int = -1, soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None) -> list:
    """Argument values for :data:`PARTIAL_SIGNATURE` (no device access, no sync).

    Args:
        spec: a ``"partial"`` or ``"single"`` :class:`KernelSpec`.
        q: ``[B, Q, Hq, D]``; k_cache, v_cache: contiguous ``[B, T, Hkv, D]`` or paged
            ``[pages, page_size, Hkv, D]``; seq_lens ``[B]`` int32; block_table ``[B, max_pages]``
            int32 or ``None``.
        sm_scale: score scale; the kernel gets ``sm_scale * log2(e)`` (base-2 softmax).
        o: partial: ``PartialState.o [B, Q, Hq, S, D]`` fp32; single: ``out [B, Q, Hq, D]``.
        lse: partial: ``[B, Q, Hq, S]`` fp32; single: ``[B, Q, Hq]`` fp32 or ``None``.
        chunk_size: tokens per split (any int >= 1; packed as ``min(chunk_size, MAX_KV_TOKENS)``); num_splits:
            splits of the grid (1 for single pass).
        window_left: sliding window in tokens, -1 = none (used when ``spec.window``; any int >= -1: packed as
            ``min(window_left, kv_capacity(k_cache, block_table))``, the same visible positions for sequences up
            to the capacity); soft_cap: ``c`` of ``c * tanh(s / c)`` (used when ``spec.softcap``; the kernel gets
            ``c * log2(e)``).
        sinks: ``[num_q_heads]`` fp32 sink logits, for the single pass and the fused merge (partial
            states exclude them).
        k_scale, v_scale: ``[num_kv_heads]`` fp32 dequantization scales of an fp8 cache (``spec.kv_fp8``).
        out, out_lse, counters: the fused merge's (``spec.merge == "fused"``): ``out [B, Q, Hq, D]`` in q's dtype,
            ``out_lse [B, Q, Hq]`` fp32 or ``None``, the zeroed int32 ``counters`` (``plan.sync_words``: one
            completion counter per (sequence, KV head)); ``None`` otherwise.
    Strides are in elements; a single-pass output has split stride 0.

    Raises:
        ValueError: ``window_left`` below -1 or ``chunk_size`` below 1.
    """
    if int(window_left) < -1 or int(chunk_size) < 1:
        raise ValueError(f"window_left must be >= -1 and chunk_size >= 1, got {window_left} and {chunk_size}")
    window = int(window_left) if int(window_left) < 0 else min(int(window_left), kv_capacity(k_cache, block_table))
    single = spec.kind == "single"
    o_str = _strides(o, 3) + [0 if single else int(o.stride(3))]
    l_str = _strides(lse, 3) + ([0] if single or lse is None else [int(lse.stride(3))])
    bt = block_table
    return [
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_lens.data_ptr(),
        0 if bt is None else bt.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
        0 if sinks is None else sinks.data_ptr(),
        0 if k_scale is None else k_scale.data_ptr(), 0 if v_scale is None else v_scale.data_ptr(),
        float(sm_scale) * _LOG2E, float(soft_cap) * _LOG2E, min(int(chunk_size), MAX_KV_TOKENS), int(num_splits),
        int(k_cache.shape[2]), window,
        *_strides(q, 3), *_strides(k_cache, 3), *_strides(v_cache, 3),
        0 if bt is None else int(bt.stride(0)),
        *o_str, *l_str,
        0 if out is None else out.data_ptr(), 0 if out_lse is None else out_lse.data_ptr(),
        0 if counters is None else counters.data_ptr(),
        *_strides(out, 3), *_strides(out_lse, 3),
    ]


def merge_args(o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None,
               num_splits: int, sinks: torch.Tensor | None = None) -> list:
    """Argument values for :data:`MERGE_SIGNATURE`: merge the first ``num_splits`` splits of
    ``o [B, Q, H, S, D]`` / ``lse [B, Q, H, S]`` into ``out [B, Q, H, D]`` and ``out_lse [B, Q, H]``
    (``sinks [H]`` fp32 contiguous join the denominator when given)."""
    return [
        o.data_ptr(), lse.data_ptr(), out.data_ptr(), 0 if out_lse is None else out_lse.data_ptr(),
        0 if sinks is None else sinks.data_ptr(),
        int(num_splits), int(o.shape[1]), int(o.shape[2]),
        *_strides(o, 4), *_strides(lse, 4), *_strides(out, 3), *_strides(out_lse, 3),
    ]


def expected_param_sizes(signature: tuple[tuple[str, str], ...]) -> list[int]:
    """Byte size of each parameter as the kernel declares it (for checking against the PTX)."""
    return [8 if k in ("ptr", "i64") else 4 for _, k in signature]
