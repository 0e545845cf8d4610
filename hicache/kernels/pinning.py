"""Host memory for the pools: an exact-size mapping first-touched by several threads
(huge_pages.py), page-locked and mapped for the GPU with `cudaHostRegister` when asked.

Registering memory that is already faulted in only locks and maps pages; torch's pinned
allocator (`cudaHostAlloc` under a caching allocator) rounds the request up to a power of two
and faults every page on one thread. Where registering fails (no driver, a locked-memory limit)
the buffer comes from torch's pinned allocator as before, and `HostMemory.pinning` says why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hicache.kernels.huge_pages import (
    HUGE_PAGE,
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
    address, size = buffer.data_ptr(), buffer.numel()
    flags = int(rt.cudaHostRegisterPortable) | int(rt.cudaHostRegisterMapped)
    try:
        ok, name = _ok(rt.cudaHostRegister(address, size, flags))
    except Exception as exc:  # noqa: BLE001 - a missing library or driver: not registered
        return f"cudaHostRegister raised {type(exc).__name__}: {exc}"
    if not ok:
        return f"cudaHostRegister failed: {name}"
    # Unregistered before the mapping's munmap (not at exit: the process's end frees both).
    owner.before_unmap.append(functools.partial(rt.cudaHostUnregister, address))
    return None


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
