"""The tier owner: the radix tree and the two slot ledgers, one per tier (L1 whole from the
start; L2 as the allocator leases it, chunk by chunk while it prepares the host pool). Every
change to the tree goes through here, so that the slots a change frees go back to their ledger
in the same call: insertion, locks and host protection, the copies of a backup or a load,
eviction (L1 then L2), pin marks and `clear`.

Eviction returns what it could not do alone as data: the L1 nodes that need an L2 copy before
they may leave. The allocator (`allocation.py`) has their backups started and turns "nothing
to evict now" into a wait for an op in flight; nothing here knows of ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.components.controller.ledger import SlotLedger
from hicache.components.controller.shared import Shared, Step
from hicache.radix.results import InsertResult, LoadPlan, MatchResult, concat
from hicache.radix.structure import INF
from hicache.radix.tree import Range
from hicache.results import CacheStats, TierStats
from hicache.types import NodeId, PageHash

TIERS = ("device", "host", "storage")  # what `clear` may name


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    """An L1 allocation: its slots, or what its eviction did, as the controller sees it (the
    tree's own record, `radix.results.DeviceEviction`, also names the slots)."""

    slots: np.ndarray | None = None  # given: there was room
    freed: int = 0  # device tokens freed
    needs_backup: tuple[NodeId, ...] = ()  # left on L1 until copied to L2 (the caller's to start)


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

    def free_parts(self, step: Step, tier: str, parts: tuple[np.ndarray, ...]) -> None:
        """`free` of an eviction's victims, one array per node, without joining them."""
        if step.out.detail:
            self.free(step, tier, concat(list(parts)))
        elif parts:
            self.ledgers[tier].free_parts(parts)

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

    def device(self, step: Step, n: int, *, landing: int, back_up: bool) -> DeviceRoom:
        """Device slots for n tokens; without room, evict what is missing less `landing` (the
        tokens eviction backups in flight free once they land: asking for all of n each time
        round would back up, and keep in both tiers, more leaves)."""
        slots = self.alloc(step, "device", n)
        if slots is not None:
            return DeviceRoom(slots)
        short = n - self.ledgers["device"].available - landing
        if short <= 0:
            return DeviceRoom()
        return self.evict_device(step, short, back_up=back_up)

    def evict_device(self, step: Step, n: int, *, back_up: bool) -> DeviceRoom:
        """Evict about n tokens from L1. The nodes the policy wants copied to L2 first
        (write_back, exclusive, `back_up`: L3 on) stay on L1 and are returned: the caller
        starts their backups (or drops them, `discard`)."""
        shared, tree = self._shared, self._shared.tree
        ev = tree.evict_device(
            n, now=step.now, require_host_copy=shared.cfg.exclusive, back_up=back_up
        )
        self.free_parts(step, "device", ev.freed_parts)
        self.free(step, "host", ev.freed_host)
        freed = ev.freed_tokens
        if freed:
            shared.counters.device_evictions += freed
            step.out.info(
                "tree.evict_device", tokens=freed, demoted=len(ev.demoted), removed=len(ev.removed)
            )
        return DeviceRoom(None, freed, tuple(ev.needs_backup))

    def discard(self, step: Step, node: NodeId, reason: str) -> int:
        """Drop a device leaf without a copy (and what hangs below it); tokens freed."""
        shared = self._shared
        gone = shared.tree.discard_device(node)
        self.free_parts(step, "device", gone.freed_parts)
        self.free(step, "host", gone.freed_host)
        shared.counters.device_evictions += gone.freed_tokens
        step.out.info(
            "tree.evict_device",
            tokens=gone.freed_tokens,
            demoted=0,
            removed=len(gone.removed),
            reason=reason,
        )
        return gone.freed_tokens

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
            if not ev.freed_tokens:
                return None
            shared.counters.host_evictions += ev.freed_tokens
            step.out.info("tree.evict_host", tokens=ev.freed_tokens, removed=len(ev.removed))
            self.free_parts(step, "host", ev.freed_parts)

    # ------------------------------------------------------------------ requests
    def match(self, step: Step, tokens: Any, salt: bytes) -> MatchResult:
        """The cached prefix of `tokens` (stamped as used now)."""
        return self._shared.tree.match(tokens, now=step.now, salt=salt)

    def relock(self, new: NodeId | None, old: NodeId | None) -> None:
        """Move a holder's lock from `old` to `new` (either may be None)."""
        tree = self._shared.tree
        if new is not None:
            tree.lock(new)
        if old is not None:
            tree.unlock(old)

    def retain(self, step: Step, tokens: Any, ranges: tuple[Range, ...], salt: bytes) -> None:
        self._shared.tree.retain(tokens, ranges, now=step.now, salt=salt)

    def insert(
        self,
        step: Step,
        tokens: Any,
        slots: np.ndarray,
        *,
        chunked: bool,
        salt: bytes,
        backup: bool,
    ) -> InsertResult:
        return self._shared.tree.insert(
            tokens, slots, now=step.now, chunked=chunked, salt=salt, backup=backup
        )

    # ------------------------------------------------------------------ pins
    def mark_pins(
        self, step: Step, tokens: Any, *, device_until: float, host_until: float, salt: bytes
    ) -> int:
        return self._shared.tree.mark_pins(
            tokens, device_until=device_until, host_until=host_until, now=step.now, salt=salt
        )

    def unmark_pins(self, step: Step, tokens: Any, salt: bytes) -> None:
        self._shared.tree.unmark_pins(tokens, now=step.now, salt=salt)

    # ------------------------------------------------------------------ copies
    def protect_host(self, node: NodeId, *, copy_complete: bool = True) -> None:
        """Keep node..root in the tree with their L2 copies while a transfer uses them."""
        self._shared.tree.protect_host(node, copy_complete=copy_complete)

    def release_host(self, node: NodeId) -> None:
        self._shared.tree.release_host(node)

    def start_backup(self, node: NodeId, host: np.ndarray) -> None:
        self._shared.tree.begin_backup(node, host)

    def finish_backup(self, step: Step, node: NodeId, *, ok: bool) -> None:
        """A backup ended: on failure its host slots go back."""
        self.free(step, "host", self._shared.tree.end_backup(node, ok=ok))

    def set_page_hashes(self, node: NodeId, hashes: tuple[PageHash, ...]) -> None:
        self._shared.tree.set_page_hashes(node, hashes)

    def start_load_back(self, plan: LoadPlan, device_slots: np.ndarray) -> None:
        """The plan's nodes take their device slots; the deepest is locked until it lands."""
        tree = self._shared.tree
        tree.commit_load_back(plan, device_slots)
        tree.lock(plan.nodes[-1])

    def finish_load_back(
        self, step: Step, lock: NodeId, filled: LoadPlan, *, ok: bool
    ) -> tuple[int, tuple[NodeId, ...]]:
        """A load ended: its lock goes; on failure its nodes go back to L2 only (the device
        tokens freed and the nodes that kept them are returned); in exclusive mode, on success,
        they leave L2."""
        tree = self._shared.tree
        tree.unlock(lock)
        if not ok:
            freed, kept = tree.revert_load_back(filled)
            self.free(step, "device", freed)
            return len(freed), kept
        if self._shared.cfg.exclusive:
            self.free(step, "host", tree.drop_host(filled))
        return 0, ()

    def insert_host(
        self,
        step: Step,
        anchor: NodeId,
        tokens: Any,
        host_slots: np.ndarray,
        hashes: tuple[PageHash, ...],
        salt: bytes,
    ) -> None:
        """Hang prefetched pages below `anchor`; slots of pages already there go back."""
        inserted = self._shared.tree.insert_host(
            anchor, tokens, host_slots, hashes, now=step.now, salt=salt
        )
        self.free(step, "host", inserted.duplicate_slots)

    # ------------------------------------------------------------------ clear and drain
    def clear_device(self, step: Step) -> int:
        """Every unlocked L1 page: demoted where it has an L2 copy, else removed; pages the
        write policy would back up first are dropped without a copy. Tokens freed. Run once
        nothing is in flight, so no op still uses a page it drops; pins do not hold (eviction
        runs as if at the end of time)."""
        tree, dropped = self._shared.tree, 0
        while tree.evictable_device_tokens():
            ev = tree.evict_device(tree.evictable_device_tokens(), now=INF)
            self.free_parts(step, "device", ev.freed_parts)
            self.free(step, "host", ev.freed_host)
            freed = ev.freed_tokens
            for node in ev.needs_backup:  # write_back: no copy wanted, the caller asked to drop
                gone = tree.discard_device(node)
                self.free_parts(step, "device", gone.freed_parts)
                self.free(step, "host", gone.freed_host)
                freed += gone.freed_tokens
            if not freed:
                break  # what is left is protected (a backup or upload would still read it)
            dropped += freed
        return dropped

    def clear_host(self, step: Step) -> int:
        """Every unlocked, unprotected page's L2 copy (pages also on L1 stay there). Tokens
        freed."""
        tree = self._shared.tree
        copies = tree.drop_host_copies()
        self.free(step, "host", copies)
        dropped = len(copies)
        while tree.evictable_host_tokens():
            ev = tree.evict_host(tree.evictable_host_tokens(), now=INF)
            if not ev.freed_tokens:
                break
            self.free_parts(step, "host", ev.freed_parts)
            dropped += ev.freed_tokens
        return dropped

    def drain(self, step: Step) -> None:
        """At close, every request released: every node but the root leaves, its slots back."""
        freed = self._shared.tree.clear()
        self.free(step, "device", freed.device)
        self.free(step, "host", freed.host)
