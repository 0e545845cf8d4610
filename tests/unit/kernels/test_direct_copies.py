"""Direct io as batched copies (direct_copies.py): the copy lists a transfer becomes, the calls
each issuer makes (against stand-ins that record them: ctypes callbacks in place of the driver's
entry points, an object in place of cuda-python's runtime), and the choice between issuers."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, MLAGeometry, plan_transfer
from hicache.kernels.cpu_engine import CpuEngine
from hicache.kernels.cuda_engine import CudaEngine
from hicache.kernels.direct_copies import (
    CompiledLoop,
    DriverBatch,
    RuntimeBatch,
    choose_issuer,
    copy_list,
    copy_loop_library,
    piece_layout,
)
from hicache.kernels.transfer import run_backup, run_load_layer

STREAM = 0x5EED


class MemmoveIssuer:
    """Records every issue call and performs the copies on the CPU."""

    name = "memmove"

    def __init__(self) -> None:
        self.calls: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def issue(self, dsts, srcs, sizes, stream):
        self.calls.append((dsts.copy(), srcs.copy(), sizes.copy(), stream))
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)


def _pools(geometry, layout, page_size, tokens=64):
    device = DevicePool.allocate(geometry, tokens, page_size)
    host = HostPool(device, 2 * tokens, layout, pin_memory=False)
    rng = np.random.default_rng(page_size)
    for layer in range(geometry.layers):
        for c in range(geometry.components):
            buf = device.buffer(layer, c).view(torch.uint8)
            buf.copy_(torch.from_numpy(rng.integers(0, 256, buf.shape, dtype=np.uint8)))
    return device, host


def _slots(pages, page_size, rng, total):
    chosen = rng.choice(total, pages, replace=False)
    return (chosen[:, None] * page_size + np.arange(page_size)).ravel().astype(np.int64)


GEOMETRIES = [MHAGeometry(3, 2, 16, torch.float16), MLAGeometry(2, 32, 8, torch.bfloat16)]
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["mha", "mla"])
def test_direct_io_is_one_issue_per_transfer_and_moves_the_right_bytes(geometry, layout, page_size):
    if layout == "page_head" and geometry.kind == "mla":
        pytest.skip("page_head is MHA only")
    device, host = _pools(geometry, layout, page_size)
    _, reference = _pools(geometry, layout, page_size)
    rng = np.random.default_rng(7)
    pages = device.size // page_size // 2
    dev_slots = _slots(pages, page_size, rng, device.size // page_size)
    host_slots = _slots(pages, page_size, rng, host.size // page_size)
    plan = plan_transfer(host, device, host_slots, dev_slots)
    issuer = MemmoveIssuer()
    engine = CudaEngine(device.device, STREAM, issuer=issuer)

    run_backup(plan, device, host, "direct", engine)
    run_backup(plan, device, reference, "kernel", CpuEngine())
    assert len(issuer.calls) == 1 and issuer.calls[0][3] == STREAM
    assert torch.equal(host.buffer, reference.buffer)

    loaded = DevicePool.allocate(geometry, device.size, page_size)
    for layer in range(geometry.layers):
        run_load_layer(plan, host, loaded, layer, "direct", engine)
        assert len(issuer.calls) == 2 + layer
        for c in range(geometry.components):
            got = loaded.buffer(layer, c)[torch.from_numpy(dev_slots)]
            want = device.buffer(layer, c)[torch.from_numpy(dev_slots)]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    untouched = np.setdiff1d(np.arange(device.size), dev_slots)
    assert not loaded.buffer(0, 0)[torch.from_numpy(untouched)].view(torch.uint8).any()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_runs_consecutive_on_both_sides_are_one_copy_each(layout):
    g = MHAGeometry(2, 2, 16, torch.float16)
    device, host = _pools(g, layout, 4)
    # host pages 4,5,6 <- device pages 0,1,2 (one run); host 9 <- device 7; listed unsorted
    host_slots = np.concatenate([np.arange(36, 40), np.arange(16, 28)]).astype(np.int64)
    dev_slots = np.concatenate([np.arange(28, 32), np.arange(0, 12)]).astype(np.int64)
    plan = plan_transfer(host, device, host_slots, dev_slots)
    issuer = MemmoveIssuer()
    run_backup(plan, device, host, "direct", CudaEngine(device.device, STREAM, issuer=issuer))
    ((dsts, srcs, sizes, _),) = issuer.calls
    page_bytes = 4 * g.heads * g.head_dim * 2  # one (layer, component) block of a page
    views = g.layers * g.components
    first = host.page_view(0, 0, host.word)
    if layout == "layer_first":  # a view's host pages are consecutive: runs merge
        assert sizes.tolist() == [3 * page_bytes, page_bytes] * views
        assert int(dsts[1]) == first[9].data_ptr()
    else:  # a page holds every layer's block: consecutive host pages are a page apart
        assert sizes.tolist() == [page_bytes] * 4 * views
        assert int(dsts[3]) == first[9].data_ptr()
    assert int(dsts[0]) == first[4].data_ptr()
    assert int(srcs[0]) == device.buffer(0, 0)[0].data_ptr()


def test_page_first_pieces_are_tokens():
    g = MHAGeometry(2, 2, 16, torch.float16)
    device, host = _pools(g, "page_first", 4)
    lay = piece_layout(host.page_view(1, 1, host.word), device.page_view(1, 1, host.word))
    token = g.heads * g.head_dim * 2
    assert lay.piece == token  # layers interleave within a host token: one piece per token
    assert lay.dst_offsets.tolist() == [i * g.layers * 2 * token for i in range(4)]
    assert lay.src_offsets.tolist() == [i * token for i in range(4)]


def test_copy_list_empty_and_mismatched_views():
    g = MHAGeometry(1, 1, 16, torch.float16)
    device, host = _pools(g, "page_first_direct", 4)
    lay = piece_layout(host.page_view(0, 0, host.word), device.page_view(0, 0, host.word))
    none = np.zeros(0, dtype=np.int64)
    for array in copy_list([lay], none, none, none):
        assert array.size == 0 and array.dtype == np.uint64
    with pytest.raises(ValueError, match="page views differ"):
        piece_layout(torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 5, dtype=torch.int32))


# --- the issuers' calls -----------------------------------------------------------------------

_P, _SZ = ctypes.c_void_p, ctypes.c_size_t
BATCH_12 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _SZ, _P, _P, _SZ, _P, _P)
BATCH_13 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _SZ, _P, _P, _SZ, _P)
MEMCPY_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _SZ, _P)


def _u64(address: int, n: int) -> list[int]:
    return list((ctypes.c_uint64 * n).from_address(address))


class BatchEntryPoint:
    """A ctypes callback standing in for the driver's cuMemcpyBatchAsync (12.x or 13.x ABI)."""

    def __init__(self, with_fail_index: bool, status: int = 0, fail_at: int = 0) -> None:
        self.calls: list[dict[str, Any]] = []
        self.status, self.fail_at = status, fail_at

        def record(dsts, srcs, sizes, count, attrs, idxs, nattrs, *rest):
            fail, stream = (rest[0], rest[1]) if with_fail_index else (None, rest[0])
            self.calls.append(
                {
                    "dsts": _u64(dsts, count),
                    "srcs": _u64(srcs, count),
                    "sizes": _u64(sizes, count),
                    "attrs": attrs,
                    "idxs": _u64(idxs, nattrs),
                    "stream": stream,
                    "fail": fail is not None,
                }
            )
            if fail is not None and self.status:
                ctypes.c_uint64.from_address(fail).value = self.fail_at
            return self.status

        self.callback = (BATCH_12 if with_fail_index else BATCH_13)(record)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value


