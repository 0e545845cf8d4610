"""Findings of the hardening review, one test each: wrong KV, hangs, crashes from a caller's
mistake, and leaks. Each failed on the code before its fix."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from hicache import HiCache, InvalidRequest, StorageTimeout
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.observability import EventLog
from hicache.runtime.errors import ActorFailed
from hicache.testing import (
    BackendFaults,
    FaultPlan,
    FaultyBackend,
    ScriptedScheduler,
    bad_prefix_pages,
    run_virtual,
    synthetic_compute,
    virtual_config,
)
from tests.integration.storage_helpers import config as storage_config
from tests.integration.storage_helpers import namespace_of, write

PAGE = 4


def tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


class HungBackend(MemoryBackend):
    """A memory backend whose chosen calls never return until cancelled."""

    def __init__(self, *args, hang=("exists", "get_into", "set_from", "clear"), **kw) -> None:
        super().__init__(*args, **kw)
        self.hang = set(hang)
        self.returned = dict.fromkeys(("exists", "get_into", "set_from", "clear"), 0)

    async def _maybe_hang(self, name: str) -> None:
        if name in self.hang:
            try:
                await anyio.sleep_forever()
            finally:
                self.returned[name] += 1

    async def exists(self, keys):
        await self._maybe_hang("exists")
        return await super().exists(keys)

    async def get_into(self, keys, targets):
        await self._maybe_hang("get_into")
        return await super().get_into(keys, targets)

    async def set_from(self, keys, sources):
        await self._maybe_hang("set_from")
        return await super().set_from(keys, sources)

    async def clear(self):
        await self._maybe_hang("clear")
        return await super().clear()


# ---------------------------------------------------------------- wrong KV


def test_release_mid_load_never_hands_the_loads_slots_to_another_request():
    """A load holds its own lock: its device slots are not reused before the copy landed,
    even when its request is released mid-load (real threads, the load gated)."""
    faults = FaultPlan()

    async def main():
        cfg = virtual_config(
            deterministic=False,
            cpu_transfers="thread",
            device_tokens=64,
            host_tokens=256,
            write_policy="write_through",
        )
        log = EventLog(capture=True)
        landed = anyio.Event()
        # The loader logs load_done, then sends LoadDone to the tree in the same turn: any
        # frontend call made after this fires is handled after the tree applied it.
        log.add_listener(lambda e: e["event"] == "loader.load_done" and landed.set())
        async with HiCache(cfg, transfer_faults=faults, log=log) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            a, b, c = tokens(0, 32), tokens(1000, 32), tokens(2000, 32)
            await sched.run([[("a", a)], [("b", b)], [("c", c)]])  # a leaves L1 for L2
            await cache.flush()
            gate = faults.gate("load", 0, 0)
            m = await cache.match("again", a)
            assert m.host_len == 32
            lb = await cache.load_back("again")
            assert lb.loaded_tokens == 32
            await cache.release("again")  # mid-load: the copy has not started
            await cache.match("d", tokens(3000, 64))
            got: list[np.ndarray] = []

            async def allocate() -> None:  # needs the load's slots: waits for the load to end
                got.append(await cache.allocate("d", 64))

            async with anyio.create_task_group() as tg:
                tg.start_soon(allocate)
                await anyio.wait_all_tasks_blocked()
                assert not got  # parked while the load is gated
                gate.set()
            await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
            await landed.wait()
            assert (await cache.stats()).inflight["loads"] == 0
            new = got[0]  # reused only once the load had landed
            d = tokens(3000, 64)
            synthetic_compute(cache)("d", d, new, 0)
            assert bad_prefix_pages(cache, d, new) == 0
            await cache.cache_finished("d", d, new)
            m2 = await cache.match("e", d)
            assert m2.device_len == 64 and bad_prefix_pages(cache, d, m2.device_slots) == 0
            await cache.release("e")

    anyio.run(main)


def test_caching_other_tokens_than_the_matched_ones_is_refused():
    async def main():
        async with HiCache(virtual_config(write_policy="write_through")) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            a = tokens(0, 16)
            await sched.run([[("a", a)]])
            m = await cache.match("x", a)
            assert m.device_len == 16
            before = await cache.dump()
            b = tokens(500, 16)  # same length, other tokens
            with pytest.raises(InvalidRequest, match="differ from the tokens"):
                await cache.cache_finished("x", b, m.device_slots)
            with pytest.raises(InvalidRequest, match="differ from the tokens"):
                await cache.cache_unfinished("x", b[:8], m.device_slots[:8])
            assert await cache.dump() == before
            assert (await cache.match("y", b)).device_len == 0
            await cache.release_many(["x", "y"])

    run_virtual(main)


def test_a_request_whose_load_failed_cannot_cache_the_freed_slots():
    faults = FaultPlan()

    async def main():
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_through")
        async with HiCache(cfg, transfer_faults=faults) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            a = tokens(0, 32)
            await sched.run([[("a", a)], [("b", tokens(500, 32))]])
            faults.fail[("load", 0, 1)] = OSError("injected")
            await cache.match("x", a)
            lb = await cache.load_back("x")
            with pytest.raises(Exception, match="load failed"):
                await lb.handle.wait_async(1)
            await cache.system.run_until_idle()
            with pytest.raises(InvalidRequest, match="load its prefix depends on failed"):
                await cache.cache_finished("x", a, lb.device_slots)
            await cache.release("x")

    run_virtual(main)


# ---------------------------------------------------------------- hangs


def hung_cache(cfg, hang, log=None):
    backend = HungBackend(namespace=namespace_of(cfg), store=MemoryStore(), hang=hang)
    return HiCache(cfg, backend=backend, log=log), backend


def test_a_hung_probe_ends_a_wait_complete_prefetch_at_the_storage_deadline():
    async def main():
        cfg = storage_config(prefetch_policy="wait_complete", storage_timeout=2.0)
        cache, backend = hung_cache(cfg, hang={"exists"})
        async with cache:
            t = tokens(0, 32)
            await cache.match("r", t)
            t0 = cache.system.now()
            await cache.prefetch("r", t)
            out = await cache.prefetch_wait("r")
            assert cache.system.now() - t0 == pytest.approx(2.0)
            assert out.ready and out.done_tokens == 0
            await cache.release("r")
        assert backend.returned["exists"] == 1  # the call was cancelled, not left running

    run_virtual(main)


def test_a_hung_upload_holds_no_flush_and_no_close():
    log = EventLog(capture=True)

    async def main():
        cfg = storage_config(storage_timeout=3.0, upload_retries=5)
        cache, _backend = hung_cache(cfg, hang={"set_from"}, log=log)
        async with cache:
            t0 = cache.system.now()
            await write(cache, "w", tokens(0, 32))  # computes, caches, flushes
            assert cache.system.now() - t0 == pytest.approx(3.0)
        assert cache.close_tables is not None and not any(cache.close_tables.values())

    run_virtual(main)
    names = [e["event"] for e in log.events]
    assert "uploader.timeout" in names and "uploader.retry" not in names


def test_clear_storage_on_a_hung_store_is_a_timeout_error_and_the_cache_keeps_serving():
    async def main():
        cfg = storage_config(storage_timeout=1.0)
        cache, _ = hung_cache(cfg, hang={"clear"})
        async with cache:
            with pytest.raises(StorageTimeout, match="clear_storage"):
                await cache.clear_storage()
            await write(cache, "w", tokens(0, 16))

    run_virtual(main)


class UncancellableBackend(MemoryBackend):
    """set_from waits until released and ignores cancellation, as a call running in a worker
    thread does: the deadline cannot end it."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.release = anyio.Event()

    async def set_from(self, keys, sources):
        with anyio.CancelScope(shield=True):
            await self.release.wait()
        return await super().set_from(keys, sources)


