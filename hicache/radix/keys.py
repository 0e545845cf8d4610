"""Key encoding: token ids to the bytes the tree compares, page by page.

Token ids are 32-bit unsigned (as in the L3 page hash); a bigram key (speculative decoding) is a pair
of them per position. A key becomes a flat numpy array with one element per token (a bigram's two
uint32 read as one uint64); node keys are stored as ``bytes``, so whole pages and whole node keys
compare with memcmp (``bytearray.startswith`` on a staging buffer) instead of per-token Python loops.
A faster int64 -> uint32 conversion (the compiled one, kernels/native/rowcopy.py) may be handed in
by whoever builds the tree; the core itself is numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache.radix.results import TreeError

__all__ = ["KeyCodec", "U32Ids"]

_U32_MAX = 2**32 - 1

U32Ids = Callable[[np.ndarray], np.ndarray | None]
"""int64 token ids (1-D, C-contiguous) to a new uint32 array, or None (out of range, or not
available): the codec then converts with numpy, which names the bad id."""


class KeyCodec:
    """Turns keys into bytes for one tree. Immutable."""

    __slots__ = ("bigram", "itemsize", "dtype", "page_size", "page_bytes", "_u32_ids")

    def __init__(self, *, page_size: int, bigram: bool, u32_ids: U32Ids | None = None) -> None:
        self.bigram = bigram
        self.itemsize = 8 if bigram else 4
        # One comparable element per token: a bigram's two uint32 read as one uint64.
        self.dtype = np.dtype(np.uint64 if bigram else np.uint32)
        self.page_size = page_size
        self.page_bytes = page_size * self.itemsize
        self._u32_ids = u32_ids

    def encode(self, key: Sequence[Any] | np.ndarray) -> np.ndarray:
        """The key as a contiguous 1-D array of ``dtype`` (all of it; callers cut to pages). May be a
        view of the caller's array: read, never kept. Raises TreeError on a malformed key."""
        if type(key) is np.ndarray and key.dtype == np.uint32 and key.ndim == 1 and not self.bigram:
            return key if key.flags.c_contiguous else np.ascontiguousarray(key)  # the fast path
        arr = key if isinstance(key, np.ndarray) else np.asarray(key)
        if arr.size == 0:
            return np.empty(0, dtype=self.dtype)
        want_ndim = 2 if self.bigram else 1
        if arr.ndim != want_ndim or (self.bigram and arr.shape[1] != 2):
            shape = "(n, 2) bigram pairs" if self.bigram else "(n,) token ids"
            raise TreeError(f"key must be {shape}, got shape {arr.shape}")
        convert = None if self.bigram else self._u32_ids
        if convert is not None and arr.dtype == np.int64 and arr.flags.c_contiguous:
            converted = convert(arr)
            if converted is not None:  # one pass for what min, max and astype do below
                return converted
        if arr.dtype != np.uint32:
            if arr.dtype.kind not in "iu":
                raise TreeError(f"key must hold integer token ids, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi > _U32_MAX:
                raise TreeError(f"token id {lo if lo < 0 else hi} is outside [0, 2**32)")
            arr = arr.astype(np.uint32)
        arr = np.ascontiguousarray(arr)
        return arr.view(np.uint64).reshape(-1) if self.bigram else arr

    def decode(self, key: bytes) -> np.ndarray:
        """Token ids of encoded bytes ((n,) or (n, 2) uint32), a read-only view."""
        arr = np.frombuffer(key, dtype=np.uint32)
        return arr.reshape(-1, 2) if self.bigram else arr

    def common_tokens(self, node_key: bytes, key: np.ndarray, start: int) -> int:
        """Tokens, cut to whole pages, that ``node_key`` shares with ``key[start:]``."""
        count = min(len(node_key) // self.itemsize, key.size - start)
        a = np.frombuffer(node_key, dtype=self.dtype, count=count)
        differ = a != key[start : start + count]
        same = int(differ.argmax()) if differ.any() else count
        return same - same % self.page_size
