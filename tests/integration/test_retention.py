"""Retention ranges and pins through the whole cache, on virtual time: a high-priority range
outlives LRU pressure in L1 and L2 and falls back after its duration; pins hold a prefix in L1
and/or L2 against a sweep of other traffic, expire, hit their cap, and come back pinned from
L3 after a clear. Every page a request reads is checked against the KV it must hold."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hicache import HiCache, InvalidRequest, PinLimitError, Retention
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.testing import ScriptedScheduler, bad_pages, run_virtual
from tests.integration.storage_helpers import (
    PAGE,
    compute_into,
    config,
    fetch,
    namespace_of,
    seeds_for,
    tokens_from,
    write,
)

SYSTEM = tokens_from(0, 16)  # four pages: the prefix operators want kept
DEVICE, HOST = 64, 128  # 16 and 32 pages: a sweep of 40 other requests churns both twice


async def run(cache: HiCache, rid: str, tokens: np.ndarray, retention=()) -> None:
    """One request, computed and cached, its writes flushed."""
    await ScriptedScheduler(
        cache, compute=compute_into(cache), wait_prefetch=False, retention_of=lambda _: retention
    ).run([[(rid, tokens)]])
    await cache.flush()


async def sweep(cache: HiCache, tag: str, count: int = 40) -> None:
    """Other traffic: `count` distinct 16-token requests, enough to turn both tiers over."""
    for k in range(count):
        await write(cache, f"{tag}{k}", tokens_from(10_000 + 1000 * k, 16))


async def where(cache: HiCache, tokens: np.ndarray) -> tuple[int, int, int]:
    """(L1, L2) tokens of the prefix cached now, and how many L1 pages hold wrong KV."""
    m = await cache.match("probe", tokens)
    bad = bad_pages(cache.device_pool, m.device_slots, seeds_for(tokens), page_size=PAGE, first=0)
    await cache.release("probe")
    return m.device_len, m.host_len, bad


@pytest.mark.parametrize(
    "policy, exclusive",
    [("write_through", False), ("write_back", False), ("write_through_selective", False),
     ("write_through", True)],
)  # fmt: skip
def test_a_high_priority_range_outlives_lru_then_falls_back(policy, exclusive):
    cfg = config(write_policy=policy, exclusive=exclusive, device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM, [Retention(0, None, priority=90, duration=100.0)])
            await sweep(cache, "a")
            kept = await where(cache, SYSTEM)
            await cache.system.sleep(100.0)  # virtual: the range's duration passes
            await sweep(cache, "b")
            gone = await where(cache, SYSTEM)
            return kept, gone

    kept, gone = run_virtual(main)
    assert kept[0] + kept[1] == len(SYSTEM) and kept[2] == 0  # still cached, byte-exact
    assert gone[:2] == (0, 0)  # an ordinary page again: LRU pressure took it


def test_without_a_range_the_same_traffic_evicts_the_prefix():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            await sweep(cache, "a")
            return await where(cache, SYSTEM)

    assert run_virtual(main)[:2] == (0, 0)


def test_a_low_priority_range_is_evicted_before_older_pages():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST, write_policy="write_back")

    async def main():
        async with HiCache(cfg) as cache:
            old = tokens_from(5000, 16)
            await run(cache, "old", old)
            await run(cache, "scratch", SYSTEM, [Retention(0, 16, priority=0)])
            # Three more requests fill L1 (16 pages): one request's pages must go.
            for k in range(3):
                await write(cache, f"f{k}", tokens_from(20_000 + 1000 * k, 16))
            return await where(cache, old), await where(cache, SYSTEM)

    old, scratch = run_virtual(main)
    assert old[0] == 16 and scratch[0] == 0  # the newer, low-priority pages went first


@pytest.mark.parametrize("tiers", [("device", "host"), ("device",), ("host",)])
def test_a_pinned_prefix_survives_a_sweep_and_leaves_once_unpinned(tiers):
    cfg = config(device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            out = await cache.pin(SYSTEM, tiers=tiers)
            await sweep(cache, "a")
            pinned = await where(cache, SYSTEM)
            assert await cache.unpin(SYSTEM) and not await cache.unpin(SYSTEM)
            await sweep(cache, "b")
            return out, pinned, await where(cache, SYSTEM)

    out, pinned, after = run_virtual(main)
    assert out.tokens == out.cached_tokens == 16 and out.until is None
    if "device" in tiers:
        assert pinned[0] == 16  # never left L1
    else:
        assert pinned[0] + pinned[1] == 16  # may have left L1, never L2
    assert pinned[2] == 0
    assert after[:2] == (0, 0)


def test_a_pin_with_a_ttl_expires_on_the_cache_clock():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            out = await cache.pin(SYSTEM, ttl=50.0)
            await sweep(cache, "a")
            held = await where(cache, SYSTEM)
            await cache.system.sleep(50.0)  # virtual
            await sweep(cache, "b")
            stats = cache.system.actors["tree"].controller.bookkeeping()
            return out, held, await where(cache, SYSTEM), stats

    out, held, after, tables = run_virtual(main)
    assert out.until is not None and held[0] == 16 and after[:2] == (0, 0)
    assert tables["pins"] == 0  # the expired pin left the table at the next insert


def test_pages_cached_after_the_pin_are_pinned_as_they_arrive():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            out = await cache.pin(SYSTEM, tiers=("device",))  # nothing cached yet
            await run(cache, "sys", tokens_from(0, 24))  # the prefix and two pages more
            await sweep(cache, "a")
            return out, await where(cache, tokens_from(0, 24))

    out, found = run_virtual(main)
    assert out.cached_tokens == 0 and found[0] == 16  # the pinned part stayed; the rest went


def test_a_pinned_prefix_comes_back_pinned_from_l3(tmp_path):
    cfg = config(
        storage=f"file:{tmp_path}",
        device_tokens=DEVICE,
        host_tokens=HOST,
        prefetch_policy="wait_complete",
    )

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            await cache.pin(SYSTEM, tiers=("host",))
            await cache.clear(("device", "host"))  # pins do not hold against a clear
            cleared = await where(cache, SYSTEM)
            back = await fetch(cache, "again", SYSTEM)  # from L3 into L2, then L1
            await sweep(cache, "a")  # L1 and L2 turn over; L3 too would serve it, so ...
            await cache.clear(("storage",))  # ... only L2 can still hold it now
            return cleared, back, await where(cache, SYSTEM)

    cleared, back, after = run_virtual(main)
    assert cleared[:2] == (0, 0)
    assert back.prefetch.done_tokens + back.device_hit == 16 and back.bad == 0
    assert after[0] + after[1] == 16 and after[2] == 0  # pinned in L2 on its way back


def test_the_pin_cap_counts_shared_pages_once_and_refuses_past_it():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST, max_pinned_device_tokens=24)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            await cache.pin(SYSTEM, tiers=("device",))
            await cache.pin(tokens_from(0, 24), tiers=("device",))  # shares 16: 24 in all
            with pytest.raises(PinLimitError) as err:
                await cache.pin(tokens_from(7000, 8), tiers=("device",))  # 32 > 24
            await cache.pin(tokens_from(7000, 8), tiers=("host",))  # the host cap is 64
            await sweep(cache, "a")
            return err.value, await where(cache, SYSTEM)

    err, held = run_virtual(main)
    assert err.tier == "device" and err.cap == 24 and "max_pinned_device_tokens" in str(err)
    assert held[0] == 16  # the pins made before the refusal still hold


def test_bad_pins_and_ranges_are_refused_and_change_nothing():
    cfg = config(device_tokens=DEVICE, host_tokens=HOST)

    async def main():
        async with HiCache(cfg) as cache:
            await run(cache, "sys", SYSTEM)
            errors = []
            for call in (
                lambda: cache.pin(SYSTEM, tiers=("disk",)),
                lambda: cache.pin(SYSTEM, tiers=()),
                lambda: cache.pin(SYSTEM, ttl=-1),
                lambda: cache.pin(SYSTEM, ttl=float("nan")),
                lambda: cache.pin(SYSTEM[:3]),  # no whole page
                lambda: cache.match("r", SYSTEM, retention=[Retention(0, 4, priority=101)]),
                lambda: cache.match("r", SYSTEM, retention=[Retention(8, 4, priority=50)]),
                lambda: cache.match("r", SYSTEM, retention=[Retention(0, 4, 50, duration=0)]),
                lambda: cache.match("r", SYSTEM, retention=[(0, 4, 50)]),
            ):
                with pytest.raises(InvalidRequest) as err:
                    await call()
                errors.append(str(err.value))
            tables = cache.system.actors["tree"].controller.bookkeeping()
            return errors, tables, await where(cache, SYSTEM)

    errors, tables, found = run_virtual(main)
    assert "tiers" in errors[0] and "ttl" in errors[2] and "whole page" in errors[4]
    assert "priority" in errors[5] and "start < end" in errors[6] and "duration" in errors[7]
    assert tables["pins"] == 0 and tables["requests"] == 0
    assert found == (16, 0, 0)


def test_a_range_duration_reaches_storage_as_an_expiry():
    """The upload of retained pages asks the store to keep them for the rest of the range;
    a store that enforces expiry (here on the cache's own clock) drops them then."""
    clock = [0.0]
    store = MemoryStore(clock=lambda: clock[0])
    cfg = config(device_tokens=DEVICE, host_tokens=HOST, prefetch_policy="wait_complete")
    other = tokens_from(3000, 16)

    async def main():
        async with HiCache(
            cfg, backend=MemoryBackend(namespace=namespace_of(cfg), store=store)
        ) as c:
            clock[0] = c.system.now()
            await run(c, "sys", SYSTEM, [Retention(0, None, priority=90, duration=30.0)])
            await run(c, "other", other)  # no range: stored without an expiry
            stored = len(store)
            await c.clear(("device", "host"))
            clock[0] = c.system.now() + 31.0  # the store's clock passes the range's end
            sys_back = await fetch(c, "a", SYSTEM)
            other_back = await fetch(c, "b", other)
            return stored, sys_back, other_back

    stored, sys_back, other_back = run_virtual(main)
    assert stored == 8  # both requests' four pages
    assert sys_back.prefetch.done_tokens == 0  # expired in the store with its range
    assert other_back.prefetch.done_tokens == 16 and other_back.bad == 0


def test_replay_pins_first_blocks_and_refuses_bad_tiers(tmp_path, capsys):
    from hicache.cli.main import main as hicache_main

    out = tmp_path / "summary.json"
    args = ["replay", "--storage", "none", "--limit", "60", "--kv", "mha:1:1:8:float16",
            "--device-tokens", "16384", "--host-tokens", "32768", "--quiet", "--deterministic"]  # fmt: skip
    assert hicache_main([*args, "--pin-first-block", "host", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["pins"]["first_blocks"] > 0 and summary["corrupt_pages"] == 0
    assert summary["verified_pages"] > 0
    assert summary["config"]["pin_first_block"] == ["host"]
    assert hicache_main([*args, "--pin-first-block", "disk"]) == 2
    assert "--pin-first-block" in capsys.readouterr().err
