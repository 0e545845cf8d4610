"""hicache as a vLLM KV connector (v1): vLLM's paged KV cache is L1, hicache adds L2 and L3.

Load it into an unmodified vLLM with

    KVTransferConfig(kv_connector="HiCacheConnector",
                     kv_connector_module_path="hicache.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...})     # keys: docs/vllm.md

Split across vLLM's processes (docs/decisions.md, "vLLM: the scheduler keeps the index, the
workers keep the bytes"):

- scheduler side (`SchedulerSide`, vLLM's scheduler process): the L2 index (`HostIndex`:
  hicache page hash -> host slot, least recently used first, pins for the step being built)
  and, with storage, a probe of L3 (`exists`). It decides every transfer and sends it in the
  step's metadata; it never touches bytes.
- worker side (`WorkerSide`, each vLLM worker): the host pool (one page-first array of host
  slots), the copies L1 <-> L2 and the L3 reads and writes (hicache's storage backends, their
  framing and CRC-32 checksums). Workers run the steps' metadata in order, and within a step
  L3 reads, then L2 -> L1 loads (before the forward), then L1 -> L2 stores (after it), so the
  index the scheduler keeps is the truth for every later step; the one thing it cannot know
  ahead, a failed or corrupt L3 read, the worker detects (a per-slot validity flag), reports as
  vLLM load errors (vLLM recomputes those blocks) and sends back to the scheduler, which
  forgets the page.

Pages are vLLM blocks (`page_size` = vLLM's `block_size`) named by hicache's chained SHA-256
page hashes (`hicache.backends.keys.chain_page_hashes`), starting from hicache's salt seed for
a request's `cache_salt`, so L3 keys are the ones an embedded `HiCache` with the same salt
would use for the same tokens and namespace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from hicache.backends.keys import KV_DTYPES, Namespace, chain_page_hashes
from hicache.types import PageHash

if TYPE_CHECKING:
    import torch

    from hicache.backends.base import StorageBackend

    _ConnectorBase = object
    _MetadataBase = object
    _WorkerMetadataBase = object
else:
    try:  # vLLM is optional: without it this module imports, but nothing here can run.
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1 as _ConnectorBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorMetadata as _MetadataBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorWorkerMetadata as _WorkerMetadataBase,
        )
    except ImportError:  # pragma: no cover - exercised only where vLLM is absent
        _ConnectorBase = object
        _MetadataBase = object
        _WorkerMetadataBase = object

__all__ = [
    "ConnectorOptions",
    "HiCacheConnector",
    "HiCacheMetadata",
    "HiCacheWorkerMetadata",
    "HostIndex",
    "LoadPlan",
    "SchedulerSide",
    "WorkerSide",
    "parse_options",
]

log = logging.getLogger("hicache.vllm")
T = TypeVar("T")

DEFAULT_HOST_FRACTION = 0.10
"""Default L2 size: this fraction of the machine's physical memory, per worker."""

# ---------------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, validated. Every key is documented in docs/vllm.md."""

    host_bytes: int | None = None  # L2 bytes per worker; None: host_fraction of physical memory
    host_fraction: float = DEFAULT_HOST_FRACTION
    storage: str | None = None  # an L3 spec (hicache.backends.registry), None: no L3
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    storage_timeout: float = 5.0  # seconds per L3 call; past it the call is a miss
    storage_write: bool = True  # write-through of stored pages to L3
    model_id: str | None = None  # the L3 namespace's model; None: vLLM's model name
    salt_requests: bool = True  # a request's cache_salt separates its pages


_OPTION_KEYS = {
    "host_bytes",
    "host_gib",
    "host_fraction",
    "storage",
    "storage_options",
    "storage_timeout",
    "storage_write",
    "model_id",
    "salt_requests",
}


