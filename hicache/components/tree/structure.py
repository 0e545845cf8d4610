"""The tree's nodes and the facts it keeps about them incrementally.

Every change to a node's place in the tree (new, attached, split, removed), to its device copy or
to its ref counts (`refs.py`) goes through `TreeStructure`, which keeps the eviction candidates (device and
host leaves), the evictable token counts and the in-flight backup pieces up to date, and tells
the observer where pages entered or left a tier. `RadixTree` owns one; the operations in
`prefix.py`, `refs.py`, `transfers.py`, `leaf_eviction.py` and `views.py` work on it.

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

import hashlib

import numpy as np

from hicache.components.tree.codec import KeyCodec
from hicache.components.tree.node import Node
from hicache.components.tree.observer import TreeObserver
from hicache.components.tree.returns import ClearedSlots, TreeError
from hicache.components.tree.slot_arrays import concat
from hicache.types import EMPTY_SLOTS, NodeId, PageHash

__all__ = ["TreeStructure", "salt_seed"]


def salt_seed(salt: bytes) -> PageHash:
    """What a salt's page hash chain starts from (the empty salt starts from nothing, so its
    L3 keys are those of a cache without salts): equal salts give equal keys on every
    instance, so instances of one tenant share a store."""
    return PageHash(hashlib.sha256(b"hicache salt\0" + salt).hexdigest())


class TreeStructure:
    """The nodes of one tree (by id, from the root) and the facts derived from them, kept
    incrementally: which nodes are eviction candidates, how many tokens are evictable, how many
    pieces each in-flight backup covers. ``check_tree`` recomputes all of it from scratch."""

    def __init__(
        self, *, codec: KeyCodec, observer: TreeObserver | None, default_priority: int = 0
    ) -> None:
        self.codec = codec
        self.default_priority = default_priority  # a node's priority outside any live range
        self.ranked = False  # some node was given a priority: eviction ranks by it first
        self.page_size = codec.page_size
        self.observer = observer
        self.next_id = 0
        self.nodes: dict[int, Node] = {}  # live nodes by id
        self.root = self.new_node(
            None, b"", 0, device=EMPTY_SLOTS, host=EMPTY_SLOTS, now=0.0, priority=default_priority
        )
        # One more root per salt in use (docs/tree.md, "Salts"): a salt's pages hang below its
        # own root, so no other salt's walk can reach them. Created by the first insert under
        # the salt, removed with its last child; nobody outside the tree holds its id.
        self.salt_roots: dict[bytes, Node] = {}
        self.root_salts: dict[int, tuple[bytes, PageHash]] = {}  # salt root id -> salt, seed
        # Eviction candidates (id -> node; iteration order is insertion order).
        self.device_leaves: dict[int, Node] = {}  # device-resident, no device-resident child
        self.host_leaves: dict[int, Node] = {}  # host-only, no children
        self.evictable_device = 0  # device tokens of unlocked nodes
        self.evictable_host = 0  # host-only tokens of unlocked, unprotected nodes
        self.backups: dict[int, int] = {}  # in-flight backup id (its node id) -> pieces (>= 1)

    def new_node(
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
        """A registered node, not yet attached to its parent (``attach`` or ``split`` does that)."""
        node = Node(
            NodeId(self.next_id),
            parent,
            key,
            num_tokens,
            device=device,
            host=host,
            now=now,
            priority=priority,
        )
        self.next_id += 1
        self.nodes[node.id] = node
        return node

    def root_of(self, salt: bytes, *, create: bool) -> Node | None:
        """The root of a salt's pages (the tree's root for the empty salt)."""
        if not salt:
            return self.root
        root = self.salt_roots.get(salt)
        if root is None and create:
            root = self.new_node(
                None,
                b"",
                0,
                device=EMPTY_SLOTS,
                host=EMPTY_SLOTS,
                now=0.0,
                priority=self.default_priority,
            )
            self.salt_roots[salt] = root
            self.root_salts[root.id] = (salt, salt_seed(salt))
        return root

    def seed_of(self, root: Node) -> PageHash | None:
        """The page hash before a root's first pages: None for the tree's root."""
        entry = self.root_salts.get(root.id)
        return None if entry is None else entry[1]

    def _drop_salt_root(self, root: Node) -> None:
        """A salt root whose last child went: retire it (nothing else holds its id)."""
        salt, _ = self.root_salts.pop(root.id)
        del self.salt_roots[salt]
        del self.nodes[root.id]

    def node(self, node_id: NodeId, what: str = "node") -> Node:
        """The live node of an id; TreeError for a removed or unknown one."""
        node = self.nodes.get(node_id)
        if node is None:
            if isinstance(node_id, (int, np.integer)) and 0 <= node_id < self.next_id:
                raise TreeError(f"{what} {node_id} was removed from the tree")
            raise TreeError(f"{what} {node_id!r} is not a node of this tree")
        return node

    def untrack(self, node: Node) -> None:
        """Take node out of the leaf sets and counters before its state changes."""
        if node.parent is None:  # a root (or a removed node)
            return
        self.device_leaves.pop(node.id, None)
        self.host_leaves.pop(node.id, None)
        if node.lock_ref == 0:
            if node.device is not None:
                self.evictable_device -= node.num_tokens
            elif node.host_ref == 0:
                self.evictable_host -= node.num_tokens

    def track(self, node: Node) -> None:
        """Put node back into the leaf sets and counters after its state changed."""
        if node.parent is None:  # a root (or a removed node)
            return
        if node.device is not None:
            if node.device_children == 0:
                self.device_leaves[node.id] = node
        elif not node.children:
            self.host_leaves[node.id] = node
        if node.lock_ref == 0:
            if node.device is not None:
                self.evictable_device += node.num_tokens
            elif node.host_ref == 0:
                self.evictable_host += node.num_tokens

    def set_device(self, node: Node, slots: np.ndarray | None, how: str = "") -> None:
        """Give a non-root node device slots, or take them away (``None``)."""
        parent = node.parent
        assert parent is not None
        self.untrack(node)
        self.untrack(parent)
        was = node.device is not None
        node.device = slots
        parent.device_children += (slots is not None) - was
        self.track(node)
        self.track(parent)
        obs = self.observer
        if obs is not None and was != (slots is not None):
            if slots is None:
                obs.node_lost(node.id, "device")
            else:
                obs.node_gained(node.id, "device", how)

    def attach(self, node: Node) -> None:
        """Hang a new leaf (from ``new_node``) under its parent."""
        parent = node.parent
        assert parent is not None
        self.untrack(parent)
        parent.children[node.key[: self.codec.page_bytes]] = node
        if node.device is not None:
            parent.device_children += 1
        self.track(node)
        self.track(parent)
        obs = self.observer
        if obs is not None:  # a new leaf: device-only from insert, host-only from insert_host
            if node.device is not None:
                obs.node_gained(node.id, "device", "insert")
            else:
                obs.node_gained(node.id, "host", "insert_host")

    def remove(self, node: Node) -> None:
        """Detach a childless node and retire its id. Its slots are the caller's to return."""
        obs = self.observer
        if obs is not None:  # told while the node can still be read
            if node.device is not None:
                obs.node_lost(node.id, "device")
            if node.host is not None and node.backup is None:
                obs.node_lost(node.id, "host")
        parent = node.parent
        assert parent is not None
        self.untrack(node)
        self.untrack(parent)
        del parent.children[node.key[: self.codec.page_bytes]]
        if node.device is not None:
            parent.device_children -= 1
        del self.nodes[node.id]
        node.parent = None
        self.track(parent)
        if parent.parent is None and parent is not self.root and not parent.children:
            self._drop_salt_root(parent)

    def remove_subtree(self, x: Node, freed_host: list[np.ndarray], removed: list[NodeId]) -> None:
        """Remove x (now without device copy) and its host-only descendants, deepest first,
        collecting their host slots and ids."""
        for child in list(x.children.values()):
            self.remove_subtree(child, freed_host, removed)
        if x.host is not None:
            freed_host.append(x.host)
        removed.append(x.id)
        self.remove(x)

    def clear(self) -> ClearedSlots:
        """``RadixTree.clear``: remove every node but the root, return every slot."""
        root = self.root
        busy = [
            x.id
            for x in self.nodes.values()
            if x.parent is not None and (x.lock_ref or x.host_ref or x.backup is not None)
        ]
        if busy:
            raise TreeError(f"clear: nodes {busy[:8]} are locked, protected or in flight")
        device = [x.device for x in self.nodes.values() if x.device is not None]
        host = [x.host for x in self.nodes.values() if x.host is not None]
        obs, self.observer = self.observer, None  # one tree_cleared, not one call per node
        try:
            for top in [root, *self.salt_roots.values()]:
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
            self.set_device(x, None)
        self.remove(x)

    def split(self, node: Node, num_tokens: int) -> Node:
        """Cut ``node`` after ``num_tokens`` (whole pages, 0 < n < len). The upper piece is a new node
        that copies every count and stamp; ``node`` keeps its id and the lower piece."""
        cut = num_tokens * self.codec.itemsize
        parent = node.parent
        assert parent is not None
        upper = self.new_node(
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
        self.untrack(node)
        node.key = node.key[cut:]
        node.num_tokens -= num_tokens
        if node.device is not None:
            node.device = node.device[num_tokens:]
        if node.host is not None:
            node.host = node.host[num_tokens:]
        page_bytes = self.codec.page_bytes
        parent.children[upper.key[:page_bytes]] = upper  # same first page as before
        upper.children[node.key[:page_bytes]] = node
        upper.device_children = int(node.device is not None)
        node.parent = upper
        if node.backup is not None:
            self.backups[node.backup] += 1
        self.track(node)
        self.track(upper)
        return upper

    def set_hashes(self, x: Node, hashes: tuple[PageHash, ...]) -> None:
        """``RadixTree.set_page_hashes``: one L3 page hash per page of x."""
        pages = x.num_tokens // self.page_size
        if len(hashes) != pages:
            raise TreeError(
                f"set_page_hashes of node {x.id}: {len(hashes)} hashes for {pages} pages"
            )
        x.hashes = hashes
