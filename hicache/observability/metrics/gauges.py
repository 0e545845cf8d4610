"""The gauges no event carries, read from a live cache when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hicache.observability.metrics.instruments import MetricSet


class ScrapeCollector:
    """Gauges read when Prometheus scrapes: tier use from the tree's ledgers, ops in
    flight from the tree's tables, mailbox depth and counters from every actor's inbox. Read
    from the server's thread without stopping the loop: each value is one the cache had (ints
    read whole), the set of them need not be one instant."""

    def __init__(self, metrics: MetricSet, cache: Any) -> None:
        self._m = metrics
        self._cache = cache

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        i = self._m.instance
        cache = self._cache
        system = getattr(cache, "_system", None)
        if system is None:
            return
        actors = system.actors
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
