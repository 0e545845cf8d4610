"""What a cache will allocate at open, checked against what the machine has before anything is
allocated: a configuration too large fails with the sizes, not with `Cannot allocate memory`.

The pools are faulted in at open (docs/data-plane.md), so their bytes are taken at once: L1 on
its device (host memory when that is the CPU), L2 in host memory. The check compares them with
the memory available now (Linux: MemAvailable; CUDA: the device's free memory). Numbers in,
words out: the caller turns a shortfall into its own error (assembly.py: a `ConfigError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TierBytes", "available_memory", "cuda_free", "fmt_bytes", "shortfall"]


def available_memory() -> int | None:
    """Bytes of host memory available to new allocations now (Linux: MemAvailable, which
    counts reclaimable page cache; elsewhere free physical pages), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def fmt_bytes(n: float) -> str:
    """Decimal units, three significant digits: 26.2 GB, 512 MB, 4.1 kB."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True, slots=True)
class TierBytes:
    """What the pools of one cache take: L1 on `device`, L2 in host memory."""

    device: str  # "cpu", "cuda", "cuda:N"
    l1: int  # 0 when the caller hands its own device pool
    l2: int

    @property
    def host(self) -> int:
        """Host memory taken: L2, and L1 when it lives on the CPU."""
        return self.l2 + (self.l1 if self.device == "cpu" else 0)


def shortfall(
    need: TierBytes,
    *,
    host_free: Callable[[], int | None] = available_memory,
    device_free: Callable[[str], int | None] | None = None,
) -> str | None:
    """What does not fit, each tier's bytes against what is available ("L2 30 GB of host
    memory, 20 GB available; ..."), or None when the pools fit or the free memory is unknown."""
    problems = []
    free = host_free()
    if free is not None and need.host > free:
        parts = [f"L2 {fmt_bytes(need.l2)}"]
        if need.device == "cpu" and need.l1:
            parts.insert(0, f"L1 {fmt_bytes(need.l1)} (device is cpu)")
        problems.append(f"{' + '.join(parts)} of host memory, {fmt_bytes(free)} available")
    if need.device != "cpu" and need.l1 and device_free is not None:
        on_device = device_free(need.device)
        if on_device is not None and need.l1 > on_device:
            problems.append(
                f"L1 {fmt_bytes(need.l1)} on {need.device}, {fmt_bytes(on_device)} free there"
            )
    return "; ".join(problems) or None


def cuda_free(device: str) -> int | None:
    """Free bytes on a CUDA device now, or None when they cannot be read."""
    try:
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    except Exception:  # noqa: BLE001 - no driver, no device: nothing to check against
        return None
