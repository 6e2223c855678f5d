"""Kernel launches through the driver library's C entry points (``ctypes``), for the bound launches' hot path.

cuda-python's ``cuLaunchKernel`` wraps the driver call in Python-level argument conversion: each handle is checked
against its class and unwrapped, and ``kernelParams`` goes through a helper object. On an H200 host one such launch
of an empty kernel took 3.8-6.8 us of host time. The launches made per call by ``DecodeWrapper.run()`` already have
everything in integer form (function handle, grid, block, shared memory, stream, the address of a packed
``void*[]``), so :class:`DriverLaunch` calls ``cuLaunchKernel`` / ``cuLaunchKernelEx`` of ``libcuda.so.1``
directly, with ``ctypes`` argument types declared once. It is the same library cuda-python and torch have loaded
(``dlopen`` returns the process's one copy), so contexts, streams and graph capture are shared.

The structures for ``cuLaunchKernelEx`` (``CUlaunchConfig``, ``CUlaunchAttribute``) are declared as in ``cuda.h``
(CUDA 12.0 and later, unchanged in 13.x); a CPU test compiles ``cuda.h`` and checks every size and offset.

:func:`driver_launch` returns ``None`` (the callers keep cuda-python's launch) where the library or an entry point is
missing, or where ``ATTNPLAN_DRIVER_LAUNCH=cuda-python`` is set.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["DriverLaunch", "LaunchConfigC", "LaunchAttributeC", "driver_launch", "ENV"]

#: environment variable: ``cuda-python`` keeps every launch on cuda-python's bindings (``ctypes``: the default)
ENV = "ATTNPLAN_DRIVER_LAUNCH"
#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (``CUlaunchAttributeID`` in ``cuda.h``)
PROGRAMMATIC_STREAM_SERIALIZATION = 6

_c_uint, _c_void_p = ctypes.c_uint, ctypes.c_void_p


class LaunchAttributeC(ctypes.Structure):
    """``CUlaunchAttribute``: ``id`` (an enum, 4 bytes), 4 bytes of padding, ``value`` (a 64-byte union whose members
    include pointers, so 8-byte aligned); 72 bytes."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfigC(ctypes.Structure):
    """``CUlaunchConfig``: grid and block dimensions, dynamic shared memory, stream, attribute list; 56 bytes."""

    _fields_ = [("gridDimX", _c_uint), ("gridDimY", _c_uint), ("gridDimZ", _c_uint),
                ("blockDimX", _c_uint), ("blockDimY", _c_uint), ("blockDimZ", _c_uint),
                ("sharedMemBytes", _c_uint), ("hStream", _c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttributeC)), ("numAttrs", _c_uint)]


class DriverLaunch:
    """``cuLaunchKernel`` and ``cuLaunchKernelEx`` of one loaded driver library (``ctypes.CDLL``).

    Every handle is an ``int`` (a ``CUfunction`` / ``CUstream`` value; ``int(handle)`` of cuda-python's objects), and
    ``kernel_params`` the address of a ``void*[]`` (:attr:`~.args.PackedArgs.kernel_params`). Each call returns the
    driver's ``CUresult`` as an ``int`` (0: launched); nothing is checked here, the callers do it.
    """

    __slots__ = ("launch", "launch_ex", "lib")

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        f = lib.cuLaunchKernel
        f.argtypes = [_c_void_p, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_void_p, _c_void_p,
                      _c_void_p]
        f.restype = ctypes.c_int
        g = lib.cuLaunchKernelEx
        g.argtypes = [ctypes.POINTER(LaunchConfigC), _c_void_p, _c_void_p, _c_void_p]
        g.restype = ctypes.c_int
        #: ``launch(fn, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra)`` -> CUresult (int): the
        #: argument order of ``cuLaunchKernel`` (and of cuda-python's binding of it)
        self.launch = f
        #: ``launch_ex(config, fn, kernel_params, extra)`` -> CUresult (int); ``config`` from :meth:`pdl_config`
        self.launch_ex = g

    @staticmethod
    def pdl_config(grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int) -> LaunchConfigC:
        """A ``CUlaunchConfig`` with one attribute, programmatic stream serialization allowed (programmatic dependent
        launch). The attribute is kept alive by the returned object (``config._attr``)."""
        attr = LaunchAttributeC()
        attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1  # programmaticStreamSerializationAllowed: the union's first int (little-endian)
        c = LaunchConfigC()
        c.gridDimX, c.gridDimY, c.gridDimZ = grid
        c.blockDimX, c.blockDimY, c.blockDimZ = block
        c.sharedMemBytes = smem
        c.hStream = stream or None
        c.attrs = ctypes.pointer(attr)
        c.numAttrs = 1
        c._attr = attr
        return c


_LAUNCH: list = []  # [DriverLaunch or None] once looked up


def driver_launch() -> DriverLaunch | None:
    """The process's :class:`DriverLaunch`, or ``None`` where ``libcuda.so.1`` (or one of its two entry points)
    cannot be loaded, or where the environment variable :data:`ENV` is ``cuda-python``. Read once per process."""
    if not _LAUNCH:
        d = None
        if os.environ.get(ENV, "ctypes").strip().lower() != "cuda-python":
            try:
                d = DriverLaunch(ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError):  # no driver library (a CPU machine), or an entry point missing
                d = None
        _LAUNCH.append(d)
    return _LAUNCH[0]
