"""Copy engines: the two primitive moves every transfer is made of, per device kind.

- `gather_scatter(dst, dst_pages, src, src_pages, host_is_dst=)`: `dst[dst_pages] =
  src[src_pages]` on page views (the `kernel` io backend; also batched direct io on CPU).
- `copy_run(dst, src)`: one copy of equally shaped slices (the `direct` io backend), used while
  a move has at most `max_run_copies` runs.

An engine is used by one thread at a time (it owns scratch memory). Views are word-typed
(pages, page_size, heads, words) tensors: bytes move, the KV dtype is irrelevant.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from hicache.kernels.rows import SCRATCH_BYTES, RowGrid, RowPlan, copy_rows, plan_rows, row_grid

_CACHED_PLANS = 8
"""Row plans kept per engine: a transfer reuses one plan for each of its (layer, component)."""


class CpuEngine:
    """Host-memory copies, single-threaded, as batched row copies (rows.py): kernel io moves a
    whole transfer of one (layer, component) in one or a few numpy calls. Direct io copies
    each run with one copy; past `max_run_copies` runs it batches them as rows instead (per-run
    Python calls would cost more than the bytes)."""

    kind = "cpu"
    max_run_copies = 16

    def __init__(self, scratch_bytes: int = SCRATCH_BYTES):
        self._scratch_bytes = scratch_bytes
        self._scratch = np.empty(0, dtype=np.uint8)
        self._shapes: dict[tuple, tuple[int, np.ndarray] | None] = {}
        self._plans: dict[tuple, tuple[torch.Tensor, torch.Tensor, RowPlan]] = {}

    def host_words(self, host) -> torch.Tensor:
        return host.buffer

    def _grid(self, view: torch.Tensor) -> RowGrid | None:
        key = (tuple(view.shape), view.stride())
        if key not in self._shapes:
            grid = row_grid(view)
            self._shapes[key] = None if grid is None else (grid.page_rows, grid.inner)
            return grid
        known = self._shapes[key]
        if known is None:
            return None
        page_rows, inner = known
        row = view.shape[-1]
        extent = (view.shape[0] - 1) * page_rows + int(inner.max()) + 1
        flat = torch.as_strided(view, (extent * row,), (1,))
        return RowGrid(flat.numpy().reshape(extent, row), page_rows, inner)

    def _plan(self, dst: RowGrid, dst_pages: torch.Tensor, src: RowGrid, src_pages: torch.Tensor,
              host_is_dst: bool) -> RowPlan:
        key = (id(dst_pages), id(src_pages), dst.page_rows, dst.inner.tobytes(),
               src.page_rows, src.inner.tobytes(), host_is_dst)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is dst_pages and hit[1] is src_pages:
            return hit[2]
        plan = plan_rows(dst, dst_pages.numpy(), src, src_pages.numpy(), prefer_dst_order=host_is_dst)
        if len(self._plans) >= _CACHED_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (dst_pages, src_pages, plan)
        return plan

    def gather_scatter(self, dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor,
                       src_pages: torch.Tensor, *, host_is_dst: bool = False) -> None:
        if dst_pages.numel() == 0:
            return
        dst_grid, src_grid = self._grid(dst), self._grid(src)
        if dst_grid is None or src_grid is None:  # rows off the grid: generic (slow) copy
            dst[dst_pages] = src[src_pages]
            return
        if self._scratch.size < self._scratch_bytes or self._scratch.size < src.shape[-1] * src.element_size():
            self._scratch = np.empty(max(self._scratch_bytes, src.shape[-1] * src.element_size()), dtype=np.uint8)
        plan = self._plan(dst_grid, dst_pages, src_grid, src_pages, host_is_dst)
        copy_rows(dst_grid.array, src_grid.array, plan, self._scratch)

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        else:
            np.copyto(dst.numpy(), src.numpy())

    def synchronize(self) -> None:
        """CPU copies are synchronous: nothing to wait for."""


class CudaEngine:
    """Copies between pinned host memory and a CUDA device, enqueued on `stream` (a
    cuda-python stream handle, or None for torch's current stream).

    Kernel io runs torch index ops on the GPU over a device mapping of the pinned host buffer
    (unified addressing), so nothing blocks the calling thread; direct io issues one
    cudaMemcpyAsync per contiguous run. Without a mapping (host pool not pinned) it falls back to
    staging through the CPU, which blocks the calling thread but stays correct."""

    kind = "cuda"
    max_run_copies = sys.maxsize

    def __init__(self, device: torch.device, stream=None):
        from cuda.bindings import runtime as cudart

        self._cudart = cudart
        self.device = device
        self._stream = stream
        self._aliases: dict[int, torch.Tensor | None] = {}

    def host_words(self, host) -> torch.Tensor:
        """The host buffer as a CUDA tensor aliasing the pinned memory, or the CPU buffer."""
        key = host.buffer.data_ptr()
        if key not in self._aliases:
            self._aliases[key] = _device_alias(self._cudart, host.buffer, self.device) if host.pinned else None
        alias = self._aliases[key]
        return host.buffer if alias is None else alias

    def gather_scatter(self, dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor,
                       src_pages: torch.Tensor, *, host_is_dst: bool = False) -> None:
        if dst_pages.numel() == 0:
            return
        if src.device.type == "cpu":  # unmapped host -> device: gather on CPU, copy, scatter
            moved = src.index_select(0, src_pages.cpu()).to(dst.device)
            dst.index_copy_(0, dst_pages.to(dst.device), moved)
        elif dst.device.type == "cpu":  # device -> unmapped host
            moved = src.index_select(0, src_pages.to(src.device)).cpu()
            dst.index_copy_(0, dst_pages.cpu(), moved)
        else:
            dst.index_copy_(0, dst_pages.to(dst.device), src.index_select(0, src_pages.to(src.device)))

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            stream = self._stream
            if stream is None:
                stream = self._cudart.cudaStream_t(torch.cuda.current_stream(self.device).cuda_stream)
            (err,) = self._cudart.cudaMemcpyAsync(
                dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                self._cudart.cudaMemcpyKind.cudaMemcpyDefault, stream,
            )
            if err != self._cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemcpyAsync failed: {err}")
        else:
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class _CudaArray:
    """Minimal __cuda_array_interface__ exporter so torch can wrap a device pointer."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3, "strides": None,
        }


def _device_alias(cudart, buffer: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA uint8 tensor over the pinned `buffer` (same memory), or None if not mappable."""
    err, attrs = cudart.cudaPointerGetAttributes(buffer.data_ptr())
    if err != cudart.cudaError_t.cudaSuccess or not attrs.devicePointer:
        return None
    with torch.cuda.device(device):
        alias = torch.as_tensor(_CudaArray(int(attrs.devicePointer), buffer.numel()), device=device)
    return alias


def engine_for(device: torch.device, stream=None):
    """The engine that moves bytes between host memory and `device`."""
    return CudaEngine(device, stream) if device.type == "cuda" else CpuEngine()
