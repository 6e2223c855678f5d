"""The ``cuda_ptx`` backend's bound launch (``CudaPtxBackend.bind``): ``DecodeWrapper.run()``'s launches of one plan,
checked and packed at ``plan()`` time.

An unbound launch (``CudaPtxBackend.run``) checks the inputs, lists the ~50 argument values
(:func:`~.args.partial_args`: strides, scalars, data pointers), packs them (:class:`~.args.PackedArgs`) and looks the
kernel up, on every call. For one plan, one workspace and inputs of one signature, all of that is the same from call to
call but seven data pointers, so :class:`BoundLaunch` packs the arguments once per output layout and per call writes
only those pointers into the packed buffer (one ``struct.pack_into``) before the driver launch, which is the unbound
path's own (``cuLaunchKernel``, or ``cuLaunchKernelEx`` with programmatic dependent launch for the separate merge
exactly where the unbound path uses it) without the context query first
(:meth:`~.runtime.DeviceRuntime.launch_current`: a launch outside this device's context fails and is made again
through :meth:`~.runtime.DeviceRuntime.launch_function`).
"""

from __future__ import annotations

import struct
import threading

import torch

from attnplan.backends.base import DecodeInputs

from .args import MERGE_SIGNATURE, PARTIAL_SIGNATURE, PackedArgs

__all__ = ["BoundLaunch", "MAX_LAYOUTS"]

#: most output layouts one binding prepares (a later new layout keeps the unbound path), as Triton's bound launch
MAX_LAYOUTS = 16
#: the parameters a call writes, in signature order: the inputs', the outputs', then the variant tensors' (written
#: only when the binding has a sink or scale tensor)
PARTIAL_PTRS = ("q", "k_cache", "v_cache", "seq_lens", "block_table", "out", "out_lse", "sinks", "k_scale", "v_scale")
MERGE_PTRS = ("out", "out_lse", "sinks")


def _offset(signature: tuple[tuple[str, str], ...], names: tuple[str, ...]) -> int:
    """Byte offset in :class:`PackedArgs`' buffer of the first of ``names``, which must be consecutive pointer
    parameters of ``signature`` (one 8-byte slot each, so one ``struct.pack_into`` writes them all)."""
    order = [n for n, _ in signature]
    i = order.index(names[0])
    if tuple(order[i:i + len(names)]) != names or any(k != "ptr" for _, k in signature[i:i + len(names)]):
        raise AssertionError(f"{names} are not consecutive pointer parameters of the kernel's signature")
    return 8 * i


_PARTIAL_AT = _offset(PARTIAL_SIGNATURE, PARTIAL_PTRS)
_MERGE_AT = _offset(MERGE_SIGNATURE, MERGE_PTRS)
_U64 = {n: struct.Struct(f"<{n}Q") for n in (2, 3, 7, 10)}


class _Prepared:
    """One kernel launch of one output layout: its function, geometry, PDL flag and packed arguments, and where
    (``at``, ``pack``) a call writes its data pointers."""

    __slots__ = ("fn", "name", "cfg", "pdl", "args", "params", "at", "pack")

    def __init__(self, fn, spec, cfg, pdl: bool, args: PackedArgs, at: int, pack: struct.Struct):
        self.fn, self.name, self.cfg, self.pdl, self.args, self.at, self.pack = fn, spec.name, cfg, pdl, args, at, pack
        self.params = args.kernel_params


