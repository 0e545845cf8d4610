"""`clear(tiers)`: drop every unlocked page of L1 and/or L2 (locked pages stay with their
requests). Run by the controller once nothing is in flight, so no backup, load, upload or
prefetch still uses a page it drops. Pins do not hold against a clear (eviction runs as if at
the end of time): pinned pages leave too, and come back pinned when cached or prefetched again."""

from __future__ import annotations

from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.tiers import Tiers
from hicache.radix.structure import INF

TIERS = ("device", "host", "storage")


def drop_device(step: Step, shared: Shared, tiers: Tiers) -> int:
    """Every unlocked L1 page: demoted where it has an L2 copy, else removed; pages the write
    policy would back up first are dropped without a copy. Tokens freed."""
    tree, dropped = shared.tree, 0
    while tree.evictable_device_tokens():
        ev = tree.evict_device(tree.evictable_device_tokens(), now=INF)
        tiers.free(step, "device", ev.freed)
        tiers.free(step, "host", ev.freed_host)
        freed = len(ev.freed)
        for node in ev.needs_backup:  # write_back: no copy wanted, the caller asked to drop
            gone = tree.discard_device(node)
            tiers.free(step, "device", gone.freed)
            tiers.free(step, "host", gone.freed_host)
            freed += len(gone.freed)
        if not freed:
            break  # what is left is protected (a backup or upload would still read it)
        dropped += freed
    return dropped


def drop_host(step: Step, shared: Shared, tiers: Tiers) -> int:
    """Every unlocked, unprotected page's L2 copy (pages also on L1 stay there). Tokens freed."""
    tree = shared.tree
    copies = tree.drop_host_copies()
    tiers.free(step, "host", copies)
    dropped = len(copies)
    while tree.evictable_host_tokens():
        ev = tree.evict_host(tree.evictable_host_tokens(), now=INF)
        if not len(ev.freed):
            break
        tiers.free(step, "host", ev.freed)
        dropped += len(ev.freed)
    return dropped
