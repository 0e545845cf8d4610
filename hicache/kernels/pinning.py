"""Host memory for the pools: an exact-size mapping first-touched by several threads
(huge_pages.py), page-locked and mapped for the GPU with `cudaHostRegister` when asked; for the
host pool, range by range (`LazyHostMemory`), so the allocator can lease the first chunks of a
large pool while it prepares the rest.

Registering memory that is already faulted in only locks and maps pages; torch's pinned
allocator (`cudaHostAlloc` under a caching allocator) rounds the request up to a power of two
and faults every page on one thread. Where registering fails (no driver, a locked-memory limit)
the buffer comes from torch's pinned allocator as before, and `HostMemory.pinning` says why.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.kernels.huge_pages import (
    HUGE_PAGE,
    SMALL_PAGE,
    TOUCH_BYTES_PER_THREAD,
    Mapping,
    first_touch,
    mapped_bytes,
    max_touch_threads,
)


@dataclass(frozen=True, slots=True)
class HostMemory:
    """A host buffer and how it was made: `pinning` is "registered" (cudaHostRegister of the
    mapping), "torch" (torch's pinned allocator: small buffers, or registering failed, with
    the reason after a colon) or "none"; `touch_threads` is how many threads faulted it in (0:
    torch allocated it)."""

    buffer: torch.Tensor
    pinning: str
    touch_threads: int


def _runtime() -> Any:
    from cuda.bindings import runtime as cudart

    return cudart


def _ok(result: Any) -> tuple[bool, str]:
    err = result[0] if isinstance(result, tuple) else result
    return int(err) == 0, getattr(err, "name", str(err))


def register_host(buffer: torch.Tensor, owner: Mapping, *, runtime: Any = None) -> str | None:
    """Page-lock `buffer` (a contiguous uint8 CPU tensor) and map it for every device
    (`cudaHostRegister`, portable and mapped), unregistered when `owner` (the mapping holding
    the memory) is collected, before it is unmapped. Returns None on success, else why not.
    `runtime`: the cuda-python runtime module (default) or a stand-in with the same calls."""
    rt = _runtime() if runtime is None else runtime
    address = buffer.data_ptr()
    why = _register(rt, address, buffer.numel())
    if why is None:
        # Unregistered before the mapping's munmap (not at exit: the process's end frees both).
        owner.before_unmap.append(functools.partial(rt.cudaHostUnregister, address))
    return why


def _register(rt: Any, address: int, size: int) -> str | None:
    """cudaHostRegister (portable, mapped) of `size` bytes at `address`: None, or why not."""
    flags = int(rt.cudaHostRegisterPortable) | int(rt.cudaHostRegisterMapped)
    try:
        ok, name = _ok(rt.cudaHostRegister(address, size, flags))
    except Exception as exc:  # noqa: BLE001 - a missing library or driver: not registered
        return f"cudaHostRegister raised {type(exc).__name__}: {exc}"
    return None if ok else f"cudaHostRegister failed: {name}"


def host_memory(
    nbytes: int, *, pin: bool = False, threads: int | None = None, runtime: Any = None
) -> HostMemory:
    """A zeroed uint8 CPU buffer of exactly `nbytes`. At least one huge page long: a huge-page
    advised mapping whose pages are all faulted in now (a transfer never pays first-touch
    faults while serving), on up to `threads` threads (default `max_touch_threads()`, one per
    64 MiB); then, with `pin`, registered (`register_host`, `runtime` as there), or taken from
    torch's pinned allocator where that fails. Smaller buffers come from torch."""
    if nbytes < HUGE_PAGE:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        return HostMemory(buffer, "torch" if pin else "none", 0)
    buffer, mapping = mapped_bytes(nbytes)
    wanted = max_touch_threads() if threads is None else threads
    if wanted < 1:
        raise ValueError(f"threads must be at least 1, got {wanted}")
    used = first_touch(buffer.numpy(), max(1, min(wanted, nbytes // TOUCH_BYTES_PER_THREAD)))
    if not pin:
        return HostMemory(buffer, "none", used)
    why = register_host(buffer, mapping, runtime=runtime)
    if why is None:
        return HostMemory(buffer, "registered", used)
    del buffer, mapping  # give the faulted-in mapping back before torch allocates its own
    return HostMemory(torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True), f"torch: {why}", 0)


def cpu_bytes(nbytes: int, *, pin: bool = False, threads: int | None = None) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of exactly `nbytes` (`host_memory`'s buffer: at least one huge
    page long, a huge-page advised mapping faulted in on up to `threads` threads and, with
    `pin`, registered with CUDA; smaller buffers come from torch)."""
    return host_memory(nbytes, pin=pin, threads=threads).buffer


class LazyHostMemory:
    """A zeroed uint8 CPU buffer of exactly `nbytes` that is made usable range by range
    (`prepare`): each 4 KiB page of a range faulted in once, on threads for large ranges, and
    with `pin` registered with CUDA (`runtime` as in `register_host`). Buffers shorter than a
    huge page come from torch, usable (and pinned with `pin`) at once.

    Every registration is recorded (`registered`: address -> bytes) until `unpin` undoes it;
    the mapping undoes what is left before it is unmapped. A page is faulted in and registered
    at most once: preparing a range twice, or ranges that share pages, never writes to a page
    already prepared (it may hold KV by then)."""

    def __init__(
        self, nbytes: int, *, pin: bool, threads: int | None = None, runtime: Any = None
    ) -> None:
        self.nbytes = nbytes
        self.pin = pin
        self.threads = max_touch_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        self._runtime = runtime
        self.registered: dict[int, int] = {}
        units = -(-nbytes // SMALL_PAGE)
        self._touched = np.zeros(units, dtype=bool)
        self._pinned = np.zeros(units, dtype=bool)
        self.buffer: torch.Tensor
        self.pinning = "registered" if pin else "none"
        self.lazy = nbytes >= HUGE_PAGE
        if not self.lazy:
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.pinning = "torch" if pin else "none"
            self._touched[:] = self._pinned[:] = True
            return
        self.buffer, mapping = mapped_bytes(nbytes)
        self._bytes = self.buffer.numpy()
        self._mapping: Mapping | None = mapping
        # A table the mapping can empty without holding this object (no cycle through it).
        mapping.before_unmap.append(functools.partial(_unpin_all, self._rt, self.registered))

    @property
    def _rt(self) -> Any:
        if self._runtime is None:
            self._runtime = _runtime()
        return self._runtime

    def prepare(self, ranges: Iterable[tuple[int, int]]) -> str | None:
        """Make the byte ranges `[lo, hi)` usable: fault in their pages not faulted in yet,
        then (with `pin`) register the pages not registered yet, one call per run of them.
        None when all of it is ready; else why a registration failed (its pages stay faulted
        in, not registered; a later `prepare` of them tries again). Mutates."""
        runs = _page_runs(ranges, self.nbytes)
        for lo, hi in runs:
            for a, b in _unset_runs(self._touched, lo, hi):
                start, stop = a * SMALL_PAGE, min(b * SMALL_PAGE, self.nbytes)
                threads = max(1, min(self.threads, (stop - start) // TOUCH_BYTES_PER_THREAD))
                first_touch(self._bytes[start:stop], threads)
                self._touched[a:b] = True
        if not self.pin or not self.lazy:
            return None
        base = self.buffer.data_ptr()
        for lo, hi in runs:
            for a, b in _unset_runs(self._pinned, lo, hi):
                start, stop = a * SMALL_PAGE, min(b * SMALL_PAGE, self.nbytes)
                why = _register(self._rt, base + start, stop - start)
                if why is not None:
                    return why
                self.registered[base + start] = stop - start
                self._pinned[a:b] = True
        return None

    def prepared(self, ranges: Iterable[tuple[int, int]]) -> bool:
        """Whether every page of the byte ranges is faulted in and (with `pin`) registered."""
        done = self._touched & self._pinned if self.pin else self._touched
        return all(done[lo:hi].all() for lo, hi in _page_runs(ranges, self.nbytes))

    def unpin(self) -> int:
        """Unregister every registration recorded; how many there were. Idempotent."""
        if not self.registered:
            return 0
        count = len(self.registered)
        _unpin_all(self._rt, self.registered)
        self._pinned[:] = False
        return count

    def fall_back(self, why: str) -> None:
        """Registering failed from the start (no driver, a locked-memory limit): take the
        whole buffer from torch's pinned allocator instead, usable at once; `pinning` says
        why. Only before anything uses the buffer."""
        self.unpin()
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.pinning = f"torch: {why}"
        self.lazy = False
        self._bytes = self.buffer.numpy()
        self._mapping = None  # the faulted-in mapping goes back once no view holds it
        self._touched[:] = self._pinned[:] = True


def _unpin_all(rt: Any, registered: dict[int, int]) -> None:
    for address in list(registered):
        rt.cudaHostUnregister(address)
        del registered[address]


def _page_runs(ranges: Iterable[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The 4 KiB pages (as [first, last) page numbers) that the byte ranges touch, merged into
    sorted disjoint runs. Raises ValueError for a range outside [0, nbytes)."""
    spans = []
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= nbytes:
            raise ValueError(f"byte range [{lo}, {hi}) is outside the buffer [0, {nbytes})")
        if lo < hi:
            spans.append((lo // SMALL_PAGE, -(-hi // SMALL_PAGE)))
    spans.sort()
    runs: list[tuple[int, int]] = []
    for a, b in spans:
        if runs and a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


def _unset_runs(marks: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """Runs [a, b) of False in `marks[lo:hi]`, as absolute indices."""
    window = marks[lo:hi]
    if window.all():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([True], window, [True])).astype(np.int8)))
    return [(lo + int(a), lo + int(b)) for a, b in zip(edges[::2], edges[1::2])]
