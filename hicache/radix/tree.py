"""The radix tree: a paged prefix index over device (L1) and host (L2) KV slots.

A synchronous, deterministic class: no I/O, no clock reads (``now`` is passed in), no threads. It
owns the nodes; callers hold ``NodeId``s, which are never reused. It never allocates or frees
slots itself: slots come in with inserts, and every call that lets go of slots returns them for
the caller to free.

This module holds match and insert, retention and pins, and the copies between tiers (backups,
loads back). `RadixTree` inherits the rest: eviction from `EvictingTree` (eviction.py), and the
nodes, their bookkeeping, locks, queries and the integrity check from `TreeStructure`
(structure.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.policies.eviction import EvictionStrategy
from hicache.policies.write import WritePolicy
from hicache.radix.eviction import EvictingTree
from hicache.radix.keys import KeyCodec, U32Ids
from hicache.radix.results import (
    InsertHostResult,
    InsertResult,
    LoadPlan,
    MatchResult,
    TreeError,
    concat,
    frozen_slots,
)
from hicache.radix.structure import INF, Node, TreeObserver
from hicache.types import EMPTY_SLOTS, NodeId, PageHash

__all__ = ["RadixTree", "Range"]

Range = tuple[int, int, int, float]  # a retention range: start, end (tokens), priority, until


class RadixTree(EvictingTree):
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
        u32_ids: U32Ids | None = None,
    ) -> None:
        """``u32_ids``: a faster conversion of int64 token ids for the key codec (``KeyCodec``)."""
        if page_size < 1:
            raise TreeError(f"page_size must be >= 1, got {page_size}")
        super().__init__(
            eviction=eviction,
            write_policy=write_policy,
            codec=KeyCodec(page_size=page_size, bigram=bigram, u32_ids=u32_ids),
            observer=observer,
            default_priority=default_priority,
        )
        self._stage = bytearray()  # scratch copy of the key being walked, for memcmp against keys

    # ----------------------------------------------------------------------------- match / insert
    def match(
        self, key: Sequence[Any] | np.ndarray, *, now: float, salt: bytes = b""
    ) -> MatchResult:
        """Longest whole-page prefix of ``key`` among the pages cached under ``salt``. Mutates:
        stamps ``now`` as the last access of every matched node and splits the last one if the
        match ends inside it. With nothing matched, ``last_node`` is the tree's root."""
        arr = self._codec.encode(key)
        start = self._root_of(salt, create=False)
        if start is None:  # nothing was ever cached under this salt
            return MatchResult(device_slots=EMPTY_SLOTS, host_len=0, last_node=self.root)
        path, _ = self._descend(start, arr, arr.size - arr.size % self.page_size, now)
        device_parts = []
        host_len = 0
        for x in path:
            if x.device is not None:
                device_parts.append(x.device)
            else:
                host_len += x.num_tokens
        return MatchResult(
            device_slots=concat(device_parts),
            host_len=host_len,
            last_node=path[-1].id if path else self.root,  # never a salt's root
        )

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
        arr = self._codec.encode(key)
        n = arr.size
        ps = self.page_size
        if n % ps:
            raise TreeError(f"insert: key of {n} tokens is not a multiple of page_size={ps}")
        slots = frozen_slots(device_slots, "insert", n)
        # Chunked-prefill inserts neither count hits nor propose backups (as the seed), unless
        # the caller asks for a backup now (threshold 1: every node without a host copy).
        threshold = 1 if backup else None if chunked else self.write_policy.backup_threshold
        hit = 0 if chunked else 1
        start = self._root_of(salt, create=n > 0) or self._root
        path, matched = self._descend(start, arr, n, now)
        prefix_len = 0
        pos = 0
        candidates: list[NodeId] = []
        for x in path:
            if x.device is None:
                # Recomputed KV for a host-only node: adopt the caller's slots (top-down, so the
                # evicted-suffix invariant holds).
                self._set_device(x, slots[pos : pos + x.num_tokens], "insert")
            else:
                prefix_len = pos + x.num_tokens
                x.hit_count += hit
                if (
                    threshold is not None
                    and x.host is None
                    and (backup or x.hit_count >= threshold)
                ):
                    candidates.append(x.id)
            if priority is not None and priority > x.priority:
                x.priority = priority
            pos += x.num_tokens
        node = path[-1] if path else start
        if matched < n:
            leaf_slots = slots[matched:]
            if matched:  # a view would keep the caller's whole array (duplicates included) alive
                leaf_slots = leaf_slots.copy()
                leaf_slots.flags.writeable = False
            leaf = self._new_node(
                node,
                arr[matched:].tobytes(),
                n - matched,
                device=leaf_slots,
                host=None,
                now=now,
                priority=self._default_priority if priority is None else priority,
            )
            leaf.hit_count = hit
            self._attach(leaf)
            if threshold is not None and (backup or leaf.hit_count >= threshold):
                candidates.append(leaf.id)
            node = leaf
        return InsertResult(
            prefix_len=prefix_len,
            duplicate_slots=slots[:prefix_len],
            last_node=node.id,
            backup_candidates=tuple(candidates),
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
        start = self._node(parent, "insert_host parent")
        arr = self._codec.encode(key_suffix)
        n = arr.size
        if start is self._root and salt:  # nothing of the salt was matched: below its root
            start = self._root_of(salt, create=n > 0) or self._root
        ps = self.page_size
        if n % ps:
            raise TreeError(
                f"insert_host: suffix of {n} tokens is not a multiple of page_size={ps}"
            )
        slots = frozen_slots(host_slots, "insert_host", n)
        hashes = tuple(page_hashes)
        if len(hashes) != n // ps:
            raise TreeError(f"insert_host: {len(hashes)} page hashes for {n // ps} pages")
        path, matched = self._descend(start, arr, n, now)
        node = path[-1] if path else start
        if matched < n:
            leaf = self._new_node(
                node,
                arr[matched:].tobytes(),
                n - matched,
                device=None,
                host=slots[matched:],
                now=now,
                priority=self._default_priority,
            )
            leaf.hashes = hashes[matched // ps :]
            self._attach(leaf)
            node = leaf
        return InsertHostResult(
            matched_len=matched,
            duplicate_slots=slots[:matched],
            last_node=self.root if node.parent is None else node.id,
        )

    def _descend(self, start: Node, key: np.ndarray, n: int, now: float) -> tuple[list[Node], int]:
        """Walk from ``start`` along ``key[:n]`` (n whole pages), comparing whole node keys with
        memcmp. Splits the last node if the key ends or differs inside it; stamps ``now`` on every
        node passed. Returns the nodes passed below ``start`` and the tokens they cover. Mutates
        (stamps, split)."""
        path: list[Node] = []
        codec = self._codec
        ps = codec.page_size
        if n == 0:
            return path, 0
        child = start.children.get(key[:ps].tobytes())
        if child is None:
            return path, 0
        isz = codec.itemsize
        end = n * isz
        if len(self._stage) < end:
            self._stage = bytearray(max(end, 2 * len(self._stage)))
        stage = self._stage
        staged = 0  # bytes of the key copied into the stage so far (copied lazily, as compared)
        pos = 0  # bytes matched
        while True:
            ck = child.key
            stop = pos + len(ck)
            if stop > staged and staged < end:
                upto = min(stop, end)
                count = (upto - staged) // isz
                np.frombuffer(stage, dtype=codec.dtype, count=count, offset=staged)[:] = key[
                    staged // isz : upto // isz
                ]
                staged = upto
            if stop <= end and stage.startswith(ck, pos, end):
                pos = stop
                child.last_access = now
                path.append(child)
            else:
                rest = child  # keeps its id and the part past the match
                child = self._split(child, codec.common_tokens(ck, key[:n], pos // isz))
                pos += child.num_tokens * isz
                child.last_access = now
                rest.last_access = now  # as SGLang: a split refreshes the suffix too
                path.append(child)
                break
            if pos >= end:
                break
            t = pos // isz
            nxt = child.children.get(key[t : t + ps].tobytes())
            if nxt is None:
                break
            child = nxt
        return path, pos // isz

    # ----------------------------------------------------------------------------- retention, pins
    # (docs/tree.md, "Retention and pins"). A retention range gives the pages it covers a
    # priority until a time on the cache's clock: eviction in both tiers takes the lowest
    # priority first, then the strategy's order (`EvictingTree._ranking`); past its time a node's
    # priority is the default again. Among explicit ranges the higher priority wins (equal ones
    # keep the later end); a node with no live range takes whatever a range says, so a range may
    # also rank pages below the default. A pin keeps a prefix's nodes in L1 (not evicted) and/or
    # in L2 (not removed; they may still leave L1, backed up first) until a time; pins cover
    # whole prefixes, so every ancestor of a pinned node is pinned too and a leaf-first eviction
    # never has to look past a pinned leaf. Both are marks on nodes, cut at page boundaries and
    # copied by splits; expiry needs no timer: every check compares with ``now``.
    def retain(
        self,
        key: Sequence[Any] | np.ndarray,
        ranges: Sequence[Range],
        *,
        now: float,
        salt: bytes = b"",
    ) -> None:
        """Give the cached pages of ``key`` the priorities of ``ranges`` ((start, end, priority,
        until) in tokens and cache time; a page partly inside counts as inside). Mutates: splits
        at the ranges' page boundaries, stamps ``now`` on the path."""
        start = self._root_of(salt, create=False)
        if start is None:
            return
        arr = self._codec.encode(key)
        ps = self.page_size
        n = arr.size - arr.size % ps
        bounds = [
            (lo // ps * ps, min(-(-hi // ps) * ps, n), p, until) for lo, hi, p, until in ranges
        ]
        cuts = [b for lo, hi, _, _ in bounds for b in (lo, hi)]
        default = self._default_priority
        for x, a, b in self._spans(start, arr, n, cuts, now):
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
                self._ranked = True

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
        start = self._root_of(salt, create=False)
        if start is None:
            return 0
        arr = self._codec.encode(key)
        marked = 0
        for x, _, b in self._spans(start, arr, arr.size, (), now):
            x.device_pin_until = max(x.device_pin_until, device_until)
            x.host_pin_until = max(x.host_pin_until, host_until)
            marked = b
        return marked

    def unmark_pins(
        self, key: Sequence[Any] | np.ndarray, *, now: float, salt: bytes = b""
    ) -> None:
        """Clear every pin mark along ``key``; the caller marks again what other pins cover."""
        start = self._root_of(salt, create=False)
        if start is None:
            return
        arr = self._codec.encode(key)
        path, _ = self._descend(start, arr, arr.size, now)
        for x in path:
            x.device_pin_until = x.host_pin_until = -INF

    def retained_for(self, nodes: Sequence[NodeId], *, now: float) -> float | None:
        """Seconds the nodes' live retention ranges still run (the longest), or None when one
        of them has none or an open-ended one: what an upload of their pages asks storage to
        keep them for. Does not mutate."""
        ends = [self._node(n).retain_until for n in nodes]
        if not ends or max(ends) == INF or min(ends) <= now:
            return None
        return max(ends) - now

    def _spans(
        self, start: Node, key: np.ndarray, n: int, cuts: Sequence[int], now: float
    ) -> list[tuple[Node, int, int]]:
        """The cached nodes along `key[:n]` with the token span each covers, split first so that
        every cut (a page boundary) falls between two nodes."""
        for cut in sorted(set(cuts)):
            if 0 < cut < n:
                self._descend(start, key, cut, now)  # splits the node the cut falls inside
        path, _ = self._descend(start, key, n, now)
        spans, pos = [], 0
        for x in path:
            spans.append((x, pos, pos + x.num_tokens))
            pos += x.num_tokens
        return spans

    # ----------------------------------------------------------------------------- backup (L1 -> L2)
    def begin_backup(self, node: NodeId, host_slots: np.ndarray) -> None:
        """Give ``node`` the host slots its KV is being copied into, and lock it until end_backup.
        The node counts as BOTH at once, but has no complete host copy (``has_host_copy``) and cannot
        be host-protected until the backup ends. Raises if the node is not on the device, already has a
        host copy, or the length differs. Mutates."""
        x = self._node(node)
        if x.parent is None:
            raise TreeError("begin_backup: a root has no KV to back up")
        if x.device is None:
            raise TreeError(f"begin_backup of node {node}: it has no device copy")
        if x.host is not None:
            raise TreeError(f"begin_backup of node {node}: it already has a host copy")
        slots = frozen_slots(host_slots, f"begin_backup of node {node}", x.num_tokens)
        self._untrack(x)
        x.host = slots
        x.backup = x.id
        self._track(x)
        self._backups[x.id] = 1
        self._add_lock(x, 1)

    def backup_pieces(self, node: NodeId) -> tuple[NodeId, ...]:
        """The nodes an in-flight backup of ``node`` now covers, root first: the node itself
        and the upper pieces split off it since begin_backup. Does not mutate."""
        x = self._node(node)
        if x.backup != x.id:
            raise TreeError(f"backup_pieces of node {node}: no backup of it is in flight")
        return tuple(p.id for p in reversed(_pieces(x)))

    def end_backup(self, node: NodeId, *, ok: bool) -> np.ndarray:
        """Finish the backup begun on ``node`` and unlock it. Mutates.

        If the node was split meanwhile, the backup covers all its pieces (the upper pieces sit
        directly above it). On success they keep the host copy; on failure every piece drops it and
        the host slots are returned, root first, for the caller to free (empty on success).
        """
        x = self._node(node)
        if x.backup != x.id:
            raise TreeError(f"end_backup of node {node}: no backup of it is in flight")
        pieces = _pieces(x)
        assert len(pieces) == self._backups.pop(x.id)
        self._add_lock(x, -1)
        freed = []
        for piece in reversed(pieces):
            self._untrack(piece)
            piece.backup = None
            if not ok:
                assert piece.host is not None
                freed.append(piece.host)
                piece.host = None
            self._track(piece)
        obs = self.observer
        if ok and obs is not None:  # the host copies are complete now, root first
            for piece in reversed(pieces):
                obs.node_gained(piece.id, "host", "backup")
        return concat(freed) if not ok else EMPTY_SLOTS

    # ----------------------------------------------------------------------------- load back (L2 -> L1)
    def plan_load_back(self, node: NodeId) -> LoadPlan:
        """The host-only nodes above and including ``node`` that a load must fill. Does not mutate.
        Lock ``node`` before planning and keep it locked until the load is done."""
        x = self._node(node)
        chain = []
        host = []
        while x.device is None:  # a root is on the device (it holds empty slots)
            assert x.host is not None and x.parent is not None
            chain.append(x.id)
            host.append(x.host)
            x = x.parent
        chain.reverse()
        host.reverse()
        slots = concat(host)
        return LoadPlan(nodes=tuple(chain), host_slots=slots, num_tokens=int(slots.size))

    def commit_load_back(self, plan: LoadPlan, device_slots: np.ndarray) -> None:
        """Give the planned nodes their device slots (in plan order): they become BOTH (exclusive
        mode drops the host copies with ``drop_host`` once the load has landed). Splits since
        planning are fine; raises TreeError, changing nothing, if the plan is stale (a planned node
        is gone or already on the device). Mutates."""
        if not plan.nodes:
            frozen_slots(device_slots, "commit_load_back", 0)
            return
        current = self.plan_load_back(plan.nodes[-1])
        if current.num_tokens != plan.num_tokens or not np.array_equal(
            current.host_slots, plan.host_slots
        ):
            raise TreeError(
                f"commit_load_back: stale plan for node {plan.nodes[-1]} "
                f"({plan.num_tokens} host tokens planned, {current.num_tokens} host-only now)"
            )
        slots = frozen_slots(device_slots, "commit_load_back", plan.num_tokens)
        offset = 0
        for i in current.nodes:
            c = self._nodes[i]
            self._set_device(c, slots[offset : offset + c.num_tokens], "load_back")
            offset += c.num_tokens

    def revert_load_back(self, plan: LoadPlan) -> tuple[np.ndarray, tuple[NodeId, ...]]:
        """Undo a committed load that failed: the planned nodes drop their device copies again
        (back to HOST_ONLY), deepest first, stopping at a node that meanwhile got device-resident
        children (its copy must then be recomputed by whoever inserted below it). Returns the
        device slots to free and the nodes left on the device. Mutates."""
        freed: list[np.ndarray] = []
        kept: list[NodeId] = []
        for i in reversed(plan.nodes):
            x = self._nodes.get(i)
            if x is None or x.device is None or x.host is None:
                continue
            if x.device_children:
                kept.append(x.id)
                break
            freed.append(x.device)
            self._set_device(x, None)
        return concat(freed), tuple(kept)

    def drop_host(self, plan: LoadPlan) -> np.ndarray:
        """Exclusive mode, after a load landed: the planned nodes give up their host copies
        (they stay on the device). Nodes that are gone or host-protected keep theirs. Returns
        the host slots to free. Mutates."""
        return self._drop_host_copies([self._nodes.get(i) for i in reversed(plan.nodes)])

    def drop_host_copies(self) -> np.ndarray:
        """`clear` of L2: every unlocked node on the device gives up its host copy (protected
        or in-flight ones keep theirs). Returns the host slots to free. Mutates."""
        return self._drop_host_copies([x for x in self._nodes.values() if x.lock_ref == 0])

    def _drop_host_copies(self, nodes: list[Node | None]) -> np.ndarray:
        """Nodes that are gone, not on the device, or whose host copy is in use keep it."""
        freed: list[np.ndarray] = []
        for x in nodes:
            if x is None or x.host is None or x.device is None or x.host_ref or x.backup:
                continue
            if x.parent is None:
                continue  # a root
            self._untrack(x)
            freed.append(x.host)
            x.host = None
            self._track(x)
            if self.observer is not None:
                self.observer.node_lost(x.id, "host")
        return concat(freed)


def _pieces(x: Node) -> list[Node]:
    """The nodes the backup begun on ``x`` covers, ``x`` first: it and the upper pieces split
    off it since (they sit directly above it)."""
    pieces = []
    y: Node | None = x
    while y is not None and y.backup == x.id:
        pieces.append(y)
        y = y.parent
    return pieces
