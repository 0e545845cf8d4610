"""Building one cache: pools, streams, cores, actors, storage, in order, each step undone if a
later one fails.

`assemble` returns an `Assembly` whose `resources` (an `AsyncExitStack`) closes, in reverse
order, everything the steps started: the transfer streams' threads, a backend the cache
opened, the metrics exporter. The facade enters the actor system last and closes `resources` after
the actor system has stopped; if any step raises, `assemble` closes what the earlier ones started
before the error propagates, so a failed open leaves no thread or connection behind.

The uploader and prefetcher are built with or without storage, so that L3 can be attached at
run time (`open_storage` / `adopt_storage` make the attachment, as at open). Which backend is
attached is the tree actor's to know (`TreeActor.storage`); at close the stack closes the one
attached then, if the cache opened it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from hicache.backends.base import StorageBackend
from hicache.backends.keys import Namespace
from hicache.backends.registry import connect_backend
from hicache.backends.sealing.backend import seal_backend
from hicache.components.allocator.actor import AllocatorActor
from hicache.components.controller.actor import TreeActor
from hicache.components.controller.agreement import (
    RankAgreement,
    SingleRank,
    TorchDistributedAgreement,
)
from hicache.components.loader.actor import LoaderActor
from hicache.components.prefetcher.actor import PrefetcherActor
from hicache.components.topology import Topology
from hicache.components.uploader.actor import UploaderActor
from hicache.components.writer.actor import WriterActor
from hicache.config import CacheConfig, ConfigError, Rewrite
from hicache.kernels.geometry import parse_geometry
from hicache.kernels.native.pagehash import install as install_page_hasher
from hicache.kernels.native.rowcopy import native_rows, u32_ids, unavailable_reason
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams import FaultHook, TransferStreams, cuda_driver_status, make_streams
from hicache.kernels.streams.nokv import NoKVStreams
from hicache.messages import StorageAttachment, TreeInbox
from hicache.observability import EventLog
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree
from hicache.runtime import ActorSystem, Mailbox
from hicache.secrets import redact_url
from hicache.sizing import TierBytes, cuda_free, shortfall

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True, slots=True)
class Parts:
    """What the caller may hand in instead of letting the cache build it."""

    device_pool: DevicePool | None = None
    log: EventLog | None = None
    streams: TransferStreams | None = None
    backend: StorageBackend | None = None  # the caller's: not closed here, not given the host pool
    transfer_faults: FaultHook | None = None
    tp_group: ProcessGroup | None = None


@dataclass(slots=True)
class Assembly:
    device_pool: DevicePool
    host_pool: HostPool
    system: ActorSystem
    streams: TransferStreams
    topology: Topology
    agreement: RankAgreement
    tree_inbox: Mailbox[TreeInbox]
    tree: RadixTree  # the tree actor's core, for observers (KV events) to read
    namespace: Namespace  # the L3 namespace of every backend attached, at open or later
    attached: Callable[[], StorageAttachment | None]  # the L3 attached now (the tree actor's)
    resources: AsyncExitStack  # closes streams, an owned backend; the caller adds more


async def assemble(cfg: CacheConfig, rewrites: Sequence[Rewrite], parts: Parts) -> Assembly:
    """Build every piece of one cache (the actor system not yet entered). `cfg` is resolved."""
    resources = AsyncExitStack()
    try:
        return await _assemble(cfg, rewrites, parts, resources)
    except BaseException:
        await resources.aclose()
        raise


async def _assemble(
    cfg: CacheConfig, rewrites: Sequence[Rewrite], parts: Parts, resources: AsyncExitStack
) -> Assembly:
    geometry = parse_geometry(cfg.kv)
    check_pools_fit(cfg, geometry.bytes_per_token, own_device_pool=parts.device_pool is None)
    device = parts.device_pool or DevicePool.allocate(
        geometry, size=cfg.device_tokens, page_size=cfg.page_size, device=_device(cfg.device)
    )
    if device.size != cfg.device_tokens:
        raise ValueError(
            f"device pool holds {device.size} tokens but device_tokens={cfg.device_tokens}"
        )
    # Mapped only: the allocator prepares it (faults in, pins with CUDA) chunk by chunk.
    host = HostPool(device, cfg.host_capacity, cfg.layout, prepare=False)
    system = ActorSystem(log=parts.log, deterministic=cfg.deterministic, seed=cfg.seed)
    for rw in rewrites:
        system.log.emit(
            "config.rewritten",
            component="cache",
            level="warning",
            field=rw.field,
            old=rw.old,
            new=rw.new,
            reason=rw.reason,
        )
    agreement = _agreement(cfg, parts.tp_group)
    topo = Topology.for_capacity(cfg.channel_capacity)
    edges = topo.edges()  # every inbox's bounds, declared in one place
    bpt = geometry.bytes_per_token
    install_page_hasher()  # page hashes in one compiled call where it builds
    tree = RadixTree(
        page_size=cfg.page_size,
        eviction=make_strategy(cfg.eviction),
        write_policy=write_policy(cfg.write_policy),
        default_priority=cfg.default_priority,
        u32_ids=u32_ids,
    )
    tree_actor = TreeActor(
        config=cfg,
        tree=tree,
        bytes_per_token=bpt,
        topology=topo,
        agreement=agreement,
        storage_on=parts.backend is not None or bool(cfg.storage),
    )
    allocator = AllocatorActor(
        host=host,
        tree=tree_actor.inbox,
        chunk_bytes=cfg.host_chunk_bytes,
        modelled_rate=cfg.transfer_bandwidth if cfg.deterministic else None,
        capacity=edges["allocator"].capacity,
    )
    # The first chunk is ready (or the pool has fallen back whole) before anything uses the
    # buffer; the pool is taken back after the streams have stopped (callbacks run in reverse).
    await allocator.open()
    resources.callback(allocator.release)
    streams = await _streams(cfg, device, host, system, parts)
    resources.callback(streams.close)
    writer = WriterActor(
        streams=streams,
        tree=tree_actor.inbox,
        bytes_per_token=bpt,
        capacity=edges["writer"].capacity,
        reserve=edges["writer"].reserve,
    )
    loader = LoaderActor(
        streams=streams,
        tree=tree_actor.inbox,
        bytes_per_token=bpt,
        capacity=edges["loader"].capacity,
        reserve=edges["loader"].reserve,
    )
    namespace = storage_namespace(cfg)
    resources.push_async_callback(tree_actor.close_storage)  # what is attached at close
    storage: StorageAttachment | None = None
    if parts.backend is not None:
        storage = adopt_storage(cfg, parts.backend, namespace=namespace, log=system.log)
    elif cfg.storage:
        storage = await open_storage(
            cfg, cfg.storage, cfg.extra, namespace=namespace, log=system.log, host=host
        )
    backend = None if storage is None else storage.backend
    uploader = UploaderActor(
        backend=backend,
        namespace=namespace,
        host_pool=host,
        tree=tree_actor.inbox,
        retries=cfg.upload_retries,
        backoff=cfg.upload_backoff,
        timeout=cfg.storage_timeout,
        capacity=edges["uploader"].capacity,
        reserve=edges["uploader"].reserve,
    )
    prefetcher = PrefetcherActor(
        backend=backend,
        namespace=namespace,
        host_pool=host,
        tree=tree_actor.inbox,
        batch_pages=cfg.storage_batch_pages,
        timeout=cfg.storage_timeout,
        capacity=edges["prefetcher"].capacity,
        reserve=edges["prefetcher"].reserve,
    )
    tree_actor.connect(
        writer=writer.inbox,
        loader=loader.inbox,
        uploader=uploader.inbox,
        prefetcher=prefetcher.inbox,
        storage=storage,
    )
    actors: list[Any] = [tree_actor, allocator, writer, loader, uploader, prefetcher]
    for actor in actors:
        system.add(actor)
    return Assembly(
        device_pool=device,
        host_pool=host,
        system=system,
        streams=streams,
        topology=topo,
        agreement=agreement,
        tree_inbox=tree_actor.inbox,
        tree=tree,
        namespace=namespace,
        attached=lambda: tree_actor.storage,
        resources=resources,
    )


def _agreement(cfg: CacheConfig, tp_group: ProcessGroup | None) -> RankAgreement:
    if cfg.tp_size == 1:
        return SingleRank()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"tp_size={cfg.tp_size} (tp_rank={cfg.tp_rank}) needs torch.distributed: call "
            "torch.distributed.init_process_group on every rank before opening the cache "
            "(and pass a gloo group as HiCache(..., tp_group=)); without it the ranks' "
            "trees drift apart"
        )
    return TorchDistributedAgreement(tp_group)


async def _streams(
    cfg: CacheConfig, device: DevicePool, host: HostPool, system: ActorSystem, parts: Parts
) -> TransferStreams:
    if parts.streams is not None:
        return parts.streams
    if not device.geometry.layers:  # pages with no K/V: nothing to copy, nothing to build
        system.log.emit(
            "streams.selected",
            component="cache",
            kind="none",
            reason="the pools have 0 layers: pages hold tokens only, transfers move nothing",
        )
        return NoKVStreams(device, host, schedule=system.call_later)
    if device.device.type == "cpu" and not cfg.deterministic:
        # The compiled row copier is built (once per machine, by `cc`) off the event loop.
        await anyio.to_thread.run_sync(native_rows)
    inline = cfg.cpu_transfers == "inline" and device.device.type == "cpu"
    # Inline CPU copies: a load's bytes move at submit and a backup's on the copy thread;
    # completions come on the loop's turns (the virtual streams' machinery, no modelled time).
    streams, selection = make_streams(
        device,
        host,
        io=cfg.io_backend,
        prefer="virtual" if cfg.deterministic else "inline" if inline else "auto",
        schedule=system.call_later,
        bandwidth=cfg.transfer_bandwidth if cfg.deterministic else float("inf"),
        fault=parts.transfer_faults,
        transfer_sms=cfg.transfer_sms,
    )
    copier: dict[str, str] = {}
    paths = getattr(streams, "copy_paths", None)
    if selection.kind == "cuda" and paths is not None:  # CUDA: which copies each io runs
        copier = paths()
    elif device.device.type == "cpu":  # CPU copies: say which row copier moves the bytes
        reason = None if native_rows() is not None else unavailable_reason()
        copier = (
            {"copier": "compiled"}
            if reason is None
            else {"copier": "numpy", "copier_reason": reason}
        )
    system.log.emit(
        "streams.selected",
        component="cache",
        kind=selection.kind,
        reason=selection.reason,
        **copier,
    )
    return streams


def storage_namespace(cfg: CacheConfig) -> Namespace:
    """The L3 namespace of this cache's pages, whichever backend holds them."""
    return Namespace(
        model=cfg.model_id,
        kv=cfg.kv,
        page_size=cfg.page_size,
        tenant=cfg.tenant,
        rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        layout=cfg.layout,
        seal=cfg.storage_seal(),  # keyed names and sealed values with a secret
    )


