"""A storage backend wrapper that injects latency, failures, outages, hangs and corruption, for
tests of how the cache degrades: every fault must end as a miss or a retry, never as wrong KV
and never as a hung cache."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from hicache.backends.base import PageBuffer, StorageBackend, enforces_ttl, set_from_ttl

METHODS = ("exists", "get_into", "set_from")


@dataclass(slots=True)
class BackendFaults:
    """What to inject. Call counters are per method and start at 0; all faults are
    deterministic (no randomness) so a failing test replays exactly.

    Order within one call: latency and `delays` first (on the actor system's clock), then a hang,
    then an outage (`down`, `outages`), then the per-call failures, then corruption."""

    latency: float = 0.0  # seconds per call, on the actor system's clock (virtual in tests)
    down: bool = False  # every call fails as if the server were unreachable
    fail_sets: set[int] = field(default_factory=set)  # set_from call numbers that store nothing
    fail_gets: set[int] = field(default_factory=set)  # get_into call numbers that read nothing
    fail_exists: set[int] = field(default_factory=set)  # exists call numbers that find nothing
    # extra seconds for one call: {("get_into", 3): 0.2} (a slow read, not a failed one)
    delays: dict[tuple[str, int], float] = field(default_factory=dict)
    # [start, end) windows, in seconds of the clock since the wrapper was made, during which
    # the backend is down (a storage outage that ends by itself)
    outages: tuple[tuple[float, float], ...] = ()
    # calls that never return (they await forever): the cache must end them with its
    # deadline (`CacheConfig.storage_timeout`). `hang` hangs every call.
    hang: bool = False
    hang_exists: set[int] = field(default_factory=set)
    hang_gets: set[int] = field(default_factory=set)
    hang_sets: set[int] = field(default_factory=set)
    # get_into call numbers whose stored values are corrupted (one byte of one page's payload
    # flipped, the middle page of the call) just before the read: the backend's checksum must
    # catch it and report a short read. Needs an inner backend whose values the wrapper can
    # reach (`memory`, a SimpleStoreBackend over a dict-like store, or `file:`).
    corrupt_gets: set[int] = field(default_factory=set)

    def is_set(self) -> bool:
        """Whether any fault is configured."""
        return bool(
            self.latency
            or self.down
            or self.fail_sets
            or self.fail_gets
            or self.fail_exists
            or self.delays
            or self.outages
            or self.hang
            or self.hang_exists
            or self.hang_gets
            or self.hang_sets
            or self.corrupt_gets
        )


_HANGS = {"exists": "hang_exists", "get_into": "hang_gets", "set_from": "hang_sets"}
_FAILS = {"exists": "fail_exists", "get_into": "fail_gets", "set_from": "fail_sets"}


class FaultyBackend:
    """Wraps a real backend; `faults` may be changed between calls by the test.

    `calls` counts calls per method; `injected` counts the faults actually applied, by kind
    (`latency`, `delay`, `hang`, `down`, `outage`, `fail_exists`, `fail_get`, `fail_set`,
    `corrupt`: pages corrupted). `clock` (default `anyio.current_time`) times the outages."""

    def __init__(
        self,
        inner: StorageBackend,
        faults: BackendFaults | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.inner = inner
        self.faults = faults or BackendFaults()
        self.calls: dict[str, int] = dict.fromkeys(METHODS, 0)
        self.injected: Counter[str] = Counter()
        self._clock = clock or anyio.current_time
        self._origin: float | None = None
        try:
            self._origin = self._clock()
        except Exception:  # noqa: BLE001 - no event loop yet: the first call sets the origin
            self._origin = None

    def _now(self) -> float:
        now = self._clock()
        if self._origin is None:
            self._origin = now
        return now - self._origin

    async def _enter(self, method: str) -> tuple[int, bool]:
        """Count the call, apply latency, delays, hangs; return (call number, down now)."""
        f = self.faults
        n = self.calls[method]
        self.calls[method] = n + 1
        if f.latency:
            self.injected["latency"] += 1
            await anyio.sleep(f.latency)
        extra = f.delays.get((method, n))
        if extra:
            self.injected["delay"] += 1
            await anyio.sleep(extra)
        if f.hang or n in getattr(f, _HANGS[method]):
            self.injected["hang"] += 1
            await anyio.sleep_forever()
        if f.down:
            self.injected["down"] += 1
            return n, True
        if f.outages:
            now = self._now()
            if any(start <= now < end for start, end in f.outages):
                self.injected["outage"] += 1
                return n, True
        if n in getattr(f, _FAILS[method]):
            self.injected[
                {"exists": "fail_exists", "get_into": "fail_get", "set_from": "fail_set"}[method]
            ] += 1
            return n, True
        return n, False

    async def exists(self, keys: Sequence[str]) -> int:
        _, failed = await self._enter("exists")
        return 0 if failed else await self.inner.exists(keys)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        n, failed = await self._enter("get_into")
        if failed:
            return 0
        if (
            n in self.faults.corrupt_gets
            and keys
            and corrupt_stored_value(self.inner, keys[len(keys) // 2])
        ):
            self.injected["corrupt"] += 1
        return await self.inner.get_into(keys, targets)

    @property
    def enforces_ttl(self) -> bool:
        return enforces_ttl(self.inner)

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        _, failed = await self._enter("set_from")
        if failed:
            return 0
        return await set_from_ttl(self.inner, keys, sources, ttl=ttl)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def clear(self) -> None:
        await self.inner.clear()

    def stats(self) -> Mapping[str, int | float]:
        return {
            **self.inner.stats(),
            **{f"calls_{k}": v for k, v in self.calls.items()},
            **{f"injected_{k}": v for k, v in self.injected.items()},
        }

    async def aclose(self) -> None:
        await self.inner.aclose()


def corrupt_stored_value(backend: Any, key: str) -> bool:
    """Flip one payload byte (the last) of `key`'s stored value in place, bypassing the
    backend's write path, so its checksum no longer matches. Returns whether a value was
    found and corrupted. Supports backends over a simple store (`backend.store` with
    get/put, e.g. `memory`) and the file backend (`backend._path(key)`)."""
    store = getattr(backend, "store", None)
    if store is not None and callable(getattr(store, "get", None)):
        value = store.get(key)
        if not value:
            return False
        flipped = bytearray(value)
        flipped[-1] ^= 0xFF
        store.put(key, bytes(flipped))
        return True
    path_of = getattr(backend, "_path", None)
    if callable(path_of):
        path = path_of(key)
        try:
            with open(path, "r+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return False
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
            return True
        except FileNotFoundError:
            return False
    raise TypeError(f"cannot reach the stored values of {type(backend).__name__} to corrupt them")
