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

    from hicache.backends import framing

    monkeypatch.setattr(framing, "CHECKSUM_THREADS", 3)  # more parts than this machine's cores
    rng = np.random.default_rng(len(sizes))
    values = [[memoryview(rng.integers(0, 256, n, dtype=np.uint8)), b"tail"] for n in sizes]
    assert framing.checksums(values) == [framing.checksum(v) for v in values]
    assert len({framing.checksum(v) for v in values}) == len(
        values
    )  # distinct data: a swap would show


def test_checksums_started_match_checksums_in_order():
    """The checksums a writer starts before its transfer are each value's, in order."""
    import numpy as np

    from hicache.backends import framing

    rng = np.random.default_rng(5)
    values = [[memoryview(rng.integers(0, 256, n, dtype=np.uint8)), b"x"] for n in (9, 1 << 20, 0)]
    started = framing.checksums_started(values)
    assert started.result(timeout=30) == [framing.checksum(v) for v in values]
    assert framing.checksums_started([]).result(timeout=30) == []


def test_verify_payload_uses_a_given_checksum():
    h = decode_header(encode_header("k", [b"payload"]), "k")
    from hicache.backends.framing import checksum

    verify_payload(h, [b"payload"], checksum([b"payload"]))
    with pytest.raises(CorruptValue) as err:
        verify_payload(h, [b"payload"], checksum([b"pAyload"]))
    assert err.value.reason == "checksum"
