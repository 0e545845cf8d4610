"""Retention and pins on the tree's nodes (docs/tree.md, "Retention and pins").

A retention range gives the pages it covers a priority until a time on the cache's clock:
eviction in both tiers takes the lowest priority first, then the strategy's order. Past its
time a node's priority is the default again. Among explicit ranges the higher priority wins
(equal ones keep the later end); a node with no live range takes whatever a range says, so a
range may also rank pages *below* the default.

A pin keeps a prefix's nodes in L1 (not evicted) and/or in L2 (not removed; they may still
leave L1, backed up first) until a time. Pins cover whole prefixes, so every ancestor of a
pinned node is pinned too and a leaf-first eviction never has to look past a pinned leaf.

Both are marks on nodes, cut at page boundaries (a node is wholly in or out of a range) and
copied by splits; expiry needs no timer: every check compares with ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache.components.tree.node import INF, Node
from hicache.components.tree.prefix import PrefixIndex
from hicache.components.tree.structure import TreeStructure
from hicache.policies.eviction import EvictionStrategy

__all__ = ["Range", "mark_pins", "ranking", "retain", "unmark_pins"]

Range = tuple[int, int, int, float]  # start, end (tokens), priority, until (cache clock)


def ranking(s: TreeStructure, strategy: EvictionStrategy, now: float) -> Callable[[Node], Any]:
    """The eviction order at `now`: the strategy's key, after the live priority once any
    retention was set (until then every node has the default and the plain key is the order).
    An expired range is reset here, so a strategy that reads `priority` sees the live one."""
    if not s.ranked:
        return strategy.key
    default, key = s.default_priority, strategy.key

    def ranked(x: Node) -> Any:
        if x.retain_until <= now:
            x.priority, x.retain_until = default, INF
        return (x.priority, key(x))

    return ranked


def _spans(
    prefix: PrefixIndex, start: Node, key: np.ndarray, n: int, cuts: Sequence[int], now: float
) -> list[tuple[Node, int, int]]:
    """The cached nodes along `key[:n]` with the token span each covers, split first so that
    every cut (a page boundary) falls between two nodes."""
    for cut in sorted(set(cuts)):
        if 0 < cut < n:
            prefix.descend(start, key, cut, now)  # splits the node the cut falls inside
    path, _ = prefix.descend(start, key, n, now)
    spans, pos = [], 0
    for x in path:
        spans.append((x, pos, pos + x.num_tokens))
        pos += x.num_tokens
    return spans


def retain(
    s: TreeStructure,
    prefix: PrefixIndex,
    start: Node,
    key: np.ndarray,
    ranges: Sequence[Range],
    now: float,
) -> None:
    """Give the cached pages of `key` (below `start`) the priorities of `ranges`; a page
    partly inside a range counts as inside."""
    ps = s.page_size
    n = key.size - key.size % ps
    bounds = [(lo // ps * ps, min(-(-hi // ps) * ps, n), p, until) for lo, hi, p, until in ranges]
    cuts = [b for lo, hi, _, _ in bounds for b in (lo, hi)]
    default = s.default_priority
    for x, a, b in _spans(prefix, start, key, n, cuts, now):
        for lo, hi, priority, until in bounds:
            if not (lo <= a and b <= hi):
                continue
            if x.retain_until <= now:
                x.priority, x.retain_until = default, INF
            explicit = x.priority != default or x.retain_until != INF
            if not explicit or priority > x.priority:
                x.priority, x.retain_until = priority, until
            elif priority == x.priority:
                x.retain_until = max(x.retain_until, until)
            s.ranked = True


def mark_pins(
    s: TreeStructure,
    prefix: PrefixIndex,
    start: Node,
    key: np.ndarray,
    device_until: float,
    host_until: float,
    now: float,
) -> int:
    """Pin the cached nodes of `key` (whole pages, below `start`); returns the tokens marked."""
    n = key.size
    marked = 0
    for x, _, b in _spans(prefix, start, key, n, (), now):
        x.device_pin_until = max(x.device_pin_until, device_until)
        x.host_pin_until = max(x.host_pin_until, host_until)
        marked = b
    return marked


def unmark_pins(
    s: TreeStructure, prefix: PrefixIndex, start: Node, key: np.ndarray, now: float
) -> None:
    """Drop every pin mark along `key` (the caller marks again what other pins still cover)."""
    path, _ = prefix.descend(start, key, key.size, now)
    for x in path:
        x.device_pin_until = x.host_pin_until = -INF
