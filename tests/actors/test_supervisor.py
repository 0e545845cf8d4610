"""Supervision: an actor raises -> event, pending replies fail with ActorFailed, everything stops."""

from dataclasses import dataclass

import anyio
import pytest

from hicache.observability import EventLog
from hicache.runtime import (
    Actor,
    ActorFailed,
    ActorSystem,
    ActorSystemClosed,
    Reply,
    run_deterministic,
)


@dataclass(frozen=True, slots=True)
class Hold:
    reply: Reply[int]


@dataclass(frozen=True, slots=True)
class Crash:
    why: str


class Hoarder(Actor[Hold]):
    """Keeps replies without answering: they are pending when the crash comes."""

    def __init__(self) -> None:
        super().__init__("hoarder", capacity=1)
        self.held: list[Reply[int]] = []
        self.stopped = False

    async def handle(self, msg: Hold) -> None:
        self.held.append(msg.reply)

    async def on_stop(self) -> None:
        self.stopped = True


class Bomb(Actor[Crash]):
    def __init__(self, *, crash_on_start: bool = False) -> None:
        super().__init__("bomb", capacity=1)
        self.crash_on_start = crash_on_start

    async def on_start(self) -> None:
        if self.crash_on_start:
            raise RuntimeError("no fuel")

    async def handle(self, msg: Crash) -> None:
        raise ValueError(msg.why)


async def crash_scenario() -> tuple[ActorSystem, EventLog, Hoarder, list[BaseException]]:
    log = EventLog(capture=True)
    system = ActorSystem(log=log)
    hoarder, bomb = Hoarder(), Bomb()
    system.add(hoarder)
    system.add(bomb)
    outcomes: list[BaseException] = []
    with anyio.fail_after(30):  # a hang guard only; the scenario itself never waits on time
        try:
            async with system:
                first = system.reply()
                await hoarder.inbox.send(Hold(first))
                second = system.reply()
                await hoarder.inbox.send(Hold(second))
                await bomb.inbox.send(Crash("boom"))
                try:
                    await second.wait()
                except ActorFailed as exc:
                    outcomes.append(exc)
                try:
                    first.result()  # already failed too; waiting would just see the cancellation
                except ActorFailed as exc:
                    outcomes.append(exc)
                await anyio.sleep_forever()  # the actor system must cancel the body too
        except ActorFailed as exc:
            outcomes.append(exc)
    return system, log, hoarder, outcomes


def check_crash(
    system: ActorSystem, log: EventLog, hoarder: Hoarder, outcomes: list[BaseException]
) -> None:
    assert len(outcomes) == 3
    for exc in outcomes:
        assert isinstance(exc, ActorFailed)
        assert exc.actor == "bomb" and isinstance(exc.cause, ValueError)
        assert str(exc) == "actor 'bomb' failed: ValueError: boom"
    assert outcomes[-1] is system.failure
    assert system.pending_replies == 0 and all(r.done for r in hoarder.held)
    assert not hoarder.stopped  # a crashed actor system cancels; on_stop is for clean stops
    failed = [e for e in log.events if e["event"] == "kernel.actor_failed"]
    assert len(failed) == 1
    assert (failed[0]["actor"], failed[0]["error"], failed[0]["message"]) == (
        "bomb",
        "ValueError",
        "boom",
    )
    assert failed[0]["level"] == "error"
    assert log.events[-1]["event"] == "kernel.stopped" and log.events[-1]["reason"] == "failure"


@pytest.mark.anyio
async def test_crash_fails_pending_replies_and_stops_everything():
    tasks_before = len(anyio.get_running_tasks())
    check_crash(*await crash_scenario())
    assert len(anyio.get_running_tasks()) == tasks_before


def test_crash_in_deterministic_mode():
    check_crash(*run_deterministic(crash_scenario))


class Stuck(Actor[Hold]):
    async def handle(self, msg: Hold) -> None:
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_blocked_sender_is_released_when_the_kernel_fails():
    system = ActorSystem()
    hoarder, bomb = Stuck("stuck", capacity=1), Bomb()
    system.add(hoarder)
    system.add(bomb)
    released: list[str] = []

    async def outsider() -> None:  # a task outside the actor system's group, stuck on a full inbox
        try:
            while True:
                await hoarder.inbox.send(Hold(Reply()))
        except ActorSystemClosed:
            released.append("closed")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            with pytest.raises(ActorFailed):
                async with system:
                    tg.start_soon(outsider)
                    await anyio.wait_all_tasks_blocked()
                    await bomb.inbox.send(Crash("x"))
                    await anyio.sleep_forever()
    assert released == ["closed"]


@pytest.mark.anyio
async def test_failure_in_on_start_is_named():
    system = ActorSystem()
    system.add(Bomb(crash_on_start=True))
    with (
        anyio.fail_after(30),
        pytest.raises(ActorFailed, match="actor 'bomb' failed: RuntimeError: no fuel"),
    ):
        async with system:
            await anyio.sleep_forever()


@pytest.mark.anyio
async def test_failure_in_helper_task_is_named():
    async def broken() -> None:
        raise OSError("stream lost")

    with anyio.fail_after(30), pytest.raises(ActorFailed) as info:
        async with ActorSystem() as system:
            system.start_soon(broken, name="transfer-stream")
            await anyio.sleep_forever()
    assert info.value.actor == "transfer-stream" and isinstance(info.value.cause, OSError)


def test_failure_in_timer_callback_and_only_first_failure_counts():
    async def main() -> ActorFailed:
        log = EventLog(capture=True)
        try:
            async with ActorSystem(log=log) as system:
                system.call_later(5, lambda: 1 / 0)
                system.call_later(5, lambda: {}["k"])  # same instant, runs second
                await anyio.sleep_forever()
        except ActorFailed as exc:
            failed = [e for e in log.events if e["event"] == "kernel.actor_failed"]
            assert [e["first"] for e in failed] == [True]
            assert failed[0]["t"] == 5.0
            return exc
        raise AssertionError("no failure")

    exc = run_deterministic(main)
    assert isinstance(exc.cause, ZeroDivisionError) and exc.actor.startswith("timer:")
