"""The vLLM connector's counters and KV cache events, in vLLM's own forms.

- `Counters`: what each half of the connector counts; `take()` hands vLLM the increments
  since the last call (`get_kv_connector_stats`, called every step on both halves).
- `HiCacheStats` (a `KVConnectorStats`): the increments in flight from the workers and the
  scheduler to vLLM's stat loggers; `aggregate` sums them, `reduce` is the dict vLLM's log
  line prints ("KV Transfer metrics: ...").
- `HiCachePromMetrics` (a `KVConnectorPromMetrics`): one Prometheus counter per entry of
  `METRICS`, named `vllm:hicache_<name>`, labelled with vLLM's labels (model_name, engine).
- `EventLog`: `BlockStored`/`BlockRemoved` events (vllm.distributed.kv_events) for pages
  entering and leaving L2 (medium "CPU") and written to L3 (medium "STORAGE"), named by
  vLLM's own block hashes so they line up with vLLM's events for its GPU blocks.

Every metric and event is documented in docs/vllm.md ("Metrics and events").
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    _StatsBase = object
    _PromBase = object
else:
    try:  # vLLM is optional: without it the counters and stats still work (unit tests).
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorPromMetrics as _PromBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorStats as _StatsBase,
        )
    except ImportError:  # pragma: no cover - exercised only where vLLM is absent
        _StatsBase = object
        _PromBase = object

__all__ = ["METRICS", "Counters", "EventLog", "HiCachePromMetrics", "HiCacheStats", "PagePayload"]

METRICS: dict[str, str] = {
    # scheduler side (vLLM's scheduler process)
    "lookups": "get_num_new_matched_tokens calls (requests looked up in L2 and L3)",
    "hit_l2_pages": "pages promised to vLLM from L2 (planned loads)",
    "hit_l3_pages": "pages promised to vLLM from L3 (planned reads into L2, then loads)",
    "l2_evictions": "L2 pages evicted (least recently used) to make room",
    "l2_forgotten": "L2 pages dropped because their L3 read failed",
    "no_slot": "pages neither loaded nor stored: every L2 slot was pinned by the step",
    "async_loads": "requests told their load is asynchronous (pages from L3 or still arriving)",
    "prefetch_pages": "L3 pages read into L2 for no request (best_effort prefetch)",
    "write_back_requests": "finished requests whose blocks waited for a write-back store",
    # worker side (summed over the workers: pages count once per TP rank, bytes are shards)
    "l2_load_pages": "pages copied L2 -> vLLM's KV blocks",
    "l2_load_bytes": "bytes copied L2 -> vLLM's KV blocks",
    "l2_store_pages": "pages copied vLLM's KV blocks -> L2",
    "l2_store_bytes": "bytes copied vLLM's KV blocks -> L2",
    "l3_read_pages": "pages read from L3 into L2, checksums verified",
    "l3_read_bytes": "bytes read from L3 into L2",
    "l3_read_failures": "L3 reads that came back short (absent, corrupt, unreachable, timeout)",
    "l3_write_pages": "pages written to L3 (write-through)",
    "l3_write_bytes": "bytes written to L3",
    "l3_write_failures": "pages whose L3 write failed or was not accepted (L3 misses them)",
    "load_errors": "blocks reported to vLLM as failed loads (vLLM recomputes them)",
    "load_timeouts": "L3 pages an asynchronous load gave up on at its deadline (recomputed)",
    "aborted_loads": "asynchronous loads dropped because vLLM aborted their request",
}
"""Every counter: name -> meaning. Prometheus: `vllm:hicache_<name>` (a counter: `_total`)."""


class Counters:
    """Monotonic counters with a view of the increments since the last `take()`. Thread-safe:
    L3 write completions are counted on the storage loop's thread."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.totals: dict[str, int] = dict.fromkeys(names, 0)
        self._taken: dict[str, int] = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.totals[name] += n

    def __getitem__(self, name: str) -> int:
        return self.totals[name]

    def take(self) -> dict[str, int]:
        """The non-zero increments since the last call."""
        with self._lock:
            delta = {k: v - self._taken[k] for k, v in self.totals.items() if v != self._taken[k]}
            self._taken = dict(self.totals)
        return delta


