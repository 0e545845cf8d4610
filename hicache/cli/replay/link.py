"""`hicache replay`'s link utilization: the bytes the cache moved between L1 and L2 (both
directions) over the run's time (from the first step, once the pools are allocated and pinned,
to the last write flushed: opening a large cache is pinning, not the link), against a
contiguous copy over the same link measured at start (CUDA: one pinned host buffer to and from
the device; CPU pools: one host buffer to another).

1.0 means the replay kept the link as busy as one contiguous copy in one direction would; the
two directions can overlap on a GPU (separate copy engines), so it can exceed 1 there."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LinkReference", "link_utilization", "measure_link"]

REFERENCE_BYTES = 256 << 20
"""One reference copy: large enough that per-call costs are noise, small next to the pools."""

REPEATS = 3


@dataclass(frozen=True, slots=True)
class LinkReference:
    """The contiguous copy rate of the replay's link, in bytes/s, and what was copied."""

    rate: float
    what: str


def _best(seconds: list[float]) -> float:
    return min(seconds) if seconds else float("inf")


def _cuda_reference(device: str, nbytes: int) -> LinkReference:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    rates = []
    for dst, src in ((on_device, host), (host, on_device)):
        dst.copy_(src, non_blocking=True)  # warm: first-use costs are not the link's
        torch.cuda.synchronize(device)
        seconds = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        rates.append(nbytes / _best(seconds))
    h2d, d2h = rates
    return LinkReference(
        (h2d + d2h) / 2,
        f"contiguous pinned copy host<->{device} (h2d {h2d / 1e9:.1f}, d2h {d2h / 1e9:.1f} GB/s)",
    )


def _host_reference(nbytes: int) -> LinkReference:
    src = torch.ones(nbytes, dtype=torch.uint8)  # written: its pages exist
    dst = torch.ones(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(REPEATS + 1):  # the first one warms
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        seconds.append(time.perf_counter() - t0)
    return LinkReference(nbytes / _best(seconds[1:]), "contiguous host copy (memmove, 1 thread)")


def measure_link(device: str, nbytes: int = REFERENCE_BYTES) -> LinkReference:
    """The reference for pools on `device` ("cpu", "cuda", "cuda:N"; "auto" as the cache
    resolves it)."""
    if device == "auto":
        from hicache.kernels.streams import cuda_driver_status

        device = "cuda" if cuda_driver_status()[0] else "cpu"
    if device.startswith("cuda"):
        return _cuda_reference(device, nbytes)
    return _host_reference(nbytes)


def link_utilization(moved_bytes: int, run_s: float, reference: LinkReference) -> dict[str, Any]:
    """The summary's `link` entry: the rate moved over `run_s` and its ratio to the reference."""
    moved = moved_bytes / run_s if run_s > 0 else 0.0
    return {
        "run_s": round(run_s, 3),
        "moved_gbps": round(moved / 1e9, 3),
        "reference_gbps": round(reference.rate / 1e9, 3),
        "reference": reference.what,
        "utilization": round(moved / reference.rate, 4),
    }
