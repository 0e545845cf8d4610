"""Pools, page buffer views, and bad input rejected before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, MLAGeometry, backup, load_layer
from tests.unit.kernels.reference import randomize

G = MHAGeometry(layers=2, heads=2, head_dim=4, dtype=torch.float16)
MLA = MLAGeometry(layers=3, kv_lora_rank=6, qk_rope_head_dim=2, dtype=torch.bfloat16)


def test_device_pool_accessors():
    d = DevicePool.allocate(G, 16, 4)
    assert (d.size, d.page_size) == (16, 4)
    assert d.k_buffer(1).shape == (16, 2, 4) and d.v_buffer(1).dtype == torch.float16
    assert d.k_buffer(0).data_ptr() != d.v_buffer(0).data_ptr()
    with pytest.raises(TypeError, match="MHA"):
        d.latent_buffer(0)
    m = DevicePool.allocate(MLA, 8, 1)
    assert m.latent_buffer(2).shape == (8, 1, 8)
    with pytest.raises(TypeError, match="MLA"):
        m.k_buffer(0)


def test_wrap_uses_engine_tensors_without_copying():
    ks = [torch.randn(8, 2, 4).half() for _ in range(2)]
    vs = [torch.randn(8, 2, 4).half() for _ in range(2)]
    d = DevicePool.wrap(G, 4, k_buffers=ks, v_buffers=vs)
    assert d.k_buffer(1) is ks[1] and d.v_buffer(0) is vs[0]


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda: [torch.zeros(8, 2, 4, dtype=torch.float32)] * 2, "dtype"),
        (lambda: [torch.zeros(8, 3, 4, dtype=torch.float16)] * 2, "shape"),
        (
            lambda: [
                torch.zeros(8, 2, 4, dtype=torch.float16),
                torch.zeros(12, 2, 4, dtype=torch.float16),
            ],
            "tokens",
        ),
        (
            lambda: [
                torch.zeros(8, 2, 4, dtype=torch.float16),
                torch.zeros(8, 2, 4, dtype=torch.float16, device="meta"),
            ],
            "is on meta",
        ),
        (
            lambda: [torch.zeros(2, 4, 8, dtype=torch.float16).transpose(0, 2).transpose(1, 2)] * 2,
            "contiguous",
        ),
        (lambda: [torch.zeros(6, 2, 4, dtype=torch.float16)] * 2, "multiple of page_size"),
        (lambda: [torch.zeros(8, 2, 4, dtype=torch.float16)], "layers"),
    ],
)
def test_wrap_rejects_mismatched_tensors(make, fragment):
    ks = make()
    with pytest.raises(ValueError, match=fragment):
        DevicePool.wrap(G, 4, k_buffers=ks, v_buffers=[torch.zeros_like(k) for k in ks])


def test_wrap_needs_the_right_buffer_kinds():
    with pytest.raises(ValueError, match="k_buffers and v_buffers"):
        DevicePool.wrap(G, 4, latent_buffers=[torch.zeros(8, 2, 4)])
    with pytest.raises(ValueError, match="latent_buffers"):
        DevicePool.wrap(MLA, 1, k_buffers=[], v_buffers=[])


@pytest.mark.parametrize(
    "size,layout,fragment",
    [
        (16, "page_first", "larger than the device pool"),
        (8, "page_first", "larger than the device pool"),
        (18, "page_first", "multiple of page_size"),
        (32, "page_row", "unknown host layout"),
    ],
)
def test_host_pool_checks(size, layout, fragment):
    d = DevicePool.allocate(G, 16, 4)
    with pytest.raises(ValueError, match=fragment):
        HostPool(d, size, layout)


def test_page_head_rejects_mla():
    with pytest.raises(ValueError, match="MHA"):
        HostPool(DevicePool.allocate(MLA, 8, 1), 16, "page_head")


@pytest.mark.parametrize(
    "layout,pieces",
    [("layer_first", 4), ("page_first", 1), ("page_first_direct", 1), ("page_head", 1)],
)
def test_page_buffers_are_zero_copy_and_cover_each_page(layout, pieces):
    d = DevicePool.allocate(G, 16, 4)
    h = HostPool(d, 32, layout)
    randomize(h.buffer, np.random.default_rng(1))
    slots = np.array([*range(12, 16), *range(4)], dtype=np.int64)
    views = h.page_buffers(slots)
    assert len(views) == 2 and all(len(p) == pieces for p in views)
    for page in views:
        assert sum(v.nbytes for v in page) == h.page_nbytes == 4 * G.bytes_per_token
        assert all(v.c_contiguous and v.format == "B" for v in page)
    # every byte of pages 3 and 0 is covered exactly once: mark through the views
    before = h.buffer.clone()
    for page in views:
        for view in page:
            view[:] = bytes(len(view))
    changed = (h.buffer != before).numpy()
    assert not changed[h.buffer.numpy() != 0].any()  # nothing outside the pages was zeroed
    # device slots loaded from zeroed pages become zero: the views alias exactly those pages
    d_slots = np.arange(8, dtype=np.int64)
    for layer in range(2):
        load_layer(h, d, slots, d_slots, layer)
    assert d.k_buffer(0)[:8].abs().sum() == 0 and d.v_buffer(1)[:8].abs().sum() == 0


def test_layer_first_pieces_are_layer_major_k_then_v():
    d = DevicePool.allocate(G, 16, 4)
    h = HostPool(d, 32, "layer_first")
    for layer in range(2):
        d.k_buffer(layer)[:4] = 10 * layer + 1
        d.v_buffer(layer)[:4] = 10 * layer + 2
    backup(d, h, np.arange(4), np.arange(4, 8))
    pieces = h.page_buffers(np.arange(4, 8))[0]
    values = [np.frombuffer(p, dtype=np.float16)[0] for p in pieces]
    assert values == [1, 2, 11, 12]


def test_page_buffers_validate():
    h = HostPool(DevicePool.allocate(G, 16, 4), 32, "page_first")
    with pytest.raises(ValueError, match="whole number of pages"):
        h.page_buffers(np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        h.page_buffers(np.arange(32, 36, dtype=np.int64))


# ---- bad transfer input: error, and not one byte moved ----------------------------------


def _setup(ps=4):
    d = DevicePool.allocate(G, 16, ps)
    h = HostPool(d, 32, "page_first")
    rng = np.random.default_rng(5)
    randomize(d, rng)
    randomize(h.buffer, rng)
    return d, h


def _state(d, h):
    return [h.buffer.clone()] + [d.buffer(l, c).clone() for l in range(2) for c in range(2)]


BAD = [
    (np.arange(8), np.arange(4), "8 slots but device_slots has 4"),
    (np.arange(28, 36), np.arange(8), "slot 35 is out of range"),
    (np.arange(8), np.arange(-4, 4), "slot -4 is out of range"),
    (np.array([0, 1, 2, 3, 0, 1, 2, 3]), np.arange(8), "appears more than once"),
    (np.arange(2, 10), np.arange(8), "not a multiple of page_size"),
    (np.array([0, 1, 3, 2]), np.arange(4), "not 4 consecutive slots"),
    (np.arange(6), np.arange(6), "whole number of pages"),
    (np.arange(8, dtype=np.int32), np.arange(8), "must be int64"),
    (torch.arange(8, dtype=torch.int32), np.arange(8), "must be int64"),
    (list(range(8)), np.arange(8), "numpy int64 array or a torch int64 tensor"),
    (np.arange(8).reshape(2, 4), np.arange(8), "1-D"),
]


@pytest.mark.parametrize("host_slots,device_slots,fragment", BAD)
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_bad_slots_raise_before_any_byte_moves(host_slots, device_slots, fragment, direction):
    d, h = _setup()
    before = _state(d, h)
    with pytest.raises((ValueError, TypeError), match=fragment):
        if direction == "load":
            load_layer(h, d, host_slots, device_slots, 0)
        else:
            backup(d, h, device_slots, host_slots)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, _state(d, h))
    )


def test_mismatched_pools_and_arguments():
    d, h = _setup()
    other = DevicePool.allocate(MHAGeometry(2, 2, 4, torch.bfloat16), 16, 4)
    with pytest.raises(ValueError, match="geometry"):
        load_layer(h, other, np.arange(4), np.arange(4), 0)
    with pytest.raises(ValueError, match="page_size"):
        backup(DevicePool.allocate(G, 16, 2), h, np.arange(4), np.arange(4))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        load_layer(h, d, np.arange(4), np.arange(4), 2)
    with pytest.raises(ValueError, match="unknown io backend"):
        backup(d, h, np.arange(4), np.arange(4), io="dma")
