"""Stream semantics: virtual (layer-wise landing on virtual time), CPU (order, per-layer
events, failures), selection."""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from trio.testing import MockClock

from hicache.kernels import (
    DevicePool,
    FaultPlan,
    HostPool,
    LayerNotReady,
    MHAGeometry,
    TransferFailed,
    make_streams,
)
from tests.unit.kernels.reference import naive_backup, randomize

G = MHAGeometry(layers=4, heads=2, head_dim=8, dtype=torch.float16)
LAYER_BYTES = 8 * G.bytes_per_token // G.layers  # 8 tokens per load in these tests


def pools():
    d = DevicePool.allocate(G, 16, 4)
    h = HostPool(d, 32, "page_first")
    randomize(h.buffer, np.random.default_rng(0))
    return d, h


def run_virtual(body):
    """Run body(streams, tg) on trio with a MockClock; schedule = sleep in the task group."""

    async def main():
        d, h = pools()
        async with anyio.create_task_group() as tg:

            async def later(delay, callback):
                await anyio.sleep(delay)  # virtual: the MockClock jumps, nothing waits
                callback()

            streams, selection = make_streams(
                d,
                h,
                io="kernel",
                prefer="virtual",
                bandwidth=LAYER_BYTES,  # 1 s per layer
                schedule=lambda delay, cb: tg.start_soon(later, delay, cb),
                fault=body.fault,
            )
            assert selection.kind == "virtual"
            await body(streams, d, h)
            streams.close()

    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def test_virtual_layers_land_in_order_at_model_times():
    seen = {}

    async def body(streams, d, h):
        done = []
        t0 = anyio.current_time()
        handle = streams.submit_load(np.arange(8), np.arange(4, 12), on_done=done.append)
        # copies are inline: bytes are already in place even though nothing has "landed"
        assert torch.equal(
            d.k_buffer(3)[4:12].view(torch.uint8), h.shaped()[:8, 3, 0].view(torch.uint8)
        )
        assert not handle.layer_done(0)
        with pytest.raises(LayerNotReady):
            handle.wait(0)
        for layer in range(G.layers):
            await handle.wait_async(layer)
            seen[layer] = anyio.current_time() - t0
            handle.wait(layer)  # landed: returns
            if layer + 1 < G.layers:
                assert not handle.layer_done(layer + 1)  # the next layer is still pending
                assert done == []
        await anyio.lowlevel.checkpoint()
        assert handle.done() and done == [None]

    body.fault = None
    run_virtual(body)
    assert seen == pytest.approx({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})


def test_virtual_jobs_queue_per_direction_and_backups_run_alongside():
    async def body(streams, d, h):
        events = []

        def log(name):
            return lambda error: events.append((name, anyio.current_time(), error))

        t0 = anyio.current_time()
        first = streams.submit_load(np.arange(8), np.arange(8), on_done=log("load0"))
        second = streams.submit_load(np.arange(8, 16), np.arange(8, 16), on_done=log("load1"))
        streams.submit_backup(np.arange(4), np.arange(28, 32), on_done=log("backup0"))
        await second.wait_async(0)
        assert first.done() and anyio.current_time() - t0 == pytest.approx(5.0)
        await second.wait_async(3)
        await anyio.lowlevel.checkpoint()
        got = [(n, round(t - t0, 6), e) for n, t, e in events]
        assert got == [("backup0", 2.0, None), ("load0", 4.0, None), ("load1", 8.0, None)]

    body.fault = None
    run_virtual(body)


def test_virtual_fault_fails_the_rest_and_delay_shifts_landing():
    plan = FaultPlan()
    plan.fail[("load", 0, 2)] = OSError("injected")
    plan.delay[("load", 1, 0)] = 0.5

    async def body(streams, d, h):
        done = []
        t0 = anyio.current_time()
        bad = streams.submit_load(np.arange(8), np.arange(8), on_done=done.append)
        good = streams.submit_load(np.arange(8), np.arange(8), on_done=done.append)
        await bad.wait_async(1)
        with pytest.raises(TransferFailed) as info:
            await bad.wait_async(2)
        assert isinstance(info.value.__cause__, OSError)
        assert isinstance(done[0], OSError) and not bad.done()
        await good.wait_async(0)
        assert anyio.current_time() - t0 == pytest.approx(
            3.0 + 1.5
        )  # failed at t=3, then 1 s + 0.5 s
        await good.wait_async(3)
        await anyio.lowlevel.checkpoint()
        assert done[1:] == [None]

    body.fault = plan
    run_virtual(body)


