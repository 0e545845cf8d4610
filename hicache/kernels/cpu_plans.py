"""What a CPU engine plans once and reuses: row grids over sets of views, row plans per pair of
page lists, and the compiled page loop's setup (one page's row pattern) per pair of grids.
Owned by one engine, so used by one thread at a time."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hicache.kernels.native.rowcopy import PageRuns
from hicache.kernels.rows import (
    RowGrid,
    RowPlan,
    common_row,
    page_rows_of,
    plan_pairs,
    plan_rows,
    require_host_memory,
    row_space,
    split_rows,
)

_CACHED_ROWS = 1 << 22
"""Row pairs kept per engine (about 64 MiB): a transfer's plan serves each of its layers."""

_CACHED_SPACES = 1024
"""Row grids an engine keeps (a few per layer and component of each pool pair it serves)."""

_PREFETCH_LINES = 64
"""Source cache lines of a page the page loop touches ahead (the first 4 KiB it reads)."""

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
PageSetup = tuple[RowGrid, RowGrid, PageRuns]
"""The page loop's arguments for one transfer's views: both sides' grids and the row pattern."""


def pair_row(pairs: Pairs) -> int:
    """The longest row that puts every destination view on one grid and every source on one."""
    return math.gcd(common_row([d for d, _ in pairs]), common_row([s for _, s in pairs]))


class CpuPlans:
    """The caches of one `CpuEngine`; `pairs_plans` picks `plan_pairs` (the compiled copier's
    one pair list) over `plan_rows` (numpy's ordered batches)."""

    def __init__(self, *, pairs_plans: bool) -> None:
        self._pairs_plans = pairs_plans
        self._shapes: dict[tuple[Any, ...], tuple[int, np.ndarray] | None] = {}
        self._spaces: dict[tuple[Any, ...], tuple[RowGrid, tuple[Any, ...]] | None] = {}
        self._plans: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, RowPlan]] = {}
        self._cached_rows = 0
        self._runs: dict[tuple[Any, ...], PageRuns] = {}
        self._page_setups: dict[int, tuple[Any, PageSetup | None]] = {}

    def space(self, views: list[torch.Tensor]) -> tuple[RowGrid, tuple[Any, ...]] | None:
        # Per-layer loads ask for the same few view sets over and over; building the row grid
        # (a numpy array over the views' memory) was half of a small move's fixed cost. A grid
        # is named by the views' addresses, shape, strides and dtype, which fix the memory it
        # spans, so a hit is right even if the pool behind it was replaced by an identical one.
        first = views[0]
        key = (tuple(first.shape), first.stride())
        space_key = (key, first.dtype, tuple(v.data_ptr() for v in views))
        if space_key in self._spaces:
            return self._spaces[space_key]
        require_host_memory(views, "the CPU copy engine")  # before any raw address is taken
        if key not in self._shapes:
            self._shapes[key] = page_rows_of(first)
        space = row_space(views, self._shapes[key])
        if len(self._spaces) >= _CACHED_SPACES:
            self._spaces.clear()
        self._spaces[space_key] = space
        return space

    def plan(
        self,
        dst: RowGrid,
        dst_key: tuple[Any, ...],
        dst_pages: torch.Tensor,
        src: RowGrid,
        src_key: tuple[Any, ...],
        src_pages: torch.Tensor,
        host_is_dst: bool,
    ) -> RowPlan:
        """The row plan of `dst[dst_pages] = src[src_pages]`, kept while the same page tensors
        come back (checked by identity) and within `_CACHED_ROWS` row pairs."""
        key = (id(dst_pages), id(src_pages), dst_key, src_key, host_is_dst)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is dst_pages and hit[1] is src_pages:
            return hit[2]
        if self._pairs_plans:
            plan = plan_pairs(dst, dst_pages.numpy(), src, src_pages.numpy(), by_dst=False)
        else:
            plan = plan_rows(
                dst, dst_pages.numpy(), src, src_pages.numpy(), prefer_dst_order=host_is_dst
            )
        while self._plans and self._cached_rows + plan.pairs > _CACHED_ROWS:
            self._cached_rows -= self._plans.pop(next(iter(self._plans)))[2].pairs
        if plan.pairs <= _CACHED_ROWS:
            self._plans[key] = (dst_pages, src_pages, plan)
            self._cached_rows += plan.pairs
        return plan

    def page_setup(self, pairs: Pairs, row: int) -> PageSetup | None:
        """What the compiled copier's page loop needs for these views: every view of the
        transfer on one row grid per side, and one page's row pattern (runs of rows consecutive
        on both sides, cached per pair of grids) applied to each page pair. Planning is then
        O(pages), not O(rows): a backup of short strided rows (page_first with small heads:
        16 B rows) built a pair table per row that cost more than the copy. None when the views
        are not on grids."""
        split = [(split_rows(d, row), split_rows(s, row)) for d, s in pairs]
        dst_space = self.space([d for d, _ in split])
        src_space = self.space([s for _, s in split])
        if dst_space is None or src_space is None:
            return None
        (dst_grid, dst_key), (src_grid, src_key) = dst_space, src_space
        if dst_grid.inner.size != src_grid.inner.size:
            return None
        runs = self._runs.get((dst_key, src_key))
        if runs is None:
            runs = page_runs(dst_grid, src_grid)
            if len(self._runs) >= _CACHED_SPACES:
                self._runs.clear()
            self._runs[(dst_key, src_key)] = runs
        return dst_grid, src_grid, runs

    def page_setup_of(self, pairs: Pairs) -> PageSetup | None:
        """`page_setup` kept per `pairs` list (transfer.py hands the same list for every
        transfer between the same pools), checked by identity."""
        hit = self._page_setups.get(id(pairs))
        if hit is not None and hit[0] is pairs:
            return hit[1]
        setup = self.page_setup(pairs, pair_row(pairs))
        if len(self._page_setups) >= _CACHED_SPACES:
            self._page_setups.clear()
        self._page_setups[id(pairs)] = (pairs, setup)
        return setup


def page_runs(dst: RowGrid, src: RowGrid) -> PageRuns:
    """One page's row pattern between two grids with the same views and inner rows: pair j
    (view v, inner row i) goes from `src.offsets[v] + src.inner[i]` to the same on `dst`, in
    destination order, merged into runs where both sides advance by one row. Pure."""
    d = (dst.offsets[:, None] + dst.inner[None, :]).ravel()
    s = (src.offsets[:, None] + src.inner[None, :]).ravel()
    order = np.argsort(d, kind="stable")
    d, s = d[order], s[order]
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [d.size]))).astype(np.int64)
    row_bytes = src.array.shape[1] * src.array.itemsize
    lines: list[int] = []
    seen: set[int] = set()
    for first, count in zip((s[starts] * row_bytes).tolist(), (lengths * row_bytes).tolist()):
        if len(lines) >= _PREFETCH_LINES:
            break
        for offset in range(first - first % 64, first + count, 64):
            if offset not in seen and len(lines) < _PREFETCH_LINES:
                seen.add(offset)
                lines.append(offset)
    return PageRuns(d[starts], s[starts], lengths, np.array(lines, dtype=np.int64))
