"""Hybrid models (sliding-window and recurrent layers beside full attention): the layer
groups an engine declares, the rule for how much of a prefix they may reuse, and a cache
wrapper that keeps recurrent snapshots in every tier (docs/hybrid.md)."""

from hicache.hybrid.cache import HybridCache, HybridHit, HybridPrefetch
from hicache.hybrid.groups import (
    FullAttention,
    HybridModel,
    LayerGroup,
    NoCache,
    Recurrent,
    SlidingWindow,
)
from hicache.hybrid.states import state_config

__all__ = [
    "FullAttention",
    "HybridCache",
    "HybridHit",
    "HybridModel",
    "HybridPrefetch",
    "LayerGroup",
    "NoCache",
    "Recurrent",
    "SlidingWindow",
    "state_config",
]
