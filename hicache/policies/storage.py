"""Which values a store at its cap takes and keeps: the L3 admission and eviction policies.

A policy is pure bookkeeping over keys and sizes (no I/O, no clock): the store tells it what
it wrote, read, missed and removed, asks it whether to take a value it does not hold
(`admit`) and, when it needs room, which value goes next (`pop_victim`, one at a time, so
freeing room costs O(values removed)). The memory store, the file store's index and the
sizing sweep's model of L3 all run the same policy object, so the sweep predicts what a
capped store keeps.

Not thread-safe: the store that owns a policy serialises calls (under its own lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

__all__ = [
    "DEFAULT_STORE_POLICY",
    "STORE_POLICIES",
    "LruStore",
    "StorePolicy",
    "make_store_policy",
]


class StorePolicy(Protocol):
    """The store's book of the values it holds, in the order it would give them up."""

    name: str

    @property
    def held_bytes(self) -> int:
        """Bytes of the values held (as given to `insert`)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def keys(self) -> Iterator[str]:
        """The keys held, in no promised order (a rescan compares them with the disk)."""
        ...

    def admit(self, key: str, size: int) -> bool:
        """Whether a write of `key` (not held) should be stored now. Pure: a refused write is
        not held, and a later offer of the same key may be admitted."""
        ...

    def insert(self, key: str, size: int) -> None:
        """`key` was written and is held now (again, if it was: its size is replaced)."""
        ...

    def touch(self, key: str) -> None:
        """A held `key` was read (ignored for a key not held)."""
        ...

    def missed(self, key: str) -> None:
        """A read or probe did not find `key` (admission policies remember it)."""
        ...

    def remove(self, key: str) -> int:
        """`key` is gone (deleted, expired, corrupt); its size, 0 if it was not held."""
        ...

    def pop_victim(self) -> tuple[str, int] | None:
        """The next value to give up, removed from the book: (key, size); None when empty."""
        ...


class LruStore:
    """Least recently used (read or written) goes first; every write is admitted."""

    name = "lru"
    __slots__ = ("_held", "_order")

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterator[str]:
        return iter(self._order)

    def admit(self, key: str, size: int) -> bool:
        return True

    def insert(self, key: str, size: int) -> None:
        old = self._order.pop(key, None)
        self._held += size - (old or 0)
        self._order[key] = size

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def missed(self, key: str) -> None:
        return None

    def remove(self, key: str) -> int:
        size = self._order.pop(key, None)
        if size is None:
            return 0
        self._held -= size
        return size

    def pop_victim(self) -> tuple[str, int] | None:
        if not self._order:
            return None
        key, size = self._order.popitem(last=False)
        self._held -= size
        return key, size


STORE_POLICIES: Mapping[str, Callable[[], StorePolicy]] = MappingProxyType({"lru": LruStore})
DEFAULT_STORE_POLICY = "lru"


def make_store_policy(name: str) -> StorePolicy:
    """A fresh policy by name (ValueError naming the known ones for another)."""
    try:
        factory = STORE_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown store policy {name!r}; known: {', '.join(sorted(STORE_POLICIES))}"
        ) from None
    return factory()
