"""The radix tree's nodes and the facts it keeps about them.

`Node` is one edge of the tree: a run of whole pages and where their KV lives. `TreeStructure`
owns the nodes of one tree. Every change to a node's place (new, attached, split, removed), to
its device copy or to its ref counts goes through its methods, which keep the eviction
candidates (device and host leaves), the evictable token counts and the in-flight backup pieces
up to date and tell the observer where pages entered or left a tier; `check_integrity`
recomputes all of it from scratch. It also answers the per-node queries. `RadixTree` (tree.py)
is this structure with eviction (eviction.py), match and insert, retention and the copies
between tiers.

Rules (docs/tree.md):
- Keys are cut to whole pages; children are keyed by their first page; a match or insert that
  ends inside a node splits it at a page boundary. The upper piece gets a new id; the original id
  keeps the lower piece (the suffix), so ids held by callers still name the same last tokens.
- Evicted-suffix invariant: along every root-to-leaf path the nodes without a device copy form a
  suffix. L1 eviction is leaf-first; inserts give device slots top-down.
- ``lock_ref`` and ``host_ref`` count along the whole path node..root; a split piece copies both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from hicache.radix.hashes import salt_seed
from hicache.radix.keys import KeyCodec
from hicache.radix.results import ClearedSlots, NodeState, TreeError, concat
from hicache.types import EMPTY_SLOTS, NodeId, PageHash

__all__ = ["INF", "Node", "Tier", "TreeObserver", "TreeStructure"]

INF = float("inf")

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


class Node:
    """One edge of the radix tree: a run of whole pages and where their KV lives.

    Owned and mutated only by the tree that created it; other components hold NodeIds.
    Invariants (``check_integrity``): ``key`` holds ``num_tokens`` tokens (a multiple of
    page_size, > 0 except for a root); ``device`` and ``host`` are None or read-only int64 arrays
    of ``num_tokens`` slots; a non-root node has at least one of them; ``hashes`` is None or one
    page hash per page.
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "num_tokens",
        "device",
        "host",
        "hashes",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "retain_until",
        "device_pin_until",
        "host_pin_until",
        "backup",
        "device_children",
    )

    def __init__(
        self,
        node_id: NodeId,
        parent: Node | None,
        key: bytes,
        num_tokens: int,
        *,
        device: np.ndarray | None,
        host: np.ndarray | None,
        now: float,
        priority: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # first page of the child's key -> child
        self.key = key  # the tokens' bytes (uint32 each, or two uint32 for bigram keys)
        self.num_tokens = num_tokens
        self.device = device  # L1 slots, or None when not on the device
        # L2 slots, or None when no host copy (or, with backup set, one being written)
        self.host = host
        self.hashes: tuple[PageHash, ...] | None = None  # L3 page hashes, one per page, when known
        self.lock_ref = 0  # running requests / in-flight device reads on this node or below
        self.host_ref = 0  # in-flight host transfers protecting this node or below
        self.hit_count = 0
        self.last_access = now
        self.created = now
        # Retention (docs/tree.md, "Retention and pins"): eviction takes the lowest priority
        # first; past `retain_until` (cache clock) the node's priority is the default again.
        self.priority = priority
        self.retain_until = INF
        # Pins (cache clock): until then the node is not evicted from L1 / not removed from L2.
        self.device_pin_until = -INF
        self.host_pin_until = -INF
        self.backup: int | None = None  # id of the in-flight backup whose host copy this node holds
        self.device_children = 0  # children with a device copy (a node with none is an L1 leaf)


class TreeStructure:
    """The nodes of one tree (by id, from the root) and the facts derived from them, kept
    incrementally: which nodes are eviction candidates, how many tokens are evictable, how many
    pieces each in-flight backup covers. ``check_integrity`` recomputes all of it from scratch."""

    def __init__(
        self, *, codec: KeyCodec, observer: TreeObserver | None, default_priority: int
    ) -> None:
        self.page_size = codec.page_size
        self.observer = observer  # told where pages enter or leave a tier; None: nobody
        self._codec = codec
        self._default_priority = default_priority  # a node's priority outside any live range
        self._ranked = False  # some node was given a priority: eviction ranks by it first
        self._next_id = 0
        self._nodes: dict[int, Node] = {}  # live nodes by id
        self._root = self._new_node(
            None, b"", 0, device=EMPTY_SLOTS, host=EMPTY_SLOTS, now=0.0, priority=default_priority
        )
        self.root: NodeId = self._root.id
        # One more root per salt in use (docs/tree.md, "Salts"): a salt's pages hang below its
        # own root, so no other salt's walk can reach them. Created by the first insert under
        # the salt, removed with its last child; nobody outside the tree holds its id.
        self._salt_roots: dict[bytes, Node] = {}
        self._root_salts: dict[int, tuple[bytes, PageHash]] = {}  # salt root id -> salt, seed
        # Eviction candidates (id -> node; iteration order is insertion order).
        self._device_leaves: dict[int, Node] = {}  # device-resident, no device-resident child
        self._host_leaves: dict[int, Node] = {}  # host-only, no children
        self._evictable_device = 0  # device tokens of unlocked nodes
        self._evictable_host = 0  # host-only tokens of unlocked, unprotected nodes
        self._backups: dict[int, int] = {}  # in-flight backup id (its node id) -> pieces (>= 1)

    # ----------------------------------------------------------------------------- nodes and roots
    def _new_node(
        self,
        parent: Node | None,
        key: bytes,
        num_tokens: int,
        *,
        device: np.ndarray | None,
        host: np.ndarray | None,
        now: float,
        priority: int,
    ) -> Node:
        """A registered node, not yet attached to its parent (``_attach`` or ``_split`` does
        that)."""
        node = Node(
            NodeId(self._next_id),
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

    def _root_of(self, salt: bytes, *, create: bool) -> Node | None:
        """The root of a salt's pages (the tree's root for the empty salt)."""
        if not salt:
            return self._root
        root = self._salt_roots.get(salt)
        if root is None and create:
            root = self._new_node(
                None,
                b"",
                0,
                device=EMPTY_SLOTS,
                host=EMPTY_SLOTS,
                now=0.0,
                priority=self._default_priority,
            )
            self._salt_roots[salt] = root
            self._root_salts[root.id] = (salt, salt_seed(salt))
        return root

    def _drop_salt_root(self, root: Node) -> None:
        """A salt root whose last child went: retire it (nothing else holds its id)."""
        salt, _ = self._root_salts.pop(root.id)
        del self._salt_roots[salt]
        del self._nodes[root.id]

    def _node(self, node_id: NodeId, what: str = "node") -> Node:
        """The live node of an id; TreeError for a removed or unknown one."""
        node = self._nodes.get(node_id)
        if node is None:
            if isinstance(node_id, (int, np.integer)) and 0 <= node_id < self._next_id:
                raise TreeError(f"{what} {node_id} was removed from the tree")
            raise TreeError(f"{what} {node_id!r} is not a node of this tree")
        return node

    # ----------------------------------------------------------------------------- the derived facts
    def _untrack(self, node: Node) -> None:
        """Take node out of the leaf sets and counters before its state changes."""
        if node.parent is None:  # a root (or a removed node)
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
        if node.parent is None:  # a root (or a removed node)
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

    # ----------------------------------------------------------------------------- changes of shape
    def _set_device(self, node: Node, slots: np.ndarray | None, how: str = "") -> None:
        """Give a non-root node device slots, or take them away (``None``)."""
        parent = node.parent
        assert parent is not None
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
                obs.node_lost(node.id, "device")
            else:
                obs.node_gained(node.id, "device", how)

    def _attach(self, node: Node) -> None:
        """Hang a new leaf (from ``_new_node``) under its parent."""
        parent = node.parent
        assert parent is not None
        self._untrack(parent)
        parent.children[node.key[: self._codec.page_bytes]] = node
        if node.device is not None:
            parent.device_children += 1
        self._track(node)
        self._track(parent)
        obs = self.observer
        if obs is not None:  # a new leaf: device-only from insert, host-only from insert_host
            if node.device is not None:
                obs.node_gained(node.id, "device", "insert")
            else:
                obs.node_gained(node.id, "host", "insert_host")

    def _remove(self, node: Node) -> None:
        """Detach a childless node and retire its id. Its slots are the caller's to return."""
        obs = self.observer
        if obs is not None:  # told while the node can still be read
            if node.device is not None:
                obs.node_lost(node.id, "device")
            if node.host is not None and node.backup is None:
                obs.node_lost(node.id, "host")
        parent = node.parent
        assert parent is not None
        self._untrack(node)
        self._untrack(parent)
        del parent.children[node.key[: self._codec.page_bytes]]
        if node.device is not None:
            parent.device_children -= 1
        del self._nodes[node.id]
        node.parent = None
        self._track(parent)
        if parent.parent is None and parent is not self._root and not parent.children:
            self._drop_salt_root(parent)

    def _remove_subtree(self, x: Node, freed_host: list[np.ndarray], removed: list[NodeId]) -> None:
        """Remove x (now without device copy) and its host-only descendants, deepest first,
        collecting their host slots and ids."""
        for child in list(x.children.values()):
            self._remove_subtree(child, freed_host, removed)
        if x.host is not None:
            freed_host.append(x.host)
        removed.append(x.id)
        self._remove(x)

    def _split(self, node: Node, num_tokens: int) -> Node:
        """Cut ``node`` after ``num_tokens`` (whole pages, 0 < n < len). The upper piece is a new
        node that copies every count and stamp; ``node`` keeps its id and the lower piece."""
        cut = num_tokens * self._codec.itemsize
        parent = node.parent
        assert parent is not None
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
        upper.retain_until = node.retain_until
        upper.device_pin_until = node.device_pin_until
        upper.host_pin_until = node.host_pin_until
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
        page_bytes = self._codec.page_bytes
        parent.children[upper.key[:page_bytes]] = upper  # same first page as before
        upper.children[node.key[:page_bytes]] = node
        upper.device_children = int(node.device is not None)
        node.parent = upper
        if node.backup is not None:
            self._backups[node.backup] += 1
        self._track(node)
        self._track(upper)
        return upper

    def clear(self) -> ClearedSlots:
        """Remove every node but the root; return all slots the tree held. Refuses (TreeError)
        while any node is locked, protected or being backed up. Mutates."""
        busy = [
            x.id
            for x in self._nodes.values()
            if x.parent is not None and (x.lock_ref or x.host_ref or x.backup is not None)
        ]
        if busy:
            raise TreeError(f"clear: nodes {busy[:8]} are locked, protected or in flight")
        device = [x.device for x in self._nodes.values() if x.device is not None]
        host = [x.host for x in self._nodes.values() if x.host is not None]
        obs, self.observer = self.observer, None  # one tree_cleared, not one call per node
        try:
            for top in [self._root, *self._salt_roots.values()]:
                for child in list(top.children.values()):
                    self._remove_all(child)
        finally:
            self.observer = obs
        if obs is not None:
            obs.tree_cleared()
        return ClearedSlots(device=concat(device), host=concat(host))

    def _remove_all(self, x: Node) -> None:
        for child in list(x.children.values()):
            self._remove_all(child)
        if x.device is not None:
            self._set_device(x, None)
        self._remove(x)

    # ----------------------------------------------------------------------------- locks and protection
    # Both count along the whole path node..root; a root's stay 0.
    def lock(self, node: NodeId) -> None:
        """Add one ``lock_ref`` on node..root: no page on that path leaves L1 (or L2). Mutates.
        Locking the root does nothing."""
        self._add_lock(self._node(node), 1)

    def unlock(self, node: NodeId) -> None:
        """Drop one ``lock_ref`` on node..root. Raises if the node is not locked. Mutates."""
        x = self._node(node)
        if x.parent is not None and x.lock_ref <= 0:
            raise TreeError(f"unlock of node {node}: it is not locked (lock_ref would go below 0)")
        self._add_lock(x, -1)

    def protect_host(self, node: NodeId, *, copy_complete: bool = True) -> None:
        """Add one ``host_ref`` on node..root: none of these nodes leaves the tree (their host copies
        stay) while an L2 transfer uses them. Raises if the node's host copy is still being written,
        unless ``copy_complete`` is False (the caller only keeps the path in the tree: a prefetch
        anchor, whose copy nothing reads; a node without any copy is kept on L1 or backed up
        before it leaves, see ``evict_device``). Mutates. Protecting the root does nothing."""
        x = self._node(node)
        if copy_complete and x.backup is not None:
            raise TreeError(f"protect_host of node {node}: its host copy is still being written")
        self._add_host_ref(x, 1)

    def release_host(self, node: NodeId) -> None:
        """Drop one ``host_ref`` on node..root. Raises if the node is not protected. Mutates."""
        x = self._node(node)
        if x.parent is not None and x.host_ref <= 0:
            raise TreeError(
                f"release_host of node {node}: it is not protected (host_ref would go below 0)"
            )
        self._add_host_ref(x, -1)

    def _add_lock(self, x: Node, delta: int) -> None:
        """Add ``delta`` to ``lock_ref`` on x..root."""
        while x.parent is not None:
            self._untrack(x)
            x.lock_ref += delta
            self._track(x)
            x = x.parent

    def _add_host_ref(self, x: Node, delta: int) -> None:
        while x.parent is not None:
            self._untrack(x)
            x.host_ref += delta
            self._track(x)
            x = x.parent

    # ----------------------------------------------------------------------------- queries
    @property
    def page_bytes(self) -> int:
        """Bytes of one page of an encoded key (``check_key``)."""
        return self._codec.page_bytes

    @property
    def salts(self) -> int:
        """Salts with pages in the tree (each has a root of its own until its last page goes)."""
        return len(self._salt_roots)

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self._nodes)

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

    def is_root(self, node: NodeId) -> bool:
        """The tree's root, or a salt's (the pages cached under a salt hang below its own)."""
        return self._node(node).parent is None

    def seed(self, root: NodeId) -> PageHash | None:
        """The page hash a root's first pages chain from: None for the tree's root, the salt's
        seed (`salt_seed`) for a salt's root."""
        entry = self._root_salts.get(self._node(root).id)
        return None if entry is None else entry[1]

    def parent(self, node: NodeId) -> NodeId | None:
        p = self._node(node).parent
        return None if p is None else p.id

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
        given = tuple(hashes)
        pages = x.num_tokens // self.page_size
        if len(given) != pages:
            raise TreeError(
                f"set_page_hashes of node {x.id}: {len(given)} hashes for {pages} pages"
            )
        x.hashes = given

    def check_key(self, key: Sequence[Any] | np.ndarray) -> np.ndarray:
        """The key encoded for this tree (a uint32 array of token ids; uint64 pairs for bigram
        keys); TreeError if it is not well-formed. Passing the encoded array of a non-bigram key
        back to `match`/`insert` skips their own conversion. Does not mutate."""
        return self._codec.encode(key)

    def needs_backup(self, node: NodeId) -> bool:
        """True if the node is on the device with no host copy and no backup in flight (a
        write-through candidate that is still worth copying). False for removed ids."""
        x = self._nodes.get(node)
        return x is not None and x.parent is not None and x.device is not None and x.host is None

    def has_host_copy(self, node: NodeId) -> bool:
        """True for the root, and for a node whose host copy is complete (no backup in flight)."""
        x = self._node(node)
        return x.parent is None or (x.host is not None and x.backup is None)

    def cached_tokens(self, tier: str) -> int:
        """Tokens held in "device" or "host" slots by the tree. Does not mutate."""
        if tier == "device":
            return sum(x.device.size for x in self._nodes.values() if x.device is not None)
        if tier == "host":
            return sum(x.host.size for x in self._nodes.values() if x.host is not None)
        raise TreeError(f"cached_tokens: tier must be 'device' or 'host', got {tier!r}")

    def dump(self) -> list[dict[str, Any]]:
        """One plain dict per node, by id (creation order). Does not mutate."""
        out = []
        for i in sorted(self._nodes):
            x = self._nodes[i]
            out.append(
                {
                    "id": x.id,
                    "parent": None if x.parent is None else x.parent.id,
                    "tokens": x.num_tokens,
                    "state": "root" if x.parent is None else self.state(x.id).value,
                    "lock_ref": x.lock_ref,
                    "host_ref": x.host_ref,
                    "hit_count": x.hit_count,
                    "last_access": x.last_access,
                    "created": x.created,
                    "priority": x.priority,
                    "retain_until": x.retain_until,
                    "device_pin_until": x.device_pin_until,
                    "host_pin_until": x.host_pin_until,
                    "backup_in_flight": x.backup is not None,
                    "hashes": x.hashes is not None,
                }
            )
        return out

    # ----------------------------------------------------------------------------- the integrity check
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see docs/tree.md): every fact
        kept incrementally is recomputed from the nodes and compared. Does not mutate. O(tree
        size)."""
        codec = self._codec
        ps, pb = self.page_size, codec.page_bytes
        seen: dict[int, Node] = {}
        device_leaves: set[int] = set()
        host_leaves: set[int] = set()
        evictable_device = evictable_host = 0
        device_parts: list[np.ndarray] = []
        host_parts: list[np.ndarray] = []
        backup_pieces: dict[int, int] = {}
        stack = [self._root, *self._salt_roots.values()]
        for top in stack[1:]:
            assert top.parent is None and top.num_tokens == 0, f"salt root {top.id} is not a root"
            assert top.children, f"salt root {top.id} has no pages below it"
        while stack:
            x = stack.pop()
            assert x.id not in seen, f"node {x.id} reached twice"
            seen[x.id] = x
            assert self._nodes.get(x.id) is x, f"node {x.id} is in the tree but not registered"
            assert x.lock_ref >= 0 and x.host_ref >= 0, f"node {x.id}: negative ref count"
            assert sum(c.lock_ref for c in x.children.values()) <= x.lock_ref or x.parent is None, (
                f"node {x.id}: lock_ref {x.lock_ref} below its children's"
            )
            assert sum(c.host_ref for c in x.children.values()) <= x.host_ref or x.parent is None, (
                f"node {x.id}: host_ref {x.host_ref} below its children's"
            )
            device_children = 0
            for first, c in x.children.items():
                assert c.parent is x, f"node {c.id}: parent pointer is not {x.id}"
                assert first == c.key[:pb] and len(first) == pb, (
                    f"node {c.id}: child key is not its first page"
                )
                device_children += c.device is not None
                if x.device is None and x.parent is not None:
                    assert c.device is None, (
                        f"node {c.id} is on the device below evicted node {x.id}"
                    )
                stack.append(c)
            assert device_children == x.device_children, (
                f"node {x.id}: device_children count is stale"
            )
            if x.parent is None:
                continue
            n = x.num_tokens
            assert n > 0 and n % ps == 0, (
                f"node {x.id}: {n} tokens is not a positive multiple of {ps}"
            )
            assert len(x.key) == n * codec.itemsize, (
                f"node {x.id}: key bytes do not match its length"
            )
            assert x.device is not None or x.host is not None, (
                f"node {x.id} has neither device nor host copy"
            )
            for name, arr in (("device", x.device), ("host", x.host)):
                if arr is not None:
                    assert arr.dtype == np.int64 and arr.shape == (n,), (
                        f"node {x.id}: {name} slots of wrong shape"
                    )
                    assert not arr.flags.writeable, f"node {x.id}: {name} slots are writeable"
            if x.device is not None:
                device_parts.append(x.device)
            if x.host is not None:
                host_parts.append(x.host)
            if x.hashes is not None:
                assert len(x.hashes) == n // ps, (
                    f"node {x.id}: {len(x.hashes)} hashes for {n // ps} pages"
                )
            if x.backup is not None:
                assert x.host is not None and x.lock_ref > 0, (
                    f"node {x.id}: backup in flight without host copy or lock"
                )
                backup_pieces[x.backup] = backup_pieces.get(x.backup, 0) + 1
            if x.device is not None and x.device_children == 0:
                device_leaves.add(x.id)
            if x.device is None and not x.children:
                host_leaves.add(x.id)
            if x.lock_ref == 0:
                if x.device is not None:
                    evictable_device += n
                elif x.host_ref == 0:
                    evictable_host += n
        assert len(seen) == len(self._nodes), "registered nodes unreachable from the root"
        assert set(self._device_leaves) == device_leaves, "device leaf set is stale"
        assert set(self._host_leaves) == host_leaves, "host leaf set is stale"
        assert self._evictable_device == evictable_device, "evictable device count is stale"
        assert self._evictable_host == evictable_host, "evictable host count is stale"
        assert backup_pieces == self._backups, "in-flight backup pieces are stale"
        for bid in backup_pieces:
            assert self._nodes.get(bid) is not None and self._nodes[bid].backup == bid, (
                f"backup {bid} lost its node"
            )
        for name, parts in (("device", device_parts), ("host", host_parts)):
            if parts:
                allslots = np.concatenate(parts)
                assert np.unique(allslots).size == allslots.size, (
                    f"a {name} slot is held by two nodes"
                )
