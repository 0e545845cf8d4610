"""`ActorSystem.call_later` on asyncio without the sequencer runs on the loop's own timers (no task
per timer): the same contract as the task-based timers trio and deterministic mode use."""

from __future__ import annotations

import anyio
import pytest

from hicache.runtime import ActorFailed, ActorSystem


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # trio's timers are tasks (tests/actors/test_virtual_time.py and others)


@pytest.mark.anyio
async def test_timers_fire_in_order_and_cancel() -> None:
    fired: list[str] = []
    last = anyio.Event()

    def late() -> None:
        fired.append("late")
        last.set()

    with anyio.fail_after(10):
        async with ActorSystem() as system:
            assert system._loop is not None
            system.call_later(0.02, late)
            system.call_later(0, lambda: fired.append("soon"))
            dropped = system.call_later(0.01, lambda: fired.append("dropped"))
            dropped.cancel()
            assert dropped.cancelled
            first = system.call_later(0, lambda: fired.append("first"))
            await last.wait()  # the latest timer: every earlier one has had its turn
            assert first.fired and not first.cancelled
    assert fired == ["soon", "first", "late"]
    assert not system._loop_timers


@pytest.mark.anyio
async def test_pending_timers_are_cancelled_at_close() -> None:
    fired: list[int] = []
    with anyio.fail_after(10):
        async with ActorSystem() as system:
            handle = system.call_later(60, lambda: fired.append(1))
    assert handle.cancelled and not fired
    assert not system._loop_timers


@pytest.mark.anyio
async def test_a_raising_timer_stops_the_kernel_under_its_name() -> None:
    def broken() -> None:
        raise OSError("copy lost")

    with anyio.fail_after(10), pytest.raises(ActorFailed) as info:
        async with ActorSystem() as system:
            system.call_later(0, broken)
            later = system.call_later(0.5, lambda: None)
            await anyio.sleep_forever()
    assert isinstance(info.value.cause, OSError) and info.value.actor.startswith("timer:")
    assert later.cancelled
