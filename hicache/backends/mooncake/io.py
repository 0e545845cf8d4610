"""Blocking batch operations against a Mooncake Store client, one client call per chunk.

A stored value is exactly the framed value every hicache backend stores (framing.py): header
(magic, version, key, length, CRC-32) then the payload. Mooncake cannot prepend bytes to memory
it moves zero-copy, so the header is written to a lane's registered header slot and the value
is put and got scatter-gather: pieces `[header slot, page piece 1, page piece 2, ...]`, except
where the page has header room (a host pool page: `header_room` of kernels/pools.py's
`PagePieces`): the header is then written just before the page and the value moves as one
piece. A read of a value with another length fails in the client; a read of the right length
is checked against the header (key, length, CRC-32) before the page counts as read.

These functions run in worker threads and never raise for store-side failures: they return
what happened as data. `client` is a `MooncakeDistributedStore` or a fake with its methods.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.backends import batch_checksums, framing
from hicache.backends.base import PageBuffer
from hicache.backends.mooncake.memory import HEADER_SLOT, Lane
from hicache.backends.registered import RegisteredRegions, address_of

OK = 0
NOT_FOUND = -704
ALREADY_EXISTS = -705


NO_SPACE = frozenset({-101, -200})  # AVAILABLE_SEGMENT_EMPTY, NO_AVAILABLE_HANDLE


def is_no_space(code: int) -> bool:
    """The master found no segment room for the value (the store is full)."""
    return code in NO_SPACE


def is_unreachable(code: int) -> bool:
    """RPC-class failures (-900…-999): the master or a peer could not be reached."""
    return -999 <= code <= -900


@dataclass(slots=True)
class ChunkResult:
    """What one chunk did. `done`: pages, from the first, stored or read and verified."""

    done: int = 0
    nbytes: int = 0  # payload bytes of the `done` pages
    staged: int = 0  # pages that went through staging
    absent: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (key, reason), deleted
    errors: list[tuple[str, int]] = field(default_factory=list)  # (key, client code)


def page_plan(regions: RegisteredRegions, page: PageBuffer) -> tuple[list[int], list[int], bool]:
    """(addresses, sizes, staged) of a page's non-empty pieces; staged when any piece lies
    outside registered memory (the page then moves whole through staging)."""
    ptrs: list[int] = []
    sizes: list[int] = []
    for piece in page:
        n = memoryview(piece).nbytes
        if n:
            ptrs.append(address_of(piece))
            sizes.append(n)
    staged = not all(regions.covers(p, n) for p, n in zip(ptrs, sizes))
    return ptrs, sizes, staged


def split_chunks(
    payloads: Sequence[int], staged: Sequence[bool], *, batch: int, staging: int
) -> list[range]:
    """Consecutive index ranges of at most `batch` pages whose staged payloads fit `staging`.
    Raises ValueError for a staged page larger than `staging` (a configuration error). Pure."""
    chunks: list[range] = []
    start, used = 0, 0
    for i, (n, s) in enumerate(zip(payloads, staged)):
        need = n if s else 0
        if need > staging:
            raise ValueError(
                f"a {n}-byte page outside registered memory does not fit the {staging}-byte "
                "staging lane: register the host pool (register_host_memory) or raise staging="
            )
        if i - start == batch or used + need > staging:
            chunks.append(range(start, i))
            start, used = i, 0
        used += need
    if start < len(payloads):
        chunks.append(range(start, len(payloads)))
    return chunks


def _in_room(
    regions: RegisteredRegions, page: PageBuffer, ptrs: list[int], sizes: list[int], size: int
) -> int | None:
    """Where a `size`-byte header goes so that header and page are one registered piece: just
    before the page, in its header room (`PagePieces`); None when the page has no such room."""
    if getattr(page, "header_room", 0) < size or len(ptrs) != 1:
        return None
    at = ptrs[0] - size
    return at if regions.covers(at, size + sizes[0]) else None


def _room_view(at: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(at)).cast("B")


def _header_slot(lane: Lane, i: int, size: int) -> tuple[memoryview, int]:
    if size > HEADER_SLOT:
        raise ValueError(
            f"key too long: header of {size} bytes exceeds the {HEADER_SLOT}-byte slot"
        )
    return lane.headers[
        i * HEADER_SLOT : i * HEADER_SLOT + size
    ], lane.headers_ptr + i * HEADER_SLOT


def put_chunk(
    client: Any,
    lane: Lane,
    regions: RegisteredRegions,
    keys: Sequence[str],
    pages: Sequence[PageBuffer],
) -> ChunkResult:
    """Store each page under its key (an existing key counts as stored: keys name content)."""
    all_ptrs: list[list[int]] = []
    all_sizes: list[list[int]] = []
    payload: list[int] = []
    result = ChunkResult()
    offset = 0
    crcs = batch_checksums.checksums(pages)  # on several threads: one is slower than memory here
    for i, (key, page) in enumerate(zip(keys, pages)):
        ptrs, sizes, staged = page_plan(regions, page)
        header = framing.pack_header(key, sum(sizes), crcs[i])
        at = None if staged else _in_room(regions, page, ptrs, sizes, len(header))
        if at is not None:  # one piece: Mooncake moves every extra piece as its own request
            _room_view(at, len(header))[:] = header
            all_ptrs.append([at])
            all_sizes.append([len(header) + sizes[0]])
            payload.append(sizes[0])
            continue
        slot, slot_ptr = _header_slot(lane, i, len(header))
        slot[:] = header
        if staged:
            n = sum(sizes)
            dst = lane.staging[offset : offset + n]
            pos = 0
            for piece in page:
                m = _byte_view(piece)
                dst[pos : pos + m.nbytes] = m
                pos += m.nbytes
            ptrs, sizes = ([lane.staging_ptr + offset], [n]) if n else ([], [])
            offset += n
            result.staged += 1
        all_ptrs.append([slot_ptr, *ptrs])
        all_sizes.append([len(header), *sizes])
        payload.append(sum(sizes))
    codes = client.batch_put_from_multi_buffers(list(keys), all_ptrs, all_sizes)
    for key, code, n in zip(keys, codes, payload):
        if code in (OK, ALREADY_EXISTS):
            if not result.errors:
                result.done += 1
                result.nbytes += n
        else:
            result.errors.append((key, int(code)))
    return result


def get_chunk(
    client: Any,
    lane: Lane,
    regions: RegisteredRegions,
    keys: Sequence[str],
    pages: Sequence[PageBuffer],
) -> ChunkResult:
    """Read each key into its page, verify it, and delete values that fail verification.
    Stops verifying at the first page that is not read: later pages are of no use."""
    all_ptrs: list[list[int]] = []
    all_sizes: list[list[int]] = []
    staged_at: list[int | None] = []
    headers: list[tuple[memoryview, int]] = []
    offset = 0
    for i, (key, page) in enumerate(zip(keys, pages)):
        ptrs, sizes, staged = page_plan(regions, page)
        hsize = framing.header_size(key)
        at = None if staged else _in_room(regions, page, ptrs, sizes, hsize)
        if at is not None:  # header lands in the page's room: one piece
            headers.append((_room_view(at, hsize), hsize + sizes[0]))
            staged_at.append(None)
            all_ptrs.append([at])
            all_sizes.append([hsize + sizes[0]])
            continue
        slot, slot_ptr = _header_slot(lane, i, hsize)
        headers.append((slot, hsize + sum(sizes)))
        if staged:
            n = sum(sizes)
            ptrs, sizes = ([lane.staging_ptr + offset], [n]) if n else ([], [])
            staged_at.append(offset)
            offset += n
        else:
            staged_at.append(None)
        all_ptrs.append([slot_ptr, *ptrs])
        all_sizes.append([hsize, *sizes])
    codes = client.batch_get_into_multi_buffers(list(keys), all_ptrs, all_sizes)
    # Checksum every payload read whole (up to the first page that is not) in one batch, on
    # several threads; the checks below then go page by page.
    sources: list[PageBuffer] = []
    for i, (page, code) in enumerate(zip(pages, codes)):
        slot, expected = headers[i]
        if code != expected:
            break
        at = staged_at[i]
        sources.append(page if at is None else [lane.staging[at : at + expected - len(slot)]])
    crcs = batch_checksums.checksums(sources)
    result = ChunkResult()
    for i, (key, page, code) in enumerate(zip(keys, pages, codes)):
        slot, expected = headers[i]
        if code == NOT_FOUND:
            result.absent += 1
            break
        if code < 0:
            reason = _classify_failure(client, key, expected, int(code))
            if reason is None:
                result.errors.append((key, int(code)))
            else:
                result.corrupt.append((key, reason))
            break
        payload_len = expected - len(slot)
        try:
            if code != expected:
                raise framing.CorruptValue("length", f"read {code} bytes, expected {expected}")
            src = sources[i]
            header = framing.decode_header(slot, key)
            framing.verify_payload(header, src, crcs[i])
        except framing.CorruptValue as exc:
            result.corrupt.append((key, exc.reason))
            break
        if staged_at[i] is not None:
            _scatter(src[0], page)
            result.staged += 1
        result.done += 1
        result.nbytes += payload_len
    if result.corrupt:
        client.batch_remove([k for k, _ in result.corrupt], True)
    return result


def _classify_failure(client: Any, key: str, expected: int, code: int) -> str | None:
    """ "length" when the key holds a value of another size (foreign or torn: it can never be
    read into this page), else None (a transient failure, left in place)."""
    if is_unreachable(code):
        return None
    size = client.get_size(key)
    return "length" if size >= 0 and size != expected else None


def _scatter(src: memoryview, page: PageBuffer) -> None:
    pos = 0
    for piece in page:
        m = _byte_view(piece)
        m[:] = src[pos : pos + m.nbytes]
        pos += m.nbytes


def _byte_view(piece: memoryview) -> memoryview:
    m = memoryview(piece)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")