COPIES = (
    np.array([0x1000, 0x9000], dtype=np.uint64),
    np.array([0x2000, 0xA000], dtype=np.uint64),
    np.array([256, 4096], dtype=np.uint64),
)


@pytest.mark.parametrize("with_fail_index", [True, False], ids=["cuda12", "cuda13"])
def test_driver_batch_is_one_call_with_the_lists(with_fail_index):
    entry = BatchEntryPoint(with_fail_index)
    attributes = ctypes.create_string_buffer(24)
    address = ctypes.addressof(attributes)
    DriverBatch(entry.address, with_fail_index, address, attributes).issue(*COPIES, STREAM)
    assert entry.calls == [
        {
            "dsts": [0x1000, 0x9000],
            "srcs": [0x2000, 0xA000],
            "sizes": [256, 4096],
            "attrs": address,
            "idxs": [0],
            "stream": STREAM,
            "fail": with_fail_index,
        }
    ]


def test_driver_batch_names_the_failed_copy_and_skips_empty_lists():
    entry = BatchEntryPoint(True, status=1, fail_at=1)
    batch = DriverBatch(entry.address, True, 0, None)
    with pytest.raises(RuntimeError, match="at copy 1 of 2: CUresult 1"):
        batch.issue(*COPIES, STREAM)
    empty = np.zeros(0, dtype=np.uint64)
    batch.issue(empty, empty, empty, STREAM)
    assert len(entry.calls) == 1
    entry13 = BatchEntryPoint(False, status=700)
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync failed: CUresult 700"):
        DriverBatch(entry13.address, False, 0, None).issue(*COPIES, STREAM)


