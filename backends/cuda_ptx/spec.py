"""Kernel specializations of ``decode.cu`` and their launch geometry (plain Python, no GPU needed).

:class:`KernelSpec` fixes one specialization: the -D macros (:meth:`KernelSpec.defines`) and what follows from them
(rows per row group, the tile, the rings, threads and the dynamic shared memory). This is the one place the host
computes the kernel's layout; ``layout.cuh`` recomputes threads, the tile and the shared memory from the other
macros and static-asserts equality with ``ATTNPLAN_THREADS`` / ``_TILE_TOKENS`` / ``_SMEM_BYTES``, so a
mismatch fails the compile instead of the launch. :func:`make_spec` chooses a specialization for a problem (the
heuristics: warps, stages, tile sizes, the tensor-core path), :func:`merge_spec` / :func:`merge_teams` the merge
kernel's; :func:`partial_launch_config` / :func:`merge_launch_config` map a plan's grid onto a CUDA grid.

Kernel layout (see ``decode.cu`` and its headers for the method): a program is ``row_groups x kv_warps`` warps; a
row group holds ``rows_per_group`` of the ``GQA group x q_len`` rows in registers. Split-K: the ``kv_warps`` warps
of a row group stream different KV tiles of the unit through private ``stages``-deep ``cp.async`` rings and merge
their softmax states through shared memory at the end. An fp8 KV cache (``kv_dtype="float8_e4m3fn"``) carries 16
values per 16-byte vector; q stays fp16 / bf16. Tensor-core split-K (``mma=True``; fp16 / bf16 caches and fp8 ones):
the same rings and end merge, tiles of ``passes`` 16-token m-tiles, rows in whole n8-tiles (``n_tiles`` per warp),
ring rows of ``row_chunks`` 16-byte chunks (XOR-swizzled, or padded to an odd count) for conflict-free
``ldmatrix``; the tile is sized in bytes, so an fp8 one holds twice the tokens (see :func:`_mma_spec`). The
``"partial"`` kernel (a plan with several units per sequence) starts with the device-side schedule
(``schedule.cuh``); the ``"single"`` one (a single-pass plan) has none. The fused merge (``merge="fused"``,
partial kernels only; ``ATTNPLAN_MERGE``): the partial kernel also merges each (sequence, KV head)'s unit states,
so no merge kernel is launched (the arguments: :mod:`.args`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from attnplan.planner import FUSED_TEAM_UNITS

__all__ = [
    "KernelSpec", "make_spec", "merge_spec", "merge_teams", "LaunchConfig", "partial_launch_config",
    "merge_launch_config", "mma_unsupported", "vector_layout", "max_rows", "DTYPE_CODES", "ELEM_BYTES", "FP8",
    "KIND_CODES", "MERGE_CODES", "ENTRY", "PROBE_ENTRY", "TILE_BYTES", "INFLIGHT_BYTES", "SMEM_BUDGET", "MAX_WARPS", "SCORE_REGS",
    "ROW_REGS", "MAX_ROWS_PER_WARP", "MMA_TILE_BYTES", "MMA_INFLIGHT_BYTES", "MMA_NTILE_DIMS", "MERGE_CHUNK",
    "MAX_MERGE_TEAMS",
]

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
FP8 = "float8_e4m3fn"
KIND_CODES = {"partial": 0, "single": 1, "merge": 2}
#: the partial kernel's cross-program merge (``plan.merge``): none (a merge kernel follows, or single pass) or
#: fused (inside the partial kernel)
MERGE_CODES = {"none": 0, "fused": 1}
ENTRY = {"partial": "attnplan_decode_partial", "single": "attnplan_decode_single", "merge": "attnplan_merge"}
#: the schedule probe's entry (a ``"partial"`` spec with ``probe=True``: the prologue alone, for tests)
PROBE_ENTRY = "attnplan_schedule_probe"

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
#: (``layout.cuh``'s ``MERGE_CHUNK``; 8 for head_dim 256's two-warp teams)
MERGE_CHUNK = 16
#: merge kernel: most teams per CTA (``ATTNPLAN_MERGE_TEAMS``: 1, 2, 4 or 8)
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
    """How one K/V row of ``dtype`` (the KV cache's) maps onto a warp (mirrored by ``layout.cuh``: DV, LPT, NV, TPP).

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
        kind: ``"partial"`` (the scheduled partial kernel: one-unit sequences into ``out`` / ``lse``, the other
            units' states into the ragged workspace), ``"single"`` (single pass: ``out`` and ``lse`` directly, no
            schedule) or ``"merge"`` (the separate merge).
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
            contiguous range of the row's units, combined through shared memory (:attr:`smem_bytes`); 1 = one
            team per row, no shared memory, no barrier. Chosen by :func:`merge_teams`.
        probe: a ``"partial"`` spec's module also holds ``attnplan_schedule_probe`` (``ATTNPLAN_SCHEDULE_PROBE``),
            the prologue alone with the kernel's threads, and :attr:`entry` names it (tests of the schedule's
            integers); the partial kernel itself compiles as without it.
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
    probe: bool = False

    def __post_init__(self) -> None:
        if self.teams not in (1, 2, 4, 8) or (self.teams != 1 and self.kind != "merge"):
            raise ValueError(f"merge teams must be one of 1, 2, 4, 8, and > 1 only for a 'merge' kernel; got "
                             f"teams {self.teams!r} (kind {self.kind!r})")
        if self.probe and self.kind != "partial":
            raise ValueError(f"the schedule probe belongs to a 'partial' kernel, not to {self.kind!r}")

    # -- derived, mirrored by layout.cuh (threads, tile and shared memory checked by static_assert) -------
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
        """Dynamic shared memory per program, bytes: the per-warp cp.async rings (``num_warps x stages x
        stage_bytes``), reused by the final warp merge (``num_warps x rows_per_group x (head_dim + 2)`` fp32); the
        larger of the two. The merge kernel with ``teams`` > 1: each team's partial result, ``teams x (head_dim +
        2)`` fp32 (weighted column sums, then the running maxima and total weights); 0 for one team.

        The one place the host computes it: :func:`make_spec`'s budgets, the launch configuration and the driver's
        opt-in (:class:`~.runtime.DeviceRuntime`) all read this; ``layout.cuh`` computes ``SMEM_BYTES`` /
        ``MERGE_SMEM_BYTES`` from the other macros and static_asserts equality with ``ATTNPLAN_SMEM_BYTES``."""
        if self.kind == "merge":
            return 0 if self.teams == 1 else self.teams * (self.head_dim + 2) * 4
        ring = self.num_warps * self.stages * self.stage_bytes
        epilogue = self.num_warps * self.rows_per_group * (self.head_dim + 2) * 4
        return max(ring, epilogue)

    @property
    def entry(self) -> str:
        """The kernel's (``extern "C"``) name in the module (the probe's for a probe spec)."""
        return PROBE_ENTRY if self.probe else ENTRY[self.kind]

    @property
    def name(self) -> str:
        """File-name form spelling the specialization, e.g. ``partial-bfloat16-d128-g4-q1-page16-w1x4-s4-p4``
        (``-kvfp8`` for an fp8 cache, ``-mma`` for the tensor-core path, then ``-window`` / ``-softcap``, then
        ``-fused`` for the in-kernel merge, ``-probe`` for a schedule probe); a merge kernel:
        ``merge-bfloat16-d128``, ``-t8`` for 8 teams per CTA."""
        if self.kind == "merge":
            return f"merge-{self.dtype}-d{self.head_dim}" + (f"-t{self.teams}" if self.teams > 1 else "")
        cache = f"page{self.page_size}" if self.page_size else "contig"
        return (f"{self.kind}-{self.dtype}-d{self.head_dim}-g{self.group}-q{self.q_len}-{cache}"
                f"-w{self.row_groups}x{self.kv_warps}-s{self.stages}-p{self.passes}"
                + ("-kvfp8" if self.kv_fp8 else "")
                + ("-mma" if self.mma else "")
                + ("-window" if self.window else "") + ("-softcap" if self.softcap else "")
                + ("" if self.merge == "none" else f"-{self.merge}") + ("-probe" if self.probe else ""))

    def defines(self) -> dict[str, int]:
        """The -D macros of this specialization (``config.cuh`` and ``layout.cuh`` list them)."""
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
            if self.merge == "fused":
                d["ATTNPLAN_FUSED_TEAM"] = FUSED_TEAM_UNITS
            if self.probe:
                d["ATTNPLAN_SCHEDULE_PROBE"] = 1
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
        mma: the tensor-core path (``ATTNPLAN_MMA``, ``mma_loop.cuh``): ``None`` = wherever
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
    with the fp8 kernels' ``__launch_bounds__(threads, 1)``: ``layout.cuh``, ``MIN_CTAS_PER_SM``).
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
    CTAs). Measured with it on an H200 (CUPTI): 8 rows x 128 splits 9.3 -> 3.3 us (8 teams),
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


