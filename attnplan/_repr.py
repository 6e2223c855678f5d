"""Bounded ``repr`` for error messages: a value from a user or a file is shown, never walked or printed whole."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 6, 8, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` of at most ``limit`` characters, bounded in depth and items as it is built (``reprlib``:
    a long list or a deep mapping is not walked past what is shown). An int of more than 256 bits is described by
    its bit length (Python refuses to convert one of more than 4,300 digits); a value whose repr raises (a foreign
    object, a list holding such an int), by its type."""
    if isinstance(value, int) and value.bit_length() > 256:  # (a decimal conversion quadratic in the digits)
        return f"an int of {value.bit_length()} bits"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a foreign object's repr, or a huge int inside a container (ValueError)
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."
