"""Engines refuse memory they cannot address, and virtual streams pick the engine that fits
the device pool's device (a GPU pool must never reach the CPU row copier: it crashed there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, make_streams, plan_transfer
from hicache.kernels.cpu_engine import CpuEngine
from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.rows import UnreachableMemory
from hicache.kernels.streams import inline
from hicache.kernels.streams.inline import CpuInlineCopies, inline_copies
from hicache.kernels.streams.virtual import VirtualStreams
from hicache.kernels.transfer import backup, load_layer, run_load_all
from tests.unit.kernels.reference import randomize

G = MHAGeometry(layers=2, heads=2, head_dim=8, dtype=torch.float16)


class NoNative:
    """Stands in for the compiled copier: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the native copier was reached ({name}) with unreachable memory")


def meta_pools(layout="page_first"):
    """A device pool whose tensors are not in host memory (the `meta` device: shapes only)."""
    device = DevicePool.allocate(G, 16, 4, device="meta")
    return device, HostPool(device, 32, layout)


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("native", [True, False])
def test_cpu_engine_refuses_a_device_pool_off_the_host(io, native):
    device, host = meta_pools("page_first" if io == "kernel" else "page_first_direct")
    engine = CpuEngine(native=False)
    if native:
        engine.native = NoNative()  # type: ignore[assignment]
    slots = np.arange(8, dtype=np.int64)
    with pytest.raises(
        UnreachableMemory, match="CPU copy engine cannot move a device pool on meta"
    ):
        backup(device, host, slots, slots, io=io, engine=engine)
    with pytest.raises(UnreachableMemory, match="on meta"):
        load_layer(host, device, slots, slots, 0, io=io, engine=engine)
    assert not host.buffer.any()  # nothing was written on the host side either


def test_cpu_engine_primitives_check_each_tensor():
    engine = CpuEngine(native=False)
    engine.native = NoNative()  # type: ignore[assignment]
    host = torch.zeros(4, 4, 2, 8, dtype=torch.int16)
    away = torch.zeros(4, 4, 2, 8, dtype=torch.int16, device="meta")
    pages = torch.arange(2)
    with pytest.raises(UnreachableMemory, match="tensor on meta"):
        engine.move([(host, away)], pages, pages, host_is_dst=True)
    with pytest.raises(UnreachableMemory, match="tensor on meta"):
        engine.move_numpy([(away, host)], np.arange(2), np.arange(2))
    with pytest.raises(UnreachableMemory, match="tensor on meta"):
        engine.copy_run(host[:2], away[:2])
    with pytest.raises(UnreachableMemory, match="tensor on meta"):
        engine.gather_scatter(away, pages, host, pages)


def test_an_error_names_the_device_and_what_moves_it():
    device, host = meta_pools()
    plan = plan_transfer(host, device, np.arange(4), np.arange(4))
    with pytest.raises(UnreachableMemory) as caught:
        run_load_all(plan, host, device, "kernel", CpuEngine())
    assert "meta" in str(caught.value) and "engine_for" in str(caught.value)
    assert isinstance(caught.value, ValueError)  # bad input, not a crash


def test_virtual_streams_refuse_a_device_no_engine_moves():
    device, host = meta_pools()
    for prefer in ("virtual", "inline"):
        with pytest.raises(UnreachableMemory, match="no copy engine moves a device pool on meta"):
            make_streams(
                device, host, io="kernel", prefer=prefer, schedule=lambda d, cb: None, bandwidth=1e9
            )


class Recording:
    """Stand-in inline copies: records the plans it is handed."""

    kind = "cuda"

    def __init__(self, device_pool, host_pool, io, *, transfer_sms=None):
        self.made_for = (device_pool, host_pool, io)
        self.transfer_sms = transfer_sms
        self.calls = []
        self.closed = 0

    def load_all(self, plan):
        self.calls.append(("load", plan.host_pages.tolist(), plan.device_pages.tolist()))

    def load_layer(self, plan, layer):
        self.calls.append(("layer", layer, plan.host_pages.tolist()))

    def backup(self, plan):
        self.calls.append(("backup", plan.host_pages.tolist(), plan.device_pages.tolist()))

    def close(self):
        self.closed += 1


def test_inline_copies_follow_the_device_pools_device(monkeypatch):
    device = DevicePool.allocate(G, 16, 4)
    host = HostPool(device, 32, "page_first")
    assert isinstance(inline_copies(device, host, "kernel"), CpuInlineCopies)
    # A pool on a GPU (a stand-in object: only its device is read) gets the CUDA inline copies,
    # the class the CUDA streams' module provides, never the CPU ones.
    from hicache.kernels.streams import cuda

    monkeypatch.setattr(cuda, "CudaInlineCopies", Recording)
    on_gpu = SimpleNamespace(device=torch.device("cuda:1"), geometry=G)
    made = inline_copies(on_gpu, host, "direct")  # type: ignore[arg-type]
    assert isinstance(made, Recording) and made.made_for == (on_gpu, host, "direct")
    assert made.transfer_sms == DEFAULT_TRANSFER_SMS
    assert set(inline.MAKERS) == {"cpu", "cuda"}


