"""Copy engines: the two primitive moves every transfer is made of, per device kind.

- `gather_scatter(dst, dst_pages, src, src_pages)`: `dst[dst_pages] = src[src_pages]` on page
  views (the `kernel` io backend).
- `copy_run(dst, src)`: one copy of equally shaped slices (the `direct` io backend).

An engine is used by one thread at a time (it owns scratch memory). Views are word-typed
(pages, page_size, heads, words) tensors: bytes move, the KV dtype is irrelevant.
"""

from __future__ import annotations

import ctypes

import torch

_STAGING_BYTES = 1 << 20
"""Kernel io on CPU gathers through a reused scratch buffer this large: small enough to stay
in cache between the gather and the scatter, large enough to amortise per-op overhead."""


class CpuEngine:
    """Host-memory copies. Kernel io gathers into a reused scratch buffer and scatters from it;
    direct io copies each run with one memmove when both sides are contiguous."""

    kind = "cpu"

    def __init__(self, staging_bytes: int = _STAGING_BYTES):
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._staging_bytes = staging_bytes

    def host_words(self, host) -> torch.Tensor:
        return host.buffer

    def gather_scatter(self, dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor, src_pages: torch.Tensor) -> None:
        page_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
        if page_bytes == 0 or dst_pages.numel() == 0:
            return
        chunk = max(1, self._staging_bytes // page_bytes)
        need = min(chunk, dst_pages.numel()) * page_bytes
        if self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8)
        words = self._staging.view(src.dtype)
        for start in range(0, dst_pages.numel(), chunk):
            d_idx = dst_pages[start : start + chunk]
            out = words[: d_idx.numel() * src[0].numel()].view(d_idx.numel(), *src.shape[1:])
            torch.index_select(src, 0, src_pages[start : start + chunk], out=out)
            dst.index_copy_(0, d_idx, out)

    def copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        else:
            dst.copy_(src)

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

    def gather_scatter(self, dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor, src_pages: torch.Tensor) -> None:
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
