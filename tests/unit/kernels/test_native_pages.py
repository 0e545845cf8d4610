"""The compiled copier's page loop and slot checks (rowcopy.c: `hicache_copy_pages`,
`hicache_slot_pages`) against plain numpy."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.kernels.indices import check_pages
from hicache.kernels.native.addresses import data_address
from hicache.kernels.native.rowcopy import PageRuns, native_rows, unavailable_reason

needs_native = pytest.mark.skipif(
    native_rows() is None, reason=f"compiled row copier unavailable: {unavailable_reason()}"
)


def _runs(dst_within: np.ndarray, src_within: np.ndarray) -> PageRuns:
    """Runs as the engine builds them: destination order, merged where both sides advance."""
    order = np.argsort(dst_within, kind="stable")
    d, s = dst_within[order], src_within[order]
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [d.size]))).astype(np.int64)
    return PageRuns(d[starts], s[starts], lengths, np.array([0, 64], dtype=np.int64))


@needs_native
@pytest.mark.parametrize("seed", range(16))
def test_page_loop_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    row_bytes = int(rng.choice([1, 8, 16, 24, 32, 64, 100]))
    dst_page_rows, src_page_rows = int(rng.integers(2, 40)), int(rng.integers(2, 40))
    per_page = int(rng.integers(1, min(dst_page_rows, src_page_rows) + 1))
    dst_within = rng.permutation(dst_page_rows)[:per_page].astype(np.int64)
    src_within = rng.permutation(src_page_rows)[:per_page].astype(np.int64)
    if seed % 3 == 0:  # long runs on both sides (layer_first-like)
        dst_within = np.arange(per_page, dtype=np.int64)
        src_within = np.arange(per_page, dtype=np.int64) + (src_page_rows - per_page)
    dst_pages_total, src_pages_total = int(rng.integers(4, 30)), int(rng.integers(4, 30))
    n = int(rng.integers(1, min(dst_pages_total, src_pages_total) + 1))
    dst_pages = rng.permutation(dst_pages_total)[:n].astype(np.int64)
    src_pages = rng.permutation(src_pages_total)[:n].astype(np.int64)
    dst = rng.integers(0, 256, (dst_pages_total * dst_page_rows, row_bytes), dtype=np.uint8)
    src = rng.integers(0, 256, (src_pages_total * src_page_rows, row_bytes), dtype=np.uint8)
    expected = dst.copy()
    d_rows = (dst_pages[:, None] * dst_page_rows + dst_within[None, :]).ravel()
    s_rows = (src_pages[:, None] * src_page_rows + src_within[None, :]).ravel()
    expected[d_rows] = src[s_rows]
    native_rows().copy_pages(
        dst,
        src,
        dst_pages,
        dst_page_rows,
        src_pages,
        src_page_rows,
        _runs(dst_within, src_within),
        streaming=bool(seed % 2),
    )
    assert np.array_equal(dst, expected)


@needs_native
def test_a_page_out_of_range_is_skipped_whole_and_reported():
    dst = np.zeros((8, 16), dtype=np.uint8)  # 4 pages of 2 rows
    src = np.arange(1, 6 * 16 + 1, dtype=np.uint8).reshape(6, 16) % 251 + 1
    runs = _runs(np.array([0, 1], dtype=np.int64), np.array([1, 0], dtype=np.int64))
    with pytest.raises(IndexError, match="2 of 6 row pairs out of range"):
        native_rows().copy_pages(
            dst,
            src,
            np.array([0, 4, 2], dtype=np.int64),  # page 4 would write rows 8-9: foreign memory
            2,
            np.array([0, 1, 2], dtype=np.int64),
            2,
            runs,
            streaming=False,
        )
    assert np.array_equal(dst[0], src[1]) and np.array_equal(dst[1], src[0])
    assert np.array_equal(dst[4], src[5]) and np.array_equal(dst[5], src[4])
    assert not dst[[2, 3, 6, 7]].any()


def _slots(pages, ps):
    return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()


@needs_native
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_slot_pages_accepts_whole_pages_only(ps):
    nat = native_rows()
    size = 16 * ps
    good = _slots([3, 0, 15, 7], ps)
    assert nat.slot_pages(good, ps, size).tolist() == [3, 0, 15, 7]
    assert nat.slot_pages(np.empty(0, dtype=np.int64), ps, size).size == 0
    bad = [
        _slots([3, 16], ps),  # past the end
        _slots([3, 3], ps),  # a page twice
        np.concatenate([good, [-1] * ps]),  # negative
    ]
    if ps > 1:
        bad += [good[1:], good + 1, np.concatenate([good[:-2], good[-1:], good[-2:-1]])]
    for slots in bad:
        assert nat.slot_pages(np.ascontiguousarray(slots, dtype=np.int64), ps, size) is None
        with pytest.raises(ValueError):
            check_pages(np.ascontiguousarray(slots, dtype=np.int64), ps, size, "slots")
    # the marks a refused call set are cleared: the same pages pass afterwards
    assert nat.slot_pages(_slots([3], ps), ps, size).tolist() == [3]
    assert nat.slot_pages(good, ps, size).tolist() == [3, 0, 15, 7]


@needs_native
def test_ledger_alloc_pops_expands_and_marks_and_addresses():
    nat = native_rows()
    stack = np.array([9, 2, 0, 5], dtype=np.int64)
    held = np.zeros(10, dtype=bool)
    slots = nat.ledger_alloc(stack, 4, 3, 4, held)  # the top three: 5, 0, 2
    assert np.array_equal(slots, _slots(np.array([5, 0, 2]), 4))
    assert np.flatnonzero(held).tolist() == [0, 2, 5]
    assert nat.ledger_free(slots, 4, 40, held, stack, 1) == 4
    assert stack.tolist() == [9, 2, 0, 5] and not held.any()
    base = np.arange(40, dtype=np.int64)
    for a in (base, base[3:], base[::2], base.reshape(4, 10)[1], np.zeros(0)):
        assert data_address(a) == a.ctypes.data


@needs_native
def test_u32_ids_converts_or_refuses():
    nat = native_rows()
    ids = np.array([0, 7, 2**32 - 1, 12345], dtype=np.int64)
    out = nat.u32_ids(ids)
    assert out is not None and out.dtype == np.uint32 and out.tolist() == ids.tolist()
    assert nat.u32_ids(np.array([1, -1, 3], dtype=np.int64)) is None
    assert nat.u32_ids(np.array([1, 2**32], dtype=np.int64)) is None
    assert nat.u32_ids(np.empty(0, dtype=np.int64)).size == 0


@needs_native
def test_u32_same_compares_ids_without_converting():
    nat = native_rows()
    ids = np.array([0, 7, 2**32 - 1, 12345], dtype=np.int64)
    assert nat.u32_same(ids, ids.astype(np.uint32))
    assert not nat.u32_same(ids, np.array([0, 7, 2**32 - 1, 12346], dtype=np.uint32))
    wrapped = np.array([2**32 + 5], dtype=np.int64)  # would equal 5 once truncated
    assert not nat.u32_same(wrapped, np.array([5], dtype=np.uint32))
    assert not nat.u32_same(np.array([-1], dtype=np.int64), np.array([2**32 - 1], dtype=np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        nat.u32_same(ids, ids)
