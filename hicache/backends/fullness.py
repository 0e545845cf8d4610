"""A store that answered "full": stop writing for a while instead of failing every page.

A full filesystem (ENOSPC, EDQUOT), a Redis server out of memory with no eviction policy, a
Mooncake store with no segment space: each refuses every write until something leaves. Writing
on page by page turns one condition into thousands of errors and keeps the cache's uploads
busy. `WriteGate` is the backend's switch for it: after a "full" answer, writes are refused
at once, with no I/O, for a backoff that doubles while the store stays full (`FIRST_BACKOFF`
up to `LONGEST_BACKOFF`) and resets on the first write that lands. Reads are never gated.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

FIRST_BACKOFF = 0.05
LONGEST_BACKOFF = 5.0
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_full_error(exc: BaseException) -> bool:
    """A filesystem's "no space" (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


class WriteGate:
    """Open until the store says it is full; then closed for a growing backoff."""

    __slots__ = ("_backoff", "_clock", "_until", "full_answers", "refused_pages", "streaks")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._until = float("-inf")
        self._backoff = FIRST_BACKOFF
        self.full_answers = 0  # "full" answers (batches that met a full store)
        self.streaks = 0  # times the store went from accepting to full
        self.refused_pages = 0  # pages not written because the gate was closed

    def is_open(self) -> bool:
        return self._clock() >= self._until

    def refuse(self, pages: int) -> None:
        self.refused_pages += pages

    def full(self) -> bool:
        """The store said full: close for the current backoff, then double it. Calls that
        were in flight when it closed and answer full meanwhile change nothing. True when
        this began a streak (the caller reports it once)."""
        self.full_answers += 1
        now = self._clock()
        if now < self._until:
            return False
        began = self._backoff == FIRST_BACKOFF
        self.streaks += began
        self._until = now + self._backoff
        self._backoff = min(self._backoff * 2, LONGEST_BACKOFF)
        return began

    def landed(self) -> bool:
        """A write landed: the next full answer starts a new streak. True when this ended
        a streak (for a `storage.writes_resumed` event)."""
        ended = self._backoff != FIRST_BACKOFF
        self._backoff = FIRST_BACKOFF
        return ended
