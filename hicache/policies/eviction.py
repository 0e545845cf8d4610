"""Eviction strategies and the one heap routine that evicts in their order.

A strategy only ranks nodes: ``key(node)`` returns a sortable value, smallest evicted first. Which
nodes are candidates, what evicting one means and when a parent joins the heap is the tree's business
(mechanism); the strategy never sees the tree. One strategy instance serves both tiers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

__all__ = [
    "FIFO",
    "FILO",
    "LFU",
    "LRU",
    "MRU",
    "SLRU",
    "STRATEGIES",
    "EvictionStats",
    "EvictionStrategy",
    "PriorityFirst",
    "evict_in_order",
    "make_strategy",
]


class EvictionStats(Protocol):
    """What a strategy may read from a node (read-only)."""

    last_access: float
    created: float
    hit_count: int
    priority: int


class EvictionStrategy(Protocol):
    name: str

    def key(self, node: EvictionStats) -> Any:
        """Sort key; the smallest is evicted first. Must not mutate the node."""
        ...


class LRU:
    """Least recently used first."""

    name = "lru"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return node.last_access


class LFU:
    """Fewest hits first; ties by least recently used."""

    name = "lfu"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return (node.hit_count, node.last_access)


class FIFO:
    """Oldest created first."""

    name = "fifo"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return node.created


class MRU:
    """Most recently used first."""

    name = "mru"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return -node.last_access


class FILO:
    """Newest created first."""

    name = "filo"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return -node.created


class PriorityFirst:
    """Lowest request priority first; ties by least recently used."""

    name = "priority"
    __slots__ = ()

    def key(self, node: EvictionStats) -> Any:
        return (node.priority, node.last_access)


class SLRU:
    """Segmented LRU: nodes hit fewer than ``protect_after`` times (probation) go first, in LRU order;
    nodes hit at least that often (protected) go only once no probation node is left."""

    name = "slru"
    __slots__ = ("protect_after",)

    def __init__(self, protect_after: int = 2) -> None:
        if protect_after < 1:
            raise ValueError(f"SLRU protect_after must be >= 1, got {protect_after}")
        self.protect_after = protect_after

    def key(self, node: EvictionStats) -> Any:
        return (node.hit_count >= self.protect_after, node.last_access)


STRATEGIES: MappingProxyType[str, Callable[[], EvictionStrategy]] = MappingProxyType(
    {cls.name: cls for cls in (LRU, LFU, FIFO, MRU, FILO, PriorityFirst, SLRU)}
)


def make_strategy(name: str) -> EvictionStrategy:
    """A fresh strategy by name (``lru``, ``lfu``, ``fifo``, ``mru``, ``filo``, ``priority``, ``slru``)."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction strategy {name!r}; known: {', '.join(STRATEGIES)}"
        ) from None


T = TypeVar("T")


def evict_in_order(
    candidates: Iterable[T],
    *,
    key: Callable[[T], Any],
    ident: Callable[[T], int],
    evict: Callable[[T], tuple[int, T | None]],
    target: int,
) -> int:
    """Evict candidates cheapest first until ``target`` units are freed or none is left.

    ``evict(c)`` does the work and returns (units freed, a new candidate that this eviction exposed or
    None); a new candidate joins the heap at its current key. Ties break by ``ident`` so the order is
    deterministic. Returns the units freed (may exceed ``target`` by the last candidate's size).
    """
    heap = [(key(c), ident(c), c) for c in candidates]
    heapq.heapify(heap)
    freed = 0
    while freed < target and heap:
        _, _, cand = heapq.heappop(heap)
        units, exposed = evict(cand)
        freed += units
        if exposed is not None:
            heapq.heappush(heap, (key(exposed), ident(exposed), exposed))
    return freed