class HiCacheStats(_StatsBase):
    """The connector's stats for vLLM: `data` maps a `METRICS` name to an increment."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = {k: v for k, v in (data or {}).items() if k in METRICS}

    def __repr__(self) -> str:
        return f"HiCacheStats({self.data})"

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> HiCacheStats:
        for k, v in dict(getattr(other, "data", None) or {}).items():
            if k in METRICS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"hicache_{k}": int(self.data[k]) for k in METRICS if self.data.get(k)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HiCachePromMetrics(_PromBase):
    """One Prometheus counter per `METRICS` entry, per engine (vLLM's label values)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        cast(Any, super()).__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls: Any = cast(Any, self)._counter_cls
        self.counters: dict[tuple[int, str], Any] = {}
        for name, doc in METRICS.items():
            metric = counter_cls(
                name=f"vllm:hicache_{name}",
                documentation=f"hicache connector: {doc}",
                labelnames=labelnames,
            )
            for engine, values in per_engine_labelvalues.items():
                self.counters[(engine, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


# ----------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class PagePayload:
    """What a `BlockStored` event says of one page, captured while its request is alive."""

    block_hash: Any  # vLLM's block hash (bytes, or int under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any  # the previous page's, None for a request's first page
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


def _vllm(module: str) -> Any:
    return importlib.import_module(module)


MEDIUM_L2 = "CPU"  # vllm.distributed.kv_events.MEDIUM_CPU
MEDIUM_L3 = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE


class EventLog:
    """The scheduler half's KV cache events, drained by vLLM through `take_events`. Inert
    (`enabled` False) unless vLLM's `kv_events_config.enable_kv_cache_events` is on."""

    def __init__(self, enabled: bool, block_size: int, tp_size: int = 1) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self.tp_size = max(1, tp_size)
        self._events: list[Any] = []
        self._in_l2: dict[str, PagePayload] = {}  # hicache page hash -> payload, pages in L2
        self._uploading: dict[str, PagePayload] = {}  # written to L3, not yet confirmed
        self._upload_acks: dict[str, int] = {}  # confirmations so far (one per TP rank)

    @staticmethod
    def payload(request: Any, page: int, page_hashes: list[str], block_size: int) -> PagePayload:
        """vLLM's hash of the request's page `page` (hicache's page hash where vLLM has none:
        prefix caching off), its parent's, in vLLM's event form, and its tokens."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        convert = _vllm("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash

        def ext(i: int) -> Any:
            raw = hashes[i] if i < len(hashes) else bytes.fromhex(page_hashes[i])
            return convert(raw)

        block_hash = ext(page)
        lora = getattr(request, "lora_request", None)
        tokens = request.all_token_ids[page * block_size : (page + 1) * block_size]
        return PagePayload(
            block_hash=block_hash,
            parent=ext(page - 1) if page > 0 else None,
            token_ids=tuple(int(t) for t in tokens),
            lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
            lora_name=getattr(lora, "name", None) if lora is not None else None,
        )

    def _stored(self, p: PagePayload, medium: str) -> Any:
        return _vllm("vllm.distributed.kv_events").BlockStored(
            block_hashes=[p.block_hash],
            parent_block_hash=p.parent,
            token_ids=list(p.token_ids),
            block_size=self.block_size,
            lora_id=p.lora_id,
            medium=medium,
            lora_name=p.lora_name,
            group_idx=0,
        )

    def entered_l2(self, page_hash: str, payload: PagePayload, *, upload: bool) -> None:
        if not self.enabled:
            return
        self._in_l2[page_hash] = payload
        self._events.append(self._stored(payload, MEDIUM_L2))
        if upload:
            self._uploading[page_hash] = payload

    def left_l2(self, hashes: list[str]) -> None:
        if not self.enabled or not hashes:
            return
        gone = [self._in_l2.pop(h) for h in hashes if h in self._in_l2]
        if gone:
            self._events.append(
                _vllm("vllm.distributed.kv_events").BlockRemoved(
                    block_hashes=[p.block_hash for p in gone], medium=MEDIUM_L2, group_idx=0
                )
            )

    def uploaded(self, acks: dict[str, int]) -> None:
        """Workers confirmed L3 writes: a page is announced once every TP rank wrote it."""
        if not self.enabled:
            return
        for h, n in acks.items():
            if h not in self._uploading:
                continue
            got = self._upload_acks.get(h, 0) + n
            if got >= self.tp_size:
                self._upload_acks.pop(h, None)
                self._events.append(self._stored(self._uploading.pop(h), MEDIUM_L3))
            else:
                self._upload_acks[h] = got

    def upload_failed(self, hashes: list[str]) -> None:
        for h in hashes:
            self._uploading.pop(h, None)
            self._upload_acks.pop(h, None)

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
