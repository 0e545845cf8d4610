"""RadixTree.check_integrity: recompute every derived fact from scratch and compare."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hicache.components.tree.codec import KeyCodec
from hicache.components.tree.node import Node


class TreeState(Protocol):
    """What the check reads of a tree: its nodes and the facts it keeps incrementally
    (`TreeStructure`, which a `RadixTree` owns, has these; this module imports neither, so the
    dependencies point one way)."""

    page_size: int
    codec: KeyCodec
    root: Node
    salt_roots: dict[bytes, Node]
    nodes: dict[int, Node]
    device_leaves: dict[int, Node]
    host_leaves: dict[int, Node]
    evictable_device: int
    evictable_host: int
    backups: dict[int, int]


def check_tree(tree: TreeState) -> None:
    """Raise AssertionError naming the first broken invariant. Does not mutate. O(tree size)."""
    codec = tree.codec
    ps, pb = tree.page_size, codec.page_bytes
    root = tree.root
    seen: dict[int, Node] = {}
    device_leaves: set[int] = set()
    host_leaves: set[int] = set()
    evictable_device = evictable_host = 0
    device_parts: list[np.ndarray] = []
    host_parts: list[np.ndarray] = []
    backup_pieces: dict[int, int] = {}
    stack = [root, *tree.salt_roots.values()]
    for top in stack[1:]:
        assert top.parent is None and top.num_tokens == 0, f"salt root {top.id} is not a root"
        assert top.children, f"salt root {top.id} has no pages below it"
    while stack:
        x = stack.pop()
        assert x.id not in seen, f"node {x.id} reached twice"
        seen[x.id] = x
        assert tree.nodes.get(x.id) is x, f"node {x.id} is in the tree but not registered"
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
                assert c.device is None, f"node {c.id} is on the device below evicted node {x.id}"
            stack.append(c)
        assert device_children == x.device_children, f"node {x.id}: device_children count is stale"
        if x.parent is None:
            continue
        n = x.num_tokens
        assert n > 0 and n % ps == 0, f"node {x.id}: {n} tokens is not a positive multiple of {ps}"
        assert len(x.key) == n * codec.itemsize, f"node {x.id}: key bytes do not match its length"
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
    assert len(seen) == len(tree.nodes), "registered nodes unreachable from the root"
    assert set(tree.device_leaves) == device_leaves, "device leaf set is stale"
    assert set(tree.host_leaves) == host_leaves, "host leaf set is stale"
    assert tree.evictable_device == evictable_device, "evictable device count is stale"
    assert tree.evictable_host == evictable_host, "evictable host count is stale"
    assert backup_pieces == tree.backups, "in-flight backup pieces are stale"
    for bid in backup_pieces:
        assert tree.nodes.get(bid) is not None and tree.nodes[bid].backup == bid, (
            f"backup {bid} lost its node"
        )
    for name, parts in (("device", device_parts), ("host", host_parts)):
        if parts:
            allslots = np.concatenate(parts)
            assert np.unique(allslots).size == allslots.size, f"a {name} slot is held by two nodes"
