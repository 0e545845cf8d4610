"""Read-only views over a tree's nodes: a node's state, tokens cached per tier, the dump.
Functions over a `TreeStructure`; ``RadixTree``'s methods of the same names call them."""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.components.tree.node import NodeState
from hicache.components.tree.returns import TreeError
from hicache.components.tree.structure import TreeStructure
from hicache.types import NodeId

__all__ = ["cached_tokens", "dump", "has_host_copy", "needs_backup", "state"]


def state(s: TreeStructure, node: NodeId) -> NodeState:
    x = s.nodes.get(node)
    if x is None:
        if isinstance(node, (int, np.integer)) and 0 <= node < s.next_id:
            return NodeState.GONE
        raise TreeError(f"node {node!r} is not a node of this tree")
    if x.device is None:
        return NodeState.HOST_ONLY
    return NodeState.DEVICE_ONLY if x.host is None else NodeState.BOTH


def needs_backup(s: TreeStructure, node: NodeId) -> bool:
    x = s.nodes.get(node)
    return x is not None and x.parent is not None and x.device is not None and x.host is None


def has_host_copy(s: TreeStructure, node: NodeId) -> bool:
    x = s.node(node)
    return x.parent is None or (x.host is not None and x.backup is None)


def cached_tokens(s: TreeStructure, tier: str) -> int:
    if tier == "device":
        return sum(x.device.size for x in s.nodes.values() if x.device is not None)
    if tier == "host":
        return sum(x.host.size for x in s.nodes.values() if x.host is not None)
    raise TreeError(f"cached_tokens: tier must be 'device' or 'host', got {tier!r}")


def dump(s: TreeStructure) -> list[dict[str, Any]]:
    out = []
    for i in sorted(s.nodes):
        x = s.nodes[i]
        out.append(
            {
                "id": x.id,
                "parent": None if x.parent is None else x.parent.id,
                "tokens": x.num_tokens,
                "state": "root" if x.parent is None else state(s, x.id).value,
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
