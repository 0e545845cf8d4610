"""Copy engines: the two primitive moves every transfer is made of, per device kind.

- `move(pairs, dst_pages, src_pages, host_is_dst=)`: `dst[dst_pages] = src[src_pages]` for
  every (dst, src) pair of page views of one transfer (the `kernel` io backend; also batched
  direct io on CPU); `gather_scatter` is the same for one pair.
- `copy_run(dst, src)`: one copy of equally shaped slices (the `direct` io backend), used while
  a move needs at most `max_run_copies` copies (runs x views).

An engine is used by one thread at a time (it owns scratch memory). Views are word-typed
(pages, page_size, heads, words) tensors: bytes move, the KV dtype is irrelevant.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from hicache.kernels.native import PageRuns, native_rows, unavailable_reason
from hicache.kernels.pools import HostPool
from hicache.kernels.rows import (
    SCRATCH_BYTES,
    RowGrid,
    RowPlan,
    common_row,
    copy_rows,
    page_rows_of,
    plan_pairs,
    plan_rows,
    row_space,
    split_rows,
)

_CACHED_ROWS = 1 << 22
"""Row pairs kept per engine (about 64 MiB): a transfer's plan serves each of its layers."""


_MIN_ROW_BYTES = 256
"""Views of one transfer are merged into one row space only with rows at least this long
(shorter rows cost more per byte than the separate moves they would replace)."""

_PARALLEL_BYTES = 4 << 20
"""Moves at least this large are split over the engine's `threads`."""

_STREAMING_BYTES = 4 << 20
"""Moves at least this large (twice this machine's L2) bypass the cache on the destination
side (compiled copier only): they would evict more than they leave behind."""


_CACHED_SPACES = 1024
"""Row grids an engine keeps (a few per layer and component of each pool pair it serves)."""