def partial_launch_config(spec: KernelSpec, units: int, num_kv_heads: int) -> LaunchConfig:
    """Map the plan's 1-D grid of ``units x num_kv_heads`` programs (unit-major: program ``p`` is unit ``p //
    num_kv_heads``, KV head ``p % num_kv_heads``) onto a CUDA grid.

    ``(1, num_kv_heads, units)`` while both fit CUDA's 65535 limit of ``y`` and ``z`` (the kernel reads ``h, u`` off
    ``blockIdx.y, .z`` without a division), else the programs in order along ``x`` (the kernel divides
    ``blockIdx.x``). The hardware dispatches ``x`` fastest, then ``y``: programs without a unit come last either way.

    Raises:
        ValueError: a count is not positive, or the program count exceeds 2**31 - 1.
    """
    units, h = int(units), int(num_kv_heads)
    if min(units, h) < 1:
        raise ValueError(f"units {units} and num_kv_heads {h} must be positive")
    if units <= _MAX_GRID_YZ and h <= _MAX_GRID_YZ:
        cuda_grid = (1, h, units)
    elif units * h <= _MAX_GRID_X:
        cuda_grid = (units * h, 1, 1)
    else:
        raise ValueError(f"{units} units x {h} KV heads = {units * h} programs, more than a CUDA grid holds "
                         f"({_MAX_GRID_X})")
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
