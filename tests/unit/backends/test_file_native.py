"""The compiled file-store loops (backends/file/native.py) against backends/file/io.py's Python
loops: for every case each way gets the same file state, and must give the same result and leave
the same files (bytes, timestamps)."""

from __future__ import annotations

import itertools
import math
import os
import random
import shutil
import struct
import sys
import threading
import time
import zlib

import pytest

from hicache.backends.file import io as file_io
from hicache.backends.file.index import expiry_to_atime_ns
from hicache.backends.file.native import expire_le, native_file_io, unavailable_reason
from hicache.backends.framing import FIXED_HEADER_SIZE, CorruptValue

native = native_file_io()
needs_native = pytest.mark.skipif(native is None, reason=f"not built: {unavailable_reason()}")

KEY = "hicache:0123456789abcdef0123:" + "ab" * 32
NS = 1_000_000_000
TIMES = (1_700_000_000_123_456_789, 1_700_000_001_000_000_000)


def pieces_of(data: bytes, cuts: list[int]) -> list[memoryview]:
    view = memoryview(bytearray(data))
    bounds = [0, *cuts, len(data)]
    return [view[a:b] for a, b in itertools.pairwise(bounds)]


def same(a: object, b: object) -> bool:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


def snapshot(root: str) -> dict[str, tuple[bytes, int, int]]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (f.read(), st.st_atime_ns, st.st_mtime_ns)
    return out


@needs_native
@pytest.mark.parametrize(
    "size, cuts",
    [(0, []), (1, []), (16384, []), (16384, [100, 5000]), (3 << 20, [1 << 20, 2 << 20, 2 << 20])],
)
@pytest.mark.parametrize("fsync", [False, True])
def test_writes_leave_the_same_files(tmp_path, size, cuts, fsync):
    data = random.Random(size).randbytes(size)
    results = []
    for way in ("py", "c"):
        root = str(tmp_path / way)
        os.makedirs(os.path.join(root, "tmp"))
        job = (
            KEY,
            f"{root}/ab/a/{KEY[-64:]}",
            f"{root}/tmp/x.tmp",
            pieces_of(data, cuts),
            fsync,
            TIMES,
        )
        results.append(file_io.write_value(job) if way == "py" else native.write_values([job])[0])
    assert results[0] == results[1] == (len(KEY) + FIXED_HEADER_SIZE + size, size)
    assert snapshot(str(tmp_path / "py")) == snapshot(str(tmp_path / "c"))


@needs_native
@pytest.mark.parametrize("damage", ["tmp_gone", "namespace_gone", "tmp_is_file", "path_is_dir"])
def test_write_failures_and_healing_match(tmp_path, damage):
    data = b"x" * 1000
    results = []
    for way in ("py", "c"):
        root = str(tmp_path / way)
        os.makedirs(os.path.join(root, "ns", "tmp"))
        path = f"{root}/ns/ab/a/{KEY[-64:]}"
        if damage == "tmp_gone":
            shutil.rmtree(os.path.join(root, "ns", "tmp"))
        elif damage == "namespace_gone":
            shutil.rmtree(os.path.join(root, "ns"))
        elif damage == "tmp_is_file":
            os.rmdir(os.path.join(root, "ns", "tmp"))
            open(os.path.join(root, "ns", "tmp"), "w").close()
        elif damage == "path_is_dir":
            os.makedirs(os.path.join(path, "child"))
        job = (KEY, path, f"{root}/ns/tmp/x.tmp", [memoryview(data)], False, TIMES)
        results.append(file_io.write_value(job) if way == "py" else native.write_values([job])[0])
    py, c = results
    assert type(py) is type(c)
    if isinstance(py, OSError):
        assert isinstance(c, OSError) and py.errno == c.errno
        names = [
            [
                None if f is None else os.path.relpath(f, tmp_path / way)
                for f in (e.filename, e.filename2)
            ]
            for e, way in ((py, "py"), (c, "c"))
        ]
        assert names[0] == names[1]  # the same paths named
    assert snapshot(str(tmp_path / "py")).keys() == snapshot(str(tmp_path / "c")).keys()


