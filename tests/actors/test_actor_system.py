"""ActorSystem lifecycle on asyncio and trio: request/reply, clean shutdown, helpers, idleness."""

from dataclasses import dataclass

import anyio
import pytest

from hicache.observability import EventLog
from hicache.runtime import Actor, ActorSystem, ActorSystemClosed, Reply


@dataclass(frozen=True, slots=True)
class Add:
    amount: int


@dataclass(frozen=True, slots=True)
class Total:
    reply: Reply[int]


class Counter(Actor[Add | Total]):
    def __init__(self, name: str, capacity: int = 4) -> None:
        super().__init__(name, capacity=capacity)
        self.total = 0
        self.seen: list[int] = []
        self.lifecycle: list[str] = []

    async def on_start(self) -> None:
        self.lifecycle.append("start")

    async def handle(self, msg: Add | Total) -> None:
        match msg:
            case Add(amount=amount):
                self.total += amount
                self.seen.append(amount)
            case Total(reply=reply):
                reply.set(self.total)

    async def on_stop(self) -> None:
        self.lifecycle.append(f"stop:{len(self.seen)}")


@dataclass(frozen=True, slots=True)
class Forward:
    n: int


class Relay(Actor[Forward]):
    def __init__(self, name: str, to: Actor[Forward] | None) -> None:
        super().__init__(name, capacity=2)
        self.to = to
        self.got: list[int] = []

    async def handle(self, msg: Forward) -> None:
        self.got.append(msg.n)
        if self.to is not None:
            await self.to.inbox.send(msg)


@pytest.mark.anyio
async def test_request_reply_and_clean_shutdown_drains_the_inbox():
    tasks_before = len(anyio.get_running_tasks())
    log = EventLog(capture=True)
    system = ActorSystem(log=log)
    counter = Counter("counter")
    system.add(counter)
    async with system:
        for i in range(10):  # more than the capacity: the sends wait their turn
            await counter.inbox.send(Add(amount=i))
        assert await system.request(counter.inbox, lambda r: Total(reply=r)) == 45
        for _ in range(3):
            await counter.inbox.send(Add(amount=100))  # still queued when the block ends
    assert counter.total == 345 and counter.seen == [*range(10), 100, 100, 100]
    assert counter.lifecycle == ["start", "stop:13"]
    assert [e["event"] for e in log.events] == ["kernel.started", "actor.stopped", "kernel.stopped"]
    assert log.events[-1]["reason"] == "exit" and system.failure is None
    assert len(anyio.get_running_tasks()) == tasks_before
    with pytest.raises(ActorSystemClosed):
        await counter.inbox.send(Add(amount=1))
    with pytest.raises(ActorSystemClosed):
        system.reply()


@pytest.mark.anyio
async def test_run_until_idle_waits_for_a_chain_to_settle():
    system = ActorSystem()
    last = Relay("c", None)
    middle = Relay("b", last)
    first = Relay("a", middle)
    for actor in (first, middle, last):
        system.add(actor)
    async with system:
        for n in range(20):
            await first.inbox.send(Forward(n))
        await system.run_until_idle()
        assert last.got == list(range(20))


@pytest.mark.anyio
async def test_helper_task_feeds_an_actor_and_is_cancelled_at_shutdown():
    system = ActorSystem()
    counter = Counter("counter")
    system.add(counter)
    finished: list[str] = []

    async def feeder(n: int) -> None:
        for i in range(n):
            await counter.inbox.send(Add(amount=i))
        try:
            await anyio.sleep_forever()
        finally:
            finished.append("cancelled")

    async with system:
        system.start_soon(feeder, 5, name="feeder")
        await system.run_until_idle()
        assert counter.total == 10
    assert finished == ["cancelled"]


@pytest.mark.anyio
async def test_body_error_propagates_unchanged_and_fails_pending_replies():
    system = ActorSystem()
    system.add(Counter("counter"))
    async with system:
        pending = system.reply()
    with pytest.raises(ZeroDivisionError):
        async with ActorSystem() as other:
            lost = other.reply()
            1 / 0  # noqa: B018
    with pytest.raises(ActorSystemClosed, match="stopped before this reply was set"):
        lost.result()
    with pytest.raises(ActorSystemClosed):
        pending.result()


