"""L3 prefetch at the cache level, on virtual time: the three termination policies and the
timeout formula, revoke, the rate limit, admission checks, and load-back of what arrived.

The reader's storage is slow on purpose: every backend call takes LATENCY virtual seconds and
reads go in batches of BATCH pages, so a 16-page prefetch probes for 4 x LATENCY (the probe is
batched too) and then lands one batch every LATENCY: at 0.625, 0.75, 0.875 and 1.0 s.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache import CacheConfig, HiCache
from hicache.backends.memory import MemoryStore
from hicache.observability import EventLog
from hicache.testing import run_virtual
from tests.integration.storage_helpers import (
    PAGE,
    config,
    fetch,
    slow_memory,
    tokens_from,
    write,
)

LATENCY = 0.125
BATCH = 4  # pages
TOKENS = tokens_from(0, 64)  # 16 pages
PROBE_END = 4 * LATENCY
BATCH_ENDS = [PROBE_END + (i + 1) * LATENCY for i in range(4)]  # 0.625 .. 1.0


def at(seconds: float):
    """A virtual duration, up to float rounding of the clock's absolute times."""
    return pytest.approx(seconds, abs=1e-9)


async def stored(*sequences: np.ndarray) -> MemoryStore:
    """A store holding every page of `sequences`, written by a cache of `config()`."""
    store = MemoryStore()
    async with HiCache(config(storage="memory", extra={"store": store})) as writer:
        for i, tokens in enumerate(sequences):
            await write(writer, f"w{i}", tokens)
    assert len(store) == sum(len(t) // PAGE for t in sequences)
    return store


def reader(store: MemoryStore, *, log=None, **overrides) -> HiCache:
    cfg = config(storage_batch_pages=BATCH, **overrides)
    return HiCache(cfg, backend=slow_memory(cfg, store, latency=LATENCY), log=log)


# ---------------------------------------------------------------- termination policies


def test_wait_complete_returns_when_every_hit_page_arrived():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="wait_complete") as cache:
            await cache.match("r", TOKENS)
            t0 = cache.system.now()
            started = await cache.prefetch("r", TOKENS)
            out = await cache.prefetch_wait("r")
            waited = cache.system.now() - t0
            m = await cache.match("r", TOKENS)
            await cache.release("r")
            return started, out, waited, m.host_len

    started, out, waited, host_len = run_virtual(main)
    assert started.state == "running" and started.wanted_tokens == 64
    assert out.state == "done" and out.hit_tokens == out.done_tokens == 64
    assert waited == at(BATCH_ENDS[-1])
    assert host_len == 64  # all of it now in L2, as host-only nodes


def test_best_effort_returns_at_once_with_what_arrived_and_ends_the_op():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="best_effort") as cache:
            backend = cache.backend
            await cache.match("r", TOKENS)
            t0 = cache.system.now()
            await cache.prefetch("r", TOKENS)
            # The scheduler comes back between the first and the second batch.
            await cache.system.sleep(BATCH_ENDS[0] + LATENCY / 2)
            asked = cache.system.now() - t0
            out = await cache.prefetch_wait("r")
            answered = cache.system.now() - t0
            await cache.system.sleep(2.0)  # long after the whole prefetch would have finished
            m = await cache.match("r", TOKENS)
            reads = backend.calls["get_into"]
            await cache.release("r")
            return asked, answered, out, m.host_len, reads

    asked, answered, out, host_len, reads = run_virtual(main)
    assert answered == at(asked)  # not held until the batch in flight lands
    assert out.state == "done" and out.hit_tokens == 64
    assert out.done_tokens == BATCH * PAGE  # the first batch
    assert host_len == BATCH * PAGE  # what arrived is in the tree; nothing more came
    assert reads == 2  # the batch in flight at the stop finished; no other was started


def test_best_effort_wait_before_anything_arrived_is_an_empty_done():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="best_effort") as cache:
            await cache.match("r", TOKENS)
            await cache.prefetch("r", TOKENS)
            out = await cache.prefetch_wait("r")  # still probing
            again = await cache.prefetch_poll("r")
            used = (await cache.stats()).host.used
            await cache.release("r")
            return out, again, used

    out, again, used = run_virtual(main)
    assert out.state == "done" and out.done_tokens == 0
    assert again == out
    assert used == 0  # host slots are taken only after the probe, for the pages it found


