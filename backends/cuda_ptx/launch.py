"""Kernel specializations, launch configuration, argument packing and driver-API launches.

Everything above :class:`DeviceRuntime` is plain Python that runs without a GPU (the CPU tests
exercise it): :class:`KernelSpec` fixes one specialization of ``decode.cu`` (the -D macros),
:func:`make_spec` chooses it from the problem, :func:`partial_launch_config` /
:func:`merge_launch_config` map the plan's grid onto a CUDA grid, :func:`partial_args` /
:func:`merge_args` list the kernel arguments from the tensors (pointers, strides in elements), and
:class:`PackedArgs` lays them out for ``cuLaunchKernel``'s ``kernelParams`` (one 8-byte slot per
argument plus an array of pointers to the slots).

:class:`DeviceRuntime` owns one device's state: the primary context (torch's), the modules loaded
with ``cuModuleLoadData`` and their ``CUfunction``s (dynamic shared memory raised with
``cuFuncSetAttribute``), and launches on torch's current stream with ``cuLaunchKernel``. Every
driver call is checked (:func:`~._bindings.check_driver`). A launch allocates no device memory and
never synchronizes the host, so it can be captured in a CUDA graph.

Kernel layout (see ``decode.cu`` for the method): a program is ``row_groups x kv_warps`` warps; a
row group holds ``rows_per_group`` of the ``GQA group x q_len`` rows in registers. Split-K: the
``kv_warps`` warps of a row group stream different KV tiles of the chunk through private
``stages``-deep ``cp.async`` rings and merge their softmax states through shared memory at the end. An fp8 KV cache
(``kv_dtype="float8_e4m3fn"``) carries 16 values per 16-byte vector; q stays fp16 / bf16.
Tensor-core split-K (``mma=True``; fp16 / bf16 caches and fp8 ones): the same rings and end merge, tiles
of ``passes`` 16-token m-tiles, rows in whole n8-tiles (``n_tiles`` per warp), ring rows of
``row_chunks`` 16-byte chunks (XOR-swizzled, or padded to an odd count) for conflict-free ``ldmatrix``;
the tile is sized in bytes, so an fp8 one holds twice the tokens (see :func:`_mma_spec`).
The fused merge (``merge="fused"``, partial kernels only; ``decode.cu``'s ``ATTNPLAN_MERGE``): the partial
kernel also takes ``out``, ``out_lse`` and the zeroed int32 ``counters`` (``plan.sync_words``), and merges the
group's states itself, so no merge kernel is launched.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from dataclasses import dataclass

import torch

from ._bindings import CudaPtxError, DriverError, bindings, check_driver
from .nvrtc import CompileCache, CompileTarget, Compiled, nvrtc_version, select_target
from .source import kernel_program

__all__ = [
    "KernelSpec", "make_spec", "merge_spec", "LaunchConfig", "partial_launch_config", "merge_launch_config",
    "PackedArgs", "PARTIAL_SIGNATURE", "MERGE_SIGNATURE", "partial_args", "merge_args", "check_layout",
    "pdl_launch_config",
    "DeviceRuntime", "DTYPE_CODES", "INFLIGHT_BYTES", "SMEM_BUDGET", "MAX_WARPS",
    "vector_layout", "max_rows", "FP8", "mma_unsupported", "MERGE_CODES",
    "merge_teams", "MERGE_CHUNK", "MAX_MERGE_TEAMS",
]

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
FP8 = "float8_e4m3fn"
KIND_CODES = {"partial": 0, "single": 1, "merge": 2}
#: the partial kernel's cross-program merge (``plan.merge``): none (a merge kernel follows, or single pass) or
#: fused (inside the partial kernel)
MERGE_CODES = {"none": 0, "fused": 1}
ENTRY = {"partial": "attnplan_decode_partial", "single": "attnplan_decode_single", "merge": "attnplan_merge"}

#: bytes of K+V one warp's ring stage holds (the tile), before capping by registers
TILE_BYTES = 4096
#: KV bytes a program should keep in flight (Little's law: ~33 GB/s per H200 SM x ~1.5 us)
INFLIGHT_BYTES = 48 * 1024
#: default dynamic shared memory budget per program: two programs fit an H100/H200 SM
SMEM_BUDGET = 96 * 1024
#: most warps in one program (keeps >= 255 registers per thread available)
MAX_WARPS = 8
#: score registers per lane (passes x rows) the tile is sized for
SCORE_REGS = 16
#: q + accumulator fp32 registers per lane (2 x rows x elements per lane) a row group may hold
ROW_REGS = 128
#: most rows one warp holds whatever the lane width (16 fp32 rows reach 255 registers)
MAX_ROWS_PER_WARP = 8
#: tensor-core path: bytes of K+V one warp's ring stage holds (tiles of whole 16-token m-tiles)
MMA_TILE_BYTES = 8192
#: tensor-core path: KV bytes a program keeps in flight. Measured on an H200 (bf16 32/8/128, batch 1 KV
#: 128K paged 16 and batch 16 KV 32K): 4 warps x 2 stages (32 KB in flight, 64 KB smem, up to 3 programs
#: per SM) was as fast or ~2-3% faster than 3 stages (48 KB, 96 KB smem); 4+ stages (1 program per SM) slower
MMA_INFLIGHT_BYTES = 32 * 1024
#: tensor-core path: n8-tiles per warp x head_dim at most (q B fragments + O^T accumulators:
#: 6 x head_dim / 16 registers per n8-tile, so 256 keeps them within 96 registers)
MMA_NTILE_DIMS = 256
#: merge kernel: splits whose o rows a one-warp merge team (head_dim <= 128) loads per memory round trip
#: (``decode.cu``'s ``MERGE_CHUNK``; 8 for head_dim 256's two-warp teams)
MERGE_CHUNK = 16
#: merge kernel: most teams per CTA (``decode.cu``'s ``ATTNPLAN_MERGE_TEAMS``: 1, 2, 4 or 8)
MAX_MERGE_TEAMS = 8
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def mma_unsupported(dtype: str, head_dim: int, kv_dtype: str | None = None) -> str:
    """Why the tensor-core path (``mma.sync`` m16n8k16) cannot serve these shapes; ``""`` if it can.

    It needs fp16 / bf16 q with the KV cache in q's dtype or in ``float8_e4m3fn`` (fp32 stays on CUDA
    cores) and head_dim a multiple of 16 (the mma's K-dim).
    """
    if dtype not in ("float16", "bfloat16"):
        return f"the tensor-core path needs float16 or bfloat16, got {dtype}"
    if kv_dtype not in (None, dtype, FP8):
        return f"the tensor-core path needs the KV cache in q's dtype {dtype} or {FP8}, got {kv_dtype}"
    if head_dim % 16:
        return f"the tensor-core path needs head_dim a multiple of 16, got {head_dim}"
    return ""


def vector_layout(dtype: str, head_dim: int) -> dict:
    """How one K/V row of ``dtype`` (the KV cache's) maps onto a warp (mirrors ``decode.cu``).

    Returns ``{"vec", "dv", "lpt", "nv", "tpp", "elems"}``: elements per 16-byte vector, vectors per
    row, lanes per token row, vectors per lane, tokens per warp pass, elements per lane.
    """
    vec = 16 // ELEM_BYTES[dtype]
    dv = head_dim // vec
    lpt = 32 if dv >= 32 else _pow2_ceil(dv)
    nv = -(-dv // lpt)
    return {"vec": vec, "dv": dv, "lpt": lpt, "nv": nv, "tpp": 32 // lpt, "elems": nv * vec}


@dataclass(frozen=True)
class KernelSpec:
    """One compile-time specialization of ``decode.cu``.

    Attributes:
        kind: ``"partial"`` (writes :class:`~attnplan.PartialState`), ``"single"`` (writes ``out`` and
            ``lse`` directly) or ``"merge"``.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (q and out; the KV cache too unless fp8).
        head_dim: channels per head (multiple of 8; of 16 with an fp8 cache).
        group, q_len: GQA group size and queries per sequence (rows = group x q_len); 1 for merge.
        page_size: tokens per page, 0 for a contiguous cache.
        kv_warps: warps per row group, taking different KV tiles of the chunk (split-K).
        row_groups: warp sets splitting the rows.
        stages: cp.async ring depth of each warp's ring.
        passes: warp passes per tile (tile tokens = passes x tokens per pass).
        window: sliding-window masking and chunk base (``window_left`` argument).
        softcap: logits soft-cap (``softcap_log2`` argument).
        kv_fp8: the KV cache is ``float8_e4m3fn`` (dequantized with the ``k_scale`` / ``v_scale`` arguments).
        mma: the tensor-core path (``ATTNPLAN_MMA``; fp16 / bf16 q, KV in q's dtype or fp8):
            ``passes`` is then the 16-token m-tiles of a warp's tile, rows go to warps in whole n8-tiles.
        merge: ``"none"``, or the in-kernel merge of a ``"partial"`` kernel (``ATTNPLAN_MERGE``): ``"fused"``
            (the last program of each (sequence, KV head) merges the group in split order).
        teams: merge kernel only (``ATTNPLAN_MERGE_TEAMS``): merge teams per CTA (1, 2, 4 or 8), each merging a
            contiguous range of the row's splits, combined through shared memory (:attr:`smem_bytes`); 1 = one
            team per row, no shared memory, no barrier. Chosen by :func:`merge_teams`.
    """

    kind: str
    dtype: str
    head_dim: int
    group: int = 1
    q_len: int = 1
    page_size: int = 0
    kv_warps: int = 1
    row_groups: int = 1
    stages: int = 2
    passes: int = 1
    window: bool = False
    softcap: bool = False
    kv_fp8: bool = False
    mma: bool = False
    merge: str = "none"
    teams: int = 1

    def __post_init__(self) -> None:
        if self.teams not in (1, 2, 4, 8) or (self.teams != 1 and self.kind != "merge"):
            raise ValueError(f"merge teams must be one of 1, 2, 4, 8, and > 1 only for a 'merge' kernel; got "
                             f"teams {self.teams!r} (kind {self.kind!r})")

    # -- derived, mirrored by decode.cu's static_asserts ----------------------------------------
    @property
    def kv_dtype(self) -> str:
        return FP8 if self.kv_fp8 else self.dtype

    @property
    def layout(self) -> dict:
        """The KV cache's :func:`vector_layout`."""
        return vector_layout(self.kv_dtype, self.head_dim)

    @property
    def rows(self) -> int:
        return self.group * self.q_len

    @property
    def rows_per_group(self) -> int:
        """Rows of one row group (tensor-core path: whole n8-tiles, padding rows included)."""
        rt = -(-self.rows // self.row_groups)
        return 8 * -(-rt // 8) if self.mma else rt

    @property
    def n_tiles(self) -> int:
        """Tensor-core path: n8-tiles (8 rows each) per warp; 1 otherwise."""
        return self.rows_per_group // 8 if self.mma else 1

    @property
    def tile_tokens(self) -> int:
        return self.passes * (16 if self.mma else self.layout["tpp"])

    @property
    def row_chunks(self) -> int:
        """16-byte chunks per token row of a ring tile: head_dim's; on the tensor-core path rounded up to
        an odd count (one padding chunk) when that is not a multiple of 8 (else the rows are XOR-swizzled)."""
        dv = self.layout["dv"]
        return dv | 1 if self.mma and dv % 8 else dv

    @property
    def stage_bytes(self) -> int:
        """K + V bytes of one ring stage (one warp tile)."""
        return 2 * self.tile_tokens * self.row_chunks * 16

    @property
    def num_warps(self) -> int:
        return self.row_groups * self.kv_warps

    @property
    def threads(self) -> int:
        if self.kind == "merge":  # teams x one row's team (4 head_dim columns per thread, whole warps)
            return self.teams * -(-self.head_dim // 4 // 32) * 32
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per program: the per-warp cp.async rings, reused by the final warp merge
        (``num_warps x rows_per_group x (head_dim + 2)`` fp32). The merge kernel with ``teams`` > 1: each team's
        partial result, ``teams x (head_dim + 2)`` fp32 (weighted column sums, then the running maxima and total
        weights); 0 for one team."""
        if self.kind == "merge":
            return 0 if self.teams == 1 else self.teams * (self.head_dim + 2) * 4
        ring = self.num_warps * self.stages * self.stage_bytes
        epilogue = self.num_warps * self.rows_per_group * (self.head_dim + 2) * 4
        return max(ring, epilogue)

    @property
    def entry(self) -> str:
        """The kernel's (``extern "C"``) name in the module."""
        return ENTRY[self.kind]

    @property
    def name(self) -> str:
        """File-name form spelling the specialization, e.g. ``partial-bfloat16-d128-g4-q1-page16-w1x4-s4-p4``
        (``-kvfp8`` for an fp8 cache, ``-mma`` for the tensor-core path, then ``-window`` / ``-softcap``, then
        ``-fused`` for the in-kernel merge); a merge kernel:
        ``merge-bfloat16-d128``, ``-t8`` for 8 teams per CTA."""
        if self.kind == "merge":
            return f"merge-{self.dtype}-d{self.head_dim}" + (f"-t{self.teams}" if self.teams > 1 else "")
        cache = f"page{self.page_size}" if self.page_size else "contig"
        return (f"{self.kind}-{self.dtype}-d{self.head_dim}-g{self.group}-q{self.q_len}-{cache}"
                f"-w{self.row_groups}x{self.kv_warps}-s{self.stages}-p{self.passes}"
                + ("-kvfp8" if self.kv_fp8 else "")
                + ("-mma" if self.mma else "")
                + ("-window" if self.window else "") + ("-softcap" if self.softcap else "")
                + ("" if self.merge == "none" else f"-{self.merge}"))

    def defines(self) -> dict[str, int]:
        """The -D macros of this specialization (``decode.cu`` header lists them)."""
        d = {"ATTNPLAN_KIND": KIND_CODES[self.kind], "ATTNPLAN_DTYPE": DTYPE_CODES[self.dtype],
             "ATTNPLAN_HEAD_DIM": self.head_dim, "ATTNPLAN_THREADS": self.threads}
        if self.kind == "merge":
            d.update({"ATTNPLAN_MERGE_TEAMS": self.teams, "ATTNPLAN_SMEM_BYTES": self.smem_bytes})
        else:
            d.update({"ATTNPLAN_GROUP": self.group, "ATTNPLAN_QLEN": self.q_len, "ATTNPLAN_PAGE_SIZE": self.page_size,
                      "ATTNPLAN_KV_WARPS": self.kv_warps, "ATTNPLAN_ROW_GROUPS": self.row_groups,
                      "ATTNPLAN_STAGES": self.stages, "ATTNPLAN_PASSES": self.passes,
                      "ATTNPLAN_SMEM_BYTES": self.smem_bytes, "ATTNPLAN_TILE_TOKENS": self.tile_tokens,
                      "ATTNPLAN_WINDOW": int(self.window), "ATTNPLAN_SOFTCAP": int(self.softcap),
                      "ATTNPLAN_KV_FP8": int(self.kv_fp8),
                      "ATTNPLAN_MMA": int(self.mma), "ATTNPLAN_MERGE": MERGE_CODES[self.merge]})
        return d

    def options(self) -> list[str]:
        """NVRTC options besides the architecture."""
        return ["-std=c++17", *(f"-D{k}={v}" for k, v in sorted(self.defines().items()))]


def _check_shape_support(dtype: str, head_dim: int, kv_dtype: str | None = None) -> None:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {dtype!r}")
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"head_dim must be a positive multiple of 8, got {head_dim}")
    if kv_dtype not in (None, dtype, FP8):
        raise ValueError(f"kv_dtype must be q's dtype {dtype} or {FP8}, got {kv_dtype!r}")
    if kv_dtype == FP8:
        if dtype == "float32":
            raise ValueError(f"an {FP8} KV cache needs q in float16 or bfloat16, got float32")
        if head_dim % 16:
            raise ValueError(f"an {FP8} KV cache needs head_dim a multiple of 16 (16-byte vectors), got {head_dim}")


def max_rows(dtype: str, head_dim: int) -> int:
    """Most GQA-group x q_len rows one program holds for this KV dtype and head_dim."""
    return MAX_WARPS * _rows_per_warp(dtype, head_dim)


def _rows_per_warp(dtype: str, head_dim: int) -> int:
    return min(MAX_ROWS_PER_WARP, ROW_REGS // (2 * vector_layout(dtype, head_dim)["elems"]))


@functools.lru_cache(maxsize=4096)
def make_spec(kind: str, dtype: str, head_dim: int, group: int, q_len: int, page_size: int | None, *,
              num_warps: int | None = None, num_stages: int | None = None,
              smem_limit: int = SMEM_BUDGET, window: bool = False, softcap: bool = False,
              kv_dtype: str | None = None, mma: bool | None = None,
              merge: str = "none", passes: int | None = None) -> KernelSpec:
    """Choose the partial / single-pass specialization for a problem.

    Args:
        kind: ``"partial"`` or ``"single"``.
        dtype, head_dim, group, q_len: the problem's (``dtype`` = q's).
        page_size: tokens per page, ``None`` or 0 for a contiguous cache.
        num_warps: KV warps per row group (config ``backend_options.cuda_ptx.num_warps``); ``None`` = 4 for
            one row group, fewer as row groups are added (at most 8 warps in all), on the tensor-core path
            fewer while two stages exceed the budget.
        num_stages: ring depth; ``None`` = enough to keep :data:`INFLIGHT_BYTES` in flight, capped so
            the program stays within ``min(SMEM_BUDGET, smem_limit)``.
        smem_limit: dynamic shared memory the device allows per program (opt-in), bytes; an explicit
            ``num_stages`` may use all of it.
        window, softcap: compile the sliding-window / soft-cap variants in.
        kv_dtype: the KV cache's dtype: ``None`` or ``dtype``, or ``"float8_e4m3fn"`` (q fp16 / bf16,
            head_dim a multiple of 16).
        mma: the tensor-core path (``decode.cu``'s ``ATTNPLAN_MMA``): ``None`` = wherever
            :func:`mma_unsupported` has no objection (fp8 KV included) and the program fits
            ``smem_limit`` (else the CUDA-core path), ``True`` = required, ``False`` = CUDA cores. An fp8
            spec is the same for every architecture: the kernel converts with ``cvt.rn.f16x2.e4m3x2`` from
            sm_89 on and with the integer decoder below (sm_80 / sm_86 compiles).
        merge: the in-kernel merge of a ``"partial"`` kernel: ``"none"`` (a merge kernel follows) or
            ``"fused"`` (the plan's ``merge``).
        passes: tensor-core path only: 16-token m-tiles per warp tile (config
            ``backend_options.cuda_ptx.passes``, 1, 2, 4 or 8); ``None`` = the tile of :data:`MMA_TILE_BYTES`.
            A tile that does not fit (registers, shared memory) raises instead of falling back to the CUDA-core
            path; with ``mma=False`` it is ignored (the CUDA-core tile follows its registers).
    Returns:
        the :class:`KernelSpec`. CUDA-core path: rows are split into row groups of at most ``min(8,
        ROW_REGS / (2 x elements per lane))`` rows; the tile is sized so a warp holds at most
        :data:`SCORE_REGS` scores and a stage holds at most :data:`TILE_BYTES`. Tensor-core path: rows go to warps in n8-tiles,
        at most ``MMA_NTILE_DIMS / head_dim`` per warp (fewest row groups, tiles spread evenly); the
        tile is whole 16-token m-tiles within :data:`MMA_TILE_BYTES` (of the KV dtype: fp8 tiles hold
        twice the tokens) and :data:`SCORE_REGS` scores; the
        default KV warps shrink until two stages of every warp fit ``min(SMEM_BUDGET, smem_limit)``;
        stages keep :data:`MMA_INFLIGHT_BYTES` in flight.
    Raises:
        ValueError: unsupported dtype / head_dim / kind, too many rows (fp8 KV: more than
        :func:`max_rows`, the CUDA-core fallback's, on either path), ``mma=True`` where
        the tensor-core path cannot serve, or options that exceed :data:`MAX_WARPS` warps or
        ``smem_limit``, an unknown ``merge`` or one on a
        ``"single"`` kernel.
    """
    if kind not in ("partial", "single"):
        raise ValueError(f"kind must be 'partial' or 'single', got {kind!r}")
    if merge not in MERGE_CODES:
        raise ValueError(f"merge must be one of {sorted(MERGE_CODES)}, got {merge!r}")
    if merge != "none" and kind != "partial":
        raise ValueError(f"merge {merge!r} is an in-kernel merge of the 'partial' kernel, not of {kind!r}")
    _check_shape_support(dtype, head_dim, kv_dtype)
    args = (kind, dtype, head_dim, group, q_len, int(page_size or 0), num_warps, num_stages, smem_limit,
            bool(window), bool(softcap))
    if kv_dtype == FP8 and group * q_len > max_rows(FP8, head_dim):  # either path: the CUDA-core one is the fallback
        raise ValueError(f"GQA group x q_len = {group * q_len} rows exceeds {max_rows(FP8, head_dim)} rows per program "
                         f"for {FP8} head_dim {head_dim}")
    if mma is None or mma:
        why = mma_unsupported(dtype, head_dim, kv_dtype)
        if mma and why:
            raise ValueError(f"mma=True: {why}")
        if not why:
            try:
                return _mma_spec(*args, kv_dtype, merge=merge, passes=passes)
            except ValueError:
                if mma or passes is not None:  # an explicit tensor-core tile never turns into the CUDA-core path
                    raise
    return _core_spec(*args, kv_dtype, merge=merge)


def _stages_and_check(base: KernelSpec, num_stages: int | None, smem_limit: int, rings: int,
                      inflight: int = INFLIGHT_BYTES) -> KernelSpec:
    """``base`` with its ring depth: enough stages for ``inflight`` bytes over ``rings`` rings within
    ``min(SMEM_BUDGET, smem_limit)`` (or ``num_stages``); raises if the program exceeds ``smem_limit``."""
    if num_stages is None:
        budget = min(SMEM_BUDGET, smem_limit)
        stages = min(8, max(2, 1 + -(-inflight // (rings * base.stage_bytes))))
        while stages > 2 and KernelSpec(**{**base.__dict__, "stages": stages}).smem_bytes > budget:
            stages -= 1
    else:
        stages = int(num_stages)
        if stages < 2:
            raise ValueError(f"num_stages must be >= 2 for the cp.async ring, got {num_stages}")
    spec = KernelSpec(**{**base.__dict__, "stages": stages})
    if spec.smem_bytes > smem_limit:
        raise ValueError(f"{spec.name} needs {spec.smem_bytes} bytes of shared memory per program, "
                         f"over the limit of {smem_limit}; lower num_stages or num_warps")
    return spec


def _core_spec(kind, dtype, head_dim, group, q_len, page_size, num_warps, num_stages, smem_limit, window, softcap,
               kv_dtype, merge="none") -> KernelSpec:
    """The CUDA-core specialization (see :func:`make_spec`)."""
    kvd = kv_dtype or dtype
    lay = vector_layout(kvd, head_dim)
    rows = group * q_len
    rt_max = _rows_per_warp(kvd, head_dim)
    row_groups = -(-rows // rt_max)
    if row_groups > MAX_WARPS:
        raise ValueError(f"GQA group x q_len = {rows} rows exceeds {max_rows(kvd, head_dim)} rows per program "
                         f"for {kvd} head_dim {head_dim}")
    rt = -(-rows // row_groups)
    row_bytes = head_dim * ELEM_BYTES[kvd]
    passes = min(_pow2_floor(max(1, SCORE_REGS // rt)), _pow2_floor(max(1, TILE_BYTES // (2 * lay["tpp"] * row_bytes))))
    if num_warps is None:
        kv_warps = 4 if row_groups == 1 else max(1, MAX_WARPS // row_groups)
    else:
        kv_warps = int(num_warps)
        if kv_warps < 1 or kv_warps * row_groups > MAX_WARPS:
            raise ValueError(f"num_warps {num_warps} x {row_groups} row group(s) must be in [1, {MAX_WARPS}] warps")
    base = KernelSpec(kind, dtype, head_dim, group, q_len, page_size, kv_warps, row_groups, 2, passes,
                      window, softcap, kvd == FP8, merge=merge)
    return _stages_and_check(base, num_stages, smem_limit, kv_warps)


def _mma_spec(kind, dtype, head_dim, group, q_len, page_size, num_warps, num_stages, smem_limit, window,
              softcap, kv_dtype=None, merge="none", passes=None) -> KernelSpec:
    """The tensor-core specialization (see :func:`make_spec`).

    The warp tile is sized in bytes (:data:`MMA_TILE_BYTES` of K + V per stage), not tokens: an fp8 cache
    (1 byte per element) gets twice the tokens per tile of a bf16 / fp16 one (head_dim 128: 2 m-tiles = 32
    tokens instead of 16), so the default 4 warps x 2 stages x 8 KB (64 KB of shared memory, 32 KB =
    :data:`MMA_INFLIGHT_BYTES` in flight per program) keeps the bytes in flight of the measured bf16
    default, i.e. twice its tokens. The larger tile also halves the per-token cost of the online softmax's
    row-max shuffles and rescales; its registers (2 m-tiles x n8-tiles x 4 scores + the P fragments) stay
    within :data:`SCORE_REGS` (head_dim 128, sm_90: 130-165 registers without spills, soft-cap included,
    with the fp8 kernels' ``__launch_bounds__(threads, 1)``: ``decode.cu``).
    """
    rows = group * q_len
    n8 = -(-rows // 8)
    row_groups = -(-n8 // max(1, MMA_NTILE_DIMS // head_dim))
    if row_groups > MAX_WARPS:
        raise ValueError(f"GQA group x q_len = {rows} rows needs {row_groups} row groups of n8-tiles on the tensor-core "
                         f"path for head_dim {head_dim}, more than {MAX_WARPS} warps")
    ntw = -(-n8 // row_groups)
    eb = ELEM_BYTES[kv_dtype or dtype]
    if passes is None:
        passes = max(1, min(_pow2_floor(max(1, MMA_TILE_BYTES // (2 * 16 * head_dim * eb))),
                            _pow2_floor(max(1, SCORE_REGS // (4 * ntw)))))
    elif passes not in (1, 2, 4, 8) or 4 * ntw * passes > 2 * SCORE_REGS:
        raise ValueError(f"passes {passes}: the tensor-core tile takes 1, 2, 4 or 8 m-tiles, and at most "
                         f"{2 * SCORE_REGS // (4 * ntw)} for {ntw} n8-tile(s) per warp")
    base = KernelSpec(kind, dtype, head_dim, group, q_len, page_size, 1, row_groups, 2, passes, window, softcap,
                      kv_dtype == FP8, True, merge)
    if num_warps is None:
        kv_warps = 4 if row_groups == 1 else max(1, MAX_WARPS // row_groups)
        budget = min(SMEM_BUDGET, smem_limit)
        while kv_warps > 1 and KernelSpec(**{**base.__dict__, "kv_warps": kv_warps}).smem_bytes > budget:
            kv_warps -= 1
    else:
        kv_warps = int(num_warps)
        if kv_warps < 1 or kv_warps * row_groups > MAX_WARPS:
            raise ValueError(f"num_warps {num_warps} x {row_groups} row group(s) must be in [1, {MAX_WARPS}] warps")
    base = KernelSpec(**{**base.__dict__, "kv_warps": kv_warps})
    return _stages_and_check(base, num_stages, smem_limit, kv_warps, MMA_INFLIGHT_BYTES)


@functools.lru_cache(maxsize=256)
def merge_spec(dtype: str, head_dim: int, teams: int = 1) -> KernelSpec:
    """The merge kernel's specialization: output dtype, head_dim and merge ``teams`` per CTA (1, 2, 4 or 8;
    :func:`merge_teams` chooses it).

    Raises:
        ValueError: an unsupported dtype or head_dim, or ``teams`` not one of 1, 2, 4, 8.
    """
    _check_shape_support(dtype, head_dim)
    return KernelSpec("merge", dtype, head_dim, teams=teams)  # KernelSpec checks the team count


def merge_teams(rows: int, num_splits: int, sm_count: int) -> int:
    """Merge teams per CTA for ``rows`` output rows ``(batch, query, q_head)`` of ``num_splits`` splits each on a
    device of ``sm_count`` SMs.

    One team per CTA walks a row's splits in ``ceil(num_splits / MERGE_CHUNK)`` dependent memory round trips
    (each thread loads ``MERGE_CHUNK`` = 16 splits' o rows per trip): with few rows and many splits the merge is
    latency bound. Measured on an H200 (CUPTI): batch 1, 1 KV head, 8 query heads (8 rows), 128 splits, one
    team: 9.3 us, each of the 8 CTAs walking 8 round trips. Several teams split a row's splits (contiguous
    ranges of whole chunks) and combine their partial results through shared memory.

    Rule: 1 team when the rows alone fill the device (``rows >= sm_count``: every SM already has a CTA, more
    threads per row add no latency hiding that other rows' CTAs do not) or one chunk holds the splits
    (``num_splits <= MERGE_CHUNK``: one round trip already); otherwise the smallest power of two ``T`` with
    ``T x MERGE_CHUNK >= num_splits`` (one round trip per team), capped at :data:`MAX_MERGE_TEAMS` (8: 256
    threads per CTA at head_dim <= 128, 512 at 256; with ``rows < sm_count`` that is fewer than ``8 x sm_count``
    CTAs). Measured with it (results/2026-11-30-s5-call3, CUPTI): 8 rows x 128 splits 9.3 -> 3.3 us (8 teams),
    8 rows x 187 splits 4.1 us, 32 rows x 32 splits 3.6 -> 2.9 us (2 teams); rows just below the SM count
    and the cap are unmeasured. Example: 8 rows, 128 splits, 132 SMs -> 8 teams of 16 splits each (one round trip
    each); 8 rows, 40 splits -> 4; 8 rows, 1000 splits -> 8; 200 rows -> 1.

    Raises:
        ValueError: a count below 1.
    """
    rows, num_splits, sm_count = int(rows), int(num_splits), int(sm_count)
    if min(rows, num_splits, sm_count) < 1:
        raise ValueError(f"merge_teams needs rows, num_splits and sm_count >= 1, got {rows}, {num_splits}, {sm_count}")
    if rows >= sm_count or num_splits <= MERGE_CHUNK:
        return 1
    return min(MAX_MERGE_TEAMS, _pow2_ceil(-(-num_splits // MERGE_CHUNK)))


# ------------------------------------------------------------------------------------------------
# launch configuration
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    """``cuLaunchKernel`` geometry: ``grid`` and ``block`` (x, y, z) and dynamic shared memory bytes."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def partial_launch_config(spec: KernelSpec, grid: tuple[int, int, int]) -> LaunchConfig:
    """Map the plan's grid ``(num_splits, num_kv_heads, batch)`` onto a CUDA grid.

    x = split, y = KV head, z = sequence while y and z fit CUDA's 65535 limit; otherwise the three
    are flattened onto x (the kernel decodes ``blockIdx`` linearly either way).

    Raises:
        ValueError: an axis is not positive, or the program count exceeds 2**31 - 1.
    """
    s, h, b = (int(x) for x in grid)
    if min(s, h, b) < 1:
        raise ValueError(f"grid {grid} must be positive on every axis")
    if h <= _MAX_GRID_YZ and b <= _MAX_GRID_YZ and s <= _MAX_GRID_X:
        cuda_grid = (s, h, b)
    elif s * h * b <= _MAX_GRID_X:
        cuda_grid = (s * h * b, 1, 1)
    else:
        raise ValueError(f"grid {grid} has {s * h * b} programs, more than a CUDA grid holds ({_MAX_GRID_X})")
    return LaunchConfig(cuda_grid, (spec.threads, 1, 1), spec.smem_bytes)


def merge_launch_config(spec: KernelSpec, rows: int) -> LaunchConfig:
    """One program per output row ``(batch, query, q_head)``: grid ``(rows, 1, 1)``, ``spec.threads`` threads
    (``spec.teams`` merge teams) and ``spec.smem_bytes`` of dynamic shared memory (the teams' combine; 0 for
    one team).

    Raises:
        ValueError: ``spec`` is not a merge kernel's, or ``rows`` is outside ``[1, 2**31 - 1]``.
    """
    if spec.kind != "merge":
        raise ValueError(f"merge_launch_config needs a merge kernel's spec, got {spec.name}")
    rows = int(rows)
    if rows < 1 or rows > _MAX_GRID_X:
        raise ValueError(f"merge rows must be in [1, {_MAX_GRID_X}], got {rows}")
    return LaunchConfig((rows, 1, 1), (spec.threads, 1, 1), spec.smem_bytes)


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------
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
        chunk_size: tokens per split; num_splits: splits of the grid (1 for single pass).
        window_left: sliding window in tokens (used when ``spec.window``); soft_cap: ``c`` of
            ``c * tanh(s / c)`` (used when ``spec.softcap``; the kernel gets ``c * log2(e)``).
        sinks: ``[num_q_heads]`` fp32 sink logits, for the single pass and the in-kernel merges (partial
            states exclude them).
        k_scale, v_scale: ``[num_kv_heads]`` fp32 dequantization scales of an fp8 cache (``spec.kv_fp8``).
        out, out_lse, counters: the fused merge's (``spec.merge == "fused"``): ``out [B, Q, Hq, D]`` in q's dtype,
            ``out_lse [B, Q, Hq]`` fp32 or ``None``, the zeroed int32 ``counters`` (``plan.sync_words``: one
            completion counter per (sequence, KV head)); ``None`` otherwise.
    Strides are in elements; a single-pass output has split stride 0.
    """
    single = spec.kind == "single"
    o_str = _strides(o, 3) + [0 if single else int(o.stride(3))]
    l_str = _strides(lse, 3) + ([0] if single or lse is None else [int(lse.stride(3))])
    bt = block_table
    return [
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seq_lens.data_ptr(),
        0 if bt is None else bt.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
        0 if sinks is None else sinks.data_ptr(),
        0 if k_scale is None else k_scale.data_ptr(), 0 if v_scale is None else v_scale.data_ptr(),
        float(sm_scale) * _LOG2E, float(soft_cap) * _LOG2E, int(chunk_size), int(num_splits), int(k_cache.shape[2]),
        int(window_left),
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


# ------------------------------------------------------------------------------------------------
# driver runtime (GPU only)
# ------------------------------------------------------------------------------------------------
class DeviceRuntime:
    """One CUDA device's driver-API state for the backend.

    Uses torch's primary context of device ``index`` (retained with ``cuDevicePrimaryCtxRetain`` and
    made current when a thread has none), loads modules with ``cuModuleLoadData`` and keeps their
    functions per :class:`KernelSpec`.

    Args:
        index: torch / driver device ordinal.
        cache: the compile cache.
    Raises:
        DriverError: a driver call fails (the message names it).
    """

    def __init__(self, index: int, cache: CompileCache):
        driver, _ = bindings()
        self.index = int(index)
        self.cache = cache
        self._lock = threading.Lock()
        self._functions: dict[KernelSpec, object] = {}
        self._modules: list = []
        self._tls = threading.local()
        with torch.cuda.device(self.index):
            torch.cuda.init()
            check_driver(driver.cuInit(0), "cuInit")
            self._device = check_driver(driver.cuDeviceGet(self.index), "cuDeviceGet")
            self.compute_capability = torch.cuda.get_device_capability(self.index)
            self._ctx = check_driver(driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
            self._ctx_int = int(self._ctx)
            self.smem_optin = int(check_driver(driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._device),
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)"))
            self.ensure_context()
        self.target: CompileTarget = select_target(self.compute_capability)
        # programmatic dependent launch: an sm_90+ device running code compiled for sm_90+ (the kernels'
        # griddepcontrol.wait exists only there; an older PTX fallback must not launch early). Fixed per
        # device: decided here, not on every launch
        arch = int("".join(ch for ch in self.target.arch if ch.isdigit()) or 0)
        self.pdl_supported: bool = self.compute_capability >= (9, 0) and arch >= 90

    def ensure_context(self) -> None:
        """Make this device's primary context current in the calling thread if it is not."""
        driver, _ = bindings()
        cur = check_driver(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(cur) != self._ctx_int:
            check_driver(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def compiled(self, spec: KernelSpec) -> Compiled:
        """The spec's image for this device (compile cache)."""
        return kernel_program().cached(self.cache, spec.name, spec.options(), self.target)

    def function(self, spec: KernelSpec):
        """The loaded ``CUfunction`` of ``spec`` (compiling and loading on first use)."""
        fn = self._functions.get(spec)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(spec)
            if fn is None:
                fn = self._load(spec)
                self._functions[spec] = fn
        return fn

    def _load(self, spec: KernelSpec):
        driver, _ = bindings()
        with torch.cuda.device(self.index):
            self.ensure_context()
            compiled = self.compiled(spec)
            try:
                module = check_driver(driver.cuModuleLoadData(compiled.image), "cuModuleLoadData")
            except DriverError as e:
                if compiled.source == "disk":  # a stale or damaged cache entry: rebuild once
                    self.cache.invalidate(compiled)
                    compiled = self.compiled(spec)
                    module = check_driver(driver.cuModuleLoadData(compiled.image), "cuModuleLoadData")
                else:
                    hint = ""
                    if compiled.target.kind == "ptx":
                        hint = (f"; the image is PTX for {compiled.target.arch} from NVRTC {nvrtc_version()} (the device's "
                                "architecture has no NVRTC cubin target); a driver older than NVRTC rejects newer PTX")
                    raise DriverError(f"{e} while loading {spec.name}{hint}") from None
            self._modules.append(module)
            fn = check_driver(driver.cuModuleGetFunction(module, spec.entry.encode()), f"cuModuleGetFunction({spec.entry})")
            if spec.smem_bytes > 48 * 1024:
                if spec.smem_bytes > self.smem_optin:
                    raise CudaPtxError(f"{spec.name} needs {spec.smem_bytes} bytes of shared memory; the device allows "
                                       f"{self.smem_optin} per block")
                check_driver(driver.cuFuncSetAttribute(
                    fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.smem_bytes),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={spec.smem_bytes})")
        return fn

    def launch(self, spec: KernelSpec, cfg: LaunchConfig, args: PackedArgs, stream: int, pdl: bool = False) -> None:
        """Launch ``spec`` on ``stream`` (torch's current stream handle). Launch only.

        ``pdl``: programmatic dependent launch (CUDA 12.x "PDL", as FlashInfer and TensorRT-LLM chain
        their decode kernels): ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
        so the kernel may start before the previous kernel of the stream has finished; the kernel must
        begin with ``griddepcontrol.wait`` (the merge kernel does). Ignored unless
        ``pdl_supported``. Otherwise ``cuLaunchKernel``. Captured by CUDA graphs either way (a
        programmatic edge for ``pdl``).
        """
        driver, _ = bindings()
        fn = self.function(spec)
        self.ensure_context()
        if pdl and self.pdl_supported:
            config = self._pdl_config(cfg)
            config.hStream = driver.CUstream(stream)
            check_driver(driver.cuLaunchKernelEx(config, fn, args.kernel_params, 0),
                         f"cuLaunchKernelEx({spec.name}, grid={cfg.grid}, block={cfg.block}, smem={cfg.smem}, pdl)")
            return
        check_driver(driver.cuLaunchKernel(fn, *cfg.grid, *cfg.block, cfg.smem, stream, args.kernel_params, 0),
                     f"cuLaunchKernel({spec.name}, grid={cfg.grid}, block={cfg.block}, smem={cfg.smem})")

    def _pdl_config(self, cfg: LaunchConfig):
        """A ``CUlaunchConfig`` for ``cfg`` with the programmatic-serialization attribute, cached per
        thread (its stream is set at each launch; building one costs ~2 us of Python)."""
        cache = getattr(self._tls, "pdl", None)
        if cache is None:
            cache = self._tls.pdl = {}
        config = cache.get(cfg)
        if config is None:
            config = cache[cfg] = pdl_launch_config(cfg)
        return config


def pdl_launch_config(cfg: LaunchConfig, stream: int = 0):
    """``CUlaunchConfig`` of ``cfg`` (grid, block, dynamic shared memory) on ``stream`` with one
    attribute, ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1`` (programmatic dependent
    launch). Host structures only: built and checked without a GPU."""
    driver, _ = bindings()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cfg.grid
    config.blockDimX, config.blockDimY, config.blockDimZ = cfg.block
    config.sharedMemBytes = cfg.smem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def expected_param_sizes(signature: tuple[tuple[str, str], ...]) -> list[int]:
    """Byte size of each parameter as the kernel declares it (for checking against the PTX)."""
    return [8 if k in ("ptr", "i64") else 4 for _, k in signature]

