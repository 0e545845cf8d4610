"""`HiCache`: the facade a serving loop calls. An async context manager that builds the pools,
the cores and the actors, starts the kernel, and on exit drains in-flight work and checks that
every ledger balances.

Every call is a request to the tree actor; the batched forms (`*_many`) carry a whole scheduler
step in one message, which is what keeps the actor path cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import numpy as np

from hicache.components.allocator.actor import AllocatorActor
from hicache.components.allocator.core import SlotLedger
from hicache.components.topology import Topology
from hicache.components.tree.agreement import SingleRank, TorchDistributedAgreement
from hicache.components.loader.actor import LoaderActor
from hicache.components.tree.actor import TreeActor
from hicache.components.tree.core import RadixTree
from hicache.components.writer.actor import WriterActor
from hicache.config import CacheConfig
from hicache.kernels.geometry import parse_geometry
from hicache.kernels.native import native_rows, unavailable_reason
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams import make_streams
from hicache.backends.keys import Namespace
from hicache.backends.registry import connect_backend
from hicache.components.prefetcher.actor import PrefetcherActor
from hicache.components.uploader.actor import UploaderActor
from hicache.messages import (
    AllocBatch, CacheBatch, CacheItem, ClearStorage, Drain, DumpTree, Flush, GetStats,
    LoadBackBatch, MatchBatch, MatchItem, PrefetchBatch, PrefetchPoll, PrefetchWait,
    ReleaseBatch,
)
from hicache.observability import EventLog
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.results import (
    CacheOutcome, CacheStats, LoadBackOutcome, MatchOutcome, PrefetchOutcome,
)
from hicache.runtime import Kernel
from hicache.types import RequestId


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
        streams=None,
        backend=None,
        transfer_faults=None,
        tp_group=None,
    ) -> None:
        self.requested_config = config or CacheConfig()
        self.config, self.rewrites = self.requested_config.resolve()
        self._device_pool = device_pool
        self._log = log
        self._streams_override = streams
        self._backend_override = backend
        self._transfer_faults = transfer_faults
        self._tp_group = tp_group
        self._agreement = SingleRank()
        self.backend = None
        self._kernel: Kernel | None = None
        self._streams = None
        self._tree_inbox = None
        self.close_report: dict | None = None  # the ledgers after close
        self.close_tables: dict[str, int] | None = None  # the tree's tables after close

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> HiCache:
        try:
            await self._open()
        except BaseException:
            # A later step failed (a bad spec, an unreachable server, no process group): undo
            # what the earlier ones started, so no stream thread or connection is left behind.
            if self._streams is not None:  # closed on exit too, as __aexit__ does
                self._streams.close()
            if self.backend is not None and self._backend_override is None:
                await self.backend.aclose()
            raise
        return self

    async def _open(self) -> None:
        cfg = self.config
        geometry = parse_geometry(cfg.kv)
        device = self._device_pool or DevicePool.allocate(
            geometry, size=cfg.device_tokens, page_size=cfg.page_size, device=_device(cfg.device)
        )
        if device.size != cfg.device_tokens:
            raise ValueError(
                f"device pool holds {device.size} tokens but device_tokens={cfg.device_tokens}"
            )
        host = HostPool(device, cfg.host_capacity, cfg.layout)
        self.device_pool, self.host_pool = device, host
        kernel = Kernel(log=self._log, deterministic=cfg.deterministic, seed=cfg.seed)
        self._kernel = kernel
        for rw in self.rewrites:
            kernel.log.emit("config.rewritten", component="cache", level="warning",
                            field=rw.field, old=rw.old, new=rw.new, reason=rw.reason)

        if self._streams_override is not None:
            streams, selection = self._streams_override, None
        else:
            inline = cfg.cpu_transfers == "inline" and device.device.type == "cpu"
            # Inline CPU copies are the virtual streams with no modelled time: bytes move at
            # submit, completion is reported on the next turn of the loop.
            streams, selection = make_streams(
                device, host, io=cfg.io_backend,
                prefer="virtual" if cfg.deterministic or inline else "auto",
                schedule=kernel.call_later,
                bandwidth=cfg.transfer_bandwidth if cfg.deterministic else float("inf"),
                fault=self._transfer_faults,
            )
        self._streams = streams
        if selection is not None:
            copier: dict[str, str] = {}
            if selection.kind != "cuda":  # CPU copies: say which row copier moves the bytes
                reason = None if native_rows() is not None else unavailable_reason()
                copier = {"copier": "compiled"} if reason is None else {"copier": "numpy", "copier_reason": reason}
            kernel.log.emit("streams.selected", component="cache", kind=selection.kind,
                            reason=selection.reason, **copier)

        topo = Topology.for_capacity(cfg.channel_capacity)
        self.topology = topo
        edges = topo.edges()  # every inbox's bounds, declared in one place
        bpt = geometry.bytes_per_token
        tree = RadixTree(page_size=cfg.page_size, eviction=make_strategy(cfg.eviction),
                         write_policy=write_policy(cfg.write_policy))
        allocator = AllocatorActor(
            device=SlotLedger(size=cfg.device_tokens, page_size=cfg.page_size, tier="device"),
            host=SlotLedger(size=cfg.host_capacity, page_size=cfg.page_size, tier="host"),
            capacity=edges["allocator"].capacity,
        )
        agreement = SingleRank()
        if cfg.tp_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                from hicache.config import ConfigError

                raise ConfigError(
                    f"tp_size={cfg.tp_size} (tp_rank={cfg.tp_rank}) needs torch.distributed: call "
                    "torch.distributed.init_process_group on every rank before opening the cache "
                    "(and pass a gloo group as HiCache(..., tp_group=)); without it the ranks' "
                    "trees drift apart")
            agreement = TorchDistributedAgreement(self._tp_group)
        self._agreement = agreement
        tree_actor = TreeActor(config=cfg, tree=tree, allocator=allocator.inbox,
                               bytes_per_token=bpt, topology=topo, agreement=agreement)
        writer = WriterActor(streams=streams, tree=tree_actor.inbox, bytes_per_token=bpt,
                             capacity=edges["writer"].capacity, reserve=edges["writer"].reserve)
        loader = LoaderActor(streams=streams, tree=tree_actor.inbox, bytes_per_token=bpt,
                             capacity=edges["loader"].capacity, reserve=edges["loader"].reserve)
        actors = [tree_actor, allocator, writer, loader]
        storage = {}
        if self._backend_override is not None or cfg.storage:
            namespace = Namespace(
                model=cfg.model_id, kv=cfg.kv, page_size=cfg.page_size, tenant=cfg.tenant,
                rank=cfg.tp_rank, tp_size=cfg.tp_size, layout=cfg.layout,
            )
            emit = kernel.log.bind("storage").warning
            backend = self._backend_override
            if backend is None:
                options = dict(cfg.extra)
                if cfg.deterministic and cfg.storage.startswith("file:"):
                    options.setdefault("threads", 0)  # no real threads on virtual time
                backend = await connect_backend(cfg.storage, namespace=namespace,
                                                emit=lambda event, **kw: emit(event, **kw),
                                                **options)
                # Backends that move registered memory zero-copy (Mooncake) get the host pool.
                # Only for a backend this cache owns: the pool must outlive its registration.
                if hasattr(backend, "register_host_memory"):
                    backend.register_host_memory(host.buffer.data_ptr(), host.nbytes)
            self.backend = backend
            uploader = UploaderActor(
                backend=backend, namespace=namespace, host_pool=host, tree=tree_actor.inbox,
                retries=cfg.upload_retries, backoff=cfg.upload_backoff,
                timeout=cfg.storage_timeout,
                capacity=edges["uploader"].capacity, reserve=edges["uploader"].reserve,
            )
            prefetcher = PrefetcherActor(
                backend=backend, namespace=namespace, host_pool=host, tree=tree_actor.inbox,
                batch_pages=cfg.storage_batch_pages, timeout=cfg.storage_timeout,
                capacity=edges["prefetcher"].capacity, reserve=edges["prefetcher"].reserve,
            )
            actors += [uploader, prefetcher]
            storage = dict(uploader=uploader.inbox, prefetcher=prefetcher.inbox,
                           namespace=namespace, clear_storage=backend.clear)
        tree_actor.connect(writer=writer.inbox, loader=loader.inbox, **storage)
        for actor in actors:
            kernel.add(actor)
        self._tree_inbox = tree_actor.inbox
        if cfg.metrics_port is not None:  # Prometheus /metrics, fed by this kernel's log
            from hicache.observability.metrics import serve_cache_metrics

            self._metrics = serve_cache_metrics(self, cfg.metrics_port)
        await kernel.__aenter__()

    async def __aexit__(self, *exc_info) -> bool | None:
        kernel = self._kernel
        assert kernel is not None
        leak: LedgerImbalance | None = None
        try:
            if exc_info[0] is None and kernel.failure is None:
                report, tables = await self._drain(kernel)
                self.close_report, self.close_tables = report, tables
                leaked = {t: v["used"] for t, v in report.items() if v["used"]}
                left = {name: n for name, n in tables.items() if n}
                if leaked:
                    leak = LedgerImbalance(f"slots still held after close: {leaked}")
                elif left:
                    leak = BookkeepingLeak(f"tables not empty after close: {left}")
        finally:
            try:
                suppress = await kernel.__aexit__(*exc_info)
            finally:
                if getattr(self, "_metrics", None) is not None:  # stop the exporter
                    self._metrics.close()
                self._streams.close()
                if self.backend is not None and self._backend_override is None:
                    await self.backend.aclose()
        if leak is not None:
            raise leak
        return suppress

    async def _drain(self, kernel: Kernel):
        """Let in-flight work finish, for at most `close_timeout`; then abandon what is left
        (an event says what), so a hung backend cannot hold close forever."""
        timeout = self.config.close_timeout
        with kernel.clock.move_on_after(timeout):
            return await self._until(lambda r: Drain(reply=r, poll=self._polling))
        kernel.log.emit("cache.close_timeout", component="cache", level="warning",
                        timeout=timeout)
        return await self._call(lambda r: Drain(reply=r, abandon=True))

    # ------------------------------------------------------------------ plumbing
    async def _call(self, make, timeout: float | None = None):
        if self._kernel is None:
            raise RuntimeError("HiCache is not open: use `async with HiCache(config) as cache`")
        return await self._kernel.request(self._tree_inbox, make, timeout=timeout)

    @property
    def _polling(self) -> bool:
        """TP ranks change state only at sync points (frontend calls), so a wait cannot park on
        the tree: it polls, and every rank polls the same number of times."""
        return not self._agreement.trivial

    async def _until(self, make, *, done=lambda value: value is not None):
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
    async def match(self, rid: RequestId, tokens: Sequence[int] | np.ndarray) -> MatchOutcome:
        """Match the longest cached page-aligned prefix and lock it for this request."""
        (out,) = await self.match_many([(rid, tokens)])
        return out

    async def match_many(self, items: Iterable[tuple[RequestId, object]]) -> tuple[MatchOutcome, ...]:
        batch = tuple(MatchItem(rid=rid, tokens=_tokens(t)) for rid, t in items)
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

    async def cache_finished(self, rid: RequestId, tokens, device_slots) -> CacheOutcome:
        """Insert a finished request's KV, free duplicates, count hits, release its lock."""
        (out,) = await self.cache_many([(rid, tokens, device_slots, True)])
        return out

    async def cache_unfinished(self, rid: RequestId, tokens, device_slots) -> CacheOutcome:
        """Insert a chunk of a running request (no hit count); the lock moves to the new end."""
        (out,) = await self.cache_many([(rid, tokens, device_slots, False)])
        return out

    async def cache_many(self, items) -> tuple[CacheOutcome, ...]:
        batch = tuple(
            CacheItem(rid=rid, tokens=_tokens(t), device_slots=np.asarray(s, dtype=np.int64),
                      finished=bool(f))
            for rid, t, s, f in items
        )
        return await self._call(lambda r: CacheBatch(items=batch, reply=r))

    async def release(self, rid: RequestId) -> None:
        """Forget a request without caching it: unlock its path, free its allocated slots."""
        await self.release_many([rid])

    async def release_many(self, rids: Iterable[RequestId]) -> None:
        batch = tuple(rids)
        await self._call(lambda r: ReleaseBatch(rids=batch, reply=r))

    async def prefetch(self, rid: RequestId, tokens) -> PrefetchOutcome:
        """Start fetching, from L3 into L2, the part of `tokens` past the request's last match.
        Admission checks may skip it (see the outcome's `reason`)."""
        (out,) = await self.prefetch_many([(rid, tokens)])
        return out

    async def prefetch_many(self, items) -> tuple[PrefetchOutcome, ...]:
        batch = tuple(MatchItem(rid=rid, tokens=_tokens(t)) for rid, t in items)
        return await self._call(lambda r: PrefetchBatch(items=batch, reply=r))

    async def prefetch_wait(self, rid: RequestId) -> PrefetchOutcome:
        """Return once the request's prefetch may end under the configured policy
        (best_effort: now, with what has arrived; wait_complete: when complete; timeout: when
        complete or timed out). What arrived is then in the tree, and the request's next
        load_back brings it into L1."""
        out = await self._call(lambda r: PrefetchWait(rid=rid, reply=r, poll=self._polling))
        if self._polling and not out.ready:
            out = await self._until(lambda r: PrefetchPoll(rid=rid, reply=r),
                                    done=lambda o: o.ready)
        return out

    async def prefetch_poll(self, rid: RequestId) -> PrefetchOutcome:
        return await self._call(lambda r: PrefetchPoll(rid=rid, reply=r))

    async def clear_storage(self) -> bool:
        """Remove every L3 value of this cache's namespace. False when storage is off."""
        return await self._call(lambda r: ClearStorage(reply=r))

    async def flush(self) -> None:
        """Wait until every pending write (L1 -> L2, and on to L3) has completed."""
        await self._until(lambda r: Flush(reply=r, poll=self._polling),
                          done=lambda v: v is not False)

    async def stats(self) -> CacheStats:
        return await self._call(lambda r: GetStats(reply=r))

    async def dump(self) -> list[dict]:
        return await self._call(lambda r: DumpTree(reply=r))


def _tokens(tokens) -> np.ndarray | tuple:
    if isinstance(tokens, np.ndarray):
        return tokens
    seq = list(tokens)
    if seq and isinstance(seq[0], tuple):
        return tuple(seq)  # bigram keys
    return np.asarray(seq, dtype=np.int64)


def _device(spec: str) -> str:
    if spec != "auto":
        return spec
    from hicache.kernels.streams import cuda_driver_status

    usable, _why = cuda_driver_status()
    return "cuda" if usable else "cpu"
