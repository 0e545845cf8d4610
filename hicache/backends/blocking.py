"""Where a backend's blocking calls run: worker threads under a bounded limiter, or inline.

Inline mode calls the function on the event loop's thread: slower for real I/O but free of
thread scheduling, which deterministic (virtual-time) runs need. A `BlockingRunner` belongs
to one backend and is used from one event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")
R = TypeVar("R")


class BlockingRunner:
    """Runs blocking work for a backend. `threads=0` means inline; otherwise at most
    `threads` calls of this runner are in worker threads at once."""

    def __init__(self, threads: int) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads must be an int >= 0 (0 = inline), got {threads!r}")
        self.threads = threads
        self._limiter = anyio.CapacityLimiter(threads) if threads else None

    @property
    def inline(self) -> bool:
        return self._limiter is None

    async def run(self, fn: Callable[..., R], *args: object) -> R:
        """`fn(*args)` in a worker thread (or inline); cancellation waits for the thread."""
        if self._limiter is None:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`[fn(x) for x in items]`, the items split into contiguous stripes, one worker-thread
        call per stripe (so a batch costs at most `threads` thread hops, not one per item)."""
        if not items:
            return []
        if self._limiter is None or len(items) == 1:
            return await self.run(_apply_all, fn, items)
        n = min(self.threads, len(items))
        bounds = [len(items) * i // n for i in range(n + 1)]
        results: list[list[R]] = [[] for _ in range(n)]

        async def stripe(i: int) -> None:
            results[i] = await self.run(_apply_all, fn, items[bounds[i] : bounds[i + 1]])

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(stripe, i)
        return [r for part in results for r in part]


def _apply_all(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    return [fn(x) for x in items]
