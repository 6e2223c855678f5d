"""The ``numba`` backend: ``numba.cuda`` kernels for the device-side split-KV schedule and its merge.

Runs on CUDA GPUs, and on CPU tensors under ``NUMBA_ENABLE_CUDASIM=1`` (numba's CUDA simulator,
CI's mode; the variable must be set before numba is first imported). The kernels and their method
are in :mod:`attnplan.backends.numba.kernels`; this module picks a specialization, makes the tensor
views numba can take, and launches.

What runs (the kernel contract of :mod:`attnplan.backends.base`): one split-KV kernel on the plan's
1-D grid of ``max_units x num_kv_heads`` programs. With ``plan.schedule.max_units_per_seq > 1`` each
program first computes the schedule from the live ``seq_lens`` (:mod:`attnplan.schedule`), then
writes its unit either straight into ``out`` / ``lse`` (a sequence with one unit, sinks applied) or
into its slot of the ragged workspace; then, for the ``separate`` merge, :meth:`NumbaBackend.merge`
combines each remaining row's slots through the first-slot / units table (``workspace.meta``: sequence
``b``'s units in slots ``[first[b], first[b] + units[b])``, longest units first in a batch of at most 32
sequences, :mod:`attnplan.schedule`) that the partial kernel's program 0 wrote. A single-pass plan runs
the same kernel without the prologue.
The fused merge is not implemented (``merge_strategies = {"separate"}``; the planner falls back).

Tensors reach numba as views: fp16 and bf16 tensors are reinterpreted as ``int16`` (numba has no
bf16 and sees torch's bf16 as a 2-byte void dtype) and the kernels widen the bits to fp32 and round
results back to 16 bits themselves (see the kernels module for the exact bit formulas). The KV
cache is read in 8-byte words (an ``int64`` view: four fp16/bf16 or two fp32 elements per load)
whenever its strides and offset allow that view, else one element at a time. Every other stride is
honoured as it is (q, the block table, ``seq_lens``, ``out``, ``lse``). On a GPU the views go through
``numba.cuda.as_cuda_array(t, sync=False)`` (no synchronization on torch's stream) and kernels launch
on ``numba.cuda.external_stream(torch.cuda.current_stream().cuda_stream)``; in the simulator they are
the CPU tensors' numpy views, handed over without the simulator's copy-in/copy-out. Every launch through
numba's dispatcher runs inside :func:`attnplan.backends.numba.kernels.launch_scope` (numba's process-wide
patches for that launch only); simulated launches also lower Python's thread switch interval while they
run (the simulator's barriers otherwise cost milliseconds each).

``DecodeWrapper.run()`` launches through :class:`BoundLaunch` (:meth:`NumbaBackend.bind`, made by
``plan()``): on a GPU, after the first launch of an output layout through the dispatcher, it keeps the
compiled kernel and numba's own marshalling of its arguments and later only writes the call's data pointers
into it before ``cuda.core.launch`` (numba's typing and marshalling of every argument are most of a
dispatcher launch's host time). Lengths read from ``seq_lens`` are clamped into ``[0, capacity]``
(:attr:`~attnplan.backends.base.DecodeInputs.capacity`, a kernel argument) and block-table entries into ``[0,
num_pages)`` by the kernel.

Attention variants (``variants``: window, softcap, sinks, fp8_kv) are flags of the kernel
specialization, with the semantics of :mod:`attnplan.reference` and the Triton kernels: a sliding
window moves the units' base to the window and masks each query to ``[p - window_left, p]``; the
soft cap is ``cap * tanh(x / cap)`` on the natural-log scaled scores; sinks join the denominator in
the merge kernel and in the direct output of one-unit sequences (never in partial states); an fp8
(``float8_e4m3fn``) cache is passed as its ``uint8`` bits (``int64`` words of 8 codes when the view
allows it), widened exactly in the kernel, with ``k_scale[h]`` folded into the score scale and
``v_scale[h]`` into the unit's output (``DecodeInputs.k_scale/v_scale``: fp32 ``[num_kv_heads]``
tensors).

Example::

    out = attnplan.decode(q, k_cache, v_cache, seq_lens, block_table, backend="numba")
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import ClassVar

import torch

from attnplan.backends.base import Backend, DecodeInputs, Workspace, one_launch
from attnplan.planner import SplitPlan

__all__ = ["NumbaBackend", "BoundLaunch"]

_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # kernels.KIND_FP32/FP16/BF16
_FP8 = torch.float8_e4m3fn

#: simulator layout: 4 token groups of 2 lanes, 4 positions each per tile (block_n = 16)
_SIM_LANES, _SIM_THREADS, _SIM_UNROLL, _SIM_MERGE_THREADS = 2, 8, 4, 8
#: GPU defaults: 256 threads, 4 positions per group per tile, block_n at most 256 tokens
_GPU_THREADS, _GPU_UNROLL, _GPU_MAX_BLOCK_N, _GPU_MERGE_THREADS = 256, 4, 256, 128
#: most (token groups x rows) one program keeps in shared memory (2 x 4 KiB of m and l)
_MAX_GROUP_ROWS = 1024

#: most (token groups x head_dim) of a program's accumulator exchange (kernels._SMEM_ACC_FLOATS)
_MAX_GROUP_CHANNELS = 8192


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _sim_env() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@contextlib.contextmanager
def _sim_switch_interval():
    """The simulator runs each CUDA thread as a Python thread and polls them at ``syncthreads``;
    with Python's default 5 ms thread switch interval every barrier costs milliseconds. Lower the
    interval for the duration of a simulated launch only, then restore it."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, 5e-5))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class NumbaBackend(Backend):
    """Split-KV decode in ``numba.cuda``: one program per (work unit, KV head) serving the whole GQA
    group and all queries of the unit's sequence (the kernel contract of :mod:`attnplan.backends.base`).

    Method: Flash-Decoding (Dao et al. 2023): each program computes the online-softmax partial state
    of its unit's token range for all its rows and the merge rescales the states to a common
    log-sum-exp; the schedule prologue, the thread layout and the bit-level dtype handling are
    documented in :mod:`attnplan.backends.numba.kernels`.

    Support: q/KV fp16, bf16, fp32 (same dtype), or q fp16/bf16 with a float8_e4m3fn cache;
    ``head_dim`` a multiple of 8 in [16, 256]; the variants window, softcap, sinks, fp8_kv;
    ``group_size * q_len <= 64`` rows per program (every row keeps fp32 registers per lane, so
    large row counts spill and run slowly, but stay exact); more queries go in several launches of
    whole GQA groups (``Backend.q_block``), a larger GQA group in launches of blocks of its query heads
    (``Backend.head_block``).

    ``partial`` and ``merge`` only launch (no allocation, no host sync), so ``run`` can be captured
    in a CUDA graph once each specialization has run (compiled) outside capture.
    They raise ``KeyError`` for a dtype outside float16/bfloat16/float32 (float8_e4m3fn for the
    cache), ``ValueError`` for a plan whose kernel options give an impossible thread layout or for
    an fp8 cache without ``k_scale``/``v_scale`` or with fp32 q.

    Attributes:
        compile_times: ``{kernel specialization tag: seconds}`` of each numba compilation, measured
            around the first launch of that specialization (GPU only; the simulator compiles
            nothing). Shared by all instances.
    """

    name = "numba"
    min_head_dim = 16
    max_head_dim = 256
    head_dim_multiple = 8
    max_rows_per_program = 64
    graph_safe = True
    variants = frozenset({"window", "softcap", "sinks", "fp8_kv"})

    compile_times: ClassVar[dict[str, float]] = {}

    def __init__(self) -> None:
        self._k = None
        self._streams: dict[int, object] = {}

    # -- availability ------------------------------------------------------------------------------
    def _kernels(self):
        """The kernels module (imports numba on first use). Raises ImportError/any numba error."""
        if self._k is None:
            from . import kernels
            self._k = kernels
        return self._k

    def available(self, device: torch.device) -> tuple[bool, str]:
        """``(True, "")`` when kernels can run on tensors on ``device``, else ``(False, reason)``.

        CUDA devices need ``numba.cuda`` importable and ``numba.cuda.is_available()``; CPU devices
        need numba's simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba was imported), which in
        turn cannot run CUDA tensors. Never raises: a broken numba install becomes the reason.
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return False, f"unsupported device type {device.type}"
        if device.type == "cpu" and not _sim_env():
            return False, "CPU tensors need NUMBA_ENABLE_CUDASIM=1 (numba's CUDA simulator)"
        try:
            k = self._kernels()
        except Exception as e:  # noqa: BLE001 - any import-time failure makes only this backend unavailable
            return False, f"numba.cuda is not importable: {type(e).__name__}: {e}"
        if device.type == "cpu":
            if not k.SIM:
                return False, "NUMBA_ENABLE_CUDASIM=1 was set after numba was imported; the simulator is off"
            return True, ""
        if k.SIM:
            return False, "NUMBA_ENABLE_CUDASIM=1: numba's simulator runs on CPU tensors only"
        try:
            ok = bool(k.cuda.is_available())
        except Exception as e:  # noqa: BLE001
            return False, f"numba.cuda.is_available() failed: {type(e).__name__}: {e}"
        return (True, "") if ok else (False, "numba.cuda.is_available() is False (no CUDA driver/GPU for numba)")

    # -- configuration -----------------------------------------------------------------------------
    def kernel_config(self, problem, options: dict, device) -> dict:
        """Thread layout for ``problem``.

        Args:
            problem: a :class:`~attnplan.problem.DecodeProblem`.
            options: the config's ``backend_options.numba``: ``threads`` and ``block_n`` (``None`` =
                choose); ``lanes`` and ``unroll`` are honoured too if a config ever carries them.
            device: where it runs; CPU means the simulator.
        Returns:
            ``{"block_n", "threads", "lanes", "unroll", "merge_threads"}``: ``threads`` per program,
            ``lanes`` threads per KV position (a power of two <= 32), ``unroll`` positions per token
            group per tile, ``block_n = threads / lanes * unroll`` positions per tile (the schedule's
            granule is a multiple of it), ``merge_threads`` per merge program. The simulator uses 8 threads of
            2 lanes and ``block_n = 16`` (``block_n`` may be overridden). A GPU uses 256 threads
            with about 8 channels per lane and 4 positions per group for up to 4 rows; for more
            rows, about 4 channels per lane and an unroll of 2 (up to 8 rows) or 1, so the
            per-lane register arrays (``rows x channels`` of q and of the accumulator) stay small.
        """
        options = {k: v for k, v in (options or {}).items() if v is not None}
        rows = problem.group_size * problem.q_len
        d = problem.head_dim
        elem = 1 if problem.kv_dtype == "float8_e4m3fn" else 4 if problem.q_dtype == "float32" else 2
        nwords = -(-d * elem // 8)  # 8-byte words per KV row
        if torch.device(device).type != "cuda":
            lanes, threads, merge_threads = _SIM_LANES, _SIM_THREADS, _SIM_MERGE_THREADS
            unroll = int(options.get("block_n", (threads // lanes) * _SIM_UNROLL)) // (threads // lanes)
        else:
            target = 8 if rows <= 4 else 4
            lanes = int(options.get("lanes", min(32, _next_pow2(-(-d // target)), _next_pow2(nwords))))
            if lanes < 1 or lanes > 32 or lanes & (lanes - 1):
                raise ValueError(f"numba backend option lanes must be a power of two in [1, 32], got {lanes}")
            threads = max(32, min(1024, int(options.get("threads", _GPU_THREADS)) // 32 * 32))
            # shared memory: (groups x rows) m and l, (groups x head_dim) of the accumulator
            while threads > 32 and ((threads // lanes) * rows > _MAX_GROUP_ROWS
                                    or (threads // lanes) * d > _MAX_GROUP_CHANNELS):
                threads //= 2
            unroll = _GPU_UNROLL if rows <= 4 else 2 if rows <= 8 else 1
            unroll = min(unroll, max(1, _GPU_MAX_BLOCK_N // (threads // lanes)))
            if "block_n" in options:
                unroll = int(options["block_n"]) // (threads // lanes)
            unroll = int(options.get("unroll", unroll))
            merge_threads = min(_GPU_MERGE_THREADS, max(32, _next_pow2(d)))
        unroll = max(1, unroll)
        return {"block_n": (threads // lanes) * unroll, "threads": threads, "lanes": lanes, "unroll": unroll,
                "merge_threads": merge_threads}

    def _layout(self, plan: SplitPlan, x: DecodeInputs) -> tuple[int, int, int]:
        """``(lanes, threads, unroll)`` from the plan, or chosen afresh when the plan was made for
        another backend (its kernel options lack them)."""
        kc = plan.kernel
        if all(key in kc for key in ("lanes", "threads", "unroll")):
            return int(kc["lanes"]), int(kc["threads"]), int(kc["unroll"])
        c = self.kernel_config(_problem_of(x), {}, x.q.device)
        return c["lanes"], c["threads"], c["unroll"]

    # -- launching ---------------------------------------------------------------------------------
    def _array(self, t: torch.Tensor):
        if t.requires_grad:  # numba reads the memory, as triton does: no autograd (its interface refuses such a tensor)
            t = t.detach()
        if self._k.SIM:
            return self._k.sim_array(t.numpy())
        return self._k.cuda.as_cuda_array(t, sync=False)

    def _stream(self, ptr: int):
        """The numba stream object for the CUDA stream ``ptr`` (made once per stream)."""
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self._k.cuda.external_stream(ptr)
        return stream

    def bind(self, plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs, previous=None) -> "BoundLaunch":
        """The launches of ``plan`` for inputs of ``inputs``' signature, prepared once (``DecodeWrapper.plan()``
        calls this; its ``run()`` calls the result). See :class:`BoundLaunch`. ``previous`` (the binding this one
        replaces) is not used."""
        return BoundLaunch(self, plan, workspace, inputs)

    def _launch(self, kern, tag: str, grid: tuple, block: int, args: tuple, device: torch.device) -> None:
        k = self._k
        if k.SIM:
            with k.launch_scope(), _sim_switch_interval():
                kern[grid, block](*args)
            return
        stream = self._stream(torch.cuda.current_stream(device).cuda_stream)
        before = len(kern.overloads)
        t0 = time.perf_counter()
        with k.launch_scope():
            if device.index is not None and device.index != torch.cuda.current_device():
                with k.cuda.gpus[device.index]:
                    kern[grid, block, stream](*args)
            else:
                kern[grid, block, stream](*args)
        if len(kern.overloads) != before:
            key = tag if tag not in self.compile_times else f"{tag}#{len(kern.overloads)}"
            self.compile_times[key] = time.perf_counter() - t0

    def _kv_views(self, x: DecodeInputs):
        """K and V as 8-byte words when both allow an ``int64`` view, else element views (``uint8``
        codes for an fp8 cache); and the elements per word."""
        if x.k_cache.dtype == _FP8:
            kc, vc = x.k_cache.view(torch.uint8), x.v_cache.view(torch.uint8)
        else:
            kind = _KINDS[x.k_cache.dtype]
            kc, vc = _elem_view(x.k_cache, kind), _elem_view(x.v_cache, kind)
        try:
            kw, vw = x.k_cache.view(torch.int64), x.v_cache.view(torch.int64)
            return kw, vw, 8 // x.k_cache.element_size()
        except RuntimeError:
            pass
        return kc, vc, 1

    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The scheduled split-KV kernel (launch only: no allocation, no host sync). Page ids read from the block
        table are clamped into ``[0, num_pages)`` (``num_pages = k_cache.shape[0]``).

        Args:
            plan: grid ``(max_units * num_kv_heads,)``; ``plan.schedule`` and ``plan.kernel`` as planned.
            inputs: q ``[B, Q, Hq, D]`` and the cache in one dtype (or an fp8 cache with fp16/bf16 q and
                ``k_scale``/``v_scale``); ``seq_lens`` / ``block_table`` int32. Any strides but unit stride
                in head_dim.
            workspace: the plan's :class:`~attnplan.backends.base.Workspace`: units of sequences with two
                or more units go to ``workspace.state``, unit ``j`` of sequence ``b`` to slot ``first[b] + j``
                (:attr:`attnplan.schedule.Units.slot`); ``workspace.meta`` (``first`` then ``units``) is written
                for the separate merge.
            out: ``[B, Q, Hq, D]`` in q's dtype: rows of one-unit sequences (every row for a single pass),
                the sink applied.
            lse: ``[B, Q, Hq]`` fp32 (natural log) for those rows, or ``None``.
        Raises:
            KeyError: a dtype outside float16/bfloat16/float32 (float8_e4m3fn for the cache).
            ValueError: an fp8 cache without ``k_scale``/``v_scale`` or with fp32 q; a plan whose kernel
                options give an impossible thread layout; a plan with the fused merge.
        """
        one_launch(plan)
        kern, tag, grid, threads, args, _ = self._partial_call(plan, inputs, workspace, out, lse)
        self._launch(kern, tag, grid, threads, args, inputs.q.device)

    def _partial_call(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                      lse: torch.Tensor | None) -> tuple:
        """:meth:`partial`'s launch: ``(kernel, tag, grid, threads, args, tensors)``; ``tensors[i]`` is
        ``(tensor, role)`` for the array argument ``args[i]`` (``role``: the :class:`BoundLaunch` argument it
        comes from, ``None`` for the workspace and stand-ins) and ``(None, None)`` for a scalar."""
        k = self._kernels()
        x = inputs
        q = x.q
        _, q_len, hq, d = q.shape
        hkv = x.k_cache.shape[2]
        kind = _KINDS[q.dtype]
        fp8 = x.k_cache.dtype == _FP8
        if fp8 and (x.k_scale is None or x.v_scale is None or kind == 0):
            raise ValueError("an fp8 KV cache needs k_scale and v_scale (fp32 [num_kv_heads]) and fp16/bf16 q")
        if plan.merge == "fused":
            raise ValueError("the numba backend has no fused merge (merge_strategies: separate); plan for numba")
        sched = not plan.single_pass
        window = x.window_left >= 0
        softcap = x.soft_cap > 0
        sinks_on = x.sinks is not None  # applied to the rows written directly; the merge applies them to the rest
        kc, vc, ew = self._kv_views(x)
        (kflat, ks), (vflat, vs) = _flat(kc), _flat(vc)
        lanes, threads, unroll = self._layout(plan, x)
        spec = k.DecodeSpec(kind=kind, ew=ew, head_dim=d, group=hq // hkv, q_len=q_len, paged=x.paged,
                            lanes=lanes, threads=threads, unroll=unroll, sched=sched, has_lse=lse is not None,
                            kv_same=ks == vs, window=window, softcap=softcap, fp8=fp8, sinks=sinks_on)
        kern = k.decode_kernel(spec)
        ints = workspace.targets  # an int32 stand-in for arrays the specialization never reads
        page_shift = int(x.k_cache.shape[1]).bit_length() - 1 if x.paged else 0
        last_page = max(int(x.k_cache.shape[0]) - 1, 0) if x.paged else 0  # page ids are clamped into it
        st = workspace.state
        meta = workspace.meta if sched and plan.merge == "separate" and workspace.meta is not None else ints
        stride_t = k.numpy.int32 if max(ks + vs) < 2**31 else k.numpy.int64
        ks, vs = tuple(stride_t(v) for v in ks), tuple(stride_t(v) for v in vs)
        s = plan.schedule
        # (tensor, role): the role names the call's tensor a bound launch reads the data pointer of
        arrays = ((_elem_view(q, kind), "q"), (kflat, "k"), (vflat, "v"))
        after = ((x.seq_lens, "seq_lens"), (x.block_table, "block_table") if x.paged else (ints, None),
                 (_elem_view(out, kind), "out"), (lse, "lse") if lse is not None else (ints, None),
                 (st.o, None) if sched else (ints, None), (st.lse, None) if sched else (ints, None),
                 (meta, None), (workspace.targets, None))
        ints_ = (int(hkv), int(s.granule), int(s.min_unit_granules), int(s.max_units_per_seq), int(meta is not ints),
                 page_shift, last_page, x.capacity, k.numpy.float32(x.sm_scale), int(x.window_left) if window else 0,
                 k.numpy.float32(x.soft_cap if softcap else 1.0))
        tail = ((x.k_scale, "k_scale") if fp8 else (ints, None), (x.v_scale, "v_scale") if fp8 else (ints, None),
                (x.sinks, "sinks") if sinks_on else (ints, None))
        tensors = (*arrays, *((None, None),) * 6, *after, *((None, None),) * len(ints_), *tail)
        arr = self._array
        args = (*(arr(t) for t, _ in arrays), *ks, *vs, *(arr(t) for t, _ in after), *ints_,
                *(arr(t) for t, _ in tail))
        return kern, spec.tag(), tuple(plan.grid), threads, args, tensors

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """The separate merge: rows of sequences with ``units[b] >= 2`` (``workspace.meta``, written by
        :meth:`partial`) merged from their workspace slots into ``out [B, Q, Hq, D]`` (its own dtype) and, if
        given, ``lse [B, Q, Hq]`` fp32, by :func:`attnplan.state.merge_states`'s contract (one program per
        row, grid ``(B * Q * Hq,)``; rows of one-unit sequences are left as the partial kernel wrote them).

        ``sinks [Hq]`` fp32, if given, join the denominator after the states are merged (an all-empty row
        gets ``o = 0, lse = sink``).

        Raises:
            ValueError: ``workspace`` has no state or meta (the plan's merge is not ``separate``).
        """
        one_launch(plan)
        kern, tag, grid, threads, args, _ = self._merge_call(plan, workspace, out, lse, sinks)
        self._launch(kern, tag, grid, threads, args, out.device)

    def _merge_call(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
                    sinks: torch.Tensor | None) -> tuple:
        """:meth:`merge`'s launch, laid out as :meth:`_partial_call`'s."""
        if workspace.state is None or workspace.meta is None:
            raise ValueError(f"the numba merge needs a workspace with state and meta (plan merge {plan.merge!r})")
        k = self._kernels()
        b, q_len, hq, d = out.shape
        kind = _KINDS[out.dtype]
        threads = int(plan.kernel.get("merge_threads") or
                      (_SIM_MERGE_THREADS if k.SIM else min(_GPU_MERGE_THREADS, max(32, _next_pow2(d)))))
        spec = k.MergeSpec(kind=kind, head_dim=d, threads=threads, has_lse=lse is not None, sinks=sinks is not None)
        kern = k.merge_kernel(spec)
        st = workspace.state
        tensors = ((st.o, None), (st.lse, None), (workspace.meta, None), (_elem_view(out, kind), "out"),
                   (lse, "lse") if lse is not None else (st.lse, None),
                   (sinks, "sinks") if sinks is not None else (st.lse, None))
        args = tuple(self._array(t) for t, _ in tensors)
        return kern, spec.tag(), (b * q_len * hq,), threads, args, tensors


