"""A hybrid model's layer groups and the one rule that decides how much of a prefix it may
reuse (pure: no cache, no I/O).

A hit of length h reuses positions [0, h) and recomputes the rest, so h is valid only when
every group can resume there at once:
- full attention needs K/V of every position in [0, h);
- a sliding window W (a query at q sees keys in (q - W, q]) needs K/V of [h - W + 1, h) only,
  computed over the whole prefix (lower layers see all of it), so its pages are keyed by the
  full prefix like any other; or, declared with a `grid`, only that window is kept, as a
  snapshot at each point like a recurrent state (no page outside a window is ever kept);
- a recurrent layer (Mamba2, gated delta-net) needs its state exactly after token h - 1: a
  hit may end only where a snapshot of that state was kept. A state from any other position
  gives wrong output, so with recurrent groups and no snapshot the hit is 0 (fail closed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hicache.config import ConfigError

__all__ = [
    "FullAttention",
    "HybridModel",
    "LayerGroup",
    "NoCache",
    "Recurrent",
    "SlidingWindow",
    "Stateful",
]


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Layers that attend to every earlier position."""

    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Layers whose query at q sees keys in (q - window, q]. Without `grid`, their K/V is
    kept as pages in the pool, every position, like full attention's. With `grid` (and
    `state_bytes`: the K/V of the last window - 1 tokens of every layer of the group, as the
    engine packs it), only that window is kept, in the snapshot taken at each point with the
    recurrent states: the layers leave the pool, and a hit ends where a snapshot was kept."""

    layers: tuple[int, ...]
    window: int
    state_bytes: int = 0
    grid: int | None = None

    @property
    def windowed(self) -> bool:
        return self.grid is not None


@dataclass(frozen=True, slots=True)
class Recurrent:
    """Layers that carry a state from token to token (conv and SSM/recurrent state).
    `state_bytes`: one snapshot of every layer of the group. `grid`: tokens between
    snapshots a prefill keeps (a multiple of the page size, and of the kernel's chunk where it
    has one); a request's end, cut to a page, is kept too."""

    layers: tuple[int, ...]
    state_bytes: int
    grid: int


@dataclass(frozen=True, slots=True)
class NoCache:
    """Layers that keep nothing between tokens (Nemotron-H's MLP and MoE layers): declared
    so that every model layer is named once, and a layer left out by mistake is still caught."""

    layers: tuple[int, ...]


_PART = {"FullAttention": "kv", "SlidingWindow": "kv", "Recurrent": "state", "NoCache": "none"}
LayerGroup = FullAttention | SlidingWindow | Recurrent | NoCache
Stateful = Recurrent | SlidingWindow  # a group kept as snapshots (a sliding one with a grid)


