"""Page values as stored in Redis: the framing header followed by the page's pieces.

Pure functions over buffers, no I/O. Reading verifies and copies in one pass, chunk by chunk,
so a chunk is checksummed and copied while it is still in cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.backends.base import PageBuffer
from hicache.backends.framing import (
    CorruptValue,
    checksum,
    decode_header,
    verify_payload,
)

_CHUNK = 256 * 1024  # bytes checksummed then copied at a time; fits in L2


def byte_views(page: PageBuffer, *, writable: bool, what: str) -> list[memoryview]:
    """The page's pieces as flat unsigned-byte views (no copy). Raises ValueError for a piece
    that is not contiguous, or read-only where `writable`."""
    views = []
    for index, piece in enumerate(page):
        view = memoryview(piece)
        if not view.c_contiguous:
            raise ValueError(f"{what}: piece {index} is not C-contiguous")
        if writable and view.readonly:
            raise ValueError(f"{what}: piece {index} is read-only")
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def read_value_into(key: str, value: bytes | memoryview, pieces: Sequence[memoryview]) -> int:
    """Verify `value` (as read under `key`) and copy its payload into `pieces`; return the
    payload size. Raises CorruptValue; the pieces may then hold part of the value."""
    header = decode_header(value, key)
    payload = memoryview(value)[header.size :]
    wanted = sum(piece.nbytes for piece in pieces)
    if payload.nbytes != header.payload_len:
        raise CorruptValue(
            "truncated", f"{payload.nbytes} payload bytes, header says {header.payload_len}"
        )
    if header.payload_len != wanted:
        raise CorruptValue("length", f"value of {header.payload_len} bytes, page is {wanted}")
    crc = 0
    offset = 0
    for piece in pieces:
        for start in range(0, piece.nbytes, _CHUNK):
            end = min(start + _CHUNK, piece.nbytes)
            src = payload[offset + start : offset + end]
            crc = checksum((src,), crc)
            piece[start:end] = src
        offset += piece.nbytes
    if crc != header.crc32:
        raise CorruptValue("checksum", f"checksum mismatch for {key!r}")
    return wanted


def verify_landed(key: str, header: bytes, pieces: Sequence[memoryview]) -> int:
    """Verify a value received in place: `header` is its first bytes, the payload already lies
    in `pieces` (whose total length matched the value's). Returns the payload size. Raises
    CorruptValue; the pieces then hold a value that must not be used."""
    parsed = decode_header(header, key)
    if parsed.size != len(header):
        raise CorruptValue("length", f"header of {parsed.size} bytes, expected {len(header)}")
    verify_payload(parsed, pieces)
    return parsed.payload_len


def explain_wrong_length(key: str, prefix: bytes, length: int, wanted: int) -> CorruptValue:
    """Why a value of `length` bytes (whose first bytes are `prefix`) cannot fill a page of
    `wanted` payload bytes: the header's own complaint, else "truncated" (shorter or longer than
    its header says) or "length" (a sound value for another page size). Pure."""
    try:
        header = decode_header(prefix, key)
    except CorruptValue as error:
        return error
    if length - header.size != header.payload_len:
        return CorruptValue(
            "truncated", f"{length - header.size} payload bytes, header says {header.payload_len}"
        )
    return CorruptValue("length", f"value of {header.payload_len} bytes, page is {wanted}")