def test_a_timed_out_upload_keeps_its_host_pages_until_the_call_returns():
    """Past the deadline the flush returns, but the pages the call may still read stay
    protected: the upload op stays in flight until the thread returns."""

    async def main():
        cfg = storage_config(storage_timeout=2.0, upload_retries=0)
        backend = UncancellableBackend(namespace=namespace_of(cfg), store=MemoryStore())
        log = EventLog(capture=True)
        ended = anyio.Event()  # the uploader logs the upload's end, then sends UploadDone
        log.add_listener(
            lambda e: e["event"] in ("uploader.stored", "uploader.failed") and ended.set()
        )
        async with HiCache(cfg, backend=backend, log=log) as cache:
            t0 = cache.system.now()
            await write(cache, "w", tokens(0, 32))  # the flush ends at the deadline
            assert cache.system.now() - t0 == pytest.approx(2.0)
            tree = cache.system.actors["tree"]
            assert tree.bookkeeping()["uploads"] == 1  # still protected
            assert [n["host_ref"] for n in await cache.dump()][1:] == [1]
            backend.release.set()
            await ended.wait()
            assert [n["host_ref"] for n in await cache.dump()][1:] == [0]
            assert tree.bookkeeping()["uploads"] == 0

    run_virtual(main)


def test_close_abandons_work_past_its_deadline_with_an_event():
    log = EventLog(capture=True)

    async def main():
        cfg = storage_config(storage_timeout=1000.0, close_timeout=5.0)
        cache, _ = hung_cache(cfg, hang={"set_from"}, log=log)
        async with cache:
            await ScriptedScheduler(
                cache, compute=synthetic_compute(cache), wait_prefetch=False
            ).run([[("w", tokens(0, 16))]])
            t0 = cache.system.now()
        assert cache.system.now() - t0 == pytest.approx(5.0)
        return cache.close_report

    report = run_virtual(main)
    assert report["host"]["used"] == 0
    names = [e["event"] for e in log.events]
    assert "cache.close_timeout" in names and "tree.abandoned" in names