#: the tensors of a :class:`BoundLaunch` call, by role (the order of its source tuple)
_ROLES = ("q", "k", "v", "seq_lens", "block_table", "out", "lse", "sinks", "k_scale", "v_scale")
_ROLE_INDEX = {r: i for i, r in enumerate(_ROLES)}


class _Direct:
    """One compiled numba kernel with its marshalled arguments, for launches that skip numba's dispatcher.

    ``template``: the kernel arguments exactly as numba's ``_Kernel.launch`` passes them to ``cuda.core.launch``
    (made by the kernel's own ``_prepare_args``); ``patch``: ``(position, role index)`` of every data pointer that
    comes from the call's tensors (the rest, the workspace's and the stand-ins', stay as they are)."""

    __slots__ = ("launch", "config", "handle", "template", "patch", "grid", "block", "kern", "streams")


def _launch_api():
    """numba-cuda's dispatcher module (whose ``launch``, ``LaunchConfig`` and ``CUDA_CORE_GE_1_0`` its own
    ``_Kernel.launch`` uses) and its array type."""
    from numba.cuda import dispatcher, types

    return dispatcher, types.Array


def _direct(kern, args: tuple, tensors: tuple, grid, block, stream) -> _Direct | None:
    """A :class:`_Direct` for the numba dispatcher ``kern`` just launched with ``args`` (``tensors``: see
    :meth:`NumbaBackend._partial_call`) on the numba ``stream``, or ``None`` when numba's objects are not of the
    shape expected (another numba-cuda layout, a debug kernel, argument extensions): then launches keep going
    through the dispatcher."""
    try:
        nd, array_type = _launch_api()
        ko = kern.overloads.get(tuple(kern.typeof_pyval(a) for a in args))
        if ko is None or ko.debug or getattr(ko, "extensions", None):
            return None
        template, retr, patch = [], [], []
        for (t, role), ty, val in zip(tensors, ko.argument_types, args, strict=True):
            start = len(template)
            ko._prepare_args(ty, val, stream, retr, template)
            if role is not None:
                # an array's arguments are (meminfo, parent, size, itemsize, data pointer, shape..., strides...)
                if not isinstance(ty, array_type) or template[start + 4] != t.data_ptr():
                    return None
                patch.append((start + 4, _ROLE_INDEX[role]))
        if retr:
            return None
        lc = kern[grid, block, stream]
        if getattr(nd, "CUDA_CORE_GE_1_0", True):
            config = nd.LaunchConfig(grid=lc.griddim, block=lc.blockdim, shmem_size=lc.sharedmem,
                                     is_cooperative=ko.cooperative)
        else:
            config = nd.LaunchConfig(grid=lc.griddim, block=lc.blockdim, shmem_size=lc.sharedmem,
                                     cooperative_launch=ko.cooperative)
        d = _Direct()
        d.launch, d.config, d.handle = nd.launch, config, ko._codelibrary.get_cufunc().kernel
        d.template, d.patch = template, tuple(patch)
        d.grid, d.block, d.kern, d.streams = grid, block, kern, {}
        return d
    except Exception:  # noqa: BLE001 - anything unexpected: no direct launch, the dispatcher stays in charge
        return None


