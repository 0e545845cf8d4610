"""Host memory registered with a transfer engine (Mooncake's client, NIXL's agent): which
address ranges it may move zero-copy, and the address of a page piece to look up there.
"""

from __future__ import annotations

import bisect
import ctypes

import numpy as np


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