@pytest.mark.parametrize(
    "base, per_ki, arrived",
    [
        (0.625, 1.0, BATCH * PAGE),  # deadline 0.6875: one batch landed, the second in flight
        (0.25, 2.0, 0),  # deadline 0.375: still probing
        (10.0, 0.25, 64),  # never reached: returns when complete
    ],
)
def test_timeout_returns_at_base_plus_per_ki_token_times_tokens(base, per_ki, arrived):
    async def main():
        store = await stored(TOKENS)
        async with reader(
            store,
            prefetch_policy="timeout",
            prefetch_timeout_base=base,
            prefetch_timeout_per_ki_token=per_ki,
        ) as cache:
            await cache.match("r", TOKENS)
            t0 = cache.system.now()
            await cache.prefetch("r", TOKENS)
            out = await cache.prefetch_wait("r")
            waited = cache.system.now() - t0
            m = await cache.match("r", TOKENS)
            await cache.release("r")
            return out, waited, m.host_len, cache.config.prefetch_timeout(64)

    out, waited, host_len, deadline = run_virtual(main)
    assert deadline == base + per_ki * 64 / 1024
    assert waited == at(min(deadline, BATCH_ENDS[-1]))
    assert out.state == "done" and out.done_tokens == arrived == host_len


def test_hung_storage_holds_no_request_past_its_deadline():
    async def main():
        store = await stored(TOKENS)
        cfg = config(prefetch_policy="timeout")  # defaults: 1 s + 0.25 s per 1024 tokens
        hung = slow_memory(cfg, store, latency=100.0)
        async with HiCache(cfg, backend=hung) as cache:
            await cache.match("r", TOKENS)
            t0 = cache.system.now()
            await cache.prefetch("r", TOKENS)
            out = await cache.prefetch_wait("r")
            waited = cache.system.now() - t0
            lb = await cache.load_back("r")
            new = await cache.allocate("r", 64)  # the request goes on: computes it all
            await cache.cache_finished("r", TOKENS, new)
            return out, waited, lb.loaded_tokens

    out, waited, loaded = run_virtual(main)
    assert waited == at(1.0 + 0.25 * 64 / 1024)
    assert out.state == "done" and out.done_tokens == 0 and loaded == 0


def test_closing_with_prefetches_in_flight_balances_the_ledgers():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="wait_complete") as cache:
            await cache.match("r", TOKENS)
            await cache.prefetch("r", TOKENS)
            await cache.system.sleep(BATCH_ENDS[1])  # mid-way
        return cache.close_report

    report = run_virtual(main)
    assert report["host"]["used"] == 0 and report["device"]["used"] == 0


def test_what_arrives_after_the_request_left_still_lands_in_l2():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="wait_complete") as cache:
            await cache.match("gone", TOKENS)
            await cache.prefetch("gone", TOKENS)
            await cache.release("gone")
            await cache.system.sleep(2.0)
            got = await fetch(cache, "next", TOKENS)
            return got, await cache.stats()

    got, stats = run_virtual(main)
    assert got.prefetch.state == "skipped"  # nothing left to fetch: all of it is in L2
    assert got.load.loaded_tokens == 64 and got.bad == 0
    assert stats.storage_hit_tokens == 0  # counted for requests that got them, and none did


def test_timeout_formula():
    cfg = CacheConfig()
    assert (cfg.prefetch_timeout_base, cfg.prefetch_timeout_per_ki_token) == (1.0, 0.25)
    assert cfg.prefetch_timeout(0) == 1.0
    assert cfg.prefetch_timeout(1024) == 1.25
    assert cfg.prefetch_timeout(4096) == 2.0
    # In pages: base + per_ki_token x pages x page_size / 1024.
    cfg = CacheConfig(page_size=64, prefetch_timeout_base=0.5, prefetch_timeout_per_ki_token=2.0)
    assert cfg.prefetch_timeout(10 * 64) == 0.5 + 2.0 * 10 * 64 / 1024


# ---------------------------------------------------------------- revoke, rate limit, admission


def test_revoke_below_threshold_returns_the_host_slots():
    async def main():
        store = await stored(TOKENS[:PAGE])  # one page in L3; the threshold is two
        async with reader(store, prefetch_policy="wait_complete") as cache:
            await cache.match("r", TOKENS)
            before = await cache.stats()
            started = await cache.prefetch("r", TOKENS)
            during = await cache.stats()
            out = await cache.prefetch_wait("r")
            await cache.system.sleep(1.0)  # any read in flight at the revoke has returned
            after = await cache.stats()
            m = await cache.match("r", TOKENS)
            await cache.release("r")
            return started, before, during, out, after, m.host_len

    started, before, during, out, after, host_len = run_virtual(main)
    assert started.state == "running"
    assert during.host.used == before.host.used  # probe first: no host slots for a miss
    assert out.state == "revoked" and out.hit_tokens == PAGE and out.done_tokens == 0
    assert after.host.used == before.host.used
    assert after.host.cached_tokens == before.host.cached_tokens == 0
    assert after.storage_hit_tokens == 0 and host_len == 0


