"""cuda-python import shim and result checking for the ``cuda_ptx`` backend.

Imports ``driver`` and ``nvrtc`` from ``cuda.bindings`` (cuda-python >= 12.6, 13.x), falling back to
the older ``from cuda import cuda, nvrtc`` layout. Every driver and NVRTC call's result goes through
:func:`check_driver` / :func:`check_nvrtc`, which raise with the call's name and the error's name and
string, never silently returning a failed handle.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaPtxError", "NvrtcError", "DriverError", "bindings", "check_driver", "check_nvrtc", "CONTEXT_ERRORS"]

#: CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE: what a launch returns when the calling thread's current
#: context is not the function's (none, or another one), or a handle is not valid in it; nothing was enqueued
CONTEXT_ERRORS = frozenset({201, 400})


class CudaPtxError(RuntimeError):
    """Base class of the ``cuda_ptx`` backend's errors."""


class NvrtcError(CudaPtxError):
    """An NVRTC call failed; for a compile error ``log`` holds NVRTC's program log (also in the message)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class DriverError(CudaPtxError):
    """A CUDA driver call failed; the message names the call and the driver's error name and string."""


_BINDINGS: tuple[Any, Any] | None = None
_IMPORT_ERROR: str = ""


def bindings() -> tuple[Any, Any]:
    """``(driver, nvrtc)`` modules of cuda-python.

    Raises:
        CudaPtxError: cuda-python is not importable (the message gives both import errors).
    """
    global _BINDINGS, _IMPORT_ERROR
    if _BINDINGS is None:
        try:
            from cuda.bindings import driver, nvrtc  # cuda-python >= 12.6 / 13.x
        except ImportError as e1:  # pragma: no cover - old cuda-python layout
            try:
                from cuda import cuda as driver  # type: ignore[no-redef]
                from cuda import nvrtc  # type: ignore[no-redef]
            except ImportError as e2:
                _IMPORT_ERROR = f"cuda-python is not importable: {e1}; {e2}"
                raise CudaPtxError(_IMPORT_ERROR) from None
        _BINDINGS = (driver, nvrtc)
    return _BINDINGS


def _unpack(result: Any) -> tuple[Any, Any]:
    """Split a cuda-python return value into ``(status, payload)``; payload is ``None``, one value or a tuple."""
    if isinstance(result, tuple):
        status = result[0]
        rest = result[1:]
        return status, (None if not rest else rest[0] if len(rest) == 1 else rest)
    return result, None


def check_driver(result: Any, call: str) -> Any:
    """Return the payload of a driver call's result, or raise :class:`DriverError`.

    Args:
        result: what the ``cuda.bindings.driver`` function returned (``(CUresult, ...)``).
        call: the call's name for the message, e.g. ``"cuModuleLoadData"``.
    """
    driver, _ = bindings()
    status, payload = _unpack(result)
    if int(status) != int(driver.CUresult.CUDA_SUCCESS):
        name = string = "?"
        try:
            err, n = driver.cuGetErrorName(status)
            name = n.decode() if isinstance(n, bytes) else str(n)
            err, s = driver.cuGetErrorString(status)
            string = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001 - the message must not fail
            name = str(status)
        raise DriverError(f"{call} failed: {name} ({int(status)}): {string}")
    return payload


def check_nvrtc(result: Any, call: str, log: str = "") -> Any:
    """Return the payload of an NVRTC call's result, or raise :class:`NvrtcError` (with ``log`` if given)."""
    _, nvrtc = bindings()
    status, payload = _unpack(result)
    if int(status) != int(nvrtc.nvrtcResult.NVRTC_SUCCESS):
        try:
            s = nvrtc.nvrtcGetErrorString(status)[1]
            string = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001
            string = str(status)
        msg = f"{call} failed: {string} ({int(status)})"
        if log:
            msg += f"\nNVRTC log:\n{log}"
        raise NvrtcError(msg, log)
    return payload
