"""The radix tree: a paged prefix index over device (L1) and host (L2) KV slots.

A synchronous, deterministic core: no I/O, no clock reads (``now`` is passed in), no threads. It owns
the nodes; callers hold ``NodeId``s, which are never reused. It never allocates or frees slots itself:
slots come in with inserts, and every call that lets go of slots returns them for the caller to free.

Rules (see docs/tree.md):
- Keys are cut to whole pages; children are keyed by their first page; a match or insert that ends
  inside a node splits it at a page boundary. The upper piece gets a new id; the original id keeps the
  lower piece (the suffix), so ids held by callers still name the same last tokens.
- Evicted-suffix invariant: along every root-to-leaf path the nodes without a device copy form a
  suffix. L1 eviction is leaf-first; inserts give device slots top-down.
- ``lock_ref`` and ``host_ref`` count along the whole path node..root; a split piece copies both.
- An optional ``observer`` (``TreeObserver``) is told where a node's pages enter or leave a tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from hicache.components.tree.integrity import check_tree
from hicache.components.tree.keys import KeyCodec
from hicache.components.tree.node import Node, NodeState
from hicache.components.tree.results import (
    ClearedSlots,
    DeviceEviction,
    HostEviction,
    InsertHostResult,
    InsertResult,
    LoadPlan,
    MatchResult,
    TreeError,
)
from hicache.policies.eviction import EvictionStrategy, evict_in_order
from hicache.policies.write import WritePolicy
from hicache.types import EMPTY_SLOTS, NodeId, PageHash

__all__ = ["RadixTree", "TreeObserver"]

Tier = Literal["device", "host"]


class TreeObserver(Protocol):
    """Told where a node's pages enter or leave a tier (``RadixTree.observer``; docs/tree.md).

    Called synchronously inside the mutating call, once per node and tier, with the tree
    consistent and the node still in it: ``key``, ``parent``, ``num_tokens`` and
    ``page_hashes`` read the pages that moved (a later split does not change which pages those
    were). A host copy counts from the end of its backup (``end_backup(ok=True)``), not from
    ``begin_backup``; a failed backup is never reported. A node leaving the tree is reported
    as losing what it still holds, before it goes. ``clear`` reports ``tree_cleared`` alone.
    An observer must not raise and must not change the tree, except ``set_page_hashes`` (a
    cache fill).
    """

    def node_gained(self, node: NodeId, tier: Tier, how: str) -> None:
        """``how``: ``insert`` (a new device leaf, or a host-only node adopting device slots),
        ``load_back``, ``backup`` (the host copy is complete) or ``insert_host`` (prefetched)."""

    def node_lost(self, node: NodeId, tier: Tier) -> None: ...

    def tree_cleared(self) -> None: ...


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return EMPTY_SLOTS
    if len(parts) == 1:
        return parts[0]
    out = np.concatenate(parts)
    out.flags.writeable = False
    return out


def _frozen_slots(slots: np.ndarray, what: str, expected: int) -> np.ndarray:
    """Slots as a read-only int64 array the tree may keep. A read-only int64 array (as the ledgers
    return) is kept as is; anything else is copied, since the caller may change it later."""
    if (
        type(slots) is np.ndarray
        and slots.dtype == np.int64
        and not slots.flags.writeable
        and slots.ndim == 1
        and slots.size == expected
    ):
        return slots
    arr = np.asarray(slots)
    if arr.ndim != 1 or arr.size != expected:
        raise TreeError(f"{what}: expected {expected} slots, got shape {arr.shape}")
    if arr.dtype == np.int64 and not arr.flags.writeable:
        return arr
    if arr.size and arr.dtype.kind not in "iu":
        raise TreeError(f"{what}: slots must be integers, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.int64)
    out.flags.writeable = False
    return out


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
    ) -> None:
        if page_size < 1:
            raise TreeError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.eviction = eviction
        self.write_policy = write_policy
        self._codec = KeyCodec(page_size=page_size, bigram=bigram)
        self.observer = observer  # told where pages enter or leave a tier (TreeObserver)
        self._next_id = 0
        self._nodes: dict[int, Node] = {}  # live nodes by id
        root = self._new_node(
            None, b"", 0, device=EMPTY_SLOTS, host=EMPTY_SLOTS, now=0.0, priority=0
        )
        self._root = root
        self.root: NodeId = NodeId(root.id)
        # Eviction candidates, kept incrementally (id -> node; iteration order is insertion order).
        self._device_leaves: dict[int, Node] = {}  # device-resident, no device-resident child
        self._host_leaves: dict[int, Node] = {}  # host-only, no children
        self._evictable_device = 0  # device tokens of unlocked nodes
        self._evictable_host = 0  # host-only tokens of unlocked, unprotected nodes
        self._backups: dict[int, int] = {}  # in-flight backup id (its node id) -> pieces (>= 1)
        self._stage = (
            bytearray()
        )  # scratch copy of the key being walked, for memcmp against node keys

    # ----------------------------------------------------------------------------- bookkeeping

    def _new_node(self, parent, key, num_tokens, *, device, host, now, priority) -> Node:
        node = Node(
            self._next_id,
            parent,
            key,
            num_tokens,
            device=device,
            host=host,
            now=now,
            priority=priority,
        )
        self._next_id += 1
        self._nodes[node.id] = node
        return node

    def _untrack(self, node: Node) -> None:
        """Take node out of the leaf sets and counters before its state changes."""
        if node is self._root:
            return
        self._device_leaves.pop(node.id, None)
        self._host_leaves.pop(node.id, None)
        if node.lock_ref == 0:
            if node.device is not None:
                self._evictable_device -= node.num_tokens
            elif node.host_ref == 0:
                self._evictable_host -= node.num_tokens

    def _track(self, node: Node) -> None:
        """Put node back into the leaf sets and counters after its state changed."""
        if node is self._root:
            return
        if node.device is not None:
            if node.device_children == 0:
                self._device_leaves[node.id] = node
        elif not node.children:
            self._host_leaves[node.id] = node
        if node.lock_ref == 0:
            if node.device is not None:
                self._evictable_device += node.num_tokens
            elif node.host_ref == 0:
                self._evictable_host += node.num_tokens

    def _set_device(self, node: Node, slots: np.ndarray | None, how: str = "") -> None:
        parent = node.parent
        self._untrack(node)
        self._untrack(parent)
        was = node.device is not None
        node.device = slots
        parent.device_children += (slots is not None) - was
        self._track(node)
        self._track(parent)
        obs = self.observer
        if obs is not None and was != (slots is not None):
            if slots is None:
                obs.node_lost(NodeId(node.id), "device")
            else:
                obs.node_gained(NodeId(node.id), "device", how)

    def _attach(self, node: Node) -> None:
        parent = node.parent
        self._untrack(parent)
        parent.children[node.key[: self._codec.page_bytes]] = node
        if node.device is not None:
            parent.device_children += 1
        self._track(node)
        self._track(parent)
        obs = self.observer
        if obs is not None:  # a new leaf: device-only from insert, host-only from insert_host
            if node.device is not None:
                obs.node_gained(NodeId(node.id), "device", "insert")
            else:
                obs.node_gained(NodeId(node.id), "host", "insert_host")

    def _remove(self, node: Node) -> None:
        """Detach a childless node and retire its id. Its slots are the caller's to return."""
        obs = self.observer
        if obs is not None:  # told while the node can still be read
            if node.device is not None:
                obs.node_lost(NodeId(node.id), "device")
            if node.host is not None and node.backup is None:
                obs.node_lost(NodeId(node.id), "host")
        parent = node.parent
        self._untrack(node)
        self._untrack(parent)
        del parent.children[node.key[: self._codec.page_bytes]]
        if node.device is not None:
            parent.device_children -= 1
        del self._nodes[node.id]
        node.parent = None
        self._track(parent)

    def _split(self, node: Node, num_tokens: int) -> Node:
        """Cut ``node`` after ``num_tokens`` (whole pages, 0 < n < len). The upper piece is a new node
        that copies every count and stamp; ``node`` keeps its id and the lower piece."""
        cut = num_tokens * self._codec.itemsize
        parent = node.parent
        upper = self._new_node(
            parent,
            node.key[:cut],
            num_tokens,
            device=None if node.device is None else node.device[:num_tokens],
            host=None if node.host is None else node.host[:num_tokens],
            now=node.created,
            priority=node.priority,
        )
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.lock_ref = node.lock_ref
        upper.host_ref = node.host_ref
        upper.backup = node.backup
        if node.hashes is not None:
            pages = num_tokens // self.page_size
            upper.hashes, node.hashes = node.hashes[:pages], node.hashes[pages:]
        self._untrack(node)
        node.key = node.key[cut:]
        node.num_tokens -= num_tokens
        if node.device is not None:
            node.device = node.device[num_tokens:]
        if node.host is not None:
            node.host = node.host[num_tokens:]
        parent.children[upper.key[: self._codec.page_bytes]] = upper  # same first page as before
        upper.children[node.key[: self._codec.page_bytes]] = node
        upper.device_children = int(node.device is not None)
        node.parent = upper
        if node.backup is not None:
            self._backups[node.backup] += 1
        self._track(node)
        self._track(upper)
        return upper

    def _node(self, node_id: NodeId, what: str = "node") -> Node:
        node = self._nodes.get(node_id)
        if node is None:
            if isinstance(node_id, (int, np.integer)) and 0 <= node_id < self._next_id:
                raise TreeError(f"{what} {node_id} was removed from the tree")
            raise TreeError(f"{what} {node_id!r} is not a node of this tree")
        return node

    # ----------------------------------------------------------------------------- match / insert

    def _descend(self, start: Node, key: np.ndarray, n: int, now: float) -> tuple[list[Node], int]:
        """Walk from ``start`` along ``key[:n]`` (n whole pages), comparing whole node keys with memcmp.
        Splits the last node if the key ends or differs inside it; stamps ``now`` on every node passed.
        Returns the nodes passed below ``start`` and the tokens they cover. Mutates (stamps, split)."""
        path: list[Node] = []
        ps = self.page_size
        if n == 0:
            return path, 0
        child = start.children.get(key[:ps].tobytes())
        if child is None:
            return path, 0
        codec = self._codec
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
            child = child.children.get(key[t : t + ps].tobytes())
            if child is None:
                break
        return path, pos // isz

    def match(self, key: Sequence | np.ndarray, *, now: float) -> MatchResult:
        """Longest whole-page prefix of ``key`` in the tree. Mutates: stamps ``now`` as the last access
        of every matched node and splits the last one if the match ends inside it."""
        arr = self._codec.encode(key)
        path, _ = self._descend(self._root, arr, arr.size - arr.size % self.page_size, now)
        device_parts = []
        host_len = 0
        for x in path:
            if x.device is not None:
                device_parts.append(x.device)
            else:
                host_len += x.num_tokens
        return MatchResult(
            device_slots=_concat(device_parts),
            host_len=host_len,
            last_node=NodeId(path[-1].id if path else self._root.id),
        )

    def insert(
        self,
        key: Sequence | np.ndarray,
        device_slots: np.ndarray,
        *,
        now: float,
        chunked: bool = False,
        priority: int = 0,
    ) -> InsertResult:
        """Add ``key`` (whole pages) with the device slots holding its KV. Mutates.

        Tokens already on the device keep their slots (the passed ones are returned as duplicates);
        host-only nodes on the path take the passed slots (they become BOTH); the rest becomes a new
        DEVICE_ONLY leaf. Matched device nodes and the new leaf count a hit unless ``chunked``; every
        matched node is stamped ``now`` and raised to at least ``priority``.
        """
        arr = self._codec.encode(key)
        n = arr.size
        if n % self.page_size:
            raise TreeError(
                f"insert: key of {n} tokens is not a multiple of page_size={self.page_size}"
            )
        slots = _frozen_slots(device_slots, "insert", n)
        # Chunked-prefill inserts neither count hits nor propose backups (as the seed).
        threshold = None if chunked else self.write_policy.backup_threshold
        hit = 0 if chunked else 1
        path, matched = self._descend(self._root, arr, n, now)
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
                if threshold is not None and x.host is None and x.hit_count >= threshold:
                    candidates.append(x.id)
            if priority > x.priority:
                x.priority = priority
            pos += x.num_tokens
        node = path[-1] if path else self._root
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
                priority=priority,
            )
            leaf.hit_count = hit
            self._attach(leaf)
            if threshold is not None and leaf.hit_count >= threshold:
                candidates.append(leaf.id)
            node = leaf
        return InsertResult(
            prefix_len=prefix_len,
            duplicate_slots=slots[:prefix_len],
            last_node=NodeId(node.id),
            backup_candidates=tuple(candidates),  # NodeId is int at run time
        )

    def insert_host(
        self,
        parent: NodeId,
        key_suffix: Sequence | np.ndarray,
        host_slots: np.ndarray,
        page_hashes: Sequence[PageHash],
        *,
        now: float,
    ) -> InsertHostResult:
        """Hang prefetched pages (host copy only) under ``parent``. Mutates.

        What already exists under ``parent`` is skipped (stamped ``now``; its passed host slots are
        returned as duplicates); the rest becomes one HOST_ONLY leaf with its page hashes.
        """
        start = self._node(parent, "insert_host parent")
        arr = self._codec.encode(key_suffix)
        n = arr.size
        ps = self.page_size
        if n % ps:
            raise TreeError(
                f"insert_host: suffix of {n} tokens is not a multiple of page_size={ps}"
            )
        slots = _frozen_slots(host_slots, "insert_host", n)
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
                priority=node.priority,
            )
            leaf.hashes = hashes[matched // ps :]
            self._attach(leaf)
            node = leaf
        return InsertHostResult(
            matched_len=matched, duplicate_slots=slots[:matched], last_node=NodeId(node.id)
        )

    # ----------------------------------------------------------------------------- locks

    def lock(self, node: NodeId) -> None:
        """Add one ``lock_ref`` on node..root: no page on that path leaves L1 (or L2). Mutates.
        Locking the root does nothing."""
        self._add_ref(self._node(node), "lock_ref", 1)

    def unlock(self, node: NodeId) -> None:
        """Drop one ``lock_ref`` on node..root. Raises if the node is not locked. Mutates."""
        x = self._node(node)
        if x is not self._root and x.lock_ref <= 0:
            raise TreeError(f"unlock of node {node}: it is not locked (lock_ref would go below 0)")
        self._add_ref(x, "lock_ref", -1)

    def protect_host(self, node: NodeId) -> None:
        """Add one ``host_ref`` on node..root: none of these nodes leaves the tree (their host copies
        stay) while an L2 transfer uses them. Raises if the node's host copy is still being written.
        Mutates. Protecting the root does nothing."""
        x = self._node(node)
        if x.backup is not None:
            raise TreeError(f"protect_host of node {node}: its host copy is still being written")
        self._add_ref(x, "host_ref", 1)

    def release_host(self, node: NodeId) -> None:
        """Drop one ``host_ref`` on node..root. Raises if the node is not protected. Mutates."""
        x = self._node(node)
        if x is not self._root and x.host_ref <= 0:
            raise TreeError(
                f"release_host of node {node}: it is not protected (host_ref would go below 0)"
            )
        self._add_ref(x, "host_ref", -1)

    def _add_ref(self, x: Node, field: str, delta: int) -> None:
        root = self._root
        while x is not root:
            self._untrack(x)
            setattr(x, field, getattr(x, field) + delta)
            self._track(x)
            x = x.parent

    # ----------------------------------------------------------------------------- backup (L1 -> L2)

    def begin_backup(self, node: NodeId, host_slots: np.ndarray) -> None:
        """Give ``node`` the host slots its KV is being copied into, and lock it until end_backup.
        The node counts as BOTH at once, but has no complete host copy (``has_host_copy``) and cannot
        be host-protected until the backup ends. Raises if the node is not on the device, already has a
        host copy, or the length differs. Mutates."""
        x = self._node(node)
        if x is self._root:
            raise TreeError("begin_backup: the root has no KV to back up")
        if x.device is None:
            raise TreeError(f"begin_backup of node {node}: it has no device copy")
        if x.host is not None:
            raise TreeError(f"begin_backup of node {node}: it already has a host copy")
        slots = _frozen_slots(host_slots, f"begin_backup of node {node}", x.num_tokens)
        self._untrack(x)
        x.host = slots
        x.backup = x.id
        self._track(x)
        self._backups[x.id] = 1
        self._add_ref(x, "lock_ref", 1)

    def backup_pieces(self, node: NodeId) -> tuple[NodeId, ...]:
        """The nodes an in-flight backup of ``node`` now covers, root first: the node itself
        and the upper pieces split off it since begin_backup. Does not mutate."""
        x = self._node(node)
        if x.backup != x.id:
            raise TreeError(f"backup_pieces of node {node}: no backup of it is in flight")
        pieces = []
        y = x
        while y.backup == x.id:
            pieces.append(NodeId(y.id))
            y = y.parent
        return tuple(reversed(pieces))

    def end_backup(self, node: NodeId, *, ok: bool) -> np.ndarray:
        """Finish the backup begun on ``node`` and unlock it. Mutates.

        If the node was split meanwhile, the backup covers all its pieces (the upper pieces sit
        directly above it). On success they keep the host copy; on failure every piece drops it and
        the host slots are returned, root first, for the caller to free (empty on success).
        """
        x = self._node(node)
        if x.backup != x.id:
            raise TreeError(f"end_backup of node {node}: no backup of it is in flight")
        pieces = []
        y = x
        while y.backup == x.id:
            pieces.append(y)
            y = y.parent
        assert len(pieces) == self._backups.pop(x.id)
        self._add_ref(x, "lock_ref", -1)
        freed = []
        for piece in reversed(pieces):
            self._untrack(piece)
            piece.backup = None
            if not ok:
                freed.append(piece.host)
                piece.host = None
            self._track(piece)
        obs = self.observer
        if ok and obs is not None:  # the host copies are complete now, root first
            for piece in reversed(pieces):
                obs.node_gained(NodeId(piece.id), "host", "backup")
        return _concat(freed) if not ok else EMPTY_SLOTS

    # ----------------------------------------------------------------------------- load back (L2 -> L1)

    def plan_load_back(self, node: NodeId) -> LoadPlan:
        """The host-only nodes above and including ``node`` that a load must fill. Does not mutate.
        Lock ``node`` before planning and keep it locked until the load is done."""
        x = self._node(node)
        chain = []
        while x.device is None:
            chain.append(x)
            x = x.parent
        chain.reverse()
        host = _concat([c.host for c in chain])
        return LoadPlan(
            nodes=tuple(NodeId(c.id) for c in chain), host_slots=host, num_tokens=int(host.size)
        )

    def commit_load_back(self, plan: LoadPlan, device_slots: np.ndarray) -> None:
        """Give the planned nodes their device slots (in plan order): they become BOTH (exclusive
        mode drops the host copies with ``drop_host`` once the load has landed). Splits since
        planning are fine; raises TreeError, changing nothing, if the plan is stale (a planned node
        is gone or already on the device). Mutates."""
        if not plan.nodes:
            _frozen_slots(device_slots, "commit_load_back", 0)
            return
        current = self.plan_load_back(plan.nodes[-1])
        if current.num_tokens != plan.num_tokens or not np.array_equal(
            current.host_slots, plan.host_slots
        ):
            raise TreeError(
                f"commit_load_back: stale plan for node {plan.nodes[-1]} "
                f"({plan.num_tokens} host tokens planned, {current.num_tokens} host-only now)"
            )
        slots = _frozen_slots(device_slots, "commit_load_back", plan.num_tokens)
        offset = 0
        for i in current.nodes:
            c = self._nodes[i]
            self._set_device(c, slots[offset : offset + c.num_tokens], "load_back")
            offset += c.num_tokens

    # ----------------------------------------------------------------------------- eviction

    def evictable_device_tokens(self) -> int:
        """Device tokens in unlocked nodes (some may first need a backup under write_back)."""
        return self._evictable_device

    def evictable_host_tokens(self) -> int:
        """Host-only tokens in unlocked, unprotected nodes."""
        return self._evictable_host

    def evict_device(
        self, num_tokens: int, *, now: float, require_host_copy: bool = False
    ) -> DeviceEviction:
        """Free at least ``num_tokens`` device slots if unlocked leaves allow, cheapest first by the
        strategy, leaf-first. A leaf with a host copy is demoted to HOST_ONLY; one without is removed
        with its host-only descendants, unless the write policy (write_back) or ``require_host_copy``
        (exclusive mode) wants a host copy first: then it is reported in ``needs_backup`` and kept.
        Never touches locked nodes, or removes a host-protected one. With ``require_host_copy``
        the last leaf taken, when longer than what is still wanted, is split and only its last
        pages (the wanted tokens, rounded up to a page) are evicted: in exclusive mode a leaf
        moves into L2 whole, and moving more than wanted evicts as much more from L2. ``now`` is
        unused today (kept for time-aware strategies). Mutates."""
        if num_tokens < 0:
            raise TreeError(f"evict_device: num_tokens must be >= 0, got {num_tokens}")
        keep_unbacked = require_host_copy or self.write_policy.backup_on_evict
        freed: list[np.ndarray] = []
        freed_host: list[np.ndarray] = []
        demoted: list[int] = []
        removed: list[int] = []
        needs_backup: list[int] = []
        root = self._root
        page = self.page_size
        left = [num_tokens]  # tokens still wanted

        def evict(x: Node) -> tuple[int, Node | None]:
            want = -(-left[0] // page) * page
            if require_host_copy and x.num_tokens > want > 0:
                self._split(x, x.num_tokens - want)  # x keeps its id and the last `want` tokens
            units, exposed = evict_whole(x)
            left[0] -= units
            return units, exposed

        def evict_whole(x: Node) -> tuple[int, Node | None]:
            parent = x.parent
            if x.host is not None:
                freed.append(x.device)
                self._set_device(x, None)
                demoted.append(x.id)
            elif keep_unbacked:
                # Counts toward the target: it goes once its backup lands. Counting it as 0
                # would report every leaf of L1 and back up all of it.
                needs_backup.append(x.id)
                return x.num_tokens, None
            elif x.host_ref:
                return 0, None
            else:
                freed.append(x.device)
                self._set_device(x, None)
                self._remove_subtree(x, freed_host, removed)
            exposed = (
                parent
                if parent is not root and parent.device_children == 0 and parent.lock_ref == 0
                else None
            )
            return x.num_tokens, exposed

        candidates = [x for x in self._device_leaves.values() if x.lock_ref == 0]
        key = self.eviction.key
        evict_in_order(candidates, key=key, ident=lambda x: x.id, evict=evict, target=num_tokens)
        return DeviceEviction(
            freed=_concat(freed),
            demoted=tuple(NodeId(i) for i in demoted),
            removed=tuple(NodeId(i) for i in removed),
            needs_backup=tuple(NodeId(i) for i in needs_backup),
            freed_host=_concat(freed_host),
        )

    def _remove_subtree(self, x: Node, freed_host: list[np.ndarray], removed: list[int]) -> None:
        """Remove x (now without device copy) and its host-only descendants, deepest first."""
        for child in list(x.children.values()):
            self._remove_subtree(child, freed_host, removed)
        if x.host is not None:
            freed_host.append(x.host)
        removed.append(x.id)
        self._remove(x)

    def evict_host(self, num_tokens: int, *, by_pages: bool = False) -> HostEviction:
        """Free at least ``num_tokens`` host slots if possible by removing host-only leaves that are
        neither locked nor host-protected, cheapest first by the strategy; a parent left host-only and
        childless joins the candidates. With ``by_pages`` (exclusive mode) the last leaf taken, when
        longer than what is still wanted, is split and only its last pages are removed. Mutates."""
        if num_tokens < 0:
            raise TreeError(f"evict_host: num_tokens must be >= 0, got {num_tokens}")
        freed: list[np.ndarray] = []
        removed: list[int] = []
        root = self._root
        page = self.page_size
        left = [num_tokens]  # tokens still wanted

        def evict(x: Node) -> tuple[int, Node | None]:
            want = -(-left[0] // page) * page
            if by_pages and x.num_tokens > want > 0:
                self._split(x, x.num_tokens - want)  # x keeps its id and the last `want` tokens
            units, exposed = evict_whole(x)
            left[0] -= units
            return units, exposed

        def evict_whole(x: Node) -> tuple[int, Node | None]:
            parent = x.parent
            freed.append(x.host)
            removed.append(x.id)
            self._remove(x)
            exposed = None
            if (
                parent is not root
                and parent.device is None
                and not parent.children
                and parent.lock_ref == 0
                and parent.host_ref == 0
            ):
                exposed = parent
            return x.num_tokens, exposed

        candidates = [x for x in self._host_leaves.values() if x.lock_ref == 0 and x.host_ref == 0]
        evict_in_order(
            candidates, key=self.eviction.key, ident=lambda x: x.id, evict=evict, target=num_tokens
        )
        return HostEviction(freed=_concat(freed), removed=tuple(NodeId(i) for i in removed))

    # ----------------------------------------------------------------------------- queries

    def state(self, node: NodeId) -> NodeState:
        """DEVICE_ONLY, BOTH, HOST_ONLY, or GONE for a removed id. Does not mutate."""
        x = self._nodes.get(node)
        if x is None:
            if isinstance(node, (int, np.integer)) and 0 <= node < self._next_id:
                return NodeState.GONE
            raise TreeError(f"node {node!r} is not a node of this tree")
        if x.device is None:
            return NodeState.HOST_ONLY
        return NodeState.DEVICE_ONLY if x.host is None else NodeState.BOTH

    def num_tokens(self, node: NodeId) -> int:
        """Tokens of the node itself (not its path)."""
        return self._node(node).num_tokens

    def device_slots(self, node: NodeId) -> np.ndarray | None:
        return self._node(node).device

    def host_slots(self, node: NodeId) -> np.ndarray | None:
        return self._node(node).host

    def parent(self, node: NodeId) -> NodeId | None:
        p = self._node(node).parent
        return None if p is None else NodeId(p.id)

    def key(self, node: NodeId) -> np.ndarray:
        """The node's own tokens (read-only)."""
        return self._codec.decode(self._node(node).key)

    def lock_ref(self, node: NodeId) -> int:
        return self._node(node).lock_ref

    def host_ref(self, node: NodeId) -> int:
        return self._node(node).host_ref

    def hit_count(self, node: NodeId) -> int:
        return self._node(node).hit_count

    def backup_in_flight(self, node: NodeId) -> bool:
        """True if the node's host copy is still being written (it or a piece split from it)."""
        return self._node(node).backup is not None

    def page_hashes(self, node: NodeId) -> tuple[PageHash, ...] | None:
        return self._node(node).hashes

    def set_page_hashes(self, node: NodeId, hashes: Sequence[PageHash]) -> None:
        """Record the node's L3 page hashes, one per page. Mutates."""
        x = self._node(node)
        hashes = tuple(hashes)
        if len(hashes) != x.num_tokens // self.page_size:
            raise TreeError(
                f"set_page_hashes of node {node}: {len(hashes)} hashes for {x.num_tokens // self.page_size} pages"
            )
        x.hashes = hashes

    def check_key(self, key: Sequence | np.ndarray) -> np.ndarray:
        """The key encoded for this tree (a uint32 array of token ids; uint64 pairs for bigram
        keys); TreeError if it is not well-formed. Passing the encoded array of a non-bigram key
        back to `match`/`insert` skips their own conversion. Does not mutate."""
        return self._codec.encode(key)

    def needs_backup(self, node: NodeId) -> bool:
        """True if the node is on the device with no host copy and no backup in flight (a
        write-through candidate that is still worth copying). False for removed ids."""
        x = self._nodes.get(node)
        return x is not None and x is not self._root and x.device is not None and x.host is None

    def has_host_copy(self, node: NodeId) -> bool:
        """True for the root, and for a node whose host copy is complete (no backup in flight)."""
        x = self._node(node)
        return x is self._root or (x.host is not None and x.backup is None)

    def outranks_host(self, node: NodeId) -> bool:
        """Exclusive mode: whether a device leaf about to leave L1 should take an L2 place,
        i.e. the strategy would keep it over L2's next victim (or L2 has no victim). A leaf
        that loses to all of L2 is dropped instead of displacing something hotter. Does not
        mutate."""
        key = self.eviction.key
        mine = key(self._node(node))
        victims = [
            key(x) for x in self._host_leaves.values() if x.lock_ref == 0 and x.host_ref == 0
        ]
        return not victims or mine >= min(victims)

    def discard_device(self, node: NodeId) -> DeviceEviction:
        """Drop an unlocked device leaf without a host copy (and its host-only descendants)
        from the tree, as a non-backup L1 eviction would. Mutates."""
        x = self._node(node)
        if x is self._root or x.device is None or x.host is not None:
            raise TreeError(f"discard_device of node {node}: not a device-only node")
        if x.lock_ref or x.device_children or x.backup is not None:
            raise TreeError(f"discard_device of node {node}: locked, in flight or not a leaf")
        if self._protected_below(x):
            return DeviceEviction(
                freed=EMPTY_SLOTS, demoted=(), removed=(), needs_backup=(), freed_host=EMPTY_SLOTS
            )
        freed = x.device
        freed_host: list[np.ndarray] = []
        removed: list[int] = []
        self._set_device(x, None)
        self._remove_subtree(x, freed_host, removed)
        return DeviceEviction(
            freed=freed,
            demoted=(),
            removed=tuple(NodeId(i) for i in removed),
            needs_backup=(),
            freed_host=_concat(freed_host),
        )

    def _protected_below(self, x: Node) -> bool:
        return bool(x.host_ref) or any(self._protected_below(c) for c in x.children.values())

    def cached_tokens(self, tier: str) -> int:
        """Tokens held in "device" or "host" slots by the tree. Does not mutate."""
        if tier not in ("device", "host"):
            raise TreeError(f"cached_tokens: tier must be 'device' or 'host', got {tier!r}")
        field = "device" if tier == "device" else "host"
        return sum(
            getattr(x, field).size for x in self._nodes.values() if getattr(x, field) is not None
        )

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
                kept.append(NodeId(x.id))
                break
            freed.append(x.device)
            self._set_device(x, None)
        return _concat(freed), tuple(kept)

    def drop_host(self, plan: LoadPlan) -> np.ndarray:
        """Exclusive mode, after a load landed: the planned nodes give up their host copies
        (they stay on the device). Nodes that are gone or host-protected keep theirs. Returns
        the host slots to free. Mutates."""
        freed: list[np.ndarray] = []
        for i in reversed(plan.nodes):
            x = self._nodes.get(i)
            if x is None or x.host is None or x.device is None or x.host_ref or x.backup:
                continue
            self._untrack(x)
            freed.append(x.host)
            x.host = None
            self._track(x)
            if self.observer is not None:
                self.observer.node_lost(NodeId(x.id), "host")
        return _concat(freed)

    def clear(self) -> ClearedSlots:
        """Remove every node but the root; return all slots the tree held. Refuses (TreeError)
        while any node is locked, protected or being backed up. Mutates."""
        busy = [
            x.id
            for x in self._nodes.values()
            if x is not self._root and (x.lock_ref or x.host_ref or x.backup is not None)
        ]
        if busy:
            raise TreeError(f"clear: nodes {busy[:8]} are locked, protected or in flight")
        device = [x.device for x in self._nodes.values() if x.device is not None]
        host = [x.host for x in self._nodes.values() if x.host is not None]
        obs, self.observer = self.observer, None  # one tree_cleared, not one call per node
        try:
            for child in list(self._root.children.values()):
                self._remove_subtree_all(child)
        finally:
            self.observer = obs
        if obs is not None:
            obs.tree_cleared()
        return ClearedSlots(device=_concat(device), host=_concat(host))

    def _remove_subtree_all(self, x: Node) -> None:
        for child in list(x.children.values()):
            self._remove_subtree_all(child)
        if x.device is not None:
            self._set_device(x, None)
        self._remove(x)

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self._nodes)

    def dump(self) -> list[dict]:
        """One plain dict per node, by id (creation order). Does not mutate."""
        out = []
        for i in sorted(self._nodes):
            x = self._nodes[i]
            out.append(
                {
                    "id": x.id,
                    "parent": None if x.parent is None else x.parent.id,
                    "tokens": x.num_tokens,
                    "state": "root" if x is self._root else self.state(NodeId(x.id)).value,
                    "lock_ref": x.lock_ref,
                    "host_ref": x.host_ref,
                    "hit_count": x.hit_count,
                    "last_access": x.last_access,
                    "created": x.created,
                    "priority": x.priority,
                    "backup_in_flight": x.backup is not None,
                    "hashes": x.hashes is not None,
                }
            )
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see docs/tree.md). Does not mutate."""
        check_tree(self)
