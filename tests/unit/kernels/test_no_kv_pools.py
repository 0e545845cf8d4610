"""Pools of 0 layers (docs/hybrid.md, "Models with no layer kept as pages"): pages that hold
tokens alone. No byte is allocated for them, transfers between them move nothing and complete
on the next turn of the loop, and bad slots are still refused before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.backends.keys import Namespace
from hicache.kernels import DevicePool, HostPool, MHAGeometry, parse_geometry
from hicache.kernels.streams.nokv import NoKVStreams
from hicache.testing import run_virtual

NONE = MHAGeometry(layers=0, heads=1, head_dim=8, dtype=torch.float32)


def pools(layout: str = "page_first") -> tuple[DevicePool, HostPool]:
    device = DevicePool.allocate(NONE, size=64, page_size=4)
    return device, HostPool(device, 256, layout)


def test_a_geometry_of_0_layers_holds_no_byte_and_round_trips():
    assert parse_geometry("mha:0:1:8:float32") == NONE and NONE.bytes_per_token == 0
    assert parse_geometry("mla:0:512:64:bfloat16").bytes_per_token == 0
    assert NONE.spec() == "mha:0:1:8:float32"
    Namespace(model="m", kv="mha:0:1:8:float32", page_size=4)  # an L3 namespace of its own


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_pools_of_0_layers_allocate_nothing(layout):
    device, host = pools(layout)
    assert (device.size, device.page_size, device.device.type) == (64, 4, "cpu")
    assert host.nbytes == 0 == host.page_nbytes and host.header_room == 0
    pages = host.page_buffers(np.arange(8, 16))
    assert len(pages) == 2 and all(sum(len(p) for p in page) == 0 for page in pages)


def test_a_pool_of_0_layers_needs_its_size_and_device():
    with pytest.raises(ValueError, match="0 layers needs its size and device"):
        DevicePool(NONE, 4, [])
    with pytest.raises(ValueError, match="positive multiple of page_size"):
        DevicePool(NONE, 4, [], empty=(6, torch.device("cpu")))


def test_no_kv_streams_move_nothing_and_complete_on_the_next_turn():
    async def main():
        device, host = pools()
        later: list = []
        streams = NoKVStreams(device, host, schedule=lambda delay, fn: later.append((delay, fn)))
        done: list = []
        handle = streams.submit_load(np.arange(8, 16), np.arange(4, 12), on_done=done.append)
        streams.submit_backup(np.arange(0, 4), np.arange(12, 16), on_done=done.append)
        assert done == [] and [d for d, _ in later] == [0.0, 0.0]  # reported on a later turn
        for _, fn in later:
            fn()
        assert done == [None, None]
        assert handle.done() and handle.layer_done(-1)
        handle.wait(-1)
        await handle.wait_async(-1)  # "every layer landed", asked as the last layer
        with pytest.raises(ValueError, match="the pool has no layers"):
            handle.wait(0)
        with pytest.raises(ValueError, match="page"):  # bad slots: refused before queueing
            streams.submit_load(np.arange(1, 5), np.arange(4, 8), on_done=done.append)
        streams.close()
        with pytest.raises(RuntimeError, match="closed"):
            streams.submit_backup(np.arange(0, 4), np.arange(12, 16), on_done=done.append)
        assert len(later) == 2

    run_virtual(main)


def test_no_kv_streams_are_for_pools_of_0_layers_only():
    g = MHAGeometry(layers=1, heads=1, head_dim=8, dtype=torch.float32)
    device = DevicePool.allocate(g, size=64, page_size=4)
    with pytest.raises(ValueError, match="pools of 0 layers"):
        NoKVStreams(device, HostPool(device, 256, "page_first"), schedule=lambda d, f: None)
