"""Shared pieces of the L3 tests: configs, a writer run, a verified prefetch + load-back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache import HiCache
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.results import LoadBackOutcome, PrefetchOutcome
from hicache.testing import (
    BackendFaults,
    FaultyBackend,
    ScriptedScheduler,
    bad_pages,
    kv_seeds,
    synthetic_compute,
    virtual_config,
)

PAGE = 4


def config(**overrides):
    """Small, deterministic, write-through (so every insert reaches L2 and then L3), with a
    prefetch threshold of two pages, under its own model id (storage needs one)."""
    base = dict(write_policy="write_through", prefetch_threshold=2 * PAGE, model_id="test-model")
    base.update(overrides)
    return virtual_config(**base)


def namespace_of(cfg) -> Namespace:
    """The namespace a cache with this config builds (the same fields, the resolved layout)."""
    resolved, _ = cfg.resolve()
    return Namespace(
        model=resolved.model_id,
        kv=resolved.kv,
        page_size=resolved.page_size,
        tenant=resolved.tenant,
        rank=resolved.tp_rank,
        tp_size=resolved.tp_size,
        layout=resolved.layout,
    )


def slow_memory(cfg, store: MemoryStore, **faults) -> FaultyBackend:
    """A memory backend over `store` in `cfg`'s namespace, behind injected faults."""
    return FaultyBackend(
        MemoryBackend(namespace=namespace_of(cfg), store=store), BackendFaults(**faults)
    )


def seeds_for(tokens: np.ndarray) -> np.ndarray:
    return kv_seeds(tokens, PAGE)


compute_into = synthetic_compute


async def write(cache: HiCache, rid: str, tokens: np.ndarray) -> None:
    """Compute a request's KV, cache it, and wait until its pages reached L2 and L3."""
    await ScriptedScheduler(cache, compute=compute_into(cache), wait_prefetch=False).run(
        [[(rid, tokens)]]
    )
    await cache.flush()


@dataclass(frozen=True)
class Fetched:
    prefetch: PrefetchOutcome
    load: LoadBackOutcome
    device_hit: int
    bad: int  # pages of the request's device prefix that do not hold their KV


async def fetch(cache: HiCache, rid: str, tokens: np.ndarray, *, queued: float = 0.0) -> Fetched:
    """Match, prefetch from L3, wait `queued` virtual seconds (the request's time in the
    scheduler's queue), wait by the policy, load back into L1 and check every page of the
    prefix the request would read; then release the request."""
    m = await cache.match(rid, tokens)
    await cache.prefetch(rid, tokens)
    if queued:
        await cache.system.sleep(queued)
    out = await cache.prefetch_wait(rid)
    lb = await cache.load_back(rid)
    if lb.handle is not None:
        await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
    bad = bad_pages(cache.device_pool, lb.device_slots, seeds_for(tokens), page_size=PAGE, first=0)
    await cache.release(rid)
    return Fetched(prefetch=out, load=lb, device_hit=m.device_len, bad=bad)


def tokens_from(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)
