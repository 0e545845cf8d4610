"""The copy thread (hicache/kernels/native/copier.py, rowcopy.c `hicache_copier_*`): jobs move
the same bytes as the synchronous page loop, in order, report out-of-range rows as it raises
them, and nothing is queued or held once stopped."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.kernels.native.copier import PageCopier
from hicache.kernels.native.rowcopy import PageRuns, native_rows, unavailable_reason

native = native_rows()
pytestmark = pytest.mark.skipif(
    native is None, reason=f"compiled row copier unavailable: {unavailable_reason()}"
)

PAGE_ROWS = 8


def interleaving_runs() -> PageRuns:
    """A page_first-like pattern: destination rows 0..7 from two source half-pages."""
    dst = np.arange(PAGE_ROWS, dtype=np.int64)
    src = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.int64)
    return PageRuns(dst, src, np.ones(PAGE_ROWS, dtype=np.int64), np.zeros(0, dtype=np.int64))


def grids(seed: int, pages: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dst = rng.integers(0, 256, (pages * PAGE_ROWS, 16), dtype=np.uint8)
    src = rng.integers(0, 256, (pages * PAGE_ROWS, 16), dtype=np.uint8)
    return dst, src


def wait(pending) -> None:
    """Until the job is done (the copier's own thread runs it; a few microseconds)."""
    while not pending.done():
        pass


@pytest.mark.parametrize("seed", range(4))
def test_jobs_move_what_the_synchronous_loop_moves_in_order(seed):
    rng = np.random.default_rng(seed)
    runs = interleaving_runs()
    dst, src = grids(seed)
    expected = dst.copy()
    copier = PageCopier(native)
    jobs = []
    try:
        for _ in range(10):  # overlapping destinations: only in-order runs give `expected`
            dst_pages = rng.permutation(64)[:20].astype(np.int64)
            src_pages = rng.permutation(64)[:20].astype(np.int64)
            native.copy_pages(
                expected, src, dst_pages, PAGE_ROWS, src_pages, PAGE_ROWS, runs, streaming=False
            )
            pending = copier.submit(
                dst, src, dst_pages, PAGE_ROWS, src_pages, PAGE_ROWS, runs, streaming=False
            )
            assert pending is not None
            jobs.append(pending)
        for pending in jobs:
            wait(pending)
            assert pending.error() is None
        assert np.array_equal(dst, expected)
        assert copier.in_flight == 0
    finally:
        copier.stop()


def test_out_of_range_rows_are_skipped_and_reported_as_the_loop_raises():
    runs = interleaving_runs()
    dst, src = grids(7)
    before = dst.copy()
    bad = np.array([3, 64], dtype=np.int64)  # page 64 is past the grid's 64 pages
    with pytest.raises(IndexError) as raised:
        native.copy_pages(
            dst.copy(), src, bad, PAGE_ROWS, np.array([1, 2]), PAGE_ROWS, runs, streaming=False
        )
    copier = PageCopier(native)
    try:
        pending = copier.submit(
            dst, src, bad, PAGE_ROWS, np.array([1, 2]), PAGE_ROWS, runs, streaming=False
        )
        assert pending is not None
        wait(pending)
        error = pending.error()
    finally:
        copier.stop()
    assert isinstance(error, IndexError) and str(error) == str(raised.value)
    assert np.array_equal(
        dst[3 * PAGE_ROWS : 4 * PAGE_ROWS], src[PAGE_ROWS : 2 * PAGE_ROWS][[0, 4, 1, 5, 2, 6, 3, 7]]
    )
    assert np.array_equal(
        np.delete(dst, np.s_[3 * PAGE_ROWS : 4 * PAGE_ROWS], 0),
        np.delete(before, np.s_[3 * PAGE_ROWS : 4 * PAGE_ROWS], 0),
    )


def test_stop_runs_what_is_queued_and_then_takes_nothing():
    runs = interleaving_runs()
    dst, src = grids(3, pages=512)
    expected = dst.copy()
    pages = np.arange(512, dtype=np.int64)
    native.copy_pages(
        expected, src, pages, PAGE_ROWS, pages[::-1].copy(), PAGE_ROWS, runs, streaming=False
    )
    copier = PageCopier(native)
    jobs = [
        copier.submit(
            dst,
            src,
            pages[i : i + 64],
            PAGE_ROWS,
            pages[::-1][i : i + 64].copy(),
            PAGE_ROWS,
            runs,
            streaming=False,
        )
        for i in range(0, 512, 64)
    ]
    copier.stop()  # returns once every queued job has run
    assert all(job is not None and job.done() for job in jobs)
    assert np.array_equal(dst, expected)
    assert copier.in_flight == 0
    assert (
        copier.submit(dst, src, pages[:1], PAGE_ROWS, pages[:1], PAGE_ROWS, runs, streaming=False)
        is None
    )
    copier.stop()  # idempotent
