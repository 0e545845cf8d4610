"""Leaf-first eviction: which nodes leave L1 or L2 and how (demoted to host-only, or removed with
their host-only descendants), in the strategy's order (`evict_in_order`), after the live
retention priority and around pins (docs/tree.md, "Retention and pins"). `RadixTree` (tree.py)
is this class with match and insert, retention and the copies between tiers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.policies.eviction import EvictionStrategy, evict_in_order
from hicache.policies.write import WritePolicy
from hicache.radix.keys import KeyCodec
from hicache.radix.results import DeviceEviction, HostEviction, TreeError, concat
from hicache.radix.structure import INF, Node, TreeObserver, TreeStructure
from hicache.types import EMPTY_SLOTS, NodeId

__all__ = ["EvictingTree"]

Take = Callable[
    [Node], tuple[int, "Node | None"]
]  # evict one victim: (units freed, parent exposed)


def _ident(x: Node) -> int:
    return x.id


class EvictingTree(TreeStructure):
    """The tree's nodes with leaf-first eviction from both tiers, ranked by ``eviction`` (a
    strategy) and governed by ``write_policy`` (whether a leaf without host copy may leave L1)."""

    def __init__(
        self,
        *,
        eviction: EvictionStrategy,
        write_policy: WritePolicy,
        codec: KeyCodec,
        observer: TreeObserver | None,
        default_priority: int,
    ) -> None:
        super().__init__(codec=codec, observer=observer, default_priority=default_priority)
        self.eviction = eviction
        self.write_policy = write_policy

    def evictable_device_tokens(self) -> int:
        """Device tokens in unlocked nodes (some may first need a backup under write_back)."""
        return self._evictable_device

    def evictable_host_tokens(self) -> int:
        """Host-only tokens in unlocked, unprotected nodes."""
        return self._evictable_host

    def evict_device(
        self,
        num_tokens: int,
        *,
        now: float,
        require_host_copy: bool = False,
        back_up: bool = False,
    ) -> DeviceEviction:
        """Free at least ``num_tokens`` device slots if unlocked leaves allow, cheapest first by the
        strategy, leaf-first. A leaf with a host copy is demoted to HOST_ONLY; one without is removed
        with its host-only descendants, unless the write policy (write_back), ``back_up`` (the caller
        wants every page that leaves L1 copied to L2 first: L3 is attached) or ``require_host_copy``
        (exclusive mode) wants a host copy first: then it is reported in ``needs_backup`` and kept.
        Never touches locked nodes, or removes a host-protected one. With ``require_host_copy``
        the last leaf taken, when longer than what is still wanted, is split and only its last
        pages (the wanted tokens, rounded up to a page) are evicted: in exclusive mode a leaf
        moves into L2 whole, and moving more than wanted evicts as much more from L2. Retention
        and pins are read at ``now``. Mutates."""
        if num_tokens < 0:
            raise TreeError(f"evict_device: num_tokens must be >= 0, got {num_tokens}")
        keep_unbacked = require_host_copy or back_up or self.write_policy.backup_on_evict
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
                self._set_device(x, None)
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
                self._set_device(x, None)
                self._remove_subtree(x, freed_host, removed)
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
            x for x in self._device_leaves.values() if x.lock_ref == 0 and x.device_pin_until <= now
        ]
        evict = self._by_pages(num_tokens, require_host_copy, evict_whole)
        key = self._ranking(now)
        evict_in_order(candidates, key=key, ident=_ident, evict=evict, target=num_tokens)
        return DeviceEviction(
            freed_parts=tuple(freed),
            demoted=tuple(demoted),
            removed=tuple(removed),
            needs_backup=tuple(needs_backup),
            freed_host=concat(freed_host),
        )

    def evict_host(self, num_tokens: int, *, now: float, by_pages: bool = False) -> HostEviction:
        """Free at least ``num_tokens`` host slots if possible by removing host-only leaves that are
        neither locked nor host-protected, cheapest first by the strategy; a parent left host-only and
        childless joins the candidates. With ``by_pages`` (exclusive mode) the last leaf taken, when
        longer than what is still wanted, is split and only its last pages are removed. Mutates."""
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
            self._remove(x)
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

        evict = self._by_pages(num_tokens, by_pages, evict_whole)
        key = self._ranking(now)
        candidates = self._host_candidates(now)
        evict_in_order(candidates, key=key, ident=_ident, evict=evict, target=num_tokens)
        return HostEviction(freed_parts=tuple(freed), removed=tuple(removed))

    def outranks_host(self, node: NodeId, *, now: float) -> bool:
        """Exclusive mode: whether a device leaf about to leave L1 should take an L2 place, i.e. the
        strategy would keep it over L2's next victim (or L2 has no victim). A leaf that loses to all
        of L2 is dropped instead of displacing something hotter. Does not mutate."""
        key = self._ranking(now)
        x = self._node(node)
        if x.host_pin_until > now:
            return True  # pinned to L2: it goes there whatever it displaces
        mine = key(x)
        victims = [key(v) for v in self._host_candidates(now)]
        return not victims or bool(mine >= min(victims))

    def discard_device(self, node: NodeId) -> DeviceEviction:
        """Drop an unlocked device leaf without a host copy (and its host-only descendants)
        from the tree, as a non-backup L1 eviction would. Mutates."""
        x = self._node(node)
        if x.parent is None or x.device is None or x.host is not None:
            raise TreeError(f"discard_device of node {node}: not a device-only node")
        if x.lock_ref or x.device_children or x.backup is not None:
            raise TreeError(f"discard_device of node {node}: locked, in flight or not a leaf")
        if _protected_below(x):
            return DeviceEviction(
                freed_parts=(), demoted=(), removed=(), needs_backup=(), freed_host=EMPTY_SLOTS
            )
        freed = x.device
        freed_host: list[np.ndarray] = []
        removed: list[NodeId] = []
        self._set_device(x, None)
        self._remove_subtree(x, freed_host, removed)
        return DeviceEviction(
            freed_parts=(freed,),
            demoted=(),
            removed=tuple(removed),
            needs_backup=(),
            freed_host=concat(freed_host),
        )

    def _ranking(self, now: float) -> Callable[[Node], Any]:
        """The eviction order at `now`: the strategy's key, after the live priority once any
        retention was set (until then every node has the default and the plain key is the
        order). An expired range is reset here, so a strategy that reads `priority` sees the
        live one."""
        if not self._ranked:
            return self.eviction.key
        default, key = self._default_priority, self.eviction.key

        def ranked(x: Node) -> Any:
            if x.retain_until <= now:
                x.priority, x.retain_until = default, INF
            return (x.priority, key(x))

        return ranked

    def _host_candidates(self, now: float) -> list[Node]:
        return [
            x
            for x in self._host_leaves.values()
            if x.lock_ref == 0 and x.host_ref == 0 and x.host_pin_until <= now
        ]

    def _by_pages(self, num_tokens: int, split_to_fit: bool, take_whole: Take) -> Take:
        """The step `evict_in_order` takes per victim: with `split_to_fit`, first cut the victim
        to the pages still wanted (it keeps its id and its last pages; exclusive mode evicts by
        pages, like one LRU of both tiers), then take it whole and count what it gave."""
        page = self.page_size
        left = [num_tokens]  # tokens still wanted

        def evict(x: Node) -> tuple[int, Node | None]:
            want = -(-left[0] // page) * page
            if split_to_fit and x.num_tokens > want > 0:
                self._split(x, x.num_tokens - want)
            units, exposed = take_whole(x)
            left[0] -= units
            return units, exposed

        return evict


def _protected_below(x: Node) -> bool:
    return bool(x.host_ref) or any(_protected_below(c) for c in x.children.values())
