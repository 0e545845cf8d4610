"""The allocator prepares the host pool chunk by chunk and leases each chunk to the tree: the
cache serves from the first chunk on, L2 grows to the whole pool, a chunk that cannot be
pinned is withheld (never used, never waited for), and close takes the pool back."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import torch

from hicache import HiCache
from hicache.components.allocator.actor import AllocatorActor
from hicache.kernels import DevicePool, HostPool, MHAGeometry
from hicache.messages import HostSlotsReady
from hicache.observability import EventLog
from hicache.runtime import Actor, ActorSystem
from hicache.testing import ScriptedScheduler, run_virtual, synthetic_compute, virtual_config

CHUNK = 1 << 20  # bytes: 4096 tokens of the geometry below
HOST = 16384  # tokens: 4 MiB, four chunks


def chunked_config(**overrides: Any):
    # 256 bytes a token (1 layer, K and V, 1 head of 64 float16): pages of 4 KiB, no header room
    base: dict[str, Any] = dict(
        device="cpu",
        kv="mha:1:1:64:float16",
        page_size=16,
        device_tokens=1024,
        host_tokens=HOST,
        host_chunk_bytes=CHUNK,
        write_policy="write_through",
    )
    return virtual_config(**{**base, **overrides})


def allocator_events(log: EventLog) -> list[dict[str, Any]]:
    return [e for e in log.events if e["event"].startswith("allocator.")]


def test_the_cache_serves_from_the_first_chunk_and_l2_grows_to_the_whole_pool():
    def run() -> tuple[Any, list[dict[str, Any]], Any]:
        log = EventLog(capture=True)

        async def main():
            async with HiCache(chunked_config(), log=log) as cache:
                first = await cache.stats()
                assert first.host.size == 4096  # only the first chunk is the tree's yet
                sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
                tokens = np.arange(512, dtype=np.int64)
                records = await sched.run([[("a", tokens)], [("b", tokens + 5000)]])
                assert [r.computed for r in records] == [512, 512]  # served meanwhile
                served = await cache.stats()
                assert served.host.used > 0  # written through to what L2 had then
                await cache.system.sleep(1.0)  # virtual: the other chunks are prepared
                whole = await cache.stats()
                assert (whole.host.size, whole.host.used) == (HOST, served.host.used)
                allocator = cache.system.actors["allocator"]
                assert allocator.leased == HOST and allocator.tables()["chunks_pending"] == 0
                tree = cache.system.actors["tree"].controller.tiers.ledgers["host"]
                tree.check_integrity()
            return cache.close_report, allocator

        report, allocator = run_virtual(main)
        return report, allocator_events(log), allocator

    report, events, allocator = run()
    assert report["host"] == {"size": HOST, "used": 0, "available": HOST}
    assert allocator.tables() == {"chunks_pending": 0, "pinned_ranges": 0}
    leases = [(e["start"], e["stop"]) for e in events if e["event"] == "allocator.host_leased"]
    assert leases == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]
    times = [e["t"] for e in events if e["event"] == "allocator.host_leased"]
    assert times == sorted(times) and times[-1] > times[0]  # at modelled instants, in order
    assert events[-1]["event"] == "allocator.host_ready" and events[-1]["withheld"] == 0
    assert run()[1] == events  # deterministic: the same leases at the same virtual times


def test_a_pool_of_one_chunk_is_leased_whole_before_open_returns():
    async def main():
        async with HiCache(chunked_config(host_chunk_bytes=0)) as cache:
            stats = await cache.stats()
            assert stats.host.size == HOST
            assert cache.system.actors["allocator"].chunks == 1

    run_virtual(main)


def test_closing_before_the_pool_is_ready_leaves_nothing_behind():
    async def main():
        async with HiCache(chunked_config()) as cache:
            assert (await cache.stats()).host.size == 4096
        return cache.close_report, cache.system.actors["allocator"]

    report, allocator = run_virtual(main)
    assert report["host"]["used"] == 0 and report["host"]["size"] <= HOST
    assert allocator.tables()["pinned_ranges"] == 0


@pytest.mark.parametrize("cpu_transfers", ["inline", "thread"])
def test_production_mode_prepares_the_chunks_on_a_thread(cpu_transfers):
    """Real time, asyncio: the chunks are faulted in off the loop; the test waits for the
    allocator's event (bounded), not for a time."""
    log = EventLog(capture=True)

    async def main():
        ready = anyio.Event()

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "allocator.host_ready":
                ready.set()

        log.add_listener(on_event)
        cfg = chunked_config(deterministic=False, cpu_transfers=cpu_transfers)
        async with HiCache(cfg, log=log) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            await sched.run([[("a", np.arange(512, dtype=np.int64))]])
            with anyio.fail_after(60):
                await ready.wait()
            assert (await cache.stats()).host.size == HOST
            assert cache.host_pool.memory.prepared([(0, cache.host_pool.nbytes)])
        return cache.close_report

    report = anyio.run(main, backend="asyncio")
    assert report["host"]["size"] == HOST and report["host"]["used"] == 0


