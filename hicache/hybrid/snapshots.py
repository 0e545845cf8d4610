"""Where a hybrid model's recurrent snapshots live, and how they are found, read, fetched and
kept (states.py has their page format).

Two homes, one behaviour: in the K/V cache itself, a snapshot's key is its prefix followed by
sentinel pages, so its chain hangs below the prefix's node; in a states cache of its own
(`state_config`), the key is the prefix's digest followed by sentinels and the state fills
every page of it. Either way a snapshot is looked up, locked and read under a probe request id
of its own, found only whole, and a missing or partial chain is no snapshot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import torch

from hicache.cache import HiCache, Salt
from hicache.hybrid.states import prefix_digests, read_state, state_key, write_state
from hicache.kernels.pools import DevicePool
from hicache.results import CapacityError, MatchOutcome
from hicache.types import RequestId

__all__ = ["Chain", "Snapshots", "loaded_back", "probe_id"]


def probe_id(rid: RequestId, point: int) -> RequestId:
    """The request id of a snapshot lookup or store: NUL-led, so no caller's id equals it."""
    return RequestId(f"\0hybrid-state:{rid!r}:{point}")


async def loaded_back(
    cache: HiCache, rid: RequestId, last_layer: int, *, threshold: int | None = None
) -> np.ndarray:
    """`load_back` of the request's L2-only part in `cache`, landed: its device slots."""
    back = await cache.load_back(rid, threshold=threshold)
    if back.handle is not None:
        await back.handle.wait_async(last_layer)
    return back.device_slots


@dataclass(frozen=True, slots=True)
class Chain:
    """One snapshot's lookup: the state after the first `point` tokens, looked up under
    `probe`; its pages are `[base, end)` of the key `found` matched."""

    point: int
    probe: RequestId
    base: int
    end: int
    found: MatchOutcome

    @property
    def whole(self) -> bool:
        """L1 and L2 hold every page of it."""
        return self.found.device_len + self.found.host_len >= self.end

    @property
    def in_device(self) -> bool:
        """L1 holds every page of it: read without a load."""
        return self.found.device_len >= self.end


@dataclass(frozen=True, slots=True)
class Snapshots:
    """Snapshots of `state_bytes` in `cache` (its device `pool`), `pages` pages each; `own`:
    a states cache (digest keys, `base` 0) rather than the K/V cache (prefix keys, `base` the
    prefix's length)."""

    cache: HiCache
    pool: DevicePool
    pages: int
    state_bytes: int
    own: bool

    def keys(self, arr: np.ndarray, points: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """(key, base) of the snapshot after arr[:p], for each of `points`, in order."""
        page = self.pool.page_size
        if not self.own:
            return [(state_key(arr[:p], self.pages, page), p) for p in points]
        digests = prefix_digests(arr, points)
        return [(state_key(digests[p], self.pages - 1, page), 0) for p in points]

    @property
    def last_layer(self) -> int:
        return self.pool.geometry.layers - 1

    @asynccontextmanager
    async def looked_up(
        self, rid: RequestId, arr: np.ndarray, points: list[int], salt: Salt
    ) -> AsyncIterator[list[Chain]]:
        """The chains of the snapshots after arr[:p] for each of `points`, in order, all
        looked up in one call, each under its own probe id; every probe is released on
        leaving."""
        probes = [probe_id(rid, p) for p in points]
        keys = self.keys(arr, points)
        try:
            outs = await self.cache.match_many(
                (probe, key, salt) for probe, (key, _) in zip(probes, keys, strict=True)
            )
            yield [
                Chain(point, probe, base, len(key), out)
                for point, probe, (key, base), out in zip(points, probes, keys, outs, strict=True)
            ]
        finally:
            if probes:
                await self.cache.release_many(probes)

    async def read(self, chain: Chain) -> bytes | None:
        """The snapshot in a chain found whole (its L2 part loaded into L1 for the read,
        however short: the hit depends on it); None when it cannot be had or is not a state
        of this geometry."""
        if not chain.whole:
            return None
        slots = chain.found.device_slots
        if len(slots) < chain.end:
            slots = await loaded_back(self.cache, chain.probe, self.last_layer, threshold=0)
            if len(slots) < chain.end:
                return None
        for handle in chain.found.pending:
            await handle.wait_async(self.last_layer)
        return read_state(self.pool, slots[chain.base : chain.end], self.state_bytes)

    async def fetch(
        self, rid: RequestId, arr: np.ndarray, points: list[int], salt: Salt
    ) -> int | None:
        """Fetch from L3 the deepest of `points` whose snapshot can be had whole; that point,
        or None. One point at a time, deepest first, each waited for."""
        for point, (key, _) in zip(points, self.keys(arr, points), strict=True):
            probe = probe_id(rid, point)
            try:
                have = await self.cache.match(probe, key, salt=salt)
                if have.device_len + have.host_len < len(key):
                    # a chain is a page or two, below any threshold, and worth it whole
                    await self.cache.prefetch(probe, key, salt=salt, threshold=0)
                    await self.cache.prefetch_wait(probe)
                    have = await self.cache.match(probe, key, salt=salt)
            finally:
                await self.cache.release(probe)
            if have.device_len + have.host_len >= len(key):
                return point
        return None

    async def keep(
        self, probe: RequestId, key: np.ndarray, base: int, state: bytes, salt: Salt
    ) -> bool:
        """Keep one snapshot under `key`, its first `base` tokens (the prefix, in the K/V
        cache) already cached; False when it cannot be now."""
        cache, pool = self.cache, self.pool
        finished = False
        try:
            found = await cache.match(probe, key, salt=salt)
            have = found.device_len + found.host_len
            if have >= len(key):
                return True  # kept already (the same prefix gives the same state)
            if have != base:  # the prefix left, or part of an old chain is still kept:
                return False  # skip (that part is a leaf, evicted first; a later store works)
            slots = found.device_slots
            if len(slots) < base:
                slots = await loaded_back(cache, probe, self.last_layer)
                if len(slots) != base:
                    return False
            try:
                fresh = await cache.allocate(probe, len(key) - base)
            except CapacityError:
                return False
            write_state(pool, fresh, state)
            if pool.device.type == "cuda":  # the copies the cache makes run on its streams
                torch.cuda.current_stream(pool.device).synchronize()
            # backed up now whatever the write policy: a state is demoted before it can leave
            # L1, and in the K/V cache its prefix's pages go to L2 with it
            both = np.concatenate([slots[:base], fresh])
            await cache.cache_finished(probe, key, both, salt=salt, backup=True)
            finished = True  # the probe is forgotten: nothing to release
            return True
        finally:
            if not finished:
                await cache.release(probe)
