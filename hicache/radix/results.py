"""What crosses the tree's boundary: `TreeError`, the node states and frozen records its calls
return (ids, slot arrays and counts, never a node), and the read-only int64 slot arrays it takes
and gives back."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hicache.types import EMPTY_SLOTS, NodeId

__all__ = [
    "ClearedSlots",
    "DeviceEviction",
    "HostEviction",
    "InsertHostResult",
    "InsertResult",
    "LoadPlan",
    "MatchResult",
    "NodeState",
    "TreeError",
    "concat",
    "frozen_slots",
]


class TreeError(ValueError):
    """A tree call with bad input (unknown or removed node, wrong lengths, unbalanced release,
    stale plan). Raised before anything changed."""


class NodeState(enum.Enum):
    """Where a node's KV lives. ``GONE``: the id was removed from the tree (ids are never reused)."""

    DEVICE_ONLY = "device_only"
    BOTH = "both"
    HOST_ONLY = "host_only"
    GONE = "gone"


@dataclass(frozen=True, slots=True)
class MatchResult:
    device_slots: np.ndarray
    """Read-only int64 device slots of the L1-resident prefix of the key (whole pages)."""
    host_len: int
    """Tokens matched after that prefix that exist only in L2."""
    last_node: NodeId
    """Deepest matched node (the root if nothing matched)."""

    @property
    def device_len(self) -> int:
        return int(self.device_slots.size)


@dataclass(frozen=True, slots=True)
class InsertResult:
    prefix_len: int
    """Tokens of the key that were already on the device; the slots passed for them are duplicates."""
    duplicate_slots: np.ndarray
    """The caller's slots for those tokens (its first prefix_len slots): the caller frees them."""
    last_node: NodeId
    """The node holding the key's last page."""
    backup_candidates: tuple[NodeId, ...]
    """Nodes on the key's path, root first, whose hit count reached the write policy's threshold and
    that are on the device without any host copy (reported again at later hits until backed up)."""


@dataclass(frozen=True, slots=True)
class InsertHostResult:
    matched_len: int
    """Tokens of the suffix already in the tree; the host slots passed for them are duplicates."""
    duplicate_slots: np.ndarray
    """The caller's host slots for those tokens: the caller frees them."""
    last_node: NodeId
    """The node holding the suffix's last page (``parent`` for an empty suffix)."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    nodes: tuple[NodeId, ...]
    """Host-only nodes to load, root first: from just below the deepest device-resident ancestor
    down to the planned node."""
    host_slots: np.ndarray
    """Their host slots concatenated in that order."""
    num_tokens: int


class _Freed:
    """What an eviction's `freed_parts` (one slot array per node) add up to."""

    __slots__ = ()
    freed_parts: tuple[np.ndarray, ...]

    @property
    def freed(self) -> np.ndarray:
        """The slots freed, end to end."""
        return concat(list(self.freed_parts))

    @property
    def freed_tokens(self) -> int:
        return sum(len(part) for part in self.freed_parts)


@dataclass(frozen=True, slots=True)
class DeviceEviction(_Freed):
    freed_parts: tuple[np.ndarray, ...]
    """Device slots the caller now frees, one array per node (joined only if asked: `freed`)."""
    demoted: tuple[NodeId, ...]
    """Nodes that kept their host copy and became HOST_ONLY."""
    removed: tuple[NodeId, ...]
    """Nodes removed from the tree (no host copy, or host-only descendants of such a node)."""
    needs_backup: tuple[NodeId, ...]
    """Unlocked device leaves without host copy that were kept because the policy (write_back) or the
    caller (exclusive mode) requires a host copy before they leave L1: back them up, then evict again."""
    freed_host: np.ndarray
    """Host slots of host-only descendants removed together with a removed node."""


@dataclass(frozen=True, slots=True)
class HostEviction(_Freed):
    freed_parts: tuple[np.ndarray, ...]
    """Host slots the caller now frees, one array per node (joined only if asked: `freed`)."""
    removed: tuple[NodeId, ...]


@dataclass(frozen=True, slots=True)
class ClearedSlots:
    device: np.ndarray
    """Device slots the tree held."""
    host: np.ndarray
    """Host slots the tree held."""


def concat(parts: list[np.ndarray]) -> np.ndarray:
    """Slot arrays end to end, read-only (a single part is returned as is)."""
    if not parts:
        return EMPTY_SLOTS
    if len(parts) == 1:
        return parts[0]
    out = np.concatenate(parts)
    out.flags.writeable = False
    return out


def frozen_slots(slots: np.ndarray, what: str, expected: int) -> np.ndarray:
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
