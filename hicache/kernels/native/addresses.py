"""Addresses of numpy arrays as the compiled row copier's calls take them, checked and cheap."""

from __future__ import annotations

import ctypes
from typing import Any, TypeGuard

import numpy as np

I64P = ctypes.POINTER(ctypes.c_int64)
"""The ctypes type of an int64 table argument."""


def int64_pointer(rows: np.ndarray | None, n: int) -> Any:  # a ctypes int64 pointer, or None
    """A ctypes pointer to a 1-D contiguous int64 array of at least `n` entries (None: None)."""
    if rows is None:
        return None
    if rows.dtype != np.int64 or rows.ndim != 1 or rows.size < n or not rows.flags.c_contiguous:
        raise ValueError(f"row table must be 1-D contiguous int64 with at least {n} entries")
    return rows.ctypes.data_as(I64P)


def _probe_data_offset() -> int | None:
    """Where an ndarray object keeps its data pointer, found by looking: right after the
    object header in CPython (numpy's `PyArrayObject_fields.data`), checked against
    `.ctypes.data` on arrays of several kinds; None if it is not there (another build)."""
    offset = object.__sizeof__(object())  # the header: refcount and type (16 B on 64-bit)
    base = np.arange(64, dtype=np.int64)
    samples = [base, base[3:], base[::2], np.zeros(0), np.empty((4, 4), dtype=np.uint8)[1]]
    try:
        if all(
            ctypes.c_void_p.from_address(id(a) + offset).value == a.ctypes.data for a in samples
        ):
            return offset
    except (ValueError, OSError):  # pragma: no cover - a build where reading there fails
        pass
    return None  # pragma: no cover


_DATA_OFFSET = _probe_data_offset()
_POINTER_AT = ctypes.c_void_p.from_address


def data_address(array: np.ndarray) -> int:
    """`array.ctypes.data`, read straight from the array object where that was verified at
    import (`_probe_data_offset`): 0.1 us instead of 1.3-2 us, and a transfer or ledger call
    takes several."""
    if _DATA_OFFSET is None or type(array) is not np.ndarray:  # pragma: no cover
        return int(array.ctypes.data)
    return _POINTER_AT(id(array) + _DATA_OFFSET).value or 0


def int64_address(rows: np.ndarray, n: int) -> int:
    """The address of a 1-D contiguous int64 array of at least `n` entries (as `int64_pointer`)."""
    if rows.dtype != np.int64 or rows.ndim != 1 or rows.size < n or not rows.flags.c_contiguous:
        raise ValueError(f"row table must be 1-D contiguous int64 with at least {n} entries")
    return data_address(rows)


_LIBC = ctypes.CDLL(None)
_MEMCMP = _LIBC.memcmp
_MEMCMP.restype = ctypes.c_int
_MEMCMP.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def flat(array: object, dtype: type[np.generic]) -> TypeGuard[np.ndarray]:
    """Whether `array` is a plain 1-D C-contiguous numpy array of `dtype`: what the compiled
    calls take as they are (anything else goes the checked numpy way)."""
    return (
        type(array) is np.ndarray
        and array.dtype == dtype
        and array.ndim == 1
        and array.flags.c_contiguous
    )


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """`np.array_equal(a, b)` for two arrays; where both are 1-D, C-contiguous and of one
    dtype, one `memcmp` of their bytes (no temporary as large as the arrays, which the slot
    checks of every insert would otherwise make)."""
    if (
        type(a) is np.ndarray
        and type(b) is np.ndarray
        and a.dtype == b.dtype
        and a.ndim == 1
        and b.ndim == 1
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and _DATA_OFFSET is not None
    ):
        if a.size != b.size:
            return False
        return a.size == 0 or _MEMCMP(data_address(a), data_address(b), a.nbytes) == 0
    return bool(np.array_equal(a, b))
