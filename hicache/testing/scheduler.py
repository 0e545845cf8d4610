"""A scripted, step-by-step scheduler over a `HiCache`: the smallest serving loop, for tests.

A script is a list of steps; each step names the requests that run in it (id and full token
list). Per step the scheduler matches, prefetches (when storage is on), loads back, allocates,
"computes" through a callback that writes KV for the new tokens, and caches every request as
finished. It returns one `StepRecord` per request so a test can assert on hits and slots.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hicache.cache import HiCache
from hicache.results import Retention
from hicache.types import RequestId

# compute(rid, tokens, all_slots, first_new): write KV for tokens[first_new:] into all_slots
Compute = Callable[[RequestId, np.ndarray, np.ndarray, int], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    rid: RequestId
    tokens: int
    device_hit: int  # tokens found in L1 at match time
    loaded: int  # tokens brought back from L2 (L3 prefetches land in L2 first)
    computed: int  # tokens the step had to compute
    prefetch_state: str


class ScriptedScheduler:
    def __init__(
        self,
        cache: HiCache,
        *,
        compute: Compute | None = None,
        wait_prefetch: bool = True,
        salt_of: Callable[[RequestId], str | None] | None = None,
        retention_of: Callable[[RequestId], Sequence[Retention]] | None = None,
    ) -> None:
        self.cache = cache
        self.compute = compute
        self.wait_prefetch = wait_prefetch
        self.salt_of = salt_of  # each request's salt (tenant); None: the shared space
        self.retention_of = retention_of  # each request's retention ranges, given at match
        self.records: list[StepRecord] = []

    async def run(
        self, script: Sequence[Sequence[tuple[str, Sequence[int] | np.ndarray]]]
    ) -> list[StepRecord]:
        for i, step in enumerate(script):
            await self.step(i, [(RequestId(rid), np.asarray(t, dtype=np.int64)) for rid, t in step])
        return self.records

    async def step(self, index: int, requests: list[tuple[RequestId, np.ndarray]]) -> None:
        cache = self.cache
        salt = {rid: self.salt_of(rid) if self.salt_of else None for rid, _ in requests}
        salted = [(rid, tokens, salt[rid]) for rid, tokens in requests]
        retention = self.retention_of or (lambda rid: ())
        matches = await cache.match_many([(*item, retention(item[0])) for item in salted])
        states = {rid: "none" for rid, _ in requests}
        if cache.backend is not None:
            await cache.prefetch_many(salted)
            if self.wait_prefetch:
                for rid, _ in requests:
                    states[rid] = (await cache.prefetch_wait(rid)).state
        loads = await cache.load_back_many([rid for rid, _ in requests])
        news = await cache.allocate_many(
            [
                (rid, len(tokens) - len(lb.device_slots))
                for (rid, tokens), lb in zip(requests, loads)
            ]
        )
        items = []
        for (rid, tokens), m, lb, new in zip(requests, matches, loads, news):
            if lb.handle is not None:
                await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
            slots = np.concatenate([lb.device_slots, new])
            first = len(lb.device_slots)
            if self.compute is not None:
                result = self.compute(rid, tokens, slots, first)
                if result is not None:
                    await result
            items.append((rid, tokens, slots, True, salt[rid]))
            self.records.append(
                StepRecord(
                    step=index,
                    rid=rid,
                    tokens=len(tokens),
                    device_hit=m.device_len,
                    loaded=lb.loaded_tokens,
                    computed=len(tokens) - first,
                    prefetch_state=states[rid],
                )
            )
        await cache.cache_many(items)
