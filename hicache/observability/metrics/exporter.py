"""`CacheMetrics`: the metrics fed from an event log, and served to Prometheus over HTTP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.observability.events import EventLog
from hicache.observability.metrics.gauges import ScrapeCollector
from hicache.observability.metrics.handlers import HANDLERS
from hicache.observability.metrics.instruments import MetricSet, prometheus

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer


class CacheMetrics(MetricSet):
    """The metrics of one cache instance, in a registry of their own.

    `log`: the event log to listen to (the cache's `system.log`). `cache`: the `HiCache` whose
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
        if cache is not None:
            page_size = page_size or cache.config.page_size
            host_pool = getattr(cache, "host_pool", None)
            if page_nbytes is None and host_pool is not None:
                page_nbytes = host_pool.page_nbytes
        super().__init__(instance=instance, page_size=page_size or 0, page_nbytes=page_nbytes or 0)
        self._cache = cache
        self._log: EventLog | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        if cache is not None:
            self.registry.register(ScrapeCollector(self, cache))
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
        handler = HANDLERS.get(name)
        if handler is not None:
            handler(self, e, i)

    # ------------------------------------------------------------------ serving
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve `/metrics` over HTTP on a daemon thread; returns the port (0: any free one)."""
        pc = prometheus()
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
        text: str = prometheus().generate_latest(self.registry).decode()
        return text


def serve_cache_metrics(cache: Any, port: int, addr: str = "0.0.0.0") -> CacheMetrics:
    """The exporter `HiCache` starts for `metrics_port`: listens to the cache's event log,
    reads its gauges, serves `/metrics`."""
    cfg = cache.config
    metrics = CacheMetrics(
        log=cache.system.log, cache=cache, instance=f"{cfg.model_id}/rank{cfg.tp_rank}"
    )
    try:
        metrics.serve(port, addr=addr)
    except BaseException:
        metrics.close()
        raise
    return metrics