# ---------------------------------------------------------------- a caller's mistake


def test_an_unhashable_request_id_is_that_calls_error():
    async def main():
        async with HiCache(virtual_config()) as cache:
            with pytest.raises(InvalidRequest, match="not hashable"):
                await cache.match(["x"], tokens(0, 8))
            await ScriptedScheduler(cache, compute=synthetic_compute(cache)).run(
                [[("a", tokens(0, 8))]]
            )

    run_virtual(main)


def test_batches_are_all_or_nothing():
    async def main():
        async with HiCache(virtual_config(write_policy="write_through")) as cache:
            a, b = tokens(0, 16), tokens(100, 16)
            for rid, t in (("a", a), ("b", b)):
                await cache.match(rid, t)
            sa, sb = await cache.allocate_many([("a", 16), ("b", 16)])
            before = await cache.dump()
            with pytest.raises(InvalidRequest, match="device slots"):  # b's slots are wrong
                await cache.cache_many([("a", a, sa, True), ("b", b, sb[::-1], True)])
            assert await cache.dump() == before  # a was not inserted either
            with pytest.raises(InvalidRequest, match="twice"):
                await cache.cache_many([("a", a, sa, True), ("a", a, sa, True)])
            with pytest.raises(InvalidRequest, match="twice"):
                await cache.match_many([("c", a), ("c", b)])
            with pytest.raises(Exception, match="'ghost'"):
                await cache.release_many(["a", "ghost"])
            await cache.cache_many([("a", a, sa, True), ("b", b, sb, True)])  # a still there
            assert (await cache.match("z", a)).device_len == 16
            await cache.release("z")

    run_virtual(main)


