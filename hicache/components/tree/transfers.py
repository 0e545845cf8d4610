"""Copies between the tiers, as the tree records them: backups (L1 -> L2: ``begin_backup`` ..
``end_backup``) and loads back (L2 -> L1: ``plan_load_back``, ``commit_load_back``, undone by
``revert_load_back``; exclusive mode then ``drop_host``). Functions over a `TreeStructure`;
``RadixTree``'s methods of the same names call them and document them."""

from __future__ import annotations

import numpy as np

from hicache.components.tree.node import Node
from hicache.components.tree.refs import add_lock
from hicache.components.tree.returns import LoadPlan, TreeError
from hicache.components.tree.slot_arrays import concat, frozen_slots
from hicache.components.tree.structure import TreeStructure
from hicache.types import EMPTY_SLOTS, NodeId

__all__ = [
    "backup_pieces",
    "begin_backup",
    "commit_load_back",
    "drop_host",
    "end_backup",
    "plan_load_back",
    "revert_load_back",
]


def begin_backup(s: TreeStructure, node: NodeId, host_slots: np.ndarray) -> None:
    x = s.node(node)
    if x.parent is None:
        raise TreeError("begin_backup: a root has no KV to back up")
    if x.device is None:
        raise TreeError(f"begin_backup of node {node}: it has no device copy")
    if x.host is not None:
        raise TreeError(f"begin_backup of node {node}: it already has a host copy")
    slots = frozen_slots(host_slots, f"begin_backup of node {node}", x.num_tokens)
    s.untrack(x)
    x.host = slots
    x.backup = x.id
    s.track(x)
    s.backups[x.id] = 1
    add_lock(s, x, 1)


def _pieces(x: Node) -> list[Node]:
    """The nodes the backup begun on ``x`` covers, ``x`` first: it and the upper pieces split
    off it since (they sit directly above it)."""
    pieces = []
    y: Node | None = x
    while y is not None and y.backup == x.id:
        pieces.append(y)
        y = y.parent
    return pieces


def backup_pieces(s: TreeStructure, node: NodeId) -> tuple[NodeId, ...]:
    x = s.node(node)
    if x.backup != x.id:
        raise TreeError(f"backup_pieces of node {node}: no backup of it is in flight")
    return tuple(p.id for p in reversed(_pieces(x)))


def end_backup(s: TreeStructure, node: NodeId, *, ok: bool) -> np.ndarray:
    x = s.node(node)
    if x.backup != x.id:
        raise TreeError(f"end_backup of node {node}: no backup of it is in flight")
    pieces = _pieces(x)
    assert len(pieces) == s.backups.pop(x.id)
    add_lock(s, x, -1)
    freed = []
    for piece in reversed(pieces):
        s.untrack(piece)
        piece.backup = None
        if not ok:
            assert piece.host is not None
            freed.append(piece.host)
            piece.host = None
        s.track(piece)
    obs = s.observer
    if ok and obs is not None:  # the host copies are complete now, root first
        for piece in reversed(pieces):
            obs.node_gained(piece.id, "host", "backup")
    return concat(freed) if not ok else EMPTY_SLOTS


def plan_load_back(s: TreeStructure, node: NodeId) -> LoadPlan:
    x = s.node(node)
    chain = []
    host = []
    while x.device is None:  # the root is on the device (it holds empty slots)
        assert x.host is not None and x.parent is not None
        chain.append(x.id)
        host.append(x.host)
        x = x.parent
    chain.reverse()
    host.reverse()
    slots = concat(host)
    return LoadPlan(nodes=tuple(chain), host_slots=slots, num_tokens=int(slots.size))


def commit_load_back(s: TreeStructure, plan: LoadPlan, device_slots: np.ndarray) -> None:
    if not plan.nodes:
        frozen_slots(device_slots, "commit_load_back", 0)
        return
    current = plan_load_back(s, plan.nodes[-1])
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
        c = s.nodes[i]
        s.set_device(c, slots[offset : offset + c.num_tokens], "load_back")
        offset += c.num_tokens


def revert_load_back(s: TreeStructure, plan: LoadPlan) -> tuple[np.ndarray, tuple[NodeId, ...]]:
    freed: list[np.ndarray] = []
    kept: list[NodeId] = []
    for i in reversed(plan.nodes):
        x = s.nodes.get(i)
        if x is None or x.device is None or x.host is None:
            continue
        if x.device_children:
            kept.append(x.id)
            break
        freed.append(x.device)
        s.set_device(x, None)
    return concat(freed), tuple(kept)


def drop_host(s: TreeStructure, plan: LoadPlan) -> np.ndarray:
    return _drop_host_copies(s, [s.nodes.get(i) for i in reversed(plan.nodes)])


def drop_unlocked_host_copies(s: TreeStructure) -> np.ndarray:
    """Every unlocked node on the device gives up its host copy (`clear` of L2)."""
    return _drop_host_copies(s, [x for x in s.nodes.values() if x.lock_ref == 0])


def _drop_host_copies(s: TreeStructure, nodes: list[Node | None]) -> np.ndarray:
    """Nodes that are gone, not on the device, or whose host copy is in use keep it."""
    freed: list[np.ndarray] = []
    for x in nodes:
        if x is None or x.host is None or x.device is None or x.host_ref or x.backup:
            continue
        if x.parent is None:
            continue  # a root
        s.untrack(x)
        freed.append(x.host)
        x.host = None
        s.track(x)
        if s.observer is not None:
            s.observer.node_lost(x.id, "host")
    return concat(freed)
