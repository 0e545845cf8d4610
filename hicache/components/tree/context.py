"""What every part of the controller shares: the configuration, the radix tree, the effects of
the step being taken, its time, the counters and the op ids. One object, passed to each part,
so that each part still owns its own tables alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hicache.components.tree.effects import Effects
from hicache.components.tree.records import Counters
from hicache.config import CacheConfig
from hicache.radix.tree import RadixTree
from hicache.types import OpId


@dataclass(slots=True)
class Context:
    cfg: CacheConfig
    tree: RadixTree
    bytes_per_token: int
    storage_on: bool
    out: Effects = field(default_factory=Effects)
    counters: Counters = field(default_factory=Counters)
    now: float = 0.0  # the step's time: given by the driver with each call
    detail: bool = False  # build detail events (`tree.slots`): the driver's log records
    last_op: int = 0

    def op(self) -> OpId:
        self.last_op += 1
        return OpId(self.last_op)


@dataclass(frozen=True, slots=True)
class Wait:
    """An allocation that can go on only once this op has ended (its backup frees device
    slots, its upload unprotects host pages, its load unlocks the pages it filled): the
    caller parks, and is retried then."""

    kind: Literal["write", "upload", "load"]
    op: OpId
