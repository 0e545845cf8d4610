"""What the parts of the controller share: the configuration, the radix tree, the counters and
the op ids (`Shared`, for the controller's life); and the time and the effects of the step
being taken (`Step`, made for each call and passed down)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.components.controller.effects import Effects
from hicache.config import CacheConfig
from hicache.radix.tree import RadixTree
from hicache.types import OpId


@dataclass(slots=True)
class Counters:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    skipped_uploads: int = 0  # nodes not uploaded: the upload backlog was full, or detached
    evict_backups: int = 0  # backups an L1 eviction waited for (write_back, exclusive, L3 on)
    anchor_backups: int = 0  # nodes backed up for a prefetch anchor that had no L2 copy
    upload_timeouts: int = 0
    abandoned_ops: int = 0  # ended at close past its deadline
    # pages meant for L3 that did not get there, by reason (tree.storage_dropped events)
    storage_dropped: dict[str, int] = field(default_factory=dict)

    def dropped(self, step: Step, reason: str, pages: int) -> None:
        """Count pages that will not reach L3 (never silent: an event and the counter)."""
        if pages > 0:
            self.storage_dropped[reason] = self.storage_dropped.get(reason, 0) + pages
            step.out.info("tree.storage_dropped", reason=reason, pages=pages)


@dataclass(slots=True)
class Shared:
    cfg: CacheConfig
    tree: RadixTree
    bytes_per_token: int
    counters: Counters = field(default_factory=Counters)
    last_op: int = 0

    def op(self) -> OpId:
        self.last_op += 1
        return OpId(self.last_op)


@dataclass(frozen=True, slots=True)
class Step:
    """One controller step: its time (given by the driver) and the effects it returns."""

    now: float
    out: Effects
