"""The ``cuda_ptx`` backend: CUDA C kernels compiled at run time by NVRTC, launched with the driver API.

The kernels (``decode.cu`` and its headers, :mod:`.source`) are compiled through ``cuda.bindings.nvrtc`` to a
cubin for the device's exact architecture (PTX only as a fallback, see :mod:`.nvrtc`), cached in memory and on
disk, loaded with ``cuModuleLoadData`` into torch's primary context, and launched with ``cuLaunchKernel`` on
``torch.cuda.current_stream()`` (:mod:`.runtime`). Launches allocate nothing and never sync the host, so ``run``
can be captured in a CUDA graph (compile and load first: :meth:`CudaPtxBackend.prepare`, or one eager run before
capture). ``DecodeWrapper.run()`` launches through :class:`~.bound.BoundLaunch` (:meth:`CudaPtxBackend.bind`, made by
``plan()``): the checks and the argument packing done once per output layout, only the call's data pointers written
per call. :mod:`.spec` chooses a kernel's specialization and computes its layout (the kernel checks it),
:mod:`.args` lists and packs its arguments, :mod:`.emulate` runs the kernels' text on a CPU (tests).

Method: Flash-Decoding's split-KV (Dao et al. 2023) with the device-side schedule of :mod:`attnplan.schedule`
(the kernel contract of :mod:`attnplan.backends.base`). A plan fixes a 1-D grid of ``max_units x num_kv_heads``
programs; at every launch each program's prologue (``schedule.cuh``: a batch of at most 32 sequences by each warp alone,
one sequence per lane, without shared memory or barriers; a larger one by all the program's threads, reading
``seq_lens`` in chunks of at least 256 sequences, warp shuffles and one exchange through shared memory for the total, a
warp scan for the prefix sum) computes which (sequence, unit, token range) it serves, so one plan serves every length up
to its capacity and CUDA-graph replays. A program serves the whole GQA group and all queries (each KV byte read once)
where their rows fit (else the plan's query or head blocks launch again);
16-byte ``cp.async`` loads stream K and V through multi-stage shared-memory rings; fp32 accumulation with a base-2
online softmax. A sequence with one unit is written to ``out`` directly (the sink joined); a unit of a longer one
writes its partial state into workspace slot ``u``. A single-pass plan (one unit per sequence) runs the
schedule-free ``"single"`` kernel (``u = b``). The merges implement :func:`attnplan.state.merge_states`'s contract.

Cross-program merges (``plan.merge``; the global reduction of split-K, paid either by another kernel or inside
the partial one; peers: FlashInfer's ``merge_states`` and FlashAttention-2's split-KV combine, separate kernels
there):

* ``separate``: program 0 of the partial kernel writes ``workspace.meta`` (``first`` then ``units``:
  :func:`attnplan.schedule.first_slots`), then the merge kernel (one CTA per output row; it exits for rows of
  one-unit sequences; lanes over units,
  warp-shuffle max / sum, unrolled o loads; launched with PDL on sm_90+, allowed once every partial program has
  read its KV) merges the row's slots in slot order.
  Deterministic. With few rows and many units one team of threads per row is latency bound (H200, CUPTI: 8 rows x
  128 splits took 9.3 us, 8 dependent round trips of 16 splits' o rows per CTA), so the CTA then holds several
  merge teams (:func:`~.spec.merge_teams` of the plan's most units per sequence: 1 when the rows that may hold
  many units fill the SMs or 16 units hold them all, else up to 8; :meth:`CudaPtxBackend.merge_teams_for`), each
  merging a contiguous range of the units, combined through shared memory in team order (still deterministic for
  a given team count).
* ``fused``: one launch. Every unit of a sequence with several writes its state and gathers at a barrier, and one thread
  counts the program in its (sequence, KV head)'s completion counter with an ``atom.acq_rel.gpu`` add (its release is
  cumulative over the stores the barrier ordered before it, as in cooperative groups' grid sync); the program that
  brings it to the sequence's units (the others have released their states before) resets the counter to 0 and merges
  the group's GQA group x ``q_len`` rows over its units in unit order, reading the states through L2 (``ld.global.cg``)
  with the merge kernel's own per-row code (``merge_accumulate`` and ``merge_write``; the program's warps split into
  teams of one row's merge threads). A sequence of more than ``FUSED_TEAM_UNITS`` (16) units merges in two levels: each
  team of 16 consecutive units has its own counter, its last program merges the team's states in unit order into a team
  state over the team's first slot, and the program that counts the last team in the group's counter merges the team
  states in team order (no program merges more than 16 states a level; one program merging 49-128 units alone ran
  1.2-1.7x the merge kernel's step on an H100). Same math, same empty-row and sink handling as the merge kernel,
  deterministic (bitwise the same whichever programs finish last); the counters (``plan.sync_words`` int32, zero at
  rest) are back at zero after every launch, so graph replays work. The merge runs in the group's last program, on the
  step's critical path; whether it beats the separate launch is a measurement (the planner's cost model; Triton's fused
  merge measured slower on an H200).

The fused merge sits after the state write, so it serves every path (tensor-core and CUDA-core split-K, fp8 KV,
both cache layouts, window / soft-cap / sinks, ``q_len`` > 1).

Positions a row cannot see never affect it, NaN included: scores are selected away, tokens outside the rows'
union are never loaded (zero-filled copies), and with ``q_len`` > 1 the tiles holding positions some rows see and
others do not (a unit's last ``q_len - 1`` positions, a window's first) keep a non-finite V entry out of the rows
that cannot see it (P.V would multiply it by 0) and make it NaN in the rows that do, as the float64 reference does.
Every length read from ``seq_lens`` is clamped into ``[0, capacity]`` (the last kernel parameter, the tokens a
sequence of the cache holds) and every page index read from the block table into ``[0, num_pages)``, so lengths or
entries written on the device after ``plan()`` never make a kernel read outside the cache.
Strides: every offset into q, the caches, the block table, ``out``, ``lse`` and the workspace is a 64-bit product;
q's and the caches' strides must be multiples of 16 bytes (the kernels' vector loads; refused by name otherwise),
``out``'s and ``lse``'s leading strides may be any.

Tensor-core path (kernel option ``mma``, the default for fp16 / bf16 q with a cache of the same
dtype or float8_e4m3fn, head_dim a multiple of 16; ``ATTNPLAN_MMA``, ``mma_loop.cuh``). Sources:
FlashAttention-2's register-level online softmax on mma fragments, FlashInfer's tensor-core decode for
GQA, the PTX ISA's "Matrix fragments for mma.m16n8k16". With few query rows the products are computed transposed
("swap AB"): ``S^T[tokens, rows] = K . Q^T`` with ``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}``
(M = 16 KV tokens, N = 8 of the GQA group x q_len rows, K-dim = 16 of head_dim; q's B fragments in
registers, K's A fragments by ``ldmatrix`` from the warp's cp.async ring), the online softmax on the
accumulator fragments (row max: a 3-step shuffle over the 8 lanes sharing a row; row sums per lane,
reduced once at the end; exp2, fp32), then ``O^T[d, rows] += V^T . P^T`` (M = 16 head_dim columns,
K-dim = 16 tokens; V^T by ``ldmatrix.trans``, P rounded to q's dtype as in FlashAttention-2 and moved
into the B layout with ``movmatrix.trans``). A warp holds up to ``256 / head_dim`` n8-tiles of rows;
more rows take more row groups. Ring rows are XOR-swizzled (or padded by 16 bytes when head_dim / 8 is
not a multiple of 8) so ``ldmatrix`` is free of bank conflicts. Per 16 tokens and 8 rows a warp issues
``head_dim / 16`` ldmatrix + mma for each product instead of per-lane dot products and shuffle trees:
the CUDA-core split-K kernel is instruction-bound on an H200, the tensor-core one should not be.
Partial ``o`` then carries P's rounding (relative ~2^-9 for bf16, 2^-12 for fp16), as the Triton
backend's ``tl.dot`` does; ``lse`` stays fp32-exact up to accumulation order. fp32 and head_dims that are
not multiples of 16 keep the CUDA-core path.

fp8 KV on the tensor cores: the K / V tiles stay fp8 through the same cp.async rings (a stage of the bf16
default's 8 KB holds twice the tokens: 32 for head_dim 128, so 4 warps x 2 stages keep the same 32 KB in
flight) and are converted in registers right after ``ldmatrix`` (no 16-bit staging copy in shared memory: it would
cost a shared-memory pass of twice the tile's bytes for the same conversions). ``ldmatrix`` moves byte
pairs, which suffices because the mma's K-dim and O^T's head_dim order may be permuted: lane ``(g, t)``
gets 4 consecutive K bytes (dims ``4t..4t+3`` of a 16-dim step, q's B fragments loaded in that order), and
from ``ldmatrix.trans`` of V two tokens' dim pairs, regrouped per dim by one ``prmt``.
``cvt.rn.f16x2.e4m3x2`` (sm_89+) converts 2 values per instruction, exactly; sm_80 / sm_86 compiles use the
CUDA-core integer decoder plus one exact ``mul.rn.f16x2`` by 256 instead (the same spec, chosen in the
kernel by ``__CUDA_ARCH__``; the host emulation runs that form as the cvt's twin). Every fp8 mma is f16:
P rounds to fp16 whatever q's dtype, and bf16 q moves to fp16 once per program scaled by a power of two
per n8-tile (its largest |q| into [2^14, 2^15), the inverse folded into the score scale), so bf16 q also
converts K / V with one instruction per 2 values. The scales fold as on CUDA cores (``k_scale`` into the
score scale, ``v_scale`` into the normalized output); partial ``o`` carries fp16's P rounding.

fp8 KV (variant ``fp8_kv``): a ``float8_e4m3fn`` cache with per-KV-head fp32 ``k_scale`` /
``v_scale`` (q fp16 / bf16). It runs on the tensor cores (above) unless ``mma: false``; on the
CUDA cores (that option) a 16-byte load carries 16 fp8 values and the kernel decodes them
exactly with integer ops and the fp16 conversion (sign, 4-bit exponent bias 7, 3-bit mantissa,
subnormals, ``0x7f`` / ``0xff`` NaN). Either way ``k_scale[h]`` folds into q's score scale and
``v_scale[h]`` into the program's normalized output, so partial states and the merge are the same as
for fp16 caches. Rows per program are at most 32 (the CUDA-core kernel's 16 fp32 q + accumulator
registers per lane and row, twice fp16's; it is the tensor-core path's fallback).

Inside a program (split-K): a program has ``NRG`` row groups of ``RT`` rows (``R = NRG x RT`` rows = GQA group x
q_len) and ``W`` warps per row group; its unit has ``T`` tokens of head_dim ``D``, ``e`` bytes per KV element,
streamed in tiles of ``TILE`` tokens through ``S``-stage rings. Warp ``w`` of a row group takes tiles ``w, w + W,
...`` through its private ring (no CTA barrier in the main loop, 2 ``__syncwarp`` per tile): ``2 RT D T / W`` q.k
and as many P.V FLOPs per warp, ``NRG x 2 T D e`` KV bytes read per program (each row group streams the unit). At
the end the ``W`` warps' ``(m, l, acc)`` states of each row are merged through shared memory (``NRG W RT (D + 2)
4`` bytes written, ``W`` exp2 per output element, 2 ``__syncthreads``); the rings' ``NRG W S`` stages and that
buffer share the dynamic shared memory.

On CPU the backend is unavailable (it cannot run), but the kernels can be compiled and checked:
:meth:`CudaPtxBackend.compile` needs only NVRTC.
"""

