"""Host-pool layouts: where each token's rows live in the host buffer.

Shapes below are in elements of the KV dtype; `S` host slots, `P = S / page_size` pages,
`ps` page size, `L` layers, `C` components (2 = K,V for MHA; 1 = latent for MLA),
`H` heads (1 for MLA), `D` head dim (rank + rope for MLA):

| layout              | shape                     | one page of all layers is            |
|---------------------|---------------------------|--------------------------------------|
| `layer_first`       | (L, C, S, H, D)           | L x C pieces of ps x H x D           |
| `page_first`        | (S, L, C, H, D)           | one contiguous piece                 |
| `page_first_direct` | (P, L, C, ps, H, D)       | one piece; each (layer, comp) inside |
|                     |                           | is a contiguous ps x H x D block     |
| `page_head`         | (P, C, H, ps, L, D) (MHA) | one contiguous piece                 |

Everything else in the data plane goes through `page_view`, which for every layout returns
the (pages, ps, H, words) view of one (layer, component): the transfer code is layout-blind.
"""

from __future__ import annotations

from typing import Literal

import torch

from hicache.kernels.geometry import Geometry

Layout = Literal["layer_first", "page_first", "page_first_direct", "page_head"]
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first", "page_first_direct", "page_head")
PAGE_CONTIGUOUS_LAYOUTS: frozenset[str] = frozenset({"page_first", "page_first_direct", "page_head"})


def check_layout(layout: str, geometry: Geometry) -> None:
    """ValueError for an unknown layout or `page_head` with MLA."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {list(LAYOUTS)}")
    if layout == "page_head" and geometry.kind == "mla":
        raise ValueError("host layout 'page_head' needs MHA (it splits pages by head); MLA has one latent row")


def word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer type whose size divides `nbytes`: copies move words, not dtype values,
    so every KV dtype (float8 included) moves the same way and index ops stay fast."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def host_shape(layout: str, geometry: Geometry, size: int, page_size: int) -> tuple[int, ...]:
    """The layout's shape in elements (table above)."""
    L, C = geometry.layers, geometry.components
    H, D = geometry.row_heads, geometry.row_dim
    P, ps = size // page_size, page_size
    shapes = {
        "layer_first": (L, C, size, H, D),
        "page_first": (size, L, C, H, D),
        "page_first_direct": (P, L, C, ps, H, D),
        "page_head": (P, C, H, ps, L, D),
    }
    return shapes[layout]


def page_view(
    words: torch.Tensor, layout: str, geometry: Geometry, size: int, page_size: int,
    layer: int, component: int,
) -> torch.Tensor:
    """The (pages, page_size, H, Dw) view of one (layer, component) of a host buffer given as a
    1-D tensor of words (`Dw` words per head row). A view: writing it writes the host buffer."""
    L, C = geometry.layers, geometry.components
    H = geometry.row_heads
    P, ps = size // page_size, page_size
    Dw = words.numel() // (size * L * C * H)
    if layout == "layer_first":
        return words.view(L, C, P, ps, H, Dw)[layer, component]
    if layout == "page_first":
        return words.view(P, ps, L, C, H, Dw)[:, :, layer, component]
    if layout == "page_first_direct":
        return words.view(P, L, C, ps, H, Dw)[:, layer, component]
    if layout == "page_head":
        return words.view(P, C, H, ps, L, Dw)[:, component, :, :, layer].permute(0, 2, 1, 3)
    raise ValueError(f"unknown host layout {layout!r}")


def page_pieces(layout: str, geometry: Geometry, size: int, page_size: int, page: int) -> list[tuple[int, int]]:
    """(byte offset, byte length) of the pieces holding `page`, in value order: one piece for
    page-contiguous layouts; for `layer_first`, layer by layer, component by component."""
    row = geometry.row_heads * geometry.row_dim * geometry.itemsize
    page_nbytes = page_size * geometry.bytes_per_token
    if layout in PAGE_CONTIGUOUS_LAYOUTS:
        return [(page * page_nbytes, page_nbytes)]
    block = page_size * row
    pieces = []
    for layer in range(geometry.layers):
        for component in range(geometry.components):
            base = (layer * geometry.components + component) * size * row
            pieces.append((base + page * block, block))
    return pieces
