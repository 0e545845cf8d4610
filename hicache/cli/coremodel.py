"""`hicache sweep`'s replay: a trace through the cache's control plane, with no bytes, no
actors and no time.

`replay_trace` runs a trace through an `InstantCache` (`hicache/testing/instant.py`: the tree
actor's controller driven synchronously, its workers instant) in the scheduler steps
`hicache replay` uses (`hicache/cli/replay/command.py`), making the same calls, with the same
fallback on `CapacityError`, and tallies what the replay's summary reports. Every completion a
worker would report is applied before the next frontend call; docs/benchmarks.md ("Sizing sweep")
says where that gives the replay's numbers exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.cli.trace import TraceRequest, scheduler_steps
from hicache.config import CacheConfig
from hicache.messages import (
    AllocBatch,
    CacheBatch,
    CacheItem,
    Flush,
    GetStats,
    LoadBackBatch,
    MatchBatch,
    MatchItem,
    PrefetchBatch,
    PrefetchWait,
    ReleaseBatch,
)
from hicache.policies.storage import DEFAULT_STORE_POLICY
from hicache.results import CacheStats, CapacityError
from hicache.testing.instant import InstantCache
from hicache.types import RequestId


@dataclass(slots=True)
class Tally:
    """What `hicache replay` reports, in tokens (its summary's fields)."""

    requests: int = 0
    input_tokens: int = 0
    device_hit: int = 0  # L1 tokens of the matches of the steps that completed
    host_hit: int = 0  # tokens loaded back from L2 (prefetched ones included)
    storage_hit: int = 0  # tokens read from L3 into L2
    rejected: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    d2h_tokens: int = 0
    h2d_tokens: int = 0
    storage_bytes: int = 0  # framed bytes L3 holds at the end
    storage_pages: int = 0  # pages L3 holds at the end
    storage_evictions: int = 0  # pages L3 gave up to stay within its cap
    storage_refused: int = 0  # page writes L3's policy did not admit

    def summary(self) -> dict[str, Any]:
        tokens = self.input_tokens or 1
        hits = {
            "device": self.device_hit,
            "host": self.host_hit - self.storage_hit,
            "storage": self.storage_hit,
        }
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "hit_tokens": hits,
            "hit_rate": (self.device_hit + self.host_hit) / tokens,
            "evictions": {"device": self.device_evictions, "host": self.host_evictions},
            "rejected_requests": self.rejected,
            "transfer_tokens": {"d2h": self.d2h_tokens, "h2d": self.h2d_tokens},
            "storage": {
                "bytes": self.storage_bytes,
                "pages": self.storage_pages,
                "evictions": self.storage_evictions,
                "refused": self.storage_refused,
            },
        }


TokensOf = Callable[[TraceRequest], np.ndarray]


def _run_step(
    model: InstantCache, step: list[TraceRequest], tally: Tally, tokens_of: TokensOf
) -> None:
    """One scheduler step, the calls `hicache.cli.replay._run_step` makes."""
    toks = {RequestId(f"r{r.index}"): tokens_of(r) for r in step}
    items = tuple(MatchItem(rid=rid, tokens=t) for rid, t in toks.items())
    matches = model.call(lambda r: MatchBatch(items=items, reply=r))
    if model.storage:
        model.call(lambda r: PrefetchBatch(items=items, reply=r))
        for rid in toks:
            model.call(_prefetch_wait(rid))
    loads = model.call(lambda r: LoadBackBatch(rids=tuple(toks), reply=r))
    sizes = tuple((lb.rid, len(toks[lb.rid]) - len(lb.device_slots)) for lb in loads)
    news = model.call(lambda r: AllocBatch(sizes=sizes, reply=r))
    cached = tuple(
        CacheItem(
            rid=lb.rid,
            tokens=toks[lb.rid],
            device_slots=np.concatenate([lb.device_slots, new]),
            finished=True,
        )
        for lb, new in zip(loads, news, strict=True)
    )
    model.call(lambda r: CacheBatch(items=cached, reply=r))
    tally.device_hit += sum(len(m.device_slots) for m in matches)
    tally.requests += len(step)
    tally.input_tokens += sum(len(t) for t in toks.values())


def _prefetch_wait(rid: RequestId) -> Callable[[Any], PrefetchWait]:
    return lambda r: PrefetchWait(rid=rid, reply=r)


def _release(model: InstantCache, rids: list[RequestId]) -> None:
    model.call(lambda r: ReleaseBatch(rids=tuple(rids), reply=r))


def replay_trace(
    config: CacheConfig,
    requests: list[TraceRequest],
    *,
    storage: bool,
    storage_capacity: int | None = None,
    store_policy: str = DEFAULT_STORE_POLICY,
    block_tokens: int = 512,
    batch: int = 8,
    progress: Callable[[int], object] | None = None,
    tokens_of: TokensOf | None = None,
) -> Tally:
    """The whole trace through a `InstantCache`, in the replay's scheduler steps. L3 (with
    `storage`) is capped at `storage_capacity` framed bytes (None: unbounded) and runs
    `store_policy`. `tokens_of` (request -> uint32 tokens) may be shared by the runs of one
    sweep."""
    model = InstantCache(
        config, storage=storage, storage_capacity=storage_capacity, store_policy=store_policy
    )
    tally = Tally()
    if tokens_of is None:

        def tokens_of(r: TraceRequest) -> np.ndarray:
            return r.tokens(block_tokens).astype(np.uint32)

    for step in scheduler_steps(requests, batch, budget=model.cfg.device_tokens // 2):
        try:
            _run_step(model, step, tally, tokens_of)
        except CapacityError:
            # Too much at once for L1: drop the step's state and run it one by one.
            _release(model, [RequestId(f"r{r.index}") for r in step])
            for req in step:
                try:
                    _run_step(model, [req], tally, tokens_of)
                except CapacityError:
                    _release(model, [RequestId(f"r{req.index}")])
                    tally.rejected += 1
                    tally.requests += 1
                    tally.input_tokens += req.input_length
        if progress is not None:
            progress(tally.requests)
    model.call(lambda r: Flush(reply=r))  # the replay's flush and stats
    stats: CacheStats = model.call(lambda r: GetStats(reply=r))
    counters = model.controller.counters
    tally.host_hit, tally.storage_hit = stats.host.hit_tokens, stats.storage_hit_tokens
    tally.device_evictions, tally.host_evictions = stats.device.evictions, stats.host.evictions
    tally.d2h_tokens, tally.h2d_tokens = counters.d2h_bytes, counters.h2d_bytes
    l3 = model.stored
    tally.storage_bytes, tally.storage_pages = l3.held_bytes, len(l3)
    tally.storage_evictions, tally.storage_refused = l3.evictions, l3.refused
    ledgers, tables = model.drain()
    leaked = {tier: led["used"] for tier, led in ledgers.items() if led["used"]}
    left = {name: n for name, n in tables.items() if n}
    if leaked or left:
        raise AssertionError(f"core model leaked slots {leaked} or table entries {left}")
    return tally
