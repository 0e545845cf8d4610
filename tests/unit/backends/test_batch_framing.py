"""A batch framed and unframed in one compiled call (file/native.py's frame_values and
unframe_values, used by the simple-store adapter) against framing.py's page-by-page Python: the
same values, the same results, the same reasons for a corrupt value."""

from __future__ import annotations

import itertools

import pytest

from hicache.backends import simple
from hicache.backends.batch import Counters
from hicache.backends.file.native import native_file_io, unavailable_reason
from hicache.backends.framing import FIXED_HEADER_SIZE, CorruptValue, encode_header

native = native_file_io()
needs_native = pytest.mark.skipif(native is None, reason=f"not built: {unavailable_reason()}")

KEY = "hicache:0123456789abcdef0123:" + "ab" * 32
PAYLOAD = bytes(range(256)) * 64 + b"tail"


def pieces_of(data: bytes, cuts: list[int], *, writable: bool = False) -> list[memoryview]:
    view = memoryview(bytearray(data) if writable else data)
    bounds = [0, *[c for c in cuts if c < len(data)], len(data)]
    return [view[a:b] for a, b in itertools.pairwise(bounds)]


def python_frame(key: str, pieces: list[memoryview]) -> bytes:
    return encode_header(key, pieces) + b"".join(pieces)


@needs_native
@pytest.mark.parametrize(
    "size, cuts",
    [(0, []), (1, []), (16384, []), (16384, [0, 100, 5000]), (300_000, [70_000, 70_001])],
)
def test_framed_values_are_framing_pys(size, cuts):
    data = (PAYLOAD * (size // len(PAYLOAD) + 1))[:size]
    keys = [KEY, "k", KEY.replace("ab", "cd")]
    pages = [pieces_of(data, cuts), pieces_of(data[::-1], cuts), []]
    assert native.frame_values(keys, pages) == [python_frame(k, p) for k, p in zip(keys, pages)]
    assert simple.frame_values(keys, pages) == [python_frame(k, p) for k, p in zip(keys, pages)]


@needs_native
def test_a_key_too_long_to_frame_is_the_same_error():
    key = "k" * 70_000
    with pytest.raises(ValueError, match="longer than 65535"):
        native.frame_values([key], [[memoryview(b"x")]])
    with pytest.raises(ValueError, match="longer than 65535"):
        python_frame(key, [memoryview(b"x")])


GOOD = python_frame(KEY, [memoryview(PAYLOAD)])
DAMAGE = {
    "good": GOOD,
    "absent": None,
    "empty": b"",
    "short": GOOD[:10],
    "in_key": GOOD[: FIXED_HEADER_SIZE + 3],
    "magic": b"XKV\0" + GOOD[4:],
    "version": GOOD[:4] + b"\x09\x00" + GOOD[6:],
    "other_key": python_frame(KEY.replace("ab", "ba"), [memoryview(PAYLOAD)]),
    "longer_key": python_frame(KEY + "x", [memoryview(PAYLOAD)]),
    "truncated": GOOD[:-1],
    "trailing": GOOD + b"!",
    "length": python_frame(KEY, [memoryview(PAYLOAD[:-5])]),
    "checksum": GOOD[:-1] + bytes([GOOD[-1] ^ 1]),
}


def same(a: object, b: object) -> bool:
    if isinstance(a, CorruptValue) or isinstance(b, CorruptValue):
        return type(a) is type(b) and str(a) == str(b) and a.reason == b.reason  # type: ignore[union-attr]
    return a == b


@needs_native
@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("cuts", [[], [7, 9000]])
@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_unframed_values_give_framing_pys_results(kind, cuts, wrap):
    blob = DAMAGE[kind]
    value = None if blob is None else wrap(blob)
    targets = [bytearray(len(PAYLOAD)), bytearray(len(PAYLOAD))]
    pages = [pieces_of(bytes(t), cuts, writable=True) for t in targets]
    (c_result,) = native.unframe_values([KEY], [value], [pages[0]])
    py_result = simple._unframe_result(KEY, value, pages[1])
    assert same(c_result, py_result), (c_result, py_result)
    if kind == "good":
        assert c_result == len(PAYLOAD)
        assert b"".join(pages[0]) == b"".join(pages[1]) == PAYLOAD
    elif kind != "absent":
        assert isinstance(c_result, CorruptValue)


@needs_native
def test_a_batch_unframes_each_value_on_its_own():
    kinds = ["good", "checksum", "absent", "other_key", "good"]
    pages = [[memoryview(bytearray(len(PAYLOAD)))] for _ in kinds]
    results = native.unframe_values([KEY] * len(kinds), [DAMAGE[k] for k in kinds], pages)
    assert [type(r).__name__ for r in results] == [
        "int",
        "CorruptValue",
        "NoneType",
        "CorruptValue",
        "int",
    ]
    assert bytes(pages[-1][0]) == PAYLOAD


@pytest.mark.parametrize("compiled", [True, False])
def test_the_adapters_unframing_counts_and_reports_alike(compiled, monkeypatch):
    if compiled and native is None:
        pytest.skip(f"not built: {unavailable_reason()}")
    if not compiled:
        monkeypatch.setattr(simple, "native_file_io", lambda: None)
    kinds = ["good", "checksum", "absent", "length", "good"]
    pages = [[memoryview(bytearray(len(PAYLOAD)))] for _ in kinds]
    events: list[tuple[str, dict[str, object]]] = []
    counters = Counters()
    oks, corrupt = simple.unframe_values(
        [KEY] * len(kinds),
        [DAMAGE[k] for k in kinds],
        pages,
        counters,
        lambda name, **fields: events.append((name, fields)),
    )
    assert oks == [True, False, False, False, True]
    assert corrupt == [KEY, KEY]
    assert counters.bytes_read == 2 * len(PAYLOAD) and counters.corrupt == 2
    assert [f["reason"] for _, f in events] == ["checksum", "length"]
    assert bytes(pages[0][0]) == bytes(pages[-1][0]) == PAYLOAD


def test_framing_without_the_compiled_module_is_the_same(monkeypatch):
    keys = [KEY, "k"]
    pages = [pieces_of(PAYLOAD, [3]), pieces_of(b"", [])]
    monkeypatch.setattr(simple, "native_file_io", lambda: None)
    assert simple.frame_values(keys, pages) == [python_frame(k, p) for k, p in zip(keys, pages)]