def test_cpu_layer_events_and_ordering():
    d, h = pools()
    plan = FaultPlan()
    gate = plan.gate("load", 0, 2)  # stall the first load before its layer 2
    streams, selection = make_streams(d, h, io="direct", prefer="cpu", fault=plan)
    assert selection.kind == "cpu"
    done = []
    lock = threading.Lock()

    def record(name):
        def on_done(error):
            with lock:
                done.append((name, error))

        return on_done

    first = streams.submit_load(np.arange(8), np.arange(8), on_done=record("load0"))
    second = streams.submit_load(np.arange(8, 16), np.arange(8, 16), on_done=record("load1"))
    first.wait(1)  # layers 0 and 1 landed while layer 2 is held back
    assert first.layer_done(1) and not first.layer_done(2) and not second.layer_done(0)
    assert torch.equal(d.v_buffer(1)[:8].view(torch.uint8), h.shaped()[:8, 1, 1].view(torch.uint8))
    assert not d.k_buffer(2)[:8].view(torch.uint8).any()  # layer 2 not copied yet
    gate.set()
    second.wait(3)
    streams.close()
    streams.close()  # idempotent
    assert done == [("load0", None), ("load1", None)]
    assert first.done() and second.done()
    with pytest.raises(RuntimeError, match="closed"):
        streams.submit_backup(np.arange(4), np.arange(4), on_done=record("late"))


def test_cpu_failure_is_reported_once_and_waiters_do_not_hang():
    d, h = pools()
    plan = FaultPlan(
        fail={("load", 0, 1): OSError("disk on fire"), ("backup", 0, None): ValueError("bad")}
    )
    streams, _ = make_streams(d, h, io="kernel", prefer="cpu", fault=plan)
    done = []
    handle = streams.submit_load(np.arange(8), np.arange(8), on_done=done.append)
    streams.submit_backup(np.arange(4), np.arange(4), on_done=done.append)
    handle.wait(0)
    with pytest.raises(TransferFailed):
        handle.wait(3)
    after = streams.submit_load(
        np.arange(8), np.arange(8), on_done=done.append
    )  # the queue still runs
    after.wait(3)
    streams.close()
    assert sorted(type(e).__name__ for e in done) == ["NoneType", "OSError", "ValueError"]


def test_cpu_wait_async_on_asyncio_and_bad_input_raises_at_submit():
    d, h = pools()
    streams, _ = make_streams(d, h, io="kernel", prefer="cpu")

    async def main():
        handle = streams.submit_load(np.arange(8), np.arange(8), on_done=lambda e: None)
        for layer in range(G.layers):
            await handle.wait_async(layer)
        assert handle.done()

    anyio.run(main)
    with pytest.raises(ValueError, match="appears more than once"):
        streams.submit_load(np.array([0, 1, 2, 3] * 2), np.arange(8), on_done=lambda e: None)
    streams.close()


def test_auto_selection_reports_why_not_cuda():
    d, h = pools()
    streams, selection = make_streams(d, h, io="kernel")
    streams.close()
    assert selection.kind == "cpu" and selection.requested == "auto"
    if not torch.cuda.is_available():
        assert "cudaGetDeviceCount" in selection.reason or "cuda-python" in selection.reason
    with pytest.raises(ValueError, match="bandwidth"):
        make_streams(d, h, io="kernel", prefer="virtual")
    with pytest.raises(ValueError, match="unknown stream preference"):
        make_streams(d, h, io="kernel", prefer="gpu")


def test_inline_backups_land_beside_the_loop_before_they_are_reported():
    """Inline streams queue a backup's bytes on the copy thread: its completion comes only
    once they have landed (its page then holds what a plain backup writes), in order."""
    expected_device, expected_host = pools()
    naive_backup(expected_device, expected_host, np.arange(16), np.arange(16, 32))

    def page(pool, i):  # the bytes of host page 4 + i (slots 16 + 4i ...)
        return [bytes(piece) for piece in pool.page_buffers(np.arange(16 + 4 * i, 20 + 4 * i))[0]]

    async def main():
        d, h = pools()
        done = []
        streams, selection = make_streams(
            d,
            h,
            io="kernel",
            prefer="inline",
            schedule=lambda delay, cb: asyncio.get_running_loop().call_later(delay, cb),
        )
        assert selection.kind == "inline" and "copy thread" in selection.reason

        def record(i):
            def on_done(error):  # the bytes are there when the completion says so
                done.append((i, error, page(h, i) == page(expected_host, i)))

            return on_done

        for i in range(4):  # four backups of one page each, in order
            slots = np.arange(4 * i, 4 * i + 4)
            streams.submit_backup(slots, slots + 16, on_done=record(i))
        while len(done) < 4:
            await asyncio.sleep(0)
        streams.close()
        return done

    assert asyncio.run(main()) == [(i, None, True) for i in range(4)]
