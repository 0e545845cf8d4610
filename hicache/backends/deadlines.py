"""Values' expiry deadlines, soonest first, for the stores that enforce a ttl in process (the
memory store, the file store's index).

`set`, `drop` and `due` cost O(log n) each: a heap of (deadline, key) rows beside a dict of
each key's current deadline. A row whose key was dropped or given another deadline is stale
and skipped when it comes up; once the rows pass twice the keys held (plus a floor), they are
rebuilt from the dict, so a key rewritten again and again does not grow the heap. Not
thread-safe: the owning store serialises calls.
"""

from __future__ import annotations

import heapq

_FLOOR = 64  # rows allowed beyond twice the keys before a rebuild


class Deadlines:
    __slots__ = ("_of", "_rows")

    def __init__(self) -> None:
        self._of: dict[str, float] = {}
        self._rows: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._of)

    def rows(self) -> int:
        """Heap rows, stale ones included (at most twice the keys, plus a floor)."""
        return len(self._rows)

    def get(self, key: str) -> float | None:
        return self._of.get(key)

    def keys(self) -> set[str]:
        return set(self._of)

    def set(self, key: str, deadline: float) -> None:
        if self._of.get(key) == deadline:
            return
        self._of[key] = deadline
        heapq.heappush(self._rows, (deadline, key))
        if len(self._rows) > 2 * len(self._of) + _FLOOR:
            self._rows = [(d, k) for k, d in self._of.items()]
            heapq.heapify(self._rows)

    def drop(self, key: str) -> None:
        self._of.pop(key, None)

    def clear(self) -> None:
        self._of.clear()
        self._rows.clear()

    def due(self, now: float) -> list[str]:
        """The keys whose deadline is at or before `now`, soonest first, dropped from here."""
        rows, of = self._rows, self._of
        out = []
        while rows and rows[0][0] <= now:
            deadline, key = heapq.heappop(rows)
            if of.get(key) == deadline:
                del of[key]
                out.append(key)
        return out
