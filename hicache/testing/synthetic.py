"""Synthetic KV for tests: each page's bytes are a pure function of its chained page hash, layer
and position, so whatever comes back from a lower tier can be checked byte for byte."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hicache.radix.hashes import chain_page_hashes
from hicache.testing.kvfill import count_bad_pages, fill, page_seeds

if TYPE_CHECKING:
    from hicache.cache import HiCache
    from hicache.testing.scheduler import Compute
    from hicache.types import RequestId


def kv_seeds(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """One seed per whole page of `tokens`, plus one for a partial last page."""
    whole = len(tokens) // page_size * page_size
    return np.append(page_seeds(chain_page_hashes(tokens[:whole], page_size)), 0)


def synthetic_compute(cache: HiCache) -> Compute:
    """A `ScriptedScheduler` compute step that writes each new token's synthetic KV."""
    page = cache.config.page_size

    def compute(rid: RequestId, tokens: np.ndarray, slots: np.ndarray, first: int) -> None:
        fill(cache.device_pool, slots[first:], kv_seeds(tokens, page), page_size=page, first=first)

    return compute


def bad_prefix_pages(cache: HiCache, tokens: np.ndarray, slots: np.ndarray) -> int:
    """Pages among the first len(slots) tokens whose KV is not what it must be."""
    page = cache.config.page_size
    return count_bad_pages(
        cache.device_pool, slots, kv_seeds(tokens, page), page_size=page, first=0
    )
