"""Deterministic mode's turnstile: the actor system, not the event loop, decides who runs next.

trio shuffles the order in which ready tasks run. To make a run replayable, every task the
kernel knows about resumes from a wait only through `turn()`: it files a request under a stable
key and blocks. The sequencer task waits until *every* task in the run is blocked
(`trio.testing.wait_all_tasks_blocked`), then grants exactly one request, chosen by a rule that
depends only on the keys: the smallest key (seed 0), or a pick by `random.Random(seed)` from the
sorted keys (any other seed: the schedule perturbation). Between two grants exactly one task does
observable work, so the event log is a function of (program, seed) alone.

When everything is blocked, nothing asks for a turn, and the actor system says it is idle (every
actor waits on an empty inbox, no sender waits), one `run_until_idle` waiter (oldest first) is
released. Otherwise the sequencer sleeps on `_wake`, which lets trio's MockClock jump to the next
deadline (an actor's sleep or reply timeout, a timer), whose task then asks for a turn."""

from __future__ import annotations

import contextvars
import random
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel

TURN_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("hicache_turn_key", default="~main")
"""The stable name a task files its turn requests under. Set by the actor system in every task it
starts."""


class Sequencer:
    """Grants turns one at a time. Owned by one actor system; only meaningful on trio."""

    def __init__(self, seed: int, is_idle: Callable[[], bool]) -> None:
        self.seed = seed
        self._is_idle = is_idle
        self._rng = random.Random(seed) if seed != 0 else None
        self._requests: dict[str, anyio.Event] = {}
        self._idle_waiters: deque[anyio.Event] = deque()
        self._wake: anyio.Event | None = None
        self._stopped = False
        self.turns = 0  # turns granted so far (a cheap measure of how much was sequenced)

    async def turn(self, *, keep_result: bool = False) -> None:
        """Block until the sequencer lets the calling task go on.

        `keep_result=True` (a task woken with a result in hand: a reply) shields the wait, so
        the result is not lost to a cancellation that arrives meanwhile; the cancellation lands
        at the task's next checkpoint. Otherwise a cancelled task raises here. Once the sequencer
        has stopped (the actor system's teardown), turns are free: teardown is not sequenced.
        """
        if not self._stopped:
            key = TURN_KEY.get()
            if key in self._requests:
                raise RuntimeError(
                    f"two tasks wait for a turn under the same key {key!r}; in deterministic mode "
                    "start concurrent drivers with ActorSystem.start_soon so each has its own key"
                )
            granted = anyio.Event()
            self._requests[key] = granted
            self._poke()
            try:
                with anyio.CancelScope(shield=keep_result):
                    await granted.wait()
            finally:
                if self._requests.get(key) is granted:
                    del self._requests[key]
        if not keep_result:
            await anyio.lowlevel.checkpoint_if_cancelled()

    async def wait_idle(self) -> None:
        """Block until every task is blocked and none asks for a turn."""
        idle = anyio.Event()
        self._idle_waiters.append(idle)
        self._poke()
        try:
            await idle.wait()
        finally:
            if not idle.is_set():
                self._idle_waiters.remove(idle)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _choose(self) -> str:
        keys = sorted(self._requests)
        if self._rng is None:
            return keys[0]
        return keys[self._rng.randrange(len(keys))]

    async def run(self) -> None:
        """The sequencer task: runs until cancelled by the actor system."""
        from trio.testing import wait_all_tasks_blocked

        try:
            await self._grant_forever(wait_all_tasks_blocked)
        finally:
            self._stopped = True  # release everyone: teardown after a crash is not sequenced
            for granted in self._requests.values():
                granted.set()
            for idle in self._idle_waiters:
                idle.set()

    async def _grant_forever(self, wait_all_tasks_blocked: Callable[[], Awaitable[None]]) -> None:
        while True:
            await wait_all_tasks_blocked()
            if self._requests:
                self._requests.pop(self._choose()).set()
                self.turns += 1
            elif self._idle_waiters and self._is_idle():
                self._idle_waiters.popleft().set()
            else:
                self._wake = anyio.Event()
                await self._wake.wait()
                self._wake = None