async def open_storage(
    cfg: CacheConfig,
    spec: str,
    options: Mapping[str, object],
    *,
    namespace: Namespace,
    log: EventLog,
    host: HostPool,
) -> StorageAttachment:
    """Open (and connect) the backend `spec` names, sealed for `namespace`, with the host pool
    registered where the backend wants it: an attachment the cache owns and closes. Raises
    what `connect_backend` raises (ValueError, ImportError, BackendUnavailable), leaving
    nothing open."""
    backend = await connect_backend(
        spec,
        namespace=namespace,
        emit=log.bind("storage").warning,
        virtual_time=cfg.deterministic,
        connect_timeout=cfg.storage_timeout,
        **dict(options),
    )
    try:
        attach = getattr(backend, "attach_host_pool", None)
        if callable(attach):  # only for a backend this cache owns: the pool outlives it
            attach(host)
    except BaseException:
        await backend.aclose()
        raise
    return StorageAttachment(backend=backend, spec=redact_url(spec), owned=True)


def adopt_storage(
    cfg: CacheConfig, backend: StorageBackend, *, namespace: Namespace, log: EventLog
) -> StorageAttachment:
    """A caller's backend as an attachment: sealed here (open_storage seals what it opens),
    not closed by the cache, not given the host pool; shown by its class."""
    cls = type(backend)
    sealed = seal_backend(
        backend, namespace, emit=log.bind("storage").warning, virtual_time=cfg.deterministic
    )
    return StorageAttachment(
        backend=sealed, spec=f"{cls.__module__}:{cls.__qualname__}", owned=False
    )


def check_pools_fit(cfg: CacheConfig, bytes_per_token: int, *, own_device_pool: bool) -> None:
    """ConfigError with the sizes when L1 and L2 cannot fit in what the machine has now
    (hicache/sizing.py); before anything is allocated."""
    need = TierBytes(
        device=_device(cfg.device) if own_device_pool else "cpu",
        l1=cfg.device_tokens * bytes_per_token if own_device_pool else 0,
        l2=cfg.host_capacity * bytes_per_token,
    )
    problems = shortfall(need, device_free=cuda_free)
    if problems:
        what = (
            f"kv={cfg.kv} is {bytes_per_token:,} bytes per token; device_tokens="
            f"{cfg.device_tokens:,}, host_tokens={cfg.host_capacity:,}"
        )
        raise ConfigError(f"the pools do not fit: {problems} ({what})")


def _device(spec: str) -> str:
    if spec != "auto":
        return spec
    usable, _why = cuda_driver_status()
    return "cuda" if usable else "cpu"
