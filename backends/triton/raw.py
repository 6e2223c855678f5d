"""Launch a compiled Triton kernel with one driver call: ``cuLaunchKernel`` through cuda-python, with its arguments
packed once (the ``cuda_ptx`` backend's :class:`~attnplan.backends.cuda_ptx.args.PackedArgs`).

Triton's own launcher (``CompiledKernel.run``) rebuilds the whole argument list on every call: a Python wrapper
that looks for scratch allocators and hooks, then a C function that parses each of ~40 arguments. For a bound launch
(:class:`~attnplan.backends.triton.BoundLaunch`) all of them but a few data pointers are the same from call to call,
so :class:`RawKernel` packs them once and per call writes only those pointers into the packed buffer (one
``struct.pack_into`` per run of consecutive pointer parameters) before the launch. PyTorch's Inductor does the same
for its generated kernels (``torch/_inductor/runtime/static_triton_launcher.py``).

The kernel's parameter list is derived from what Triton compiled, never assumed: the specialization's signature
(``CompiledKernel.src.signature``: one type per argument; ``constexpr`` for constexprs and for arguments Triton
specialized to constants, e.g. an integer equal to 1, which the compiled kernel does not take), followed by a null
pointer for each scratch buffer the compiled kernel declares (``global_scratch_size`` / ``profile_scratch_size`` in
its metadata, which must then be 0). That list is checked against the loaded function's own parameters as the
driver reports them (``cuFuncGetParamInfo``: their number and each one's size). :func:`raw_kernel` returns ``None``
where anything does not match or is not served (a type other than pointer / int32 / int64 / fp32, several CTAs per
program, a cooperative or programmatic-dependent launch, a driver without ``cuFuncGetParamInfo``); the caller then
keeps Triton's launcher.
"""

from __future__ import annotations

import struct

__all__ = ["RawKernel", "raw_kernel", "param_kinds"]

#: Triton signature type -> :class:`PackedArgs` kind, and the parameter's size in bytes
_KINDS = {"i32": ("i32", 4), "i64": ("i64", 8), "fp32": ("f32", 4)}


def param_kinds(src, metadata) -> list[tuple[int, str, int]] | None:
    """The compiled kernel's parameters from a Triton specialization's source (``src.signature``: argument name ->
    type, in argument order; an argument in ``src.constants``, where a Triton version keeps specialized constants
    there, counts as ``constexpr``) and its ``metadata``: ``(argument index or -1 for a scratch pointer, PackedArgs
    kind, size in bytes)`` per parameter, in order; ``None`` where a type is not served (see the module docstring).

    Pure Python (no GPU): the offline compile tests check it against the PTX entry's parameters."""
    names = list(src.signature)
    constant = set()
    for key in getattr(src, "constants", None) or {}:
        key = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        constant.add(names.index(key) if isinstance(key, str) and key in names else key)
    params = []
    for i, ty in enumerate(src.signature.values()):
        if ty == "constexpr" or i in constant:
            continue
        if isinstance(ty, str) and ty.startswith("*"):
            params.append((i, "ptr", 8))
        elif ty in _KINDS:
            kind, size = _KINDS[ty]
            params.append((i, kind, size))
        else:
            return None  # a bool, a 16-bit float, a tuple, a tensor descriptor: Triton's launcher handles it
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(metadata, attr):
            if getattr(metadata, attr):
                return None  # a kernel that needs scratch memory allocated per launch
            params.append((-1, "ptr", 8))
    return params


