"""The in-place RESP reply reader (redis/direct.py's `_Replies`), fed byte streams cut at arbitrary
points, with no server: replies in order, page bodies landing in their pieces, wrong-length
values drained without touching the page, and protocol surprises aborting the connection."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from hicache.backends.framing import CorruptValue, encode_header, header_size
from hicache.backends.redis.direct import Landed, ProtocolFailure, Target, WrongLength, _Replies
from hicache.backends.redis.values import explain_wrong_length, verify_landed


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def replies(transport) -> _Replies:
    replies = _Replies()
    replies.connection_made(transport)
    return replies


def feed(replies: _Replies, stream: bytes, cuts: list[int]) -> None:
    """Deliver `stream` through get_buffer/buffer_updated, in pieces ending at `cuts`, each
    piece further limited by the buffer the reader offers (as a socket's recv_into is)."""
    position = 0
    for end in [*cuts, len(stream)]:
        while position < end:
            buffer = replies.get_buffer(-1)
            n = min(len(buffer), end - position)
            assert n > 0
            buffer[:n] = stream[position : position + n]
            replies.buffer_updated(n)
            position += n


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


KEY = "hicache:test:" + "ab" * 32


def framed(payload: bytes, key: str = KEY) -> bytes:
    return encode_header(key, [memoryview(payload)]) + payload


@pytest.mark.parametrize("seed", range(40))
def test_mixed_replies_survive_any_cutting(seed, loop, replies, transport):
    rng = np.random.default_rng(seed)
    size = int(rng.choice([0, 1, 7, 100, 5000, 70000]))
    payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    split = int(rng.integers(0, size + 1))
    pieces = [memoryview(bytearray(split)), memoryview(bytearray(size - split))]
    untouched = memoryview(bytearray(b"\x55" * size))
    target = Target(header_size(KEY), pieces)
    other = Target(header_size(KEY), [untouched])
    foreign = framed(payload + b"extra")  # a sound value of another length
    stream = (
        b"+OK\r\n"
        b"-WRONGTYPE nope\r\n"
        b":42\r\n"
        b"$-1\r\n" + bulk(framed(payload)) + bulk(foreign) + bulk(b"plain value") + bulk(b"")
    )
    cuts = sorted(set(rng.integers(0, len(stream), int(rng.integers(0, 30))).tolist()))
    done = replies.expect([None, None, None, other, target, other, None, other], loop)
    feed(replies, stream, cuts)
    assert done.done()
    ok, wrongtype, number, absent, landed, drained, plain, empty = done.result()
    assert (ok, number, absent, plain) == ("OK", 42, None, b"plain value")
    assert isinstance(wrongtype, ResponseError) and str(wrongtype).startswith("WRONGTYPE")
    assert isinstance(landed, Landed) and bytes(pieces[0]) + bytes(pieces[1]) == payload
    assert verify_landed(KEY, landed.header, pieces) == size
    assert isinstance(drained, WrongLength) and drained.length == len(foreign)
    assert drained.prefix == foreign[: header_size(KEY)]
    assert explain_wrong_length(KEY, drained.prefix, drained.length, size).reason == "length"
    assert empty == WrongLength(0, b"")
    assert bytes(untouched) == b"\x55" * size  # wrong-length values never reach the page
    assert not transport.aborted


def test_a_damaged_body_is_caught_by_verification(loop, replies):
    payload = bytes(range(256)) * 8
    value = bytearray(framed(payload))
    value[-3] ^= 0xFF  # same length, one flipped byte
    page = memoryview(bytearray(len(payload)))
    done = replies.expect([Target(header_size(KEY), [page])], loop)
    feed(replies, bulk(bytes(value)), [])
    (landed,) = done.result()
    with pytest.raises(CorruptValue) as error:
        verify_landed(KEY, landed.header, [page])
    assert error.value.reason == "checksum"
    with pytest.raises(CorruptValue) as error:  # read under another key
        verify_landed(KEY[:-1] + "x", landed.header, [page])
    assert error.value.reason == "key"


def test_truncated_and_foreign_values_are_explained():
    payload = b"x" * 100
    value = framed(payload)
    assert (
        explain_wrong_length(KEY, value[: header_size(KEY)], len(value) - 10, 100).reason
        == "truncated"
    )
    assert explain_wrong_length(KEY, b"not a header at all" * 10, 500, 100).reason == "magic"
    assert explain_wrong_length(KEY, b"short", 5, 100).reason == "truncated"


@pytest.mark.parametrize(
    "stream", [b"*1\r\n:1\r\n", b"$3\r\nabcXY", b"%1\r\n", b"$x3\r\n", b":one\r\n"]
)
def test_protocol_surprises_abort_the_connection(stream, loop, replies, transport):
    page = memoryview(bytearray(3))
    done = replies.expect([Target(0, [page])], loop)
    feed(replies, stream, [])
    assert transport.aborted
    with pytest.raises(ProtocolFailure):
        done.result()


def test_replies_nobody_asked_for_abort_the_connection(loop, replies, transport):
    done = replies.expect([None], loop)
    feed(replies, b"+OK\r\n+SURPRISE\r\n", [])
    assert done.result() == ["OK"] and transport.aborted


def test_a_connection_lost_mid_body_stops_writing_into_the_page(loop, replies):
    payload = b"p" * 1000
    page = memoryview(bytearray(1000))
    done = replies.expect([Target(header_size(KEY), [page])], loop)
    stream = bulk(framed(payload))
    feed(replies, stream[: len(stream) // 2], [])
    assert replies.get_buffer(-1).obj is page.obj  # the page is the receive buffer now
    replies.connection_lost(ConnectionResetError("reset"))
    assert replies.get_buffer(-1).obj is not page.obj  # and no longer
    with pytest.raises(RedisConnectionError, match="reset"):
        done.result()
    with pytest.raises(RedisConnectionError):
        replies.expect([None], loop)


def test_error_replies_keep_redis_py_exception_classes():
    from redis.exceptions import OutOfMemoryError

    from hicache.backends.redis.direct import error_reply

    assert isinstance(
        error_reply("OOM command not allowed when used memory > 'maxmemory'."), OutOfMemoryError
    )
    plain = error_reply("ERR unknown command")
    assert isinstance(plain, ResponseError) and "unknown command" in str(plain)