class RecordingRuntime:
    """Stands in for cuda.bindings.runtime's batch call (12.x: (err, failIdx); 13.x: (err,))."""

    class cudaMemcpyAttributes:
        srcAccessOrder = None
        flags = None

    cudaMemcpySrcAccessOrder = SimpleNamespace(cudaMemcpySrcAccessOrderStream="stream-order")
    cudaMemcpyFlags = SimpleNamespace(cudaMemcpyFlagPreferOverlapWithCompute="overlap")

    def __init__(self, result: tuple[int, ...]) -> None:
        self.result = result
        self.calls: list[tuple[Any, ...]] = []

    def cudaStream_t(self, handle):
        return ("stream", handle)

    def cudaMemcpyBatchAsync(self, *args):
        self.calls.append(args)
        return self.result


@pytest.mark.parametrize("result", [(0, 0), (0,)], ids=["cuda12", "cuda13"])
def test_runtime_batch_passes_lists_attributes_and_the_stream(result):
    runtime = RecordingRuntime(result)
    RuntimeBatch(runtime).issue(*COPIES, STREAM)
    ((dsts, srcs, sizes, count, attrs, idxs, nattrs, stream),) = runtime.calls
    assert (dsts, srcs, sizes, count) == ([0x1000, 0x9000], [0x2000, 0xA000], [256, 4096], 2)
    assert (idxs, nattrs, stream) == ([0], 1, ("stream", STREAM))
    assert attrs[0].srcAccessOrder == "stream-order" and attrs[0].flags == "overlap"


@pytest.mark.parametrize(
    ("result", "message"),
    [((1, 1), "failed at copy 1 of 2"), ((1,), "cudaMemcpyBatchAsync failed: 1")],
    ids=["cuda12", "cuda13"],
)
def test_runtime_batch_errors(result, message):
    with pytest.raises(RuntimeError, match=message):
        RuntimeBatch(RecordingRuntime(result)).issue(*COPIES, STREAM)


def _loop_library():
    library, why = copy_loop_library()
    if library is None:
        pytest.skip(f"no C compiler: {why}")
    return library


def test_compiled_loop_issues_one_memcpy_async_per_copy_in_order():
    calls: list[tuple[int, int, int, int]] = []
    entry = MEMCPY_ASYNC(lambda d, s, n, stream: calls.append((d, s, n, stream)) or 0)
    loop = CompiledLoop(_loop_library(), ctypes.cast(entry, ctypes.c_void_p).value)
    loop.issue(*COPIES, STREAM)
    assert calls == [(0x1000, 0x2000, 256, STREAM), (0x9000, 0xA000, 4096, STREAM)]


def test_compiled_loop_stops_at_the_first_refused_copy():
    calls: list[int] = []

    def refuse_second(d, s, n, stream):
        calls.append(d)
        return 1 if len(calls) == 2 else 0

    entry = MEMCPY_ASYNC(refuse_second)
    loop = CompiledLoop(_loop_library(), ctypes.cast(entry, ctypes.c_void_p).value)
    three = tuple(np.concatenate([a, a[:1]]) for a in COPIES)
    with pytest.raises(RuntimeError, match="cuMemcpyAsync failed at copy 1 of 3: CUresult 1"):
        loop.issue(*three, STREAM)
    assert calls == [0x1000, 0x9000]


# --- which issuer ------------------------------------------------------------------------------