@dataclass(frozen=True, slots=True)
class HybridModel:
    """The layer groups of one model, as the engine declares them, by the model's own layer
    numbers. A model layer has at most one K/V part (in one FullAttention or SlidingWindow
    group) and at most one state (in one Recurrent group): a layer with both (Falcon-H1's,
    Zamba2's hybrid layers) is named in one group of each; a layer with neither is named in
    NoCache. Attention layers kept as pages (full, and sliding without a grid) hold K/V in the
    cache's pool, pool layer i being `pool_layers[i]`; recurrent states and windowed sliding
    layers' windows are kept per snapshot point, one snapshot holding every such group's part
    in group order (hybrid/states.py). A model may have no layer kept as pages (a pure
    state-space model, or every attention layer windowed): its pool has 0 layers, its pages
    are tokens alone, and everything it resumes from is in its snapshots."""

    groups: tuple[LayerGroup, ...]
    page_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("a hybrid model needs at least one layer group")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {self.page_size}")
        parts: dict[int, dict[str, str]] = {}  # layer -> its part ("kv", "state", "none") -> group
        for group in self.groups:
            name = type(group).__name__
            if not group.layers:
                raise ConfigError(f"{name} group has no layers")
            for layer in group.layers:
                if layer < 0:
                    raise ConfigError(f"{name} names layer {layer}: layers count from 0")
                self._claim(parts.setdefault(layer, {}), layer, name)
            if isinstance(group, SlidingWindow) and group.window < 1:
                raise ConfigError(f"SlidingWindow window must be >= 1, got {group.window}")
            if isinstance(group, SlidingWindow) and group.grid is None and group.state_bytes:
                raise ConfigError("SlidingWindow state_bytes needs a grid (windows kept per point)")
            if isinstance(group, Recurrent) or (
                isinstance(group, SlidingWindow) and group.grid is not None
            ):
                self._check_stateful(name, group)
        seen = set(parts)
        if seen != set(range(len(seen))):
            missing = sorted(set(range(max(seen) + 1)) - seen)
            raise ConfigError(
                f"layers {missing} are in no group (a layer that keeps no cache is named in "
                "NoCache)"
            )
        if not self.pool_layers and not self.stateful:
            raise ConfigError(
                "the model keeps nothing: no attention layer kept as pages (full, or sliding "
                "without a grid), no recurrent or windowed sliding group"
            )

    @staticmethod
    def _claim(held: dict[str, str], layer: int, name: str) -> None:
        """Give `layer` the part a group of type `name` declares, refusing a second of it."""
        part = _PART[name]
        if part == "none" and part in held:
            raise ConfigError(f"layer {layer} is in two NoCache groups")
        if part in held:
            what = {"kv": "K/V", "state": "state"}[part]
            raise ConfigError(
                f"layer {layer} is in two groups that both hold its {what} ({held[part]} and "
                f"{name}): a model layer has at most one K/V part and one state"
            )
        if "none" in held or (part == "none" and held):
            other = next(iter(held.values()))
            raise ConfigError(
                f"layer {layer} is in NoCache and in {other if part == 'none' else name}: a "
                "layer that keeps a cache is not NoCache"
            )
        held[part] = name

    def _check_stateful(self, name: str, group: Stateful) -> None:
        if group.state_bytes <= 0:
            raise ConfigError(f"{name} state_bytes must be > 0, got {group.state_bytes}")
        if group.grid is None or group.grid <= 0 or group.grid % self.page_size:
            raise ConfigError(
                f"{name} grid {group.grid} must be a positive multiple of the page "
                f"size {self.page_size}"
            )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Every full and sliding layer, in order (the pool's layers unless a sliding group
        is windowed: see `pool_layers`)."""
        return tuple(
            sorted(
                layer
                for group in self.groups
                if isinstance(group, FullAttention | SlidingWindow)
                for layer in group.layers
            )
        )

    @property
    def pool_layers(self) -> tuple[int, ...]:
        """Model layers whose K/V the pool keeps as pages, in order: pool layer i holds
        `pool_layers[i]` (full attention, and sliding layers without a grid). Empty for a
        model with none: its pool has 0 layers (pages of tokens alone)."""
        return tuple(
            sorted(
                layer
                for group in self.groups
                if isinstance(group, FullAttention)
                or (isinstance(group, SlidingWindow) and not group.windowed)
                for layer in group.layers
            )
        )

    @property
    def recurrent(self) -> tuple[Recurrent, ...]:
        return tuple(g for g in self.groups if isinstance(g, Recurrent))

    @property
    def stateful(self) -> tuple[Stateful, ...]:
        """The groups a hit needs a snapshot for, in group order: recurrent groups and
        windowed sliding groups. Without any, every whole page of K/V is a place to resume."""
        return tuple(
            g
            for g in self.groups
            if isinstance(g, Recurrent) or (isinstance(g, SlidingWindow) and g.windowed)
        )

    @property
    def state_bytes(self) -> int:
        """Bytes of one snapshot: every stateful group's part, in group order."""
        return sum(g.state_bytes for g in self.stateful)

    @property
    def grid(self) -> int | None:
        """Tokens between snapshots: the least common multiple of the stateful groups' grids
        (a point every group keeps); None without stateful groups."""
        grids = [g.grid for g in self.stateful if g.grid is not None]
        if not grids:
            return None
        return math.lcm(*grids)

    def cap(self, n_tokens: int, kv_len: int) -> int:
        """The longest hit the K/V allows: whole pages, at most `kv_len` cached tokens and at
        most n_tokens - 1 (the last token is always computed, for its logits)."""
        most = min(kv_len, max(n_tokens - 1, 0))
        return most - most % self.page_size

    def usable(self, n_tokens: int, kv_len: int, snapshots: Iterable[int] = ()) -> int:
        """The hit length every group can resume from: `cap` without stateful groups (every
        page is kept whole, so a window is covered whenever full attention is), else the
        deepest snapshot point within it (0 when there is none)."""
        most = self.cap(n_tokens, kv_len)
        if not self.stateful:
            return most
        return max((p for p in snapshots if 0 < p <= most and p % self.page_size == 0), default=0)

    def snapshot_points(self, n_tokens: int) -> list[int]:
        """Where a prefill of `n_tokens` keeps a snapshot: every grid point and the last page
        boundary at or below the end, ascending (empty without stateful groups)."""
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
