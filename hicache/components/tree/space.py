"""Where the controller's slots come from: its two ledgers, one per tier (L1 whole from the
start; L2 as the allocator leases it, chunk by chunk while it prepares the host pool), and
eviction, L1 then L2.

An allocation either succeeds, is impossible now (None: everything left is locked by running
requests), or must wait for an op in flight (`Wait`): an eviction backup that will free device
slots, an upload that holds the only evictable host pages. The caller parks on a `Wait` and is
retried once that op has ended; nothing here blocks.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hicache.components.allocator.core import SlotLedger
from hicache.components.tree.context import Context, Wait
from hicache.results import CacheStats, TierStats
from hicache.types import EMPTY_SLOTS, NodeId, OpId


class Writes(Protocol):
    """What eviction needs of the write flows (`writes.py`), which allocate from here."""

    def evicting_tokens(self) -> int: ...

    def oldest_write(self) -> OpId | None: ...

    def oldest_live_upload(self) -> OpId | None: ...

    def start_backup(self, node: NodeId, *, evicting: bool) -> bool | Wait: ...


class Loads(Protocol):
    def oldest(self) -> OpId | None: ...


class Space:
    def __init__(self, ctx: Context) -> None:
        cfg = ctx.cfg
        self._ctx = ctx
        # The ledgers of record, one per tier. L2 holds only what the allocator has leased.
        self.ledgers = {
            "device": SlotLedger(size=cfg.device_tokens, page_size=cfg.page_size, tier="device"),
            "host": SlotLedger(
                size=cfg.host_capacity, page_size=cfg.page_size, tier="host", leased=0
            ),
        }
        self.writes: Writes | None = None  # set once the write flows exist (they use this)
        self.loads: Loads | None = None  # likewise the load flows

    def lease_host(self, start: int, stop: int) -> None:
        """Host slots [start, stop), prepared by the allocator, join L2 (LedgerError for a
        range that is misaligned or leased already)."""
        self.ledgers["host"].lease(start, stop)

    def alloc(self, tier: str, n: int) -> np.ndarray | None:
        slots = self.ledgers[tier].alloc(n)
        if slots is not None and len(slots) and self._ctx.detail:  # for `hicache check-log`
            self._ctx.out.info("tree.slots", tier=tier, op="alloc", slots=slots)
        return slots

    def free(self, tier: str, slots: np.ndarray) -> None:
        if len(slots):
            self.ledgers[tier].free(slots)
            if self._ctx.detail:
                self._ctx.out.info("tree.slots", tier=tier, op="free", slots=slots)

    def view(self) -> dict[str, dict[str, int]]:
        """Each tier's size, used and available tokens."""
        return {
            tier: {"size": led.size, "used": led.used, "available": led.available}
            for tier, led in self.ledgers.items()
        }

    def stats(self, inflight: dict[str, int]) -> CacheStats:
        tree, c = self._ctx.tree, self._ctx.counters
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
            inflight=inflight,
        )

    def device(self, n: int) -> np.ndarray | Wait | None:
        """Device slots for n tokens, evicting L1 (backing up first where the policy says so)."""
        if n == 0:
            return EMPTY_SLOTS
        writes = self.writes
        assert writes is not None
        while True:
            slots = self.alloc("device", n)
            if slots is not None:
                return slots
            # Evict what is missing, less what eviction backups in flight will free: asking for
            # all of n each time round would back up (and keep in both tiers) more leaves.
            short = n - self.ledgers["device"].available - writes.evicting_tokens()
            if short > 0:
                freed = self._evict_device(short)
                if freed is True:
                    continue
                if isinstance(freed, Wait):
                    return freed
            oldest = writes.oldest_write()
            if oldest is not None:
                return Wait("write", oldest)
            # A load in flight locks the pages it fills until it ends: wait for it, rather
            # than call L1 full while they are about to become evictable.
            load = self.loads.oldest() if self.loads is not None else None
            return None if load is None else Wait("load", load)

    def _evict_device(self, n: int) -> bool | Wait:
        """Evict about n tokens from L1 and start the backups the policy wants first. True when
        a device slot was freed; else the first wait met (no write credit, no host room)."""
        ctx, tree, writes = self._ctx, self._ctx.tree, self.writes
        assert writes is not None
        exclusive = ctx.cfg.exclusive
        # With L3 attached a page leaves L1 through L2 (and so reaches L3), whatever the policy.
        back_up = ctx.storage_on and ctx.cfg.evict_to_storage
        ev = tree.evict_device(n, now=ctx.now, require_host_copy=exclusive, back_up=back_up)
        self.free("device", ev.freed)
        self.free("host", ev.freed_host)
        freed = len(ev.freed)
        if freed:
            ctx.counters.device_evictions += freed
            ctx.out.info(
                "tree.evict_device", tokens=freed, demoted=len(ev.demoted), removed=len(ev.removed)
            )
        wait: Wait | None = None
        for node in ev.needs_backup:  # write_back, exclusive, L3 on: copy to L2, then evict
            if exclusive and not tree.outranks_host(node, now=ctx.now):
                # Older than everything L2 could give up: drop it rather than displace hotter
                # pages, so the two tiers together evict like one LRU of their total size.
                freed += self._discard(node, "older_than_l2")
            elif wait is None:
                started = writes.start_backup(node, evicting=True)
                if isinstance(started, Wait):
                    wait = started  # the rest stay on L1, found again by the next eviction
                elif not started and back_up and tree.needs_backup(node):
                    # No L2 room for its copy (what L2 holds is on L1 too, or in use): with
                    # L3 attached it leaves L1 as without L3, rather than fail the allocation.
                    freed += self._discard(node, "no_l2_room")
        if freed:
            return True
        return wait if wait is not None else False

    def _discard(self, node: NodeId, reason: str) -> int:
        """Drop a device leaf without a copy (and what hangs below it); tokens freed."""
        ctx = self._ctx
        gone = ctx.tree.discard_device(node)
        self.free("device", gone.freed)
        self.free("host", gone.freed_host)
        ctx.counters.device_evictions += len(gone.freed)
        ctx.out.info(
            "tree.evict_device",
            tokens=len(gone.freed),
            demoted=0,
            removed=len(gone.removed),
            reason=reason,
        )
        return len(gone.freed)

    def host(self, n: int) -> np.ndarray | Wait | None:
        """Host slots for n tokens, evicting L2."""
        ctx = self._ctx
        while True:
            slots = self.alloc("host", n)
            if slots is not None:
                return slots
            ev = ctx.tree.evict_host(
                n - self.ledgers["host"].available,  # the shortfall
                now=ctx.now,
                by_pages=ctx.cfg.exclusive,
            )
            if len(ev.freed):
                ctx.counters.host_evictions += len(ev.freed)
                ctx.out.info("tree.evict_host", tokens=len(ev.freed), removed=len(ev.removed))
                self.free("host", ev.freed)
                continue
            # An upload pins the candidates: wait for it, never for one past its deadline.
            assert self.writes is not None
            upload = self.writes.oldest_live_upload()
            return None if upload is None else Wait("upload", upload)
