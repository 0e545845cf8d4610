"""`memory`: framed page values in a process-local dict, for tests and single-process runs.

Values are kept as framed bytes (header + payload), so the read path checks them exactly
like a remote store would. Capacity rule (`hicache/policies/storage.py`, `StoreBook`): a value
that fits beside the framed total under `capacity_bytes` is stored; one that does not is
offered to the store policy (`policy=`, default `DEFAULT_STORE_POLICY`), which may refuse it
or name the values to evict until it fits. A refused value is dropped as if evicted at once:
the set succeeds (an uploader would retry a failed one, offering it again) and `refused`
counts it. A value larger than the whole capacity is not stored (a failed set, not an error). Gets are reads and misses for the policy,
`contains` a probe. By default the capacity is half the memory available when the store is
made (`default_capacity`), so a long run cannot take the process's memory;
`capacity_bytes=None` means unbounded. Calls run inline (no threads): a dict needs none, and
deterministic runs need their absence.

Expiry: a value put with `ttl` seconds is a miss (and dropped) once `clock()` (monotonic by
default) has passed its deadline; expired values are also the first to go when the capacity
needs room (found through a heap of deadlines: a put costs O(values dropped), not a scan).

Several backends (e.g. two cache instances in one test) share values by being given the same
`MemoryStore`; `clear` then removes only the caller's namespace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hicache.backends.base import EventSink
from hicache.backends.deadlines import Deadlines
from hicache.backends.keys import Namespace
from hicache.backends.simple import SimpleStoreBackend
from hicache.policies.storage import DEFAULT_STORE_POLICY, StoreBook
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
    """A dict of framed values under a `StoreBook` (a byte cap and its admission and eviction
    policy) and per-value expiry. Thread-safe."""

    enforces_ttl = True

    def __init__(
        self,
        capacity_bytes: int | None = DEFAULT_CAPACITY,
        *,
        policy: str = DEFAULT_STORE_POLICY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes is DEFAULT_CAPACITY:
            capacity_bytes = default_capacity()
        self._book = StoreBook(policy, capacity_bytes)  # checks both
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._values: dict[str, bytes] = {}
        self._deadlines = Deadlines()  # only values put with a ttl
        self._clock = clock
        self.peak_bytes = 0  # the most framed bytes ever held
        self._lock = threading.Lock()
        self.evictions = 0  # values dropped to stay within capacity (expired ones included)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if self._expired(key, self._clock()):
                self._drop(key)
            self._book.read(key)  # a hit is a read for the policy, a miss a miss
            return self._values.get(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            if self._expired(key, self._clock()):
                self._drop(key)
            return self._book.probe(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` of each key, under one hold of the lock."""
        with self._lock:
            if len(self._deadlines):
                now = self._clock()
                for key in keys:
                    if self._expired(key, now):
                        self._drop(key)
            read = self._book.read
            values = self._values
            out = []
            for key in keys:
                read(key)
                out.append(values.get(key))
            return out

    def put(self, key: str, value: bytes, ttl: float | None = None) -> bool:
        """Store `value` (expiring `ttl` seconds from now, if given; a ttl <= 0 only removes
        the old value); False when it alone exceeds the capacity (nothing changes then). A
        value the policy does not admit is not kept (`refused` counts it) but the put is not
        a failure: True. Costs O(values evicted), amortised."""
        with self._lock:
            return self._put(key, value, ttl)

    def put_many(
        self, keys: Sequence[str], values: Sequence[bytes], ttl: float | None = None
    ) -> list[bool]:
        """`put` of each key and value, in order, under one hold of the lock."""
        with self._lock:
            if (ttl is None or ttl > 0) and self._book.fits(sum(map(len, values))):
                return self._put_fitting(keys, values, ttl)
            put = self._put
            return [put(key, value, ttl) for key, value in zip(keys, values)]

    def _put_fitting(
        self, keys: Sequence[str], values: Sequence[bytes], ttl: float | None
    ) -> list[bool]:
        """`_put` of each, for a batch that fits whole beside what is held (no admission, no
        eviction: `StoreBook.write_fitting`)."""
        peak = self._book.write_fitting(zip(keys, map(len, values)))
        store, deadlines = self._values, self._deadlines
        deadline = None if ttl is None else self._clock() + ttl
        for key, value in zip(keys, values):
            store[key] = value if type(value) is bytes else bytes(value)
            if deadline is not None:
                deadlines.set(key, deadline)
            elif len(deadlines):
                deadlines.drop(key)
        if peak > self.peak_bytes:
            self.peak_bytes = peak
        return [True] * len(keys)

    def _put(self, key: str, value: bytes, ttl: float | None) -> bool:
        size = len(value)
        book = self._book
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return False
        if ttl is not None and ttl <= 0:
            self._drop(key)
            return True
        old = self._values.get(key)
        growth = size - (len(old) if old is not None else 0)
        if not book.fits(growth):
            self._drop_expired(self._clock())
        evicted = book.write(key, size)
        if evicted is None:
            # Not admitted: a decision, not a failure. Dropped like a value evicted at
            # once (an uploader retries a failed set, which would undo the decision).
            self._drop(key)
            return True
        if evicted:
            for victim in evicted:
                self._forget(victim)
            self.evictions += len(evicted)
        self._values[key] = value if type(value) is bytes else bytes(value)
        if ttl is None:
            self._deadlines.drop(key)
        else:
            self._deadlines.set(key, self._clock() + ttl)
        held = book.held_bytes
        if held > self.peak_bytes:
            self.peak_bytes = held
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _expired(self, key: str, now: float) -> bool:
        deadline = self._deadlines.get(key)
        return deadline is not None and deadline <= now

    def _drop_expired(self, now: float) -> None:
        """Drop every value whose deadline has passed: O(values dropped + stale rows)."""
        for key in self._deadlines.due(now):
            self._drop(key)
            self.evictions += 1

    def _drop(self, key: str) -> None:
        if key in self._values:
            self._book.remove(key)
            self._forget(key)

    def _forget(self, key: str) -> None:
        """The value of `key` (no longer in the book) is gone."""
        del self._values[key]
        self._deadlines.drop(key)

    def scan(self, prefix: str) -> Iterator[str]:
        with self._lock:
            return iter([k for k in self._values if k.startswith(prefix)])

    @property
    def nbytes(self) -> int:
        """Framed bytes held."""
        return self._book.held_bytes

    @property
    def refused(self) -> int:
        """Writes the policy did not admit."""
        return self._book.refused

    def __len__(self) -> int:
        return len(self._values)

    def check_integrity(self) -> None:
        with self._lock:
            book = self._book
            assert book.held_bytes == sum(len(v) for v in self._values.values()), (
                "byte total drifted"
            )
            assert len(book) == len(self._values) and all(k in book for k in self._values), (
                "the book and the values disagree"
            )
            assert self._deadlines.keys() <= self._values.keys(), "a deadline without a value"
            assert self._deadlines.rows() <= 2 * len(self._deadlines) + 64, "stale rows grew"
            if self.capacity_bytes is not None:
                assert book.held_bytes <= self.capacity_bytes, "over capacity"
            check = getattr(book.policy, "check_integrity", None)
            if callable(check):
                check()


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
        policy: str | None = None,
    ) -> None:
        if store is not None and (capacity_bytes is not DEFAULT_CAPACITY or policy is not None):
            raise ValueError(
                "give either store or capacity_bytes and policy, not both (the store has its "
                "own capacity and policy)"
            )
        super().__init__(
            store
            if store is not None
            else MemoryStore(capacity_bytes, policy=policy or DEFAULT_STORE_POLICY),
            namespace=namespace,
            emit=emit,
            threads=0,
        )

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> MemoryBackend:
        """Spec `memory`. Options: `store` (a shared MemoryStore), `capacity_bytes` (default:
        half the available memory; None: unbounded), `policy` (a store policy's name, default
        `DEFAULT_STORE_POLICY`)."""
        if spec != "memory":
            raise ValueError(f"memory backend spec is exactly 'memory', got {spec!r}")
        unknown = set(options) - {"store", "capacity_bytes", "policy"}
        if unknown:
            raise TypeError(
                f"unknown memory backend options {sorted(unknown)}; known: capacity_bytes, "
                "policy, store"
            )
        return cls(namespace=namespace, emit=emit, **options)

    def stats(self) -> dict[str, int | float]:
        out = dict(super().stats())
        out["evictions"] = self.store.evictions
        out["refused"] = self.store.refused
        out["stored_bytes"] = self.store.nbytes
        out["peak_stored_bytes"] = self.store.peak_bytes
        out["max_bytes"] = self.store.capacity_bytes or 0  # 0: unbounded
        return out
