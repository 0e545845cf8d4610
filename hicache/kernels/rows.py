"""CPU transfers as batched row copies.

Every word view the transfers use is (pages, ..., row) with the last dim contiguous. Seen over
its memory, such a view is a C-contiguous grid of rows of `row` words: page `p` owns rows
`p * page_rows + inner` (`inner` in the view's element order). A page-to-page transfer is then
a list of (source row, destination row) pairs. The compiled copier (native/rowcopy.py) moves any
pair list in one call (`plan_pairs`). Without it numpy moves a batch of rows in one C loop (`take`:
one memcpy per row; fancy assignment: one contiguous copy per row), releasing the GIL and using one
core (torch's CPU index ops are element-wise or fork an OpenMP team per call); pairs are then
ordered so that one side is sequential whenever possible, which makes the copy a single pass, and
otherwise go through a cache-sized scratch buffer (gather, then scatter)."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.kernels.native.rowcopy import NativeRows

SCRATCH_BYTES = 1 << 20
"""Staged copies gather this many bytes at a time: small enough to stay in L2 between the
gather and the scatter, large enough that per-call overhead is noise."""


BLOCK_BYTES = 256 << 10
"""Destination blocks at least this large (on average) are filled by one `take` each; smaller
ones go through the scratch buffer (per-call overhead would dominate)."""


class UnreachableMemory(ValueError):
    """A copy engine was handed tensors in memory it cannot address (a CPU engine and a CUDA
    tensor, say): raised before any byte is touched, instead of a crash in native code."""


def require_host_memory(tensors: list[torch.Tensor], what: str) -> None:
    """Raise `UnreachableMemory` unless every tensor lives in host memory: the CPU engine reads
    and writes through raw addresses, which for device memory would crash the process."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise UnreachableMemory(
                f"{what} was handed a tensor on {tensor.device}; it copies host memory only "
                "(pools on a device move with that device's engine: engines.engine_for)"
            )


@dataclass(frozen=True, slots=True)
class RowGrid:
    """Views as rows: `array` is a C-contiguous (rows, row) numpy array over the views' memory
    (writing it writes the tensors); page `p` of view `v` is rows `offsets[v] + p * page_rows +
    inner`. With several views (one per layer and component) the array spans from the lowest
    view to the end of the highest: only the views' rows are ever touched, whatever lies between
    their allocations is not."""

    array: np.ndarray
    page_rows: int
    offsets: np.ndarray
    inner: np.ndarray
    address: int = 0  # the array's data address (0: not taken; `row_space` takes it)


