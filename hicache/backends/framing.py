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

With a secret, the payload itself starts with a seal block (sealing/seal.py: an HMAC or AES-GCM tag
over the header's fields and the page), added and checked by sealing/backend.py around any backend.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

try:  # same polynomial and result as zlib.crc32, much faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib keeps the format readable
    _crc32 = zlib.crc32
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hicache.backends.file.native import NativeFileIO

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


CHECKSUM_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads `checksums` spreads a batch over. One thread's CRC-32 runs at about 21 GB/s here,
below what memory delivers; two measured 36 GB/s (the CRC releases the GIL)."""

PARALLEL_CHECKSUM_BYTES = 4 << 20
"""Batches smaller than this are checksummed on the calling thread (a hand-off costs more)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _checksum_pool() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one checksum pool per process, started on first use
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max(1, CHECKSUM_THREADS - 1), thread_name_prefix="hicache-crc"
            )
        return _pool


Values = Sequence[Sequence[memoryview | bytes]]


class PendingChecksums(Protocol):
    """Checksums being computed (`checksums_started`); `result` waits for them."""

    def result(self) -> list[int]: ...


def native_checksums() -> NativeFileIO | None:
    """The compiled module that checksums a batch in one call (file/native.py, built on the
    process's first call), or None where it cannot be built: batches are then checksummed
    with a call per piece, which needs the GIL back between pieces."""
    from hicache.backends.file.native import native_file_io  # it imports this module

    return native_file_io()


def _checksum_run(values: Values) -> list[int]:
    native = native_checksums()
    if native is not None:
        return native.checksums(values)
    return [checksum(value) for value in values]


def checksums(values: Values) -> list[int]:
    """The CRC-32 of each value (the concatenation of its pieces), as `checksum` gives it. A
    large batch is split into runs of whole values of about equal bytes, one per thread, the
    calling thread taking the first: a batch of pages from DRAM checksums ~1.7x faster."""
    sizes = [sum(memoryview(p).nbytes for p in value) for value in values]
    total = sum(sizes)
    parts = min(CHECKSUM_THREADS, len(values))
    if parts < 2 or total < PARALLEL_CHECKSUM_BYTES:
        return _checksum_run(values)
    cuts, acc, goal = [0], 0, total / parts
    for i, n in enumerate(sizes):
        acc += n
        if acc >= goal * len(cuts) and len(cuts) < parts and i + 1 < len(values):
            cuts.append(i + 1)
    cuts.append(len(values))

    def run(lo: int, hi: int) -> list[int]:
        return _checksum_run(values[lo:hi])

    native = native_checksums()
    helpers: list[PendingChecksums]
    if native is not None:  # native threads: nothing waits for the GIL to start
        helpers = [
            native.checksums_started(values[lo:hi]) for lo, hi in itertools.pairwise(cuts[1:])
        ]
    else:
        pool = _checksum_pool()
        helpers = [pool.submit(run, lo, hi) for lo, hi in itertools.pairwise(cuts[1:])]
    out = run(cuts[0], cuts[1])
    for pending in helpers:
        out.extend(pending.result())
    return out


def checksums_started(values: Values) -> PendingChecksums:
    """`checksums` of `values` computed on another thread, returned at once: for a caller
    with other work to do meanwhile (a transfer that does not need them). The values must not
    change until `result` returns. With the compiled module the thread is its own and never
    takes the GIL, so it runs beside a caller that holds the GIL; else it is the checksum
    pool's."""
    native = native_checksums()
    if native is not None:
        return native.checksums_started(values)
    return _checksum_pool().submit(_checksum_run, values)


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
