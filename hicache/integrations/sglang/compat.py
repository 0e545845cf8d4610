"""SGLang's storage interface types where SGLang is installed, stand-ins where not (so the
module imports, and its unit tests run, without SGLang; nothing here can run SGLang then)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

log = logging.getLogger("hicache.integrations.sglang")

if TYPE_CHECKING:
    StorageBase = object
    PoolTransferResult: Any = None
    HAVE_SGLANG = False
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as StorageBase
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        HAVE_SGLANG = True
    except ImportError:  # pragma: no cover - exercised only where SGLang is absent
        StorageBase = object
        HAVE_SGLANG = False

        @dataclass
        class PoolTransferResult:
            """SGLang's result of `batch_exists_v2` (the same fields)."""

            kv_hit_pages: int
            extra_pool_hit_pages: dict[str, int]
            restorable_prefix_pages: list[int] | None = field(default=None)


class HitPolicy(str, Enum):
    """SGLang's `PoolHitPolicy` values (compared by value: SGLang's enum is a str)."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


KV_POOL = "kv"
"""SGLang's `PoolName.KV`: the anchor pool (`register_mem_pool_host`) and v2's KV transfers."""


def storage_metrics(
    prefetch_pgs: list[int],
    backup_pgs: list[int],
    prefetch_bandwidth: list[float],
    backup_bandwidth: list[float],
) -> Any:
    """SGLang's `StorageMetrics` with these samples (what its metrics collector asserts
    `get_stats` returns), or None where SGLang's metrics module cannot be imported."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        return None
    metrics = StorageMetrics()
    metrics.prefetch_pgs.extend(prefetch_pgs)
    metrics.backup_pgs.extend(backup_pgs)
    metrics.prefetch_bandwidth.extend(prefetch_bandwidth)
    metrics.backup_bandwidth.extend(backup_bandwidth)
    return metrics
