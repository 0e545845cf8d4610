"""`HybridCache`: hicache for models that mix full attention with sliding-window or recurrent
layers. It wraps a `HiCache` and keeps one promise: a hit is never longer than every layer
group can resume from (groups.py's rule), in L1, L2 and L3.

K/V of every attention layer is cached as usual (whole pages, every position, so any shorter
hit still finds its window). Recurrent states are kept as snapshot chains (states.py), in the
K/V cache below their prefix's node or, given `states=`, in a cache of their own keyed by the
prefix's digest (snapshots.py hides which): a match looks for the deepest snapshot within the
K/V it found and cuts the hit there; without one the hit is 0. A snapshot is read out of its
pool while a lookup-only request (a probe) locks it, then that request is released; the
hit's K/V stays locked by the caller's request as with `HiCache.match`. A model with no layer
kept as pages runs over a pool of 0 layers: its pages are tokens alone and its snapshots,
all a hit resumes from, are in a states cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.cache import HiCache, Salt
from hicache.hybrid.groups import HybridModel
from hicache.hybrid.snapshots import Chain, Snapshots, loaded_back, probe_id
from hicache.hybrid.states import DIGEST_TOKENS, TOKEN_LIMIT, state_model_id, state_pages
from hicache.kernels.pools import DevicePool
from hicache.results import CacheOutcome, InvalidRequest, MatchOutcome
from hicache.types import RequestId

__all__ = ["HybridCache", "HybridHit", "HybridPrefetch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridHit:
    """What a request may reuse: `length` tokens (every group can resume there), their K/V
    in `device_slots` (locked for `rid` until `cache_*` or `release`, landed), and `state`,
    the snapshot after token `length - 1` (None without stateful groups or when
    `length` is 0). `kv_len`: the K/V the cache held before the groups' rule cut it;
    `device_hit`: tokens of the hit that were in L1 at the match (the rest came from L2,
    where a prefetch from L3 also lands); `probes`: snapshot chains looked up.
    `snapshot_hint`: with stateful groups, the point up to which K/V is cached when that is
    deeper than the hit (the branch where this prompt leaves what was cached before): a
    snapshot kept there while this request prefills lets the next prompt sharing the prefix
    resume from it. None otherwise. `state_tier`: where the snapshot was found ("device",
    or "host": loaded back from L2 for the read)."""

    rid: RequestId
    length: int
    device_slots: np.ndarray
    state: bytes | None
    kv_len: int
    device_hit: int = 0
    probes: int = 0
    snapshot_hint: int | None = None
    state_tier: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridPrefetch:
    """After `prefetch`: the K/V now in L1/L2 for the tokens, and the snapshot point found
    (None: none, or no stateful groups)."""

    rid: RequestId
    kv_len: int
    snapshot: int | None


@dataclass(slots=True)
class HybridCache:
    """A `HiCache` (opened) and the model's layer groups. `states`: an opened `HiCache` of
    `state_config(cache.config, model, ...)` to keep the snapshots in (pools sized in
    snapshots, L3 values of their own); None keeps them in the K/V pools. `max_probes`:
    snapshot points a match looks at, deepest first (each is one lookup)."""

    cache: HiCache
    model: HybridModel
    max_probes: int = 8
    states: HiCache | None = None
    _pool: DevicePool = field(init=False)
    _snaps: Snapshots = field(init=False)

    def __post_init__(self) -> None:
        pool = self.cache.device_pool
        if pool.page_size != self.model.page_size:
            raise InvalidRequest(
                f"the model's page size {self.model.page_size} is not the cache's {pool.page_size}"
            )
        if pool.geometry.layers != len(self.model.pool_layers):
            raise InvalidRequest(
                f"the cache's pool has {pool.geometry.layers} layers, the model keeps "
                f"{len(self.model.pool_layers)} as pages (full, and sliding without a grid)"
            )
        if self.max_probes < 1:
            raise InvalidRequest(f"max_probes must be >= 1, got {self.max_probes}")
        self._pool = pool
        self._snaps = self._snapshot_store()

    def _snapshot_store(self) -> Snapshots:
        states = self.states
        if states is None:
            if self.model.stateful and not self.model.pool_layers:
                raise InvalidRequest(
                    "the model keeps no layer as pages, so its pool pages hold no bytes: keep "
                    "its snapshots in a states cache (states=, opened with state_config)"
                )
            pages = state_pages(self._pool, self.model.state_bytes) if self.model.stateful else 0
            return Snapshots(self.cache, self._pool, pages, self.model.state_bytes, own=False)
        if not self.model.stateful:
            raise InvalidRequest("states= given, but the model keeps no snapshots")
        if states is self.cache:
            raise InvalidRequest("states= must be a cache of its own (state_config), not the K/V's")
        cfg, kv = states.config, self.cache.config
        if cfg.page_size != DIGEST_TOKENS:
            raise InvalidRequest(
                f"the states cache's page size is {cfg.page_size}, not {DIGEST_TOKENS}: "
                "build its config with hicache.hybrid.state_config"
            )
        want = state_model_id(kv)
        if cfg.model_id != want or (cfg.tp_rank, cfg.tp_size) != (kv.tp_rank, kv.tp_size):
            raise InvalidRequest(
                f"the states cache (model_id {cfg.model_id!r}, TP rank {cfg.tp_rank} of "
                f"{cfg.tp_size}) is not the K/V cache's (model_id {want!r}, TP rank "
                f"{kv.tp_rank} of {kv.tp_size}): build its config with hicache.hybrid.state_config"
            )
        pool = states.device_pool
        pages = state_pages(pool, self.model.state_bytes)
        return Snapshots(states, pool, pages, self.model.state_bytes, own=True)

    # ------------------------------------------------------------------ lookups
    async def match(
        self, rid: RequestId, tokens: Sequence[int] | np.ndarray, *, salt: Salt = None
    ) -> HybridHit:
        """The longest prefix every layer group can resume from, locked for `rid`, its K/V
        in L1 (L2 parts loaded back and landed) and its snapshot read."""
        arr = self._tokens(tokens)
        found = await self.cache.match(rid, arr, salt=salt)
        kv_len = found.device_len + found.host_len
        length = top = self.model.cap(len(arr), kv_len)
        state: bytes | None = None
        points: list[int] = []
        tier: str | None = None
        slots = found.device_slots
        if self.model.stateful:
            points = self.model.candidates(len(arr), kv_len, self.max_probes)
            async with self._snaps.looked_up(rid, arr, points, salt) as chains:
                length, state, tier, slots = await self._resume(rid, found, chains)
        elif length > len(slots):
            slots = await loaded_back(self.cache, rid, self._last_layer)
            length = self.model.usable(len(arr), len(slots))  # what landed, if not all
        for handle in found.pending:
            await handle.wait_async(self._last_layer)
        if len(slots) != length:  # the request's cached prefix is the hit: move its lock there
            slots = (await self.cache.match(rid, arr[:length], salt=salt)).device_slots
            if len(slots) < length:  # not expected: the lock kept them in L1; resume from 0
                length = 0
                slots = (await self.cache.match(rid, arr[:0], salt=salt)).device_slots
        return HybridHit(
            rid=rid,
            length=length,
            device_slots=np.asarray(slots[:length]),
            state=state if length else None,
            kv_len=kv_len,
            device_hit=min(found.device_len, length),
            probes=len(points),
            snapshot_hint=top if self.model.stateful and top > length else None,
            state_tier=tier if length and state is not None else None,
        )

    async def _resume(
        self, rid: RequestId, found: MatchOutcome, chains: list[Chain]
    ) -> tuple[int, bytes | None, str | None, np.ndarray]:
        """(length, state, its tier, the request's device slots) at the deepest point whose
        snapshot and K/V both land in L1, or 0. `load_back_threshold` weighs the tokens a
        load saves against the deepest point that needs none (`floor`), not the tokens it
        moves: a chain of a page or two in L2 below a prefix in L1 can be the whole hit."""
        device = found.device_len
        free = [
            c for c in chains if c.whole and c.point <= device and (self._snaps.own or c.in_device)
        ]
        floor = free[0].point if free else 0  # a states cache's own loads always run
        worth = max(1, self.cache.config.load_back_threshold)
        slots, loaded = found.device_slots, False
        for chain in chains:
            if not chain.whole or (chain.point > floor and chain.point - floor < worth):
                continue
            state = await self._snaps.read(chain)
            if state is None:
                continue
            if chain.point > len(slots) and not loaded:
                slots, loaded = (
                    await loaded_back(self.cache, rid, self._last_layer, threshold=0),
                    True,
                )
            if chain.point > len(slots):
                continue  # L1 could not take the K/V: a shallower point may still be whole
            return chain.point, state, "device" if chain.in_device else "host", slots
        return 0, None, None, slots

    async def prefetch(
        self, rid: RequestId, tokens: Sequence[int] | np.ndarray, *, salt: Salt = None
    ) -> HybridPrefetch:
        """Fetch from L3 into L2 the K/V of `tokens` and the deepest snapshot within it
        (looked for as `match` does), waiting as the cache's prefetch policy says."""
        arr = self._tokens(tokens)
        await self.cache.match(rid, arr, salt=salt)
        await self.cache.prefetch(rid, arr, salt=salt)
        await self.cache.prefetch_wait(rid)
        found = await self.cache.match(rid, arr, salt=salt)
        kv_len = found.device_len + found.host_len
        points = self.model.candidates(len(arr), kv_len, self.max_probes)
        snapshot = await self._snaps.fetch(rid, arr, points, salt)
        return HybridPrefetch(rid=rid, kv_len=kv_len, snapshot=snapshot)

    # ------------------------------------------------------------------ caching
    async def allocate(self, rid: RequestId, num_tokens: int) -> np.ndarray:
        return await self.cache.allocate(rid, num_tokens)

    async def release(self, rid: RequestId) -> None:
        await self.cache.release(rid)

    async def cache_finished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        snapshots: Mapping[int, bytes] | None = None,
        salt: Salt = None,
    ) -> tuple[CacheOutcome, tuple[int, ...]]:
        """`HiCache.cache_finished`, then keep each snapshot `{point: state}` (the state after
        token point - 1). Returns the outcome and the points kept (a point whose prefix left
        L1 meanwhile, or that found no room, is skipped: a later hit is only shorter)."""
        return await self._cache(rid, tokens, device_slots, snapshots, salt, finished=True)

    async def cache_unfinished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        snapshots: Mapping[int, bytes] | None = None,
        salt: Salt = None,
    ) -> tuple[CacheOutcome, tuple[int, ...]]:
        """`HiCache.cache_unfinished` (a chunked prefill's chunk), then keep the snapshots."""
        return await self._cache(rid, tokens, device_slots, snapshots, salt, finished=False)

    async def _cache(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        snapshots: Mapping[int, bytes] | None,
        salt: Salt,
        *,
        finished: bool,
    ) -> tuple[CacheOutcome, tuple[int, ...]]:
        arr = self._tokens(tokens)
        snaps = dict(snapshots or {})
        self._check_snapshots(snaps, len(arr))
        # K/V that comes with a snapshot goes to L2 with it, whatever the write policy: an L2
        # copy of either alone cannot be resumed from
        backup = bool(snaps)
        if finished:
            out = await self.cache.cache_finished(rid, arr, device_slots, salt=salt, backup=backup)
        else:
            out = await self.cache.cache_unfinished(
                rid, arr, device_slots, salt=salt, backup=backup
            )
        points = sorted(snaps)
        kept = [
            point
            for point, (key, base) in zip(points, self._snaps.keys(arr, points), strict=True)
            if await self._snaps.keep(probe_id(rid, point), key, base, snaps[point], salt)
        ]
        return out, tuple(kept)

    @property
    def _last_layer(self) -> int:
        return self._pool.geometry.layers - 1

    def _check_snapshots(self, snaps: Mapping[int, bytes], n_tokens: int) -> None:
        if snaps and not self.model.stateful:
            raise InvalidRequest(
                "snapshots given, but the model keeps none (no recurrent or windowed sliding group)"
            )
        page = self.model.page_size
        for point, state in snaps.items():
            if not 0 < point <= n_tokens or point % page:
                raise InvalidRequest(
                    f"snapshot point {point} must be a multiple of the page size {page} "
                    f"in (0, {n_tokens}]"
                )
            if len(state) != self.model.state_bytes:
                raise InvalidRequest(
                    f"snapshot at {point} has {len(state)} bytes, the model declares "
                    f"{self.model.state_bytes}"
                )

    def _tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1:
            raise InvalidRequest(f"tokens must be a 1-D sequence of ids, got shape {arr.shape}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
            raise InvalidRequest(
                f"token ids must be in [0, {TOKEN_LIMIT}) (ids above are the cache's own)"
            )
        return arr
