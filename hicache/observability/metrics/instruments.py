"""The metric definitions: every counter and histogram of one cache, in a registry of its own."""

from __future__ import annotations

from collections import OrderedDict
from types import ModuleType
from typing import Any

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


def prometheus() -> ModuleType:
    """`prometheus_client`, or an ImportError naming the extra to install."""
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "hicache metrics need prometheus_client: pip install 'hicache[metrics]'"
        ) from None
    return prometheus_client


class MetricSet:
    """The counters and histograms of one cache instance, in `self.registry`, and what the
    event handlers (`handlers.py`) keep between events: the start times of open ops.

    `instance`: the value of the `cache` label every metric carries. `page_size` /
    `page_nbytes`: for metrics the events give in pages (0: unknown).
    """

    def __init__(self, *, instance: str, page_size: int, page_nbytes: int) -> None:
        pc = prometheus()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.instance = instance
        self.page_size = page_size
        self.page_nbytes = page_nbytes
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
        self.storage_dropped_pages = counter(
            "hicache_storage_dropped_pages",
            "Pages meant for L3 that did not get there, by reason (store_full, failed, "
            "timed_out, backlog_full, evicted, detached, l2_held_by_uploads)",
            ["reason"],
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

    def _transfer(self, i: str, direction: str, nbytes: int, seconds: float | None) -> None:
        if nbytes:
            self.transfer_bytes.labels(i, direction).inc(nbytes)
        if seconds is None:
            return
        self.transfer_seconds.labels(i, direction).observe(seconds)
        if seconds > 0 and nbytes:
            self.bandwidth.labels(i, direction).observe(nbytes / seconds)
