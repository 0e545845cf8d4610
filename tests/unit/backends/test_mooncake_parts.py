"""Pure parts of the Mooncake backend: spec parsing, registered regions, chunking."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hicache.backends import framing
from hicache.backends.mooncake.io import get_chunk, put_chunk, split_chunks
from hicache.backends.mooncake.memory import Arena
from hicache.backends.mooncake.spec import parse_size, parse_spec
from hicache.backends.registered import RegisteredRegions, address_of
from hicache.kernels.pools import PagePieces


def test_spec_defaults_and_overrides() -> None:
    s = parse_spec("mooncake://10.0.0.5:50051?segment=1GiB&local_buffer=32MiB", {"lanes": 2})
    assert (s.master, s.protocol, s.segment, s.local_buffer, s.lanes) == (
        "10.0.0.5:50051",
        "tcp",
        1 << 30,
        32 << 20,
        2,
    )
    assert s.metadata == "http://10.0.0.5:8080/metadata"


@pytest.mark.parametrize(
    "spec, words",
    [
        ("redis://x:1", "mooncake://"),
        ("mooncake://host", "HOST:PORT"),
        ("mooncake://h:1?protocol=udp", "protocol"),
        ("mooncake://h:1?protocol=rdma", "device"),
        ("mooncake://h:1?segment=lots", "segment"),
        ("mooncake://h:1?lanes=0", "lanes"),
        ("mooncake://h:1?colour=red", "unknown option"),
        ("mooncake://h:1?metadata=ftp://x", "metadata"),
    ],
)
def test_bad_specs_name_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_spec(spec)


def test_sizes() -> None:
    assert (
        parse_size("4GB", "x") == 4 * 10**9
        and parse_size("64MiB", "x") == 64 << 20
        and parse_size(7, "x") == 7
    )


def test_regions_cover_only_inside_one_region() -> None:
    r = RegisteredRegions()
    assert r.add(1000, 100) and r.add(5000, 10)
    assert not r.add(1010, 10)  # already covered
    assert (
        r.covers(1000, 100)
        and r.covers(1050, 50)
        and not r.covers(1050, 51)
        and not r.covers(900, 10)
    )
    with pytest.raises(ValueError, match="overlaps"):
        r.add(1090, 20)
    with pytest.raises(ValueError, match="nbytes"):
        r.add(8000, 0)
    r.check_integrity()
    assert r.ranges() == [(1000, 100), (5000, 10)]


def test_address_of_read_only_and_typed_views() -> None:
    a = np.arange(8, dtype=np.float32)
    assert address_of(memoryview(a)) == a.ctypes.data
    assert address_of(memoryview(a.tobytes())) != 0
    with pytest.raises(ValueError, match="contiguous"):
        address_of(memoryview(a)[::2])


def test_chunks_respect_batch_and_staging() -> None:
    assert split_chunks([10] * 5, [False] * 5, batch=2, staging=0) == [
        range(2),
        range(2, 4),
        range(4, 5),
    ]
    assert split_chunks([10, 10, 10], [True, False, True], batch=8, staging=15) == [
        range(2),
        range(2, 3),
    ]
    with pytest.raises(ValueError, match="register the host pool"):
        split_chunks([100], [True], batch=8, staging=99)


class SliceStore:
    """A stand-in client keeping values in a dict and recording how many memory slices each
    value moved as (the real transfer engine sends every slice as its own request)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.slices: list[int] = []

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        for key, ps, ns in zip(keys, ptrs, sizes):
            self.values[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(ps, ns))
            self.slices.append(len(ps))
        return [0] * len(keys)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        codes = []
        for key, ps, ns in zip(keys, ptrs, sizes):
            value = self.values.get(key)
            self.slices.append(len(ps))
            if value is None or len(value) != sum(ns):
                codes.append(-704 if value is None else -1)
                continue
            pos = 0
            for p, n in zip(ps, ns):
                ctypes.memmove(p, value[pos : pos + n], n)
                pos += n
            codes.append(len(value))
        return codes

    def batch_remove(self, keys, force):
        for key in keys:
            self.values.pop(key, None)

    def get_size(self, key):
        return len(self.values.get(key, b"")) or -704


