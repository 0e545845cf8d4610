"""A storage backend wrapper that injects latency, failures, outages and corruption, for tests
of how the cache degrades: every fault must end as a miss or a retry, never as wrong KV."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from hicache.backends.base import PageBuffer, StorageBackend


@dataclass(slots=True)
class BackendFaults:
    """What to inject. Call counters are per method and start at 0; all faults are
    deterministic (no randomness) so a failing test replays exactly."""

    latency: float = 0.0  # seconds per call, on the kernel's clock (virtual in tests)
    down: bool = False  # every call fails as if the server were unreachable
    fail_sets: set[int] = field(default_factory=set)  # set_from call numbers that store nothing
    fail_gets: set[int] = field(default_factory=set)  # get_into call numbers that read nothing


class FaultyBackend:
    """Wraps a real backend; `faults` may be changed between calls by the test."""

    def __init__(self, inner: StorageBackend, faults: BackendFaults | None = None) -> None:
        self.inner = inner
        self.faults = faults or BackendFaults()
        self.calls: dict[str, int] = {"exists": 0, "get_into": 0, "set_from": 0}

    async def _enter(self, method: str) -> int:
        n = self.calls[method]
        self.calls[method] = n + 1
        if self.faults.latency:
            await anyio.sleep(self.faults.latency)
        return n

    async def exists(self, keys: Sequence[str]) -> int:
        await self._enter("exists")
        return 0 if self.faults.down else await self.inner.exists(keys)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        n = await self._enter("get_into")
        if self.faults.down or n in self.faults.fail_gets:
            return 0
        return await self.inner.get_into(keys, targets)

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        n = await self._enter("set_from")
        if self.faults.down or n in self.faults.fail_sets:
            return 0
        return await self.inner.set_from(keys, sources)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def clear(self) -> None:
        await self.inner.clear()

    def stats(self) -> Mapping[str, int | float]:
        return {**self.inner.stats(), **{f"calls_{k}": v for k, v in self.calls.items()}}

    async def aclose(self) -> None:
        await self.inner.aclose()
