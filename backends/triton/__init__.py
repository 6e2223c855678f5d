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
plan-derived launch constants are computed once per (plan, workspace). ``DecodeWrapper.run()`` launches through
:class:`BoundLaunch` (:meth:`TritonBackend.bind`, made by ``plan()``), which launches the compiled kernel of a known
specialization directly instead of through the JIT (one ``cuLaunchKernel`` per kernel with arguments packed once,
:mod:`.raw`, where the compiled kernel's parameters allow; else Triton's own launcher). Lengths read from
``seq_lens`` are clamped into ``[0, capacity]`` (the ``capacity`` argument, :attr:`DecodeInputs.capacity`) and
block-table entries into ``[0, num_pages)`` by the kernel.

Threads: on a GPU, launches from several Python threads run concurrently. Triton's interpreter runs one kernel at a
time (its grid and its patches of ``triton.language`` are process-wide state: a second launch mid-run moves the
first's program ids or fails), so the interpreted launches of this backend take one process-wide lock and run one
after another.
"""

from __future__ import annotations

import os
import threading

import torch

from attnplan.backends.base import Backend, DecodeInputs, Workspace, one_launch
from attnplan.planner import SplitPlan
from attnplan.problem import LOG2E, torch_dtype

__all__ = ["TritonBackend", "BoundLaunch", "merge_geometry", "spec_classes"]

#: most sequences the prologue reads per step (one ``tl.arange`` block; larger batches loop). The loop lays the units
#: out in index order, so it may serve only batches past ``LONGEST_FIRST_BATCH`` (the schedule's longest-first order
#: is computed in one block)
MAX_BLOCK_B = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: serializes this backend's launches of interpreted kernels (module docstring, "Threads")
_INTERPRETER_LOCK = threading.Lock()
# a fork while another thread interprets a kernel would leave the child a lock no thread of it releases: hold it
# across the fork, so that parent and child each release their own
os.register_at_fork(before=_INTERPRETER_LOCK.acquire, after_in_parent=_INTERPRETER_LOCK.release,
                    after_in_child=_INTERPRETER_LOCK.release)


def _interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter (decided when it was decorated)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # noqa: BLE001 - a Triton without the interpreter: compiled kernels only
        return False
    return isinstance(kernel, InterpretedFunction)


#: merge programs (4 warps) per SM a long-tailed plan's sliced merge grid may hold (2,048 threads per SM). Measured,
#: not an occupancy: on an H100, 16 and 8 were level on every long-tailed point (8/1/128 b64 one-long: 0.95x and
#: 0.96x of one program per row)
MERGE_PROGRAMS_PER_SM = 16


def merge_geometry(rows: int, num_splits: int, head_dim: int, sm_count: int,
                   long_tail: bool = False) -> tuple[int, int, int]:
    """The merge kernel's ``(column slices per row, BLOCK_D, BLOCK_S)``: its grid is ``(rows, slices)``,
    each program merges ``BLOCK_D`` output columns over a row's units, ``BLOCK_S`` units per load.

    ``num_splits``: the most units a row can have (``plan.schedule.max_units_per_seq``). One program per row with
    32 units per load is the default. When the rows do not fill the SMs (``rows < sm_count``; e.g. one sequence and
    one KV head: 8 rows), each row is cut into up to ``head_dim / 16`` column slices (at most about ``2 * sm_count``
    programs in all) and each program loads up to 256 units at once (``BLOCK_S * BLOCK_D <= 4096`` fp32 per load),
    so a row over hundreds of units costs one or two memory round trips instead of ``num_splits / 32`` (measured on
    an H200: 6.0-10.8 us at 8 rows x 128-256 splits with one program per row). ``long_tail``: the schedule sizes
    units from the lengths (``balanced``, ``batch_invariant``), so one long sequence among short ones may hold most
    units while the other rows have one (their programs exit at once): when a row may hold more units than one
    32-unit load, rows that fill the SMs are still cut into as many slices (up to ``head_dim / 16``) as keep the
    grid within :data:`MERGE_PROGRAMS_PER_SM` programs per SM (e.g. 512 rows on 132 SMs: 4 slices, 128 units per
    load), so the long rows are not walked 32 units per round trip; from 1,057 rows on, one program per row.
    Measured on an H100 (triton, capacity plans): 8/1/128 b64 with one 128K sequence among short ones 63.7 -> 60.5
    us, the other long-tailed points within 1%; live plans of at most 32 units per row keep one program per row
    (4 slices cost 2-4% there: 8/1/128 b64 and 28/4/128 b16 at 4K). ``sm_count`` 0 (unknown) keeps the default.
    """
    block_d = max(16, _next_pow2(head_dim))
    slices = 1
    if 0 < rows < sm_count:
        want = -(-2 * sm_count // rows)
        while slices * 2 <= min(block_d // 16, want):
            slices *= 2
    elif long_tail and sm_count > 0 and num_splits > 32:
        while slices * 2 <= block_d // 16 and rows * slices * 2 <= MERGE_PROGRAMS_PER_SM * sm_count:
            slices *= 2
    block_d //= slices
    block_s = min(max(2, _next_pow2(num_splits)), 32 if slices == 1 else min(256, max(32, 4096 // block_d)))
    return slices, block_d, block_s


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


class _Launch:
    """What a (plan, workspace) pair fixes for the partial and merge launches, computed once."""

    __slots__ = ("plan", "workspace", "grid", "const", "ints", "ws", "merge_grid", "merge_const", "q_shape")


#: keyword arguments of a Triton launch that are compile options, not kernel parameters
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


class _Direct:
    """One compiled Triton kernel, launched through its own launcher (``CompiledKernel.run``) without the JIT's
    per-call binding, specialization and cache-key work.

    ``const_tail``: the values of the kernel's constexpr parameters, appended after the positional arguments
    (the launcher skips them; Triton's ``CompiledKernel.__getitem__`` passes them the same way)."""

    __slots__ = ("run", "function", "packed", "const_tail", "device", "debug", "kernel")


def _direct(jit_fn, ck, nargs: int, const: dict, device: int) -> _Direct | None:
    """A :class:`_Direct` for the compiled kernel ``ck`` that a launch of ``jit_fn`` with ``nargs`` positional
    arguments and the keyword arguments ``const`` returned, or ``None`` when the kernel is not of the expected
    shape (an interpreter run, another Triton layout): then launches keep going through the JIT."""
    try:
        names = list(jit_fn.arg_names)
        if sorted(jit_fn.constexprs) != list(range(nargs, len(names))):
            return None  # the kernel's constexpr parameters are not exactly the ones after the positional ones
        if set(const) - _LAUNCH_OPTIONS != set(names[nargs:]):
            return None
        d = _Direct()
        d.kernel = ck  # owns the module of the function handle below (and of a raw launch's)
        d.run = ck.run  # loads the module on first use
        d.function, d.packed = ck.function, ck.packed_metadata
        if d.function is None:
            return None
        d.const_tail = tuple(const[n] for n in names[nargs:])
        d.device = device
        from triton import knobs
        d.debug = knobs.runtime.debug
        return d
    except Exception:  # noqa: BLE001 - anything unexpected: no direct launch, the JIT stays in charge
        return None


def _check_raw(status: int, which: str) -> None:
    """Raise for a raw launch's driver ``status`` unless it is a context or handle error
    (:data:`~attnplan.backends.cuda_ptx._bindings.CONTEXT_ERRORS`: nothing was enqueued), after which Triton's
    launcher (which handles the context as it does for any launch) launches instead."""
    from attnplan.backends.cuda_ptx._bindings import CONTEXT_ERRORS, check_driver

    if status not in CONTEXT_ERRORS:
        check_driver((status,), f"cuLaunchKernel(triton {which} kernel)")


def _hook_set(hook) -> bool:
    """Whether a Triton launch hook is installed: ``None`` (older Triton) or an empty ``knobs.HookChain`` (newer
    Triton's default, never ``None``) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _same_args(a: tuple, b: tuple) -> bool:
    """Whether two launch argument tuples are the same: tensors by identity, numbers by type and value."""
    return len(a) == len(b) and all(x is y or (not isinstance(x, torch.Tensor) and type(x) is type(y) and x == y)
                                    for x, y in zip(a, b))


def spec_classes(values: tuple) -> tuple:
    """What Triton's JIT specializes a kernel on, per scalar argument, or finer: an ``int`` by whether it is 1 (a
    constant), a multiple of 16 (divisibility) and its width (int32 / int64 / uint64), a ``float`` not at all
    (fp32), anything else by type and value. Two argument lists with equal classes (and equal pointer alignments and
    constexprs) get the same compiled kernel from the JIT."""
    out = []
    for v in values:
        t = type(v)
        if t is int:
            out.append((v == 1, v % 16 == 0, -2 ** 31 <= v < 2 ** 31, v >= 2 ** 63))
        elif t is float:
            out.append(float)
        else:
            out.append((t, v))
    return tuple(out)


def _as_ptrs(args: tuple) -> tuple:
    """``args`` with every tensor replaced by its data pointer."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class BoundLaunch:
    """``DecodeWrapper.run()``'s launches of one plan on one workspace, for inputs of one signature, prepared at
    ``plan()`` time (FlashInfer's plan/run split; the same idea as a CUDA graph's fixed launch parameters, without
    the graph).

    Valid for ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and ``block_table`` with the shapes, strides, dtypes,
    device and 16-byte data-pointer alignment of the ``inputs`` it was made from (``DecodeWrapper.run()`` checks
    exactly that before calling it; a C-contiguous input's strides may differ along axes of length one, where only
    index 0 is read: the binding's strides serve it), with ``inputs``' score scale and variants (the sink and scale
    tensors are kept by reference). ``out`` and ``lse`` may differ from call to call. It keeps no reference to the
    input tensors.

    The first call for each output layout launches through Triton's JIT (which compiles a new specialization) and
    keeps the compiled kernel it returned (a binding made with ``previous``, :meth:`TritonBackend.bind`, starts with
    the kernels of the layouts its predecessor launched, where the specialization is the same); later calls with the
    same output layout launch that compiled kernel directly (``CompiledKernel.run``: the launcher Triton's JIT itself ends in), with arguments laid out once and
    data pointers passed as integers (the launcher then neither calls ``data_ptr()`` nor asks the driver about each
    pointer: every tensor here is device memory of the planned device, checked by ``run()``). A direct launch is
    used only for exactly the specialization Triton compiled: the key holds ``out``'s and ``lse``'s strides and
    the 16-byte alignment of every pointer that can change (``out``, ``lse``, the sink and scale tensors);
    everything else the specialization depends on (the inputs' strides and alignment, the plan's integers, the
    constexprs, the dtypes) is fixed for the binding. The direct path is also left for the JIT when a Triton
    launch hook is set (profilers), when Triton's debug knob changed, under the interpreter, and on another
    current device. Before a layout's first direct launch, the arguments it lays out are compared with those of
    the JIT launch (tensors by identity, numbers by type and value); a mismatch keeps that layout on the JIT.

    With ``raw`` (the default), a layout's direct launches are one ``cuLaunchKernel`` per kernel with the arguments
    above packed once (:func:`.raw.raw_kernel`, where the parameter list derived from Triton's signature matches
    the loaded function's as the driver reports it; else Triton's launcher as above). A call then writes the data
    pointers of q, k_cache, v_cache, seq_lens, block_table, out, lse (and the sink and scale tensors' where the
    binding has them) into the packed buffers under a lock, and launches; a launch that fails with a context or handle
    error (this thread's current context is not the kernel's) enqueued nothing and goes through Triton's launcher;
    any other driver error raises ``DriverError``. ``raw`` (also the attribute) is read when a layout's direct
    launches are prepared: changing it affects layouts first seen afterwards.
    """

    __slots__ = ("backend", "L", "paged", "mid", "mid_ptrs", "tail", "tail_scalars", "last_page", "capacity",
                 "sm_scale", "window_left", "soft_cap", "sinks", "k_scale", "v_scale", "fp8", "variant_tensors",
                 "direct", "merge", "merge_ints", "grids", "hooks", "current_device", "current_stream", "raw", "lock",
                 "spec")

    def __init__(self, backend: "TritonBackend", plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs,
                 raw: bool = True, previous: "BoundLaunch | None" = None):
        x = inputs
        if previous is not None and not (previous.backend is backend and previous.L.plan is plan
                                         and previous.L.workspace is workspace):
            previous = None
        L = previous.L if previous is not None else backend._launch(plan, workspace, remember=False)
        if x.q.shape != L.q_shape:
            raise ValueError(f"q has shape {tuple(x.q.shape)}, the plan {L.q_shape}: re-plan")
        self.backend, self.L = backend, L
        targets = L.ws[0]
        self.fp8 = fp8 = L.const["FP8"]
        k, v, q, sl, bt = x.k_cache, x.v_cache, x.q, x.seq_lens, x.block_table
        self.paged = bt is not None
        bts = bt.stride() if self.paged else (0, 0)
        self.last_page = max(int(k.shape[0]) - 1, 0) if self.paged else 0
        self.capacity = x.capacity  # the clamp of every length the kernel reads
        ks, vs, qs = k.stride(), v.stride(), q.stride()
        self.sm_scale, self.window_left, self.soft_cap = x.sm_scale, x.window_left, x.soft_cap
        self.sinks, self.k_scale, self.v_scale = x.sinks, x.k_scale, x.v_scale
        self.variant_tensors = tuple(t for t in ((x.k_scale, x.v_scale) if fp8 else ()) + (x.sinks,) if t is not None)
        self.mid = tuple(L.ws)  # targets, meta, counters, ws_o, ws_lse: the workspace, fixed
        self.mid_ptrs = tuple(t.data_ptr() for t in self.mid)
        self.tail_scalars = (x.sm_scale * LOG2E, max(x.window_left, 0), float(x.soft_cap), *L.ints, self.last_page,
                             self.capacity, sl.stride(0), qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                             bts[0], bts[1])
        self.tail = (x.k_scale if fp8 else targets, x.v_scale if fp8 else targets,
                     x.sinks if x.sinks is not None else targets) + self.tail_scalars
        self.merge = L.merge_grid is not None
        self.merge_ints = (L.ints[0], L.ints[1])
        g, mg = tuple(L.grid) + (1, 1), tuple(L.merge_grid or ()) + (1, 1, 1)
        self.grids = g[:3] + mg[:3]  # partial then merge grid, three axes each
        self.direct: dict[tuple, tuple] = {}
        self.hooks = self.current_device = self.current_stream = None
        self.raw = raw
        self.lock = threading.Lock()
        ts = self.tail_scalars
        at = 3 + len(L.ints) + 1  # capacity: never specialized on (kernels.UNSPECIALIZED), so not a class here
        self.spec = (tuple((t.dtype, t.data_ptr() & 15) for t in (q, k, v, sl) + ((bt,) if self.paged else ())),
                     spec_classes(ts[:at] + ts[at + 1:]))
        if previous is not None and previous.raw == raw and previous.paged == self.paged \
                and previous.spec == self.spec and previous.sinks is self.sinks and previous.k_scale is self.k_scale \
                and previous.v_scale is self.v_scale:
            self._inherit(previous)
        if not _interpreting() and torch.device(x.q.device).type == "cuda":
            try:
                from triton import knobs
                from triton.runtime import driver
                self.hooks = knobs.runtime
                self.current_device = driver.active.get_current_device
                self.current_stream = driver.active.get_current_stream
            except Exception:  # noqa: BLE001 - no direct launches; the JIT path still works
                self.hooks = None

    def _inherit(self, previous: "BoundLaunch") -> None:
        """Take ``previous``'s compiled kernels for every output layout it launched directly: the same plan,
        workspace, variant tensors and specialization (the inputs' 16-byte alignment and the specialization classes
        of every scalar argument Triton specializes on, :func:`spec_classes`: all but ``capacity``,
        ``kernels.UNSPECIALIZED``) as this binding, so Triton's JIT would return the same
        compiled kernels for this binding's arguments. Raw launches are re-packed with this binding's scalars (the
        parameter layout the driver confirmed is kept); nothing is asked of the JIT or the driver."""
        try:
            var = self._variant_ptrs() if self.variant_tensors else None
            for key, (dp, dm, rp, rm) in previous.direct.items():
                os_, ls = key[0], key[1] if key[1] is not None else (0, 0, 0)
                if rp is not None:
                    rp = rp.with_values(self._direct_args((0, 0, 0, 0, 0), 0, 0, os_, ls, var) + dp.const_tail)
                if rm is not None:
                    rm = rm.with_values(self._direct_merge_args(0, 0, os_, ls, var) + dm.const_tail)
                self.direct[key] = (dp, dm, rp, rm)
        except Exception:  # noqa: BLE001 - a value the packing refuses (a float beyond fp32): the JIT, as on a miss
            self.direct.clear()

    def _inputs(self, q, k, v, sl, bt) -> DecodeInputs:
        return DecodeInputs(q, k, v, sl, bt, self.sm_scale, self.window_left, self.soft_cap, self.sinks,
                            self.k_scale, self.v_scale)

    def _args(self, q, k, v, sl, bt, out, lse, os_, ls) -> tuple:
        """The partial kernel's positional arguments as the JIT gets them (tensors)."""
        targets = self.mid[0]
        return ((q, k, v, sl, bt if self.paged else targets) + self.mid
                + (out, lse if lse is not None else targets) + self.tail + os_[:3] + ls[:2])

    def _merge_args(self, out, lse, os_, ls) -> tuple:
        targets, meta, _, ws_o, ws_lse = self.mid
        return ((ws_o, ws_lse, meta, out, lse if lse is not None else targets,
                 self.sinks if self.sinks is not None else targets) + self.merge_ints + os_[:3] + ls[:2])

    def _direct_args(self, ptrs, po, pl, os_, ls, var) -> tuple:
        """:meth:`_args` with every tensor as its data pointer (``var``: :meth:`_variant_ptrs`, or ``None`` when the
        binding has no sink or scale tensor)."""
        mp = self.mid_ptrs
        if var is None:
            var = (mp[0], mp[0], mp[0])
        return ((ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4] if self.paged else mp[0]) + mp + (po, pl) + var
                + self.tail_scalars + (os_[0], os_[1], os_[2], ls[0], ls[1]))

    def _direct_merge_args(self, po, pl, os_, ls, var) -> tuple:
        """:meth:`_merge_args` with every tensor as its data pointer."""
        mp = self.mid_ptrs
        mi = self.merge_ints
        return (mp[3], mp[4], mp[1], po, pl, mp[0] if var is None else var[2], mi[0], mi[1],
                os_[0], os_[1], os_[2], ls[0], ls[1])

    def _variant_ptrs(self) -> tuple:
        """The data pointers of the k_scale, v_scale and sinks arguments (the targets stand-in where unused)."""
        t = self.mid_ptrs[0]
        return (self.k_scale.data_ptr() if self.fp8 else t, self.v_scale.data_ptr() if self.fp8 else t,
                self.sinks.data_ptr() if self.sinks is not None else t)

    def _layout(self, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
        """``(key, out strides, lse strides, out pointer, lse pointer)``: the direct launches' key holds ``out``'s and
        ``lse``'s strides and the 16-byte alignment of every pointer that can change (the class docstring); without
        an lse the kernels get the workspace's first pointer and zero strides."""
        os_ = out.stride()
        po = out.data_ptr()
        if lse is None:
            ls, pl = (0, 0, 0), self.mid_ptrs[0]
            key = (os_, None, po & 15)
        else:
            ls, pl = lse.stride(), lse.data_ptr()
            key = (os_, ls, po & 15, pl & 15)
        vt = self.variant_tensors
        if vt:
            key += tuple(t.data_ptr() & 15 for t in vt)
        return key, os_, ls, po, pl

    def launch_direct(self, ptrs: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> bool:
        """The direct launches alone (see the class docstring), for inputs of the bound signature whose data pointers
        are ``ptrs`` (q, k, v, sl, bt; 0 for no block table): ``True`` once launched on the current stream; ``False``,
        with nothing launched, where the JIT must launch (no direct launch for ``out``'s and ``lse``'s layout yet, a
        launch hook set, Triton's debug knob changed, another current device): :meth:`__call__` then does."""
        key, os_, ls, po, pl = self._layout(out, lse)
        vt = self.variant_tensors
        entry = self.direct.get(key)
        h = self.hooks
        if entry is None or h is None or _hook_set(h.launch_enter_hook) or _hook_set(h.launch_exit_hook):
            return False
        dp, dm, rp, rm = entry
        dev = self.current_device()
        if dp.device != dev or dp.debug != h.debug:
            return False
        var = self._variant_ptrs() if vt else None
        stream = self.current_stream(dev)
        if rp is not None:
            ins = ptrs if self.paged else (ptrs[0], ptrs[1], ptrs[2], ptrs[3], self.mid_ptrs[0])
            with self.lock:
                status = rp.launch(stream, ins, (po, pl) + var if vt else (po, pl))
                if status == 0:
                    if rm is None:
                        return True
                    status = rm.launch(stream, (po, pl, var[2]) if vt else (po, pl))
                    if status == 0:
                        return True
                    _check_raw(status, "merge")
                    dm.run(*self.grids[3:], stream, dm.function, dm.packed, None, None, None,
                           *self._direct_merge_args(po, pl, os_, ls, var), *dm.const_tail)
                    return True
            _check_raw(status, "partial")  # a context error: nothing enqueued, Triton's launcher runs both
        g = self.grids
        dp.run(g[0], g[1], g[2], stream, dp.function, dp.packed, None, None, None,
               *self._direct_args(ptrs, po, pl, os_, ls, var), *dp.const_tail)
        if dm is not None:
            dm.run(g[3], g[4], g[5], stream, dm.function, dm.packed, None, None, None,
                   *self._direct_merge_args(po, pl, os_, ls, var), *dm.const_tail)
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor | None,
                 out: torch.Tensor, lse: torch.Tensor | None, ptrs: tuple | None = None) -> None:
        """Launch the partial kernel (and the separate merge) on the current stream. No allocation, no sync.
        ``ptrs``: the data pointers of q, k, v, sl and bt (0 for ``None``) when the caller has them."""
        if ptrs is None:
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), bt.data_ptr() if self.paged else 0)
        if self.launch_direct(ptrs, out, lse):
            return
        key, os_, ls, po, pl = self._layout(out, lse)
        vt = self.variant_tensors
        entry = self.direct.get(key)
        h = self.hooks
        # through the JIT: compiles a new specialization; keeps the compiled kernels for direct launches
        be, L = self.backend, self.L
        ck, args = be._launch_partial(L, self._inputs(q, k, v, sl, bt), out, lse)
        cm = margs = None
        if self.merge:
            cm, margs = be._launch_merge(L, out, lse, self.sinks)
        if h is None or entry is not None or len(self.direct) >= 16:
            return
        kern = be._kernels()
        dev = self.current_device()
        dp = None
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), bt.data_ptr() if self.paged else 0)
        var = self._variant_ptrs() if vt else None
        if _same_args(args, self._args(q, k, v, sl, bt, out, lse, os_, ls)) and \
                _as_ptrs(args) == self._direct_args(ptrs, po, pl, os_, ls, var):
            dp = _direct(kern.split_kv_partial_kernel, ck, len(args),
                         {**L.const, "WRITE_LSE": lse is not None, "SINKS_ON": self.sinks is not None}, dev)
        dm = None
        if dp is not None and self.merge:
            if _same_args(margs, self._merge_args(out, lse, os_, ls)) and \
                    _as_ptrs(margs) == self._direct_merge_args(po, pl, os_, ls, var):
                dm = _direct(kern.merge_kernel, cm, len(margs),
                             {**L.merge_const, "WRITE_LSE": lse is not None, "SINKS_ON": self.sinks is not None}, dev)
            if dm is None:
                return
        if dp is not None:
            rp = rm = None
            if self.raw:
                from .raw import raw_kernel

                rp = raw_kernel(ck, self.grids[:3], self._direct_args(ptrs, po, pl, os_, ls, var) + dp.const_tail,
                                ((0, 1, 2, 3, 4), (10, 11, 12, 13, 14) if vt else (10, 11)))
                if rp is not None and dm is not None:
                    rm = raw_kernel(cm, self.grids[3:], self._direct_merge_args(po, pl, os_, ls, var) + dm.const_tail,
                                    ((3, 4, 5) if vt else (3, 4),))
                    if rm is None:
                        rp = None  # both kernels one way or the other
            self.direct[key] = (dp, dm, rp, rm)


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
        self._serial = None  # _INTERPRETER_LOCK where the kernels are interpreted, else None (set by _kernels)
        self._launches: dict[tuple[int, int], _Launch] = {}

    def _kernels(self):
        if self._triton is None:
            from . import kernels
            self._serial = _INTERPRETER_LOCK if _interpreted(kernels.split_kv_partial_kernel) else None
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
    def _launch(self, plan: SplitPlan, workspace: Workspace, remember: bool = True) -> _Launch:
        """The launch constants of ``(plan, workspace)``, kept in ``self._launches`` when ``remember`` (a
        :class:`BoundLaunch` holds its own and keeps nothing here: its wrapper's workspace dies with the wrapper)."""
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
        from .kernels import fused_unroll

        block_m, block_d = max(16, _next_pow2(p.q_len * group)), max(16, _next_pow2(d))
        L.const = dict(
            Q_LEN=p.q_len, GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_N=kc["block_n"],
            BLOCK_B=min(MAX_BLOCK_B, max(16, _next_pow2(p.batch))), ONE_BLOCK=p.batch <= MAX_BLOCK_B,
            GRANULE=s.granule,
            PAGE_SIZE=p.page_size or 1, PAGED=bool(p.page_size), MULTI=not s.single_pass, BALANCED=any(s.targets),
            MERGE=plan.merge, UPCAST=upcast, DOT_PRECISION="ieee" if (p.q_dtype == "float32" or upcast) else "tf32",
            WINDOW=p.window_left >= 0, SOFTCAP=p.soft_cap > 0, FP8=p.kv_dtype == "float8_e4m3fn",
            FUSED_UNROLL=fused_unroll(block_m, block_d),
            num_warps=kc.get("num_warps", 1 if interp else 4), num_stages=kc.get("num_stages", 1 if interp else 2))
        L.ints = (p.batch, slots, s.min_unit_granules, s.max_units_per_seq)
        dummy = workspace.targets
        L.ws = (workspace.targets, workspace.meta if workspace.meta is not None else dummy,
                workspace.counters if workspace.counters is not None else dummy, ws_o, ws_lse)
        if plan.merge == "separate":
            rows = p.batch * p.q_len * p.num_q_heads
            slices, block_d, block_s = merge_geometry(rows, s.max_units_per_seq, d, plan.device.sm_count,
                                                      s.sized_by_lengths)
            L.merge_grid = (rows, slices)
            L.merge_const = dict(NUM_HEADS=p.num_q_heads, Q_LEN=p.q_len, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s,
                                 num_warps=1 if interp else 4)
        else:
            L.merge_grid = L.merge_const = None
        if remember:
            if len(self._launches) >= self.launch_table_max:
                self._launches.clear()
            self._launches[key] = L
        return L

    # -- launches ---------------------------------------------------------------------------------
    @staticmethod
    def _partial_args(L: _Launch, x: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
        """The partial kernel's positional (non-constexpr) arguments, in its parameter order."""
        q, k, v, sl, bt = x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table
        targets, meta, counters, ws_o, ws_lse = L.ws
        fp8 = L.const["FP8"]
        sinks = x.sinks
        if bt is None:
            bt, bts, last_page = targets, (0, 0), 0
        else:
            bts = bt.stride()
            last_page = max(int(k.shape[0]) - 1, 0)  # page indices are clamped into [0, num_pages)
        capacity = x.capacity  # lengths are clamped into [0, capacity]
        ls = lse.stride() if lse is not None else (0, 0)
        ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), out.stride()
        return (q, k, v, sl, bt, targets, meta, counters, ws_o, ws_lse, out, lse if lse is not None else targets,
                x.k_scale if fp8 else targets, x.v_scale if fp8 else targets, sinks if sinks is not None else targets,
                x.sm_scale * LOG2E, max(x.window_left, 0), float(x.soft_cap), *L.ints, last_page, capacity,
                sl.stride(0), qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], bts[0], bts[1],
                os_[0], os_[1], os_[2], ls[0], ls[1])

    @staticmethod
    def _merge_args(L: _Launch, out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None) -> tuple:
        """The merge kernel's positional (non-constexpr) arguments, in its parameter order."""
        targets, meta, _, ws_o, ws_lse = L.ws
        os_ = out.stride()
        ls = lse.stride() if lse is not None else (0, 0)
        return (ws_o, ws_lse, meta, out, lse if lse is not None else targets, sinks if sinks is not None else targets,
                L.ints[0], L.ints[1], os_[0], os_[1], os_[2], ls[0], ls[1])

    def _launch_partial(self, L: _Launch, x: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None):
        """Launch the partial kernel through Triton's JIT (compiling on a new specialization); returns what the
        launch returned (the compiled kernel on a GPU) and the positional arguments used."""
        if x.q.shape != L.q_shape:
            raise ValueError(f"q has shape {tuple(x.q.shape)}, the plan {L.q_shape}: re-plan")
        args = self._partial_args(L, x, out, lse)
        kernel = self._kernels().split_kv_partial_kernel[L.grid]
        if self._serial is None:
            ck = kernel(*args, WRITE_LSE=lse is not None, SINKS_ON=x.sinks is not None, **L.const)
        else:
            with self._serial:
                ck = kernel(*args, WRITE_LSE=lse is not None, SINKS_ON=x.sinks is not None, **L.const)
        return ck, args

    def _launch_merge(self, L: _Launch, out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None):
        """Launch the separate merge kernel through Triton's JIT; returns the launch's result and the arguments."""
        if L.merge_grid is None:
            raise ValueError(f"plan merge is {L.plan.merge!r}: no separate merge to launch")
        args = self._merge_args(L, out, lse, sinks)
        kernel = self._kernels().merge_kernel[L.merge_grid]
        if self._serial is None:
            ck = kernel(*args, WRITE_LSE=lse is not None, SINKS_ON=sinks is not None, **L.merge_const)
        else:
            with self._serial:
                ck = kernel(*args, WRITE_LSE=lse is not None, SINKS_ON=sinks is not None, **L.merge_const)
        return ck, args

    def bind(self, plan: SplitPlan, workspace: Workspace, inputs: DecodeInputs,
             previous: "BoundLaunch | None" = None) -> "BoundLaunch":
        """The launches of ``plan`` for inputs of ``inputs``' signature, prepared once (``DecodeWrapper.plan()``
        calls this; its ``run()`` calls the result). See :class:`BoundLaunch`.

        ``previous``: the binding this one replaces (a wrapper re-planned for inputs of another signature, e.g. a
        KV cache one token longer every step): where the plan, workspace and specialization are the same, its
        compiled kernels and launch constants are kept, so the first ``run()`` launches directly instead of through
        the JIT.

        Raises:
            ValueError: ``workspace`` does not serve the plan, or q's shape is not the plan's.
        """
        return BoundLaunch(self, plan, workspace, inputs, previous=previous)

    def partial(self, plan: SplitPlan, inputs: DecodeInputs, workspace: Workspace, out: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The scheduled partial kernel (:mod:`attnplan.backends.base`): one-unit sequences into ``out``
        ``[B, Q, H, D]`` (q's dtype) and ``lse [B, Q, H]`` fp32 (if given), the others' units into the workspace;
        ``workspace.meta`` for the separate merge; the fused merge inside.

        ``out``'s three leading strides and ``lse``'s two are honoured (their last axes have unit stride), as are
        q's, the cache's and the block table's strides and ``seq_lens``'s. Lengths read from ``seq_lens`` are clamped
        into ``[0, capacity]`` (:attr:`DecodeInputs.capacity`) and page indices read from the block table into ``[0,
        num_pages)`` (``num_pages = k_cache.shape[0]``).

        Raises:
            ValueError: q's shape is not the plan's, or ``workspace`` does not serve the plan.
        """
        one_launch(plan)
        self._launch_partial(self._launch(plan, workspace), inputs, out, lse)

    def merge(self, plan: SplitPlan, workspace: Workspace, out: torch.Tensor, lse: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> None:
        """The separate merge kernel: the rows of sequences with two or more units (``workspace.meta``) into ``out``
        ``[B, Q, H, D]`` and, if given, ``lse [B, Q, H]`` fp32; ``sinks [H]`` fp32 join the denominator. Rows of
        one-unit sequences are left as the partial kernel wrote them.

        Raises:
            ValueError: the plan's merge is not ``separate``, or ``workspace`` does not serve the plan.
        """
        one_launch(plan)
        self._launch_merge(self._launch(plan, workspace), out, lse, sinks)
