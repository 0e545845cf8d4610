"""What the facade hands back to a serving loop: small frozen values and typed errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.types import RequestId

if TYPE_CHECKING:
    from hicache.kernels.streams.base import LoadHandle


class CacheError(Exception):
    """Base of every error the cache raises to its caller."""


class CapacityError(CacheError):
    """Not enough device or host slots even after evicting everything that may be evicted:
    what is left is locked by running requests or protected by in-flight transfers."""

    def __init__(
        self, tier: str, wanted: int, available: int, rid: RequestId | None = None
    ) -> None:
        who = f" for request {rid!r}" if rid is not None else ""
        super().__init__(
            f"{tier} capacity{who}: wanted {wanted} tokens, {available} free after eviction "
            "(the rest is locked by running requests or in flight)"
        )
        self.tier, self.wanted, self.available, self.rid = tier, wanted, available, rid


class PinLimitError(CapacityError):
    """`pin` would pin more tokens of a tier than its cap (`max_pinned_device_tokens`,
    `max_pinned_host_tokens`); nothing was pinned."""

    def __init__(self, tier: str, added: int, total: int, cap: int) -> None:
        CacheError.__init__(
            self,
            f"pin: {tier} would hold {total} pinned tokens ({added} more), over its cap of "
            f"{cap} (max_pinned_{tier}_tokens)",
        )
        self.tier, self.wanted, self.rid = tier, added, None
        self.available = max(0, cap - (total - added))
        self.cap = cap


class UnknownRequest(CacheError):
    def __init__(self, rid: RequestId, action: str) -> None:
        super().__init__(f"request {rid!r} is unknown to the cache ({action}); match it first")
        self.rid = rid


class InvalidRequest(CacheError, ValueError):
    """A call's arguments are wrong (bad tokens or slots, tokens that differ from the matched
    ones, a duplicate or unhashable request id, a negative size). Detected before anything
    changed: the call had no effect, the cache keeps serving."""


class StorageTimeout(CacheError, TimeoutError):
    """A storage call the caller waits on (`clear_storage`) passed `storage_timeout`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchOutcome:
    """The prefix the cache holds for a request. `device_slots` index the device pool for the
    L1-resident prefix; `host_len` more tokens exist in L2 only (load them with load_back).
    The matched path stays locked (never evicted) until the request is cached or released.
    `pending` lists loads still landing on this prefix: wait on them before reading the KV."""

    rid: RequestId
    device_slots: np.ndarray
    host_len: int
    pending: tuple[LoadHandle, ...] = ()

    @property
    def device_len(self) -> int:
        return len(self.device_slots)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBackOutcome:
    """The request's full cached prefix in device slots, and the handle to wait on per layer
    before attention reads layer i (None when nothing is landing). The prefix is taken from
    the tree at load_back, so it may be longer than the match said (others loaded or cached
    more of it meanwhile); the handle then also covers their loads still landing on it."""

    rid: RequestId
    device_slots: np.ndarray
    loaded_tokens: int
    handle: LoadHandle | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOutcome:
    """After caching a request (or a chunk): the device slots now backing its prefix (the
    tree's own slots; duplicates the caller passed were freed) and how many tokens were new.
    After `cache_unfinished`, `pending` lists loads still landing on that prefix (the tree
    already held some of the chunk's tokens, being loaded): wait on them before reading."""

    rid: RequestId
    device_slots: np.ndarray
    new_tokens: int
    pending: tuple[LoadHandle, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchOutcome:
    """Where a request's L3 prefetch stands. `state`: none (never started), skipped (an
    admission check said no; see `reason`), running, done (what arrived is in the tree as
    L2-only pages) or revoked (too few pages were in storage to be worth it)."""

    rid: RequestId
    state: str
    reason: str | None = None
    hit_tokens: int = 0
    done_tokens: int = 0
    wanted_tokens: int = 0

    @property
    def ready(self) -> bool:
        return self.state != "running"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearOutcome:
    """What `clear` dropped: the tokens of unlocked pages in L1 and in L2 (pages locked by
    running requests stay theirs), and whether the L3 namespace was cleared."""

    device_tokens: int = 0
    host_tokens: int = 0
    storage: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    size: int  # slots (tokens) usable now (L2: leased so far by the allocator)
    used: int  # slots held: by the tree, by running requests, by transfers in flight
    cached_tokens: int  # tokens the tree holds in this tier
    evictable_tokens: int  # of those, what eviction could free now (unlocked, unprotected)
    evictions: int  # tokens evicted so far
    hit_tokens: int  # tokens served from this tier so far


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    device: TierStats
    host: TierStats
    storage_hit_tokens: int = 0
    bytes: dict[str, int] = field(default_factory=dict)  # "d2h", "h2d": bytes moved so far
    # pages meant for L3 that did not get there, by reason: store_full, failed, timed_out,
    # backlog_full, evicted (before its upload started), detached, l2_held_by_uploads
    storage_dropped: dict[str, int] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)  # ops and requests in flight, by kind


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep a request's tokens [start, end) (end None: to its end) at `priority` for
    `duration` seconds of the cache's clock (None: as long as they stay cached). Priorities
    run from 0 to 100; pages outside every range have the configured `default_priority`
    (35). Eviction in L1 and L2 takes the lowest priority first, then the eviction strategy's
    order; a page partly inside a range counts as inside. Given at `match`, applied to the
    request's pages then and whenever it caches more."""

    start: int
    end: int | None
    priority: int
    duration: float | None = None


@dataclass(frozen=True, slots=True)
class PinOutcome:
    """What `pin` pinned: its prefix's whole-page tokens, how many of them are cached now (the
    rest are pinned as they arrive), and when the pin ends (cache clock; None: at `unpin`)."""

    tokens: int
    cached_tokens: int
    until: float | None
