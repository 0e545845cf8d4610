"""Which host memory the Mooncake client may move zero-copy, and the backend's own registered
arena (per-lane header slots and staging) for everything else.

Mooncake transfers only from and into memory registered with its client (`register_buffer`;
on RDMA that pins and maps it). The host pool registers itself once; a page piece wholly inside
a registered region goes zero-copy, any other piece is copied through a lane's staging area.
"""

from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass

import numpy as np

HEADER_SLOT = 512
"""Bytes reserved per page for its framing header (fixed part plus key): keys up to 488 bytes."""


def address_of(view: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers included)."""
    mv = view if isinstance(view, memoryview) else memoryview(view)
    if not mv.c_contiguous:
        raise ValueError("page pieces must be C-contiguous buffers")
    if not mv.nbytes:
        return 0
    if not mv.readonly:  # ctypes takes only writable buffers; ~10x faster than numpy's view
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    # __array_interface__, not .ctypes.data: the latter builds a ctypes helper per call (~10x slower)
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0])


class RegisteredRegions:
    """Disjoint, sorted address ranges [start, end) registered with the client. Mutated only by
    `add` (from the event loop); `covers` may run in worker threads, which see either the old or
    the new tuple, both consistent."""

    __slots__ = ("_starts", "_ends")

    def __init__(self) -> None:
        self._starts: tuple[int, ...] = ()
        self._ends: tuple[int, ...] = ()

    def add(self, ptr: int, nbytes: int) -> bool:
        """Record [ptr, ptr+nbytes). False (and no change) if it is already covered; raises
        ValueError for an empty range or one overlapping a different registered range."""
        if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"ptr must be a positive address, got {ptr!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if self.covers(ptr, nbytes):
            return False
        i = bisect.bisect_right(self._starts, ptr)
        if (i > 0 and self._ends[i - 1] > ptr) or (
            i < len(self._starts) and self._starts[i] < ptr + nbytes
        ):
            raise ValueError(f"region [{ptr:#x}, +{nbytes}) overlaps a registered region")
        self._starts = self._starts[:i] + (ptr,) + self._starts[i:]
        self._ends = self._ends[:i] + (ptr + nbytes,) + self._ends[i:]
        return True

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr+nbytes) lies inside one registered region. Pure."""
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= ends[i]

    def ranges(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of each region, in address order."""
        return [(s, e - s) for s, e in zip(self._starts, self._ends)]

    def check_integrity(self) -> None:
        assert len(self._starts) == len(self._ends)
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            assert s < e, "empty region"
            assert i == 0 or self._ends[i - 1] <= s, "regions overlap or are unsorted"


@dataclass(frozen=True, slots=True)
class Lane:
    """One in-flight client call's private registered memory: `batch` header slots, then
    `staging` bytes. Owned by whoever took it from the backend's lane queue until returned."""

    headers: memoryview  # batch * HEADER_SLOT bytes
    staging: memoryview
    headers_ptr: int
    staging_ptr: int


class Arena:
    """The backend's registered memory, split into `lanes` lanes. Allocated once; pages are
    touched up front so the first transfers do not pay for page faults."""

    __slots__ = ("_buf", "lanes", "ptr", "nbytes")

    def __init__(self, *, lanes: int, batch: int, staging: int) -> None:
        per_lane_staging = staging // lanes
        per_lane = batch * HEADER_SLOT + per_lane_staging
        self._buf = np.ones(lanes * per_lane, dtype=np.uint8)  # ones, not zeros: touches pages
        self.ptr = int(self._buf.ctypes.data)
        self.nbytes = int(self._buf.nbytes)
        view = self._buf.data.cast("B")
        lanes_list = []
        for i in range(lanes):
            base = i * per_lane
            hdr = view[base : base + batch * HEADER_SLOT]
            stg = view[base + batch * HEADER_SLOT : base + per_lane]
            lanes_list.append(
                Lane(hdr, stg, self.ptr + base, self.ptr + base + batch * HEADER_SLOT)
            )
        self.lanes: tuple[Lane, ...] = tuple(lanes_list)
