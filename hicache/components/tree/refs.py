"""The ref counts that pin a path: ``lock_ref`` (no page of node..root leaves L1 or L2) and
``host_ref`` (no node of node..root leaves the tree while an L2 transfer uses its host copy).
Both count along the whole path node..root; the root's stay 0. Functions over a
`TreeStructure`; ``RadixTree``'s methods of the same names call them and document them."""

from __future__ import annotations

from hicache.components.tree.node import Node
from hicache.components.tree.returns import TreeError
from hicache.components.tree.structure import TreeStructure
from hicache.types import NodeId

__all__ = ["add_lock", "lock", "protect_host", "release_host", "unlock"]


def add_lock(s: TreeStructure, x: Node, delta: int) -> None:
    """Add ``delta`` to ``lock_ref`` on x..root."""
    while x.parent is not None:
        s.untrack(x)
        x.lock_ref += delta
        s.track(x)
        parent = x.parent
        assert parent is not None
        x = parent


def _add_host_ref(s: TreeStructure, x: Node, delta: int) -> None:
    while x.parent is not None:
        s.untrack(x)
        x.host_ref += delta
        s.track(x)
        parent = x.parent
        assert parent is not None
        x = parent


def lock(s: TreeStructure, node: NodeId) -> None:
    add_lock(s, s.node(node), 1)


def unlock(s: TreeStructure, node: NodeId) -> None:
    x = s.node(node)
    if x.parent is not None and x.lock_ref <= 0:
        raise TreeError(f"unlock of node {node}: it is not locked (lock_ref would go below 0)")
    add_lock(s, x, -1)


def protect_host(s: TreeStructure, node: NodeId, *, copy_complete: bool = True) -> None:
    x = s.node(node)
    if copy_complete and x.backup is not None:
        raise TreeError(f"protect_host of node {node}: its host copy is still being written")
    _add_host_ref(s, x, 1)


def release_host(s: TreeStructure, node: NodeId) -> None:
    x = s.node(node)
    if x.parent is not None and x.host_ref <= 0:
        raise TreeError(
            f"release_host of node {node}: it is not protected (host_ref would go below 0)"
        )
    _add_host_ref(s, x, -1)