from __future__ import annotations

import threading

import torch

from attnplan.backends.base import Backend, DecodeInputs, Workspace, one_launch
from attnplan.device import device_info
from attnplan.planner import SplitPlan
from attnplan.problem import DecodeProblem, dtype_name, torch_dtype
from attnplan.schedule import NUM_TARGETS, spread_window

from ._bindings import CudaPtxError, DriverError, NvrtcError
from .args import (
    MAX_KV_TOKENS, MERGE_SIGNATURE, PARTIAL_SIGNATURE, PackedArgs, check_layout, kv_capacity, merge_args, partial_args,
)
from .bound import BoundLaunch
from .nvrtc import CompileCache, Compiled, select_target
from .runtime import DeviceRuntime
from .source import kernel_program
from .spec import (
    FP8, MAX_MERGE_TEAMS, KernelSpec, make_spec, max_rows, merge_launch_config, merge_spec, merge_teams,
    mma_unsupported, partial_launch_config,
)

__all__ = ["CudaPtxBackend", "BoundLaunch", "CudaPtxError", "NvrtcError", "DriverError", "KernelSpec", "CompileCache",
           "spread_slots"]

#: shared-memory limit assumed when planning without a device (sm_86/sm_89 opt-in, the smallest >= sm_80)
_CPU_SMEM_LIMIT = 99 * 1024
#: most tokens of the default block_n (the schedule's granule) where one tile is not longer
BLOCK_N_CAP = 128


