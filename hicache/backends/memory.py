"""`memory`: framed page values in a process-local dict, for tests and single-process runs.

Values are kept as framed bytes (header + payload), so the read path checks them exactly
like a remote store would. Capacity rule: storing a value evicts the least recently used
values (by get or put) until the framed total fits `capacity_bytes`; a value larger than the
whole capacity is not stored (a failed set, not an error). By default the capacity is half the
memory available when the store is made (`default_capacity`), so a long run cannot take the
process's memory; `capacity_bytes=None` means unbounded. Calls run inline (no threads): a dict
needs none, and deterministic runs need their absence.

Expiry: a value put with `ttl` seconds is a miss (and dropped) once `clock()` (monotonic by
default) has passed its deadline; expired values are also the first to go when the capacity
needs room.

Several backends (e.g. two cache instances in one test) share values by being given the same
`MemoryStore`; `clear` then removes only the caller's namespace.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from hicache.backends.base import EventSink
from hicache.backends.keys import Namespace
from hicache.backends.simple import SimpleStoreBackend
from hicache.sizing import available_memory

DEFAULT_FRACTION = 0.5
"""Of the memory available at construction, what a `MemoryStore` holds at most by default."""


def default_capacity() -> int | None:
    """`DEFAULT_FRACTION` of the available memory (None, unbounded, where it is unknown)."""
    free = available_memory()
    return None if free is None else max(1, int(free * DEFAULT_FRACTION))


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT_CAPACITY"


DEFAULT_CAPACITY: Any = _Default()
"""`capacity_bytes`' default: `default_capacity()` when the store is made."""


class MemoryStore:
    """A dict of framed values with an optional LRU byte capacity and per-value expiry.
    Thread-safe; every method but `get`'s recency update leaves other keys alone."""

    enforces_ttl = True

    def __init__(
        self,
        capacity_bytes: int | None = DEFAULT_CAPACITY,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes is DEFAULT_CAPACITY:
            capacity_bytes = default_capacity()
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ValueError(
                f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._deadlines: dict[str, float] = {}  # only values put with a ttl
        self._clock = clock
        self._bytes = 0
        self.peak_bytes = 0  # the most framed bytes ever held
        self._lock = threading.Lock()
        self.evictions = 0  # values dropped to stay within capacity

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if self._expired(key, self._clock()):
                self._drop(key)
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._values and not self._expired(key, self._clock())

    def put(self, key: str, value: bytes, ttl: float | None = None) -> bool:
        """Store `value` (expiring `ttl` seconds from now, if given; a ttl <= 0 only removes
        the old value); False when it alone exceeds the capacity (nothing changes then)."""
        size = len(value)
        with self._lock:
            if self.capacity_bytes is not None and size > self.capacity_bytes:
                return False
            self._drop(key)
            if ttl is not None and ttl <= 0:
                return True
            self._values[key] = bytes(value)
            self._bytes += size
            if ttl is not None:
                self._deadlines[key] = self._clock() + ttl
            if self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                now = self._clock()
                for expired in [k for k in self._deadlines if self._expired(k, now)]:
                    self._drop(expired)
                    self.evictions += 1
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                self._drop(next(iter(self._values)))
                self.evictions += 1
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _expired(self, key: str, now: float) -> bool:
        deadline = self._deadlines.get(key)
        return deadline is not None and deadline <= now

    def _drop(self, key: str) -> None:
        old = self._values.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._deadlines.pop(key, None)

    def scan(self, prefix: str) -> Iterator[str]:
        with self._lock:
            return iter([k for k in self._values if k.startswith(prefix)])

    @property
    def nbytes(self) -> int:
        """Framed bytes held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def check_integrity(self) -> None:
        with self._lock:
            assert self._bytes == sum(len(v) for v in self._values.values()), "byte total drifted"
            if self.capacity_bytes is not None:
                assert self._bytes <= self.capacity_bytes, "over capacity"


class MemoryBackend(SimpleStoreBackend):
    """The in-process backend: a SimpleStoreBackend over a MemoryStore, inline."""

    store: MemoryStore

    def __init__(
        self,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        store: MemoryStore | None = None,
        capacity_bytes: int | None = DEFAULT_CAPACITY,
    ) -> None:
        if store is not None and capacity_bytes is not DEFAULT_CAPACITY:
            raise ValueError(
                "give either store or capacity_bytes, not both (the store has its own capacity)"
            )
        super().__init__(
            store if store is not None else MemoryStore(capacity_bytes),
            namespace=namespace,
            emit=emit,
            threads=0,
        )

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> MemoryBackend:
        """Spec `memory`. Options: `store` (a shared MemoryStore), `capacity_bytes` (default:
        half the available memory; None: unbounded)."""
        if spec != "memory":
            raise ValueError(f"memory backend spec is exactly 'memory', got {spec!r}")
        unknown = set(options) - {"store", "capacity_bytes"}
        if unknown:
            raise TypeError(
                f"unknown memory backend options {sorted(unknown)}; known: capacity_bytes, store"
            )
        return cls(namespace=namespace, emit=emit, **options)

    def stats(self) -> dict[str, int | float]:
        out = dict(super().stats())
        out["evictions"] = self.store.evictions
        out["stored_bytes"] = self.store.nbytes
        out["peak_stored_bytes"] = self.store.peak_bytes
        out["max_bytes"] = self.store.capacity_bytes or 0  # 0: unbounded
        return out
