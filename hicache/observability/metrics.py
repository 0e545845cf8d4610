"""Prometheus metrics of one cache (optional extra: `pip install 'hicache[metrics]'`).

One source of truth: counters and histograms are fed by the cache's own event log (an
`EventLog` listener, so a metric moves exactly when its event is emitted), and gauges that no
event carries (tokens used per tier, ops in flight, mailbox depth) are read from the cache's
ledgers, tree tables and mailboxes when Prometheus scrapes. docs/metrics.md lists every
metric, its labels and units.

    async with HiCache(CacheConfig(..., metrics_port=9400)) as cache: ...   # serves /metrics

or, for a log of your own, `CacheMetrics(log=log).serve(port)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hicache.observability.events import EventLog

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

TIERS = ("device", "host", "storage")
DIRECTIONS = ("d2h", "h2d", "h2s", "s2h")
_DURATION_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BANDWIDTH_BUCKETS = tuple(
    float(b) for b in (1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)
)
_MAX_OPEN_OPS = 65_536  # start times kept per kind, for the durations joined by op id


def _prometheus() -> ModuleType:
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "hicache metrics need prometheus_client: pip install 'hicache[metrics]'"
        ) from None
    return prometheus_client


class CacheMetrics:
    """The metrics of one cache instance, in a registry of their own.

    `log`: the event log to listen to (the cache's `kernel.log`). `cache`: the `HiCache` whose
    ledgers, tree tables and mailboxes the gauges read on scrape (None: no gauges).
    `instance`: the value of the `cache` label every metric carries (named `cache`, not
    `instance`, so it does not clash with the target label Prometheus adds).
    `page_size` / `page_nbytes`: for metrics the events give in pages (taken from `cache`
    when given).
    """

    def __init__(
        self,
        *,
        log: EventLog | None = None,
        cache: Any = None,
        instance: str = "0",
        page_size: int | None = None,
        page_nbytes: int | None = None,
    ) -> None:
        pc = _prometheus()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.instance = instance
        self._cache = cache
        if cache is not None:
            page_size = page_size or cache.config.page_size
            host_pool = getattr(cache, "host_pool", None)
            if page_nbytes is None and host_pool is not None:
                page_nbytes = host_pool.page_nbytes
        self.page_size = page_size or 0
        self.page_nbytes = page_nbytes or 0
        self._log: EventLog | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._prefetch_started: OrderedDict[Any, float] = OrderedDict()
        self._load_started: OrderedDict[Any, float] = OrderedDict()
        r, lab = self.registry, ["cache"]

        def counter(name: str, doc: str, labels: tuple[str, ...] | list[str] = ()) -> Any:
            return pc.Counter(name, doc, [*lab, *labels], registry=r)

        self.hit_tokens = counter(
            "hicache_hit_tokens",
            "Tokens served from a tier: device = matched in L1, "
            "host = loaded back from L2 (prefetched pages included), storage = read from L3 "
            "into L2",
            ["tier"],
        )
        self.queried_tokens = counter(
            "hicache_queried_tokens",
            "Tokens asked of a tier: device = every match's length, "
            "host = what the match did not find in L1, storage = every prefetch's length",
            ["tier"],
        )
        self.salt_class_tokens = counter(
            "hicache_match_tokens_by_salt_class",
            "Matched (queried) and L1-hit tokens by salt class: shared = no salt, salted = "
            "a request's own salt (salts themselves are not labels: unbounded cardinality)",
            ["salt_class", "kind"],
        )
        self.evicted_tokens = counter(
            "hicache_evicted_tokens",
            "Tokens evicted from a tier (storage: values dropped by "
            "a size-capped store x page size)",
            ["tier"],
        )
        self.transfer_bytes = counter(
            "hicache_transfer_bytes",
            "Bytes moved, by direction: d2h (L1->L2 backups), h2d "
            "(L2->L1 loads), h2s (L2->L3 uploads), s2h (L3->L2 prefetches)",
            ["direction"],
        )
        self.transfer_seconds = pc.Histogram(
            "hicache_transfer_duration_seconds",
            "Duration of one transfer op, from command "
            "to completion on the cache's clock: d2h backups, h2d loads, h2s uploads (every "
            "storage call and retry of the op), s2h prefetches (probe and reads)",
            [*lab, "direction"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.bandwidth = pc.Histogram(
            "hicache_transfer_bandwidth_bytes_per_second",
            "Bytes per second of one transfer "
            "op (ops that took no measurable time are not observed): d2h is the backup "
            "bandwidth, s2h the prefetch bandwidth",
            [*lab, "direction"],
            buckets=_BANDWIDTH_BUCKETS,
            registry=r,
        )
        self.storage_errors = counter(
            "hicache_storage_errors",
            "Storage calls that failed (storage.error by backend "
            "op; prefetcher.io_error as op=prefetch)",
            ["op"],
        )
        self.corrupt_values = counter(
            "hicache_storage_corrupt_values",
            "L3 values that failed verification (a miss; the value was deleted)",
            ["reason"],
        )
        self.storage_timeouts = counter(
            "hicache_storage_timeouts",
            "Storage calls past storage_timeout, by what was waiting: upload, probe, read, clear",
            ["op"],
        )
        self.skipped_uploads = counter(
            "hicache_skipped_uploads",
            "Backed-up nodes not uploaded: the upload backlog was full (max_upload_backlog)",
        )
        self.failed_uploads = counter(
            "hicache_failed_uploads",
            "Uploads still short after every retry (their pages are later misses)",
        )
        self.upload_retries = counter("hicache_upload_retries", "Upload retries")
        self.skipped_loads = counter(
            "hicache_skipped_loads",
            "Load-backs not done: no load credit (deferred) or no L1 room (capacity)",
            ["reason"],
        )
        self.failed_transfers = counter(
            "hicache_failed_transfers",
            "Backups (d2h) and loads (h2d) whose copy failed",
            ["direction"],
        )
        self.prefetches = counter(
            "hicache_prefetches",
            "Prefetches by outcome: done, revoked, or skipped:<reason>",
            ["outcome"],
        )
        self.abandoned_ops = counter(
            "hicache_abandoned_ops",
            "Ops ended as failed because close passed close_timeout",
            ["kind"],
        )
        self.actor_failures = counter("hicache_actor_failures", "Actors (or helpers) that raised")
        self.events = counter("hicache_events", "Events emitted, by name", ["event"])
        for t in TIERS:
            for m in (self.hit_tokens, self.queried_tokens, self.evicted_tokens):
                m.labels(instance, t)
        for d in DIRECTIONS:
            self.transfer_bytes.labels(instance, d)
        if cache is not None:
            self.registry.register(_ScrapeCollector(self))
        if log is not None:
            self.attach(log)

    # ------------------------------------------------------------------ events
    def attach(self, log: EventLog) -> None:
        """Listen to `log` (one log per exporter)."""
        if self._log is not None:
            self._log.remove_listener(self.on_event)
        self._log = log
        log.add_listener(self.on_event)

    def on_event(self, e: dict[str, Any]) -> None:
        name = e.get("event", "")
        i = self.instance
        self.events.labels(i, name).inc()
        handler = _HANDLERS.get(name)
        if handler is not None:
            handler(self, e, i)

    def _transfer(self, i: str, direction: str, nbytes: int, seconds: float | None) -> None:
        if nbytes:
            self.transfer_bytes.labels(i, direction).inc(nbytes)
        if seconds is None:
            return
        self.transfer_seconds.labels(i, direction).observe(seconds)
        if seconds > 0 and nbytes:
            self.bandwidth.labels(i, direction).observe(nbytes / seconds)

    # ------------------------------------------------------------------ serving
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve `/metrics` over HTTP on a daemon thread; returns the port (0: any free one)."""
        pc = _prometheus()
        server, self._thread = pc.start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        """Stop serving and stop listening. Idempotent."""
        if self._log is not None:
            self._log.remove_listener(self.on_event)
            self._log = None
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def text(self) -> str:
        """The exposition text a scrape would get now."""
        text: str = _prometheus().generate_latest(self.registry).decode()
        return text


# ---------------------------------------------------------------------- event handlers
def _on_match(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
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


def _on_load_started(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.hit_tokens.labels(i, "host").inc(e.get("tokens", 0))
    _remember(m._load_started, e.get("op"), e.get("t", 0.0))


def _on_prefetch_started(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.queried_tokens.labels(i, "storage").inc(e.get("tokens", 0))
    _remember(m._prefetch_started, e.get("op"), e.get("t", 0.0))


def _on_prefetch_done(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    read = e.get("read", 0)
    m.hit_tokens.labels(i, "storage").inc(read)
    m.prefetches.labels(i, e.get("state", "done")).inc()
    if not read:  # nothing read: no end to time (a stop while idle has no prefetcher.done)
        m._prefetch_started.pop(e.get("op"), None)


def _on_prefetcher_done(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    start = m._prefetch_started.pop(e.get("op"), None)
    nbytes = e.get("read", 0) * m.page_nbytes
    seconds = None if start is None else max(e.get("t", 0.0) - start, 0.0)
    m._transfer(i, "s2h", nbytes, seconds if nbytes else None)


def _on_prefetch_skipped(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.prefetches.labels(i, f"skipped:{e.get('reason')}").inc()


def _on_evict_device(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "device").inc(e.get("tokens", 0))


def _on_evict_host(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "host").inc(e.get("tokens", 0))


def _on_storage_evicted(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.evicted_tokens.labels(i, "storage").inc(e.get("values", 0) * m.page_size)


def _on_backup_done(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    if e.get("ok", True):
        m._transfer(i, "d2h", e.get("bytes", 0), e.get("seconds"))
    else:
        m.failed_transfers.labels(i, "d2h").inc()


def _on_load_done(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    start = m._load_started.pop(e.get("op"), None)
    if e.get("ok", True):
        seconds = e.get("seconds")
        if seconds is None and start is not None:  # tree.load_started .. loader.load_done
            seconds = max(e.get("t", 0.0) - start, 0.0)
        m._transfer(i, "h2d", e.get("bytes", 0), seconds)
    else:
        m.failed_transfers.labels(i, "h2d").inc()


def _on_uploader_stored(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m._transfer(i, "h2s", e.get("bytes", 0), e.get("seconds"))


def _on_uploader_failed(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.failed_uploads.labels(i).inc()


def _on_uploader_retry(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.upload_retries.labels(i).inc()


def _on_uploader_timeout(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, "upload").inc()


def _on_prefetcher_timeout(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, e.get("step", "read")).inc()


def _on_storage_timeout(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.storage_timeouts.labels(i, e.get("call", "clear")).inc()


def _on_storage_error(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.storage_errors.labels(i, str(e.get("op", "unknown"))).inc()


def _on_io_error(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.storage_errors.labels(i, "prefetch").inc()


def _on_corrupt(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.corrupt_values.labels(i, str(e.get("reason", "unknown"))).inc()


def _on_upload_skipped(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.skipped_uploads.labels(i).inc()


def _on_load_deferred(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.skipped_loads.labels(i, "deferred").inc()


def _on_load_skipped(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.skipped_loads.labels(i, str(e.get("reason", "capacity"))).inc()


def _on_load_failed(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    pass  # counted by loader.load_done ok=false (an abandoned load has neither)


def _on_abandoned(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    for kind in ("writes", "loads", "uploads", "prefetches"):
        if e.get(kind):
            m.abandoned_ops.labels(i, kind).inc(e[kind])


def _on_actor_failed(m: CacheMetrics, e: dict[str, Any], i: str) -> None:
    m.actor_failures.labels(i).inc()


_HANDLERS: dict[str, Callable[[CacheMetrics, dict[str, Any], str], None]] = {
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
    "tree.load_deferred": _on_load_deferred,
    "tree.load_skipped": _on_load_skipped,
    "tree.load_failed": _on_load_failed,
    "tree.abandoned": _on_abandoned,
    "kernel.actor_failed": _on_actor_failed,
}


# ---------------------------------------------------------------------- scrape-time gauges
class _ScrapeCollector:
    """Gauges read when Prometheus scrapes: tier use from the allocator's ledgers, ops in
    flight from the tree's tables, mailbox depth and counters from every actor's inbox. Read
    from the server's thread without stopping the loop: each value is one the cache had (ints
    read whole), the set of them need not be one instant."""

    def __init__(self, metrics: CacheMetrics) -> None:
        self._m = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self._m
        i = m.instance
        cache = m._cache
        kernel = getattr(cache, "_kernel", None)
        if kernel is None:
            return
        actors = kernel.actors
        used = GaugeMetricFamily(
            "hicache_used_tokens",
            "Token slots held in a tier (by the tree, running requests and transfers in flight)",
            labels=["cache", "tier"],
        )
        total = GaugeMetricFamily(
            "hicache_capacity_tokens", "Token slots in a tier", labels=["cache", "tier"]
        )
        tree = actors.get("tree")
        ledgers = tree.ledgers() if tree is not None else {}  # the tree's leased ledgers
        for tier, ledger in ledgers.items():
            used.add_metric([i, tier], ledger["used"])
            total.add_metric([i, tier], ledger["size"])
        yield used
        yield total
        inflight = GaugeMetricFamily(
            "hicache_inflight_ops",
            "Ops in flight or queued in the "
            "tree, by kind (writes, loads, uploads, prefetches, the "
            "backlogs waiting for a credit, open requests)",
            labels=["cache", "kind"],
        )
        tree = actors.get("tree")
        if tree is not None:
            try:
                book = tree.bookkeeping()
            except RuntimeError:  # a table changed size while read: skip this scrape's
                book = {}
            for kind in (
                "writes",
                "loads",
                "uploads",
                "prefetches",
                "write_backlog",
                "upload_backlog",
                "requests",
            ):
                if kind in book:
                    inflight.add_metric([i, kind], book[kind])
        yield inflight
        depth = GaugeMetricFamily(
            "hicache_mailbox_depth_messages",
            "Messages buffered in an actor's inbox",
            labels=["cache", "actor"],
        )
        high = GaugeMetricFamily(
            "hicache_mailbox_high_water_messages",
            "The most messages an actor's inbox ever held",
            labels=["cache", "actor"],
        )
        waiting = GaugeMetricFamily(
            "hicache_mailbox_waiting_senders",
            "Senders blocked on a full inbox now",
            labels=["cache", "actor"],
        )
        blocked = CounterMetricFamily(
            "hicache_mailbox_blocked_sends",
            "Sends that had to wait for room (backpressure)",
            labels=["cache", "actor"],
        )
        delivered = CounterMetricFamily(
            "hicache_mailbox_delivered_messages",
            "Messages delivered to an actor's inbox",
            labels=["cache", "actor"],
        )
        for name, actor in actors.items():
            s = actor.inbox.statistics()
            depth.add_metric([i, name], s.used)
            high.add_metric([i, name], s.high_water)
            waiting.add_metric([i, name], s.waiting_senders)
            blocked.add_metric([i, name], s.blocked_sends)
            delivered.add_metric([i, name], s.delivered)
        yield from (depth, high, waiting, blocked, delivered)


def serve_cache_metrics(cache: Any, port: int, addr: str = "0.0.0.0") -> CacheMetrics:
    """The exporter `HiCache` starts for `metrics_port`: listens to the cache's kernel log,
    reads its gauges, serves `/metrics`."""
    cfg = cache.config
    metrics = CacheMetrics(
        log=cache.kernel.log, cache=cache, instance=f"{cfg.model_id}/rank{cfg.tp_rank}"
    )
    try:
        metrics.serve(port, addr=addr)
    except BaseException:
        metrics.close()
        raise
    return metrics
