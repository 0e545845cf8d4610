"""Synthetic KV bytes for replays: a pure function of (page key, layer, position in page), so
every page that reaches L1 from any tier can be checked against what it must be.

Bytes, not values, are generated (so every dtype, 8-bit floats included, works the same): token
t of a page with seed s holds, in layer l and component c (K, V or the MLA latent), the bytes
`(s + 131*l + 61*c + 7*t + j) mod 256` for j over the token's row.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.kernels.pools import DevicePool


def page_seeds(hashes) -> np.ndarray:
    """One small integer per page, from its chained hash."""
    return np.fromiter((int(h[:8], 16) & 0xFFFF for h in hashes), dtype=np.int64,
                       count=len(hashes))


def _token_bases(seeds: np.ndarray, page_size: int, first: int, count: int) -> np.ndarray:
    positions = np.arange(first, first + count, dtype=np.int64)
    return seeds[positions // page_size] + 7 * (positions % page_size)


def _rows(pool: DevicePool, layer: int, component: int) -> torch.Tensor:
    buf = pool.buffer(layer, component)
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def _expected(bases: np.ndarray, layer: int, component: int, width: int) -> torch.Tensor:
    offsets = np.arange(width, dtype=np.int64)
    shift = 131 * layer + 61 * component
    return torch.from_numpy(((bases[:, None] + shift + offsets[None, :]) % 256).astype(np.uint8))


def fill(pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int,
         first: int) -> None:
    """Write the KV of tokens first .. first+len(slots) of a request into `slots`."""
    if not len(slots):
        return
    bases = _token_bases(seeds, page_size, first, len(slots))
    index = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            rows.index_copy_(0, index.to(rows.device), _expected(bases, layer, comp, rows.shape[1])
                             .to(rows.device))


def count_bad_pages(pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int,
                    first: int) -> int:
    """How many pages among tokens first .. first+len(slots) do not hold what they must."""
    if not len(slots):
        return 0
    bases = _token_bases(seeds, page_size, first, len(slots))
    index = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    bad_tokens = torch.zeros(len(slots), dtype=torch.bool)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            got = rows.index_select(0, index.to(rows.device)).cpu()
            want = _expected(bases, layer, comp, rows.shape[1])
            bad_tokens |= (got != want).any(dim=1)
    pages = (np.arange(first, first + len(slots)) // page_size)[bad_tokens.numpy()]
    return len(np.unique(pages))