def parse_options(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """Validate `kv_connector_extra_config`. Raises ValueError naming an unknown key or a bad
    value, so a typo fails vLLM's start instead of silently running on defaults."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _OPTION_KEYS)
    if unknown:
        raise ValueError(
            f"HiCacheConnector: unknown kv_connector_extra_config keys {unknown}; "
            f"known: {sorted(_OPTION_KEYS)} (docs/vllm.md)"
        )
    if "host_bytes" in extra and "host_gib" in extra:
        raise ValueError("HiCacheConnector: give host_bytes or host_gib, not both")
    host_bytes: int | None = None
    if "host_bytes" in extra:
        host_bytes = int(extra["host_bytes"])
    elif "host_gib" in extra:
        host_bytes = int(float(extra["host_gib"]) * (1 << 30))
    if host_bytes is not None and host_bytes <= 0:
        raise ValueError(f"HiCacheConnector: host_bytes must be positive, got {host_bytes}")
    fraction = float(extra.get("host_fraction", DEFAULT_HOST_FRACTION))
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"HiCacheConnector: host_fraction must be in (0, 1), got {fraction}")
    storage = extra.get("storage") or None
    if storage is not None and not isinstance(storage, str):
        raise ValueError(f"HiCacheConnector: storage must be a spec string, got {storage!r}")
    if storage is not None:
        from hicache.backends.registry import resolve

        resolve(storage)  # ValueError for an unknown form
    storage_options = extra.get("storage_options") or {}
    if not isinstance(storage_options, Mapping):
        raise ValueError("HiCacheConnector: storage_options must be a mapping")
    timeout = float(extra.get("storage_timeout", 5.0))
    if not timeout > 0:
        raise ValueError(f"HiCacheConnector: storage_timeout must be positive, got {timeout}")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ValueError(f"HiCacheConnector: model_id must be a non-empty string, got {model_id!r}")
    return ConnectorOptions(
        host_bytes=host_bytes,
        host_fraction=fraction,
        storage=storage,
        storage_options=dict(storage_options),
        storage_timeout=timeout,
        storage_write=bool(extra.get("storage_write", True)),
        model_id=model_id,
        salt_requests=bool(extra.get("salt_requests", True)),
    )


def default_host_bytes(fraction: float, tp_size: int) -> int:
    """`fraction` of physical memory, shared by the `tp_size` workers of one machine."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        physical = 16 << 30
    return int(physical * fraction) // max(1, tp_size)


# ------------------------------------------------------------------------- geometry, keys


@dataclass(frozen=True, slots=True)
class Geometry:
    """What both sides derive alike from vLLM's KV cache config."""

    block_size: int  # tokens per vLLM block = hicache page
    layers: tuple[str, ...]  # attention layers, in vLLM's group order
    page_bytes: int  # one block of every layer, one worker's shard
    kv: str  # hicache kv spec, for the L3 namespace
    layout: str  # the byte order of a stored page


def geometry_of(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """Geometry of a model with one uniform attention KV cache group. Raises ValueError for
    what this connector does not support (hybrid models: several groups)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(
            f"HiCacheConnector supports one KV cache group (uniform attention), got {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    layers = tuple(groups[0].layer_names)
    block_size = int(spec.block_size)
    heads = int(getattr(spec, "num_kv_heads", 1))
    head_size = int(getattr(spec, "head_size", 0))
    dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        dtype = "uint8"  # quantized caches: the namespace still separates them (layout)
    kind = "mla" if type(spec).__name__.startswith("MLA") else "mha"
    page_bytes = int(spec.page_size_bytes) * len(layers)
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "?"))
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    layout = (
        f"vllm:{device}:{getattr(kv_cache_config, 'kv_cache_layout', None)}:"
        f"{cache_dtype}:{type(spec).__name__}:{page_bytes}"
    )
    kv = f"{kind}:{len(layers)}:{max(heads, 1)}:{max(head_size, 1)}:{dtype}"
    return Geometry(block_size, layers, page_bytes, kv, layout)


def namespace_of(geometry: Geometry, model_id: str, *, rank: int, tp_size: int) -> Namespace:
    """The L3 namespace of one worker's shard (the scheduler probes rank 0's)."""
    return Namespace(
        model=model_id,
        kv=geometry.kv,
        page_size=geometry.block_size,
        rank=rank,
        tp_size=tp_size,
        layout=geometry.layout,
    )


def salt_prior(salt: str | None) -> PageHash | None:
    """Where a salted request's page hash chain starts: hicache's `salt_seed`, so keys equal
    those of an embedded HiCache matching the same tokens under the same salt."""
    if not salt:
        return None
    from hicache.components.tree.structure import salt_seed

    return salt_seed(salt.encode())


# ----------------------------------------------------------------------- storage, off loop


class LoopThread:
    """One asyncio loop on a daemon thread: how the synchronous connector calls hicache's
    async storage backends."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class Storage:
    """An L3 backend behind a loop thread; every failure is a miss (hicache's contract)."""

    def __init__(self, spec: str, namespace: Namespace, options: ConnectorOptions) -> None:
        from hicache.backends.registry import connect_backend

        self.namespace = namespace
        self.timeout = options.storage_timeout
        self.errors = 0
        self._loop = LoopThread("hicache-vllm-storage")
        self.backend: StorageBackend = self._loop.run(
            connect_backend(
                spec, namespace=namespace, emit=self._emit, **dict(options.storage_options)
            ),
            max(30.0, self.timeout),
        )

    def _emit(self, event: str, **fields: Any) -> None:
        log.warning("hicache %s %s", event, fields)

    def keys(self, hashes: Sequence[str]) -> list[str]:
        return self.namespace.keys(hashes)

    def exists(self, hashes: Sequence[str]) -> int:
        if not hashes:
            return 0
        try:
            return int(self._loop.run(self.backend.exists(self.keys(hashes)), self.timeout))
        except (TimeoutError, concurrent.futures.TimeoutError, OSError, RuntimeError) as exc:
            self.errors += 1
            log.warning("hicache storage exists failed (a miss): %r", exc)
            return 0

    def get_into(self, hashes: Sequence[str], targets: Sequence[Sequence[memoryview]]) -> int:
        try:
            coro = self.backend.get_into(self.keys(hashes), targets)
            return int(self._loop.run(coro, self.timeout))
        except (TimeoutError, concurrent.futures.TimeoutError, OSError, RuntimeError) as exc:
            self.errors += 1
            log.warning("hicache storage read failed (a miss): %r", exc)
            return 0

    def set_from_async(
        self, hashes: Sequence[str], sources: Sequence[Sequence[memoryview]]
    ) -> concurrent.futures.Future[int]:
        return self._loop.submit(self.backend.set_from(self.keys(hashes), sources))

    def close(self) -> None:
        try:
            self._loop.run(self.backend.aclose(), self.timeout)
        except (TimeoutError, concurrent.futures.TimeoutError, OSError, RuntimeError) as exc:
            log.warning("hicache storage close failed: %r", exc)
        self._loop.close()


# ------------------------------------------------------------------------ scheduler side


class HostIndex:
    """The L2 ledger, in vLLM's scheduler: which page hash each host slot holds, least
    recently used first. Slots pinned for the step being built are never evicted in it."""

    def __init__(self, slots: int) -> None:
        if slots <= 0:
            raise ValueError(f"the host pool needs at least one slot, got {slots}")
        self.slots = slots
        self._by_hash: OrderedDict[str, int] = OrderedDict()
        self._hash_of: dict[int, str] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, page_hash: str) -> int | None:
        return self._by_hash.get(page_hash)

    def touch(self, page_hash: str) -> None:
        if page_hash in self._by_hash:
            self._by_hash.move_to_end(page_hash)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def allocate(self, page_hash: str) -> int | None:
        """A slot for a page not in the index (recorded at once, pinned), evicting the least
        recently used unpinned page if none is free; None when every slot is pinned."""
        if page_hash in self._by_hash:
            raise ValueError(f"page {page_hash[:12]} is already in L2")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._by_hash.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
            del self._hash_of[slot]
            self.evictions += 1
        self._by_hash[page_hash] = slot
        self._hash_of[slot] = page_hash
        self._pinned.add(slot)
        return slot

    def forget(self, slot: int, page_hash: str) -> bool:
        """Drop `slot` if it still holds `page_hash` (a failed read the worker reported)."""
        if self._hash_of.get(slot) != page_hash:
            return False
        del self._hash_of[slot]
        del self._by_hash[page_hash]
        self._free.append(slot)
        return True

    def clear(self) -> None:
        self._by_hash.clear()
        self._hash_of.clear()
        self._free = list(range(self.slots - 1, -1, -1))
        self._pinned.clear()


