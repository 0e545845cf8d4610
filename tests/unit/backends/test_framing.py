from __future__ import annotations

import pytest

from hicache.backends.framing import (
    FIXED_HEADER_SIZE,
    CorruptValue,
    decode_header,
    encode_header,
    header_size,
    verify_payload,
)


def test_round_trip_over_pieces():
    pieces = [b"abc", memoryview(b"defg"), b""]
    head = encode_header("k1", pieces)
    assert len(head) == header_size("k1") == FIXED_HEADER_SIZE + 2
    h = decode_header(head + b"abcdefg", "k1")
    assert (h.key, h.payload_len, h.size) == ("k1", 7, len(head))
    verify_payload(h, [b"abcdefg"])  # pieces split differently: same checksum


@pytest.mark.parametrize(
    "mutate, key, reason",
    [
        (lambda v: v[:10], "k1", "truncated"),
        (lambda v: v[: FIXED_HEADER_SIZE + 1], "k1", "truncated"),
        (lambda v: b"XKV\0" + v[4:], "k1", "magic"),
        (lambda v: v[:4] + b"\x09\x00" + v[6:], "k1", "version"),
        (lambda v: v, "k2", "key"),
    ],
)
def test_header_faults(mutate, key, reason):
    value = encode_header("k1", [b"payload"]) + b"payload"
    with pytest.raises(CorruptValue) as err:
        decode_header(mutate(value), key)
    assert err.value.reason == reason


def test_payload_faults():
    h = decode_header(encode_header("k", [b"payload"]), "k")
    with pytest.raises(CorruptValue) as err:
        verify_payload(h, [b"paylo"])
    assert err.value.reason == "length"
    with pytest.raises(CorruptValue) as err:
        verify_payload(h, [b"pAyload"])
    assert err.value.reason == "checksum"


def test_checksum_continues_and_matches_zlib():
    import zlib

    from hicache.backends.framing import checksum

    data = bytes(range(256)) * 1000
    assert checksum([data]) == zlib.crc32(data)
    assert checksum([data[5000:]], checksum([data[:5000]])) == zlib.crc32(data)


def test_chunks_regroup_without_copying():
    from hicache.backends.file.io import _chunks

    buf = bytearray(range(250))
    pieces = [memoryview(buf)[0:100], memoryview(buf)[100:130], memoryview(buf)[130:250]]
    runs = _chunks(pieces, size=64)
    assert all(sum(v.nbytes for v in run) <= 64 for run in runs)
    assert [sum(v.nbytes for v in run) for run in runs][:-1] == [64] * (len(runs) - 1)
    assert b"".join(bytes(v) for run in runs for v in run) == bytes(buf)
    runs[0][0][0] = 255  # a view into the original, not a copy
    assert buf[0] == 255


@pytest.mark.parametrize("sizes", [[], [7], [3 << 20, 1, 0, 2 << 20, 5 << 20], [1 << 20] * 9])
def test_checksums_of_a_batch_match_one_by_one(sizes, monkeypatch):
    """Large batches are split over threads; every value's checksum and their order must be
    what the single-threaded `checksum` gives, whatever the split."""
    import numpy as np

    from hicache.backends import batch_checksums, framing

    monkeypatch.setattr(
        batch_checksums, "CHECKSUM_THREADS", 3
    )  # more parts than this machine's cores
    rng = np.random.default_rng(len(sizes))
    values = [[memoryview(rng.integers(0, 256, n, dtype=np.uint8)), b"tail"] for n in sizes]
    assert batch_checksums.checksums(values) == [framing.checksum(v) for v in values]
    assert len({framing.checksum(v) for v in values}) == len(
        values
    )  # distinct data: a swap would show


def test_checksums_started_match_checksums_in_order():
    """The checksums a writer starts before its transfer are each value's, in order."""
    import numpy as np

    from hicache.backends import batch_checksums, framing

    rng = np.random.default_rng(5)
    values = [[memoryview(rng.integers(0, 256, n, dtype=np.uint8)), b"x"] for n in (9, 1 << 20, 0)]
    started = batch_checksums.checksums_started(values)
    assert started.result() == [framing.checksum(v) for v in values]
    assert batch_checksums.checksums_started([]).result() == []


def test_verify_payload_uses_a_given_checksum():
    h = decode_header(encode_header("k", [b"payload"]), "k")
    from hicache.backends.framing import checksum

    verify_payload(h, [b"payload"], checksum([b"payload"]))
    with pytest.raises(CorruptValue) as err:
        verify_payload(h, [b"payload"], checksum([b"pAyload"]))
    assert err.value.reason == "checksum"


def _batch() -> list[list[object]]:
    import numpy as np

    rng = np.random.default_rng(31)
    data = rng.integers(0, 256, (5 << 20) + 3, dtype=np.uint8).tobytes()
    return [[], [b""], [data[:9]], [memoryview(data)[:4097], data[4097:]], [bytearray(data[:1])]]


def test_checksums_without_the_compiled_module_use_the_per_piece_crc(monkeypatch):
    """Where file/native.py cannot build, batches go through ISA-L (or zlib) piece by piece,
    with the same results."""
    import zlib

    from hicache.backends import batch_checksums, framing
    from hicache.backends.file import native

    monkeypatch.setattr(native, "native_file_io", lambda: None)
    assert batch_checksums.native_checksums() is None
    calls = []

    def counted(piece: object, crc: int) -> int:
        calls.append(piece)
        return zlib.crc32(piece, crc)  # type: ignore[arg-type]

    monkeypatch.setattr(framing, "_crc32", counted)
    values = _batch()
    expected = [zlib.crc32(b"".join(bytes(p) for p in v)) for v in values]
    assert batch_checksums.checksums(values) == expected
    assert batch_checksums.checksums_started(values).result() == expected
    assert len(calls) == 2 * sum(len(v) for v in values)  # every piece, both times


def test_checksums_with_the_compiled_module_match_the_per_piece_crc(monkeypatch):
    """Where it builds, a batch is one compiled call (no per-piece call), same results."""
    import zlib

    from hicache.backends import batch_checksums, framing
    from hicache.backends.file.native import native_file_io, unavailable_reason

    if native_file_io() is None:
        pytest.skip(f"compiled file I/O not built: {unavailable_reason()}")
    assert batch_checksums.native_checksums() is not None
    monkeypatch.setattr(framing, "_crc32", None)  # a per-piece call would fail
    values = _batch()
    expected = [zlib.crc32(b"".join(bytes(p) for p in v)) for v in values]
    assert batch_checksums.checksums(values) == expected
    assert batch_checksums.checksums_started(values).result() == expected


_FALLBACK_PROBE = """
import zlib
from hicache.backends import batch_checksums
from hicache.backends.file.native import unavailable_reason
values = [[b"ab", b"", bytes(range(256)) * 99], [], [b"x" * 4097]]
print("native:", batch_checksums.native_checksums(), unavailable_reason())
print("same:", batch_checksums.checksums(values) == [zlib.crc32(b"".join(v)) for v in values])
"""


def test_checksums_fall_back_when_native_code_is_turned_off(tmp_path):
    """`HICACHE_NATIVE=0`: nothing is built, and batches checksum as before."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={
            **os.environ,
            "PYTHONPATH": root,
            "HICACHE_NATIVE": "0",
            "HICACHE_CACHE_DIR": str(tmp_path),
        },
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "native: None disabled by HICACHE_NATIVE" in done.stdout
    assert "same: True" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing built
