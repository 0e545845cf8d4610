"""A copy thread for the compiled page loop (rowcopy.c, `hicache_copier_*`): page copies run in
submission order on a thread of their own, beside the event loop that queued them, as a
GPU's copy engine runs beside the host. Inline CPU streams copy their backups this way: the
loop goes on with the next call while the bytes move on the other core.

A job reads and writes the arrays it was given until it is done: `PendingCopy` keeps them
alive, and `PageCopier.stop` runs what is queued and joins the thread before it returns, so
no array is released under a running copy.
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from hicache.kernels.native.addresses import data_address
from hicache.kernels.native.rowcopy import NativeRows, PageRuns, page_args, page_error

CAPACITY = 64
"""Jobs that may wait at once; a submit past it returns None and the caller copies itself."""


class PendingCopy:
    """One queued page copy: `done()` once the thread has run it, then `error()` says whether
    rows fell out of range (skipped, as the synchronous call raises for)."""

    __slots__ = ("_result", "_address", "_keep", "_native", "_rows", "_dst_rows", "_src_rows")

    def __init__(
        self, native: NativeRows, keep: tuple[object, ...], rows: int, limits: tuple[int, int]
    ) -> None:
        self._result = np.zeros(2, dtype=np.int64)  # skipped rows, then 1 once done
        self._address = data_address(self._result)
        self._keep: tuple[object, ...] | None = keep  # what the job reads and writes
        self._native = native
        self._rows = rows
        self._dst_rows, self._src_rows = limits

    def done(self) -> bool:
        if self._keep is None:
            return True
        if self._native._copy_done(self._address) < 0:
            return False
        self._keep = None  # the thread is done with them
        return True

    def error(self) -> IndexError | None:
        """Once done: the out-of-range rows as the synchronous copy would raise them."""
        skipped = int(self._result[0])
        if not skipped:
            return None
        return page_error(skipped, self._rows, self._dst_rows, self._src_rows)


class PageCopier:
    """A started copy thread. Owned by one inline-copies object; `stop` before its pools go."""

    def __init__(self, native: NativeRows, capacity: int = CAPACITY) -> None:
        handle = native._copier_start(capacity)
        if not handle:
            raise OSError("the copy thread could not be started")
        self._native = native
        self._handle: int | None = handle
        # A forked child has no copy thread to stop. `getpid` kept here: a copier collected as
        # the interpreter shuts down may find the `os` module already torn down.
        self._getpid = os.getpid
        self._pid = self._getpid()
        self._queued: deque[PendingCopy] = deque()  # submitted, not yet seen done

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet seen done."""
        self._forget_landed()
        return len(self._queued)

    def _forget_landed(self) -> None:
        queued = self._queued
        while queued and queued[0].done():  # the thread runs them in order
            queued.popleft()

    def submit(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        dst_pages: np.ndarray,
        dst_page_rows: int,
        src_pages: np.ndarray,
        src_page_rows: int,
        runs: PageRuns,
        *,
        streaming: bool,
        dst_address: int | None = None,
        src_address: int | None = None,
    ) -> PendingCopy | None:
        """`NativeRows.copy_pages` with the same arguments, queued: the pending job, or None
        (the ring full or the thread stopped) when the caller must copy itself."""
        if self._handle is None:
            return None
        args = page_args(
            dst, src, dst_pages, dst_page_rows, src_pages, src_page_rows, runs, streaming,
            dst_address, src_address,
        )  # fmt: skip
        self._forget_landed()  # so the table stays as short as what is in flight
        pending = PendingCopy(
            self._native,
            (dst, src, dst_pages, src_pages, runs),
            int(dst_pages.size) * runs.rows,
            (dst.shape[0], src.shape[0]),
        )
        queued = self._native._copier_submit(self._handle, *args, pending._address)
        if queued < 0:
            return None
        self._queued.append(pending)
        return pending

    def stop(self) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None and self._getpid() == self._pid:
            self._native._copier_stop(handle)
            for pending in self._queued:
                pending.done()
        self._queued.clear()

    def __del__(self) -> None:
        self.stop()
