"""The event handlers: how each event of the cache's log moves the metrics (`HANDLERS`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hicache.observability.metrics.instruments import MetricSet

_MAX_OPEN_OPS = 65_536  # start times kept per kind, for the durations joined by op id


def _on_match(m: MetricSet, e: dict[str, Any], i: str) -> None:
    tokens, dev = e.get("tokens", 0), e.get("device_hit", 0)
    m.queried_tokens.labels(i, "device").inc(tokens)
    m.hit_tokens.labels(i, "device").inc(dev)
    m.queried_tokens.labels(i, "host").inc(max(tokens - dev, 0))
    salt_class = "salted" if e.get("salted") else "shared"
    m.salt_class_tokens.labels(i, salt_class, "queried").inc(tokens)
    m.salt_class_tokens.labels(i, salt_class, "hit").inc(dev)


def _remember(starts: OrderedDict[Any, float], op: Any, t: float) -> None:
    starts[op] = t
    while len(starts) > _MAX_OPEN_OPS:
        starts.popitem(last=False)


def _on_load_started(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.hit_tokens.labels(i, "host").inc(e.get("tokens", 0))
    _remember(m._load_started, e.get("op"), e.get("t", 0.0))


def _on_prefetch_started(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.queried_tokens.labels(i, "storage").inc(e.get("tokens", 0))
    _remember(m._prefetch_started, e.get("op"), e.get("t", 0.0))


def _on_prefetch_done(m: MetricSet, e: dict[str, Any], i: str) -> None:
    read = e.get("read", 0)
    m.hit_tokens.labels(i, "storage").inc(read)
    m.prefetches.labels(i, e.get("state", "done")).inc()
    if not read:  # nothing read: no end to time (a stop while idle has no prefetcher.done)
        m._prefetch_started.pop(e.get("op"), None)


def _on_prefetcher_done(m: MetricSet, e: dict[str, Any], i: str) -> None:
    start = m._prefetch_started.pop(e.get("op"), None)
    nbytes = e.get("read", 0) * m.page_nbytes
    seconds = None if start is None else max(e.get("t", 0.0) - start, 0.0)
    m._transfer(i, "s2h", nbytes, seconds if nbytes else None)


def _on_prefetch_skipped(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.prefetches.labels(i, f"skipped:{e.get('reason')}").inc()


def _on_evict_device(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "device").inc(e.get("tokens", 0))


def _on_evict_host(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "host").inc(e.get("tokens", 0))


def _on_storage_evicted(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "storage").inc(e.get("values", 0) * m.page_size)


def _on_backup_done(m: MetricSet, e: dict[str, Any], i: str) -> None:
    if e.get("ok", True):
        m._transfer(i, "d2h", e.get("bytes", 0), e.get("seconds"))
    else:
        m.failed_transfers.labels(i, "d2h").inc()


def _on_load_done(m: MetricSet, e: dict[str, Any], i: str) -> None:
    start = m._load_started.pop(e.get("op"), None)
    if e.get("ok", True):
        seconds = e.get("seconds")
        if seconds is None and start is not None:  # tree.load_started .. loader.load_done
            seconds = max(e.get("t", 0.0) - start, 0.0)
        m._transfer(i, "h2d", e.get("bytes", 0), seconds)
    else:
        m.failed_transfers.labels(i, "h2d").inc()


def _on_uploader_stored(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m._transfer(i, "h2s", e.get("bytes", 0), e.get("seconds"))


def _on_uploader_failed(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.failed_uploads.labels(i).inc()


def _on_uploader_retry(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.upload_retries.labels(i).inc()


def _on_uploader_timeout(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, "upload").inc()


def _on_prefetcher_timeout(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, e.get("step", "read")).inc()


def _on_storage_timeout(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, e.get("call", "clear")).inc()


def _on_storage_error(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_errors.labels(i, str(e.get("op", "unknown"))).inc()


def _on_io_error(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_errors.labels(i, "prefetch").inc()


def _on_corrupt(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.corrupt_values.labels(i, str(e.get("reason", "unknown"))).inc()


def _on_upload_skipped(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.skipped_uploads.labels(i).inc()


def _on_storage_dropped(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.storage_dropped_pages.labels(i, str(e.get("reason", "unknown"))).inc(int(e.get("pages", 0)))


def _on_load_deferred(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.skipped_loads.labels(i, "deferred").inc()


def _on_load_skipped(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.skipped_loads.labels(i, str(e.get("reason", "capacity"))).inc()


def _on_load_failed(m: MetricSet, e: dict[str, Any], i: str) -> None:
    pass  # counted by loader.load_done ok=false (an abandoned load has neither)


def _on_abandoned(m: MetricSet, e: dict[str, Any], i: str) -> None:
    for kind in ("writes", "loads", "uploads", "prefetches"):
        if e.get(kind):
            m.abandoned_ops.labels(i, kind).inc(e[kind])


def _on_actor_failed(m: MetricSet, e: dict[str, Any], i: str) -> None:
    m.actor_failures.labels(i).inc()


HANDLERS: dict[str, Callable[[MetricSet, dict[str, Any], str], None]] = {
    "tree.match": _on_match,
    "tree.load_started": _on_load_started,
    "tree.prefetch_started": _on_prefetch_started,
    "tree.prefetch_done": _on_prefetch_done,
    "tree.prefetch_skipped": _on_prefetch_skipped,
    "prefetcher.done": _on_prefetcher_done,
    "tree.evict_device": _on_evict_device,
    "tree.evict_host": _on_evict_host,
    "storage.evicted": _on_storage_evicted,
    "writer.backup_done": _on_backup_done,
    "loader.load_done": _on_load_done,
    "uploader.stored": _on_uploader_stored,
    "uploader.failed": _on_uploader_failed,
    "uploader.retry": _on_uploader_retry,
    "uploader.timeout": _on_uploader_timeout,
    "prefetcher.timeout": _on_prefetcher_timeout,
    "tree.storage_timeout": _on_storage_timeout,
    "storage.error": _on_storage_error,
    "prefetcher.io_error": _on_io_error,
    "storage.corrupt": _on_corrupt,
    "tree.upload_skipped": _on_upload_skipped,
    "tree.storage_dropped": _on_storage_dropped,
    "tree.load_deferred": _on_load_deferred,
    "tree.load_skipped": _on_load_skipped,
    "tree.load_failed": _on_load_failed,
    "tree.abandoned": _on_abandoned,
    "kernel.actor_failed": _on_actor_failed,
}
