"""Header room: bytes in front of each host page that hold no KV (layouts.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry
from hicache.kernels.layouts import HEADER_ROOM_WANTED, header_room
from hicache.kernels.pools import PagePieces

BIG = MHAGeometry(layers=16, heads=8, head_dim=128, dtype=torch.float16)  # 64 KiB a token
SMALL = MHAGeometry(layers=2, heads=2, head_dim=4, dtype=torch.float32)  # 128 B a token


@pytest.mark.parametrize(
    "layout, geometry, ps, expected",
    [
        ("page_first", BIG, 16, 2048),  # one token's heads (the row unit) of a 1 MiB page
        ("page_first", BIG, 1, 0),  # 2 KiB would be 1/32 of a 64 KiB page
        ("page_head", BIG, 16, HEADER_ROOM_WANTED),  # head rows are 256 B
        ("page_first", SMALL, 16, 0),  # 512 B would be a quarter of a 2 KiB page
        ("page_first_direct", BIG, 16, 0),  # its row unit is a 32 KiB block: 1/32 of a page
        ("layer_first", BIG, 64, 0),  # pages are not contiguous: no room to speak of
    ],
)
def test_default_room_only_where_it_is_cheap(layout, geometry, ps, expected):
    assert header_room(layout, geometry, ps) == expected


@pytest.mark.parametrize(
    "layout, room, match",
    [
        ("page_first", 100, "multiple of"),  # not a multiple of 64 (the row unit is 32 B)
        ("page_first", -2048, "multiple of"),
        ("page_first", True, "multiple of"),
        ("layer_first", 2048, "page-contiguous"),
    ],
)
def test_bad_room_is_refused_naming_it(layout, room, match):
    device = DevicePool.allocate(SMALL, 8, 4)
    with pytest.raises(ValueError, match=match):
        HostPool(device, 16, layout, header_room=room)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_pages_sit_after_their_room(layout):
    device = DevicePool.allocate(SMALL, 8, 4)
    room = header_room(layout, SMALL, 4, 512)
    host = HostPool(device, 16, layout, header_room=room)
    page = host.page_nbytes
    assert host.nbytes == host.buffer.numel() == 4 * (page + room)
    raw = host.buffer.numpy()
    raw[:] = np.arange(raw.size) % 251
    buffers = host.page_buffers(np.arange(4, 12))  # pages 1 and 2
    assert all(isinstance(b, PagePieces) and b.header_room == room and len(b) == 1 for b in buffers)
    for p, (piece,) in zip((1, 2), buffers):
        start = room + p * (page + room)
        assert bytes(piece) == raw[start : start + page].tobytes()
    # the KV views see the same bytes as the pieces and never the rooms
    shaped = host.shaped().view(torch.uint8).numpy()
    assert shaped.reshape(4, -1)[1].tobytes() == bytes(buffers[0][0])


def test_no_room_pieces_say_so():
    device = DevicePool.allocate(SMALL, 8, 4)
    host = HostPool(device, 16, "layer_first")
    (pieces,) = host.page_buffers(np.arange(4))
    assert pieces.header_room == 0 and len(pieces) == 2 * 2


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pool_pages_are_marked_checked_and_are_what_a_backend_checks(layout):
    device = DevicePool.allocate(SMALL, 8, 4)
    host = HostPool(device, 16, layout)
    for pieces in host.page_buffers(np.arange(8)):
        assert pieces.checked  # a backend takes them without a check per piece...
        for piece in pieces:  # ...because each is what that check asks for
            assert piece.c_contiguous and not piece.readonly and piece.ndim == 1
            assert piece.format == "B"
    assert not PagePieces([memoryview(b"x")]).checked  # anything else is checked