class RawKernel:
    """One compiled Triton kernel's launch with packed arguments: ``grid`` (three axes), ``num_warps x 32``
    threads, ``shared`` bytes of dynamic shared memory, the function handle Triton loaded.

    ``values``: every argument of the kernel in Triton's order (constexprs included, ignored), data pointers as
    ints. ``changing``: groups of argument indices, each of pointer arguments that are consecutive parameters, whose
    values :meth:`launch` writes (one group per ``values`` tuple it gets). ``driver_launch``: cuda-python's
    ``cuLaunchKernel``.

    Raises:
        ValueError: a group is not consecutive pointer parameters.
    """

    __slots__ = ("fn", "grid", "block", "smem", "args", "params", "writes", "driver_launch", "layout")

    def __init__(self, fn, grid: tuple[int, int, int], num_warps: int, shared: int, params: list, values: tuple,
                 changing: tuple[tuple[int, ...], ...], driver_launch):
        self.layout = tuple(params)
        self._pack(values)
        slot = {i: j for j, (i, kind, _) in enumerate(params) if i >= 0 and kind == "ptr"}
        writes = []
        for group in changing:
            slots = [slot.get(i) for i in group]
            if None in slots or slots != list(range(slots[0], slots[0] + len(slots))):
                raise ValueError(f"arguments {group} are not consecutive pointer parameters")
            writes.append((8 * slots[0], struct.Struct(f"<{len(slots)}Q")))
        self.writes = tuple(writes)
        self.fn, self.grid, self.block, self.smem = fn, tuple(grid), (32 * int(num_warps), 1, 1), int(shared)
        self.driver_launch = driver_launch  # cuda-python's cuLaunchKernel

    def _pack(self, values: tuple) -> None:
        from attnplan.backends.cuda_ptx.args import PackedArgs

        signature = tuple((f"p{j}", kind) for j, (_, kind, _) in enumerate(self.layout))
        self.args = PackedArgs(signature, [0 if i < 0 else values[i] for i, _, _ in self.layout])
        self.params = self.args.kernel_params

    def with_values(self, values: tuple) -> "RawKernel":
        """The same kernel, grid and parameter layout (already checked against the driver) with other argument
        ``values`` packed into a buffer of its own: for a launch of the same compiled specialization with other
        scalars (a re-bound launch whose strides changed, :class:`~attnplan.backends.triton.BoundLaunch`). The
        caller vouches that Triton would pick this specialization for ``values`` (equal specialization classes,
        ``attnplan.backends.triton.spec_classes``)."""
        k = object.__new__(RawKernel)
        k.fn, k.grid, k.block, k.smem, k.writes, k.driver_launch, k.layout = (
            self.fn, self.grid, self.block, self.smem, self.writes, self.driver_launch, self.layout)
        k._pack(values)
        return k

    def launch(self, stream: int, *groups: tuple):
        """Write each group's data pointers (one ``values`` tuple per group of ``changing``, in order), then
        ``cuLaunchKernel`` on ``stream``; returns the driver's status, a ``CUresult`` (0: launched;
        :data:`~attnplan.backends.cuda_ptx._bindings.CONTEXT_ERRORS`: nothing
        was enqueued). The caller serializes calls on one kernel (the buffer is
        shared); the driver copies the parameters during the call."""
        buf = self.args.buffer
        for (at, st), vals in zip(self.writes, groups):
            st.pack_into(buf, at, *vals)
        g, b = self.grid, self.block
        res = self.driver_launch(self.fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, self.params, 0)
        return res[0] if type(res) is tuple else res


def raw_kernel(ck, grid, values: tuple, changing: tuple[tuple[int, ...], ...]) -> RawKernel | None:
    """A :class:`RawKernel` for Triton's compiled kernel ``ck`` (loaded: its function handle exists) launched on
    ``grid`` with ``values`` (see :class:`RawKernel`), or ``None`` where the kernel is not served or its parameters
    as the driver reports them differ from the ones derived from Triton's signature."""
    try:
        md = ck.metadata
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) \
                or getattr(md, "launch_pdl", False):
            return None
        params = param_kinds(ck.src, md)
        if params is None or len(values) != len(ck.src.signature):
            return None
        from attnplan.backends.cuda_ptx._bindings import bindings

        driver = bindings()[0]
        fn = driver.CUfunction(int(ck.function))
        info = getattr(driver, "cuFuncGetParamInfo", None)
        if info is None:
            return None
        for j, (_, _, size) in enumerate(params):
            res = info(fn, j)
            if int(res[0]) != 0 or int(res[2]) != size:
                return None
        if int(info(fn, len(params))[0]) == 0:  # the kernel takes more parameters than derived
            return None
        g = tuple(grid) + (1,) * (3 - len(grid))
        if min(g) < 1:
            return None  # Triton's launcher skips an empty grid; the driver would refuse it
        return RawKernel(fn, g, md.num_warps, md.shared, params, values, changing, driver.cuLaunchKernel)
    except Exception:  # noqa: BLE001 - anything unexpected: Triton's launcher stays in charge
        return None
