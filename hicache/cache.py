"""`HiCache`: the facade a serving loop calls. An async context manager that has
`hicache.assembly` build the pools, cores and actors, starts the actor system, and on exit drains
in-flight work and checks that every ledger balances and every table is empty.

Every call is a request to the tree actor; the batched forms (`*_many`) carry a whole scheduler
step in one message, which is what keeps the actor path cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np
from typing_extensions import Self

from hicache.assembly import Parts, adopt_storage, assemble, open_storage
from hicache.backends.base import StorageBackend
from hicache.components.controller.agreement import RankAgreement, SingleRank
from hicache.config import CacheConfig, ConfigError
from hicache.kernels.pools import DevicePool
from hicache.messages import (
    AllocBatch,
    Asks,
    AttachStorage,
    CacheBatch,
    CacheItem,
    Clear,
    ClearStorage,
    DetachStorage,
    Drain,
    DumpTree,
    Flush,
    GetStats,
    LoadBackBatch,
    MatchBatch,
    MatchItem,
    Pin,
    PrefetchBatch,
    PrefetchPoll,
    PrefetchWait,
    ReleaseBatch,
    StorageAttachment,
    TreeInbox,
    Unpin,
)
from hicache.observability import EventLog
from hicache.results import (
    CacheOutcome,
    CacheStats,
    ClearOutcome,
    InvalidRequest,
    LoadBackOutcome,
    MatchOutcome,
    PinOutcome,
    PrefetchOutcome,
    Retention,
)
from hicache.runtime import ActorSystem, Mailbox, Reply
from hicache.runtime.errors import ActorSystemClosed
from hicache.types import RequestId

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hicache.backends.keys import Namespace
    from hicache.kernels.streams.base import FaultHook, TransferStreams
    from hicache.observability.kv_events import TreeKVEvents
    from hicache.observability.metrics import CacheMetrics

T = TypeVar("T")

Ledgers = dict[str, dict[str, int]]
"""tier -> {"size", "used", "available"}: a ledger's balance (`close_report`)."""


_POLL_INTERVAL = 0.002  # seconds between polls of TP ranks waiting for in-flight work


class LedgerImbalance(RuntimeError):
    """After close, a ledger still holds slots: something leaked."""


class BookkeepingLeak(LedgerImbalance):
    """After close, a table that grows with requests or ops still holds entries."""