def test_rate_limit_bounds_prefetch_tokens_in_flight():
    # host - device = 192 tokens: at most int(0.8 x 192) = 153 prefetch tokens in flight.
    lengths = [64, 64, 64, 24, 8]
    sequences = [tokens_from(1000 * i, n) for i, n in enumerate(lengths)]

    async def main():
        store = await stored(*sequences)
        async with reader(
            store, prefetch_policy="wait_complete", device_tokens=64, host_tokens=256
        ) as cache:
            rids = [f"r{i}" for i in range(len(sequences))]
            await cache.match_many(zip(rids, sequences))
            first = await cache.prefetch_many(zip(rids, sequences))
            inflight = sum(o.wanted_tokens for o in first if o.state == "running")
            outs = [await cache.prefetch_wait(rid) for rid in rids]
            await cache.system.sleep(1.0)  # every read is over: the window is empty again
            again = await cache.prefetch("r2", sequences[2])
            last = await cache.prefetch_wait("r2")
            await cache.release_many(rids)
            return first, inflight, outs, again, last

    first, inflight, outs, again, last = run_virtual(main)
    # 64 + 64 = 128 fit; a third 64 would make 192; 24 more make 152 <= 153; 8 more would not.
    assert [o.state for o in first] == ["running", "running", "skipped", "running", "skipped"]
    assert first[2].reason == first[4].reason == "rate_limited"
    assert inflight == 152
    assert [o.state for o in outs] == ["done", "done", "skipped", "done", "skipped"]
    assert again.state == "running" and last.done_tokens == 64


def test_admission_skips_are_reported_with_their_reason():
    async def main():
        store = await stored(TOKENS)
        async with reader(store, prefetch_policy="wait_complete") as cache:
            short = tokens_from(5000, 2 * PAGE - 1)  # under two whole pages
            await cache.match("short", short)
            below = await cache.prefetch("short", short)
            await cache.release("short")
            off = await cache.prefetch_poll("nobody")
        return below, off

    below, off = run_virtual(main)
    assert (below.state, below.reason) == ("skipped", "below_threshold")
    assert off.state == "none"


def test_a_prefetch_below_a_prefix_only_on_l1_backs_it_up_and_lands():
    """Write-back keeps a fresh insert on L1 only. A prefetch below it still runs: once
    storage has enough below, the prefix gets its L2 copy (and so its L3 one), and what
    arrives hangs below it, read back byte-exact."""
    log = EventLog(capture=True)

    async def main():
        store = await stored(TOKENS)
        async with reader(
            store, prefetch_policy="wait_complete", write_policy="write_back", log=log
        ) as cache:
            head = TOKENS[:32]
            await write(cache, "head", head)
            got = await fetch(cache, "r", TOKENS)
            await cache.flush()
            return got, await cache.stats()

    got, stats = run_virtual(main)
    assert got.prefetch.state == "done" and got.prefetch.done_tokens == 32
    assert got.device_hit == 32 and got.load.loaded_tokens == 32 and got.bad == 0
    backups = [e for e in log.events if e["event"] == "tree.anchor_backup"]
    assert [(e["nodes"], e["tokens"]) for e in backups] == [(1, 32)]
    assert stats.bytes["d2h"] > 0 and stats.host.cached_tokens >= 64  # head's copy + the rest


def test_prefetch_without_storage_is_none():
    async def main():
        async with HiCache(config()) as cache:
            await cache.match("r", TOKENS)
            out = await cache.prefetch("r", TOKENS)
            cleared = await cache.clear_storage()
            await cache.release("r")
            return out, cleared

    out, cleared = run_virtual(main)
    assert out.state == "none" and cleared is False


# ---------------------------------------------------------------- into L1, byte-exact


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetched_pages_load_back_byte_exact_and_count_as_storage_hits(policy):
    log = EventLog(capture=True)

    async def main():
        # The last 16 tokens are not in L3: they stop the consecutive run of hits.
        store = await stored(TOKENS[:48])
        async with reader(store, prefetch_policy=policy, log=log) as cache:
            got = await fetch(cache, "r", TOKENS, queued=2.0)  # all of it has arrived by then
            stats = await cache.stats()
            return got, stats

    got, stats = run_virtual(main)
    assert got.prefetch.state == "done" and got.prefetch.done_tokens == 48
    assert got.load.loaded_tokens == 48 and len(got.load.device_slots) == 48
    assert got.bad == 0
    assert stats.storage_hit_tokens == 48 and stats.host.hit_tokens == 48
    events = [e["event"] for e in log.events]
    assert "tree.prefetch_started" in events and "tree.prefetch_done" in events
