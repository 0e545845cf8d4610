"""Prometheus metrics of one cache (optional extra: `pip install 'hicache[metrics]'`).

One source of truth: counters and histograms are fed by the cache's own event log (an
`EventLog` listener, so a metric moves exactly when its event is emitted), and gauges that no
event carries (tokens used per tier, ops in flight, mailbox depth) are read from the cache's
ledgers, tree tables and mailboxes when Prometheus scrapes. docs/metrics.md lists every
metric, its labels and units.

    async with HiCache(CacheConfig(..., metrics_port=9400)) as cache: ...   # serves /metrics

or, for a log of your own, `CacheMetrics(log=log).serve(port)`.

The definitions are in `instruments.py`, what each event does to them in `handlers.py`, the
scrape-time gauges in `gauges.py`, and `CacheMetrics` (listening, serving) in `exporter.py`.
"""

from hicache.observability.metrics.exporter import CacheMetrics, serve_cache_metrics
from hicache.observability.metrics.instruments import DIRECTIONS, TIERS

__all__ = ["DIRECTIONS", "TIERS", "CacheMetrics", "serve_cache_metrics"]
