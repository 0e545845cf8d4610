"""Memory for CPU pools: large unpinned buffers come from anonymous mappings aligned to and
advised for transparent huge pages.

Why: a layer load from a page-first host layout touches one short row in every few KiB of a
buffer of GiBs; with 4 KiB pages nearly every row is a TLB miss (two-level walks in a VM).
Huge pages measured 1.5-2x faster on those gathers here (docs/benchmarks.md "Transfers").
Pinned buffers (CUDA present) stay with torch's pinned allocator.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def cpu_bytes(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`: pinned through torch when `pin`; huge-page
    advised (where the platform has it) when at least one huge page long; else torch's."""
    if pin or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled or unsupported: ordinary pages, same semantics
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    skip = -whole.data_ptr() % HUGE_PAGE
    buffer = whole[skip : skip + nbytes]
    # Fault every page in now (as torch.zeros did), after the advice so they come huge: a
    # transfer should not pay first-touch faults, which zero 2 MiB each, while serving. One
    # write per 4 KiB suffices (the kernel zeroes what it maps) and covers a 4 KiB fallback.
    buffer[::4096] = 0
    return buffer
