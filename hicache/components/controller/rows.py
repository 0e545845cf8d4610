"""The rows of the controller's tables: one per running request (`RequestState`, in
`requests.py`) and one per op in flight (`WriteOp`, `LoadOp`, `UploadOp`, `PrefetchOp`, in the
op table, `ops.py`). Other actors only ever see ids and slot arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.components.loader.ticket import LoadTicket
from hicache.components.prefetch_state import Phase, advance
from hicache.radix.results import LoadPlan
from hicache.radix.tree import Range
from hicache.results import PrefetchOutcome
from hicache.types import EMPTY_SLOTS, NodeId, OpId, PageHash, RequestId


@dataclass(slots=True)
class RequestState:
    """What the controller knows of one running request."""

    lock: NodeId | None = None  # the node whose path is locked for this request
    last_node: NodeId | None = None  # deepest matched node (device or host)
    prefix_slots: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)  # tree slots it reads
    host_len: int = 0  # L2-only tokens after prefix_slots, as of the last match
    owned: list[np.ndarray] = field(default_factory=list)  # slots allocated, not yet in the tree
    # the rest of its last page, unused
    padding: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    tokens: Any = None  # the tokens of the last match, for re-matching after a prefetch
    salt: bytes = b""  # the pages it may read and caches are those of this salt
    prefetch: PrefetchOutcome | None = None  # the last prefetch's outcome once it ended
    loads: list[OpId] = field(default_factory=list)  # the loads its prefix waits on
    failed_load: bool = False  # one of them failed: its prefix slots are no longer its
    loaded_back: bool = False  # load_back ran since the last match: its prefix is fixed now
    retention: tuple[Range, ...] = ()  # its ranges (start, end, priority, until), from the match


@dataclass(slots=True)
class WriteOp:
    node: NodeId
    host_slots: np.ndarray
    evicting: bool = False  # started by an L1 eviction (write_back / exclusive)


@dataclass(slots=True)
class LoadOp:
    ticket: LoadTicket  # the handle callers wait on (bound when the actor submits the load)
    plan: LoadPlan
    lock: NodeId  # the load's own lock (the plan's deepest node), held until it lands or fails
    anchor: NodeId  # the deepest node already on the device above it (the root if none): the
    # nodes the load fills are those between anchor and lock, however they are split meanwhile


@dataclass(slots=True)
class PrefetchOp:
    rid: RequestId
    anchor: NodeId  # deepest matched node with a host copy; new nodes go below it
    tokens: Any  # the page-aligned tokens to fetch, after the anchor
    prefix: Any  # its request's tokens up to the end of `tokens` (pins mark what lands)
    salt: bytes  # its request's
    hashes: tuple[PageHash, ...]
    host_slots: np.ndarray
    timer: bool = False  # the timeout policy's timer is running (cancelled when the op ends)
    threshold: int = 0  # fewest tokens worth fetching (the config's, or the request's own)
    phase: Phase = Phase.PROBING  # where it stands (`prefetch_state.py`)
    hit_pages: int = 0  # pages storage has, as agreed (known from WAITING_HOST on)
    done_pages: int = 0
    waiters: list[Any] = field(default_factory=list)  # replies of prefetch waits

    def to(self, op: OpId, phase: Phase) -> None:
        self.phase = advance(op, self.phase, phase)


@dataclass(slots=True)
class UploadOp:
    node: NodeId
    pages: int
    timed_out: bool = False  # its storage call passed the deadline: no longer waited for
