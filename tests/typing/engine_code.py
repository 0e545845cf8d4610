"""Code an engine author writes against hicache's public API.
`tests/unit/test_public_api_types.py` type-checks it strictly: every line must pass, so the
annotations say what the API really takes and gives."""

from __future__ import annotations

import numpy as np

from hicache import (
    CacheConfig,
    CacheStats,
    HiCache,
    LoadBackOutcome,
    MatchOutcome,
    PrefetchOutcome,
    TierStats,
)
from hicache.kernels.streams import LoadHandle
from hicache.testing import ScriptedScheduler, virtual_config
from hicache.types import RequestId


async def serve_one(rid: RequestId, tokens: np.ndarray) -> int:
    """The README's embedding example, step by step."""
    config = CacheConfig(
        kv="mha:2:1:8:float32", page_size=4, device_tokens=64, host_tokens=256, storage="memory"
    )
    async with HiCache(config) as cache:
        m = await cache.match(rid, tokens)
        for pending in m.pending:  # loads still landing on the matched prefix
            pending.wait(0)
        await cache.prefetch(rid, tokens)
        outcome: PrefetchOutcome = await cache.prefetch_wait(rid)
        lb = await cache.load_back(rid)
        if lb.handle is not None:  # wait per layer before attention reads it
            lb.handle.wait(0)
            await lb.handle.wait_async(0)
        new = await cache.allocate(rid, len(tokens) - len(lb.device_slots))
        done = await cache.cache_finished(rid, tokens, np.concatenate([lb.device_slots, new]))
        stats: CacheStats = await cache.stats()
        if cache.backend is not None:  # storage is on
            stored = cache.backend.stats()
            assert stored is not None
        return done.new_tokens + stats.device.used + outcome.done_tokens


def fake_results(rid: RequestId) -> tuple[MatchOutcome, LoadBackOutcome, CacheStats]:
    """An engine's own tests build results to drive its scheduler without a cache."""
    slots = np.arange(4, dtype=np.int64)
    tier = TierStats(
        size=64, used=4, cached_tokens=4, evictable_tokens=0, evictions=0, hit_tokens=0
    )
    handle: LoadHandle | None = None
    return (
        MatchOutcome(rid=rid, device_slots=slots, host_len=0),
        LoadBackOutcome(rid=rid, device_slots=slots, loaded_tokens=0, handle=handle),
        CacheStats(device=tier, host=tier),
    )


async def scripted(cache: HiCache) -> int:
    """The test kit's scheduler over numpy token arrays."""
    scheduler = ScriptedScheduler(cache)
    records = await scheduler.run([[("a", np.arange(8, dtype=np.int64))], [("b", [1, 2, 3])]])
    return len(records) + virtual_config(page_size=4).page_size
