"""The header every stored page value carries, so a torn, truncated or foreign value is a miss.

Layout (little-endian), then the key (UTF-8), then the payload:

    magic "HKV\\0" | version u16 | key length u16 | payload length u64 | crc32 u32 | reserved u32

The checksum is zlib's CRC-32 over the payload, computed incrementally over the page's pieces so
no joined copy is made. It is computed by ISA-L (`isal`, the same CRC-32, about 10x zlib's
speed with PCLMUL) when installed, else by zlib (about 5 GB/s), which would make verification
the bottleneck of reads from the page cache. A batch (`checksums`) goes through the file
store's compiled module where it builds (file/native.py: one call per batch, the GIL released
for all of it, so it runs beside threads that hold the GIL), through the per-piece calls
otherwise; the results are the same.

With a secret, the payload itself starts with a seal block (hicache/seal.py: an HMAC or AES-GCM
tag over the header's fields and the page), added and checked by sealing/backend.py around any
backend.
"""

from __future__ import annotations

import struct
import zlib

try:  # same polynomial and result as zlib.crc32, much faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib keeps the format readable
    _crc32 = zlib.crc32
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"HKV\0"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQII")
FIXED_HEADER_SIZE = _FIXED.size


class CorruptValue(Exception):
    """A stored value that must not be used as KV. `reason` is one of: magic, version,
    truncated, key, length, checksum."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"corrupt page value ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    key: str
    payload_len: int
    crc32: int
    size: int  # bytes of header, key included


def checksum(pieces: Sequence[memoryview | bytes], crc: int = 0) -> int:
    """CRC-32 of the pieces' concatenation; `crc` continues an earlier part's checksum."""
    for piece in pieces:
        crc = _crc32(piece, crc)
    return crc


def encode_header(key: str, pieces: Sequence[memoryview | bytes]) -> bytes:
    """The header for a value whose payload is the concatenation of `pieces`."""
    length = sum(memoryview(p).nbytes for p in pieces)
    return pack_header(key, length, checksum(pieces))


def pack_header(key: str, payload_len: int, crc32: int) -> bytes:
    """The header for a payload whose length and checksum the caller computed (e.g. part by
    part while writing it)."""
    key_bytes = key.encode()
    if len(key_bytes) > 0xFFFF:
        raise ValueError(f"key of {len(key_bytes)} bytes is longer than 65535")
    return _FIXED.pack(MAGIC, FORMAT_VERSION, len(key_bytes), payload_len, crc32, 0) + key_bytes


def header_size(key: str) -> int:
    return FIXED_HEADER_SIZE + len(key.encode())


def decode_header(buf: bytes | memoryview, expected_key: str) -> Header:
    """Parse and check the header at the start of `buf` against the key it was read under.
    Raises CorruptValue; never returns a header for another key."""
    if len(buf) < FIXED_HEADER_SIZE:
        raise CorruptValue("truncated", f"{len(buf)} bytes is shorter than a header")
    magic, version, key_len, payload_len, crc, _ = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptValue("magic", f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CorruptValue("version", f"format version {version}, expected {FORMAT_VERSION}")
    end = FIXED_HEADER_SIZE + key_len
    if len(buf) < end:
        raise CorruptValue("truncated", "value ends inside its key")
    key = bytes(buf[FIXED_HEADER_SIZE:end]).decode(errors="replace")
    if key != expected_key:
        raise CorruptValue("key", f"value belongs to {key!r}, read as {expected_key!r}")
    return Header(key=key, payload_len=payload_len, crc32=crc, size=end)


def verify_payload(
    header: Header, pieces: Sequence[memoryview | bytes], crc: int | None = None
) -> None:
    """Check that `pieces` (the payload as read) match the header's length and checksum; `crc`:
    their checksum when the caller already has it (`checksums`)."""
    length = sum(memoryview(p).nbytes for p in pieces)
    if length != header.payload_len:
        raise CorruptValue("length", f"payload of {length} bytes, header says {header.payload_len}")
    if (checksum(pieces) if crc is None else crc) != header.crc32:
        raise CorruptValue("checksum", f"checksum mismatch for {header.key!r}")
