"""Minimal reproductions of the library bugs the simulation found, one test each.

Each failed before its fix; the simulation no longer works around any of them, so it checks
them again on every seed.

`LateLandingStreams` are deterministic streams that move each layer's bytes when the layer
lands, as CPU and CUDA streams do; the default virtual streams copy at submit, which hides
any read of a load that has not landed yet.
"""

from __future__ import annotations

import anyio
import numpy as np

from hicache import HiCache
from hicache.testing import (
    BackendFaults,
    FaultPlan,
    FaultyBackend,
    ScriptedScheduler,
    bad_prefix_pages,
    fill_kv,
    kv_seeds,
    run_virtual,
    synthetic_compute,
    virtual_config,
)
from hicache.testing.simulation import LateLandingStreams

PAGE = 4


async def _only_in_l2(cache: HiCache, tokens: np.ndarray) -> None:
    """Compute `tokens`, then push them out of a 32-token L1 into L2."""
    sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
    await sched.run([[("a", tokens)], [("b", np.arange(100, 132))]])
    await cache.flush()


def test_a_match_that_splits_a_node_still_loading_reports_the_load():
    async def main():
        streams = LateLandingStreams(bandwidth=1e3)  # slow: the load takes virtual seconds
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_through")
        async with HiCache(cfg, streams=streams) as cache:
            streams.bind(cache)
            a = np.arange(16, dtype=np.int64)
            await _only_in_l2(cache, a)
            await cache.match("loader", a)
            lb = await cache.load_back("loader")
            assert lb.handle is not None and not lb.handle.done()
            m = await cache.match("reader", a[:8])  # splits the node being loaded
            assert m.device_len == 8
            not_landed = bad_prefix_pages(cache, a, m.device_slots)
            assert m.pending or not not_landed, f"{not_landed} pages not landed, pending=()"
            await lb.handle.wait_async(1)
            await cache.release_many(["reader", "loader"])

    run_virtual(main)


def test_a_match_that_splits_a_node_still_loading_reports_the_load_on_cpu_threads():
    """The same with real CPU transfer threads: a gate stalls the load on its worker."""
    plan = FaultPlan()
    gate = plan.gate("load", 0, 0)

    async def main():
        cfg = virtual_config(
            deterministic=False,
            cpu_transfers="thread",
            device_tokens=32,
            host_tokens=128,
            write_policy="write_through",
        )
        async with HiCache(cfg, transfer_faults=plan) as cache:
            a = np.arange(16, dtype=np.int64)
            await _only_in_l2(cache, a)
            await cache.match("loader", a)
            lb = await cache.load_back("loader")
            try:
                m = await cache.match("reader", a[:8])
                not_landed = bad_prefix_pages(cache, a, m.device_slots)
            finally:
                gate.set()
            await lb.handle.wait_async(1)
            await cache.release_many(["reader", "loader"])
            return m, not_landed

    m, not_landed = anyio.run(main)
    assert m.pending or not not_landed, f"{not_landed} pages not landed, pending=()"


def test_cache_unfinished_never_hands_back_slots_still_loading():
    async def main():
        streams = LateLandingStreams(bandwidth=1e3)
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_through")
        async with HiCache(cfg, streams=streams) as cache:
            streams.bind(cache)
            a = np.arange(16, dtype=np.int64)
            await _only_in_l2(cache, a)
            await cache.match("writer", a[:3])  # no whole page: nothing matched
            await cache.match("loader", a)
            lb = await cache.load_back("loader")
            assert not lb.handle.done()
            mine = await cache.allocate("writer", 16)
            fill_kv(cache.device_pool, mine, kv_seeds(a, PAGE), page_size=PAGE, first=0)
            out = await cache.cache_unfinished("writer", a, mine)
            # The tree's copy wins: here, the slots of a load that has not landed. Then the
            # outcome names that load, like a match would, and after it the pages are right.
            not_landed = bad_prefix_pages(cache, a, out.device_slots)
            assert out.pending or not not_landed, (
                f"cache_unfinished handed back {list(out.device_slots)}: not landed, no handle"
            )
            for handle in out.pending:
                await handle.wait_async(1)
            assert bad_prefix_pages(cache, a, out.device_slots) == 0
            await lb.handle.wait_async(1)
            await cache.release_many(["writer", "loader"])

    run_virtual(main)