class BoundLaunch:
    """``DecodeWrapper.run()``'s launches of one plan on one workspace, for inputs of one signature, prepared at
    ``plan()`` time.

    Valid for ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and ``block_table`` with the shapes, strides, dtypes,
    device and 16-byte data-pointer alignment of the ``inputs`` it was made from (``DecodeWrapper.run()`` checks
    exactly that before calling it; a C-contiguous input's strides may differ along axes of length one, where only
    index 0 is read: the binding's strides serve it), with ``inputs``' score scale and variants (the sink and scale
    tensors are kept by reference). ``out`` and ``lse`` may differ from call to call. It keeps no reference to the
    input tensors.

    numba's launch marshals every argument on every call (typing each one, converting each tensor to a device
    array through its ``__cuda_array_interface__``, then packing shapes, strides and pointers). On a GPU the first
    call for each output layout (``out``'s and ``lse``'s strides) launches through numba's dispatcher and then
    keeps the compiled kernel and its marshalled arguments (numba's own ``_prepare_args``); later calls copy them,
    write the call's data pointers into their places and launch with ``cuda.core.launch`` (what numba's launch
    ends in). Every pointer written is checked once against numba's own marshalling of the first call; the
    simulator, a debug kernel or an unexpected numba layout keep the dispatcher. No :func:`launch_scope` is
    entered for these launches: its patches serve compilation and the simulator only.
    """

    __slots__ = ("backend", "plan", "workspace", "sm_scale", "window_left", "soft_cap", "sinks", "k_scale",
                 "v_scale", "device", "direct", "sim", "current_device", "raw_stream")

    def __init__(self, backend: "NumbaBackend", plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs):
        x = inputs
        self.backend, self.plan, self.workspace = backend, plan, workspace
        self.sm_scale, self.window_left, self.soft_cap = x.sm_scale, x.window_left, x.soft_cap
        self.sinks, self.k_scale, self.v_scale = x.sinks, x.k_scale, x.v_scale
        self.device = x.q.device
        self.direct: dict[tuple, tuple] = {}
        self.sim = backend._kernels().SIM or self.device.type != "cuda"
        self.current_device = self.raw_stream = None
        if not self.sim:
            self.current_device = torch.cuda.current_device
            self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if self.raw_stream is None:
                self.sim = True  # no cheap stream query: every launch through the dispatcher

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor | None,
                 out: torch.Tensor, lse: torch.Tensor | None, ptrs: tuple | None = None) -> None:
        """Launch the partial kernel (and the separate merge) on torch's current stream. No allocation, no sync.
        ``ptrs``: the data pointers of q, k, v, sl and bt (0 for ``None``) when the caller has them."""
        key = (out.stride(), None if lse is None else lse.stride())
        entry = self.direct.get(key)
        if entry is not None:
            idx = self.device.index
            cur = self.current_device()
            if idx is None or idx == cur:
                stream_ptr = self.raw_stream(cur)
                if ptrs is None:
                    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), 0 if bt is None else bt.data_ptr())
                src = ptrs + (out.data_ptr(), 0 if lse is None else lse.data_ptr()) + tuple(
                    0 if t is None else t.data_ptr() for t in (self.sinks, self.k_scale, self.v_scale))
                for d in entry:
                    stream = d.streams.get(stream_ptr)
                    if stream is None:
                        nb_stream = self.backend._stream(stream_ptr)
                        stream = d.streams[stream_ptr] = d.kern[d.grid, d.block, nb_stream].stream
                    a = d.template.copy()
                    for pos, i in d.patch:
                        a[pos] = src[i]
                    d.launch(stream, d.config, d.handle, *a)
                return
        be, plan, ws = self.backend, self.plan, self.workspace
        x = DecodeInputs(q, k, v, sl, bt, self.sm_scale, self.window_left, self.soft_cap, self.sinks, self.k_scale,
                         self.v_scale)
        calls = [be._partial_call(plan, x, ws, out, lse)]
        if plan.merge == "separate":
            calls.append(be._merge_call(plan, ws, out, lse, self.sinks))
        for kern, tag, grid, threads, args, _ in calls:
            be._launch(kern, tag, grid, threads, args, q.device)
        if self.sim or entry is not None or len(self.direct) >= 16:
            return
        idx = self.device.index
        if idx is not None and idx != self.current_device():
            return
        stream = be._stream(self.raw_stream(self.current_device()))
        made = tuple(_direct(kern, args, tensors, grid, threads, stream)
                     for kern, _, grid, threads, args, tensors in calls)
        if all(d is not None for d in made):
            self.direct[key] = made


def _elem_view(t: torch.Tensor, kind: int) -> torch.Tensor:
    """fp32 tensors as they are; fp16/bf16 as their ``int16`` bits (same shape and strides)."""
    return t if kind == 0 else t.view(torch.int16)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A 4-D cache view as a 1-D view from its first element over every element it spans, with its
    first three strides (the kernels add the last index, whose stride is 1)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((span,), (1,)), tuple(int(st) for st in t.stride()[:3])


def _problem_of(x: DecodeInputs):
    from attnplan.problem import DecodeProblem, dtype_name

    b, q_len, hq, d = x.q.shape
    return DecodeProblem(batch=b, num_q_heads=hq, num_kv_heads=x.k_cache.shape[2], head_dim=d, q_len=q_len,
                         page_size=int(x.k_cache.shape[1]) if x.paged else None, q_dtype=dtype_name(x.q.dtype),
                         kv_dtype=dtype_name(x.k_cache.dtype), max_kv_len=1)
