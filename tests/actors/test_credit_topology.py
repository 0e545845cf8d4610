"""Credits keep a bounded cycle deadlock-free: a toy topology with every channel saturated.

    front --Job (blocking)--> hub --Cmd (credited)--> worker --Progress (blocking)--> auditor
                               ^                         |
                               +---Done (send_nowait)----+

The hub holds `HUB_RESERVE` credits (a plain count, as the tree does): it never has more
commands in flight than the room reserved for their completions in its own inbox, so the
worker's `send_nowait` of a completion always finds room even while the front keeps the hub's
ordinary capacity full. The control
variant drops the credits (blocking sends both ways, no reserve) and deadlocks.
"""

from collections import deque
from dataclasses import dataclass

import anyio
import pytest

from hicache.runtime import Actor, ActorFailed, ActorSystem, Reply, run_deterministic


@dataclass(frozen=True, slots=True)
class Job:
    n: int
    reply: Reply[int]


@dataclass(frozen=True, slots=True)
class Done:
    n: int


@dataclass(frozen=True, slots=True)
class Cmd:
    n: int


@dataclass(frozen=True, slots=True)
class Progress:
    n: int


HUB_CAPACITY, HUB_RESERVE, WORKER_CAPACITY, AUDITOR_CAPACITY = 2, 2, 1, 1
JOBS = 24


class Hub(Actor[Job | Done]):
    def __init__(self, worker: Actor[Cmd], *, credited: bool, reserve: int) -> None:
        super().__init__("hub", capacity=HUB_CAPACITY, reserve=reserve)
        self.worker = worker
        self.credits = (
            HUB_RESERVE if credited else None
        )  # commands the hub may still have in flight
        self.waiting: deque[Job] = deque()  # jobs admitted but not yet commanded
        self.in_flight: dict[int, Reply[int]] = {}
        self.most_in_flight = 0

    async def handle(self, msg: Job | Done) -> None:
        match msg:
            case Job():
                await self.system.sleep(
                    0.1
                )  # admitting a job takes time: the front keeps up the pressure
                self.waiting.append(msg)
            case Done(n=n):
                if self.credits is not None:
                    self.credits += 1  # the completion is received: its credit comes back
                self.in_flight.pop(n).set(n * n)
        await self.pump()

    async def pump(self) -> None:
        while self.waiting and (self.credits is None or self.credits > 0):
            if self.credits is not None:
                self.credits -= 1
            job = self.waiting.popleft()
            self.in_flight[job.n] = job.reply
            self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
            await self.worker.inbox.send(Cmd(job.n))  # may wait: the worker always drains


class Worker(Actor[Cmd]):
    def __init__(self, auditor: Actor[Progress], *, credited: bool) -> None:
        super().__init__("worker", capacity=WORKER_CAPACITY)
        self.auditor = auditor
        self.credited = credited
        self.hub: Actor[Job | Done] | None = None

    async def handle(self, msg: Cmd) -> None:
        assert self.hub is not None
        await self.system.sleep(0.25 * (1 + msg.n % 3))
        await self.auditor.inbox.send(Progress(msg.n))  # backpressure from a slow leaf
        if self.credited:
            self.hub.inbox.send_nowait(Done(msg.n))  # the credit guarantees room
        else:
            await self.hub.inbox.send(Done(msg.n))


class Auditor(Actor[Progress]):
    def __init__(self) -> None:
        super().__init__("auditor", capacity=AUDITOR_CAPACITY)
        self.seen = 0

    async def handle(self, msg: Progress) -> None:
        await self.system.sleep(1.0)
        self.seen += 1


def build(system: ActorSystem, *, credited: bool, reserve: int) -> tuple[Hub, Worker, Auditor]:
    auditor = Auditor()
    worker = Worker(auditor, credited=credited)
    hub = Hub(worker, credited=credited, reserve=reserve)
    worker.hub = hub
    for actor in (hub, worker, auditor):
        system.add(actor)
    return hub, worker, auditor


async def drive(system: ActorSystem, hub: Hub) -> list[int]:
    """The front: floods the hub with blocking sends, then collects every answer."""
    replies = []
    for n in range(JOBS):
        reply = system.reply()
        replies.append(reply)
        await hub.inbox.send(Job(n, reply))
    return [await reply.wait() for reply in replies]


def run(seed: int, *, credited: bool, reserve: int) -> dict[str, object]:
    async def main() -> dict[str, object]:
        system = ActorSystem()
        hub, worker, auditor = build(system, credited=credited, reserve=reserve)
        with anyio.fail_after(10_000):  # virtual seconds: a deadlock surfaces as TimeoutError
            async with system:
                answers = await drive(system, hub)
                stats = {a.name: a.inbox.statistics() for a in (hub, worker, auditor)}
        return {
            "answers": answers,
            "stats": stats,
            "most_in_flight": hub.most_in_flight,
            "audited": auditor.seen,
        }

    return run_deterministic(main, seed=seed)


def test_credited_cycle_completes_with_every_channel_saturated():
    reserve_used = False
    for seed in range(8):
        result = run(seed, credited=True, reserve=HUB_RESERVE)
        assert result["answers"] == [n * n for n in range(JOBS)], seed
        assert result["audited"] == JOBS
        assert result["most_in_flight"] == HUB_RESERVE  # the credit limit was reached...
        stats = result["stats"]
        hub, worker, auditor = stats["hub"], stats["worker"], stats["auditor"]
        # ...and every channel ran full: its ordinary bound was reached and senders waited
        assert hub.high_water >= HUB_CAPACITY and hub.blocked_sends > 0, seed
        assert worker.high_water == WORKER_CAPACITY, seed
        assert auditor.high_water == AUDITOR_CAPACITY and auditor.blocked_sends > 0, seed
        assert hub.high_water <= HUB_CAPACITY + HUB_RESERVE
        reserve_used |= hub.high_water > HUB_CAPACITY
    assert reserve_used  # completions did arrive while ordinary traffic filled the hub


def test_control_without_credits_the_cycle_deadlocks():
    with pytest.raises(TimeoutError):
        run(0, credited=False, reserve=0)


def test_control_credits_without_a_reserve_find_no_room():
    """Ordinary traffic shares the hub's inbox, so completions need room of their own."""
    with pytest.raises(ActorFailed) as info:
        run(0, credited=True, reserve=0)
    assert info.value.actor == "worker" and isinstance(info.value.cause, anyio.WouldBlock)
