"""Every channel of the cache driven to its bound at once: the run must finish (no deadlock),
every completion must find room, and the ledgers must balance after close."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from hicache import HiCache
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend
from hicache.testing import (
    BackendFaults,
    FaultyBackend,
    ScriptedScheduler,
    run_virtual,
    virtual_config,
)


@pytest.mark.parametrize("mode", ["asyncio", "virtual-0", "virtual-1", "virtual-2"])
def test_all_channels_at_capacity_no_deadlock(mode):
    deterministic = mode.startswith("virtual")
    seed = int(mode.split("-")[1]) if deterministic else 0

    async def main():
        cfg = virtual_config(
            deterministic=deterministic,
            device_tokens=256,
            host_tokens=512,
            write_policy="write_through",
            storage="memory",
            model_id="saturation",
            channel_capacity=8,
            prefetch_threshold=4,
            prefetch_policy="wait_complete",
            seed=seed,
        )
        ns = Namespace(model=cfg.model_id, kv=cfg.kv, page_size=cfg.page_size, layout=cfg.layout)
        # Slow storage keeps uploads and prefetches in flight while the frontend floods the tree.
        backend = FaultyBackend(MemoryBackend(namespace=ns), BackendFaults(latency=0.01))
        async with HiCache(cfg, backend=backend) as cache:
            # In deterministic mode concurrent drivers run as tasks of the actor system, each with
            # its own turn key; the last one to finish answers `all_done`.
            all_done = cache.system.reply()
            left = [12]

            async def client(worker: int) -> None:
                await _client(cache, worker)
                left[0] -= 1
                if not left[0]:
                    all_done.set(None)

            for worker in range(12):
                cache.system.start_soon(client, worker, name=f"client{worker:02d}")
            with anyio.fail_after(3600):  # virtual seconds: a deadlock fails, it does not hang
                await all_done.wait()
            stats = {name: actor.inbox.statistics() for name, actor in cache.system.actors.items()}
        return stats, cache.close_report

    if deterministic:
        stats, report = run_virtual(main, seed=seed)
    else:
        stats, report = anyio.run(main, backend="asyncio")
        # Real concurrency: twelve clients against an inbox of eight felt backpressure.
        assert stats["tree"].high_water >= stats["tree"].capacity, stats["tree"]
        assert stats["tree"].blocked_sends > 0
    for name, s in stats.items():
        assert s.used <= s.capacity + s.reserve, name
    assert report["device"]["used"] == 0 and report["host"]["used"] == 0


async def _client(cache: HiCache, worker: int) -> None:
    sched = ScriptedScheduler(cache)
    rng = np.random.default_rng(worker)
    for turn in range(6):
        base = int(rng.integers(0, 4)) * 1000  # shared prefixes across workers
        tokens = np.arange(base, base + 8 + 4 * int(rng.integers(0, 4)), dtype=np.int64)
        await sched.run([[(f"w{worker}t{turn}", tokens)]])
