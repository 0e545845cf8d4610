"""Every layout x io x direction x MHA/MLA x dtype x page size x CPU copier (compiled rows,
numpy rows) against a naive per-token copy, on random non-contiguous page sets; untouched
bytes must stay as they were."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hicache.kernels import (
    DevicePool,
    HostPool,
    MHAGeometry,
    MLAGeometry,
    backup,
    load_layer,
    plan_transfer,
    run_load_all,
)
from hicache.kernels.engines import CpuEngine
from hicache.kernels.layouts import row_unit
from hicache.kernels.native.rowcopy import native_rows, unavailable_reason
from tests.unit.kernels.reference import naive_backup, naive_load, random_page_slots, randomize

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def geometry(kind: str, dtype: torch.dtype):
    # odd widths on purpose: row bytes not always a multiple of 8 exercise narrow copy words
    if kind == "mha":
        return MHAGeometry(layers=3, heads=2, head_dim=6, dtype=dtype)
    return MLAGeometry(layers=3, kv_lora_rank=5, qk_rope_head_dim=2, dtype=dtype)


CASES = [
    pytest.param(layout, io, kind, dtype, ps, id=f"{layout}-{io}-{kind}-{str(dtype)[6:]}-ps{ps}")
    for layout, io, kind, dtype, ps in itertools.product(
        LAYOUTS, ["kernel", "direct"], ["mha", "mla"], DTYPES, [1, 16, 64]
    )
    if not (layout == "page_head" and kind == "mla")
]


@pytest.fixture(params=["compiled", "numpy"])
def engine(request) -> CpuEngine:
    """The CPU engine with each row copier; both must move exactly the same bytes."""
    if request.param == "compiled" and native_rows() is None:
        pytest.skip(f"compiled row copier unavailable: {unavailable_reason()}")
    return CpuEngine(native=request.param == "compiled")


def room(layout, g, ps) -> int:
    """Page sizes above 1 run with the smallest header room the layout allows (bytes no copy
    may touch between pages), page size 1 without."""
    if ps == 1 or layout == "layer_first":
        return 0
    return math.lcm(row_unit(layout, g, ps), 64)


def pools(layout, kind, dtype, ps, seed):
    g = geometry(kind, dtype)
    device = DevicePool.allocate(g, 4 * ps, ps)
    host = HostPool(device, 8 * ps, layout, header_room=room(layout, g, ps))
    rng = np.random.default_rng(seed)
    randomize(device, rng)
    randomize(host.buffer, rng)
    # 3 of 4 device pages and 3 of 8 host pages, shuffled: runs both coalesce and break
    device_slots = random_page_slots(rng, device.size, ps, 3)
    host_slots = random_page_slots(rng, host.size, ps, 3)
    return g, device, host, device_slots, host_slots


def snapshot(device):
    return [
        [device.buffer(l, c).clone() for c in range(device.geometry.components)]
        for l in range(device.geometry.layers)
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout,io,kind,dtype,ps", CASES)
def test_load_layer_matches_naive(layout, io, kind, dtype, ps, engine):
    g, device, host, device_slots, host_slots = pools(
        layout, kind, dtype, ps, seed=ps + len(layout)
    )
    expected = DevicePool.wrap(g, ps, **_wrap_kwargs(g, snapshot(device)))
    host_before = host.buffer.clone()
    for layer in range(g.layers):
        load_layer(
            host, device, torch.from_numpy(host_slots), device_slots, layer, io=io, engine=engine
        )
        naive_load(host, expected, host_slots, device_slots, layer)
        for l in range(g.layers):  # layers not loaded yet are untouched, loaded ones match
            for c in range(g.components):
                assert same_bytes(device.buffer(l, c), expected.buffer(l, c)), (l, c)
    assert torch.equal(host.buffer, host_before)


@pytest.mark.parametrize("layout,io,kind,dtype,ps", CASES)
def test_backup_matches_naive(layout, io, kind, dtype, ps, engine):
    g, device, host, device_slots, host_slots = pools(
        layout, kind, dtype, ps, seed=3 * ps + len(layout)
    )
    expected = host.buffer.clone()
    device_before = snapshot(device)

    class Shadow:  # the naive reference writes a copy of the host bytes
        geometry, layout, size, page_size, buffer = (
            g,
            host.layout,
            host.size,
            host.page_size,
            expected,
        )
        header_room = host.header_room

    naive_backup(device, Shadow, device_slots, host_slots)
    backup(device, host, device_slots, torch.from_numpy(host_slots), io=io, engine=engine)
    assert torch.equal(host.buffer, expected)
    assert all(
        same_bytes(device.buffer(l, c), device_before[l][c])
        for l in range(g.layers)
        for c in range(g.components)
    )


@pytest.mark.parametrize(
    "layout,io,kind,dtype,ps",
    [c for c in CASES if c.values[3] in (torch.float16, torch.float8_e4m3fn)],
)
def test_load_all_matches_naive(layout, io, kind, dtype, ps, engine):
    g, device, host, device_slots, host_slots = pools(
        layout, kind, dtype, ps, seed=5 * ps + len(layout)
    )
    expected = DevicePool.wrap(g, ps, **_wrap_kwargs(g, snapshot(device)))
    host_before = host.buffer.clone()
    moved = run_load_all(
        plan_transfer(host, device, host_slots, device_slots), host, device, io, engine
    )
    for layer in range(g.layers):
        naive_load(host, expected, host_slots, device_slots, layer)
    assert moved == device_slots.size * g.bytes_per_token
    assert all(
        same_bytes(device.buffer(l, c), expected.buffer(l, c))
        for l in range(g.layers)
        for c in range(g.components)
    )
    assert torch.equal(host.buffer, host_before)


def _wrap_kwargs(g, buffers):
    if g.kind == "mha":
        return {"k_buffers": [b[0] for b in buffers], "v_buffers": [b[1] for b in buffers]}
    return {"latent_buffers": [b[0] for b in buffers]}


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_host_restores_device(layout, io):
    g = MHAGeometry(layers=2, heads=3, head_dim=4, dtype=torch.bfloat16)
    device = DevicePool.allocate(g, 32, 4)
    host = HostPool(device, 64, layout)
    rng = np.random.default_rng(7)
    randomize(device, rng)
    original = snapshot(device)
    slots = np.arange(8, 24, dtype=np.int64)
    host_slots = np.concatenate([np.arange(40, 48), np.arange(4, 12)]).astype(np.int64)
    backup(device, host, slots, host_slots, io=io)
    for l in range(2):
        for c in range(2):
            device.buffer(l, c)[slots].zero_()
    for layer in range(2):
        load_layer(host, device, host_slots, slots, layer, io=io)
    assert all(same_bytes(device.buffer(l, c), original[l][c]) for l in range(2) for c in range(2))
