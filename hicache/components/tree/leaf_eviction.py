"""Leaf-first eviction: which nodes leave L1 or L2 and how (demoted to host-only, or removed with
their host-only descendants), in the strategy's order (`evict_in_order`). Functions over a
`TreeStructure`; ``RadixTree``'s methods of the same names call them and document them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hicache.components.tree.node import Node
from hicache.components.tree.retention import ranking
from hicache.components.tree.returns import DeviceEviction, HostEviction, TreeError
from hicache.components.tree.slot_arrays import concat
from hicache.components.tree.structure import TreeStructure
from hicache.policies.eviction import EvictionStrategy, evict_in_order
from hicache.policies.write import WritePolicy
from hicache.types import EMPTY_SLOTS, NodeId

__all__ = ["discard_device", "evict_device", "evict_host", "outranks_host"]


def _ident(x: Node) -> int:
    return x.id


Take = Callable[[Node], tuple[int, "Node | None"]]


def _by_pages(s: TreeStructure, num_tokens: int, split_to_fit: bool, take_whole: Take) -> Take:
    """The step `evict_in_order` takes per victim: with `split_to_fit`, first cut the victim
    to the pages still wanted (it keeps its id and its last pages; exclusive mode evicts by
    pages, like one LRU of both tiers), then take it whole and count what it gave."""
    page = s.page_size
    left = [num_tokens]  # tokens still wanted

    def evict(x: Node) -> tuple[int, Node | None]:
        want = -(-left[0] // page) * page
        if split_to_fit and x.num_tokens > want > 0:
            s.split(x, x.num_tokens - want)
        units, exposed = take_whole(x)
        left[0] -= units
        return units, exposed

    return evict


def evict_device(
    s: TreeStructure,
    num_tokens: int,
    eviction: EvictionStrategy,
    write_policy: WritePolicy,
    require_host_copy: bool,
    now: float,
    back_up: bool = False,
) -> DeviceEviction:
    if num_tokens < 0:
        raise TreeError(f"evict_device: num_tokens must be >= 0, got {num_tokens}")
    keep_unbacked = require_host_copy or back_up or write_policy.backup_on_evict
    freed: list[np.ndarray] = []
    freed_host: list[np.ndarray] = []
    demoted: list[NodeId] = []
    removed: list[NodeId] = []
    needs_backup: list[NodeId] = []

    def evict_whole(x: Node) -> tuple[int, Node | None]:
        parent = x.parent
        device = x.device
        assert parent is not None and device is not None
        if x.host is not None:
            freed.append(device)
            s.set_device(x, None)
            demoted.append(x.id)
        elif keep_unbacked or x.host_pin_until > now:
            # Counts toward the target: it goes once its backup lands. Counting it as 0
            # would report every leaf of L1 and back up all of it. (Pinned to L2: it may
            # leave L1 only once it is there.)
            needs_backup.append(x.id)
            return x.num_tokens, None
        elif x.host_ref:
            return 0, None
        else:
            freed.append(device)
            s.set_device(x, None)
            s.remove_subtree(x, freed_host, removed)
        exposed = (
            parent
            if parent.parent is not None
            and parent.device_children == 0
            and parent.lock_ref == 0
            and parent.device_pin_until <= now
            else None
        )
        return x.num_tokens, exposed

    candidates = [
        x for x in s.device_leaves.values() if x.lock_ref == 0 and x.device_pin_until <= now
    ]
    evict = _by_pages(s, num_tokens, require_host_copy, evict_whole)
    key = ranking(s, eviction, now)
    evict_in_order(candidates, key=key, ident=_ident, evict=evict, target=num_tokens)
    return DeviceEviction(
        freed=concat(freed),
        demoted=tuple(demoted),
        removed=tuple(removed),
        needs_backup=tuple(needs_backup),
        freed_host=concat(freed_host),
    )


def evict_host(
    s: TreeStructure, num_tokens: int, eviction: EvictionStrategy, by_pages: bool, now: float
) -> HostEviction:
    if num_tokens < 0:
        raise TreeError(f"evict_host: num_tokens must be >= 0, got {num_tokens}")
    freed: list[np.ndarray] = []
    removed: list[NodeId] = []

    def evict_whole(x: Node) -> tuple[int, Node | None]:
        parent = x.parent
        host = x.host
        assert parent is not None and host is not None
        freed.append(host)
        removed.append(x.id)
        s.remove(x)
        exposed = None
        if (
            parent.parent is not None
            and parent.device is None
            and not parent.children
            and parent.lock_ref == 0
            and parent.host_ref == 0
            and parent.host_pin_until <= now
        ):
            exposed = parent
        return x.num_tokens, exposed

    evict = _by_pages(s, num_tokens, by_pages, evict_whole)
    key = ranking(s, eviction, now)
    evict_in_order(_host_candidates(s, now), key=key, ident=_ident, evict=evict, target=num_tokens)
    return HostEviction(freed=concat(freed), removed=tuple(removed))


def outranks_host(s: TreeStructure, node: NodeId, eviction: EvictionStrategy, now: float) -> bool:
    key = ranking(s, eviction, now)
    x = s.node(node)
    if x.host_pin_until > now:
        return True  # pinned to L2: it goes there whatever it displaces
    mine = key(x)
    victims = [key(v) for v in _host_candidates(s, now)]
    return not victims or bool(mine >= min(victims))


def _host_candidates(s: TreeStructure, now: float) -> list[Node]:
    return [
        x
        for x in s.host_leaves.values()
        if x.lock_ref == 0 and x.host_ref == 0 and x.host_pin_until <= now
    ]


def discard_device(s: TreeStructure, node: NodeId) -> DeviceEviction:
    x = s.node(node)
    if x.parent is None or x.device is None or x.host is not None:
        raise TreeError(f"discard_device of node {node}: not a device-only node")
    if x.lock_ref or x.device_children or x.backup is not None:
        raise TreeError(f"discard_device of node {node}: locked, in flight or not a leaf")
    if _protected_below(x):
        return DeviceEviction(
            freed=EMPTY_SLOTS, demoted=(), removed=(), needs_backup=(), freed_host=EMPTY_SLOTS
        )
    freed = x.device
    freed_host: list[np.ndarray] = []
    removed: list[NodeId] = []
    s.set_device(x, None)
    s.remove_subtree(x, freed_host, removed)
    return DeviceEviction(
        freed=freed,
        demoted=(),
        removed=tuple(removed),
        needs_backup=(),
        freed_host=concat(freed_host),
    )


def _protected_below(x: Node) -> bool:
    return bool(x.host_ref) or any(_protected_below(c) for c in x.children.values())