def page_rows_of(view: torch.Tensor) -> tuple[int, np.ndarray] | None:
    """(page_rows, inner rows of page 0) of a (pages, ..., row) word view whose last dim is
    contiguous and whose other strides are whole rows; None otherwise. Pure."""
    if view.dim() < 2 or view.shape[0] == 0 or view.stride(-1) != 1:
        return None
    row = view.shape[-1]
    strides = view.stride()[:-1]
    if row == 0 or any(s < 0 or s % row for s in strides):
        return None
    inner = np.zeros(1, dtype=np.int64)
    for n, s in zip(view.shape[1:-1], strides[1:]):
        inner = (inner[:, None] + np.arange(n, dtype=np.int64) * (s // row)).ravel()
    return strides[0] // row, inner


def common_row(views: list[torch.Tensor]) -> int:
    """The longest row (in words) that divides the views' last dim and the distances between
    their starts: rows of that length put every view on one grid. Pure."""
    row = views[0].shape[-1]
    base = min(v.data_ptr() for v in views)
    size = views[0].element_size()
    for v in views:
        row = math.gcd(
            row, (v.data_ptr() - base) // size if (v.data_ptr() - base) % size == 0 else 1
        )
    return row


def split_rows(view: torch.Tensor, row: int) -> torch.Tensor:
    """`view` with its last dim split into rows of `row` words (a view)."""
    return view if view.shape[-1] == row else view.unflatten(-1, (view.shape[-1] // row, row))


def row_space(
    views: list[torch.Tensor], shape: tuple[int, np.ndarray] | None
) -> tuple[RowGrid, tuple[Any, ...]] | None:
    """One row grid over all `views` (same shape, strides and dtype; on the CPU), given their
    common `page_rows_of`, and a key naming its geometry up to the base address; None when
    the views' starts are not whole rows apart. Does not copy."""
    require_host_memory(views, "the CPU copy engine")
    first = views[0]
    if shape is None or any(
        v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
        for v in views
    ):
        return None
    page_rows, inner = shape
    row_bytes = first.shape[-1] * first.element_size()
    starts = np.array([v.data_ptr() for v in views], dtype=np.int64)
    base = int(starts.min())
    offsets = starts - base
    if (offsets % row_bytes).any():
        return None
    offsets //= row_bytes
    extent = int(offsets.max()) + (first.shape[0] - 1) * page_rows + int(inner.max()) + 1
    memory = (ctypes.c_char * (extent * row_bytes)).from_address(base)
    array = np.frombuffer(memoryview(memory), dtype=_numpy_dtype(first.dtype)).reshape(
        extent, first.shape[-1]
    )
    grid = RowGrid(array, page_rows, offsets, inner, base)
    return grid, (tuple(first.shape), first.stride(), tuple(offsets.tolist()))


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Row pairs of one (destination, source) page mapping, and how to copy them:
    `blocks` (destination rows are few consecutive blocks: `breaks` are the block starts in
    the pair list, then its length, `firsts` each block's first destination row;
    `dst_rows` may then be empty), `put` (the same with source blocks; `firsts` are source
    rows) or `staged` (gather into scratch, then scatter)."""

    dst_rows: np.ndarray
    src_rows: np.ndarray
    mode: str
    breaks: tuple[int, ...] = ()
    firsts: tuple[int, ...] = ()

    @property
    def pairs(self) -> int:
        return int(self.src_rows.size)


def _pairs(
    dst: RowGrid, dst_pages: np.ndarray, src: RowGrid, src_pages: np.ndarray, by_dst: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs sorted by destination (by_dst) or source row. Pair (view v, page p, inner i)
    is row `offsets[v] + pages[p] * page_rows + inner[i]` on each side. Rows are sorted by
    sorting the few pages and inner rows, page-major or view-major, whichever orders them
    (decided from those few values, not from the expanded rows); a full sort of the rows only
    when neither does."""
    key, key_pages = (dst, dst_pages) if by_dst else (src, src_pages)
    by_page = np.argsort(key_pages, kind="stable")
    views, inner = key.offsets.size, key.inner.size

    def rows(
        grid: RowGrid,
        pages: np.ndarray,
        view_order: np.ndarray,
        inner_order: np.ndarray,
        page_major: bool,
    ) -> np.ndarray:
        page_part = pages[by_page] * grid.page_rows
        within = grid.offsets[view_order, None] + grid.inner[None, inner_order]  # (V, I)
        if page_major:  # (P, V*I) with (v, i) in key order
            flat = within.ravel()[within_order]
            page_major_rows: np.ndarray = (page_part[:, None] + flat[None, :]).ravel()
            return page_major_rows
        by_view: np.ndarray = (within[:, None, :] + page_part[None, :, None]).ravel()  # (V, P, I)
        return by_view

    key_within = (key.offsets[:, None] + key.inner[None, :]).ravel()
    within_order = np.argsort(key_within, kind="stable")
    all_views, all_inner = np.arange(views), np.arange(inner)
    pages = key_pages[by_page]
    if pages.size == 0 or _page_major_sorted(key_within[within_order], pages, key.page_rows):
        return (
            rows(dst, dst_pages, all_views, all_inner, True),
            rows(src, src_pages, all_views, all_inner, True),
        )
    view_order, inner_order = (
        np.argsort(key.offsets, kind="stable"),
        np.argsort(key.inner, kind="stable"),
    )
    if _view_major_sorted(key.offsets[view_order], key.inner[inner_order], pages, key.page_rows):
        return (
            rows(dst, dst_pages, view_order, inner_order, False),
            rows(src, src_pages, view_order, inner_order, False),
        )
    d = rows(dst, dst_pages, all_views, all_inner, True)
    s = rows(src, src_pages, all_views, all_inner, True)
    order = np.argsort(d if by_dst else s, kind="stable")
    return d[order], s[order]


def _increasing(a: np.ndarray) -> bool:
    return bool((np.diff(a) > 0).all())


def _page_major_sorted(within: np.ndarray, pages: np.ndarray, page_rows: int) -> bool:
    """Whether rows `pages[p] * page_rows + within[j]`, p-major, rise strictly: each page's
    rows (sorted `within`) fit in less than one page's span. `pages` sorted. Pure."""
    return _increasing(within) and _increasing(pages) and int(within[-1] - within[0]) < page_rows


def _view_major_sorted(
    offsets: np.ndarray, inner: np.ndarray, pages: np.ndarray, page_rows: int
) -> bool:
    """Whether rows `offsets[v] + pages[p] * page_rows + inner[i]`, v-major then p, rise
    strictly: each page's inner rows fit in one page's span, and each view's rows end before
    the next view's begin. All three sorted. Pure."""
    if not (_increasing(inner) and _increasing(pages) and int(inner[-1] - inner[0]) < page_rows):
        return False
    first = offsets + int(pages[0]) * page_rows + int(inner[0])
    last = offsets + int(pages[-1]) * page_rows + int(inner[-1])
    return bool((last[:-1] < first[1:]).all())


def _page_blocks(
    dst: RowGrid, dst_pages: np.ndarray, src: RowGrid, src_pages: np.ndarray, block_bytes: int
) -> RowPlan | None:
    """The `blocks` plan when every destination page is one span of `page_rows` consecutive
    rows (a page-contiguous host layout, all its views): blocks are runs of consecutive pages,
    found per page instead of per row. None when the destination is not like that or its
    blocks would be small. Pure."""
    within = (dst.offsets[:, None] + dst.inner[None, :]).ravel()
    if within.size != dst.page_rows:
        return None
    order_within = np.argsort(within, kind="stable")
    first_within = int(within[order_within[0]])
    if int(within[order_within[-1]]) - first_within != within.size - 1:
        return None
    order = np.argsort(dst_pages, kind="stable")
    pages = dst_pages[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(pages) != 1) + 1))
    row_bytes = dst.array.shape[1] * dst.array.itemsize
    if pages.size * within.size * row_bytes < starts.size * block_bytes:
        return None
    src_within = (src.offsets[:, None] + src.inner[None, :]).ravel()[order_within]
    s = (src_pages[order][:, None] * src.page_rows + src_within[None, :]).ravel()
    first = pages[starts] * dst.page_rows + first_within
    return RowPlan(
        np.empty(0, dtype=np.int64),
        s,
        "blocks",
        tuple((starts * within.size).tolist()) + (s.size,),
        tuple(first.tolist()),
    )


def plan_pairs(
    dst: RowGrid, dst_pages: np.ndarray, src: RowGrid, src_pages: np.ndarray, by_dst: bool
) -> RowPlan:
    """All row pairs in one list sorted by the destination (`by_dst`) or the source: the plan
    for the compiled copier, which moves any pair list in one pass. The engine sorts by the
    source: reads then walk memory upward (each one a stall when it misses) while writes land
    wherever they go (streamed, nothing waits for them). Loads measured 20-25 % faster sorted by
    the host side (their source) when host rows are short and strided (page_first, page_head);
    page_head backups 0.61-0.84 of a memcpy sorted by the host side (their destination), 0.76-1.03
    sorted by the device side. Pure."""
    d, s = _pairs(dst, dst_pages, src, src_pages, by_dst=by_dst)
    return RowPlan(d, s, "staged")


def plan_rows(
    dst: RowGrid,
    dst_pages: np.ndarray,
    src: RowGrid,
    src_pages: np.ndarray,
    prefer_dst_order: bool,
    block_bytes: int = BLOCK_BYTES,
) -> RowPlan:
    """Row pairs for `dst[dst_pages] = src[src_pages]` (rows distinct on each side). A single
    pass is chosen when the destination rows form few large blocks or the source rows one
    block; otherwise rows are staged, sorted by the destination (`prefer_dst_order`) or the
    source, whichever is the strided host side. Pure."""
    fast = _page_blocks(dst, dst_pages, src, src_pages, block_bytes)
    if fast is not None:
        return fast
    d, s = _pairs(dst, dst_pages, src, src_pages, by_dst=True)
    breaks = np.flatnonzero(np.diff(d) != 1) + 1
    row_bytes = dst.array.shape[1] * dst.array.itemsize
    if (d.size and d.size * row_bytes >= (breaks.size + 1) * block_bytes) or breaks.size == 0:
        starts = [0, *breaks.tolist()]
        return RowPlan(
            d, s, "blocks", tuple(starts + [d.size]), tuple(d[starts].tolist()) if d.size else ()
        )
    d2, s2 = _pairs(dst, dst_pages, src, src_pages, by_dst=False)
    breaks = np.flatnonzero(np.diff(s2) != 1) + 1
    if s2.size * row_bytes >= (breaks.size + 1) * block_bytes or breaks.size == 0:
        starts = [0, *breaks.tolist()]
        return RowPlan(d2, s2, "put", tuple(starts + [s2.size]), tuple(s2[starts].tolist()))
    return RowPlan(d, s, "staged") if prefer_dst_order else RowPlan(d2, s2, "staged")


def copy_rows(
    dst: np.ndarray,
    src: np.ndarray,
    plan: RowPlan,
    scratch: np.ndarray,
    lo: int = 0,
    hi: int | None = None,
    *,
    native: NativeRows | None = None,
    streaming: bool = False,
) -> None:
    """Copy pairs `lo:hi` (default: all) of `plan` from `src` to `dst` (C-contiguous row
    arrays of one dtype); `scratch` is a 1-D uint8 buffer of at least one row. With `native`
    (the compiled copier) every mode is one pass without scratch, `streaming` past the cache.
    Disjoint pair ranges may run on different threads with different scratch buffers (numpy
    and the copier release the GIL). Mutates `dst` (and `scratch`)."""
    hi = plan.pairs if hi is None else hi
    if hi <= lo:
        return
    if native is not None:
        _copy_native(native, dst, src, plan, lo, hi, streaming)
        return
    if plan.mode == "blocks":
        for start, end, block_first in zip(plan.breaks, plan.breaks[1:], plan.firsts):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                first = block_first + a - start
                np.take(
                    src, plan.src_rows[a:b], axis=0, out=dst[first : first + b - a], mode="wrap"
                )
        return
    if plan.mode == "put":
        for start, end, block_first in zip(plan.breaks, plan.breaks[1:], plan.firsts):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                first = block_first + a - start
                dst[plan.dst_rows[a:b]] = src[first : first + b - a]
        return
    row_bytes = src.shape[1] * src.itemsize
    chunk = max(1, scratch.size // row_bytes)
    stage = scratch[: chunk * row_bytes].view(src.dtype).reshape(chunk, src.shape[1])
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        part = stage[: b - a]
        np.take(src, plan.src_rows[a:b], axis=0, out=part, mode="wrap")
        dst[plan.dst_rows[a:b]] = part


def _copy_native(
    native: NativeRows,
    dst: np.ndarray,
    src: np.ndarray,
    plan: RowPlan,
    lo: int,
    hi: int,
    streaming: bool,
) -> None:
    """`copy_rows` through the compiled copier: one call per block (blocks, put) or for the
    whole range (staged pairs need no staging here)."""
    if plan.mode == "staged":
        native.copy(
            dst, src, plan.dst_rows[lo:hi], 0, plan.src_rows[lo:hi], 0, hi - lo, streaming=streaming
        )
        return
    for start, end, block_first in zip(plan.breaks, plan.breaks[1:], plan.firsts):
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            continue
        first = block_first + a - start
        if plan.mode == "blocks":
            native.copy(dst, src, None, first, plan.src_rows[a:b], 0, b - a, streaming=streaming)
        else:
            native.copy(dst, src, plan.dst_rows[a:b], 0, None, first, b - a, streaming=streaming)