@dataclass(slots=True)
class LoadPlan:
    """One request's load in one step: block `block_ids[i]` gets host slot `slots[i]`, read
    first from L3 where `read[i]` (the page hash `hashes[i]`)."""

    req_id: str
    block_ids: list[int]
    slots: list[int]
    hashes: list[str]
    read: list[bool]


class HiCacheMetadata(_MetadataBase):
    """Scheduler -> workers, one per step: the host pool's shape and the step's transfers."""

    def __init__(self, host_slots: int, page_bytes: int) -> None:
        self.host_slots = host_slots
        self.page_bytes = page_bytes
        self.loads: list[LoadPlan] = []
        self.store_blocks: list[int] = []
        self.store_slots: list[int] = []
        self.store_hashes: list[str] = []


class HiCacheWorkerMetadata(_WorkerMetadataBase):
    """Workers -> scheduler: host slots whose L3 read failed (slot, page hash)."""

    def __init__(self, bad: set[tuple[int, str]] | None = None) -> None:
        self.bad: set[tuple[int, str]] = set(bad or ())

    def aggregate(self, other: Any) -> HiCacheWorkerMetadata:
        return HiCacheWorkerMetadata(self.bad | set(getattr(other, "bad", ())))


@dataclass(slots=True)
class _Request:
    request: Any  # vllm.v1.request.Request (live in the scheduler process)
    prior: PageHash | None
    hashes: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    probe_start: int = 0  # pages vLLM had locally at the last probe
    stored: int = 0  # pages (from the first) already stored or found in L2