def _tristate(options: dict, name: str, null_means: str) -> bool | None:
    """Option ``name`` of ``options``: ``True``, ``False`` or ``None`` (= ``null_means``).

    Raises:
        ValueError: any other value (named, with what is allowed).
    """
    value = options.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"backend_options.cuda_ptx.{name} {value!r} must be true, false or null ({null_means})")
    return value


def spread_slots(plan: SplitPlan) -> int:
    """The partial kernel's ``spread_slots`` for ``plan`` (an int, in unit slots of the grid; raises nothing):
    :func:`attnplan.schedule.spread_window` of its SMs and KV heads for a scheduled plan that may see long-tailed
    batches (a capacity plan, or a live plan of a long-tailed batch), else 0 (the units spread over the whole grid).
    The window was measured on such plans only (benchmarks/NOTES.md, "Where a capacity plan's working programs sit:
    the spread's window"); a uniform live plan keeps the spread it was measured with."""
    if plan.single_pass or not (plan.capacity_mode or plan.problem.long_tailed):
        return 0
    return spread_window(plan.device.sm_count, plan.problem.num_kv_heads)


class _Launch:
    """What a (plan, workspace) pair fixes for the launches, computed and checked once: the partial (or single-pass)
    kernel's spec and CUDA geometry, the schedule (``None`` for a single pass), the merge kernel's spec and geometry
    (separate merge only) and whether it launches with PDL."""

    __slots__ = ("plan", "workspace", "spec", "cfg", "sched", "pdl", "merge_spec", "merge_cfg", "spread")


#: threads per SM of 8-team merge CTAs (the batch's rows x the CTA's threads, over the SMs) up to which
#: :meth:`CudaPtxBackend.merge_teams_for` counts one sequence's rows: an empirical bound from long-tailed capacity
#: plans on an H100 (132 SMs, head_dim 128: 256 threads a CTA): 256-512 rows (up to ~1,000 threads per SM) up to 12%
#: faster or level; 1,024 rows (~2,000) 0-0.6% slower; 2,048-4,096 rows 0.4-1.7% slower. Not an occupancy limit: the
#: 8-team CTA at head_dim 128 takes 124 registers a thread (ptxas, sm_90), so two are resident per SM and larger grids
#: run in waves of CTAs that mostly exit.
MERGE_THREADS_PER_SM = 1024


