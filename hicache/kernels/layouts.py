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

Header room: in the page-contiguous layouts each page may be preceded by `room` bytes that
hold no KV (page `p` then starts at byte `room + p * (page bytes + room)`). A storage backend
writes a value's header there, so header and page go out as one contiguous piece (Mooncake's
transfer engine moves each extra piece as a separate request: ~9 % of an upload here). The
room is a multiple of the widest row a page view is copied as, so the row copier's grids hold.
"""

from __future__ import annotations

import math

import torch

from hicache.kernels.geometry import Geometry
from hicache.kernels.names import LAYOUTS

PAGE_CONTIGUOUS_LAYOUTS: frozenset[str] = frozenset(
    {"page_first", "page_first_direct", "page_head"}
)


def check_layout(layout: str, geometry: Geometry) -> None:
    """ValueError for an unknown layout or `page_head` with MLA."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {list(LAYOUTS)}")
    if layout == "page_head" and geometry.kind == "mla":
        raise ValueError(
            "host layout 'page_head' needs MHA (it splits pages by head); MLA has one latent row"
        )


def word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer type whose size divides `nbytes`: copies move words, not dtype values,
    so every KV dtype (float8 included) moves the same way and index ops stay fast."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


HEADER_ROOM_WANTED = 512
"""Bytes of room wanted in front of each page: a value header is 28 bytes plus its key."""


def row_unit(layout: str, geometry: Geometry, page_size: int) -> int:
    """Bytes of the widest row a page view of `layout` is copied as (page strides must stay
    multiples of it): one (layer, component) block for `page_first_direct`, a token's heads
    for `page_first`, one head row for `page_head`."""
    head_row = geometry.row_dim * geometry.itemsize
    return {
        "page_first_direct": page_size * geometry.row_heads * head_row,
        "page_first": geometry.row_heads * head_row,
    }.get(layout, head_row)


def header_room(layout: str, geometry: Geometry, page_size: int, room: int | None = None) -> int:
    """The room in front of each page: `room` checked (0, or a multiple of the row unit and of
    64 in a page-contiguous layout), or for None the smallest such multiple of at least
    HEADER_ROOM_WANTED when it costs at most 1/64 of a page, else 0. Raises ValueError."""
    if layout not in PAGE_CONTIGUOUS_LAYOUTS:
        if room:
            raise ValueError(f"header_room needs a page-contiguous layout, not {layout!r}")
        return 0
    unit = math.lcm(row_unit(layout, geometry, page_size), 64)
    if room is None:
        room = -(-HEADER_ROOM_WANTED // unit) * unit
        return room if room * 64 <= page_size * geometry.bytes_per_token else 0
    if isinstance(room, bool) or not isinstance(room, int) or room < 0 or room % unit:
        raise ValueError(
            f"header_room {room!r} must be 0 or a multiple of {unit} bytes for {layout!r} pages"
        )
    return room


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
    words: torch.Tensor,
    layout: str,
    geometry: Geometry,
    size: int,
    page_size: int,
    layer: int,
    component: int,
    room: int = 0,
) -> torch.Tensor:
    """The (pages, page_size, H, Dw) view of one (layer, component) of a host buffer given as a
    1-D tensor of words (`Dw` words per head row; `room`: header room bytes before each page).
    A view: writing it writes the host buffer."""
    L, C = geometry.layers, geometry.components
    H = geometry.row_heads
    P, ps = size // page_size, page_size
    Dw = geometry.row_dim * geometry.itemsize // words.element_size()
    if layout == "layer_first":
        return words.view(L, C, P, ps, H, Dw)[layer, component]
    room_w = room // words.element_size()
    pages = words.view(P, -1)[:, room_w:]  # each row: one page, after its room
    if layout == "page_first":
        return pages.view(P, ps, L, C, H, Dw)[:, :, layer, component]
    if layout == "page_first_direct":
        return pages.view(P, L, C, ps, H, Dw)[:, layer, component]
    if layout == "page_head":
        return pages.view(P, C, H, ps, L, Dw)[:, component, :, :, layer].permute(0, 2, 1, 3)
    raise ValueError(f"unknown host layout {layout!r}")


def page_pieces(
    layout: str, geometry: Geometry, size: int, page_size: int, page: int, room: int = 0
) -> list[tuple[int, int]]:
    """(byte offset, byte length) of the pieces holding `page`, in value order: one piece for
    page-contiguous layouts (after the page's `room`); for `layer_first`, layer by layer,
    component by component."""
    row = geometry.row_heads * geometry.row_dim * geometry.itemsize
    page_nbytes = page_size * geometry.bytes_per_token
    if layout in PAGE_CONTIGUOUS_LAYOUTS:
        return [(room + page * (page_nbytes + room), page_nbytes)]
    block = page_size * row
    pieces = []
    for layer in range(geometry.layers):
        for component in range(geometry.components):
            base = (layer * geometry.components + component) * size * row
            pieces.append((base + page * block, block))
    return pieces
