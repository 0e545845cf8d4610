"""Host pool memory: exact size, every page faulted in by the threads asked for, registered
with CUDA through the runtime's calls (a recording stand-in here), and a clean fallback."""

from __future__ import annotations

import gc
import itertools
import sys
import threading

import numpy as np
import pytest
import torch

from hicache.kernels import pinning
from hicache.kernels.huge_pages import (
    HUGE_PAGE,
    SMALL_PAGE,
    first_touch,
    mapped_bytes,
    touch_ranges,
)
from hicache.kernels.pinning import host_memory, register_host


class RecordingRuntime:
    """Stands in for cuda.bindings.runtime: records cudaHostRegister/Unregister calls."""

    cudaHostRegisterPortable = 1
    cudaHostRegisterMapped = 2

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.mapped_at_unregister: list[bool] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple[int]:
        self.registered.append((ptr, size, flags))
        return (self.error,)

    def cudaHostUnregister(self, ptr: int) -> tuple[int]:
        self.unregistered.append(ptr)
        self.mapped_at_unregister.append(is_mapped(ptr))
        return (0,)


def is_mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's mappings (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 10 * 4096 + 5, 3 << 20])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_touch_ranges_cover_exactly_on_page_boundaries(nbytes, threads):
    ranges = touch_ranges(nbytes, threads)
    pages = -(-nbytes // SMALL_PAGE)
    assert len(ranges) == min(threads, pages)
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo and lo % SMALL_PAGE == 0
    assert all(lo < hi for lo, hi in ranges)


def test_touch_ranges_empty():
    assert touch_ranges(0, 4) == []


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of the mapping that holds `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("threads", [1, 3])
def test_first_touch_faults_in_every_page_on_the_threads_asked(threads, monkeypatch):
    nbytes = 2 * HUGE_PAGE + 3 * SMALL_PAGE + 100
    buffer, mapping = mapped_bytes(nbytes)
    assert buffer.numel() == nbytes and buffer.data_ptr() % HUGE_PAGE == 0
    before = _rss_of_mapping(buffer.data_ptr())
    assert before < nbytes  # nothing was touched yet
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self):  # the helper threads first_touch starts
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    assert first_touch(buffer.numpy(), threads) == threads
    assert started == ["hicache-touch"] * (threads - 1)  # the caller touches the first range
    assert _rss_of_mapping(buffer.data_ptr()) >= nbytes
    assert not buffer.any()
    del buffer, mapping


def test_host_memory_unpinned_is_exact_zeroed_and_touched_by_threads():
    nbytes = 3 * HUGE_PAGE + 12345
    memory = host_memory(nbytes, threads=4)
    assert memory.buffer.numel() == nbytes and memory.buffer.dtype == torch.uint8
    assert memory.pinning == "none"
    assert memory.touch_threads == 1  # one thread per 64 MiB: this buffer is smaller
    big = host_memory(130 << 20, threads=4)
    assert big.touch_threads == 2
    assert big.buffer.numel() == 130 << 20 and not big.buffer[:: 1 << 20].any()


def test_host_memory_small_buffers_come_from_torch():
    memory = host_memory(1000)
    assert memory.buffer.numel() == 1000 and memory.pinning == "none" and memory.touch_threads == 0


def test_host_memory_rejects_no_threads():
    with pytest.raises(ValueError, match="threads must be at least 1"):
        host_memory(HUGE_PAGE, threads=0)


def test_pinned_host_memory_registers_the_exact_range_and_unregisters_when_freed():
    runtime = RecordingRuntime()
    nbytes = HUGE_PAGE + 7
    memory = host_memory(nbytes, pin=True, runtime=runtime)
    assert memory.pinning == "registered"
    address = memory.buffer.data_ptr()
    assert runtime.registered == [(address, nbytes, 3)]  # portable | mapped, the exact size
    view = memory.buffer[5:10]
    del memory
    gc.collect()
    assert runtime.unregistered == []  # a view still holds the memory
    del view
    gc.collect()
    assert runtime.unregistered == [address]
    assert runtime.mapped_at_unregister == [True]  # unregistered before the munmap


def test_failed_registration_falls_back_to_torch_pinned_and_says_why(monkeypatch):
    runtime = RecordingRuntime(error=2)  # cudaErrorMemoryAllocation's number
    made: list[tuple[int, bool]] = []

    def zeros(n, *, dtype, pin_memory):  # torch's pinned allocator (needs CUDA) stands in here
        made.append((n, pin_memory))
        return torch.ones(n, dtype=dtype)

    monkeypatch.setattr(pinning.torch, "zeros", zeros)
    memory = host_memory(HUGE_PAGE, pin=True, runtime=runtime)
    assert made == [(HUGE_PAGE, True)]
    assert memory.pinning == "torch: cudaHostRegister failed: 2"
    assert memory.touch_threads == 0 and runtime.unregistered == []


def test_register_without_a_driver_says_why():
    """The real runtime on a machine without a driver (or without cuda-python): a reason, not
    an exception."""
    buffer, mapping = mapped_bytes(HUGE_PAGE)
    if torch.cuda.is_available():
        pytest.skip("a driver is present: registration would succeed")
    why = register_host(buffer, mapping)
    assert why is not None and "cudaHostRegister" in why


def test_cpu_bytes_keeps_its_contract():
    buffer = pinning.cpu_bytes(HUGE_PAGE + 1)
    assert buffer.numel() == HUGE_PAGE + 1 and not np.asarray(buffer.numpy()).any()


def test_host_pool_says_how_its_memory_was_made():
    from hicache.kernels import DevicePool, HostPool, MHAGeometry

    device = DevicePool.allocate(MHAGeometry(2, 2, 64, torch.float16), 4096, 16)
    host = HostPool(device, 8192, "page_first", pin_memory=False)
    assert host.pinning == "none" and host.buffer.numel() == host.nbytes


# ---------------------------------------------------------------- the host pool, chunk by chunk
class FailingRuntime(RecordingRuntime):
    """Fails the registrations whose number (0, 1, ...) is in `fail`."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail
        self.calls = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple[int]:
        number, self.calls = self.calls, self.calls + 1
        if number in self.fail:
            return (2,)
        return super().cudaHostRegister(ptr, size, flags)


def lazy_pool(layout, *, pin=False, runtime=None, tokens=16384, page=16):
    from hicache.kernels import DevicePool, HostPool, MHAGeometry

    # 3 * 2 * 2 * 24 * 2 bytes a token: pages of 9 KiB, not a multiple of 4 KiB, so chunks
    # share 4 KiB pages at their edges.
    device = DevicePool.allocate(MHAGeometry(3, 2, 24, torch.float16), 2048, page)
    return HostPool(
        device, tokens, layout, pin_memory=pin, prepare=False, runtime=runtime, header_room=0
    )


def chunks_of(host, count):
    from hicache.components.allocator.chunks import chunk_plan

    pages = host.size // host.page_size
    return chunk_plan(host.size, host.page_size, -(-pages // count))


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_slot_bytes_cover_each_page_of_a_chunk_and_nothing_of_the_others(layout):
    host = lazy_pool(layout)
    for start, stop in [(0, 16), (32, 96), (host.size - 16, host.size)]:
        mask = np.zeros(host.nbytes, dtype=bool)
        for lo, hi in host.slot_bytes(start, stop):
            mask[lo:hi] = True
        mine = host.page_buffers(np.arange(start, stop))
        theirs = host.page_buffers(np.setdiff1d(np.arange(host.size), np.arange(start, stop)))
        base = host.buffer.data_ptr()
        for pieces, want in ((mine, True), (theirs, False)):
            for page in pieces:
                for piece in page:
                    lo = np.frombuffer(piece, dtype=np.uint8).ctypes.data - base
                    assert mask[lo : lo + len(piece)].all() == want


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_preparing_a_chunk_never_writes_into_one_prepared_before(layout):
    host = lazy_pool(layout)
    assert host.lazy
    chunks = chunks_of(host, 8)
    for k, (start, stop) in enumerate(chunks):
        assert not host.memory.prepared(host.slot_bytes(start, stop))
        assert host.prepare_slots(start, stop) is None
        assert host.memory.prepared(host.slot_bytes(start, stop))
        for page in host.page_buffers(np.arange(start, stop)):  # the chunk's KV: all 0xAB
            for piece in page:
                np.frombuffer(piece, dtype=np.uint8)[:] = 0xAB
        for earlier in chunks[: k + 1]:
            for page in host.page_buffers(np.arange(*earlier)):
                assert all((np.frombuffer(p, dtype=np.uint8) == 0xAB).all() for p in page)
    assert host.memory._touched.all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pinned_chunks_register_disjoint_ranges_and_unpin_undoes_them_all(layout):
    runtime = RecordingRuntime()
    host = lazy_pool(layout, pin=True, runtime=runtime)
    for start, stop in chunks_of(host, 4):
        assert host.prepare_slots(start, stop) is None
    base, spans = host.buffer.data_ptr(), []
    for ptr, size, flags in runtime.registered:
        assert flags == 3 and (ptr - base) % SMALL_PAGE == 0
        spans.append((ptr - base, ptr - base + size))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == host.nbytes
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no page twice
    assert sum(b - a for a, b in spans) == host.nbytes
    assert len(host.memory.registered) == len(spans)
    assert host.unpin() == len(spans)
    assert sorted(runtime.unregistered) == sorted(p for p, _, _ in runtime.registered)
    assert host.memory.registered == {} and host.unpin() == 0


def test_a_chunk_whose_registration_fails_says_why_and_can_be_tried_again():
    runtime = FailingRuntime(fail={1})
    host = lazy_pool("page_first", pin=True, runtime=runtime)
    first, second, third = chunks_of(host, 3)
    assert host.prepare_slots(*first) is None
    assert host.prepare_slots(*second) == "cudaHostRegister failed: 2"
    assert not host.memory.prepared(host.slot_bytes(*second))
    assert host.prepare_slots(*third) is None  # the next chunks go on
    assert host.prepare_slots(*second) is None  # and the failed one may be tried again
    assert host.memory.prepared(host.slot_bytes(0, host.size))
    assert host.unpin() == 3


def test_a_pool_whose_first_registration_fails_falls_back_whole(monkeypatch):
    runtime = FailingRuntime(fail={0})
    host = lazy_pool("page_first", pin=True, runtime=runtime)
    why = host.prepare_slots(0, 1024)
    assert why is not None
    monkeypatch.setattr(
        pinning.torch, "zeros", lambda n, *, dtype, pin_memory: torch.ones(n, dtype=dtype)
    )
    host.fall_back(why)
    assert host.pinning == f"torch: {why}" and not host.lazy
    assert host.prepare_slots(0, host.size) is None and host.buffer.numel() == host.nbytes
    assert len(host.page_buffers(np.arange(16))[0][0]) == 16 * host.geometry.bytes_per_token