class CudaPtxBackend(Backend):
    """Split-KV decode with NVRTC-compiled CUDA C kernels (see the module docstring for the method).

    Support (as data): q / KV dtypes float16, bfloat16, float32 (q and KV the same), or a
    float8_e4m3fn KV cache with fp16 / bf16 q (variant ``fp8_kv``, head_dim a multiple of 16, up to
    32 rows per program); head_dim a multiple of 8 in [16, 256]; GQA group x q_len up to 64 rows per
    program, more queries in several launches of whole GQA groups (:meth:`q_block`), a larger GQA group in
    launches of blocks of its query heads (:meth:`head_block`); contiguous or paged caches with any power-of-two
    page size; variants sliding window, soft-cap, sinks and fp8 KV; cross-program merges separate (:meth:`merge`)
    and fused (inside :meth:`partial`);
    compute capability 8.0 or newer (``cp.async`` and the bf16 conversions).

    Kernel options (``backend_options.cuda_ptx`` in the config, or a tuned table's
    ``kernel_options.cuda_ptx.<layout>``): ``num_warps`` = KV warps per row group (default 4),
    ``num_stages`` = cp.async ring depth (default: enough for
    ~48 KB in flight), ``block_n`` = the schedule's granule alignment in tokens (a multiple of the kernel's tile),
    ``threads`` = total threads (alternative to ``num_warps``), ``passes`` = 16-token m-tiles per warp tile on
    the tensor-core path (default: 8 KB of K + V per stage), ``mma`` = the tensor-core
    path: ``None`` (auto: on wherever it serves, fp8 KV included), ``False`` (CUDA cores), ``True``
    (required; an error where it cannot serve), ``pdl`` = programmatic dependent launch of the merge kernel
    (default on). The plan's kernel options show the choice (``"mma": true``).

    Args:
        cache: the NVRTC compile cache; default: memory + ``$ATTNPLAN_CACHE_DIR`` / user cache dir.
    """

    name = "cuda_ptx"
    dtypes = frozenset({"float16", "bfloat16", "float32"})
    min_head_dim = 16
    max_head_dim = 256
    head_dim_multiple = 8
    max_rows_per_program = 64
    graph_safe = True
    vector_rows = True  # q and the caches in 16-byte vectors (args.check_layout, run()'s own check)
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})
    merge_strategies = frozenset({"separate", "fused"})
    #: merge_row spreads a group's splits over lanes with 8 o loads in flight per thread and its rows over
    #: the program's teams; 16 fitted to the merge benchmark on an H200 (fused 1.1-2.1 us faster than separate
    #: up to 16 splits, even at 32, 1.4 us slower at 25 splits of 128K): the cost model then picks the faster
    #: strategy on 7 of its 8 points and is within 1% on the eighth
    fused_merge_parallelism = 16
    #: its fused specialization streams long chunks 4-9% slower than the plain one (measured on an H200 at
    #: batch 4 with 16K-128K and batch 16 with 64K, with or without a stated register budget; cause not found),
    #: while up to 2048-token chunks it is 0.5-2 us faster: auto picks fused only there
    fused_merge_max_chunk = 2048
    option_aliases = (frozenset({"num_warps", "threads"}),)
    #: oldest compute capability served
    min_compute_capability: tuple[int, int] = (8, 0)

    def __init__(self, cache: CompileCache | None = None):
        self.cache = cache if cache is not None else CompileCache()
        self._launches: dict[tuple[int, int], _Launch] = {}
        self._runtimes: dict[int, DeviceRuntime] = {}
        self._available: dict[int, tuple[bool, str]] = {}
        self._lock = threading.Lock()

    # -- availability and support -----------------------------------------------------------------
    def available(self, device: torch.device) -> tuple[bool, str]:
        """Available only on a CUDA device of compute capability >= 8.0 with cuda-python importable
        and NVRTC loadable; the reason otherwise."""
        device = torch.device(device)
        if device.type != "cuda":
            return False, "cuda_ptx runs only on CUDA devices; on CPU it is compiled and checked, not run"
        if not torch.cuda.is_available():
            return False, "CUDA is not available (torch.cuda.is_available() is False)"
        index = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._available.get(index)
        if hit is None:
            hit = self._check_available(index)
            self._available[index] = hit
        return hit

    def _check_available(self, index: int) -> tuple[bool, str]:
        cc = torch.cuda.get_device_capability(index)
        if tuple(cc) < self.min_compute_capability:
            return False, (f"cuda_ptx needs compute capability >= {self.min_compute_capability[0]}."
                           f"{self.min_compute_capability[1]} (cp.async, bf16 conversions); cuda:{index} has {cc[0]}.{cc[1]}")
        try:
            select_target(cc)
        except Exception as e:  # noqa: BLE001 - import errors, missing libraries: a reason, not a crash
            return False, f"cuda_ptx: cuda-python / NVRTC unusable: {type(e).__name__}: {e}"
        try:
            self._runtime(index)
        except Exception as e:  # noqa: BLE001
            return False, f"cuda_ptx: CUDA driver API unusable on cuda:{index}: {type(e).__name__}: {e}"
        return True, ""

    def supports(self, problem: DecodeProblem) -> list[str]:
        """Reasons this backend cannot serve ``problem`` (empty list: it can)."""
        reasons = super().supports(problem)
        if problem.kv_dtype == FP8:
            if problem.q_dtype not in ("float16", "bfloat16"):
                reasons.append(f"an {FP8} KV cache needs q_dtype float16 or bfloat16, got {problem.q_dtype}")
            if problem.head_dim % 16:
                reasons.append(f"an {FP8} KV cache needs head_dim a multiple of 16, got {problem.head_dim}")
        elif problem.q_dtype != problem.kv_dtype:
            reasons.append(f"q_dtype {problem.q_dtype} must equal kv_dtype {problem.kv_dtype} (or be {FP8})")
        return reasons

    def rows_per_program(self, problem: DecodeProblem) -> int:
        """64 (:attr:`max_rows_per_program`); 32 for an fp8 cache at every head_dim (:func:`~.spec.max_rows`: the
        CUDA-core path's registers, the tensor-core path's fallback)."""
        if problem.kv_dtype == FP8:
            return min(self.max_rows_per_program, max_rows(FP8, problem.head_dim))
        return self.max_rows_per_program

    # -- planning ---------------------------------------------------------------------------------
    def _smem_limit(self, device: torch.device | None) -> int:
        if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
            dev = torch.device(device)
            return self._runtime(dev.index if dev.index is not None else torch.cuda.current_device()).smem_optin
        return _CPU_SMEM_LIMIT

    def kernel_config(self, problem: DecodeProblem, options: dict, device: torch.device) -> dict:
        """Kernel options for ``problem``: ``block_n`` (tokens; the schedule's granule is a multiple of it) = the
        tokens one pass of the program's warps covers by default (tile x KV warps), at most :data:`BLOCK_N_CAP` unless
        one tile is longer, plus the specialization's
        ``num_warps``, ``num_stages``, ``threads``, ``tile_tokens``, ``row_groups``, ``passes`` and ``mma``
        (option ``mma``: ``None`` = the tensor-core path wherever it serves, see :func:`~.spec.make_spec`;
        ``False`` = CUDA cores; ``True`` = required). ``pdl`` (option ``pdl``, default on): the merge kernel is launched with
        programmatic dependent launch on sm_90+ (see :meth:`~.runtime.DeviceRuntime.launch`).

        Raises:
            ValueError: options that do not fit the kernel (named, with what is allowed).
        """
        options = options or {}
        limit = self._smem_limit(device)
        mma = _tristate(options, "mma", "auto")
        if mma:
            why = mma_unsupported(problem.q_dtype, problem.head_dim, problem.kv_dtype)
            if why:
                raise ValueError(f"backend_options.cuda_ptx.mma true: {why}")
        args = (problem.q_dtype, problem.head_dim, problem.group_size, problem.q_len, problem.page_size)
        kw = dict(smem_limit=limit, kv_dtype=problem.kv_dtype, mma=mma)
        warps = options.get("num_warps")
        if warps is None and options.get("threads"):
            rg = make_spec("partial", *args, **kw).row_groups
            threads = int(options["threads"])
            if threads % (32 * rg):
                raise ValueError(f"backend_options.cuda_ptx.threads {threads} must be a multiple of 32 x {rg} row group(s)")
            warps = threads // (32 * rg)
        spec = make_spec("partial", *args, num_warps=warps, num_stages=options.get("num_stages"),
                         passes=options.get("passes"), **kw)
        tile = spec.tile_tokens
        # one pass of the program's warps (a tile each), at most BLOCK_N_CAP tokens unless one tile is longer: the
        # schedule's granule, so a short capacity still splits (head_dim 32: 64-token tiles x 4 warps would make
        # 256-token granules, one unit for any sequence up to 256 tokens); head_dim 128's measured defaults (bf16 64,
        # fp8 128) are within it
        block_n = int(options.get("block_n") or max(tile, min(tile * spec.kv_warps, BLOCK_N_CAP)))
        if block_n % tile:
            raise ValueError(f"backend_options.cuda_ptx.block_n {block_n} must be a multiple of the kernel's tile of "
                             f"{tile} tokens for {problem.kv_dtype} head_dim {problem.head_dim}")
        pdl = _tristate(options, "pdl", "on")
        return {"block_n": block_n, "num_warps": spec.kv_warps, "num_stages": spec.stages, "threads": spec.threads,
                "tile_tokens": tile, "row_groups": spec.row_groups, "passes": spec.passes, "mma": spec.mma,
                "pdl": True if pdl is None else pdl}

    def spec_for(self, kind: str, plan: SplitPlan, device: torch.device | None = None) -> KernelSpec:
        """The :class:`KernelSpec` that executes ``plan``: ``kind`` ``"partial"`` = the kernel :meth:`partial`
        launches (the schedule-free ``"single"`` kernel for a single-pass plan, else the scheduled ``"partial"``
        one, carrying the fused merge when ``plan.merge == "fused"``); ``"merge"`` = the separate merge kernel, with
        :meth:`merge_teams_for` teams per CTA (``device``'s SM count; the plan's device without one). The variants
        (window, soft-cap, fp8 KV) follow the plan's problem; ``device`` bounds the shared memory (the CPU stand-in's
        without one).

        Raises:
            ValueError: an unknown ``kind``, or kernel options that do not fit this backend's kernel (a plan made for
                another backend: re-plan).
        """
        p = plan.problem
        if kind == "merge":
            return merge_spec(p.q_dtype, p.head_dim, self.merge_teams_for(plan, device))
        if kind != "partial":
            raise ValueError(f"kind must be 'partial' or 'merge', got {kind!r}")
        k = plan.kernel
        # the plan's CUDA-core choice stays; its tensor-core one is taken as "auto" (make_spec falls back to
        # CUDA cores where the tensor-core program does not fit this device's shared memory, never raises)
        mma = False if k.get("mma") is False else None
        return make_spec("single" if plan.single_pass else "partial", p.q_dtype, p.head_dim, p.group_size, p.q_len,
                         p.page_size, num_warps=k.get("num_warps"), num_stages=k.get("num_stages"),
                         smem_limit=self._smem_limit(device), window=p.window_left >= 0, softcap=p.soft_cap > 0,
                         kv_dtype=p.kv_dtype, mma=mma, merge="fused" if plan.merge == "fused" else "none",
                         passes=k.get("passes") if k.get("mma") else None)

    @staticmethod
    def merge_teams_for(plan: SplitPlan, device: torch.device | None = None) -> int:
        """Merge teams per merge-kernel CTA for ``plan`` (:func:`~.spec.merge_teams`, where the rule and the
        measurement behind it are): the rows that may each hold many units, the most units one row may have
        (``plan.schedule.max_units_per_seq``) and the SM count of ``device`` (:func:`attnplan.device.device_info`;
        the plan's device fingerprint when ``device`` is None).

        The rows are the plan's ``batch x q_len x num_q_heads``, except for a schedule that sizes units from the
        lengths (``balanced``, ``batch_invariant``) whose merge grid of 8-team CTAs stays within
        :data:`MERGE_THREADS_PER_SM` threads per SM: there one sequence's ``q_len x num_q_heads``. In such a
        schedule one long sequence among short ones gets most of the units while its batchmates' rows have one (their
        CTAs exit at once), so its few rows would walk their units with one team whatever the batch (one dependent
        round trip per 16 units: H100, 8/1/128, 64 sequences, one 128K sequence's 171 units, the step 57.0 -> 50.3 us
        with 8 teams). In larger grids the 8-team CTAs cost more than they save (the same change at 2,048-4,096 rows:
        0.4-1.7% slower steps), and the batch's rows decide. E.g. a forced 128 splits at batch 1 with 8 query
        heads on an H200 (132 SMs): 8; at batch 32 (256 rows): 1; a capacity plan of 8 query heads and head_dim 128 (up
        to 256 units per sequence): 8 up to batch 66, 1 beyond."""
        p = plan.problem
        rows = p.batch * p.q_len * p.num_q_heads
        sm_count = device_info(device).sm_count if device is not None else plan.device.sm_count
        if plan.schedule.sized_by_lengths and \
                rows * merge_spec(p.q_dtype, p.head_dim, MAX_MERGE_TEAMS).threads <= MERGE_THREADS_PER_SM * sm_count:
            rows = p.q_len * p.num_q_heads
        return merge_teams(rows, plan.schedule.max_units_per_seq, sm_count)

    def compile(self, spec: KernelSpec, compute_capability: tuple[int, int] = (9, 0)) -> Compiled:
        """Compile ``spec`` for ``compute_capability`` through the compile cache (no GPU needed).

        Raises:
            NvrtcError: NVRTC is unusable or the compile fails (message with NVRTC's log).
        """
        return kernel_program().cached(self.cache, spec.name, spec.options(), select_target(compute_capability))

    def prepare(self, plan: SplitPlan, device: torch.device) -> None:
        """Compile and load every kernel ``plan`` launches on ``device`` (call before CUDA-graph capture)."""
        device = torch.device(device)
        rt = self._runtime_for(device)
        for kind in ("partial", "merge") if plan.merge == "separate" else ("partial",):
            rt.function(self.spec_for(kind, plan, device))

    def prepare_merge(self, plan: SplitPlan, device: torch.device) -> None:
        """Compile and load only ``plan``'s separate merge kernel on ``device`` (a merge-only plan, whose rows
        need not fit one partial program: context parallelism's)."""
        device = torch.device(device)
        self._runtime_for(device).function(self.spec_for("merge", plan, device))

    # -- launches ---------------------------------------------------------------------------------
    def _runtime(self, index: int) -> DeviceRuntime:
        rt = self._runtimes.get(index)
        if rt is None:
            with self._lock:
                rt = self._runtimes.get(index)
                if rt is None:
                    rt = DeviceRuntime(index, self.cache)
                    self._runtimes[index] = rt
        return rt

    def _runtime_for(self, device: torch.device) -> DeviceRuntime:
        if device.type != "cuda":
            raise ValueError(f"cuda_ptx runs only on CUDA tensors, got tensors on {device}")
        return self._runtime(device.index if device.index is not None else torch.cuda.current_device())

    def _launch(self, spec: KernelSpec, cfg, signature, values, device: torch.device, pdl: bool = False) -> None:
        rt = self._runtime_for(device)
        args = PackedArgs(signature, values)
        if rt.index != torch.cuda.current_device():
            with torch.cuda.device(rt.index):
                rt.launch(spec, cfg, args, torch.cuda.current_stream(rt.index).cuda_stream, pdl)
        else:
            rt.launch(spec, cfg, args, torch.cuda.current_stream(rt.index).cuda_stream, pdl)

    def _launch_state(self, plan: SplitPlan, workspace: Workspace, partial: bool = True,
                      remember: bool = True) -> _Launch:
        """The launch constants of ``(plan, workspace)``, computed and checked once (kept in ``self._launches``, by
        identity, when ``remember``: a :class:`~.bound.BoundLaunch` holds its own and keeps nothing here, so its
        wrapper's workspace dies with the wrapper, e.g. one allocated in a torch.compile CUDA-graph pool);
        ``partial=False``: the merge's only (no partial kernel spec: a merge-only plan's rows need not fit one
        program)."""
        key = (id(plan), id(workspace))
        hit = self._launches.get(key)
        if hit is not None and hit.plan is plan and hit.workspace is workspace \
                and (hit.spec is not None or not partial):
            return hit
        self._check_workspace(plan, workspace)
        p, s = plan.problem, plan.schedule
        device = workspace.targets.device
        L = _Launch()
        L.plan, L.workspace = plan, workspace
        L.spec = self.spec_for("partial", plan, device) if partial else None
        L.cfg = partial_launch_config(L.spec, s.max_units, p.num_kv_heads) if partial else None
        L.sched = None if plan.single_pass else s
        L.spread = spread_slots(plan)
        L.pdl = bool(plan.kernel.get("pdl", True))
        if plan.merge == "separate":
            L.merge_spec = self.spec_for("merge", plan, device)
            L.merge_cfg = merge_launch_config(L.merge_spec, p.batch * p.q_len * p.num_q_heads)
        else:
            L.merge_spec = L.merge_cfg = None
        if remember:
            if len(self._launches) >= self.launch_table_max:
                self._launches.clear()
            self._launches[key] = L
        return L

    @staticmethod
    def _check_workspace(plan: SplitPlan, workspace: Workspace) -> None:
        """What the kernels assume of ``workspace`` (:meth:`Workspace.allocate`'s buffers serve): the ragged fp32 state
        ``o [1, Q, H, >= max_units, D]`` (16-byte aligned rows of unit stride: float4 stores) and ``lse [1, Q, H,
        >= max_units]`` (any strides) unless single pass, int32 ``targets [64]``, ``meta [>= 2 B]`` for the separate
        merge and ``counters`` for the fused one (a launch's ``sync_words``, contiguous), all on one device.

        Raises:
            ValueError: naming the buffer, what it is and what the kernels need.
        """
        p, s = plan.problem, plan.schedule
        dev = workspace.targets.device
        t = workspace.targets
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < NUM_TARGETS or t.stride(0) != 1:
            raise ValueError(f"workspace.targets must be a contiguous int32 [{NUM_TARGETS}] tensor, got "
                             f"{tuple(t.shape)} {t.dtype} strides {tuple(t.stride())}")
        if not plan.single_pass:
            st = workspace.state
            if st is None:
                raise ValueError("workspace has no state for a plan with several units per sequence (Workspace.allocate)")
            o, ls = st.o, st.lse
            want = (1, p.q_len, p.num_q_heads)
            if o.dtype != torch.float32 or ls.dtype != torch.float32 or tuple(o.shape[:3]) != want \
                    or o.shape[4] != p.head_dim or o.shape[3] < s.max_units or tuple(ls.shape) != tuple(o.shape[:4]):
                raise ValueError(f"workspace.state must be float32 o [1, {p.q_len}, {p.num_q_heads}, >= {s.max_units}, "
                                 f"{p.head_dim}] and lse [1, {p.q_len}, {p.num_q_heads}, >= {s.max_units}], got o "
                                 f"{tuple(o.shape)} {o.dtype}, lse {tuple(ls.shape)} {ls.dtype}")
            check_layout("workspace.state.o", o, 4, 16)
            if o.device != dev or ls.device != dev:
                raise ValueError(f"workspace.state is on {o.device} / {ls.device}, workspace.targets on {dev}")
        for name, buf, words, need in (("meta", workspace.meta, 2 * p.batch, plan.merge == "separate"),
                                       ("counters", workspace.counters, plan.sync_words // len(plan.launches),
                                        plan.merge == "fused")):
            if need and (not isinstance(buf, torch.Tensor) or buf.dtype != torch.int32 or buf.dim() != 1
                         or buf.numel() < words or buf.stride(0) != 1 or buf.device != dev):
                raise ValueError(f"workspace.{name} must be a contiguous int32 tensor of at least {words} words on {dev} "
                                 f"for the {plan.merge} merge, got {getattr(buf, 'shape', buf)!r} "
                                 f"{getattr(buf, 'dtype', '')}")

    @staticmethod
    def _check_inputs(plan: SplitPlan, x: DecodeInputs, spec: KernelSpec) -> None:
        """What the partial / single-pass kernel assumes of the inputs (shapes, dtypes, strides; no device access):
        q of the plan's shape, the dtypes and the fp8 scales, q and the caches readable with 16-byte vectors, the
        plan's KV heads and page size, the plan's variants, 32-bit in-tile offsets and token positions, and the
        index tensors' strides: ``seq_lens`` is read with unit stride and ``block_table``'s entries of a row with
        unit column stride (its row stride may be any: rows of a wider table are fine).

        Raises:
            ValueError: naming the argument, what it is and what the kernel needs.
        """
        p = plan.problem
        fp8 = x.k_cache.dtype == torch.float8_e4m3fn
        if fp8:
            if x.v_cache.dtype != x.k_cache.dtype or x.q.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"cuda_ptx: an fp8 KV cache needs k_cache and v_cache float8_e4m3fn and q float16 or "
                                 f"bfloat16 (q {x.q.dtype}, k_cache {x.k_cache.dtype}, v_cache {x.v_cache.dtype})")
            hkv = x.k_cache.shape[2]
            for name, t in (("k_scale", x.k_scale), ("v_scale", x.v_scale)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (hkv,) \
                        or (hkv > 1 and t.stride(0) != 1) or t.device != x.k_cache.device:
                    raise ValueError(f"cuda_ptx: an fp8 KV cache needs {name} as a contiguous float32 [{hkv}] tensor "
                                     f"(one scale per KV head) on {x.k_cache.device}, got "
                                     f"{getattr(t, 'shape', t)!r} {getattr(t, 'dtype', '')}")
        elif x.k_cache.dtype != x.q.dtype or x.v_cache.dtype != x.q.dtype or x.k_scale is not None \
                or x.v_scale is not None:
            raise ValueError(f"cuda_ptx needs q and the KV cache in one dtype without dequantization scales, or a "
                             f"float8_e4m3fn cache with k_scale and v_scale (q {x.q.dtype}, k_cache {x.k_cache.dtype}, "
                             f"v_cache {x.v_cache.dtype})")
        if spec.kv_fp8 != fp8 or dtype_name(x.q.dtype) != spec.dtype:
            raise ValueError(f"plan's kernel {spec.name} is for q {spec.dtype} and kv {spec.kv_dtype}, the inputs have "
                             f"q {x.q.dtype} and k_cache {x.k_cache.dtype}: re-plan")
        want = (p.batch, p.q_len, p.num_q_heads, p.head_dim)
        if tuple(x.q.shape) != want or x.k_cache.shape[2] != p.num_kv_heads:
            raise ValueError(f"plan is for q {want} with {p.num_kv_heads} KV heads, inputs have q {tuple(x.q.shape)} "
                             f"and {x.k_cache.shape[2]} KV heads: re-plan")
        if (x.window_left >= 0) != spec.window or (x.soft_cap > 0) != spec.softcap:
            raise ValueError(f"plan's kernel {spec.name} is for window {p.window_left} and soft-cap {p.soft_cap}, the "
                             f"inputs have window_left {x.window_left} and soft_cap {x.soft_cap}: re-plan")
        check_layout("q", x.q, 16 // x.q.element_size(), 16)
        vec = spec.layout["vec"]
        for name, t in (("k_cache", x.k_cache), ("v_cache", x.v_cache)):
            check_layout(name, t, vec, 16)
        if x.paged != bool(spec.page_size) or (x.paged and spec.page_size != x.k_cache.shape[1]):
            raise ValueError(f"plan is for page size {spec.page_size or None}, the inputs have "
                             f"{x.k_cache.shape[1] if x.paged else None}")
        for name, t in (("k_cache", x.k_cache), ("v_cache", x.v_cache)):
            if (spec.tile_tokens - 1) * t.stride(1) + spec.head_dim >= 2**31:
                raise ValueError(f"{name} token stride {t.stride(1)} is too large: in-tile offsets of "
                                 f"{spec.tile_tokens} tokens must stay below 2**31 elements")
        b = x.q.shape[0]
        sl = x.seq_lens
        if sl.dtype != torch.int32 or tuple(sl.shape) != (b,) or (b > 1 and sl.stride(0) != 1):
            raise ValueError(f"cuda_ptx reads seq_lens as {b} contiguous int32 (unit stride), got shape "
                             f"{tuple(sl.shape)} {sl.dtype} strides {tuple(sl.stride())}: pass seq_lens.contiguous()")
        bt = x.block_table
        if bt is not None and (bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != b
                               or (bt.shape[1] > 1 and bt.stride(1) != 1)):
            raise ValueError(f"cuda_ptx reads block_table as int32 [{b}, max_pages] rows with unit column stride (any "
                             f"row stride), got shape {tuple(bt.shape)} {bt.dtype} strides {tuple(bt.stride())}: pass "
                             "a row-major table (block_table.contiguous())")
        capacity = kv_capacity(x.k_cache, x.block_table)
        if capacity > MAX_KV_TOKENS:
            what = (f"k_cache holds {capacity} tokens per sequence (shape {tuple(x.k_cache.shape)})" if not x.paged else
                    f"block_table's {x.block_table.shape[1]} pages x page size {x.k_cache.shape[1]} = {capacity} tokens "
                    f"per sequence")
            raise ValueError(f"cuda_ptx: {what}, more than {MAX_KV_TOKENS} (2**30): token positions are 32-bit")

    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The scheduled partial kernel (:mod:`attnplan.backends.base`'s contract; the single pass for a single-pass
        plan): rows of one-unit sequences into ``out [B, Q, H, D]`` (q's dtype) and, if given, ``lse [B, Q, H]``
        fp32, the sinks joined; the other units' states into ``workspace.state`` slot ``u``; ``workspace.meta`` for
        the separate merge; the fused merge inside (``plan.merge == "fused"``). Launch only: no allocation, no sync.

        Strides honoured: q's and the caches' (page / sequence, token, head; multiples of 16 bytes, the kernels'
        vector loads), the block table's rows, ``out``'s and ``lse``'s (``out``'s last axis unit), the workspace's.

        Raises:
            ValueError: shapes, dtypes, strides, alignment or devices the kernel cannot take, or a workspace that
                does not serve the plan (named).
        """
        one_launch(plan)
        x = inputs
        L = self._launch_state(plan, workspace)
        spec = L.spec
        self._check_inputs(plan, x, spec)
        self._check_out_lse(x.q, out, lse)
        self._check_sinks(x.sinks, x.q.shape[2])
        for name, t in (("out", out), ("lse", lse), ("workspace", workspace.targets)):
            if t is not None and t.device != x.q.device:
                raise ValueError(f"{name} is on {t.device}, q on {x.q.device}")
        self._launch(spec, L.cfg, PARTIAL_SIGNATURE, self._partial_values(L, x, out, lse),
                     x.q.device)  # no PDL: it waits for nothing

    @staticmethod
    def _partial_values(L: _Launch, x: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> list:
        """The partial (or single-pass) kernel's :func:`~.args.partial_args` for launch constants ``L`` (its plan's
        workspace, schedule and merge) and these tensors (checked by the caller)."""
        plan, workspace = L.plan, L.workspace
        ws = workspace.state
        return partial_args(L.spec, x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, out, lse,
                            schedule=L.sched, targets=None if plan.single_pass else workspace.targets,
                            meta=workspace.meta if plan.merge == "separate" else None,
                            counters=workspace.counters if plan.merge == "fused" else None,
                            ws_o=None if ws is None else ws.o, ws_lse=None if ws is None else ws.lse,
                            window_left=x.window_left, soft_cap=x.soft_cap, sinks=x.sinks, k_scale=x.k_scale,
                            v_scale=x.v_scale, spread_slots=L.spread)

    @staticmethod
    def _merge_values(L: _Launch, out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None) -> list:
        """The separate merge kernel's :func:`~.args.merge_args` for launch constants ``L`` (checked by the caller)."""
        st = L.workspace.state
        return merge_args(st.o, st.lse, L.workspace.meta, out, lse, sinks)

    @staticmethod
    def _check_out_lse(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """The kernels' final output: ``out`` shaped and typed like ``q`` with unit last stride (its other strides may
        be any: rows are written element by element, or 4 elements at once where a row is aligned for it), ``lse``
        ``[B, Q, H]`` fp32 (any strides) or None. Raises ValueError naming the tensor."""
        if out.dtype != q.dtype or tuple(out.shape) != tuple(q.shape) or out.stride(-1) != 1:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit last stride, got "
                             f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}")
        if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:3])):
            raise ValueError(f"lse must be {tuple(q.shape[:3])} float32, got {tuple(lse.shape)} {lse.dtype}")

    @staticmethod
    def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,)
                                  or sinks.stride(0) != 1):
            raise ValueError(f"sinks must be a contiguous float32 [{num_heads}] tensor, got {tuple(sinks.shape)} "
                             f"{sinks.dtype} strides {tuple(sinks.stride())}")

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """The separate merge kernel: every row ``(b, i, h)`` of a sequence with ``units[b] >= 2`` (``workspace.meta``,
        written by the partial kernel: ``first[b]`` at ``b``, ``units[b]`` at ``batch + b``) merges its workspace
        slots ``[first[b], first[b] + units[b])`` in slot order into ``out [B, Q, H, D]`` (q's dtype) and, if given,
        ``lse [B, Q, H]`` fp32, by :func:`attnplan.state.merge_states`'s contract: ``lse = logsumexp_s(lse_s)``,
        ``o = sum_s exp(lse_s - lse) o_s``, empty states weigh 0, an all-empty row gives ``o = 0, lse = -inf``, NaN
        in a non-empty state makes the row NaN; ``sinks [H]`` fp32 logits then join the denominator once
        (``lse' = logaddexp(lse, z)``, ``o' = o exp(lse - lse')``; a ``-inf`` sink is none). Rows of one-unit
        sequences are left as the partial kernel wrote them. Deterministic (fixed order, no atomics; bitwise
        reproducible for a given :meth:`merge_teams_for`). Launched with programmatic dependent launch on sm_90+
        unless the plan's kernel option ``pdl`` is false. Launch only.

        Raises:
            ValueError: a plan whose merge is not ``separate``, or dtypes, shapes, strides, alignment or devices the
                kernel cannot take (named).
        """
        one_launch(plan)
        if plan.merge != "separate":
            raise ValueError(f"plan merge is {plan.merge!r}: no separate merge to launch")
        L = self._launch_state(plan, workspace, partial=False)
        st = workspace.state
        p = plan.problem
        b, ql, h, d = p.batch, p.q_len, p.num_q_heads, p.head_dim
        if out.dtype != torch_dtype(p.q_dtype) or tuple(out.shape) != (b, ql, h, d) or out.stride(-1) != 1:
            raise ValueError(f"out must be [{b}, {ql}, {h}, {d}] {p.q_dtype} with unit last stride, got "
                             f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}")
        if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (b, ql, h)):
            raise ValueError(f"lse must be [{b}, {ql}, {h}] float32, got {tuple(lse.shape)} {lse.dtype}")
        self._check_sinks(sinks, h)
        for name, t in (("out", out), ("lse", lse), ("sinks", sinks)):
            if t is not None and t.device != st.o.device:
                raise ValueError(f"{name} is on {t.device}, the workspace on {st.o.device}")
        self._launch(L.merge_spec, L.merge_cfg, MERGE_SIGNATURE, self._merge_values(L, out, lse, sinks), st.o.device,
                     pdl=L.pdl)

    def bind(self, plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs, previous=None) -> BoundLaunch:
        """The launches of ``plan`` on ``workspace`` for inputs of ``inputs``' signature, checked and prepared once
        (``DecodeWrapper.plan()`` calls this; its ``run()`` calls the result). See :class:`~.bound.BoundLaunch`.
        ``previous`` (the binding this one replaces) is not used: a binding here compiles nothing.

        Raises:
            ValueError: what :meth:`partial` raises for these inputs and this workspace (``out`` and ``lse`` aside),
                or tensors that are not on a CUDA device.
        """
        return BoundLaunch(self, plan, workspace, inputs)

    def probe(self, spec: KernelSpec, seq_lens: torch.Tensor, schedule, probe_units, *, window_left: int = -1,
              write_meta: bool = True, capacity: int | None = None,
              slots: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the partial kernel's schedule prologue alone (tests; ``spec`` a ``"partial"`` spec: its threads, q_len
        and window; its probe build): ``(res, meta)`` on ``seq_lens``'s device, ``res`` int32 ``[n, 8]`` = (b, j,
        start, end, units[b], c, first[b], cb) of the unit that each grid slot of ``probe_units`` runs (b = -1 and
        the rest -7 where it runs none), ``meta`` int32 ``[2 B]`` written by the first probe block (``None`` without
        ``write_meta``). Each length is clamped into ``[0, capacity]`` tokens as the partial kernel clamps it
        (``None``: ``2**31 - 1``, only negative lengths clamped). ``slots``: the unit slots a batch of at most 32
        spreads its units over, as the partial kernel passes them (its grid's slots bounded by
        :func:`spread_slots`); 0: slot u runs unit u. Allocates and launches (not for a CUDA graph).

        Raises:
            ValueError: ``spec`` is not a ``"partial"`` spec, or ``capacity`` or ``slots`` is negative.
        """
        import dataclasses

        from .args import PROBE_SIGNATURE, probe_args
        from .spec import LaunchConfig

        if spec.kind != "partial":
            raise ValueError(f"the schedule probe runs a 'partial' spec's prologue, got {spec.name}")
        spec = dataclasses.replace(spec, probe=True)
        lens = torch.as_tensor(seq_lens, dtype=torch.int32).contiguous()
        dev = lens.device
        units = torch.as_tensor(list(probe_units), dtype=torch.int32).to(dev)
        res = torch.full((units.numel(), 8), -7, dtype=torch.int32, device=dev)
        meta = torch.full((2 * lens.numel(),), -7, dtype=torch.int32, device=dev) if write_meta else None
        targets = torch.tensor(schedule.targets, dtype=torch.int32, device=dev)
        cfg = LaunchConfig((units.numel(), 1, 1), (spec.threads, 1, 1), spec.smem_bytes)
        cap = {} if capacity is None else {"capacity": capacity}
        self._launch(spec, cfg, PROBE_SIGNATURE,
                     probe_args(lens, targets, meta, units, res, schedule, window_left, slots=slots, **cap), dev)
        return res, meta
