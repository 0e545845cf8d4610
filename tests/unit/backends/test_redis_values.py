"""Framed page values (redis/values.py) and the RESP packing that writes them (redis/wire.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.backends.framing import CorruptValue, encode_header
from hicache.backends.redis.values import byte_views, read_value_into
from hicache.backends.redis.wire import Parts, joined, pack

KEY = "hicache:ns:" + "ab" * 32


def encode_value(key: str, pieces: list[memoryview]) -> bytes:
    """A stored value as the backend writes it (header, then the pieces), joined in one bytes."""
    return b"".join([encode_header(key, pieces), *pieces])


def _pieces(sizes: list[int], seed: int = 0) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 600_000), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_round_trip_into_differently_cut_pieces(sizes, seed):
    source = _pieces(sizes, seed)
    value = encode_value(KEY, source)
    payload = b"".join(bytes(p) for p in source)
    # Read into pieces cut elsewhere: only the total length has to match.
    cut = len(payload) // 3
    target = [memoryview(bytearray(cut)), memoryview(bytearray(len(payload) - cut))]
    assert read_value_into(KEY, value, target) == len(payload)
    assert b"".join(bytes(t) for t in target) == payload


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda v: v[:-1], "truncated"),
        (lambda v: v + b"x", "truncated"),
        (lambda v: b"XXXX" + v[4:], "magic"),
        (lambda v: v[:4] + b"\x09\x00" + v[6:], "version"),
        (lambda v: v[:10], "truncated"),
        (lambda v: v[:-5] + bytes([v[-5] ^ 1]) + v[-4:], "checksum"),
    ],
)
def test_damaged_values_raise_with_their_reason(damage, reason):
    value = encode_value(KEY, _pieces([1000, 24]))
    target = [memoryview(bytearray(1024))]
    with pytest.raises(CorruptValue) as raised:
        read_value_into(KEY, damage(value), target)
    assert raised.value.reason == reason


def test_value_of_another_key_or_another_page_size_is_refused():
    value = encode_value(KEY, _pieces([64]))
    with pytest.raises(CorruptValue) as other_key:
        read_value_into(KEY[:-1] + "0", value, [memoryview(bytearray(64))])
    assert other_key.value.reason == "key"
    with pytest.raises(CorruptValue) as other_size:
        read_value_into(KEY, value, [memoryview(bytearray(65))])
    assert other_size.value.reason == "length"


def test_byte_views_flatten_typed_arrays_and_refuse_bad_pieces():
    floats = np.zeros((2, 3), dtype=np.float32)
    (view,) = byte_views([memoryview(floats)], writable=True, what="t")
    assert (view.format, view.ndim, view.nbytes) == ("B", 1, 24)
    with pytest.raises(ValueError, match="piece 0 is read-only"):
        byte_views([memoryview(b"abc")], writable=True, what="t")
    with pytest.raises(ValueError, match="piece 1 is not C-contiguous"):
        byte_views(
            [memoryview(b"ok"), memoryview(np.zeros((4, 4))[:, 1])], writable=False, what="t"
        )


def test_pack_is_resp_and_keeps_parts_unjoined():
    page = memoryview(os.urandom(100))
    header = encode_header("k", [page])
    out = pack([("SET", "k", Parts((header, page)), "PX", 5000), ("GET", "k")])
    assert any(piece is page for piece in out)  # the page itself goes to the transport
    wire = b"".join(bytes(p) for p in out)
    value = header + bytes(page)
    expected = (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n$2\r\nPX\r\n$4\r\n5000\r\n"
        % (len(value), value)
        + b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    )
    assert wire == expected
    assert joined(Parts((b"ab", memoryview(b"cd")))) == b"abcd"
    assert joined(b"xy") == b"xy"