class RecordingDriver:
    """Stands in for cuda.bindings.driver: a version and entry points by name."""

    CUmemcpySrcAccessOrder = SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM=1)
    CUmemcpyFlags = SimpleNamespace(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE=1)

    class CUmemcpyAttributes:
        def __init__(self) -> None:
            self._memory = ctypes.create_string_buffer(24)

        def getPtr(self) -> int:
            return ctypes.addressof(self._memory)

    def __init__(self, version: int, entry_points: dict[str, int]) -> None:
        self.version, self.entry_points = version, entry_points
        self.asked: list[tuple[bytes, int, int]] = []

    def cuDriverGetVersion(self):
        return (0, self.version)

    def cuGetProcAddress(self, symbol, version, flags):
        self.asked.append((symbol, version, flags))
        return (0, self.entry_points.get(symbol.decode(), 0), 0)


class NoDriver:
    def cuDriverGetVersion(self):
        raise RuntimeError("libcuda.so.1 not found")


WITH_BATCH = SimpleNamespace(cudaMemcpyBatchAsync=None)
WITHOUT_BATCH = SimpleNamespace()


@pytest.mark.parametrize(
    ("version", "asked", "with_fail_index"),
    [(13000, 13000, False), (13020, 13000, False), (12080, 12080, True), (12090, 12080, True)],
)
def test_batch_entry_point_of_the_drivers_abi(version, asked, with_fail_index, monkeypatch):
    monkeypatch.delenv("HICACHE_DIRECT_COPIES", raising=False)
    entry = BatchEntryPoint(with_fail_index)
    driver = RecordingDriver(version, {"cuMemcpyBatchAsync": entry.address})
    issuer, reason = choose_issuer(driver=driver, runtime=WITH_BATCH)
    assert isinstance(issuer, DriverBatch) and issuer.with_fail_index == with_fail_index
    assert driver.asked == [(b"cuMemcpyBatchAsync", asked, 0)]
    assert f"driver {version}" in reason
    issuer.issue(*COPIES, STREAM)  # called with the ABI it was found for
    assert entry.calls[0]["fail"] == with_fail_index and entry.calls[0]["stream"] == STREAM


def test_without_a_batch_entry_point_the_runtime_binding_then_the_loop(monkeypatch):
    monkeypatch.delenv("HICACHE_DIRECT_COPIES", raising=False)
    driver = RecordingDriver(12080, {"cuMemcpyAsync": 1234})
    issuer, _ = choose_issuer(driver=driver, runtime=RecordingRuntime((0,)))
    assert isinstance(issuer, RuntimeBatch)
    _loop_library()
    issuer, reason = choose_issuer(driver=driver, runtime=WITHOUT_BATCH)
    assert isinstance(issuer, CompiledLoop) and "loop" in reason


def test_old_drivers_get_the_compiled_loop(monkeypatch):
    monkeypatch.delenv("HICACHE_DIRECT_COPIES", raising=False)
    _loop_library()
    driver = RecordingDriver(12040, {"cuMemcpyBatchAsync": 99, "cuMemcpyAsync": 1234})
    issuer, reason = choose_issuer(driver=driver, runtime=WITH_BATCH)
    assert isinstance(issuer, CompiledLoop)
    assert driver.asked == [(b"cuMemcpyAsync", 12040, 0)]  # the batch call is not asked for
    assert "12040 has no cuMemcpyBatchAsync" not in reason  # chosen: no excuse needed


def test_no_driver_means_python_runs_with_the_reason(monkeypatch):
    monkeypatch.delenv("HICACHE_DIRECT_COPIES", raising=False)
    issuer, reason = choose_issuer(driver=NoDriver(), runtime=WITH_BATCH)
    assert issuer is None and "libcuda.so.1 not found" in reason
    real, real_reason = choose_issuer()  # this machine's cuda-python, no driver
    if not torch.cuda.is_available():
        assert real is None and "run-by-run" in real_reason


def test_forcing_an_issuer(monkeypatch):
    driver = RecordingDriver(13000, {"cuMemcpyBatchAsync": 0, "cuMemcpyAsync": 1234})
    with pytest.raises(ValueError, match="unknown direct-copy issuer 'dma'"):
        choose_issuer("dma", driver=driver, runtime=WITH_BATCH)
    with pytest.raises(RuntimeError, match="'batch' unavailable: cuGetProcAddress has no"):
        choose_issuer("batch", driver=driver, runtime=WITH_BATCH)
    monkeypatch.setenv("HICACHE_DIRECT_COPIES", "python")
    assert choose_issuer(driver=driver, runtime=WITH_BATCH)[0] is None
    monkeypatch.setenv("HICACHE_DIRECT_COPIES", "batch-python")
    assert isinstance(choose_issuer(driver=driver, runtime=RecordingRuntime((0,)))[0], RuntimeBatch)