def test_misuse_is_rejected_with_clear_errors():
    system = ActorSystem()
    system.add(Counter("a"))
    with pytest.raises(ValueError, match="already added"):
        system.add(Counter("a"))
    with pytest.raises(TypeError, match="needs an Actor"):
        system.add(object())  # type: ignore[arg-type]
    owned = Counter("b")
    ActorSystem().add(owned)
    with pytest.raises(ValueError, match="another actor system"):
        system.add(owned)
    with pytest.raises(ValueError, match="not starting with '~'"):
        Counter("~x")
    with pytest.raises(RuntimeError, match="not been added"):
        Counter("c").system  # noqa: B018
    with pytest.raises(ValueError, match="stop_timeout"):
        ActorSystem(stop_timeout=0)


@pytest.mark.anyio
async def test_kernel_runs_once_and_adds_only_before_start():
    system = ActorSystem()
    async with system:
        with pytest.raises(RuntimeError, match="already started"):
            system.add(Counter("late"))
        with pytest.raises(ValueError, match="finite number"):
            system.call_later(-1, lambda: None)
    with pytest.raises(RuntimeError, match="runs once"):
        async with system:
            pass


@pytest.mark.anyio
async def test_outer_cancellation_stops_everything_and_propagates():
    tasks_before = len(anyio.get_running_tasks())
    log = EventLog(capture=True)
    system = ActorSystem(log=log)
    counter = Counter("counter")
    system.add(counter)
    with anyio.CancelScope() as outer:
        async with system:
            pending = system.reply()
            outer.cancel()
            await anyio.sleep_forever()
    assert outer.cancelled_caught
    assert counter.lifecycle == ["start"]  # cancelled, not a clean stop
    with pytest.raises(ActorSystemClosed):
        pending.result()
    assert log.events[-1]["event"] == "kernel.stopped" and log.events[-1]["reason"] == "cancelled"
    assert len(anyio.get_running_tasks()) == tasks_before


class Stubborn(Actor[Add]):
    """Never finishes a message: a clean stop cannot drain it."""

    async def handle(self, msg: Add) -> None:
        await anyio.sleep_forever()


def test_stop_timeout_cancels_what_will_not_stop():
    from hicache.runtime import run_deterministic

    async def main() -> tuple[list[dict], float]:
        log = EventLog(capture=True)
        system = ActorSystem(log=log, stop_timeout=45.0)
        stubborn = Stubborn("stubborn", capacity=1)
        system.add(stubborn)
        async with system:
            await stubborn.inbox.send(Add(amount=1))
        return log.events, system.now()

    events, end = run_deterministic(main)
    assert end == 45.0
    assert [e["event"] for e in events][-2:] == ["kernel.stop_timeout", "kernel.stopped"]
    assert events[-1]["reason"] == "stop_timeout"


@pytest.mark.anyio
async def test_request_to_a_closed_mailbox_leaves_no_pending_reply():
    system = ActorSystem()
    counter = Counter("counter")
    system.add(counter)
    async with system:
        counter.inbox.close()
        with pytest.raises(ActorSystemClosed):
            await system.request(counter.inbox, lambda r: Total(reply=r))
        assert system.pending_replies == 0


@pytest.mark.anyio
async def test_a_plain_thread_delivers_completions_through_threadsafe_sender():
    import threading

    import anyio.to_thread

    system = ActorSystem()
    counter = Counter("counter", capacity=8)
    system.add(counter)
    async with system:
        deliver = counter.inbox.threadsafe_sender()
        worker = threading.Thread(target=lambda: [deliver(Add(amount=i)) for i in range(1, 6)])
        worker.start()
        await anyio.to_thread.run_sync(worker.join)
        await system.run_until_idle()
        assert counter.seen == [1, 2, 3, 4, 5]