def write_raw(path: str, blob: bytes, atime_ns: int = TIMES[0], mtime_ns: int = TIMES[1]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(blob)
    os.utime(path, ns=(atime_ns, mtime_ns))


def value(payload: bytes, key: str = KEY) -> bytes:
    from hicache.backends.framing import checksum, pack_header

    return pack_header(key, len(payload), checksum([payload])) + payload


PAYLOAD = bytes(range(256)) * 64  # 16 KiB


def damaged(kind: str) -> bytes | None:
    good = value(PAYLOAD)
    return {
        "good": good,
        "absent": None,
        "short": good[:10],
        "in_key": good[: FIXED_HEADER_SIZE + 5],
        "truncated": good[:-100],
        "trailing": good + b"extra",
        "magic": b"XKV\0" + good[4:],
        "version": good[:4] + struct.pack("<H", 9) + good[6:],
        "other_key": value(PAYLOAD, KEY[:-1] + "c"),
        "longer_key": value(PAYLOAD, KEY + "0"),
        "length": value(PAYLOAD[:-64]),
        "checksum": good[:-1] + bytes([good[-1] ^ 1]),
        "empty": b"",
        "big": value(PAYLOAD * 64),
    }[kind]


KINDS = [
    "good",
    "absent",
    "short",
    "in_key",
    "truncated",
    "trailing",
    "magic",
    "version",
    "other_key",
    "longer_key",
    "length",
    "checksum",
    "empty",
    "big",
]


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cuts", [[], [7, 9000]])
def test_reads_give_the_same_result_and_files(tmp_path, kind, cuts):
    blob = damaged(kind)
    results, outs = [], []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        os.makedirs(os.path.dirname(path))
        if blob is not None:
            write_raw(path, blob)
        size = len(PAYLOAD) * (64 if kind == "big" else 1)
        target = bytearray(size)
        job = (
            KEY,
            path,
            [memoryview(target)[a:b] for a, b in _bounds(size, cuts)],
            5.0,
            6_000_000_000,
        )
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
        outs.append(bytes(target))
    assert same(results[0], results[1]), results
    if isinstance(results[0], CorruptValue):
        assert results[0].reason == results[1].reason
    if isinstance(results[0], file_io.Read):
        assert outs[0] == outs[1]
    assert snapshot(str(tmp_path / "py")) == snapshot(str(tmp_path / "c"))


def _bounds(size: int, cuts: list[int]) -> list[tuple[int, int]]:
    cuts = [c for c in cuts if c < size]
    edges = [0, *cuts, size]
    return list(itertools.pairwise(edges))


@needs_native
def test_a_directory_in_place_of_a_value_is_the_same_error(tmp_path):
    results = []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        os.makedirs(path)
        job = (KEY, path, [memoryview(bytearray(64))], 5.0, 6_000_000_000)
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
    assert isinstance(results[0], OSError) and type(results[0]) is type(results[1])
    assert results[0].errno == results[1].errno


@needs_native
@pytest.mark.parametrize("deadline, now", [(10.0, 9.999), (10.0, 10.0), (10.0, 10.001)])
def test_expiry_is_decided_alike(tmp_path, deadline, now):
    results = []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        write_raw(path, value(PAYLOAD), atime_ns=expiry_to_atime_ns(deadline), mtime_ns=NS)
        job = (KEY, path, [memoryview(bytearray(len(PAYLOAD)))], now, 6_000_000_000)
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
        assert file_io.count_present([path], now) == native.count_present([path], now)
    assert same(results[0], results[1])
    assert isinstance(results[0], file_io.Expired) == (deadline <= now)
    assert snapshot(str(tmp_path / "py")).keys() == snapshot(str(tmp_path / "c")).keys()


@needs_native
def test_count_present_stops_at_the_first_absent_or_expired(tmp_path):
    paths = [str(tmp_path / f"v{i}") for i in range(6)]
    for i, path in enumerate(paths):
        if i != 4:
            atime = expiry_to_atime_ns(5.0) if i == 3 else TIMES[0]
            write_raw(path, b"x", atime_ns=atime, mtime_ns=NS if i == 3 else TIMES[1])
    for now, present in ((1.0, 4), (5.0, 3), (6.0, 3)):
        assert native.count_present(paths, now) == file_io.count_present(paths, now) == present


def test_expire_le_is_the_boundary_python_uses():
    rng = random.Random(7)
    for now in [0.0, 1.0, 10.0, 1e-9, 1_700_000_000.5, 1_764_000_000.123456] + [
        rng.uniform(0, 2e9) for _ in range(200)
    ]:
        limit = expire_le(now)
        assert limit / 10**9 <= now < (limit + 1) / 10**9
    with pytest.raises(ValueError):
        expire_le(math.nan)


@needs_native
def test_an_open_error_names_the_file_alike(tmp_path):
    results = []
    for way in ("py", "c"):
        parent = tmp_path / way
        parent.mkdir()
        (parent / "file").write_bytes(b"x")
        path = str(parent / "file" / "v")  # a path through a file: open fails, ENOTDIR
        job = (KEY, path, [memoryview(bytearray(64))], 5.0, 6_000_000_000)
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
    py, c = results
    assert isinstance(py, NotADirectoryError) and type(c) is type(py)
    assert (py.errno, py.filename) == (c.errno, str(tmp_path / "py" / "file" / "v"))
    assert c.filename == str(tmp_path / "c" / "file" / "v")


def _crc_batches() -> list[list[list[object]]]:
    rng = random.Random(31)
    big = rng.randbytes((5 << 20) + 3)
    return [
        [],  # no values
        [[]],  # a value of no pieces
        [[b""], [b"", b""]],  # empty pieces
        [[b"a"]],  # one byte, one piece
        [[rng.randbytes(n)] for n in (7, 8, 9, 63, 4095, 4097)],  # sizes off a multiple of 8
        [pieces_of(rng.randbytes(10_007), [1, 13, 13, 4096, 9999])],  # several, one empty
        [[memoryview(big)], pieces_of(big, [1 << 20, (3 << 20) + 1]), [big[:-1], big[-1:]]],
        [[bytearray(b"xy"), memoryview(b"z"), b"w" * 17] for _ in range(100)],  # many, mixed types
    ]


@needs_native
@pytest.mark.parametrize("batch", _crc_batches())
def test_batch_checksums_are_zlibs(batch):
    """Each value's CRC-32 is zlib's over its pieces joined, in order, whatever the pieces."""
    expected = [zlib.crc32(b"".join(bytes(p) for p in value)) for value in batch]
    assert native.checksums(batch) == expected
    if len(batch) > 1:  # a batch checksums as its values one by one
        assert [native.checksums([v])[0] for v in batch] == expected


@needs_native
def test_batch_checksums_reject_what_is_not_a_buffer():
    """A bad value is a clear error, and the buffers taken before it are let go (the bytearray
    can be resized again afterwards)."""
    held = bytearray(b"abc")
    with pytest.raises(TypeError):
        native.checksums([[held], ["not bytes"]])
    with pytest.raises(TypeError):
        native.checksums([[held], 5])
    held.extend(b"d")  # BufferError if a view had leaked
    assert native.checksums([[held]]) == [zlib.crc32(b"abcd")]


@needs_native
def test_batch_checksums_run_without_the_gil():
    """Another Python thread runs while a large batch is checksummed (the GIL is released for
    the batch, not taken back between pieces): a counter thread makes progress meanwhile."""
    data = memoryview(bytes(64 << 20))
    values = [[data[i : i + 4096] for i in range(0, len(data), 4096)]] * 4  # 256 MiB
    progress = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            progress.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # the GIL is not handed over on a timer during the batch
    try:
        counter = threading.Thread(target=count)
        counter.start()
        while not progress:  # the counter holds the GIL in its loop now
            time.sleep(0)
        seen = len(progress)
        native.checksums(values)
        during = len(progress) - seen
        stop.set()
        counter.join()
    finally:
        sys.setswitchinterval(interval)
    assert during > 0


@needs_native
@pytest.mark.parametrize("batch", _crc_batches())
def test_started_batch_checksums_are_zlibs(batch):
    """The same checksums computed on the module's own thread."""
    expected = [zlib.crc32(b"".join(bytes(p) for p in value)) for value in batch]
    started = native.checksums_started(batch)
    assert started.result() == expected
    assert started.result() == expected  # asked again: the same, nothing held any more


@needs_native
def test_started_batch_checksums_hold_the_buffers_until_done():
    """The values' buffers are held while the thread may read them and let go at `result`, or
    when the job is dropped without one."""
    held = bytearray(3 << 20)
    started = native.checksums_started([[held], [memoryview(held)[:5]]])
    with pytest.raises(BufferError):
        held.extend(b"x")  # the job still holds a view
    assert started.result() == [zlib.crc32(bytes(3 << 20)), zlib.crc32(bytes(5))]
    held.extend(b"x")
    dropped = native.checksums_started([[held]])
    del dropped  # its thread is waited for, then its views let go
    held.extend(b"y")
    with pytest.raises(TypeError):
        native.checksums_started([[held], [object()]])
    held.extend(b"z")  # a failed start let go of what it had taken


@needs_native
@pytest.mark.parametrize("marked", [False, True])
@pytest.mark.parametrize("later", [False, True])
def test_a_mark_is_a_deadline_only_after_mtime_alike(tmp_path, marked, later):
    """An atime on the mark at or before mtime (the kernel's times for a value written without
    a ttl) is no deadline; one after mtime is."""
    mtime = 100 * NS
    atime = expiry_to_atime_ns(50.0) + (200 * NS if later else 0)
    if not marked:
        atime += 1
    results = []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        write_raw(path, value(PAYLOAD), atime_ns=atime, mtime_ns=mtime)
        assert file_io.count_present([path], 1e9) == native.count_present([path], 1e9)
        job = (KEY, path, [memoryview(bytearray(len(PAYLOAD)))], 1e9, 6_000_000_000)
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
    assert same(results[0], results[1])
    assert isinstance(results[0], file_io.Expired) == (marked and later)


@needs_native
@pytest.mark.parametrize("touch_before", [TIMES[1], TIMES[1] + 1, None])
def test_a_read_touches_mtime_only_when_older_than_asked_alike(tmp_path, touch_before):
    results = []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        write_raw(path, value(PAYLOAD))
        job: tuple[object, ...] = (KEY, path, [memoryview(bytearray(len(PAYLOAD)))], 5.0, 6 * NS)
        if touch_before is not None:
            job = (*job, touch_before)
        results.append(file_io.read_value(job) if way == "py" else native.read_values([job])[0])
        touched = os.stat(path).st_mtime_ns == 6 * NS
        assert touched == (touch_before is None or TIMES[1] < touch_before)
        assert os.stat(path).st_atime_ns == TIMES[0]
    assert same(results[0], results[1])
    assert snapshot(str(tmp_path / "py")) == snapshot(str(tmp_path / "c"))


@needs_native
def test_a_write_without_times_keeps_the_kernels_alike(tmp_path):
    results = []
    for way in ("py", "c"):
        path = str(tmp_path / way / "v")
        os.makedirs(os.path.dirname(path))
        job = (KEY, path, path + ".tmp", [memoryview(PAYLOAD)], False, None)
        before = time.time_ns()
        results.append(file_io.write_value(job) if way == "py" else native.write_values([job])[0])
        st = os.stat(path)
        assert st.st_atime_ns <= st.st_mtime_ns  # so never a deadline, whatever its tail
        assert abs(st.st_mtime_ns - before) < 10 * NS
        with open(path, "rb") as f:
            assert f.read() == value(PAYLOAD)
    assert results[0] == results[1]