class HiCache:
    """A hierarchical KV cache instance. Use as `async with HiCache(config) as cache:`."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        device_pool: DevicePool | None = None,
        log: EventLog | None = None,
        streams: TransferStreams | None = None,
        backend: StorageBackend | None = None,
        transfer_faults: FaultHook | None = None,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        self.requested_config = config or CacheConfig()
        self.config, self.rewrites = self.requested_config.resolve()
        self._device_pool = device_pool
        self._log = log
        self._streams_override = streams
        self._backend_override = backend
        self._transfer_faults = transfer_faults
        self._tp_group = tp_group
        self._agreement: RankAgreement = SingleRank()
        self._attached: Callable[[], StorageAttachment | None] = lambda: None  # see `backend`
        self._namespace: Namespace | None = None  # L3's, for `attach_storage`
        self._system: ActorSystem | None = None
        self._closed = False  # set once `async with` has ended: calls raise ActorSystemClosed
        self._streams: TransferStreams | None = None
        self._resources = AsyncExitStack()
        self._metrics: CacheMetrics | None = None
        self.kv_events: TreeKVEvents | None = None  # the KV event publisher, with `kv_events=` set
        self._tree_inbox: Mailbox[TreeInbox] | None = None
        self.close_report: Ledgers | None = None  # the ledgers after close
        self.close_tables: dict[str, int] | None = None  # the tree's tables after close

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        if self._system is not None:  # opened before: its pools and tables are gone
            raise ActorSystemClosed(
                "this HiCache was opened already (and is open or closed): a cache opens once; "
                "make a new HiCache(config) for another run"
            )
        parts = Parts(
            device_pool=self._device_pool,
            log=self._log,
            streams=self._streams_override,
            backend=self._backend_override,
            transfer_faults=self._transfer_faults,
            tp_group=self._tp_group,
        )
        built = await assemble(self.config, self.rewrites, parts)  # undoes itself on failure
        self._resources = built.resources
        try:
            self.device_pool, self.host_pool = built.device_pool, built.host_pool
            self._system, self._streams = built.system, built.streams
            self.topology, self._agreement = built.topology, built.agreement
            self._tree_inbox, self._attached = built.tree_inbox, built.attached
            self._namespace = built.namespace
            if self.config.metrics_port is not None:  # Prometheus /metrics, fed by the log
                from hicache.observability.metrics import serve_cache_metrics

                metrics = self._metrics = serve_cache_metrics(self, self.config.metrics_port)
                self._resources.callback(metrics.close)
            if self.config.kv_events is not None:  # vLLM-format KV events (docs/kv-events.md)
                from hicache.observability.kv_events import start_kv_events

                self.kv_events = start_kv_events(self.config, built.tree, built.system.log)
                if self.kv_events is not None:
                    self._resources.callback(self.kv_events.close)
            await built.system.__aenter__()
        except BaseException:
            await self._resources.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        system = self._system
        assert system is not None
        leak: LedgerImbalance | None = None
        try:
            if exc_type is None and system.failure is None:
                report, tables = await self._drain(system)
                self.close_report, self.close_tables = report, tables
                system.log.emit(
                    "cache.closed",
                    component="cache",
                    used={t: v["used"] for t, v in report.items()},
                    tables_left={name: n for name, n in tables.items() if n},
                )
                leaked = {t: v["used"] for t, v in report.items() if v["used"]}
                left = {name: n for name, n in tables.items() if n}
                if leaked:
                    leak = LedgerImbalance(f"slots still held after close: {leaked}")
                elif left:
                    leak = BookkeepingLeak(f"tables not empty after close: {left}")
        finally:
            try:
                suppress = await system.__aexit__(exc_type, exc, tb)
            finally:
                self._closed = True
                await self._resources.aclose()  # exporter, an owned backend, the streams
        if leak is not None:
            raise leak
        return suppress

    async def _drain(self, system: ActorSystem) -> tuple[Ledgers, dict[str, int]]:
        """Let in-flight work finish, for at most `close_timeout`; then abandon what is left
        (an event says what), so a hung backend cannot hold close forever."""
        timeout = self.config.close_timeout
        with system.clock.move_on_after(timeout):
            drained = await self._until(lambda r: Drain(reply=r, poll=self._polling))
            assert drained is not None  # answered once nothing is in flight
            return drained
        system.log.emit("cache.close_timeout", component="cache", level="warning", timeout=timeout)
        abandoned = await self._call(lambda r: Drain(reply=r, abandon=True))
        assert abandoned is not None  # `abandon` ends what is in flight, then answers
        return abandoned

    # ------------------------------------------------------------------ plumbing
    async def _call(self, make: Callable[[Reply[T]], Asks[T]], timeout: float | None = None) -> T:
        """Send the tree the request `make(reply)` builds; its answer (typed by the message)."""
        if self._closed:
            raise ActorSystemClosed("this HiCache is closed (its `async with` block has ended)")
        if self._system is None or self._tree_inbox is None:
            raise RuntimeError("HiCache is not open: use `async with HiCache(config) as cache`")
        inbox: Mailbox[Any] = self._tree_inbox  # every `Asks` the facade builds is a TreeInbox
        return await self._system.request(inbox, make, timeout=timeout)

    @property
    def _polling(self) -> bool:
        """TP ranks change state only at sync points (frontend calls), so a wait cannot park on
        the tree: it polls, and every rank polls the same number of times."""
        return not self._agreement.trivial

    async def _until(
        self,
        make: Callable[[Reply[T]], Asks[T]],
        *,
        done: Callable[[T], bool] = lambda value: value is not None,
    ) -> T:
        """One call; with TP, repeat it (a short real-time pause between) until `done`."""
        value = await self._call(make)
        while self._polling and not done(value):
            await anyio.sleep(_POLL_INTERVAL)
            value = await self._call(make)
        return value

    @property
    def system(self) -> ActorSystem:
        """The actor system that runs this cache's actors (open caches only)."""
        assert self._system is not None
        return self._system

    kernel = system  # the same property under the name docs/api.md lists

    # ------------------------------------------------------------------ the API
    async def match(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
        retention: Sequence[Retention] = (),
    ) -> MatchOutcome:
        """Match the longest cached page-aligned prefix and lock it for this request. With a
        `salt` (a tenant's, say), only pages cached under the same salt are found: in L1, L2
        and L3 (docs/security.md). `retention` ranges rank the request's pages for eviction
        (`Retention`): the matched ones now, the ones it caches later as they are cached."""
        (out,) = await self.match_many([(rid, tokens, salt, retention)])
        return out

    async def match_many(self, items: Iterable[MatchItemTuple]) -> tuple[MatchOutcome, ...]:
        """`(rid, tokens)`, `(rid, tokens, salt)` or `(rid, tokens, salt, retention)`."""
        batch = tuple(_match_item(item) for item in items)
        return await self._call(lambda r: MatchBatch(items=batch, reply=r))

    async def load_back(self, rid: RequestId, *, threshold: int | None = None) -> LoadBackOutcome:
        """Bring the L2-only part of the last match into L1 (skipped below the threshold).
        `threshold`: fewest L2 tokens worth loading for this call, in place of
        `load_back_threshold` (a short stretch that matters whole, say a recurrent snapshot)."""
        (out,) = await self.load_back_many([rid], threshold=threshold)
        return out

    async def load_back_many(
        self, rids: Iterable[RequestId], *, threshold: int | None = None
    ) -> tuple[LoadBackOutcome, ...]:
        if threshold is not None and not _is_index(threshold):
            raise InvalidRequest(f"load_back threshold must be an int >= 0, got {threshold!r}")
        batch = tuple(rids)
        return await self._call(lambda r: LoadBackBatch(rids=batch, reply=r, threshold=threshold))

    async def allocate(self, rid: RequestId, num_tokens: int) -> np.ndarray:
        """Device slots for new tokens, evicting L1 as needed; CapacityError if impossible.
        The array is the caller's own (writable: index device buffers with it freely)."""
        (out,) = await self.allocate_many([(rid, num_tokens)])
        return out

    async def allocate_many(self, sizes: Iterable[tuple[RequestId, int]]) -> tuple[np.ndarray, ...]:
        batch = tuple((rid, _count("allocate", n)) for rid, n in sizes)
        slots = await self._call(lambda r: AllocBatch(sizes=batch, reply=r))
        # The tree keeps the ledger's read-only array; the caller gets a copy it may write to
        # (torch warns when indexing with a read-only array) without touching the tree's.
        return tuple(np.array(s) for s in slots)

    async def cache_finished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
        backup: bool = False,
    ) -> CacheOutcome:
        """Insert a finished request's KV, free duplicates, count hits, release its lock. The
        salt must be the one it was matched under. `backup`: copy its pages (and any of its
        prefix's) without an L2 copy to L2 now, whatever the write policy."""
        item = replace(_cache_item((rid, tokens, device_slots, True, salt)), backup=backup)
        (out,) = await self._call(lambda r: CacheBatch(items=(item,), reply=r))
        return out

    async def cache_unfinished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
        backup: bool = False,
    ) -> CacheOutcome:
        """Insert a chunk of a running request (no hit count); the lock moves to the new end.
        `backup` as for `cache_finished`."""
        item = replace(_cache_item((rid, tokens, device_slots, False, salt)), backup=backup)
        (out,) = await self._call(lambda r: CacheBatch(items=(item,), reply=r))
        return out

    async def cache_many(self, items: Iterable[CacheItemTuple]) -> tuple[CacheOutcome, ...]:
        """`(rid, tokens, device_slots, finished)` or the same with the salt last."""
        batch = tuple(_cache_item(item) for item in items)
        return await self._call(lambda r: CacheBatch(items=batch, reply=r))

    async def release(self, rid: RequestId) -> None:
        """Forget a request without caching it: unlock its path, free its allocated slots."""
        await self.release_many([rid])

    async def release_many(self, rids: Iterable[RequestId]) -> None:
        batch = tuple(rids)
        await self._call(lambda r: ReleaseBatch(rids=batch, reply=r))

    async def prefetch(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
        threshold: int | None = None,
    ) -> PrefetchOutcome:
        """Start fetching, from L3 into L2, the part of `tokens` past the request's last match
        (under the salt it was matched under). Admission checks may skip it (see the outcome's
        `reason`). `threshold`: fewest tokens worth fetching for this request, in place of
        `prefetch_threshold` (a short value that matters whole, say a recurrent snapshot)."""
        if threshold is not None and not _is_index(threshold):
            raise InvalidRequest(f"prefetch threshold must be an int >= 0, got {threshold!r}")
        item = _match_item((rid, tokens, salt))
        if threshold is not None:
            item = replace(item, threshold=threshold)
        return (await self._call(lambda r: PrefetchBatch(items=(item,), reply=r)))[0]

    async def prefetch_many(self, items: Iterable[TokensItem]) -> tuple[PrefetchOutcome, ...]:
        """`(rid, tokens)` or `(rid, tokens, salt)` per request."""
        batch = tuple(_match_item(item) for item in items)
        return await self._call(lambda r: PrefetchBatch(items=batch, reply=r))

    async def prefetch_wait(self, rid: RequestId) -> PrefetchOutcome:
        """Return once the request's prefetch may end under the configured policy
        (best_effort: now, with what has arrived; wait_complete: when complete; timeout: when
        complete or timed out). What arrived is then in the tree, and the request's next
        load_back brings it into L1."""
        out = await self._call(lambda r: PrefetchWait(rid=rid, reply=r, poll=self._polling))
        if self._polling and not out.ready:
            out = await self._until(
                lambda r: PrefetchPoll(rid=rid, reply=r), done=lambda o: o.ready
            )
        return out

    async def prefetch_poll(self, rid: RequestId) -> PrefetchOutcome:
        return await self._call(lambda r: PrefetchPoll(rid=rid, reply=r))

    async def clear(self, tiers: Iterable[str] = ("device", "host", "storage")) -> ClearOutcome:
        """Drop every unlocked page of these tiers once the work in flight has ended (pages
        locked by running requests stay theirs), and clear the L3 namespace with "storage".
        What it dropped; `InvalidRequest` for an unknown tier."""
        asked = tuple(tiers)
        out = await self._until(lambda r: Clear(tiers=asked, reply=r, poll=self._polling))
        assert out is not None  # answered once nothing is in flight
        return out

    async def pin(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        tiers: Iterable[str] = ("device", "host"),
        ttl: float | None = None,
        salt: Salt = None,
    ) -> PinOutcome:
        """Keep the whole pages of `tokens` (a prefix) in `tiers` ("device": not evicted from
        L1; "host": not removed from L2) for `ttl` seconds of the cache's clock (None: until
        `unpin`). Pages of the prefix cached later, or prefetched back from L3, are pinned as
        they arrive. A pin of the same prefix replaces it. `PinLimitError` (a CapacityError)
        past `max_pinned_device_tokens` / `max_pinned_host_tokens`; nothing changes then."""
        asked = tuple(dict.fromkeys(tiers))
        if ttl is not None and not (isinstance(ttl, (int, float)) and 0 < ttl < float("inf")):
            raise InvalidRequest(f"pin: ttl must be None or a finite number > 0, got {ttl!r}")
        key = _tokens(tokens)
        return await self._call(
            lambda r: Pin(tokens=key, salt=_salt(salt), tiers=asked, ttl=ttl, reply=r)
        )

    async def unpin(self, tokens: Sequence[int] | np.ndarray, *, salt: Salt = None) -> bool:
        """End the pin of exactly this prefix (its whole pages); False when there was none.
        Pages other pins cover stay pinned."""
        key = _tokens(tokens)
        return await self._call(lambda r: Unpin(tokens=key, salt=_salt(salt), reply=r))

    async def clear_storage(self) -> bool:
        """Remove every L3 value of this cache's namespace. False when storage is off."""
        return await self._call(lambda r: ClearStorage(reply=r))

    # ------------------------------------------------------------------ L3 at run time
    @property
    def backend(self) -> StorageBackend | None:
        """The L3 backend attached now (sealed where the cache seals values); None without
        storage, and once `detach_storage()` has returned."""
        storage = self._attached()
        return None if storage is None else storage.backend

    async def attach_storage(self, storage: str | StorageBackend, **options: object) -> None:
        """Turn L3 on while the cache runs: `storage` is a spec string (as `CacheConfig.storage`,
        opened with these backend `options` and closed by the cache) or a `StorageBackend`
        the caller owns (as `HiCache(backend=)`). Requests after this call see it. Raises
        what opening raises (`ValueError` for a bad spec, naming it; `BackendUnavailable`;
        `ConfigError` for the default `model_id`), and `InvalidRequest` when a backend is
        attached already; either way nothing changed. `ConfigError` with `tp_size > 1`."""
        self._check_storage_switch("attach_storage")
        assert self._system is not None and self._namespace is not None
        log = self._system.log
        if isinstance(storage, str):
            replace(self.config, storage=storage).resolve()  # the spec's type, model_id
            opened = await open_storage(
                self.config,
                storage,
                options,
                namespace=self._namespace,
                log=log,
                host=self.host_pool,
            )
        else:
            if not isinstance(storage, StorageBackend):
                raise TypeError(
                    "attach_storage takes a spec string or a StorageBackend, "
                    f"got {type(storage).__name__}"
                )
            opened = adopt_storage(self.config, storage, namespace=self._namespace, log=log)
        try:
            accepted = await self._call(lambda r: AttachStorage(storage=opened, reply=r))
        except BaseException:
            await _close_storage(opened)
            raise
        if not accepted:
            await _close_storage(opened)
            current = self._attached()
            raise InvalidRequest(
                f"attach_storage({opened.spec!r}): storage "
                f"{current.spec if current is not None else ''!r} is attached already; "
                "call detach_storage() first"
            )

    async def detach_storage(self) -> bool:
        """Turn L3 off while the cache runs: no upload or prefetch starts from now on (uploads
        still waiting for a credit are skipped, running prefetches stop with what has
        arrived), and once those in flight have ended the backend is dropped, and closed if
        the cache opened it. Requests keep running meanwhile and never fail for it. False when
        no storage was attached. `ConfigError` with `tp_size > 1`."""
        self._check_storage_switch("detach_storage")
        detached = await self._call(lambda r: DetachStorage(reply=r))
        if detached is None:
            return False
        await _close_storage(detached)
        return True

    def _check_storage_switch(self, call: str) -> None:
        if self.config.tp_size > 1:
            raise ConfigError(
                f"{call} is not supported with tp_size={self.config.tp_size}: every rank would "
                "have to open the backend and switch at the same call, and a failed open on one "
                "rank would split them; open each rank's cache with storage= instead"
            )
        if self._system is None:
            raise RuntimeError("HiCache is not open: use `async with HiCache(config) as cache`")

    async def flush(self) -> None:
        """Wait until every pending write (L1 -> L2, and on to L3) has completed."""
        await self._until(
            lambda r: Flush(reply=r, poll=self._polling), done=lambda v: v is not False
        )

    async def stats(self) -> CacheStats:
        return await self._call(lambda r: GetStats(reply=r))

    async def dump(self) -> list[dict[str, Any]]:
        return await self._call(lambda r: DumpTree(reply=r))


