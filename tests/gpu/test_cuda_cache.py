"""The whole cache with its pools on a GPU: deterministic mode (virtual streams moving bytes with
the CUDA engine) and production mode (CUDA streams), every page that comes back checked byte
for byte. Skipped where no GPU exists."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from hicache import HiCache
from hicache.kernels import cuda_driver_status
from hicache.observability import EventLog
from hicache.testing import (
    ScriptedScheduler,
    bad_prefix_pages,
    run_virtual,
    synthetic_compute,
    virtual_config,
)

usable, why = cuda_driver_status()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (usable and torch.cuda.is_available()), reason=f"no usable CUDA device: {why}"
    ),
]

SPIN = 200_000_000  # GPU cycles of the long kernel (about 0.1 s)


def conversation(turn: int, base: int) -> np.ndarray:
    return np.arange(base, base + 12 * (turn + 1), dtype=np.int64)


async def multi_turn(cache: HiCache) -> None:
    sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
    script = [[(f"c{c}t{t}", conversation(t, 1000 * c))] for t in range(3) for c in range(3)]
    records = await sched.run(script)
    assert any(r.loaded for r in records), "no turn loaded its prefix back from L2"
    for c in range(3):
        tokens = conversation(2, 1000 * c)
        await cache.match(f"check{c}", tokens)
        lb = await cache.load_back(f"check{c}")
        if lb.handle is not None:
            await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
        assert bad_prefix_pages(cache, tokens, lb.device_slots) == 0
        await cache.release(f"check{c}")


def test_deterministic_mode_on_the_gpu():
    log = EventLog(capture=True)

    async def main():
        cfg = virtual_config(
            device="cuda", device_tokens=48, host_tokens=256, write_policy="write_through"
        )
        async with HiCache(cfg, log=log) as cache:
            assert cache.device_pool.device.type == "cuda"
            await multi_turn(cache)
        return cache.close_report

    report = run_virtual(main)
    assert report["device"]["used"] == 0
    (selected,) = [e for e in log.events if e["event"] == "streams.selected"]
    assert selected["kind"] == "virtual" and "CUDA engine" in selected["reason"]


def test_deterministic_runs_agree_on_the_gpu():
    """The same seed gives the same events on the GPU (what virtual time promises)."""

    def events():
        log = EventLog(capture=True)

        async def main():
            cfg = virtual_config(
                device="cuda", device_tokens=48, host_tokens=256, write_policy="write_through"
            )
            async with HiCache(cfg, log=log) as cache:
                await multi_turn(cache)

        run_virtual(main)
        return [(e["event"], e.get("t")) for e in log.events]

    assert events() == events()


def test_production_mode_backup_waits_for_the_compute_that_wrote():
    """A long kernel is queued, then the compute writes the request's KV behind it,
    cache_finished backs it up (write_through) at once: what comes back from L2 is what the
    compute wrote."""

    async def main():
        cfg = virtual_config(
            device="cuda",
            deterministic=False,
            device_tokens=48,
            host_tokens=256,
            write_policy="write_through",
        )
        async with HiCache(cfg) as cache:
            fill = synthetic_compute(cache)

            def slow_compute(rid, tokens, slots, first):
                torch.cuda._sleep(SPIN)  # the writes below run after it, on the same stream
                fill(rid, tokens, slots, first)

            sched = ScriptedScheduler(cache, compute=slow_compute)
            tokens = conversation(1, 0)
            await sched.run([[("a", tokens)]])
            await cache.flush()
            await cache.clear(["device"])
            await cache.match("check", tokens)
            lb = await cache.load_back("check")
            assert lb.loaded_tokens > 0 and lb.handle is not None
            await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
            torch.cuda.synchronize()
            assert bad_prefix_pages(cache, tokens, lb.device_slots) == 0
            await cache.release("check")

    anyio.run(main, backend="asyncio")


def test_the_replays_link_reference_is_a_pinned_copy_to_the_gpu():
    from hicache.cli.replay.link import measure_link

    ref = measure_link("auto", nbytes=64 << 20)
    assert "pinned copy" in ref.what and ref.rate > 1e9, ref