def test_load_back_after_another_load_brought_up_the_top_of_the_prefix():
    async def main():
        cfg = virtual_config(
            device_tokens=32, host_tokens=128, write_policy="write_through", load_back_threshold=0
        )
        async with HiCache(cfg) as cache:
            a = np.arange(16, dtype=np.int64)
            await _only_in_l2(cache, a)
            m = await cache.match("late", a)  # 16 tokens in L2
            assert m.device_len == 0 and m.host_len == 16
            await cache.match("early", a[:8])
            early = await cache.load_back("early")  # the first 8 go up to L1 for "early"
            await early.handle.wait_async(1)
            lb = await cache.load_back("late")  # loads the other 8 ... as its first 8
            if lb.handle is not None:
                await lb.handle.wait_async(1)
            bad = bad_prefix_pages(cache, a, lb.device_slots)
            assert bad == 0, (
                f"load_back gave {len(lb.device_slots)} slots ({lb.loaded_tokens} "
                f"loaded): {bad} pages hold the KV of other positions"
            )
            await cache.release_many(["early", "late"])

    run_virtual(main)


def test_load_back_after_another_request_cached_the_top_of_the_prefix():
    async def main():
        cfg = virtual_config(
            device_tokens=32, host_tokens=128, write_policy="write_through", load_back_threshold=0
        )
        async with HiCache(cfg) as cache:
            a = np.arange(16, dtype=np.int64)
            await _only_in_l2(cache, a)
            m = await cache.match("late", a)
            assert m.device_len == 0 and m.host_len == 16
            await cache.match("other", a[:3])  # computes the first 8 tokens again
            mine = await cache.allocate("other", 8)
            fill_kv(cache.device_pool, mine, kv_seeds(a, PAGE), page_size=PAGE, first=0)
            await cache.cache_finished("other", a[:8], mine)
            lb = await cache.load_back("late")
            if lb.handle is not None:
                await lb.handle.wait_async(1)
            bad = bad_prefix_pages(cache, a, lb.device_slots)
            assert bad == 0, (
                f"load_back gave {len(lb.device_slots)} slots ({lb.loaded_tokens} "
                f"loaded): {bad} pages hold the KV of other positions"
            )
            await cache.release("late")

    run_virtual(main)


def test_a_prefetch_landing_after_load_back_leaves_the_prefix_alone():
    from hicache.backends.memory import MemoryBackend, MemoryStore
    from hicache.testing.simulation import cache_namespace

    store = MemoryStore()
    a = np.arange(32, dtype=np.int64)

    async def main():
        cfg = virtual_config(
            device_tokens=64,
            host_tokens=256,
            write_policy="write_through",
            prefetch_threshold=PAGE,
            model_id="regression",
        )
        ns = cache_namespace(cfg)
        async with HiCache(cfg, backend=MemoryBackend(namespace=ns, store=store)) as warm:
            await ScriptedScheduler(warm, compute=synthetic_compute(warm)).run([[("w", a)]])
            await warm.flush()  # `a` is in L3
        slow = FaultyBackend(MemoryBackend(namespace=ns, store=store), BackendFaults(latency=0.5))
        async with HiCache(cfg, backend=slow) as cache:
            await cache.match("r", a)
            assert (await cache.prefetch("r", a)).state == "running"
            # meanwhile another request computes and caches the first 16 tokens in L1
            await ScriptedScheduler(
                cache, compute=synthetic_compute(cache), wait_prefetch=False
            ).run([[("s", a[:16])]])
            lb = await cache.load_back("r")  # r goes on without waiting for its prefetch
            first = len(lb.device_slots)
            mine = await cache.allocate("r", 32 - first)
            fill_kv(cache.device_pool, mine, kv_seeds(a, PAGE), page_size=PAGE, first=first)
            await anyio.sleep(5)  # virtual time (run_virtual): r's prefetch lands, re-matches r
            await cache.cache_unfinished("r", a, np.concatenate([lb.device_slots, mine]))
            await cache.release("r")

    run_virtual(main)


def test_cache_finished_returns_the_trees_own_slots():
    async def main():
        async with HiCache(virtual_config()) as cache:
            a = np.arange(8, dtype=np.int64)
            for rid in ("x", "y"):
                await cache.match(rid, a[:3])
            xs = await cache.allocate("x", 8)
            ys = await cache.allocate("y", 8)
            for slots in (xs, ys):
                fill_kv(cache.device_pool, slots, kv_seeds(a, PAGE), page_size=PAGE, first=0)
            await cache.cache_finished("x", a, xs)
            out = await cache.cache_finished("y", a, ys)  # y's pages duplicate x's: freed
            m = await cache.match("z", a)
            await cache.release("z")
            assert np.array_equal(out.device_slots, m.device_slots), (
                f"cache_finished returned {list(out.device_slots)}, the tree holds "
                f"{list(m.device_slots)}"
            )

    run_virtual(main)
