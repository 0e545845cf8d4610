"""The Mooncake backend's own registered arena: per-lane header slots and staging.

Mooncake transfers only from and into memory registered with its client (`register_buffer`;
on RDMA that pins and maps it). The host pool registers itself once (backends/registered.py
keeps those regions); a page piece wholly inside a registered region goes zero-copy, any other
piece is copied through a lane's staging area.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEADER_SLOT = 512
"""Bytes reserved per page for its framing header (fixed part plus key): keys up to 488 bytes."""


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