def roomy_pages(n: int, page: int, room: int, seed: int) -> tuple[np.ndarray, list[PagePieces]]:
    """`n` pages laid out as a host pool with header room lays them out."""
    buf = np.random.default_rng(seed).integers(0, 256, (n, room + page), dtype=np.uint8)
    return buf, [PagePieces([memoryview(row[room:])], room) for row in buf]


@pytest.mark.parametrize("room", [0, 512])
def test_pages_with_header_room_move_as_one_slice_in_the_same_format(room: int) -> None:
    page, n = 4096, 5
    arena = Arena(lanes=1, batch=n, staging=0)
    src, src_pages = roomy_pages(n, page, room, seed=1)
    dst, dst_pages = roomy_pages(n, page, room, seed=2)
    regions = RegisteredRegions()
    for a in (src, dst):
        regions.add(a.ctypes.data, a.nbytes)
    store = SliceStore()
    keys = [f"hicache:t:{i:064x}" for i in range(n)]
    assert put_chunk(store, arena.lanes[0], regions, keys, src_pages).done == n
    for key, row in zip(keys, src):  # exactly the framed value every backend stores
        payload = row[room:].tobytes()
        assert store.values[key] == framing.encode_header(key, [payload]) + payload
    got = get_chunk(store, arena.lanes[0], regions, keys, dst_pages)
    assert got.done == n and not got.corrupt
    np.testing.assert_array_equal(dst[:, room:], src[:, room:])
    assert store.slices == [1 if room else 2] * (2 * n)
    # A corrupted payload read through the room is still caught, and deleted.
    value = bytearray(store.values[keys[2]])
    value[-1] ^= 1
    store.values[keys[2]] = bytes(value)
    got = get_chunk(store, arena.lanes[0], regions, keys, dst_pages)
    assert (got.done, got.corrupt) == (2, [(keys[2], "checksum")]) and keys[2] not in store.values


def test_room_outside_registered_memory_falls_back_to_the_header_slot() -> None:
    page, room = 4096, 512
    arena = Arena(lanes=1, batch=2, staging=0)
    src, pages = roomy_pages(2, page, room, seed=3)
    regions = RegisteredRegions()
    regions.add(src.ctypes.data + room, src.nbytes - room)  # page 0's room is not registered
    store = SliceStore()
    keys = ["k0", "k1"]
    assert put_chunk(store, arena.lanes[0], regions, keys, pages).done == 2
    assert store.slices == [2, 1]
    assert (
        src[0, :room].tobytes()
        == np.random.default_rng(3)
        .integers(0, 256, (2, room + page), dtype=np.uint8)[0, :room]
        .tobytes()
    )


def test_a_store_with_no_space_is_full_once_not_an_error_per_page() -> None:
    # The backend's report of a put chunk, without a master: -200 (NO_AVAILABLE_HANDLE)
    # closes writes for a backoff with one event, and counts no error.
    import time

    from hicache.backends.fullness import WriteGate
    from hicache.backends.mooncake.backend import MooncakeBackend
    from hicache.backends.mooncake.io import ChunkResult

    seen: list[tuple[str, dict[str, object]]] = []
    backend = MooncakeBackend.__new__(MooncakeBackend)
    backend._stats = {"full": 0, "errors": 0, "corrupt": 0, "staged_pages": 0}
    backend._gate = WriteGate(time.monotonic)
    backend._emit = lambda name, **fields: seen.append((name, fields))
    for _ in range(2):  # two batches meet the full store
        result = ChunkResult()
        result.errors = [("k1", -200), ("k2", -200)]
        backend._report("set", result)
    assert [name for name, _ in seen] == ["storage.full"]
    assert backend._stats["full"] == 2 and backend._stats["errors"] == 0
    assert not backend.accepts_writes()