def test_views_of_different_patterns_are_listed_view_by_view():
    g = MHAGeometry(1, 2, 16, torch.float16)
    device, direct_host = _pools(g, "page_first_direct", 4)
    _, token_host = _pools(g, "page_first", 4)
    word = direct_host.word
    whole = piece_layout(direct_host.page_view(0, 0, word), device.page_view(0, 0, word))
    tokens = piece_layout(token_host.page_view(0, 1, word), device.page_view(0, 1, word))
    dst_pages, src_pages = np.array([3, 1], dtype=np.int64), np.array([0, 5], dtype=np.int64)
    order = np.array([1, 0])
    both = copy_list([whole, tokens], dst_pages, src_pages, order)
    apart = [copy_list([lay], dst_pages, src_pages, order) for lay in (whole, tokens)]
    for got, a, b in zip(both, *apart):
        assert got.tolist() == a.tolist() + b.tolist()
    assert apart[1][2].tolist() == [tokens.piece] * 8  # 2 pages x 4 tokens, none adjacent


class RecordingCudart:
    """Stands in for cuda.bindings.runtime's stream and event calls."""

    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def cudaStream_t(self, handle):
        return handle

    def cudaStreamCreateWithFlags(self, flags):
        self.calls.append(("create stream", flags))
        return (0, 0xAB)

    def cudaEventCreateWithFlags(self, flags):
        self.calls.append(("create event", flags))
        return (0, f"event{sum(c[0] == 'create event' for c in self.calls)}")

    def cudaEventRecord(self, event, stream):
        self.calls.append(("record", event, stream))
        return (0,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event))
        return (0,)

    def cudaEventDestroy(self, event):
        self.calls.append(("destroy event", event))
        return (0,)

    def cudaStreamDestroy(self, stream):
        self.calls.append(("destroy stream", stream))
        return (0,)


def test_on_the_legacy_default_stream_the_engine_issues_on_its_own(monkeypatch):
    """The batch calls refuse stream 0: the engine orders its own stream after the work queued
    on the legacy stream, issues there, and orders the legacy stream after the copies."""
    import contextlib

    g = MHAGeometry(1, 1, 16, torch.float16)
    device, host = _pools(g, "layer_first", 4)
    plan = plan_transfer(host, device, np.arange(8, 12), np.arange(4))
    issuer = MemmoveIssuer()
    engine = CudaEngine(device.device, None, issuer=issuer)
    rt = engine._cudart = RecordingCudart()
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0)
    )
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for _ in range(2):
        run_backup(plan, device, host, "direct", engine)
    assert [call[3] for call in issuer.calls] == [0xAB, 0xAB]
    per_transfer = [
        ("record", "event1", 0),
        ("wait", 0xAB, "event1"),
        ("record", "event2", 0xAB),
        ("wait", 0, "event2"),
    ]
    made = [("create stream", 1), ("create event", 2), ("create event", 2)]
    assert rt.calls == made + per_transfer * 2  # made once, used by every transfer


def test_cuda_streams_report_their_copy_paths(monkeypatch):
    """What the `streams.selected` event carries on CUDA (the streams' engines, built here on
    the CPU without the streams' CUDA setup)."""
    from hicache.kernels.streams.cuda import CudaStreams

    monkeypatch.delenv("HICACHE_KERNEL_COPIES", raising=False)
    streams = CudaStreams.__new__(CudaStreams)
    streams._engines = {"load": CudaEngine(CPU_DEVICE, 1, issuer=None, kernel_copies="torch")}
    assert streams.copy_paths() == {
        "kernel_copies": "torch",
        "kernel_copies_reason": "torch index ops requested",
        "direct_copies": "python",
        "direct_copies_reason": "given",
    }
    streams._engines = {"load": CudaEngine(CPU_DEVICE, 1, issuer=MemmoveIssuer())}
    assert streams.copy_paths()["direct_copies"] == "memmove"


CPU_DEVICE = torch.device("cpu")