class CopyEngine(Protocol):
    """What the transfer functions use of an engine (`CpuEngine`, `CudaEngine`)."""

    kind: str
    max_run_copies: int
    pair_cache: dict[Any, Any]  # transfer.py's merged page views, kept per engine

    def host_words(self, host: HostPool) -> torch.Tensor: ...

    def move(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        dst_pages: torch.Tensor,
        src_pages: torch.Tensor,
        *,
        host_is_dst: bool,
    ) -> None: ...

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...


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
        """`native`: use the compiled row copier (native.py): None = where it builds, True =
        required (RuntimeError naming why it is unavailable), False = numpy only.
        `threads`: copy threads per move of at least `parallel_bytes`. Default: two (one
        where the host has one core) with the compiled copier, whose scattered-row gathers
        are latency-bound and gain 1.3-1.7x from a second thread; one with numpy, where a
        second thread measured slower (docs/benchmarks.md "Transfers")."""
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
        self._shapes: dict[tuple[Any, ...], tuple[int, np.ndarray] | None] = {}
        self._spaces: dict[tuple[Any, ...], tuple[RowGrid, tuple[Any, ...]] | None] = {}
        self._plans: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, RowPlan]] = {}
        self._cached_rows = 0
        self._runs: dict[tuple[Any, ...], PageRuns] = {}
        self._page_setups: dict[int, tuple[Any, tuple[RowGrid, RowGrid, PageRuns] | None]] = {}
        self.pair_cache: dict[Any, Any] = {}

    @property
    def threads(self) -> int:
        return self._threads

    def host_words(self, host: HostPool) -> torch.Tensor:
        return host.buffer

    def _space(self, views: list[torch.Tensor]) -> tuple[RowGrid, tuple[Any, ...]] | None:
        # Per-layer loads ask for the same few view sets over and over; building the row grid
        # (a numpy array over the views' memory) was half of a small move's fixed cost. A grid
        # is named by the views' addresses, shape, strides and dtype, which fix the memory it
        # spans, so a hit is right even if the pool behind it was replaced by an identical one.
        first = views[0]
        key = (tuple(first.shape), first.stride())
        space_key = (key, first.dtype, tuple(v.data_ptr() for v in views))
        if space_key in self._spaces:
            return self._spaces[space_key]
        if key not in self._shapes:
            self._shapes[key] = page_rows_of(first)
        space = row_space(views, self._shapes[key])
        if len(self._spaces) >= _CACHED_SPACES:
            self._spaces.clear()
        self._spaces[space_key] = space
        return space

    def _plan(
        self,
        dst: RowGrid,
        dst_key: tuple[Any, ...],
        dst_pages: torch.Tensor,
        src: RowGrid,
        src_key: tuple[Any, ...],
        src_pages: torch.Tensor,
        host_is_dst: bool,
    ) -> RowPlan:
        key = (id(dst_pages), id(src_pages), dst_key, src_key, host_is_dst)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is dst_pages and hit[1] is src_pages:
            return hit[2]
        if self.native is not None:
            plan = plan_pairs(dst, dst_pages.numpy(), src, src_pages.numpy(), by_dst=False)
        else:
            plan = plan_rows(
                dst, dst_pages.numpy(), src, src_pages.numpy(), prefer_dst_order=host_is_dst
            )
        while self._plans and self._cached_rows + plan.pairs > _CACHED_ROWS:
            self._cached_rows -= self._plans.pop(next(iter(self._plans)))[2].pairs
        if plan.pairs <= _CACHED_ROWS:
            self._plans[key] = (dst_pages, src_pages, plan)
            self._cached_rows += plan.pairs
        return plan

    def move(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        dst_pages: torch.Tensor,
        src_pages: torch.Tensor,
        *,
        host_is_dst: bool,
    ) -> None:
        """`dst[dst_pages] = src[src_pages]` for every (dst, src) pair of page views (all dst
        views alike, all src views alike). Mutates the dst views only."""
        if dst_pages.numel() == 0 or not pairs:
            return
        row = math.gcd(common_row([d for d, _ in pairs]), common_row([s for _, s in pairs]))
        if self.native is not None:
            setup = self._page_setup(pairs, row)
            if setup is not None:
                self._copy_pages(*setup, _int64(dst_pages.numpy()), _int64(src_pages.numpy()))
                return
        if row * pairs[0][0].element_size() >= _MIN_ROW_BYTES or len(pairs) == 1:
            pairs = [(split_rows(d, row), split_rows(s, row)) for d, s in pairs]
            dst_space = self._space([d for d, _ in pairs])
            src_space = self._space([s for _, s in pairs])
        else:
            dst_space = src_space = None
        if dst_space is None or src_space is None:  # views not on one row grid: one by one
            for dst, src in pairs:
                self.gather_scatter(dst, dst_pages, src, src_pages, host_is_dst=host_is_dst)
            return
        (dst_grid, dst_key), (src_grid, src_key) = dst_space, src_space
        plan = self._plan(dst_grid, dst_key, dst_pages, src_grid, src_key, src_pages, host_is_dst)
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
        helping: list[Future[None]] = []
        if parts > 1:
            if self._helpers is None or self._helper_count < parts - 1:
                if self._helpers is not None:
                    self._helpers.shutdown(wait=False)
                self._helpers = ThreadPoolExecutor(parts - 1, thread_name_prefix="hicache-copy")
                self._helper_count = parts - 1
            helping = [
                self._helpers.submit(
                    copy_rows,
                    dst_grid.array,
                    src_grid.array,
                    plan,
                    self._scratches[i],
                    bounds[i],
                    bounds[i + 1],
                    native=self.native,
                    streaming=streaming,
                )
                for i in range(1, parts)
            ]
        try:
            copy_rows(
                dst_grid.array,
                src_grid.array,
                plan,
                self._scratches[0],
                bounds[0],
                bounds[1],
                native=self.native,
                streaming=streaming,
            )
        finally:
            for future in helping:
                future.result()

    def move_numpy(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        dst_pages: np.ndarray,
        src_pages: np.ndarray,
    ) -> bool:
        """`move` with the pages as int64 numpy arrays (a `PagePlan`'s own), through the
        compiled page loop; False (nothing moved) where that loop does not apply. The loop's
        setup is kept per `pairs` list (transfer.py hands the same list for every transfer
        between the same pools), checked by identity."""
        if self.native is None or not pairs:
            return False
        if dst_pages.size == 0:
            return True
        hit = self._page_setups.get(id(pairs))
        if hit is not None and hit[0] is pairs:
            setup = hit[1]
        else:
            row = math.gcd(common_row([d for d, _ in pairs]), common_row([s for _, s in pairs]))
            setup = self._page_setup(pairs, row)
            if len(self._page_setups) >= _CACHED_SPACES:
                self._page_setups.clear()
            self._page_setups[id(pairs)] = (pairs, setup)
        if setup is None:
            return False
        self._copy_pages(*setup, _int64(dst_pages), _int64(src_pages))
        return True

    def _page_setup(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], row: int
    ) -> tuple[RowGrid, RowGrid, PageRuns] | None:
        """What the compiled copier's page loop needs for these views: every view of the
        transfer on one row grid per side, and one page's row pattern (runs of rows consecutive
        on both sides, cached per pair of grids) applied to each page pair. Planning is then
        O(pages), not O(rows): a backup of short strided rows (page_first with small heads:
        16 B rows) built a pair table per row that cost more than the copy. None when the views
        are not on grids."""
        split = [(split_rows(d, row), split_rows(s, row)) for d, s in pairs]
        dst_space = self._space([d for d, _ in split])
        src_space = self._space([s for _, s in split])
        if dst_space is None or src_space is None:
            return None
        (dst_grid, dst_key), (src_grid, src_key) = dst_space, src_space
        if dst_grid.inner.size != src_grid.inner.size:
            return None
        runs = self._runs.get((dst_key, src_key))
        if runs is None:
            runs = _page_runs(dst_grid, src_grid)
            if len(self._runs) >= _CACHED_SPACES:
                self._runs.clear()
            self._runs[(dst_key, src_key)] = runs
        return dst_grid, src_grid, runs

    def _copy_pages(
        self,
        dst_grid: RowGrid,
        src_grid: RowGrid,
        runs: PageRuns,
        dst_np: np.ndarray,
        src_np: np.ndarray,
    ) -> None:
        """Copy page pairs (dst_np[i], src_np[i]) by the page loop, split over the engine's
        threads when large."""
        native = self.native
        assert native is not None
        row_bytes = dst_grid.array.shape[1] * dst_grid.array.itemsize
        n = int(dst_np.size)
        nbytes = n * runs.rows * row_bytes
        parts = max(1, min(self._threads, n, nbytes // self._parallel_bytes))
        bounds = [n * i // parts for i in range(parts + 1)]
        streaming = nbytes >= _STREAMING_BYTES

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
        dst_space, src_space = self._space([dst]), self._space([src])
        if dst_space is None or src_space is None:  # rows off the grid: generic (slow) copy
            dst[dst_pages] = src[src_pages]
            return
        self.move([(dst, src)], dst_pages, src_pages, host_is_dst=host_is_dst)

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        else:
            np.copyto(dst.numpy(), src.numpy())

    def synchronize(self) -> None:
        """CPU copies are synchronous: nothing to wait for."""


_PREFETCH_LINES = 64
"""Source cache lines of a page the page loop touches ahead (the first 4 KiB it reads)."""


def _int64(pages: np.ndarray) -> np.ndarray:
    return (
        pages
        if pages.dtype == np.int64 and pages.flags.c_contiguous
        else np.ascontiguousarray(pages, dtype=np.int64)
    )


def _page_runs(dst: RowGrid, src: RowGrid) -> PageRuns:
    """One page's row pattern between two grids with the same views and inner rows: pair j
    (view v, inner row i) goes from `src.offsets[v] + src.inner[i]` to the same on `dst`, in
    destination order, merged into runs where both sides advance by one row. Pure."""
    d = (dst.offsets[:, None] + dst.inner[None, :]).ravel()
    s = (src.offsets[:, None] + src.inner[None, :]).ravel()
    order = np.argsort(d, kind="stable")
    d, s = d[order], s[order]
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [d.size]))).astype(np.int64)
    row_bytes = src.array.shape[1] * src.array.itemsize
    lines: list[int] = []
    seen: set[int] = set()
    for first, count in zip((s[starts] * row_bytes).tolist(), (lengths * row_bytes).tolist()):
        if len(lines) >= _PREFETCH_LINES:
            break
        for offset in range(first - first % 64, first + count, 64):
            if offset not in seen and len(lines) < _PREFETCH_LINES:
                seen.add(offset)
                lines.append(offset)
    return PageRuns(d[starts], s[starts], lengths, np.array(lines, dtype=np.int64))


