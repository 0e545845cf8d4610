"""The copy engine for a CUDA device: copies between pinned host memory and the device,
enqueued on a stream."""

from __future__ import annotations

import sys
from typing import Any

import torch

from hicache.kernels.pools import HostPool


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