Salt = str | bytes | None
TokensItem = (
    tuple[RequestId, Sequence[int] | np.ndarray]
    | tuple[RequestId, Sequence[int] | np.ndarray, Salt]
)
MatchItemTuple = (
    TokensItem | tuple[RequestId, Sequence[int] | np.ndarray, Salt, Sequence[Retention]]
)
CacheItemTuple = (
    tuple[RequestId, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, bool]
    | tuple[RequestId, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, bool, Salt]
)


async def _close_storage(storage: StorageAttachment) -> None:
    """Close a backend the cache opened (a caller's stays open), even when cancelled."""
    if storage.owned:
        with anyio.CancelScope(shield=True):
            await storage.backend.aclose()


def _salt(salt: Salt) -> bytes:
    """A salt as bytes (str as UTF-8; None and empty: the shared space)."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, (bytes, bytearray)):
        return bytes(salt)
    raise InvalidRequest(f"salt must be str, bytes or None, got {type(salt).__name__}")


def _match_item(item: MatchItemTuple) -> MatchItem:
    if len(item) not in (2, 3, 4):
        raise InvalidRequest(f"expected (rid, tokens[, salt[, retention]]), got {len(item)} fields")
    salt = item[2] if len(item) >= 3 else None
    retention = _retention(item[3]) if len(item) == 4 else ()
    return MatchItem(rid=item[0], tokens=_tokens(item[1]), salt=_salt(salt), retention=retention)


def _retention(ranges: Sequence[Retention]) -> tuple[tuple[int, float, int, float], ...]:
    """Retention ranges checked and flattened (an open end or duration as infinity)."""
    out = []
    for r in ranges:
        if not isinstance(r, Retention):
            raise InvalidRequest(f"retention: expected Retention ranges, got {type(r).__name__}")
        end = float("inf") if r.end is None else r.end
        if not (_is_index(r.start) and (r.end is None or _is_index(r.end)) and r.start < end):
            raise InvalidRequest(f"retention: need 0 <= start < end, got {r.start}..{r.end}")
        if not (_is_index(r.priority) and r.priority <= 100):
            raise InvalidRequest(f"retention: priority must be in [0, 100], got {r.priority!r}")
        duration = float("inf") if r.duration is None else r.duration
        if not (isinstance(duration, (int, float)) and duration > 0):
            raise InvalidRequest(
                f"retention: duration must be None or a number > 0, got {r.duration!r}"
            )
        out.append((r.start, end, r.priority, float(duration)))
    return tuple(out)


def _is_index(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)


def _cache_item(item: CacheItemTuple) -> CacheItem:
    if len(item) not in (4, 5):
        raise InvalidRequest(
            f"expected (rid, tokens, device_slots, finished[, salt]), got {len(item)} fields"
        )
    salt = item[4] if len(item) == 5 else None
    return CacheItem(
        rid=item[0],
        tokens=_tokens(item[1]),
        device_slots=_int_array("device_slots", item[2]),
        finished=bool(item[3]),
        salt=_salt(salt),
    )


def _tokens(tokens: Sequence[Any] | np.ndarray) -> np.ndarray | tuple[Any, ...]:
    if isinstance(tokens, np.ndarray):
        return _int_array("tokens", tokens)
    seq = list(tokens)
    if seq and isinstance(seq[0], tuple):
        return tuple(seq)  # bigram keys
    return _int_array("tokens", seq)


def _int_array(what: str, values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """`values` as an integer array (a list becomes int64); InvalidRequest naming `what` for
    anything but integers (strings, floats, bools: a float slot would be truncated to another
    slot silently)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values  # as given, as before: the tree and the keys take any integer dtype
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        bad = next((v for v in arr.reshape(-1).tolist() if not _is_plain_int(v)), arr.flat[0])
        raise InvalidRequest(
            f"{what} must be integers, got {type(bad).__name__} {bad!r} (dtype {arr.dtype})"
        )
    return arr.astype(np.int64, copy=False)


def _is_plain_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _count(call: str, n: object) -> int:
    """A token count a caller passes must be an integer (3.5 or "3" is refused, not cut); the
    tree refuses a negative one, naming the request."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise InvalidRequest(f"{call}: num_tokens must be an integer >= 0, got {n!r}")
    return int(n)
