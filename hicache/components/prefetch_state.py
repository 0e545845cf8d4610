"""The lifecycle of one prefetch (L3 -> L2), as the tree's prefetch flow and the prefetcher
actor both follow it: the phases, the one table of allowed transitions, and the error an
illegal transition raises.

    PROBING ──> WAITING_HOST ──> READING ──┐
       │             │              │      │
       └────────> STOPPING <────────┘      │
       │             │                     │
       └──────> DONE | REVOKED <───────────┘   (from any phase above)
                     │
                   ENDED                        (the tree only)

- PROBING: storage is asked how many consecutive pages it has.
- WAITING_HOST: probed; host slots for exactly those pages are not given yet (the tree is
  finding room, the prefetcher waits for its `ReadPrefetch`).
- READING: the pages are read in batches into the slots.
- STOPPING: a stop was asked (the request's wait, a timeout, a detach, close); what has arrived
  is kept, the I/O in flight finishes.
- DONE / REVOKED: settled. For the tree: what arrived is in the tree and the request has its
  outcome (REVOKED: nothing kept, the hit was below the threshold or L2 had no room). For the
  prefetcher: its last report is sent and it lets the op go.
- ENDED: the tree has the prefetcher's end report: the op's slots not taken are free again.

Each side uses the phases it sees: the prefetcher never reaches REVOKED or ENDED (it ends at
DONE). The outcome a caller sees (`PrefetchOutcome.state`) is `caller_state(phase)`.
"""

from __future__ import annotations

import enum
from typing import Literal


class Phase(enum.Enum):
    PROBING = "probing"
    WAITING_HOST = "waiting_host"
    READING = "reading"
    STOPPING = "stopping"
    DONE = "done"
    REVOKED = "revoked"
    ENDED = "ended"


_SETTLED = frozenset({Phase.DONE, Phase.REVOKED})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PROBING: frozenset({Phase.WAITING_HOST, Phase.STOPPING, *_SETTLED}),
    Phase.WAITING_HOST: frozenset({Phase.READING, Phase.STOPPING, *_SETTLED}),
    Phase.READING: frozenset({Phase.STOPPING, *_SETTLED}),
    Phase.STOPPING: _SETTLED,
    Phase.DONE: frozenset({Phase.ENDED}),
    Phase.REVOKED: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}

RUNNING = frozenset({Phase.PROBING, Phase.WAITING_HOST, Phase.READING, Phase.STOPPING})


class PrefetchStateError(RuntimeError):
    """A prefetch was asked to move between phases the lifecycle does not connect: a bug in
    the flow that asked, never a caller's mistake."""

    def __init__(self, op: int, current: Phase, wanted: Phase) -> None:
        super().__init__(f"prefetch {op}: no transition from {current.name} to {wanted.name}")
        self.op, self.current, self.wanted = op, current, wanted


def advance(op: int, current: Phase, wanted: Phase) -> Phase:
    """`wanted`, when the table allows it from `current`; else `PrefetchStateError`."""
    if wanted not in TRANSITIONS[current]:
        raise PrefetchStateError(op, current, wanted)
    return wanted


def caller_state(phase: Phase) -> Literal["running", "done", "revoked"]:
    """The state a caller sees: running until settled."""
    if phase in RUNNING:
        return "running"
    if phase is Phase.REVOKED:
        return "revoked"
    return "done"  # an ENDED op has left every table: no one asks
