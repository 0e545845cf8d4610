"""CUDA data plane: transfers and streams on a real device. Skipped where none exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels import (
    DevicePool,
    HostPool,
    MHAGeometry,
    MLAGeometry,
    backup,
    cuda_driver_status,
    load_layer,
    make_streams,
)

usable, why = cuda_driver_status()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (usable and torch.cuda.is_available()), reason=f"no usable CUDA device: {why}"
    ),
]


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize(
    "geometry", [MHAGeometry(3, 2, 64, torch.bfloat16), MLAGeometry(3, 64, 16, torch.float8_e4m3fn)]
)
def test_round_trip_on_device(io, layout, geometry):
    if layout == "page_head" and geometry.kind == "mla":
        pytest.skip("page_head is MHA only")
    device = DevicePool.allocate(geometry, 64, 16, device="cuda")
    host = HostPool(device, 128, layout)
    assert host.pinned
    for l in range(geometry.layers):
        for c in range(geometry.components):
            device.buffer(l, c).view(torch.uint8).copy_(
                torch.randint(
                    0, 256, device.buffer(l, c).view(torch.uint8).shape, dtype=torch.uint8
                )
            )
    original = [
        [device.buffer(l, c).clone() for c in range(geometry.components)]
        for l in range(geometry.layers)
    ]
    slots = np.arange(16, 48, dtype=np.int64)
    host_slots = np.concatenate([np.arange(96, 112), np.arange(16, 32)]).astype(np.int64)
    backup(device, host, slots, host_slots, io=io)
    torch.cuda.synchronize()
    for l in range(geometry.layers):
        for c in range(geometry.components):
            device.buffer(l, c)[16:48].view(torch.uint8).zero_()
    for layer in range(geometry.layers):
        load_layer(host, device, host_slots, slots, layer, io=io)
    torch.cuda.synchronize()
    for l in range(geometry.layers):
        for c in range(geometry.components):
            assert torch.equal(
                device.buffer(l, c).view(torch.uint8), original[l][c].view(torch.uint8)
            )


def host_tokens(host: HostPool, layer: int, component: int, buffer=None) -> torch.Tensor:
    """One (layer, component) of the host pool as (tokens, heads, bytes), in any layout
    (`buffer`: a copy of the host buffer to view the same way)."""
    return host.page_view(layer, component, torch.uint8, buffer).flatten(0, 1)


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_cuda_streams_layerwise(io):
    g = MHAGeometry(4, 2, 64, torch.float16)
    device = DevicePool.allocate(g, 64, 16, device="cuda")
    host = HostPool(device, 128, "page_first" if io == "kernel" else "page_first_direct")
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    streams, selection = make_streams(device, host, io=io)
    assert selection.kind == "cuda"
    done = []
    handle = streams.submit_load(
        np.arange(32, 64, dtype=np.int64), np.arange(32, dtype=np.int64), on_done=done.append
    )
    for layer in range(g.layers):
        handle.wait(layer)  # compute stream waits on the layer's event
        for c in range(g.components):
            landed = device.buffer(layer, c)[:32].view(torch.uint8).cpu()
            assert landed.shape == host_tokens(host, layer, c)[32:64].shape
            assert torch.equal(landed, host_tokens(host, layer, c)[32:64])
    before = host.buffer.clone()
    streams.submit_backup(
        np.arange(32, dtype=np.int64), np.arange(64, 96, dtype=np.int64), on_done=done.append
    )
    streams.close()
    assert done == [None, None] and handle.done()
    for layer in range(g.layers):
        for c in range(g.components):
            backed = host_tokens(host, layer, c)[64:96]
            assert torch.equal(backed, host_tokens(host, layer, c)[32:64])
            backed.copy_(host_tokens(host, layer, c, before)[64:96])  # undo: see below
    assert torch.equal(host.buffer, before)  # the backup wrote its tokens and nothing else
