"""Row-pair planning (rows.plan_pairs) against brute force: the same pairs, sorted by the key
side, whichever loop order (page-major, view-major, full sort) the planner picks."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.kernels.rows import RowGrid, plan_pairs


def grid(rng: np.random.Generator, views: int, inner: int, page_rows: int, spread: str) -> RowGrid:
    """A grid of distinct rows (as real views have) whose views are packed inside each page
    ("pages": page-major sorts), far apart ("views", like layer-first or per-layer device
    buffers: view-major sorts) or with each page's rows in two bands a page and a half apart
    ("mixed": neither sorts, the planner falls back to a full sort). Up to 4 views of 8 rows."""
    order = rng.permutation(views).astype(np.int64)
    if spread == "pages":
        return RowGrid(
            np.empty((1, 1)),
            page_rows,
            order * (page_rows // 4),
            rng.choice(page_rows // 4, inner, replace=False).astype(np.int64),
        )
    if spread == "views":
        return RowGrid(
            np.empty((1, 1)),
            page_rows,
            order * page_rows * 64,
            rng.choice(page_rows, inner, replace=False).astype(np.int64),
        )
    bands = np.concatenate([np.arange(8), 96 + np.arange(8)])  # rows [0,32) and [96,128) of page 0
    return RowGrid(
        np.empty((1, 1)),
        page_rows,
        order * 8,
        rng.choice(bands, inner, replace=False).astype(np.int64),
    )


def brute(dst: RowGrid, dst_pages, src: RowGrid, src_pages, by_dst: bool):
    pairs = [
        (
            int(dst.offsets[v] + dp * dst.page_rows + dst.inner[i]),
            int(src.offsets[v] + sp * src.page_rows + src.inner[i]),
        )
        for v in range(dst.offsets.size)
        for dp, sp in zip(dst_pages, src_pages)
        for i in range(dst.inner.size)
    ]
    pairs.sort(key=lambda p: p[0] if by_dst else p[1])
    return pairs


@pytest.mark.parametrize("seed", range(60))
def test_planned_pairs_are_the_pairs_sorted_by_the_key_side(seed: int) -> None:
    rng = np.random.default_rng(seed)
    views, inner = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    page_rows = 64
    spreads = ["pages", "views", "mixed"]
    dst = grid(rng, views, inner, page_rows, spreads[seed % 3])
    src = grid(rng, views, inner, page_rows, spreads[(seed // 3) % 3])
    pages = int(rng.integers(0, 7))
    dst_pages = rng.choice(20, pages, replace=False).astype(np.int64)
    src_pages = rng.choice(20, pages, replace=False).astype(np.int64)
    by_dst = bool(seed % 2)
    plan = plan_pairs(dst, dst_pages, src, src_pages, by_dst=by_dst)
    got = list(zip(plan.dst_rows.tolist(), plan.src_rows.tolist()))
    assert got == brute(dst, dst_pages, src, src_pages, by_dst)
    key = plan.dst_rows if by_dst else plan.src_rows
    assert (np.diff(key) > 0).all()  # distinct rows, walked upward
