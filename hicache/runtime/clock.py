"""The one source of time. Cores never read it; actors and the actor system pass `now` down."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import anyio

from hicache.observability.events import loop_time


@runtime_checkable
class Clock(Protocol):
    """Where the actor system gets time, sleeps and timeouts from. All three must agree."""

    def now(self) -> float:
        """Seconds on a monotonic scale (origin unspecified). Never goes backwards."""
        ...

    async def sleep(self, delay: float) -> None:
        """Suspend the calling task for `delay` seconds of this clock."""
        ...

    def move_on_after(self, delay: float) -> anyio.CancelScope:
        """A cancel scope whose deadline is `delay` seconds of this clock from now."""
        ...


class MonotonicClock:
    """The event loop's own monotonic clock (anyio's `current_time`).

    On asyncio and plain trio this is real monotonic time. Under `run_deterministic` the loop's
    clock is trio's `MockClock`, so the same class reads *virtual* time: it starts at 0, and jumps
    forward whenever every task is blocked. Outside a running loop `now()` falls back to
    `time.monotonic()` (only useful for logging before a loop starts).
    """

    __slots__ = ()

    def now(self) -> float:
        return loop_time()  # the time events are stamped with by default, too

    async def sleep(self, delay: float) -> None:
        await anyio.sleep(delay)

    def move_on_after(self, delay: float) -> anyio.CancelScope:
        return anyio.move_on_after(delay)

    def __repr__(self) -> str:
        return "MonotonicClock()"


class Cancellable(Protocol):
    """What a timer runs under: a task's cancel scope or a loop timer (`ActorSystem.call_later`)."""

    def cancel(self) -> None: ...

    @property
    def cancel_called(self) -> bool: ...


class TimerHandle:
    """Returned by `ActorSystem.call_later`; `cancel()` stops a callback that has not run yet."""

    __slots__ = ("_scope", "fired")

    def __init__(self, scope: anyio.CancelScope | Cancellable) -> None:
        self._scope = scope
        self.fired = False

    def cancel(self) -> None:
        self._scope.cancel()

    @property
    def cancelled(self) -> bool:
        return self._scope.cancel_called and not self.fired
