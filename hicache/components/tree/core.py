"""The radix tree: a paged prefix index over device (L1) and host (L2) KV slots.

A synchronous, deterministic core: no I/O, no clock reads (``now`` is passed in), no threads. It owns
the nodes; callers hold ``NodeId``s, which are never reused. It never allocates or frees slots itself:
slots come in with inserts, and every call that lets go of slots returns them for the caller to free.

The rules it keeps are listed in `structure.py` (and docs/tree.md). This module is the API; the
work is done in `structure.py` (nodes, incremental facts), `prefix.py` (match, insert), `refs.py`,
`transfers.py`, `leaf_eviction.py`, `retention.py`, `views.py` and `integrity.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.components.tree import leaf_eviction, refs, retention, transfers, views
from hicache.components.tree.codec import KeyCodec
from hicache.components.tree.integrity import check_tree
from hicache.components.tree.node import INF, NodeState
from hicache.components.tree.observer import Tier, TreeObserver
from hicache.components.tree.prefix import PrefixIndex
from hicache.components.tree.returns import (
    ClearedSlots,
    DeviceEviction,
    HostEviction,
    InsertHostResult,
    InsertResult,
    LoadPlan,
    MatchResult,
    TreeError,
)
from hicache.components.tree.structure import TreeStructure
from hicache.policies.eviction import EvictionStrategy
from hicache.policies.write import WritePolicy
from hicache.types import NodeId, PageHash

__all__ = ["RadixTree", "Tier", "TreeObserver"]


class RadixTree:
    """Paged radix tree with per-node device/host slots, locks, backups and leaf-first eviction.

    Mutating calls: match (access times, splits), insert, insert_host, lock/unlock, protect/release,
    begin/end_backup, commit_load_back, set_page_hashes, evict_device, evict_host. Everything else
    only reads.
    """

    def __init__(
        self,
        *,
        page_size: int,
        eviction: EvictionStrategy,
        write_policy: WritePolicy,
        bigram: bool = False,
        observer: TreeObserver | None = None,
        default_priority: int = 0,
    ) -> None:
        if page_size < 1:
            raise TreeError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.eviction = eviction
        self.write_policy = write_policy
        self._codec = KeyCodec(page_size=page_size, bigram=bigram)
        self._s = TreeStructure(
            codec=self._codec, observer=observer, default_priority=default_priority
        )
        self._prefix = PrefixIndex(self._s)
        self._root = self._s.root
        self._nodes = self._s.nodes  # the same dict, never replaced
        self.root: NodeId = self._root.id

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of an encoded key (``check_key``)."""
        return self._codec.page_bytes

    @property
    def observer(self) -> TreeObserver | None:
        """Told where pages enter or leave a tier (``TreeObserver``); None: nobody."""
        return self._s.observer

    @observer.setter
    def observer(self, observer: TreeObserver | None) -> None:
        self._s.observer = observer

    # ----------------------------------------------------------------------------- match / insert
    def match(
        self, key: Sequence[Any] | np.ndarray, *, now: float, salt: bytes = b""
    ) -> MatchResult:
        """Longest whole-page prefix of ``key`` among the pages cached under ``salt``. Mutates:
        stamps ``now`` as the last access of every matched node and splits the last one if the
        match ends inside it. With nothing matched, ``last_node`` is the tree's root."""
        return self._prefix.match(key, now, salt)

    def insert(
        self,
        key: Sequence[Any] | np.ndarray,
        device_slots: np.ndarray,
        *,
        now: float,
        chunked: bool = False,
        priority: int | None = None,
        salt: bytes = b"",
        backup: bool = False,
    ) -> InsertResult:
        """Add ``key`` (whole pages) with the device slots holding its KV. Mutates.

        Tokens already on the device keep their slots (the passed ones are returned as duplicates);
        host-only nodes on the path take the passed slots (they become BOTH); the rest becomes a new
        DEVICE_ONLY leaf. Matched device nodes and the new leaf count a hit unless ``chunked``; every
        matched node is stamped ``now`` and raised to at least ``priority`` (which only the
        ``priority`` strategy reads; ``retain`` ranks for every strategy). With ``backup``,
        every node of the path without a host copy is a backup candidate, whatever the write
        policy, chunked inserts included."""
        return self._prefix.insert(
            key, device_slots, now, chunked, priority, self.write_policy, salt, backup=backup
        )

    def insert_host(
        self,
        parent: NodeId,
        key_suffix: Sequence[Any] | np.ndarray,
        host_slots: np.ndarray,
        page_hashes: Sequence[PageHash],
        *,
        now: float,
        salt: bytes = b"",
    ) -> InsertHostResult:
        """Hang prefetched pages (host copy only) under ``parent``. Mutates.

        What already exists under ``parent`` is skipped (stamped ``now``; its passed host slots are
        returned as duplicates); the rest becomes one HOST_ONLY leaf with its page hashes.
        """
        return self._prefix.insert_host(
            parent, key_suffix, host_slots, page_hashes, now=now, salt=salt
        )

    # ----------------------------------------------------------------------------- locks
    def lock(self, node: NodeId) -> None:
        """Add one ``lock_ref`` on node..root: no page on that path leaves L1 (or L2). Mutates.
        Locking the root does nothing."""
        refs.lock(self._s, node)

    def unlock(self, node: NodeId) -> None:
        """Drop one ``lock_ref`` on node..root. Raises if the node is not locked. Mutates."""
        refs.unlock(self._s, node)

    def protect_host(self, node: NodeId, *, copy_complete: bool = True) -> None:
        """Add one ``host_ref`` on node..root: none of these nodes leaves the tree (their host copies
        stay) while an L2 transfer uses them. Raises if the node's host copy is still being written,
        unless ``copy_complete`` is False (the caller only keeps the path in the tree: a prefetch
        anchor, whose copy nothing reads; a node without any copy is kept on L1 or backed up
        before it leaves, see ``evict_device``). Mutates. Protecting the root does nothing."""
        refs.protect_host(self._s, node, copy_complete=copy_complete)

    def release_host(self, node: NodeId) -> None:
        """Drop one ``host_ref`` on node..root. Raises if the node is not protected. Mutates."""
        refs.release_host(self._s, node)

    # ----------------------------------------------------------------------------- backup (L1 -> L2)
    def begin_backup(self, node: NodeId, host_slots: np.ndarray) -> None:
        """Give ``node`` the host slots its KV is being copied into, and lock it until end_backup.
        The node counts as BOTH at once, but has no complete host copy (``has_host_copy``) and cannot
        be host-protected until the backup ends. Raises if the node is not on the device, already has a
        host copy, or the length differs. Mutates."""
        transfers.begin_backup(self._s, node, host_slots)

    def backup_pieces(self, node: NodeId) -> tuple[NodeId, ...]:
        """The nodes an in-flight backup of ``node`` now covers, root first: the node itself
        and the upper pieces split off it since begin_backup. Does not mutate."""
        return transfers.backup_pieces(self._s, node)

    def end_backup(self, node: NodeId, *, ok: bool) -> np.ndarray:
        """Finish the backup begun on ``node`` and unlock it. Mutates.

        If the node was split meanwhile, the backup covers all its pieces (the upper pieces sit
        directly above it). On success they keep the host copy; on failure every piece drops it and
        the host slots are returned, root first, for the caller to free (empty on success).
        """
        return transfers.end_backup(self._s, node, ok=ok)

    # ----------------------------------------------------------------------------- load back (L2 -> L1)
    def plan_load_back(self, node: NodeId) -> LoadPlan:
        """The host-only nodes above and including ``node`` that a load must fill. Does not mutate.
        Lock ``node`` before planning and keep it locked until the load is done."""
        return transfers.plan_load_back(self._s, node)

    def commit_load_back(self, plan: LoadPlan, device_slots: np.ndarray) -> None:
        """Give the planned nodes their device slots (in plan order): they become BOTH (exclusive
        mode drops the host copies with ``drop_host`` once the load has landed). Splits since
        planning are fine; raises TreeError, changing nothing, if the plan is stale (a planned node
        is gone or already on the device). Mutates."""
        transfers.commit_load_back(self._s, plan, device_slots)

    def revert_load_back(self, plan: LoadPlan) -> tuple[np.ndarray, tuple[NodeId, ...]]:
        """Undo a committed load that failed: the planned nodes drop their device copies again
        (back to HOST_ONLY), deepest first, stopping at a node that meanwhile got device-resident
        children (its copy must then be recomputed by whoever inserted below it). Returns the
        device slots to free and the nodes left on the device. Mutates."""
        return transfers.revert_load_back(self._s, plan)

    def drop_host(self, plan: LoadPlan) -> np.ndarray:
        """Exclusive mode, after a load landed: the planned nodes give up their host copies
        (they stay on the device). Nodes that are gone or host-protected keep theirs. Returns
        the host slots to free. Mutates."""
        return transfers.drop_host(self._s, plan)

    def drop_host_copies(self) -> np.ndarray:
        """`clear` of L2: every unlocked node on the device gives up its host copy (protected
        or in-flight ones keep theirs). Returns the host slots to free. Mutates."""
        return transfers.drop_unlocked_host_copies(self._s)

    # ----------------------------------------------------------------------------- retention, pins
    def retain(
        self,
        key: Sequence[Any] | np.ndarray,
        ranges: Sequence[retention.Range],
        *,
        now: float,
        salt: bytes = b"",
    ) -> None:
        """Give the cached pages of ``key`` the priorities of ``ranges`` ((start, end, priority,
        until) in tokens and cache time; a page partly inside counts as inside). Mutates: splits
        at the ranges' page boundaries, stamps ``now`` on the path."""
        start = self._s.root_of(salt, create=False)
        if start is not None:
            retention.retain(self._s, self._prefix, start, self._codec.encode(key), ranges, now)

    def mark_pins(
        self,
        key: Sequence[Any] | np.ndarray,
        *,
        device_until: float,
        host_until: float,
        now: float,
        salt: bytes = b"",
    ) -> int:
        """Pin the cached pages of ``key`` (whole pages) in L1 until ``device_until`` and in L2
        until ``host_until``; returns how many of its tokens are cached. Mutates (a split at
        the key's end, stamps)."""
        start = self._s.root_of(salt, create=False)
        if start is None:
            return 0
        arr = self._codec.encode(key)
        return retention.mark_pins(self._s, self._prefix, start, arr, device_until, host_until, now)

    def unmark_pins(
        self, key: Sequence[Any] | np.ndarray, *, now: float, salt: bytes = b""
    ) -> None:
        """Clear every pin mark along ``key``; the caller marks again what other pins cover."""
        start = self._s.root_of(salt, create=False)
        if start is not None:
            retention.unmark_pins(self._s, self._prefix, start, self._codec.encode(key), now)

    def retained_for(self, nodes: Sequence[NodeId], *, now: float) -> float | None:
        """Seconds the nodes' live retention ranges still run (the longest), or None when one
        of them has none or an open-ended one: what an upload of their pages asks storage to
        keep them for. Does not mutate."""
        ends = [self._s.node(n).retain_until for n in nodes]
        if not ends or max(ends) == INF or min(ends) <= now:
            return None
        return max(ends) - now

    # ----------------------------------------------------------------------------- eviction
    def evictable_device_tokens(self) -> int:
        """Device tokens in unlocked nodes (some may first need a backup under write_back)."""
        return self._s.evictable_device

    def evictable_host_tokens(self) -> int:
        """Host-only tokens in unlocked, unprotected nodes."""
        return self._s.evictable_host

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
        and pins are read at ``now`` (``retention.py``). Mutates."""
        policies = (self.eviction, self.write_policy)
        return leaf_eviction.evict_device(
            self._s, num_tokens, *policies, require_host_copy, now, back_up
        )

    def evict_host(self, num_tokens: int, *, now: float, by_pages: bool = False) -> HostEviction:
        """Free at least ``num_tokens`` host slots if possible by removing host-only leaves that are
        neither locked nor host-protected, cheapest first by the strategy; a parent left host-only and
        childless joins the candidates. With ``by_pages`` (exclusive mode) the last leaf taken, when
        longer than what is still wanted, is split and only its last pages are removed. Mutates."""
        return leaf_eviction.evict_host(self._s, num_tokens, self.eviction, by_pages, now)

    def outranks_host(self, node: NodeId, *, now: float) -> bool:
        """Exclusive mode: whether a device leaf about to leave L1 should take an L2 place, i.e. the
        strategy would keep it over L2's next victim (or L2 has no victim). A leaf that loses to all
        of L2 is dropped instead of displacing something hotter. Does not mutate."""
        return leaf_eviction.outranks_host(self._s, node, self.eviction, now)

    def discard_device(self, node: NodeId) -> DeviceEviction:
        """Drop an unlocked device leaf without a host copy (and its host-only descendants)
        from the tree, as a non-backup L1 eviction would. Mutates."""
        return leaf_eviction.discard_device(self._s, node)

    # ----------------------------------------------------------------------------- queries
    def state(self, node: NodeId) -> NodeState:
        """DEVICE_ONLY, BOTH, HOST_ONLY, or GONE for a removed id. Does not mutate."""
        return views.state(self._s, node)

    def num_tokens(self, node: NodeId) -> int:
        """Tokens of the node itself (not its path)."""
        return self._s.node(node).num_tokens

    def device_slots(self, node: NodeId) -> np.ndarray | None:
        return self._s.node(node).device

    def host_slots(self, node: NodeId) -> np.ndarray | None:
        return self._s.node(node).host

    @property
    def salts(self) -> int:
        """Salts with pages in the tree (each has a root of its own until its last page goes)."""
        return len(self._s.salt_roots)

    def is_root(self, node: NodeId) -> bool:
        """The tree's root, or a salt's (the pages cached under a salt hang below its own)."""
        return self._s.node(node).parent is None

    def seed(self, root: NodeId) -> PageHash | None:
        """The page hash a root's first pages chain from: None for the tree's root, the salt's
        seed (`salt_seed`) for a salt's root."""
        return self._s.seed_of(self._s.node(root))

    def parent(self, node: NodeId) -> NodeId | None:
        p = self._s.node(node).parent
        return None if p is None else p.id

    def key(self, node: NodeId) -> np.ndarray:
        """The node's own tokens (read-only)."""
        return self._codec.decode(self._s.node(node).key)

    def lock_ref(self, node: NodeId) -> int:
        return self._s.node(node).lock_ref

    def host_ref(self, node: NodeId) -> int:
        return self._s.node(node).host_ref

    def hit_count(self, node: NodeId) -> int:
        return self._s.node(node).hit_count

    def backup_in_flight(self, node: NodeId) -> bool:
        """True if the node's host copy is still being written (it or a piece split from it)."""
        return self._s.node(node).backup is not None

    def page_hashes(self, node: NodeId) -> tuple[PageHash, ...] | None:
        return self._s.node(node).hashes

    def set_page_hashes(self, node: NodeId, hashes: Sequence[PageHash]) -> None:
        """Record the node's L3 page hashes, one per page. Mutates."""
        self._s.set_hashes(self._s.node(node), tuple(hashes))

    def check_key(self, key: Sequence[Any] | np.ndarray) -> np.ndarray:
        """The key encoded for this tree (a uint32 array of token ids; uint64 pairs for bigram
        keys); TreeError if it is not well-formed. Passing the encoded array of a non-bigram key
        back to `match`/`insert` skips their own conversion. Does not mutate."""
        return self._codec.encode(key)

    def needs_backup(self, node: NodeId) -> bool:
        """True if the node is on the device with no host copy and no backup in flight (a
        write-through candidate that is still worth copying). False for removed ids."""
        return views.needs_backup(self._s, node)

    def has_host_copy(self, node: NodeId) -> bool:
        """True for the root, and for a node whose host copy is complete (no backup in flight)."""
        return views.has_host_copy(self._s, node)

    def cached_tokens(self, tier: str) -> int:
        """Tokens held in "device" or "host" slots by the tree. Does not mutate."""
        return views.cached_tokens(self._s, tier)

    def clear(self) -> ClearedSlots:
        """Remove every node but the root; return all slots the tree held. Refuses (TreeError)
        while any node is locked, protected or being backed up. Mutates."""
        return self._s.clear()

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self._nodes)

    def dump(self) -> list[dict[str, Any]]:
        """One plain dict per node, by id (creation order). Does not mutate."""
        return views.dump(self._s)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see docs/tree.md). Does not mutate."""
        check_tree(self._s)
