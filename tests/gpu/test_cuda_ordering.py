"""Stream ordering on a real GPU: a transfer is ordered after the compute work queued before
it on the submitter's current stream, in both directions and in every stream kind that moves
GPU pools (CUDA streams; virtual streams' inline copies in deterministic mode).

- A backup never copies a slot before the kernel that writes it (queued earlier) has run: the
  host bytes equal what the kernel wrote, not what the slot held before.
- A load never lands in slots that a kernel queued earlier still reads: that kernel sees the
  old bytes, and the slots hold the loaded ones afterwards.

Each test first queues a long spin (`torch.cuda._sleep`) on the current stream, so a copy that
did not wait for it would run first and the check would fail. Skipped where no GPU exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, cuda_driver_status, make_streams

usable, why = cuda_driver_status()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (usable and torch.cuda.is_available()), reason=f"no usable CUDA device: {why}"
    ),
]

G = MHAGeometry(4, 2, 64, torch.float16)
SPIN = 200_000_000
"""GPU cycles the long kernel spins (about 0.1 s): far longer than any of these copies."""

DEVICE_SLOTS = np.arange(16, 48, dtype=np.int64)
HOST_SLOTS = np.arange(64, 96, dtype=np.int64)


def host_tokens(host: HostPool, layer: int, component: int) -> torch.Tensor:
    return host.page_view(layer, component, torch.uint8).flatten(0, 1)


def device_tokens(device: DevicePool, layer: int, component: int) -> torch.Tensor:
    return device.buffer(layer, component).view(torch.uint8)


def random_like(t: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device)


def setup(io: str, prefer: str):
    device = DevicePool.allocate(G, 64, 16, device="cuda")
    host = HostPool(device, 128, "page_first" if io == "kernel" else "page_first_direct")
    later: list = []  # virtual streams' completions, fired by hand below
    streams, selection = make_streams(
        device,
        host,
        io=io,
        prefer=prefer,
        schedule=lambda delay, callback: later.append(callback),
        bandwidth=1e9,
    )
    assert selection.kind == ("cuda" if prefer == "auto" else "virtual"), selection

    def finish() -> None:
        streams.close()  # CUDA streams: waits for the queued jobs
        while later:  # virtual streams: the completions at their virtual times
            later.pop(0)()

    return device, host, streams, finish


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("prefer", ["auto", "virtual"])
def test_backup_copies_what_the_kernel_queued_before_it_wrote(io, prefer):
    device, host, streams, finish = setup(io, prefer)
    slots = slice(int(DEVICE_SLOTS[0]), int(DEVICE_SLOTS[-1]) + 1)
    written = [
        [random_like(device_tokens(device, layer, c)[slots]) for c in range(G.components)]
        for layer in range(G.layers)
    ]
    torch.cuda.synchronize()  # the slots hold zeros; the patterns exist before the race
    torch.cuda._sleep(SPIN)  # the long kernel: the writes below run after it
    for layer in range(G.layers):
        for c in range(G.components):
            device_tokens(device, layer, c)[slots].copy_(written[layer][c])
    done: list = []
    # what an engine does after its forward pass: cache_finished, whose backup is submitted
    # while the kernel is still queued
    streams.submit_backup(DEVICE_SLOTS, HOST_SLOTS, on_done=done.append)
    finish()
    assert done == [None]
    lo, hi = int(HOST_SLOTS[0]), int(HOST_SLOTS[-1]) + 1
    for layer in range(G.layers):
        for c in range(G.components):
            assert torch.equal(host_tokens(host, layer, c)[lo:hi], written[layer][c].cpu()), (
                f"layer {layer} component {c}: the backup copied before the kernel wrote"
            )


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("prefer", ["auto", "virtual"])
def test_load_never_lands_under_a_kernel_that_still_reads_the_slots(io, prefer):
    device, host, streams, finish = setup(io, prefer)
    slots = slice(int(DEVICE_SLOTS[0]), int(DEVICE_SLOTS[-1]) + 1)
    old = [
        [random_like(device_tokens(device, layer, c)[slots]) for c in range(G.components)]
        for layer in range(G.layers)
    ]
    for layer in range(G.layers):
        for c in range(G.components):
            device_tokens(device, layer, c)[slots].copy_(old[layer][c])
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    torch.cuda.synchronize()
    seen = [
        [torch.empty_like(old[layer][c]) for c in range(G.components)] for layer in range(G.layers)
    ]
    torch.cuda._sleep(SPIN)  # the long kernel: the reads below run after it
    for layer in range(G.layers):
        for c in range(G.components):
            seen[layer][c].copy_(device_tokens(device, layer, c)[slots])
    done: list = []
    handle = streams.submit_load(HOST_SLOTS, DEVICE_SLOTS, on_done=done.append)
    finish()
    torch.cuda.synchronize()
    assert done == [None] and handle.done()
    lo, hi = int(HOST_SLOTS[0]), int(HOST_SLOTS[-1]) + 1
    for layer in range(G.layers):
        for c in range(G.components):
            assert torch.equal(seen[layer][c], old[layer][c]), (
                f"layer {layer} component {c}: the load landed under a queued reader"
            )
            assert torch.equal(
                device_tokens(device, layer, c)[slots].cpu(), host_tokens(host, layer, c)[lo:hi]
            )
