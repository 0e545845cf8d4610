"""CPU transfers as batched row copies.

Every word view the transfers use is (pages, ..., row) with the last dim contiguous. Seen over
its memory, such a view is a C-contiguous grid of rows of `row` words: page `p` owns rows
`p * page_rows + inner` (`inner` in the view's element order). A page-to-page transfer is then
a list of (source row, destination row) pairs, and numpy moves a batch of rows in one C loop
(`take`: one memcpy per row; fancy assignment: one contiguous copy per row), releasing the GIL
and using one core (torch's CPU index ops are element-wise or fork an OpenMP team per call).

Row pairs are ordered so that one side is sequential whenever possible, which makes the copy a
single pass; otherwise rows go through a cache-sized scratch buffer (gather, then scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCRATCH_BYTES = 1 << 20
"""Staged copies gather this many bytes at a time: small enough to stay in L2 between the
gather and the scatter, large enough that per-call overhead is noise."""


@dataclass(frozen=True, slots=True)
class RowGrid:
    """A word view as rows: `array` is a C-contiguous (rows, row) numpy array over the view's
    memory (writing it writes the tensor); page `p`'s rows are `p * page_rows + inner`."""

    array: np.ndarray
    page_rows: int
    inner: np.ndarray


def row_grid(view: torch.Tensor) -> RowGrid | None:
    """The row grid of a (pages, ..., row) CPU word view; None when its rows are not aligned
    to a grid of its last dim (the caller then falls back to a generic copy). Does not copy."""
    if view.dim() < 2 or view.shape[0] == 0 or view.stride(-1) != 1:
        return None
    row = view.shape[-1]
    strides = view.stride()[:-1]
    if row == 0 or any(s < 0 or s % row for s in strides):
        return None
    inner = np.zeros(1, dtype=np.int64)
    for n, s in zip(view.shape[1:-1], strides[1:]):
        inner = (inner[:, None] + np.arange(n, dtype=np.int64) * (s // row)).ravel()
    page_rows = strides[0] // row
    extent = (view.shape[0] - 1) * page_rows + int(inner.max()) + 1
    flat = torch.as_strided(view, (extent * row,), (1,))
    return RowGrid(flat.numpy().reshape(extent, row), page_rows, inner)


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Row pairs of one (destination, source) page mapping, and how to copy them:
    `take` (destination rows are one block starting at `dst_rows[0]`), `put` (source rows are
    one block) or `staged` (neither: gather into scratch, then scatter)."""

    dst_rows: np.ndarray
    src_rows: np.ndarray
    mode: str


def _block(rows: np.ndarray) -> bool:
    """Whether `rows` are consecutive and increasing."""
    return rows.size < 2 or bool((np.diff(rows) == 1).all())


def _pairs(dst: RowGrid, dst_pages: np.ndarray, src: RowGrid, src_pages: np.ndarray,
           by_dst: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs sorted by destination (by_dst) or source row; page and inner order follow it."""
    pages, inner = (dst_pages, dst.inner) if by_dst else (src_pages, src.inner)
    order = np.argsort(pages, kind="stable")
    inner_order = np.argsort(inner, kind="stable")
    d = (dst_pages[order, None] * dst.page_rows + dst.inner[None, inner_order]).ravel()
    s = (src_pages[order, None] * src.page_rows + src.inner[None, inner_order]).ravel()
    return d, s


def plan_rows(dst: RowGrid, dst_pages: np.ndarray, src: RowGrid, src_pages: np.ndarray,
              prefer_dst_order: bool) -> RowPlan:
    """Row pairs for `dst[dst_pages] = src[src_pages]` (pages distinct on each side). A single
    pass is chosen when either side's rows form one block; otherwise rows are sorted by the
    destination (`prefer_dst_order`) or the source, whichever is the strided host side."""
    d, s = _pairs(dst, dst_pages, src, src_pages, by_dst=True)
    if _block(d):
        return RowPlan(d, s, "take")
    d2, s2 = _pairs(dst, dst_pages, src, src_pages, by_dst=False)
    if _block(s2):
        return RowPlan(d2, s2, "put")
    return RowPlan(d, s, "staged") if prefer_dst_order else RowPlan(d2, s2, "staged")


def copy_rows(dst: np.ndarray, src: np.ndarray, plan: RowPlan, scratch: np.ndarray) -> None:
    """Copy rows per `plan` from `src` to `dst` (both C-contiguous row arrays of one dtype);
    `scratch` is a 1-D uint8 buffer of at least one row. Mutates `dst` (and `scratch`)."""
    n = plan.dst_rows.size
    if n == 0:
        return
    if plan.mode == "take":
        start = int(plan.dst_rows[0])
        np.take(src, plan.src_rows, axis=0, out=dst[start : start + n], mode="wrap")
        return
    if plan.mode == "put":
        start = int(plan.src_rows[0])
        dst[plan.dst_rows] = src[start : start + n]
        return
    row_bytes = src.shape[1] * src.itemsize
    chunk = max(1, scratch.size // row_bytes)
    stage = scratch[: chunk * row_bytes].view(src.dtype).reshape(chunk, src.shape[1])
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        part = stage[: hi - lo]
        np.take(src, plan.src_rows[lo:hi], axis=0, out=part, mode="wrap")
        dst[plan.dst_rows[lo:hi]] = part