class BoundLaunch:
    """``DecodeWrapper.run()``'s launches of one plan on one workspace, for inputs of one signature, checked and
    prepared at ``plan()`` time (the same idea as Triton's and numba's bound launches).

    Made from ``inputs`` (``q [B, Q, Hq, D]``, the caches, ``seq_lens [B]`` int32, ``block_table [B, P]`` int32 or
    ``None``, the score scale and variants) by :meth:`CudaPtxBackend.bind`, which runs the checks of
    :meth:`CudaPtxBackend.partial` that do not involve ``out`` / ``lse`` (the workspace, the inputs' shapes, dtypes,
    strides, alignment, page size, variants, fp8 scales, sinks; the same ValueErrors) and needs a CUDA device.

    Assumes what ``DecodeWrapper.run()`` checks before every call: ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and
    ``block_table`` have the shapes, strides, dtypes, device and 16-byte data-pointer alignment of ``inputs`` (a
    C-contiguous input's strides may differ along axes of length one, where only index 0 is read);
    ``out [B, Q, Hq, D]`` (q's dtype, unit last stride) and ``lse [B, Q, Hq]`` fp32 or ``None`` are on that device.
    The score scale, the variants and the workspace are the binding's (the sink and scale tensors are kept by
    reference and their data pointers read at each call, as Triton's bound launch does). It keeps no reference to the
    input tensors.

    Per call it checks the output layout: ``out``'s and ``lse``'s strides, whether ``lse`` is given and the 16-byte
    alignment of their data pointers. The first call with a layout takes the unbound path (``CudaPtxBackend.run``:
    every check, its own argument list and packing, the launches), then packs that call's arguments once per kernel
    (the partial / single-pass one, and the separate merge's) for the layout, at most :data:`MAX_LAYOUTS` layouts.
    A later call with a prepared layout, on the binding's device as the current device, writes the data pointers of
    q, k_cache, v_cache, seq_lens, block_table, out and lse (0 for ``None``; the sink and scale tensors' too where the
    binding has them) into the packed buffers, which are then byte for byte what the unbound path would pack for
    these tensors, and launches with them on torch's current stream. Another current device takes the unbound path
    (which switches to the binding's device). No device memory is allocated and the host never waits.

    Threads: the packed buffers are shared by the calls of one binding, so writing the pointers and launching happen
    under a lock; the driver copies the parameters during ``cuLaunchKernel`` / ``cuLaunchKernelEx``, so the buffers
    may be rewritten as soon as the call returns (a CUDA graph captures the copied values too).
    """

    __slots__ = ("backend", "plan", "workspace", "L", "rt", "sm_scale", "window_left", "soft_cap", "variant_tensors",
                 "variant", "direct", "lock", "current_device", "raw_stream")

    def __init__(self, backend, plan, workspace, inputs: DecodeInputs):
        x = inputs
        L = backend._launch_state(plan, workspace, remember=False)
        backend._check_inputs(plan, x, L.spec)
        backend._check_sinks(x.sinks, x.q.shape[2])
        if workspace.targets.device != x.q.device:
            raise ValueError(f"workspace is on {workspace.targets.device}, q on {x.q.device}")
        self.rt = backend._runtime_for(x.q.device)
        self.backend, self.plan, self.workspace, self.L = backend, plan, workspace, L
        self.sm_scale, self.window_left, self.soft_cap = x.sm_scale, x.window_left, x.soft_cap
        self.variant_tensors = (x.sinks, x.k_scale, x.v_scale)
        self.variant = any(t is not None for t in self.variant_tensors)
        #: output layout key -> (partial, merge or None) prepared launches
        self.direct: dict[tuple, tuple[_Prepared, _Prepared | None]] = {}
        self.lock = threading.Lock()
        self.current_device = torch.cuda.current_device
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # torch.cuda.current_stream(i).cuda_stream's value
        self.raw_stream = raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor | None,
                 out: torch.Tensor, lse: torch.Tensor | None, ptrs: tuple | None = None) -> None:
        """Launch the partial kernel (and the separate merge) on torch's current stream. No allocation, no sync.
        ``ptrs``: the data pointers of q, k, v, sl and bt (0 for ``None``) when the caller has them."""
        if ptrs is None:
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), 0 if bt is None else bt.data_ptr())
        if self.launch_direct(ptrs, out, lse):
            return
        x = DecodeInputs(q, k, v, sl, bt, self.sm_scale, self.window_left, self.soft_cap, *self.variant_tensors)
        self.backend.run(self.plan, x, self.workspace, out, lse)
        key = self._layout(out, lse)[0]
        if key not in self.direct and len(self.direct) < MAX_LAYOUTS:
            self.direct[key] = self._prepare(x, out, lse)

    @staticmethod
    def _layout(out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
        """``(key, out pointer, lse pointer or 0)``: a prepared launch's key is the output layout, ``out``'s (and
        ``lse``'s) strides and 16-byte alignment."""
        po = out.data_ptr()
        if lse is None:
            return (out.stride(), None, po & 15), po, 0
        pl = lse.data_ptr()
        return (out.stride(), lse.stride(), po & 15, pl & 15), po, pl

    def launch_direct(self, ptrs: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> bool:
        """The prepared launches alone, for inputs of the bound signature whose data pointers are ``ptrs`` (q, k, v,
        sl, bt; 0 for no block table): ``True`` once launched on torch's current stream; ``False``, with nothing
        launched, where no launch is prepared yet for ``out``'s and ``lse``'s layout or another device is current
        (:meth:`__call__` then takes the unbound path, which prepares it)."""
        key, po, pl = self._layout(out, lse)
        entry = self.direct.get(key)
        rt = self.rt
        if entry is None or self.current_device() != rt.index:
            return False
        var = tuple(0 if t is None else t.data_ptr() for t in self.variant_tensors) if self.variant else ()
        stream = self.raw_stream(rt.index)
        p, m = entry
        with self.lock:
            p.pack.pack_into(p.args.buffer, p.at, *ptrs, po, pl, *var)
            rt.launch_current(p.fn, p.name, p.cfg, p.params, stream, p.pdl)
            if m is not None:
                m.pack.pack_into(m.args.buffer, m.at, po, pl, *var[:1])
                rt.launch_current(m.fn, m.name, m.cfg, m.params, stream, m.pdl)
        return True

    def _prepare(self, x: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
        """The launches of the unbound path for these (just checked) tensors, packed."""
        be, L, rt = self.backend, self.L, self.rt
        p = _Prepared(rt.function(L.spec), L.spec, L.cfg, False,  # the partial kernel never waits (unbound: no PDL)
                      PackedArgs(PARTIAL_SIGNATURE, be._partial_values(L, x, out, lse)), _PARTIAL_AT,
                      _U64[10 if self.variant else 7])
        m = None
        if L.merge_spec is not None:
            m = _Prepared(rt.function(L.merge_spec), L.merge_spec, L.merge_cfg, L.pdl,
                          PackedArgs(MERGE_SIGNATURE, be._merge_values(L, out, lse, x.sinks)), _MERGE_AT,
                          _U64[3 if self.variant else 2])
        return p, m
