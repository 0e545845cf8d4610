"""Slot-index validation and the page plan every transfer runs from.

All checks happen here, before any byte moves. Slots are int64 (numpy arrays or torch tensors);
a transfer moves whole pages, so with page size `ps` the slots come in groups of `ps`
consecutive slots starting at a multiple of `ps` (with ps = 1 any slot set is whole pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from hicache.kernels.geometry import Geometry
from hicache.kernels.native.rowcopy import native_rows

SlotArray = np.ndarray | torch.Tensor
"""Slots as the data plane takes them: a 1-D int64 numpy array or torch tensor (any device)."""


class PoolShape(Protocol):
    """What a transfer plan reads of a pool (`HostPool`, `DevicePool`), stated here so that
    this module does not import the pools, which import it."""

    geometry: Geometry
    page_size: int
    size: int


def as_slot_array(slots: SlotArray, name: str) -> np.ndarray:
    """`slots` as a 1-D int64 numpy array (a copy when it lives on a GPU). Does not validate range."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got torch {slots.dtype}")
        array = slots.detach().cpu().numpy()
    elif isinstance(slots, np.ndarray):
        if slots.dtype != np.int64:
            raise TypeError(f"{name} must be int64, got numpy {slots.dtype}")
        array = slots
    else:
        raise TypeError(
            f"{name} must be a numpy int64 array or a torch int64 tensor, got {type(slots).__name__}"
        )
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    return array


def check_pages(slots: np.ndarray, page_size: int, size: int, name: str) -> np.ndarray:
    """The page numbers covered by `slots`, checking: in [0, size), whole aligned pages, no
    duplicates. Raises ValueError naming the first offending slot."""
    native = native_rows()
    if native is not None and slots.ndim == 1 and slots.dtype == np.int64:
        # One compiled pass instead of a handful of numpy ones (each with a temporary as
        # large as the slots); only a failing check goes on below, to name the problem.
        pages = native.slot_pages(np.ascontiguousarray(slots), page_size, size)
        if pages is not None:
            return pages
    if slots.size:
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: slot {bad} is out of range [0, {size})")
    if slots.size % page_size:
        raise ValueError(
            f"{name}: {slots.size} slots is not a whole number of pages of {page_size}"
        )
    grid = slots.reshape(-1, page_size)
    starts = grid[:, 0]
    misaligned = np.flatnonzero(starts % page_size)
    if misaligned.size:
        raise ValueError(
            f"{name}: page {int(misaligned[0])} starts at slot {int(starts[misaligned[0]])}, "
            f"not a multiple of page_size {page_size}"
        )
    if page_size > 1:
        broken = np.flatnonzero((grid != starts[:, None] + np.arange(page_size)).any(axis=1))
        if broken.size:
            raise ValueError(f"{name}: page {int(broken[0])} is not {page_size} consecutive slots")
    pages = starts // page_size
    # Duplicates in O(pages): mark each page, count the marks (no sort on the hot path).
    seen = np.zeros(size // page_size, dtype=bool)
    seen[pages] = True
    if np.count_nonzero(seen) != pages.size:
        values, counts = np.unique(pages, return_counts=True)
        dup = int(values[counts > 1][0]) * page_size
        raise ValueError(f"{name}: slot {dup} appears more than once")
    return pages


@dataclass(frozen=True, slots=True)
class PagePlan:
    """Validated page pairs of one transfer: host page `host_pages[i]` <-> device page
    `device_pages[i]`. Immutable; index tensors and coalesced runs are derived once."""

    host_pages: np.ndarray
    device_pages: np.ndarray
    page_size: int
    _cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def pages(self) -> int:
        return int(self.host_pages.size)

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def index_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(host pages, device pages) as int64 tensors on `device`."""
        key = ("index", str(device))
        if key not in self._cache:
            self._cache[key] = (
                torch.from_numpy(self.host_pages).to(device),
                torch.from_numpy(self.device_pages).to(device),
            )
        tensors: tuple[torch.Tensor, torch.Tensor] = self._cache[key]
        return tensors

    def runs(self) -> list[tuple[int, int, int]]:
        """Coalesced (host page, device page, page count) runs: maximal stretches where both
        page numbers advance by one; sorted by host page (seed: sort host, permute device)."""
        if "runs" not in self._cache:
            order = np.argsort(self.host_pages, kind="stable")
            host, dev = self.host_pages[order], self.device_pages[order]
            if host.size == 0:
                self._cache["runs"] = []
            else:
                breaks = np.flatnonzero((np.diff(host) != 1) | (np.diff(dev) != 1)) + 1
                starts = np.concatenate(([0], breaks))
                lengths = np.diff(np.concatenate((starts, [host.size])))
                self._cache["runs"] = list(
                    zip(host[starts].tolist(), dev[starts].tolist(), lengths.tolist())
                )
        runs: list[tuple[int, int, int]] = self._cache["runs"]
        return runs


def plan_transfer(
    host: PoolShape, device: PoolShape, host_slots: SlotArray, device_slots: SlotArray
) -> PagePlan:
    """Validate a transfer between `host` (HostPool) and `device` (DevicePool) and return its
    page plan. Raises (TypeError/ValueError) before anything moves on: pools of different
    geometry or page size, slot arrays of other than int64, unequal lengths, out-of-range,
    duplicate or non-page-aligned slots."""
    if host.geometry != device.geometry:
        raise ValueError(
            f"host pool geometry {host.geometry.spec()} differs from device pool {device.geometry.spec()}"
        )
    if host.page_size != device.page_size:
        raise ValueError(
            f"host page_size {host.page_size} differs from device page_size {device.page_size}"
        )
    hs = as_slot_array(host_slots, "host_slots")
    ds = as_slot_array(device_slots, "device_slots")
    if hs.size != ds.size:
        raise ValueError(f"host_slots has {hs.size} slots but device_slots has {ds.size}")
    host_pages = check_pages(hs, host.page_size, host.size, "host_slots")
    device_pages = check_pages(ds, device.page_size, device.size, "device_slots")
    return PagePlan(
        host_pages.astype(np.int64, copy=True),
        device_pages.astype(np.int64, copy=True),
        host.page_size,
    )
