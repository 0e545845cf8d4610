"""What the tree tells about pages entering or leaving a tier (``RadixTree.observer``)."""

from __future__ import annotations

from typing import Literal, Protocol

from hicache.types import NodeId

__all__ = ["Tier", "TreeObserver"]

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