class SchedulerSide:
    """The connector's scheduler half: the L2 index, the L3 probe, the step's plan."""

    def __init__(
        self,
        options: ConnectorOptions,
        geometry: Geometry,
        host_slots: int,
        storage: Storage | None = None,
    ) -> None:
        self.options = options
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.index = HostIndex(host_slots)
        self.storage = storage
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadPlan] = []
        self.stats: dict[str, int] = dict.fromkeys(
            ("queries", "hit_l2_pages", "hit_l3_pages", "stored_pages", "forgotten", "no_slot"), 0
        )

    def _state(self, request: Any) -> _Request:
        rid = str(request.request_id)
        st = self._requests.get(rid)
        if st is None or st.request is not request:
            salt = getattr(request, "cache_salt", None) if self.options.salt_requests else None
            st = _Request(request=request, prior=salt_prior(salt))
            self._requests[rid] = st
        return st

    def _hashes(self, st: _Request, pages: int) -> list[str]:
        """The hashes of the request's first `pages` whole pages (cached, extended)."""
        have = len(st.hashes)
        if pages > have:
            tokens = list(
                st.request.all_token_ids[have * self.block_size : pages * self.block_size]
            )
            prior = PageHash(st.hashes[-1]) if st.hashes else st.prior
            st.hashes.extend(chain_page_hashes(tokens, self.block_size, prior=prior))
        return st.hashes[:pages]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past vLLM's own (block-aligned) hit that L2 or L3 holds, whole pages only,
        always leaving one token for vLLM to compute."""
        self.stats["queries"] += 1
        st = self._state(request)
        start = num_computed_tokens // self.block_size
        st.probe_start = start
        limit = max(0, (int(request.num_tokens) - 1) // self.block_size)
        if limit <= start:
            return 0
        hashes = self._hashes(st, limit)
        end = start
        while end < limit and self.index.lookup(hashes[end]) is not None:
            end += 1
        if self.storage is not None and end < limit:
            in_l3 = self.storage.exists(hashes[end:limit])
            end += in_l3
        return (end - start) * self.block_size

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the pages vLLM accepted, into the blocks it allocated."""
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        start = st.probe_start
        pages = -(-num_external_tokens // self.block_size)
        block_ids = list(blocks.get_block_ids()[0])
        hashes = self._hashes(st, start + pages)
        plan = LoadPlan(str(request.request_id), [], [], [], [])
        for i in range(start, start + pages):
            h = hashes[i]
            slot = self.index.lookup(h)
            read = slot is None
            if slot is None:
                slot = self.index.allocate(h)
                if slot is None:  # every slot pinned this step: the worker reports an error
                    self.stats["no_slot"] += 1
                    slot = -1
                    read = False
                else:
                    self.stats["hit_l3_pages"] += 1
            else:
                self.index.touch(h)
                self.index.pin(slot)
                self.stats["hit_l2_pages"] += 1
            plan.block_ids.append(block_ids[i])
            plan.slots.append(slot)
            plan.hashes.append(h)
            plan.read.append(read)
        self._loads.append(plan)

    def build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        meta = HiCacheMetadata(self.index.slots, self.geometry.page_bytes)
        meta.loads, self._loads = self._loads, []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            st.stored = min(st.stored, int(new.num_computed_tokens) // self.block_size)
            self._plan_stores(meta, st, int(new.num_computed_tokens) + int(sched[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._requests.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_stores(meta, st, int(cached.num_computed_tokens[i]) + int(sched[rid]))
        self.index.unpin_all()
        return meta

    def _plan_stores(self, meta: HiCacheMetadata, st: _Request, computed: int) -> None:
        """Write-through: every page whose tokens are all computed by the end of this step
        and known now goes to L2 (and from there to L3) unless L2 has it."""
        known = len(st.request.all_token_ids)
        pages = min(computed, known) // self.block_size
        pages = min(pages, len(st.block_ids))
        if pages <= st.stored:
            return
        hashes = self._hashes(st, pages)
        for i in range(st.stored, pages):
            h = hashes[i]
            if self.index.lookup(h) is not None:
                self.index.touch(h)
                continue
            slot = self.index.allocate(h)
            if slot is None:
                self.stats["no_slot"] += 1
                break
            meta.store_blocks.append(st.block_ids[i])
            meta.store_slots.append(slot)
            meta.store_hashes.append(h)
            self.stats["stored_pages"] += 1
        st.stored = pages

    def request_finished(self, request: Any) -> None:
        self._requests.pop(str(request.request_id), None)

    def worker_feedback(self, worker_meta: Any) -> None:
        for slot, page_hash in getattr(worker_meta, "bad", ()):
            if self.index.forget(slot, page_hash):
                self.stats["forgotten"] += 1

    def reset(self) -> None:
        self.index.clear()


# --------------------------------------------------------------------------- worker side


class WorkerSide:
    """The connector's worker half: the host pool and every copy and L3 transfer."""

    def __init__(
        self,
        options: ConnectorOptions,
        geometry: Geometry,
        num_blocks: int,
        storage: Storage | None,
    ) -> None:
        self.options = options
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.storage = storage
        self.planes: list[torch.Tensor] = []  # (num_blocks, bytes) uint8 views of vLLM's KV
        self.offsets: list[int] = []
        self.host: torch.Tensor | None = None  # (slots, page_bytes) uint8
        self.valid: list[bool] = []
        self.errors: set[int] = set()
        self.bad: set[tuple[int, str]] = set()
        self.uploads: dict[int, concurrent.futures.Future[int]] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "loaded_pages",
                "stored_pages",
                "read_pages",
                "read_failed",
                "load_errors",
                "uploaded",
            ),
            0,
        )

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Flat byte views of every layer's blocks: a block-major tensor (`[blocks, ...]`,
        kernel blocks of one vLLM block adjacent) or a K/V-outer one (`[2, blocks, ...]`)."""
        import torch

        names = [n for n in self.geometry.layers if n in kv_caches] or sorted(kv_caches)
        planes: list[torch.Tensor] = []
        for name in names:
            t = kv_caches[name]
            parts = [t]
            if t.shape[0] % self.num_blocks != 0 and t.shape[0] == 2:
                parts = [t[0], t[1]]
            for p in parts:
                if p.shape[0] % self.num_blocks != 0:
                    raise NotImplementedError(
                        f"HiCacheConnector: layer {name} KV shape {tuple(t.shape)} has no block "
                        f"dimension of {self.num_blocks} blocks first"
                    )
                try:
                    planes.append(p.view(self.num_blocks, -1).view(torch.uint8))
                except RuntimeError as exc:
                    raise NotImplementedError(
                        f"HiCacheConnector: layer {name} KV (shape {tuple(t.shape)}, stride "
                        f"{t.stride()}) is not block-contiguous: {exc}"
                    ) from exc
        offsets, total = [], 0
        for p in planes:
            offsets.append(total)
            total += int(p.shape[1])
        if total != self.geometry.page_bytes:
            raise NotImplementedError(
                f"HiCacheConnector: vLLM's KV blocks hold {total} bytes per block over all "
                f"layers, the KV cache spec says {self.geometry.page_bytes}"
            )
        self.planes, self.offsets = planes, offsets

    def _ensure_host(self, meta: HiCacheMetadata) -> torch.Tensor:
        import torch

        if meta.page_bytes != self.geometry.page_bytes:
            raise RuntimeError(
                f"HiCacheConnector: scheduler page of {meta.page_bytes} bytes, worker's "
                f"{self.geometry.page_bytes}"
            )
        if self.host is None:
            # Untouched pages cost nothing until written (the OS maps them on first touch).
            self.host = torch.empty((meta.host_slots, meta.page_bytes), dtype=torch.uint8)
            self.valid = [False] * meta.host_slots
        return self.host

    def _page(self, slot: int) -> list[memoryview]:
        assert self.host is not None
        return [self.host[slot].numpy().data.cast("B")]

    def _settle_upload(self, slot: int) -> None:
        """Before a host slot is overwritten, its upload to L3 must have read it."""
        fut = self.uploads.pop(slot, None)
        if fut is None:
            return
        try:
            fut.result(self.options.storage_timeout * 4)
        except (TimeoutError, concurrent.futures.TimeoutError, OSError, RuntimeError) as exc:
            log.warning("hicache upload failed (L3 misses it): %r", exc)

    def start_load(self, meta: HiCacheMetadata) -> None:
        """L3 -> L2 reads, then L2 -> L1 copies, before the forward reads any layer."""
        import torch

        if not meta.loads:
            if self.host is None and (meta.store_slots or meta.host_slots):
                self._ensure_host(meta)
            return
        host = self._ensure_host(meta)
        reads = [(p, i) for p in meta.loads for i, r in enumerate(p.read) if r]
        if reads:
            for p, i in reads:
                self._settle_upload(p.slots[i])
                self.valid[p.slots[i]] = False
            got = 0
            if self.storage is not None:
                targets = [self._page(p.slots[i]) for p, i in reads]
                got = self.storage.get_into([p.hashes[i] for p, i in reads], targets)
            self.stats["read_pages"] += got
            for k, (p, i) in enumerate(reads):
                if k < got:
                    self.valid[p.slots[i]] = True
                else:
                    self.stats["read_failed"] += 1
                    self.bad.add((p.slots[i], p.hashes[i]))
        blocks: list[int] = []
        slots: list[int] = []
        for p in meta.loads:
            failed = False
            for b, s in zip(p.block_ids, p.slots):
                # A page after a failed one is not loaded either: vLLM recomputes from the
                # first failed block of a request, and a prefix must stay a prefix.
                if failed or s < 0 or not self.valid[s]:
                    failed = True
                    self.errors.add(b)
                    self.stats["load_errors"] += 1
                    continue
                blocks.append(b)
                slots.append(s)
        if blocks:
            bi = torch.tensor(blocks, dtype=torch.long)
            si = torch.tensor(slots, dtype=torch.long)
            for plane, off in zip(self.planes, self.offsets):
                plane[bi] = host[si, off : off + plane.shape[1]]
            self.stats["loaded_pages"] += len(blocks)

    def save(self, meta: HiCacheMetadata) -> None:
        """L1 -> L2 copies of the pages computed this step, then their L3 write-through."""
        import torch

        if not meta.store_slots:
            return
        host = self._ensure_host(meta)
        for s in meta.store_slots:
            self._settle_upload(s)
        bi = torch.tensor(meta.store_blocks, dtype=torch.long)
        si = torch.tensor(meta.store_slots, dtype=torch.long)
        for plane, off in zip(self.planes, self.offsets):
            host[si, off : off + plane.shape[1]] = plane[bi]
        for s in meta.store_slots:
            self.valid[s] = True
        self.stats["stored_pages"] += len(meta.store_slots)
        if self.storage is not None and self.options.storage_write:
            if not self.storage.namespace.writes:
                return
            fut = self.storage.set_from_async(
                list(meta.store_hashes), [self._page(s) for s in meta.store_slots]
            )
            fut.add_done_callback(self._count_upload)
            for s in meta.store_slots:
                self.uploads[s] = fut

    def _count_upload(self, fut: concurrent.futures.Future[int]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.stats["uploaded"] += int(fut.result())

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def take_bad(self) -> set[tuple[int, str]]:
        bad, self.bad = self.bad, set()
        return bad

    def shutdown(self) -> None:
        for slot in list(self.uploads):
            self._settle_upload(slot)
        if self.storage is not None:
            self.storage.close()
            self.storage = None


# ------------------------------------------------------------------------------ connector


def _tp(vllm_config: Any) -> tuple[int, int]:
    """(this worker's TP rank, TP size)."""
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    try:
        import importlib

        state = importlib.import_module("vllm.distributed.parallel_state")
        return int(state.get_tensor_model_parallel_rank()), size
    except (ImportError, AssertionError, AttributeError):
        return 0, size


class HiCacheConnector(_ConnectorBase):
    """vLLM KV connector v1 over hicache's L2 (host pool) and L3 (storage backends)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        cast(Any, super()).__init__(
            vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config
        )
        if kv_cache_config is None:
            raise ValueError("HiCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        transfer = vllm_config.kv_transfer_config
        self.options = parse_options(getattr(transfer, "kv_connector_extra_config", None))
        self.geometry = geometry_of(vllm_config, kv_cache_config)
        rank, tp_size = _tp(vllm_config)
        model_id = self.options.model_id or str(vllm_config.model_config.model)
        host_bytes = self.options.host_bytes or default_host_bytes(
            self.options.host_fraction, tp_size
        )
        host_slots = max(1, host_bytes // self.geometry.page_bytes)
        self.is_scheduler = getattr(role, "name", str(role)).upper().endswith("SCHEDULER")
        storage = None
        if self.options.storage is not None:
            ns = namespace_of(
                self.geometry, model_id, rank=0 if self.is_scheduler else rank, tp_size=tp_size
            )
            storage = Storage(self.options.storage, ns, self.options)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if self.is_scheduler:
            self.scheduler = SchedulerSide(self.options, self.geometry, host_slots, storage)
        else:
            self.worker = WorkerSide(
                self.options, self.geometry, int(kv_cache_config.num_blocks), storage
            )
        log.info(
            "HiCacheConnector %s: L2 %d slots x %d B, L3 %s",
            "scheduler" if self.is_scheduler else f"worker rank {rank}",
            host_slots,
            self.geometry.page_bytes,
            self.options.storage or "off",
        )

    # -- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if meta is not None:
                self.scheduler.worker_feedback(meta)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.request_finished(request)
        return False, None

    def reset_cache(self) -> bool | None:
        if self.scheduler is not None:
            self.scheduler.reset()
            return True
        return None

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = cast(Any, self)._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # wait_for_save copies every layer's computed pages after the forward

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if not cast(Any, self).has_connector_metadata():
            return
        meta = cast(Any, self)._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self.worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> HiCacheWorkerMetadata | None:
        if self.worker is None:
            return None
        bad = self.worker.take_bad()
        return HiCacheWorkerMetadata(bad) if bad else None

    def shutdown(self) -> None:
        if self.worker is not None:
            log.info("HiCacheConnector worker stats: %s", self.worker.stats)
            self.worker.shutdown()
        if self.scheduler is not None:
            log.info("HiCacheConnector scheduler stats: %s", self.scheduler.stats)
            if self.scheduler.storage is not None:
                self.scheduler.storage.close()
                self.scheduler.storage = None
