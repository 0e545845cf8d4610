"""Two cache instances in two processes sharing one Mooncake Store (a master and a separate
storage process on loopback): the second hits, byte-exact, what the first wrote; another
tenant salt misses. Production mode on asyncio; skipped where `mooncake` is not importable."""

from __future__ import annotations

import anyio
import pytest

from hicache import HiCache
from tests.integration.cache_writer_process import write_in_child
from tests.integration.storage_helpers import config, fetch, tokens_from

pytestmark = [pytest.mark.mooncake, pytest.mark.anyio]

TOKENS = tokens_from(0, 64)  # 16 pages of 4 tokens
BOUND_S = 60  # hang guard, not a timing assertion


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def read_in_this_process(spec: str, **overrides):
    cfg = config(storage=spec, deterministic=False, prefetch_policy="wait_complete", **overrides)
    with anyio.fail_after(BOUND_S):
        async with HiCache(cfg) as cache:
            got = await fetch(cache, "reader", TOKENS)
            backend = dict(cache.backend.stats(), header_room=cache.host_pool.header_room)
            return got, await cache.stats(), backend


# The test's own small KV (pages without header room: values move as [header slot, page]) and
# one with 128 KiB page_first pages (2 KiB of header room each: values move as one piece).
@pytest.mark.parametrize("kv, room", [(None, 0), ("mha:8:8:128:float16", 2048)])
async def test_second_process_cache_hits_what_the_first_wrote(store, kv, room) -> None:
    kv = kv or config().kv
    tenant = f"mc-shared-{room}"
    wrote = write_in_child(store.spec, tenant=tenant, kv=kv, start=0, count=64)
    assert wrote["backend"]["set_pages"] == 16 and wrote["backend"]["staged_pages"] == 0

    got, stats, backend = await read_in_this_process(store.spec, tenant=tenant, kv=kv)
    assert backend["header_room"] == room
    assert got.device_hit == 0  # nothing local ...
    assert got.prefetch.done_tokens == 64 and got.load.loaded_tokens == 64  # ... all from L3
    assert got.bad == 0  # byte-exact
    assert stats.storage_hit_tokens == 64
    assert backend["staged_pages"] == 0  # the host pool was registered: zero-copy

    foreign, foreign_stats, _ = await read_in_this_process(store.spec, tenant="mc-other", kv=kv)
    assert foreign.prefetch.hit_tokens == 0 and foreign.load.loaded_tokens == 0
    assert foreign_stats.storage_hit_tokens == 0
