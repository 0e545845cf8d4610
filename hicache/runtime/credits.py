"""Credits: how a sender of commands bounds what it has in flight (see docs/architecture.md)."""

from __future__ import annotations


class Credits:
    """A counter of how many more commands may be in flight toward one completion channel.

    The holder takes a credit before sending a command and gives it back when it has *received*
    the command's completion. With `limit` no larger than the completion channel's room, every
    completion finds room, so it can be delivered with a non-blocking send. Pure and synchronous;
    owned by one actor.
    """

    __slots__ = ("name", "limit", "_in_flight")

    def __init__(self, name: str, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"credits {name!r}: limit must be an int >= 1, got {limit!r}")
        self.name = name
        self.limit = limit
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def available(self) -> int:
        return self.limit - self._in_flight

    def try_take(self) -> bool:
        """Take one credit if any is left. Mutates on success only."""
        if self._in_flight >= self.limit:
            return False
        self._in_flight += 1
        return True

    def give_back(self) -> None:
        """Return one credit (a completion was received). Raises if none is out."""
        if self._in_flight == 0:
            raise RuntimeError(f"credits {self.name!r}: give_back without a credit in flight")
        self._in_flight -= 1

    def check_integrity(self) -> None:
        assert 0 <= self._in_flight <= self.limit, (self.name, self._in_flight, self.limit)

    def __repr__(self) -> str:
        return f"Credits({self.name!r}, {self._in_flight}/{self.limit})"