class CudaEngine:
    """Copies between pinned host memory and a CUDA device, enqueued on `stream` (a
    cuda-python stream handle, or None for torch's current stream).

    Kernel io runs torch index ops on the GPU over a device mapping of the pinned host buffer
    (unified addressing), so nothing blocks the calling thread; direct io issues one
    cudaMemcpyAsync per contiguous run. Without a mapping (host pool not pinned) it falls back to
    staging through the CPU, which blocks the calling thread but stays correct."""

    kind = "cuda"
    max_run_copies = sys.maxsize

    def __init__(self, device: torch.device, stream: Any = None) -> None:
        """`stream`: a cuda-python `cudaStream_t`, or None for torch's current stream."""
        from cuda.bindings import runtime as cudart

        self._cudart = cudart
        self.device = device
        self._stream = stream
        self._aliases: dict[int, torch.Tensor | None] = {}
        self.pair_cache: dict[Any, Any] = {}

    def host_words(self, host: HostPool) -> torch.Tensor:
        """The host buffer as a CUDA tensor aliasing the pinned memory, or the CPU buffer."""
        key = host.buffer.data_ptr()
        if key not in self._aliases:
            self._aliases[key] = (
                _device_alias(self._cudart, host.buffer, self.device) if host.pinned else None
            )
        alias = self._aliases[key]
        return host.buffer if alias is None else alias

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
        if src.device.type == "cpu":  # unmapped host -> device: gather on CPU, copy, scatter
            moved = src.index_select(0, src_pages.cpu()).to(dst.device)
            dst.index_copy_(0, dst_pages.to(dst.device), moved)
        elif dst.device.type == "cpu":  # device -> unmapped host
            moved = src.index_select(0, src_pages.to(src.device)).cpu()
            dst.index_copy_(0, dst_pages.cpu(), moved)
        else:
            dst.index_copy_(
                0, dst_pages.to(dst.device), src.index_select(0, src_pages.to(src.device))
            )

    def move(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        dst_pages: torch.Tensor,
        src_pages: torch.Tensor,
        *,
        host_is_dst: bool,
    ) -> None:
        for dst, src in pairs:
            self.gather_scatter(dst, dst_pages, src, src_pages, host_is_dst=host_is_dst)

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            stream = self._stream
            if stream is None:
                stream = self._cudart.cudaStream_t(
                    torch.cuda.current_stream(self.device).cuda_stream
                )
            (err,) = self._cudart.cudaMemcpyAsync(
                dst.data_ptr(),
                src.data_ptr(),
                dst.numel() * dst.element_size(),
                self._cudart.cudaMemcpyKind.cudaMemcpyDefault,
                stream,
            )
            if err != self._cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemcpyAsync failed: {err}")
        else:
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class _CudaArray:
    """Minimal __cuda_array_interface__ exporter so torch can wrap a device pointer."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


def _device_alias(cudart: Any, buffer: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA uint8 tensor over the pinned `buffer` (same memory), or None if not mappable."""
    err, attrs = cudart.cudaPointerGetAttributes(buffer.data_ptr())
    if err != cudart.cudaError_t.cudaSuccess or not attrs.devicePointer:
        return None
    with torch.cuda.device(device):
        alias = torch.as_tensor(_CudaArray(int(attrs.devicePointer), buffer.numel()), device=device)
    return alias


def engine_for(device: torch.device, stream: Any = None) -> CopyEngine:
    """The engine that moves bytes between host memory and `device`."""
    return CudaEngine(device, stream) if device.type == "cuda" else CpuEngine()
