"""hicache: a hierarchical KV cache (device, host, storage) for LLM serving engines.

Public names only; see docs/api.md.
"""

from hicache.backends.base import BackendUnavailable
from hicache.cache import BookkeepingLeak, HiCache, LedgerImbalance
from hicache.config import CacheConfig, ConfigError
from hicache.results import (
    CacheError,
    CacheOutcome,
    CacheStats,
    CapacityError,
    ClearOutcome,
    InvalidRequest,
    LoadBackOutcome,
    MatchOutcome,
    PinLimitError,
    PinOutcome,
    PrefetchOutcome,
    Retention,
    StorageTimeout,
    TierStats,
    UnknownRequest,
)
from hicache.runtime.errors import ActorSystemClosed, KernelClosed

__version__ = "0.1.0"

__all__ = [
    "ActorSystemClosed",
    "BackendUnavailable",
    "BookkeepingLeak",
    "CacheConfig",
    "CacheError",
    "CacheOutcome",
    "CacheStats",
    "CapacityError",
    "ClearOutcome",
    "ConfigError",
    "HiCache",
    "InvalidRequest",
    "KernelClosed",
    "LedgerImbalance",
    "LoadBackOutcome",
    "MatchOutcome",
    "PinLimitError",
    "PinOutcome",
    "PrefetchOutcome",
    "Retention",
    "StorageTimeout",
    "TierStats",
    "UnknownRequest",
]
