"""The copy engine for host memory: a move is batched row copies (rows.py), through the
compiled row copier where it builds (native/rowcopy.py), else numpy."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from hicache.kernels.cpu_plans import CpuPlans, PageSetup, Pairs, pair_row
from hicache.kernels.native.copier import PageCopier, PendingCopy
from hicache.kernels.native.rowcopy import native_rows, unavailable_reason
from hicache.kernels.pools import HostPool
from hicache.kernels.rows import SCRATCH_BYTES, copy_rows, require_host_memory, split_rows

_MIN_ROW_BYTES = 256
"""Views of one transfer are merged into one row space only with rows at least this long
(shorter rows cost more per byte than the separate moves they would replace)."""

_PARALLEL_BYTES = 4 << 20
"""Moves at least this large are split over the engine's `threads`."""

_STREAMING_BYTES = 4 << 20
"""Moves at least this large (twice this machine's L2) bypass the cache on the destination
side (compiled copier only): they would evict more than they leave behind."""


class CpuEngine:
    """Host-memory copies as batched row copies (rows.py): a move of every (layer, component)
    of a transfer is one row plan over all the views, run in one or a few numpy calls; with
    `threads` > 1, large moves are split over that many threads (the calling one and helpers
    this engine starts on first need). Direct io copies each run with one copy; past
    `max_run_copies` copies it batches them as rows instead (per-run Python calls would cost
    more than the bytes)."""

    kind = "cpu"
    max_run_copies = 64

    def __init__(
        self,
        scratch_bytes: int = SCRATCH_BYTES,
        *,
        threads: int | None = None,
        parallel_bytes: int = _PARALLEL_BYTES,
        native: bool | None = None,
    ) -> None:
        """`native`: use the compiled row copier (native/rowcopy.py): None = where it builds,
        True = required (RuntimeError naming why it is unavailable), False = numpy only.
        `threads`: copy threads per move of at least `parallel_bytes`. Default: two (one
        where the host has one core) with the compiled copier, whose scattered-row gathers
        are latency-bound, so a second thread overlaps their misses; one with numpy."""
        self.native = None if native is False else native_rows()
        if native and self.native is None:
            raise RuntimeError(f"native row copies unavailable: {unavailable_reason()}")
        if threads is None:
            threads = min(2, os.cpu_count() or 1) if self.native is not None else 1
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._scratch_bytes = scratch_bytes
        self._threads = threads
        self._parallel_bytes = parallel_bytes
        self._scratches: list[np.ndarray] = []
        self._helpers: ThreadPoolExecutor | None = None
        self._helper_count = 0
        self._plans = CpuPlans(pairs_plans=self.native is not None)
        self.pair_cache: dict[Any, Any] = {}
        self._defer: tuple[PageCopier, list[PendingCopy]] | None = None  # see `deferring`

    @property
    def threads(self) -> int:
        return self._threads

    def host_words(self, host: HostPool) -> torch.Tensor:
        return host.buffer

    def move(
        self,
        pairs: Pairs,
        dst_pages: torch.Tensor,
        src_pages: torch.Tensor,
        *,
        host_is_dst: bool,
    ) -> None:
        """`dst[dst_pages] = src[src_pages]` for every (dst, src) pair of page views (all dst
        views alike, all src views alike). Mutates the dst views only."""
        if dst_pages.numel() == 0 or not pairs:
            return
        row = pair_row(pairs)
        if self.native is not None:
            setup = self._plans.page_setup(pairs, row)
            if setup is not None:
                self._copy_pages(setup, _int64(dst_pages.numpy()), _int64(src_pages.numpy()))
                return
        plans = self._plans
        if row * pairs[0][0].element_size() >= _MIN_ROW_BYTES or len(pairs) == 1:
            pairs = [(split_rows(d, row), split_rows(s, row)) for d, s in pairs]
            dst_space = plans.space([d for d, _ in pairs])
            src_space = plans.space([s for _, s in pairs])
        else:
            dst_space = src_space = None
        if dst_space is None or src_space is None:  # views not on one row grid: one by one
            for dst, src in pairs:
                self.gather_scatter(dst, dst_pages, src, src_pages, host_is_dst=host_is_dst)
            return
        (dst_grid, dst_key), (src_grid, src_key) = dst_space, src_space
        plan = plans.plan(dst_grid, dst_key, dst_pages, src_grid, src_key, src_pages, host_is_dst)
        row_bytes = dst_grid.array.shape[1] * dst_grid.array.itemsize
        n = plan.pairs
        parts = max(1, min(self._threads, n, n * row_bytes // self._parallel_bytes))
        while len(self._scratches) < parts or self._scratches[0].size < row_bytes:
            self._scratches = [
                np.empty(max(self._scratch_bytes, row_bytes), dtype=np.uint8)
                for _ in range(max(parts, len(self._scratches)))
            ]
        bounds = [n * i // parts for i in range(parts + 1)]
        streaming = n * row_bytes >= _STREAMING_BYTES
        scratches = self._scratches

        def copy(part: int) -> None:
            copy_rows(
                dst_grid.array,
                src_grid.array,
                plan,
                scratches[part],
                bounds[part],
                bounds[part + 1],
                native=self.native,
                streaming=streaming,
            )

        self._in_parts(parts, copy)

    def move_numpy(self, pairs: Pairs, dst_pages: np.ndarray, src_pages: np.ndarray) -> bool:
        """`move` with the pages as int64 numpy arrays (a `PagePlan`'s own), through the
        compiled page loop; False (nothing moved) where that loop does not apply. The loop's
        setup is kept per `pairs` list (transfer.py hands the same list for every transfer
        between the same pools), checked by identity."""
        if self.native is None or not pairs:
            return False
        if dst_pages.size == 0:
            return True
        setup = self._plans.page_setup_of(pairs)
        if setup is None:
            return False
        self._copy_pages(setup, _int64(dst_pages), _int64(src_pages))
        return True

    def _copy_pages(self, setup: PageSetup, dst_np: np.ndarray, src_np: np.ndarray) -> None:
        """Copy page pairs (dst_np[i], src_np[i]) by the page loop, split over the engine's
        threads when large."""
        native = self.native
        assert native is not None
        dst_grid, src_grid, runs = setup
        row_bytes = dst_grid.array.shape[1] * dst_grid.array.itemsize
        n = int(dst_np.size)
        nbytes = n * runs.rows * row_bytes
        streaming = nbytes >= _STREAMING_BYTES
        if self._defer is not None:  # on the copy thread, whole
            copier, queued = self._defer
            pending = copier.submit(
                dst_grid.array,
                src_grid.array,
                dst_np,
                dst_grid.page_rows,
                src_np,
                src_grid.page_rows,
                runs,
                streaming=streaming,
                dst_address=dst_grid.address or None,
                src_address=src_grid.address or None,
            )
            if pending is not None:
                queued.append(pending)
                return
        parts = max(1, min(self._threads, n, nbytes // self._parallel_bytes))
        bounds = [n * i // parts for i in range(parts + 1)]

        def copy(part: int) -> None:
            lo, hi = bounds[part], bounds[part + 1]
            native.copy_pages(
                dst_grid.array,
                src_grid.array,
                dst_np[lo:hi],
                dst_grid.page_rows,
                src_np[lo:hi],
                src_grid.page_rows,
                runs,
                streaming=streaming,
                dst_address=dst_grid.address or None,
                src_address=src_grid.address or None,
            )

        self._in_parts(parts, copy)

    @contextmanager
    def deferring(self, copier: PageCopier) -> Iterator[list[PendingCopy]]:
        """Within the block, copies by the compiled page loop are queued on `copier` instead of
        run here; the list fills with their pending jobs (every other copy still runs here,
        and a job the copier cannot take too). Not reentrant."""
        queued: list[PendingCopy] = []
        self._defer = (copier, queued)
        try:
            yield queued
        finally:
            self._defer = None

    def _in_parts(self, parts: int, copy: Callable[[int], None]) -> None:
        """`copy(part)` for each part: part 0 on this thread, the others on helper threads
        (started, or restarted with more, on first need); returns once all are done."""
        helping: list[Future[None]] = []
        if parts > 1:
            if self._helpers is None or self._helper_count < parts - 1:
                if self._helpers is not None:
                    self._helpers.shutdown(wait=False)
                self._helpers = ThreadPoolExecutor(parts - 1, thread_name_prefix="hicache-copy")
                self._helper_count = parts - 1
            helping = [self._helpers.submit(copy, i) for i in range(1, parts)]
        try:
            copy(0)
        finally:
            for future in helping:
                future.result()

    def gather_scatter(
        self,
        dst: torch.Tensor,
        dst_pages: torch.Tensor,
        src: torch.Tensor,
        src_pages: torch.Tensor,
        *,
        host_is_dst: bool = False,
    ) -> None:
        if dst_pages.numel() == 0:
            return
        dst_space, src_space = self._plans.space([dst]), self._plans.space([src])
        if dst_space is None or src_space is None:  # rows off the grid: generic (slow) copy
            dst[dst_pages] = src[src_pages]
            return
        self.move([(dst, src)], dst_pages, src_pages, host_is_dst=host_is_dst)

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        require_host_memory([dst, src], "the CPU copy engine")
        if dst.is_contiguous() and src.is_contiguous():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        else:
            np.copyto(dst.numpy(), src.numpy())

    def synchronize(self) -> None:
        """CPU copies are synchronous: nothing to wait for."""


def _int64(pages: np.ndarray) -> np.ndarray:
    return (
        pages
        if pages.dtype == np.int64 and pages.flags.c_contiguous
        else np.ascontiguousarray(pages, dtype=np.int64)
    )
