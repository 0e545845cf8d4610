"""The controller's allocator: device and host slots for every caller, with eviction.

The tier owner (`tiers.py`) allocates and evicts; what an allocation needs first comes back
as data: the L1 nodes eviction left for an L2 copy (the write flow starts their backups, or
the node is dropped), and, when nothing can be freed now, the op whose end frees slots: a
`Grant` without slots carries its `Wait` (the oldest backup, else the oldest load; for host
room the oldest upload), and the caller parks on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.components.controller.loads import LoadFlows
from hicache.components.controller.ops import Wait
from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.storage_switch import StorageSwitch
from hicache.components.controller.tiers import DeviceRoom, Tiers
from hicache.components.controller.writes import WriteFlows
from hicache.types import EMPTY_SLOTS


@dataclass(frozen=True, slots=True)
class Grant:
    """An allocation's answer: the slots, or none (`wait`: until this op ends; None: no room
    to wait for)."""

    slots: np.ndarray | None = None
    wait: Wait | None = None


class Allocator:
    def __init__(
        self,
        shared: Shared,
        tiers: Tiers,
        storage: StorageSwitch,
        writes: WriteFlows,
        loads: LoadFlows,
    ) -> None:
        self._shared = shared
        self._tiers = tiers
        self._storage = storage
        self._writes = writes
        self._loads = loads

    def device(self, step: Step, n: int) -> Grant:
        """Device slots for n tokens, evicting L1 and starting the backups eviction asks for
        first (write_back, exclusive, L3 on). Without room, the op whose end frees slots: the
        oldest backup, else the oldest load (a load in flight locks the pages it fills until
        it ends: wait for it, rather than call L1 full while they are about to become
        evictable)."""
        if n == 0:
            return Grant(EMPTY_SLOTS)
        cfg, tiers, writes = self._shared.cfg, self._tiers, self._writes
        # With L3 attached a page leaves L1 through L2 (and so reaches L3), whatever the policy.
        back_up = self._storage.on and cfg.evict_to_storage
        while True:
            room = tiers.device(step, n, landing=writes.evicting_tokens(), back_up=back_up)
            if room.slots is not None:
                return Grant(room.slots)
            freed, wait = self._copy_or_drop(step, room, back_up)
            if freed:
                continue
            if wait is not None:
                return Grant(wait=wait)
            return Grant(wait=writes.oldest_write() or self._loads.oldest())

    def _copy_or_drop(self, step: Step, room: DeviceRoom, back_up: bool) -> tuple[int, Wait | None]:
        """Back up or drop what eviction left for a copy first. The device tokens freed, and
        the first wait met (no write credit)."""
        shared, tree, tiers = self._shared, self._shared.tree, self._tiers
        freed, wait = room.freed, None
        for node in room.needs_backup:  # write_back, exclusive, L3 on: copy, then evict
            if shared.cfg.exclusive and not tree.outranks_host(node, now=step.now):
                # Older than everything L2 could give up: drop it rather than displace hotter
                # pages, so the two tiers together evict like one LRU of their total size.
                freed += tiers.discard(step, node, "older_than_l2")
            elif wait is None:
                started = self._writes.start_backup(step, node, evicting=True)
                if started.wait is not None:
                    wait = started.wait  # the rest stay on L1, found again by the next eviction
                elif started.dropped is not None:
                    freed += started.dropped
                elif not started.started and back_up and tree.needs_backup(node):
                    # No L2 room for its copy (what L2 holds is on L1 too, or in use): with
                    # L3 attached it leaves L1 as without L3, rather than fail the allocation.
                    freed += tiers.discard(step, node, "no_l2_room")
        return freed, wait

    def host(self, step: Step, n: int) -> Grant:
        """Host slots for n tokens, evicting L2; when what is left is protected by uploads,
        the wait for the oldest. Only a prefetch's read waits on it (an eviction's backup is
        dropped instead, a write-through one waits in the backlog: `WriteFlows.start_backup`)."""
        slots = self._tiers.host(step, n)
        if slots is not None:
            return Grant(slots)
        return Grant(wait=self._writes.oldest_upload())
