"""Deterministic runs: trio with a MockClock, virtual time that jumps when every task is idle."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

_RUN_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hicache_run_seed", default=None
)


def run_deterministic(main: Callable[[], Awaitable[T]], *, seed: int = 0) -> T:
    """Run `main()` on anyio's trio backend under `trio.testing.MockClock(autojump_threshold=0)`.

    Time is virtual (starts at 0, jumps to the next deadline whenever every task is blocked; a
    ten-minute timeout passes in microseconds). An `ActorSystem` created inside defaults to
    deterministic mode with this `seed` (an actor system's own `seed=` argument wins). No threads or
    real I/O may be used inside: they would make the run depend on the outside world.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    from trio.testing import MockClock

    async def seeded() -> T:
        _RUN_SEED.set(seed)
        return await main()

    return anyio.run(
        seeded, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)}
    )


def deterministic_seed() -> int | None:
    """The seed of the enclosing `run_deterministic`, or None outside one."""
    return _RUN_SEED.get()


def on_trio() -> bool:
    """Whether the calling task runs under trio."""
    try:
        import trio

        trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        return False
    return True
