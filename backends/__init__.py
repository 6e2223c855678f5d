"""attnplan backends (installed as ``attnplan.backends``): one subpackage per backend.

:func:`get_backend` returns a backend instance by name, importing its module lazily so a
missing optional dependency (numba-cuda, cuda-python) makes only that backend unavailable.
"""

from __future__ import annotations

import importlib

from attnplan._repr import short_repr

from .base import Backend, DecodeInputs, Workspace

__all__ = ["Backend", "DecodeInputs", "Workspace", "get_backend", "check_backend_name", "BACKEND_CLASSES"]

BACKEND_CLASSES = {
    "reference": ("attnplan.backends.reference", "ReferenceBackend"),
    "triton": ("attnplan.backends.triton", "TritonBackend"),
    "numba": ("attnplan.backends.numba", "NumbaBackend"),
    "cuda_ptx": ("attnplan.backends.cuda_ptx", "CudaPtxBackend"),
}

_instances: dict[str, Backend] = {}


class UnavailableBackend(Backend):
    """Stands in for a backend whose module failed to import; ``available()`` gives the error."""

    def __init__(self, name: str, error: str):
        self.name = name
        self._error = error

    def available(self, device):
        return False, self._error

    def kernel_config(self, problem, options, device):
        raise RuntimeError(self._error)

    partial = merge = kernel_config


def check_backend_name(name) -> None:
    """Raise unless ``name`` names a backend (a key of :data:`BACKEND_CLASSES`).

    Raises:
        TypeError: ``name`` is not a ``str``, ``None`` included (a caller meaning the config's order does not ask).
        ValueError: ``name`` is not one of :data:`BACKEND_CLASSES` (``""`` included).
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a backend name (one of {sorted(BACKEND_CLASSES)}) or None, got "
                        f"{type(name).__name__} {short_repr(name)}")
    if name not in BACKEND_CLASSES:
        raise ValueError(f"unknown backend {short_repr(name)}; expected one of {sorted(BACKEND_CLASSES)}")


def get_backend(name: str) -> Backend:
    """The (cached) backend instance called ``name``.

    Raises:
        TypeError, ValueError: ``name`` is not one of :data:`BACKEND_CLASSES` (:func:`check_backend_name`).
    """
    check_backend_name(name)
    inst = _instances.get(name)
    if inst is None:
        module, cls = BACKEND_CLASSES[name]
        try:
            inst = getattr(importlib.import_module(module), cls)()
        except Exception as e:  # noqa: BLE001 - an optional dependency may be missing or broken
            inst = UnavailableBackend(name, f"{name} backend failed to load: {type(e).__name__}: {e}")
        _instances[name] = inst
    return inst
