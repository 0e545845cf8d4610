"""The controller's two tiers of slots: their ledgers, one per tier (L1 whole from the start;
L2 as the allocator leases it, chunk by chunk while it prepares the host pool), allocation and
eviction, L1 then L2.

Eviction returns what it could not do alone as data: the L1 nodes that need an L2 copy before
they may leave. The write flows (`writes.py`) start those backups and turn "nothing to evict
now" into a wait for an op in flight; nothing here knows of ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.components.controller.ledger import SlotLedger
from hicache.components.controller.shared import Shared, Step
from hicache.results import CacheStats, TierStats
from hicache.types import NodeId


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    """What an L1 eviction made room for, as the controller sees it (the tree's own record,
    `radix.results.DeviceEviction`, also names the slots)."""

    freed: int  # device tokens freed
    needs_backup: tuple[NodeId, ...]  # left on L1 until copied to L2 (the caller's to start)


class Tiers:
    def __init__(self, shared: Shared) -> None:
        cfg = shared.cfg
        self._shared = shared
        # The ledgers of record, one per tier. L2 holds only what the allocator has leased.
        self.ledgers = {
            "device": SlotLedger(size=cfg.device_tokens, page_size=cfg.page_size, tier="device"),
            "host": SlotLedger(
                size=cfg.host_capacity, page_size=cfg.page_size, tier="host", leased=0
            ),
        }

    def lease_host(self, start: int, stop: int) -> None:
        """Host slots [start, stop), prepared by the allocator, join L2 (LedgerError for a
        range that is misaligned or leased already)."""
        self.ledgers["host"].lease(start, stop)

    def alloc(self, step: Step, tier: str, n: int) -> np.ndarray | None:
        slots = self.ledgers[tier].alloc(n)
        if slots is not None and len(slots) and step.out.detail:  # for `hicache check-log`
            step.out.info("tree.slots", tier=tier, op="alloc", slots=slots)
        return slots

    def free(self, step: Step, tier: str, slots: np.ndarray) -> None:
        if len(slots):
            self.ledgers[tier].free(slots)
            if step.out.detail:
                step.out.info("tree.slots", tier=tier, op="free", slots=slots)

    def view(self) -> dict[str, dict[str, int]]:
        """Each tier's size, used and available tokens."""
        return {
            tier: {"size": led.size, "used": led.used, "available": led.available}
            for tier, led in self.ledgers.items()
        }

    def stats(self, inflight: dict[str, int]) -> CacheStats:
        tree, c = self._shared.tree, self._shared.counters
        dev, host = self.ledgers["device"], self.ledgers["host"]
        return CacheStats(
            device=TierStats(
                size=dev.size,
                used=dev.used,
                cached_tokens=tree.cached_tokens("device"),
                evictable_tokens=tree.evictable_device_tokens(),
                evictions=c.device_evictions,
                hit_tokens=c.device_hit_tokens,
            ),
            host=TierStats(
                size=host.size,
                used=host.used,
                cached_tokens=tree.cached_tokens("host"),
                evictable_tokens=tree.evictable_host_tokens(),
                evictions=c.host_evictions,
                hit_tokens=c.host_hit_tokens,
            ),
            storage_hit_tokens=c.storage_hit_tokens,
            bytes={"d2h": c.d2h_bytes, "h2d": c.h2d_bytes},
            storage_dropped=dict(c.storage_dropped),
            inflight=inflight,
        )

    def evict_device(self, step: Step, n: int, *, back_up: bool) -> DeviceRoom:
        """Evict about n tokens from L1. The nodes the policy wants copied to L2 first
        (write_back, exclusive, `back_up`: L3 on) stay on L1 and are returned: the caller
        starts their backups (or drops them, `discard`)."""
        shared, tree = self._shared, self._shared.tree
        ev = tree.evict_device(
            n, now=step.now, require_host_copy=shared.cfg.exclusive, back_up=back_up
        )
        self.free(step, "device", ev.freed)
        self.free(step, "host", ev.freed_host)
        freed = len(ev.freed)
        if freed:
            shared.counters.device_evictions += freed
            step.out.info(
                "tree.evict_device", tokens=freed, demoted=len(ev.demoted), removed=len(ev.removed)
            )
        return DeviceRoom(freed, tuple(ev.needs_backup))

    def discard(self, step: Step, node: NodeId, reason: str) -> int:
        """Drop a device leaf without a copy (and what hangs below it); tokens freed."""
        shared = self._shared
        gone = shared.tree.discard_device(node)
        self.free(step, "device", gone.freed)
        self.free(step, "host", gone.freed_host)
        shared.counters.device_evictions += len(gone.freed)
        step.out.info(
            "tree.evict_device",
            tokens=len(gone.freed),
            demoted=0,
            removed=len(gone.removed),
            reason=reason,
        )
        return len(gone.freed)

    def host(self, step: Step, n: int) -> np.ndarray | None:
        """Host slots for n tokens, evicting L2; None when what is left is protected (by an
        upload or a prefetch in flight, or by a copy still landing)."""
        shared = self._shared
        while True:
            slots = self.alloc(step, "host", n)
            if slots is not None:
                return slots
            ev = shared.tree.evict_host(
                n - self.ledgers["host"].available,  # the shortfall
                now=step.now,
                by_pages=shared.cfg.exclusive,
            )
            if not len(ev.freed):
                return None
            shared.counters.host_evictions += len(ev.freed)
            step.out.info("tree.evict_host", tokens=len(ev.freed), removed=len(ev.removed))
            self.free(step, "host", ev.freed)
