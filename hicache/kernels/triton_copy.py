"""Kernel io on CUDA as one Triton copy kernel per move, on at most `transfer_sms` SMs.

A move (every (layer, component) view of a transfer) is cut into pieces as direct io cuts it
(`direct_copies.piece_layout`: the bytes both sides hold contiguously within a page); item
(view v, page i, piece k) copies `piece` words from `src_view[v] + src_pages[i] * src_page +
src_piece[k]` to the same on the destination side (offsets in words from the first view of
each side). The host side is the device mapping of the pinned host buffer, so the kernel reads
or writes host memory across the link itself. The grid has `transfer_sms` programs, one CTA
each, so the copy occupies at most that many SMs and the model's kernels keep the rest: a copy
kernel spread over every SM slows the forward pass running beside it. Each program walks the
items in groups (`ITEMS` pieces of `BLOCK` words at a time, about 32 KiB in flight).

Importing this module needs triton (shipped with CUDA builds of torch); the engine uses it only
where it imports (cuda_engine.py). With `TRITON_INTERPRET=1` set before `kernel()` is first
called, the kernel runs on CPU tensors in triton's interpreter (the unit tests do).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from hicache.kernels.direct_copies import PieceLayout, piece_layout

BYTES_IN_FLIGHT = 32 << 10
"""Bytes one program moves per step (loads issued before their stores): enough outstanding
reads to cover the link's latency on few SMs."""


def _copy_pieces(  # type: ignore[no-untyped-def]  # triton reads the parameters itself
    dst,
    src,
    dst_pages,
    src_pages,
    dst_views,
    src_views,
    dst_pieces,
    src_pieces,
    n_pages,
    n_pieces,
    total,
    dst_page,
    src_page,
    piece,
    ITEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Items (view, page, piece), view-major then page then piece; one program per SM. Every
    piece starts a multiple of ALIGN words from the base pointers (vector loads and stores)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    groups = (total + ITEMS - 1) // ITEMS  # not tl.cdiv: a jit function of its own
    for group in range(pid, groups, programs):
        item = tl.cast(group, tl.int64) * ITEMS + tl.arange(0, ITEMS)  # past 2**31 items
        live = item < total
        k = item % n_pieces
        rest = item // n_pieces
        i = rest % n_pages
        v = rest // n_pages
        d = (
            tl.load(dst_views + v, mask=live, other=0)
            + tl.load(dst_pages + i, mask=live, other=0) * dst_page
            + tl.load(dst_pieces + k, mask=live, other=0)
        )
        s = (
            tl.load(src_views + v, mask=live, other=0)
            + tl.load(src_pages + i, mask=live, other=0) * src_page
            + tl.load(src_pieces + k, mask=live, other=0)
        )
        d = tl.multiple_of(d, ALIGN)
        s = tl.multiple_of(s, ALIGN)
        for start in range(0, piece, BLOCK):
            offset = start + tl.arange(0, BLOCK)
            mask = live[:, None] & (offset < piece)[None, :]
            words = tl.load(src + s[:, None] + offset[None, :], mask=mask)
            tl.store(dst + d[:, None] + offset[None, :], words, mask=mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    return triton.jit(_copy_pieces)


def kernel() -> Any:
    """The jitted kernel (interpreted where `TRITON_INTERPRET=1`)."""
    return _kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")


@dataclass(frozen=True, slots=True)
class MoveShape:
    """A move's item tables, kept per pair list: word offsets of each view from the first view
    of its side, of each piece within a page, and the page strides, as int64 tensors on the
    views' device."""

    dst: torch.Tensor  # the first destination view (the kernel's base pointer)
    src: torch.Tensor
    dst_views: torch.Tensor
    src_views: torch.Tensor
    dst_pieces: torch.Tensor
    src_pieces: torch.Tensor
    dst_page: int
    src_page: int
    piece: int  # words
    align: int  # words every piece's start is a multiple of (at most 16 bytes' worth)


def move_shape(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> MoveShape | None:
    """The item tables of a move, or None when its views do not share one pattern (views of a
    side with different strides, offsets not whole words): the caller copies another way."""
    layouts = [piece_layout(dst, src) for dst, src in pairs]
    first: PieceLayout = layouts[0]
    word = pairs[0][0].element_size()
    for lay in layouts[1:]:
        if (lay.dst_page, lay.src_page, lay.piece) != (first.dst_page, first.src_page, first.piece):
            return None
        if not (
            np.array_equal(lay.dst_offsets, first.dst_offsets)
            and np.array_equal(lay.src_offsets, first.src_offsets)
        ):
            return None
    dst_views = np.array([lay.dst_base - first.dst_base for lay in layouts], dtype=np.int64)
    src_views = np.array([lay.src_base - first.src_base for lay in layouts], dtype=np.int64)
    parts = (dst_views, src_views, first.dst_offsets, first.src_offsets)
    scalars = (first.dst_page, first.src_page, first.piece)
    if any((a % word).any() for a in parts) or any(x % word for x in scalars):
        return None
    device = pairs[0][0].device
    spans = [int(x) for a in parts for x in np.unique(a)] + [*scalars[:2], 16, *scalars[2:]]
    align = max(1, math.gcd(*spans) // word)
    dst_v, src_v, dst_k, src_k = (torch.from_numpy(a // word).to(device) for a in parts)
    return MoveShape(
        pairs[0][0],
        pairs[0][1],
        dst_v,
        src_v,
        dst_k,
        src_k,
        first.dst_page // word,
        first.src_page // word,
        first.piece // word,
        align,
    )


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def launch(
    shape: MoveShape, dst_pages: torch.Tensor, src_pages: torch.Tensor, transfer_sms: int
) -> None:
    """Enqueue the move on torch's current stream: `dst[dst_pages] = src[src_pages]` for every
    view pair, on at most `transfer_sms` programs. Page tensors: int64 on the views' device."""
    pages = int(dst_pages.numel())
    if pages == 0:
        return
    n_views, n_pieces = int(shape.dst_views.numel()), int(shape.dst_pieces.numel())
    total = n_views * pages * n_pieces
    word = shape.dst.element_size()
    block = min(triton.next_power_of_2(shape.piece), _pow2_at_most(BYTES_IN_FLIGHT // word))
    items = max(1, _pow2_at_most(BYTES_IN_FLIGHT // (block * word)))
    groups = -(-total // items)
    kernel()[(max(1, min(transfer_sms, groups)),)](
        shape.dst,
        shape.src,
        dst_pages,
        src_pages,
        shape.dst_views,
        shape.src_views,
        shape.dst_pieces,
        shape.src_pieces,
        pages,
        n_pieces,
        total,
        shape.dst_page,
        shape.src_page,
        shape.piece,
        ITEMS=items,
        BLOCK=block,
        ALIGN=shape.align,
        num_warps=8,
    )
