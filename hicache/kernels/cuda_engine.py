"""The copy engine for a CUDA device: copies between pinned host memory and the device,
enqueued on a stream."""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import numpy as np
import torch

from hicache.kernels.direct_copies import (
    Issuer,
    PieceLayout,
    choose_issuer,
    copy_list,
    piece_layout,
)
from hicache.kernels.indices import PagePlan
from hicache.kernels.names import DEFAULT_TRANSFER_SMS, MAX_TRANSFER_SMS
from hicache.kernels.pools import HostPool


def _check(result: Any, what: str) -> Any:
    """The value of a cuda-python `(err, value)` result; RuntimeError naming `what` on error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
    return rest[0] if rest else None


def _destroy_own(rt: Any, stream: Any, events: list[Any]) -> None:
    for event in events:
        rt.cudaEventDestroy(event)
    rt.cudaStreamDestroy(stream)


class CudaEngine:
    """Copies between pinned host memory and a CUDA device, enqueued on `stream` (a
    cuda-python stream handle, or None for torch's current stream).

    Kernel io runs on the GPU over a device mapping of the pinned host buffer (unified
    addressing): one launch of the Triton copy kernel per move on at most `transfer_sms` SMs
    (triton_copy.py; `kernel_path` says which), else torch index ops, one per view; nothing
    blocks the calling thread. Direct io enqueues a transfer's
    whole copy list with one batched DMA call (direct_copies.py; `direct_issuer` says which
    issuer, None: one cudaMemcpyAsync per contiguous run from Python). Without a mapping (host
    pool not pinned) kernel io falls back to staging through the CPU, which blocks the calling
    thread but stays correct."""

    kind = "cuda"
    max_run_copies = sys.maxsize

    def __init__(
        self,
        device: torch.device,
        stream: Any = None,
        *,
        issuer: Issuer | str | None = "auto",
        transfer_sms: int = DEFAULT_TRANSFER_SMS,
        kernel_copies: str | None = None,
    ) -> None:
        """`stream`: a cuda-python `cudaStream_t`, or None for torch's current stream.
        `issuer`: how direct io enqueues its copy lists ("auto": `choose_issuer()` on first
        use; None: run by run from Python; or an `Issuer`). `transfer_sms`: the SMs kernel
        io's copy kernel may occupy. `kernel_copies`: "triton" (the copy kernel, RuntimeError
        where triton does not import), "torch" (index ops) or None (`HICACHE_KERNEL_COPIES`,
        else triton where it imports)."""
        from cuda.bindings import runtime as cudart

        check_transfer_sms(transfer_sms)
        self._cudart = cudart
        self.device = device
        self._stream = stream
        self.transfer_sms = transfer_sms
        self.kernel_path, self.kernel_reason = _kernel_path(kernel_copies)
        self._shapes: tuple[Any, Any] | None = None  # (pair list, its MoveShape or None)
        self._aliases: dict[int, torch.Tensor | None] = {}
        self.pair_cache: dict[Any, Any] = {}
        self._issuer = issuer
        self.issuer_reason = "" if issuer == "auto" else "given"
        self._layouts: tuple[Any, list[PieceLayout]] | None = None
        self._own: tuple[Any, Any, Any] | None = None  # own stream and two events, made once

    @property
    def direct_issuer(self) -> Issuer | None:
        """The issuer of direct io's copy lists (chosen on first use; `issuer_reason` says
        why), or None for run-by-run copies."""
        if isinstance(self._issuer, str):
            self._issuer, self.issuer_reason = choose_issuer()
        return self._issuer

    def copy_direct(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], plan: PagePlan, *, to_device: bool
    ) -> bool:
        """Direct io of `plan` for every (dst, src) pair of page views as one copy list, one
        issuer call; False (nothing moved) without an issuer."""
        issuer = self.direct_issuer
        if issuer is None:
            return False
        kept = self._layouts
        if kept is None or kept[0] is not pairs:  # the pair lists are kept by transfer.py
            kept = self._layouts = (pairs, [piece_layout(dst, src) for dst, src in pairs])
        dst_pages, src_pages = (
            (plan.device_pages, plan.host_pages)
            if to_device
            else (plan.host_pages, plan.device_pages)
        )
        order = np.argsort(plan.host_pages, kind="stable")
        dsts, srcs, sizes = copy_list(kept[1], dst_pages, src_pages, order)
        if self._stream is not None:
            issuer.issue(dsts, srcs, sizes, int(self._stream))
            return True
        current = int(torch.cuda.current_stream(self.device).cuda_stream)
        if current:
            issuer.issue(dsts, srcs, sizes, current)
            return True
        # The legacy default stream, which the batch calls refuse: issue on our own stream,
        # ordered after the work already queued and before the work queued next.
        stream, before, after = self._own_stream()
        rt = self._cudart
        _check(rt.cudaEventRecord(before, rt.cudaStream_t(0)), "cudaEventRecord")
        _check(rt.cudaStreamWaitEvent(stream, before, 0), "cudaStreamWaitEvent")
        issuer.issue(dsts, srcs, sizes, int(stream))
        _check(rt.cudaEventRecord(after, stream), "cudaEventRecord")
        _check(rt.cudaStreamWaitEvent(rt.cudaStream_t(0), after, 0), "cudaStreamWaitEvent")
        return True

    def _own_stream(self) -> tuple[Any, Any, Any]:
        if self._own is None:
            rt = self._cudart
            with torch.cuda.device(self.device):
                stream = _check(
                    rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"
                )
                events = [
                    _check(
                        rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreate"
                    )
                    for _ in range(2)
                ]
            self._own = (stream, events[0], events[1])
            # an engine made per call (transfer.py's load_layer/backup without one) must not
            # leave its stream behind; work still queued on them completes first (CUDA's rule)
            weakref.finalize(self, _destroy_own, rt, stream, events).atexit = False
        return self._own

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
        """Every pair's pages: one launch of the Triton copy kernel where it applies (views on
        the GPU, the host side mapped; `kernel_path`), else a torch index op per view."""
        if self.kernel_path == "triton" and pairs and dst_pages.is_cuda:
            kept = self._shapes
            if kept is None or kept[0] is not pairs:  # transfer.py keeps its pair lists
                on_gpu = all(d.is_cuda and s.is_cuda for d, s in pairs)
                kept = self._shapes = (pairs, _triton().move_shape(pairs) if on_gpu else None)
            if kept[1] is not None:
                _triton().launch(kept[1], dst_pages, src_pages, self.transfer_sms)
                return
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


KERNEL_COPIES = ("triton", "torch")


def check_transfer_sms(transfer_sms: object) -> None:
    """ValueError unless `transfer_sms` is an int in [1, MAX_TRANSFER_SMS]."""
    if (
        isinstance(transfer_sms, bool)
        or not isinstance(transfer_sms, int)
        or not 1 <= transfer_sms <= MAX_TRANSFER_SMS
    ):
        raise ValueError(
            f"transfer_sms={transfer_sms!r} must be an integer in [1, {MAX_TRANSFER_SMS}]"
        )


def _triton() -> Any:
    from hicache.kernels import triton_copy

    return triton_copy


def _kernel_path(prefer: str | None) -> tuple[str, str]:
    """("triton" | "torch", why) for kernel io's copies; `prefer` as `CudaEngine` takes it."""
    prefer = prefer or os.environ.get("HICACHE_KERNEL_COPIES") or None
    if prefer is not None and prefer not in KERNEL_COPIES:
        raise ValueError(f"unknown kernel copies {prefer!r}; expected one of {list(KERNEL_COPIES)}")
    if prefer == "torch":
        return "torch", "torch index ops requested"
    try:
        _triton()
    except ImportError as exc:
        if prefer == "triton":
            raise RuntimeError(f"the Triton copy kernel is unavailable: {exc}") from exc
        return "torch", f"triton unavailable ({exc}): torch index ops"
    return "triton", "Triton copy kernel"
