"""Synthetic KV bytes, the stand-in model of the replay and the test kit: a pure function of
(page seed, layer, position in page), so every page that reaches L1 from any tier can be
checked against what it must be.

Bytes, not values, are generated (so every dtype, 8-bit floats included, works the same): token
t of a page with seed s holds, in layer l and component c (K, V or the MLA latent), the bytes
`(s + 131*l + 61*c + 7*t + j) mod 256` for j over the token's row.

A row is therefore one of 256 windows of the ramp 0, 1, ..., 255, 0, 1, ...: the expected rows
are gathered from a (256, width) table of those windows, and on CPU pools written and compared
through numpy views of the pool, with no per-element arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from hicache.kernels.pools import DevicePool


def page_seeds(hashes: Sequence[str]) -> np.ndarray:
    """One small integer per page, from its chained hash."""
    return np.fromiter((int(h[:8], 16) & 0xFFFF for h in hashes), dtype=np.int64, count=len(hashes))


def _token_bases(seeds: np.ndarray, page_size: int, first: int, count: int) -> np.ndarray:
    positions = np.arange(first, first + count, dtype=np.int64)
    return seeds[positions // page_size] + 7 * (positions % page_size)


@lru_cache(maxsize=16)
def _windows(width: int) -> np.ndarray:
    """Row r is (r + j) mod 256 for j < width: every row the pattern can produce."""
    ramp = (np.arange(width + 256, dtype=np.int64) % 256).astype(np.uint8)
    table = np.lib.stride_tricks.sliding_window_view(ramp, width)[:256]
    return np.ascontiguousarray(table)


def _rows(pool: DevicePool, layer: int, component: int) -> torch.Tensor:
    buf = pool.buffer(layer, component)
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def _expected(bases: np.ndarray, layer: int, component: int, width: int) -> np.ndarray:
    shift = 131 * layer + 61 * component
    rows: np.ndarray = _windows(width)[(bases + shift) % 256]
    return rows


def fill(
    pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int, first: int
) -> None:
    """Write the KV of tokens first .. first+len(slots) of a request into `slots`."""
    if not len(slots):
        return
    bases = _token_bases(seeds, page_size, first, len(slots))
    index = np.asarray(slots, dtype=np.int64)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            want = _expected(bases, layer, comp, rows.shape[1])
            if rows.device.type == "cpu":
                rows.numpy()[index] = want
            else:
                rows.index_copy_(
                    0,
                    torch.from_numpy(index).to(rows.device),
                    torch.from_numpy(want).to(rows.device),
                )


def count_bad_pages(
    pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int, first: int
) -> int:
    """How many pages among tokens first .. first+len(slots) do not hold what they must."""
    if not len(slots):
        return 0
    bases = _token_bases(seeds, page_size, first, len(slots))
    index = np.asarray(slots, dtype=np.int64)
    bad_tokens = np.zeros(len(slots), dtype=bool)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            if rows.device.type == "cpu":
                got = rows.numpy()[index]
            else:
                got = rows.index_select(0, torch.from_numpy(index).to(rows.device)).cpu().numpy()
            bad_tokens |= (got != _expected(bases, layer, comp, rows.shape[1])).any(axis=1)
    pages = (np.arange(first, first + len(slots)) // page_size)[bad_tokens]
    return len(np.unique(pages))
