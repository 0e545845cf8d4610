"""`HiCache`: the facade a serving loop calls. An async context manager that has
`hicache.assembly` build the pools, cores and actors, starts the kernel, and on exit drains
in-flight work and checks that every ledger balances and every table is empty.

Every call is a request to the tree actor; the batched forms (`*_many`) carry a whole scheduler
step in one message, which is what keeps the actor path cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np
from typing_extensions import Self

from hicache.assembly import Parts, assemble
from hicache.components.tree.agreement import RankAgreement, SingleRank
from hicache.config import CacheConfig
from hicache.kernels.pools import DevicePool
from hicache.messages import (
    AllocBatch,
    Asks,
    CacheBatch,
    CacheItem,
    Clear,
    ClearStorage,
    Drain,
    DumpTree,
    Flush,
    GetStats,
    LoadBackBatch,
    MatchBatch,
    MatchItem,
    PrefetchBatch,
    PrefetchPoll,
    PrefetchWait,
    ReleaseBatch,
    TreeInbox,
)
from hicache.observability import EventLog
from hicache.results import (
    CacheOutcome,
    CacheStats,
    ClearOutcome,
    InvalidRequest,
    LoadBackOutcome,
    MatchOutcome,
    PrefetchOutcome,
)
from hicache.runtime import Kernel, Mailbox, Reply
from hicache.types import RequestId

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hicache.backends.base import StorageBackend
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
        self.backend: StorageBackend | None = None
        self._kernel: Kernel | None = None
        self._streams: TransferStreams | None = None
        self._resources = AsyncExitStack()
        self._metrics: CacheMetrics | None = None
        self.kv_events: TreeKVEvents | None = None  # the KV event publisher, with `kv_events=` set
        self._tree_inbox: Mailbox[TreeInbox] | None = None
        self.close_report: Ledgers | None = None  # the ledgers after close
        self.close_tables: dict[str, int] | None = None  # the tree's tables after close

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
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
            self._kernel, self._streams = built.kernel, built.streams
            self.topology, self._agreement = built.topology, built.agreement
            self._tree_inbox, self.backend = built.tree_inbox, built.backend
            if self.config.metrics_port is not None:  # Prometheus /metrics, fed by the log
                from hicache.observability.metrics import serve_cache_metrics

                metrics = self._metrics = serve_cache_metrics(self, self.config.metrics_port)
                self._resources.callback(metrics.close)
            if self.config.kv_events is not None:  # vLLM-format KV events (docs/kv-events.md)
                from hicache.observability.kv_events import start_kv_events

                self.kv_events = start_kv_events(self.config, built.tree, built.kernel.log)
                if self.kv_events is not None:
                    self._resources.callback(self.kv_events.close)
            await built.kernel.__aenter__()
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
        kernel = self._kernel
        assert kernel is not None
        leak: LedgerImbalance | None = None
        try:
            if exc_type is None and kernel.failure is None:
                report, tables = await self._drain(kernel)
                self.close_report, self.close_tables = report, tables
                kernel.log.emit(
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
                suppress = await kernel.__aexit__(exc_type, exc, tb)
            finally:
                await self._resources.aclose()  # exporter, an owned backend, the streams
        if leak is not None:
            raise leak
        return suppress

    async def _drain(self, kernel: Kernel) -> tuple[Ledgers, dict[str, int]]:
        """Let in-flight work finish, for at most `close_timeout`; then abandon what is left
        (an event says what), so a hung backend cannot hold close forever."""
        timeout = self.config.close_timeout
        with kernel.clock.move_on_after(timeout):
            drained = await self._until(lambda r: Drain(reply=r, poll=self._polling))
            assert drained is not None  # answered once nothing is in flight
            return drained
        kernel.log.emit("cache.close_timeout", component="cache", level="warning", timeout=timeout)
        abandoned = await self._call(lambda r: Drain(reply=r, abandon=True))
        assert abandoned is not None  # `abandon` ends what is in flight, then answers
        return abandoned

    # ------------------------------------------------------------------ plumbing
    async def _call(self, make: Callable[[Reply[T]], Asks[T]], timeout: float | None = None) -> T:
        """Send the tree the request `make(reply)` builds; its answer (typed by the message)."""
        if self._kernel is None or self._tree_inbox is None:
            raise RuntimeError("HiCache is not open: use `async with HiCache(config) as cache`")
        inbox: Mailbox[Any] = self._tree_inbox  # every `Asks` the facade builds is a TreeInbox
        return await self._kernel.request(inbox, make, timeout=timeout)

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
    def kernel(self) -> Kernel:
        assert self._kernel is not None
        return self._kernel

    # ------------------------------------------------------------------ the API
    async def match(
        self, rid: RequestId, tokens: Sequence[int] | np.ndarray, *, salt: Salt = None
    ) -> MatchOutcome:
        """Match the longest cached page-aligned prefix and lock it for this request. With a
        `salt` (a tenant's, say), only pages cached under the same salt are found: in L1, L2
        and L3 (docs/security.md)."""
        (out,) = await self.match_many([(rid, tokens, salt)])
        return out

    async def match_many(self, items: Iterable[TokensItem]) -> tuple[MatchOutcome, ...]:
        """`(rid, tokens)` or `(rid, tokens, salt)` per request."""
        batch = tuple(_match_item(item) for item in items)
        return await self._call(lambda r: MatchBatch(items=batch, reply=r))

    async def load_back(self, rid: RequestId) -> LoadBackOutcome:
        """Bring the L2-only part of the last match into L1 (skipped below the threshold)."""
        (out,) = await self.load_back_many([rid])
        return out

    async def load_back_many(self, rids: Iterable[RequestId]) -> tuple[LoadBackOutcome, ...]:
        batch = tuple(rids)
        return await self._call(lambda r: LoadBackBatch(rids=batch, reply=r))

    async def allocate(self, rid: RequestId, num_tokens: int) -> np.ndarray:
        """Device slots for new tokens, evicting L1 as needed; CapacityError if impossible."""
        (out,) = await self.allocate_many([(rid, num_tokens)])
        return out

    async def allocate_many(self, sizes: Iterable[tuple[RequestId, int]]) -> tuple[np.ndarray, ...]:
        batch = tuple((rid, int(n)) for rid, n in sizes)
        return await self._call(lambda r: AllocBatch(sizes=batch, reply=r))

    async def cache_finished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
    ) -> CacheOutcome:
        """Insert a finished request's KV, free duplicates, count hits, release its lock. The
        salt must be the one it was matched under."""
        (out,) = await self.cache_many([(rid, tokens, device_slots, True, salt)])
        return out

    async def cache_unfinished(
        self,
        rid: RequestId,
        tokens: Sequence[int] | np.ndarray,
        device_slots: Sequence[int] | np.ndarray,
        *,
        salt: Salt = None,
    ) -> CacheOutcome:
        """Insert a chunk of a running request (no hit count); the lock moves to the new end."""
        (out,) = await self.cache_many([(rid, tokens, device_slots, False, salt)])
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
        self, rid: RequestId, tokens: Sequence[int] | np.ndarray, *, salt: Salt = None
    ) -> PrefetchOutcome:
        """Start fetching, from L3 into L2, the part of `tokens` past the request's last match
        (under the salt it was matched under). Admission checks may skip it (see the outcome's
        `reason`)."""
        (out,) = await self.prefetch_many([(rid, tokens, salt)])
        return out

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

    async def clear_storage(self) -> bool:
        """Remove every L3 value of this cache's namespace. False when storage is off."""
        return await self._call(lambda r: ClearStorage(reply=r))

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
CacheItemTuple = (
    tuple[RequestId, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, bool]
    | tuple[RequestId, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, bool, Salt]
)


def _salt(salt: Salt) -> bytes:
    """A salt as bytes (str as UTF-8; None and empty: the shared space)."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, (bytes, bytearray)):
        return bytes(salt)
    raise InvalidRequest(f"salt must be str, bytes or None, got {type(salt).__name__}")


def _match_item(item: TokensItem) -> MatchItem:
    if len(item) not in (2, 3):
        raise InvalidRequest(f"expected (rid, tokens[, salt]), got {len(item)} fields")
    salt = item[2] if len(item) == 3 else None
    return MatchItem(rid=item[0], tokens=_tokens(item[1]), salt=_salt(salt))


def _cache_item(item: CacheItemTuple) -> CacheItem:
    if len(item) not in (4, 5):
        raise InvalidRequest(
            f"expected (rid, tokens, device_slots, finished[, salt]), got {len(item)} fields"
        )
    salt = item[4] if len(item) == 5 else None
    return CacheItem(
        rid=item[0],
        tokens=_tokens(item[1]),
        device_slots=np.asarray(item[2], dtype=np.int64),
        finished=bool(item[3]),
        salt=_salt(salt),
    )


def _tokens(tokens: Sequence[Any] | np.ndarray) -> np.ndarray | tuple[Any, ...]:
    if isinstance(tokens, np.ndarray):
        return tokens
    seq = list(tokens)
    if seq and isinstance(seq[0], tuple):
        return tuple(seq)  # bigram keys
    return np.asarray(seq, dtype=np.int64)
