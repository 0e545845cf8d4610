"""A hybrid model's layer groups and the one rule that decides how much of a prefix it may
reuse (pure: no cache, no I/O).

A hit of length h reuses positions [0, h) and recomputes the rest, so h is valid only when
every group can resume there at once:
- full attention needs K/V of every position in [0, h);
- a sliding window W (a query at q sees keys in (q - W, q]) needs K/V of [h - W + 1, h) only,
  computed over the whole prefix (lower layers see all of it), so its pages are keyed by the
  full prefix like any other;
- a recurrent layer (Mamba2, gated delta-net) needs its state exactly after token h - 1: a
  hit may end only where a snapshot of that state was kept. A state from any other position
  gives wrong output, so with recurrent groups and no snapshot the hit is 0 (fail closed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hicache.config import ConfigError

__all__ = ["FullAttention", "HybridModel", "LayerGroup", "Recurrent", "SlidingWindow"]


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Layers that attend to every earlier position."""

    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Layers whose query at q sees keys in (q - window, q]."""

    layers: tuple[int, ...]
    window: int


@dataclass(frozen=True, slots=True)
class Recurrent:
    """Layers that carry a state from token to token (conv and SSM/recurrent state).
    `state_bytes`: one snapshot of every layer of the group. `grid`: tokens between
    snapshots a prefill keeps (a multiple of the page size, and of the kernel's chunk where it
    has one); a request's end, cut to a page, is kept too."""

    layers: tuple[int, ...]
    state_bytes: int
    grid: int


LayerGroup = FullAttention | SlidingWindow | Recurrent


@dataclass(frozen=True, slots=True)
class HybridModel:
    """The layer groups of one model, as the engine declares them. Attention layers (full and
    sliding) hold K/V in the cache's pool, pool layer i being the i-th attention layer in
    model order; recurrent states are kept per snapshot point (hybrid/states.py)."""

    groups: tuple[LayerGroup, ...]
    page_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("a hybrid model needs at least one layer group")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {self.page_size}")
        seen: set[int] = set()
        for group in self.groups:
            name = type(group).__name__
            if not group.layers:
                raise ConfigError(f"{name} group has no layers")
            for layer in group.layers:
                if layer < 0:
                    raise ConfigError(f"{name} names layer {layer}: layers count from 0")
                if layer in seen:
                    raise ConfigError(f"layer {layer} is in two groups")
                seen.add(layer)
            if isinstance(group, SlidingWindow) and group.window < 1:
                raise ConfigError(f"SlidingWindow window must be >= 1, got {group.window}")
            if isinstance(group, Recurrent):
                if group.state_bytes <= 0:
                    raise ConfigError(f"Recurrent state_bytes must be > 0, got {group.state_bytes}")
                if group.grid <= 0 or group.grid % self.page_size:
                    raise ConfigError(
                        f"Recurrent grid {group.grid} must be a positive multiple of the page "
                        f"size {self.page_size}"
                    )
        if seen != set(range(len(seen))):
            missing = sorted(set(range(max(seen) + 1)) - seen)
            raise ConfigError(f"layers {missing} are in no group")
        if not self.attention_layers:
            raise ConfigError("a hybrid model needs at least one attention layer (full or sliding)")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model layers with K/V, in order: pool layer i holds `attention_layers[i]`."""
        return tuple(
            sorted(
                layer
                for group in self.groups
                if not isinstance(group, Recurrent)
                for layer in group.layers
            )
        )

    @property
    def recurrent(self) -> tuple[Recurrent, ...]:
        return tuple(g for g in self.groups if isinstance(g, Recurrent))

    @property
    def state_bytes(self) -> int:
        """Bytes of one snapshot: every recurrent group's state, in group order."""
        return sum(g.state_bytes for g in self.recurrent)

    @property
    def grid(self) -> int | None:
        """Tokens between snapshots: the least common multiple of the groups' grids (a point
        every group keeps); None without recurrent groups."""
        grids = [g.grid for g in self.recurrent]
        if not grids:
            return None
        return math.lcm(*grids)

    def cap(self, n_tokens: int, kv_len: int) -> int:
        """The longest hit the K/V allows: whole pages, at most `kv_len` cached tokens and at
        most n_tokens - 1 (the last token is always computed, for its logits)."""
        most = min(kv_len, max(n_tokens - 1, 0))
        return most - most % self.page_size

    def usable(self, n_tokens: int, kv_len: int, snapshots: Iterable[int] = ()) -> int:
        """The hit length every group can resume from: `cap` without recurrent groups (every
        page is kept whole, so a window is covered whenever full attention is), else the
        deepest snapshot point within it (0 when there is none)."""
        most = self.cap(n_tokens, kv_len)
        if not self.recurrent:
            return most
        return max((p for p in snapshots if 0 < p <= most and p % self.page_size == 0), default=0)

    def snapshot_points(self, n_tokens: int) -> list[int]:
        """Where a prefill of `n_tokens` keeps the recurrent state: every grid point and the
        last page boundary at or below the end, ascending (empty without recurrent groups)."""
        grid = self.grid
        if grid is None:
            return []
        points = set(range(grid, n_tokens + 1, grid))
        end = n_tokens - n_tokens % self.page_size
        if end > 0:
            points.add(end)
        return sorted(points)

    def candidates(self, n_tokens: int, kv_len: int, most: int) -> list[int]:
        """Where to look for a snapshot, deepest first, at most `most` of them: the hit's
        upper end (a request that ended there left one) and the grid points below it."""
        top = self.cap(n_tokens, kv_len)
        grid = self.grid
        if grid is None or top <= 0:
            return []
        points = {top, *range(grid, top + 1, grid)}
        return sorted(points, reverse=True)[:most]
