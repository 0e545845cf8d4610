"""hicache: a hierarchical KV cache (device, host, storage) for LLM serving engines.

Public names only; see docs/api.md.
"""

from hicache.cache import HiCache, LedgerImbalance
from hicache.config import CacheConfig, ConfigError
from hicache.results import (
    CacheError, CacheOutcome, CacheStats, CapacityError, LoadBackOutcome, MatchOutcome,
    PrefetchOutcome, TierStats, UnknownRequest,
)

__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "CacheError", "CacheOutcome", "CacheStats", "CapacityError", "ConfigError",
    "HiCache", "LedgerImbalance", "LoadBackOutcome", "MatchOutcome", "PrefetchOutcome",
    "TierStats", "UnknownRequest",
]
