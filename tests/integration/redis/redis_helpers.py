"""Helpers shared by the Redis backend tests (imported by name: the folder is on sys.path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.backends.keys import Namespace, chain_page_hashes

KV = "mha:2:2:8:bfloat16"


class Events:
    """An EventSink recording (name, fields)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.seen if name == event]

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


def namespace(tenant: str = "", kv: str = KV, page_size: int = 4) -> Namespace:
    return Namespace(model="test/redis-model", kv=kv, page_size=page_size, tenant=tenant)


class Pages:
    """Host pages laid out layer-first, [layers, K/V, pages, piece_bytes]: a page is one piece
    per layer and K/V, as the host pool hands them to a backend. Owns its memory."""

    def __init__(self, pages: int, piece_bytes: int = 256, layers: int = 2) -> None:
        self.data = np.zeros((layers, 2, pages, piece_bytes), dtype=np.uint8)

    def buffer(self, page: int) -> list[memoryview]:
        return [
            memoryview(self.data[layer, kv, page])
            for layer in range(self.data.shape[0])
            for kv in (0, 1)
        ]

    def buffers(self, pages: range | list[int]) -> list[list[memoryview]]:
        return [self.buffer(page) for page in pages]

    def fill(self, seed: int) -> Pages:
        self.data[:] = np.random.default_rng(seed).integers(0, 256, self.data.shape, dtype=np.uint8)
        return self

    def page_bytes(self, page: int) -> bytes:
        return b"".join(bytes(piece) for piece in self.buffer(page))


def page_keys(ns: Namespace, count: int, start: int = 0) -> list[str]:
    tokens = np.arange(start, start + count * ns.page_size)
    return ns.keys(chain_page_hashes(tokens, ns.page_size))
