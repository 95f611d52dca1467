"""Dtypes written down by a name that reads back as the same dtype, and the raw bytes of an array.

Why this exists: the dtypes a JAX training state holds beyond numpy's own (bfloat16, the float8
kinds, int4, ...) are ``ml_dtypes`` types. numpy's ``dtype.str`` of them is a void (``'<V2'`` for
bfloat16: read back, that is untyped bytes, not bfloat16), and they refuse the buffer protocol
(``memoryview(x)`` raises "cannot include dtype 'E' in a buffer"). So every place that writes or
sends pieces of the state (snapshot files, the piece exchange between trainers, checkpoint pieces)
records each dtype with ``dtype_name`` and moves its bytes with ``as_bytes``; every place that reads
them back resolves the dtype with ``dtype_of``. Bytes are moved, never values: a NaN's payload, a
signalling NaN, every float8 encoding comes back bit for bit.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["as_bytes", "dtype_name", "dtype_of"]


def dtype_name(dtype: Any) -> str:
    """The name of ``dtype`` (``np.dtype(dtype).name``: 'float32', 'bfloat16', 'float8_e4m3fn',
    'int4', 'bool', ...), which ``dtype_of`` reads back as the same dtype. ValueError for a dtype no
    name describes whole (a structured or void dtype, Python objects, a non-native byte order)."""
    found = np.dtype(dtype)
    try:
        same = dtype_of(found.name) == found
    except ValueError:
        same = False
    if not same:
        raise ValueError(
            f"dtype {found!r} cannot be written down by name and read back as itself: keep the "
            "state's arrays in numeric dtypes of this machine's byte order (those JAX uses)"
        )
    return found.name


def dtype_of(name: str) -> np.dtype[Any]:
    """The dtype ``name`` stands for: a numpy name or type string ('float32', '<f4': files written
    before dtypes were named), else an ``ml_dtypes`` type ('bfloat16', 'int4'). ValueError for a
    name neither knows (written by a newer version, or not a dtype name), or one that would read
    raw bytes as Python objects or untyped bytes."""
    if not isinstance(name, str):
        raise ValueError(f"a dtype name is a string, not {name!r}")
    try:
        found = np.dtype(name)
    except TypeError:
        kind = getattr(ml_dtypes, name, None)
        if not (isinstance(kind, type) and issubclass(kind, np.generic)):
            raise ValueError(
                f"unknown dtype {name!r}: neither numpy {np.__version__} nor ml_dtypes "
                f"{ml_dtypes.__version__} has it (written by a newer version of them?)"
            ) from None
        found = np.dtype(kind)
    if found.hasobject or found.type is np.void:
        raise ValueError(f"dtype {name!r} is not an array of values ({found!r}): its bytes cannot be read")
    return found


def as_bytes(array: Any) -> memoryview:
    """The raw bytes of ``array`` (any shape, 0-d and empty included) as a flat unsigned-byte view.
    Shares the array's memory where it is C-contiguous (so reading into it fills the array); any
    other layout is copied first."""
    flat = np.require(array, requirements="C").reshape(-1)
    return memoryview(flat.view(np.uint8))
