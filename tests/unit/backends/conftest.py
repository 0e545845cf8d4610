"""Fixtures for backend tests: anyio on asyncio, namespaces, a fake host page layout."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.backends.keys import Namespace
from hicache.radix.hashes import chain_page_hashes


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ns() -> Namespace:
    return Namespace(model="test/model", kv="mha:2:2:4:bfloat16", page_size=4)


class FakeHostPool:
    """Interface-compatible stand-in for the kernels host pool: a layer-first buffer
    [layers, 2 (K/V), pages, page_bytes_per_layer]. `page_buffer(page)` returns the page's
    pieces (one per layer and K/V) as memoryviews into the pool, in the order the value is
    stored. Pure numpy; owns its memory."""

    def __init__(self, pages: int, layers: int = 2, piece_bytes: int = 64) -> None:
        self.data = np.zeros((layers, 2, pages, piece_bytes), dtype=np.uint8)

    def page_buffer(self, page: int) -> list[memoryview]:
        layers = self.data.shape[0]
        return [memoryview(self.data[l, kv, page]) for l in range(layers) for kv in range(2)]

    def fill(self, page: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.data[:, :, page] = rng.integers(0, 256, self.data[:, :, page].shape, dtype=np.uint8)

    def page_bytes(self, page: int) -> bytes:
        return b"".join(bytes(p) for p in self.page_buffer(page))


@pytest.fixture
def pool() -> FakeHostPool:
    return FakeHostPool(pages=8)


def page_keys(ns: Namespace, n: int, start: int = 0) -> list[str]:
    tokens = np.arange(start, start + n * ns.page_size)
    return ns.keys(chain_page_hashes(tokens, ns.page_size))
