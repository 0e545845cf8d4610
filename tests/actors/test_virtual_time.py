"""Virtual time: long timeouts elapse at once, and fire exactly once."""

import time
from dataclasses import dataclass

import pytest

from hicache.observability import EventLog
from hicache.runtime import Actor, ActorSystem, Reply, ReplyTimeout, run_deterministic

TEN_MINUTES = 600.0


@dataclass(frozen=True, slots=True)
class Ask:
    reply: Reply[str]


class Silent(Actor[Ask]):
    """Keeps the reply and answers only when told, much too late."""

    def __init__(self) -> None:
        super().__init__("silent", capacity=1)
        self.held: list[Reply[str]] = []

    async def handle(self, msg: Ask) -> None:
        self.held.append(msg.reply)


def test_ten_minute_timer_fires_once_and_instantly():
    async def main() -> tuple[list[float], float]:
        fired: list[float] = []
        async with ActorSystem() as system:
            system.call_later(TEN_MINUTES, lambda: fired.append(system.now()))
            cancelled = system.call_later(TEN_MINUTES / 2, lambda: fired.append(-1.0))
            cancelled.cancel()
            await system.sleep(3 * TEN_MINUTES)
            assert cancelled.cancelled
            return fired, system.now()

    wall = time.perf_counter()
    fired, end = run_deterministic(main)
    wall = time.perf_counter() - wall
    assert fired == [TEN_MINUTES]
    assert end == 3 * TEN_MINUTES
    assert wall < 5.0  # thirty virtual minutes; far less than a second in practice


def test_ten_minute_reply_timeout_raises_once_at_the_deadline():
    async def main() -> tuple[ReplyTimeout, float, list[dict], Silent]:
        log = EventLog(capture=True)
        silent = Silent()
        system = ActorSystem(log=log)
        system.add(silent)
        async with system:
            with pytest.raises(ReplyTimeout) as info:
                await system.request(silent.inbox, Ask, timeout=TEN_MINUTES)
            at = system.now()
            silent.held[0].set("too late")  # ignored: the requester gave up
            await system.sleep(TEN_MINUTES)
        return info.value, at, log.events, silent

    error, at, events, silent = run_deterministic(main)
    assert (error.target, error.timeout, at) == ("silent", TEN_MINUTES, TEN_MINUTES)
    assert str(error) == "no reply from 'silent' within 600 s"
    timeouts = [e for e in events if e["event"] == "kernel.reply_timeout"]
    assert len(timeouts) == 1 and timeouts[0]["t"] == TEN_MINUTES
    with pytest.raises(ReplyTimeout):
        silent.held[0].result()
