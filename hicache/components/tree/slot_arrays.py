"""Slot arrays as the tree keeps and returns them: read-only int64, one slot per token."""

from __future__ import annotations

import numpy as np

from hicache.components.tree.returns import TreeError
from hicache.types import EMPTY_SLOTS

__all__ = ["concat", "frozen_slots"]


def concat(parts: list[np.ndarray]) -> np.ndarray:
    """The parts end to end, read-only (a single part is returned as is)."""
    if not parts:
        return EMPTY_SLOTS
    if len(parts) == 1:
        return parts[0]
    out = np.concatenate(parts)
    out.flags.writeable = False
    return out


def frozen_slots(slots: np.ndarray, what: str, expected: int) -> np.ndarray:
    """Slots as a read-only int64 array the tree may keep. A read-only int64 array (as the ledgers
    return) is kept as is; anything else is copied, since the caller may change it later."""
    if (
        type(slots) is np.ndarray
        and slots.dtype == np.int64
        and not slots.flags.writeable
        and slots.ndim == 1
        and slots.size == expected
    ):
        return slots
    arr = np.asarray(slots)
    if arr.ndim != 1 or arr.size != expected:
        raise TreeError(f"{what}: expected {expected} slots, got shape {arr.shape}")
    if arr.dtype == np.int64 and not arr.flags.writeable:
        return arr
    if arr.size and arr.dtype.kind not in "iu":
        raise TreeError(f"{what}: slots must be integers, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.int64)
    out.flags.writeable = False
    return out