@pytest.mark.parametrize("prefer", ["virtual", "inline"])
def test_the_sm_budget_reaches_the_cuda_inline_copies(monkeypatch, prefer):
    """`transfer_sms` holds for the copies virtual and inline streams make on a GPU pool too,
    not only for the CUDA streams."""
    from hicache.kernels.streams import cuda

    monkeypatch.setattr(cuda, "CudaInlineCopies", Recording)
    device = DevicePool.allocate(G, 16, 4)
    host = HostPool(device, 32, "page_first")
    on_gpu = SimpleNamespace(device=torch.device("cuda:0"), geometry=G)
    streams, _ = make_streams(
        on_gpu,  # type: ignore[arg-type]
        host,
        io="kernel",
        prefer=prefer,
        schedule=lambda delay, callback: None,
        bandwidth=1e9,
        transfer_sms=3,
    )
    assert isinstance(streams.copies, Recording) and streams.copies.transfer_sms == 3


@pytest.mark.parametrize("prefer", ["virtual", "inline"])
def test_virtual_streams_move_bytes_with_the_selected_copies(prefer):
    device = DevicePool.allocate(G, 16, 4)
    host = HostPool(device, 32, "page_first")
    recording = Recording(device, host, "kernel")
    streams = VirtualStreams(
        device,
        host,
        io="kernel",
        schedule=lambda delay, callback: None,
        bandwidth=float("inf") if prefer == "inline" else 1e9,
        copies=recording,
    )
    streams.submit_load(np.arange(16, 24), np.arange(8), on_done=lambda e: None)
    streams.submit_backup(np.arange(8, 12), np.arange(4), on_done=lambda e: None)
    assert recording.calls == [("load", [4, 5], [0, 1]), ("backup", [0], [2])]
    streams.close()
    streams.close()
    assert recording.closed == 1


def test_cpu_pools_still_move_their_bytes_on_virtual_streams():
    device = DevicePool.allocate(G, 16, 4)
    host = HostPool(device, 32, "page_first")
    randomize(host.buffer, np.random.default_rng(1))
    streams, selection = make_streams(
        device,
        host,
        io="kernel",
        prefer="virtual",
        schedule=lambda delay, callback: None,
        bandwidth=1e9,
    )
    assert selection.kind == "virtual" and "CPU engine" in selection.reason
    streams.submit_load(np.arange(16, 24), np.arange(8), on_done=lambda e: None)
    reference = DevicePool.allocate(G, 16, 4)
    for layer in range(G.layers):
        load_layer(host, reference, np.arange(16, 24), np.arange(8), layer)
        for c in range(G.components):
            moved = device.buffer(layer, c)[:8].view(torch.uint8)
            assert moved.any() and torch.equal(
                moved, reference.buffer(layer, c)[:8].view(torch.uint8)
            )
    streams.close()


def test_a_device_engine_moves_only_its_own_device():
    from hicache.kernels.transfer import check_reach

    class BoundTo:
        kind = "cuda"

        def __init__(self, device):
            self.device = torch.device(device)

    on_second = SimpleNamespace(device=torch.device("cuda:1"))
    check_reach(BoundTo("cuda:1"), on_second)  # type: ignore[arg-type]
    check_reach(BoundTo("cuda"), on_second)  # type: ignore[arg-type]  # unindexed: any
    with pytest.raises(
        UnreachableMemory, match="bound to cuda:0 cannot move a device pool on cuda:1"
    ):
        check_reach(BoundTo("cuda:0"), on_second)  # type: ignore[arg-type]
    with pytest.raises(
        UnreachableMemory, match="CUDA copy engine cannot move a device pool on cpu"
    ):
        check_reach(BoundTo("cuda:0"), SimpleNamespace(device=torch.device("cpu")))  # type: ignore[arg-type]


def test_an_engines_own_stream_is_destroyed_with_the_engine(monkeypatch):
    """The stream and events a CUDA engine makes for copies issued from the legacy default
    stream go when the engine does (an engine made per call must not leave them behind)."""
    import contextlib
    import gc

    from hicache.kernels.cuda_engine import CudaEngine

    class Runtime:
        cudaStreamNonBlocking = 1
        cudaEventDisableTiming = 2

        def __init__(self) -> None:
            self.made: list[str] = []
            self.destroyed: list[str] = []

        def cudaStreamCreateWithFlags(self, flags):
            self.made.append(f"stream{len(self.made)}")
            return (0, self.made[-1])

        def cudaEventCreateWithFlags(self, flags):
            self.made.append(f"event{len(self.made)}")
            return (0, self.made[-1])

        def cudaEventDestroy(self, event):
            self.destroyed.append(event)

        def cudaStreamDestroy(self, stream):
            self.destroyed.append(stream)

    runtime = Runtime()
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    engine = CudaEngine(torch.device("cuda:0"), None, issuer=None, kernel_copies="torch")
    engine._cudart = runtime  # type: ignore[attr-defined]
    engine._own_stream()
    engine._own_stream()  # made once
    assert len(runtime.made) == 3 and runtime.destroyed == []
    del engine
    gc.collect()
    assert sorted(runtime.destroyed) == sorted(runtime.made)