def test_an_internal_fault_after_a_partial_change_stops_the_cache_not_the_caller():
    async def main():
        async with HiCache(virtual_config()) as cache:
            tree = cache.system.actors["tree"]._tree

            def broken_insert(*args, **kw):
                raise ValueError("internal: an invariant broke mid-insert")

            tree.insert = broken_insert
            t = tokens(0, 8)
            await cache.match("a", t)
            slots = await cache.allocate("a", 8)
            await cache.cache_finished("a", t, slots)

    with pytest.raises(ActorFailed, match="invariant broke"):
        run_virtual(main)


# ---------------------------------------------------------------- leaks


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("prefetch_policy", ["best_effort", "wait_complete", "timeout"])
def test_every_table_is_empty_at_close(write_policy, prefetch_policy):
    async def main():
        cfg = storage_config(
            write_policy=write_policy,
            prefetch_policy=prefetch_policy,
            device_tokens=32,
            host_tokens=96,
            prefetch_timeout_base=0.01,
        )
        store = MemoryStore()
        async with HiCache(
            cfg, backend=MemoryBackend(namespace=namespace_of(cfg), store=store)
        ) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            convs = [tokens(1000 * c, 24) for c in range(5)]
            for turn in range(3):
                await sched.run([[(f"c{c}t{turn}", t)] for c, t in enumerate(convs)])
            await cache.system.sleep(1.0)  # let every prefetch timer come due
            tree = cache.system.actors["tree"]
            assert tree.bookkeeping()["timers_fired"] == 0
        return cache.close_tables

    tables = run_virtual(main)
    assert tables and not any(tables.values()), tables


def test_the_upload_backlog_is_bounded():
    log = EventLog(capture=True)

    async def main():
        cfg = storage_config(channel_capacity=8, max_upload_backlog=2)  # one upload credit
        store = MemoryStore()
        from hicache.testing import BackendFaults, FaultyBackend

        slow = FaultyBackend(
            MemoryBackend(namespace=namespace_of(cfg), store=store), BackendFaults(latency=1.0)
        )
        async with HiCache(cfg, backend=slow, log=log) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache), wait_prefetch=False)
            await sched.run([[(f"r{i}", tokens(100 * i, 8)) for i in range(8)]])
            await cache.system.sleep(0.1)  # virtual: every backup lands, uploads queue
            tree = cache.system.actors["tree"]
            assert tree.bookkeeping()["upload_backlog"] <= 2
            assert tree.counters.skipped_uploads >= 1

    run_virtual(main)
    assert any(
        e["event"] == "tree.upload_skipped" and e["reason"] == "backlog_full" for e in log.events
    )


def test_an_upload_evicted_from_l2_while_it_waits_is_counted_as_skipped():
    log = EventLog(capture=True)

    async def main():
        # one upload credit and slow storage: backups queue for it; an L2 of 8 pages then
        # evicts the oldest of them before their turn comes
        cfg = storage_config(channel_capacity=8, host_tokens=96, max_upload_backlog=64)
        slow = FaultyBackend(
            MemoryBackend(namespace=namespace_of(cfg), store=MemoryStore()),
            BackendFaults(latency=1.0),
        )
        async with HiCache(cfg, backend=slow, log=log) as cache:
            compute = synthetic_compute(cache)
            for i in range(12):
                t = tokens(1000 * i, 16)
                await cache.match(f"r{i}", t)
                slots = await cache.allocate(f"r{i}", len(t))
                compute(f"r{i}", t, slots, 0)
                await cache.cache_finished(f"r{i}", t, slots)
                await cache.system.sleep(0.01)  # virtual: its backup lands, its upload queues
            await cache.flush()
            return cache.system.actors["tree"].counters.skipped_uploads

    skipped = run_virtual(main)
    evicted = [
        e for e in log.events if e["event"] == "tree.upload_skipped" and e["reason"] == "evicted"
    ]
    assert evicted and skipped == len(evicted)
