"""`clear(tiers)`: every unlocked page of the tiers asked is dropped once the work in flight
has ended; pages locked by a running request stay; L3 is cleared with "storage". On virtual
time."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import HiCache
from hicache.results import InvalidRequest
from hicache.testing import run_virtual
from tests.integration.storage_helpers import compute_into, config, fetch, tokens_from, write


async def cache_some(cache: HiCache, n: int = 4) -> None:
    for k in range(n):
        await write(cache, f"w{k}", tokens_from(1000 * k, 32))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_clear_drops_every_unlocked_page_of_l1_and_l2(policy):
    cfg = config(write_policy=policy, device_tokens=128, host_tokens=256)

    async def main():
        async with HiCache(cfg) as cache:
            await cache_some(cache)
            before = await cache.stats()
            # A running request keeps its prefix through the clear.
            held = tokens_from(0, 32)
            m = await cache.match("held", held)
            out = await cache.clear(("device", "host"))
            after = await cache.stats()
            again = await cache.match("again", tokens_from(1000, 32))
            await cache.release("again")
            await cache.release("held")
            cache.system.actors["tree"].controller.shared.tree.check_integrity()
            return before, m.device_len, out, after, again.device_len + again.host_len

    before, kept, out, after, found = run_virtual(main)
    assert before.device.cached_tokens > 0
    assert kept == 32
    assert after.device.cached_tokens == kept and after.host.cached_tokens <= kept
    assert out.device_tokens == before.device.cached_tokens - kept
    assert out.host_tokens + (before.host.cached_tokens - after.host.cached_tokens) >= 0
    assert after.device.used == kept and out.storage is False
    assert found == 0  # what was cleared is not found again


def test_clear_of_one_tier_leaves_the_other(tmp_path):
    cfg = config(write_policy="write_through", device_tokens=128, host_tokens=256)

    async def main():
        async with HiCache(cfg) as cache:
            await cache_some(cache, 2)
            await cache.flush()
            out = await cache.clear(["device"])
            m = await cache.match("r", tokens_from(0, 32))
            await cache.release("r")
            return out, m.device_len, m.host_len

    out, device, host = run_virtual(main)
    assert out.device_tokens == 64 and out.host_tokens == 0
    assert device == 0 and host == 32  # demoted: its L2 copy stays


def test_clear_storage_with_the_rest(tmp_path):
    cfg = config(storage=f"file:{tmp_path}", prefetch_policy="wait_complete")

    async def main():
        async with HiCache(cfg) as cache:
            await write(cache, "w", tokens_from(0, 32))
            out = await cache.clear()
            got = await fetch(cache, "r", tokens_from(0, 32))
            return out, got

    out, got = run_virtual(main)
    assert out.storage is True and out.device_tokens == 32
    assert got.device_hit == 0 and got.prefetch.done_tokens == 0  # nothing left in any tier


def test_clear_waits_for_work_in_flight_and_checks_its_tiers():
    cfg = config(write_policy="write_through", device_tokens=128, host_tokens=256)

    async def main():
        async with HiCache(cfg) as cache:
            with pytest.raises(InvalidRequest, match="tiers"):
                await cache.clear(["disk"])
            tokens = tokens_from(0, 32)
            await cache.match("w", tokens)
            slots = await cache.allocate("w", 32)
            compute_into(cache)("w", tokens, np.asarray(slots), 0)
            await cache.cache_finished("w", tokens, slots)  # its backup is now in flight
            out = await cache.clear(["host"])  # runs after the backup: drops its L2 copy
            m = await cache.match("r", tokens)
            await cache.release("r")
            return out, m.device_len

    out, device = run_virtual(main)
    assert out.host_tokens == 32 and device == 32
