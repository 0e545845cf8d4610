"""Memory for CPU pools: large buffers come from anonymous mappings aligned to and advised for
transparent huge pages, first-touched by several threads, and (pinned pools) registered with
CUDA where it is usable (pinning.py).

Why mappings: a layer load from a page-first host layout touches one short row in every few
KiB of a buffer of GiBs; with 4 KiB pages nearly every row is a TLB miss (two-level walks in a
VM); a 2 MiB page covers hundreds of those rows with one TLB entry.
Why not torch's pinned allocator for pinned pools: it rounds a request up to a power of two
(20.4 GiB became 32 GiB) and faults and locks the memory on one thread (2 GB/s on an H200 host,
docs/benchmarks.md "Pinning"); a mapping of the exact size, faulted in by several threads and
then registered, asks the driver only to lock pages that are already there.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

HUGE_PAGE = 2 << 20
SMALL_PAGE = 4096

TOUCH_BYTES_PER_THREAD = 64 << 20
"""A buffer gets one touching thread per this many bytes (up to `max_touch_threads()`): below
it a thread's start costs more than the faults it takes over."""


def max_touch_threads() -> int:
    """Threads that first-touch a large buffer: the cores this process may run on, at most 8
    (page faults of one process contend on its memory map's lock past that)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def touch_ranges(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges, one per thread, covering [0, nbytes) exactly, cut at 4 KiB page
    boundaries, none empty (fewer ranges than `threads` when the buffer has fewer pages). Pure."""
    if nbytes <= 0:
        return []
    pages = -(-nbytes // SMALL_PAGE)
    parts = max(1, min(threads, pages))
    cuts = [pages * i // parts * SMALL_PAGE for i in range(parts)] + [nbytes]
    return [(lo, hi) for lo, hi in itertools.pairwise(cuts) if lo < hi]


def first_touch(buffer: np.ndarray, threads: int) -> int:
    """Fault in every 4 KiB page of the 1-D uint8 `buffer` by writing a zero to it, split over
    `threads` threads (numpy releases the GIL for the strided writes); returns the number of
    threads used. Zeroes nothing else: a fresh anonymous mapping is zero already."""
    ranges = touch_ranges(int(buffer.size), threads)

    def touch(lo: int, hi: int) -> None:
        buffer[lo:hi:SMALL_PAGE] = 0

    helpers = [threading.Thread(target=touch, args=r, name="hicache-touch") for r in ranges[1:]]
    for helper in helpers:
        helper.start()
    try:
        if ranges:
            touch(*ranges[0])
    finally:
        for helper in helpers:
            helper.join()
    return len(ranges)


class Mapping(mmap.mmap):
    """An anonymous mapping that runs `before_unmap` (callables, in order) when it is
    collected, while its memory is still mapped: weakref callbacks on an mmap run only after
    its munmap."""

    before_unmap: list[Callable[[], object]]

    def __del__(self) -> None:
        if sys.is_finalizing():  # the process's end frees it; the callees may be gone
            return
        for release in getattr(self, "before_unmap", ()):
            release()


def mapped_bytes(nbytes: int) -> tuple[torch.Tensor, Mapping]:
    """An untouched uint8 tensor of exactly `nbytes` over an anonymous mapping, starting on a
    2 MiB boundary and advised for huge pages where the platform has them, and the mapping
    (alive while any view of the tensor is). The mapping is one huge page longer than asked,
    for the alignment; that slack is never touched, so never backed by memory."""
    mapping = Mapping(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.before_unmap = []
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: ordinary pages, same semantics
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes], mapping
