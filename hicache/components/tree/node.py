"""The tree's node record and the node states. Internal to the tree: other components hold NodeIds."""

from __future__ import annotations

import enum

import numpy as np

from hicache.types import NodeId, PageHash

__all__ = ["INF", "Node", "NodeState"]

INF = float("inf")


class NodeState(enum.Enum):
    """Where a node's KV lives. ``GONE``: the id was removed from the tree (ids are never reused)."""

    DEVICE_ONLY = "device_only"
    BOTH = "both"
    HOST_ONLY = "host_only"
    GONE = "gone"


class Node:
    """One edge of the radix tree: a run of whole pages and where their KV lives.

    Owned and mutated only by the RadixTree that created it. Invariants (RadixTree.check_integrity):
    ``key`` holds ``num_tokens`` tokens (a multiple of page_size, > 0 except for the root); ``device``
    and ``host`` are None or read-only int64 arrays of ``num_tokens`` slots; a non-root node has at least
    one of them; ``hashes`` is None or one page hash per page.
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