def test_production_mode_closes_cleanly_while_chunks_are_being_prepared():
    """Close while the preparing thread is mid-way: its last chunk finds the inboxes closed
    and is dropped (not an actor failure); the pool is whole and nothing stays pinned."""

    async def main():
        cfg = chunked_config(deterministic=False, host_chunk_bytes=4096)  # 1024 chunks
        for _ in range(3):
            async with HiCache(cfg) as cache:
                assert (await cache.stats()).host.size >= 16
            allocator = cache.system.actors["allocator"]
            assert cache.close_report is not None and cache.close_report["host"]["used"] == 0
            assert allocator.tables()["pinned_ranges"] == 0

    anyio.run(main, backend="asyncio")


# ---------------------------------------------------------------- the allocator actor alone
class FailingRuntime:
    """Stands in for cuda.bindings.runtime; fails the registrations numbered in `fail`."""

    cudaHostRegisterPortable = 1
    cudaHostRegisterMapped = 2

    def __init__(self, fail: set[int]) -> None:
        self.fail = fail
        self.calls = 0
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple[int]:
        number, self.calls = self.calls, self.calls + 1
        if number in self.fail:
            return (2,)
        self.registered.append(ptr)
        return (0,)

    def cudaHostUnregister(self, ptr: int) -> tuple[int]:
        self.unregistered.append(ptr)
        return (0,)


class TreeStandIn(Actor[HostSlotsReady]):
    def __init__(self) -> None:
        super().__init__("tree", capacity=8)
        self.leases: list[tuple[int, int, float]] = []

    async def handle(self, msg: HostSlotsReady) -> None:
        self.leases.append((msg.start, msg.stop, self.system.now()))


def pinned_pool(runtime: FailingRuntime) -> HostPool:
    device = DevicePool.allocate(MHAGeometry(1, 1, 64, torch.float16), 1024, 16)
    return HostPool(
        device, HOST, "page_first", pin_memory=True, prepare=False, runtime=runtime, header_room=0
    )


def allocator_run(runtime: FailingRuntime, *, wait: float) -> tuple[Any, TreeStandIn, EventLog]:
    log = EventLog(capture=True)
    tree = TreeStandIn()

    async def main() -> AllocatorActor:
        host = pinned_pool(runtime)
        allocator = AllocatorActor(
            host=host, tree=tree.inbox, chunk_bytes=CHUNK, modelled_rate=1e9, capacity=8
        )
        await allocator.open()
        system = ActorSystem(log=log)
        system.add(tree)
        system.add(allocator)
        async with system:
            await system.sleep(wait)
        return allocator

    return run_virtual(main), tree, log


def test_a_chunk_that_fails_to_pin_is_withheld_and_the_others_are_leased():
    runtime = FailingRuntime(fail={2})  # the third chunk's registration
    allocator, tree, log = allocator_run(runtime, wait=1.0)
    assert [(a, b) for a, b, _ in tree.leases] == [(0, 4096), (4096, 8192), (12288, 16384)]
    assert allocator.withheld == {8192: 12288}
    failed = [e for e in log.events if e["event"] == "allocator.pin_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "warning"
    assert (failed[0]["start"], failed[0]["stop"]) == (8192, 12288)
    assert "cudaHostRegister failed" in failed[0]["reason"]
    ready = [e for e in log.events if e["event"] == "allocator.host_ready"]
    assert ready and ready[0]["withheld"] == 4096 and ready[0]["leased"] == 3 * 4096
    # Each lease arrives once its chunk's modelled preparation (1 MiB at 1 GB/s) has passed.
    assert [round(t, 6) for _, _, t in tree.leases] == [0.0, 0.001049, 0.003146]
    # Close takes the pool back: every registration undone, none left.
    assert allocator.tables()["pinned_ranges"] == 3
    assert allocator.release() == 3
    assert sorted(runtime.unregistered) == sorted(runtime.registered)
    assert allocator.tables() == {"chunks_pending": 0, "pinned_ranges": 0}
    assert allocator.release() == 0


def test_a_first_chunk_that_fails_to_pin_falls_back_to_the_whole_pool(monkeypatch):
    from hicache.kernels import pinning

    real_zeros = torch.zeros  # torch's pinned allocator needs CUDA: plain memory stands in

    def zeros(*shape: Any, dtype: Any = None, pin_memory: bool = False, **kw: Any) -> Any:
        return real_zeros(*shape, dtype=dtype, **kw)

    monkeypatch.setattr(pinning.torch, "zeros", zeros)
    runtime = FailingRuntime(fail={0})
    allocator, tree, log = allocator_run(runtime, wait=1.0)
    assert [(a, b) for a, b, _ in tree.leases] == [(0, HOST)]  # at once, before the start
    ready = [e for e in log.events if e["event"] == "allocator.host_ready"]
    assert ready[0]["pinning"].startswith("torch: cudaHostRegister failed")
    assert allocator.release() == 0 and runtime.registered == []


def test_stopping_mid_preparation_leaves_no_registration_behind():
    runtime = FailingRuntime(fail=set())
    allocator, tree, _ = allocator_run(runtime, wait=0.0015)  # two chunks ready by then
    assert [(a, b) for a, b, _ in tree.leases] == [(0, 4096), (4096, 8192)]
    assert allocator.release() == len(runtime.registered) == 2
    assert sorted(runtime.unregistered) == sorted(runtime.registered)
    assert allocator.tables()["pinned_ranges"] == 0
