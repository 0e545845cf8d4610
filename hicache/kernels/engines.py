"""Copy engines: the two primitive moves every transfer is made of, per device kind.

- `move(pairs, dst_pages, src_pages, host_is_dst=)`: `dst[dst_pages] = src[src_pages]` for
  every (dst, src) pair of page views of one transfer (the `kernel` io backend; also batched
  direct io on CPU); `gather_scatter` is the same for one pair.
- `copy_run(dst, src)`: one copy of equally shaped slices (the `direct` io backend), used while
  a move needs at most `max_run_copies` copies (runs x views).

An engine is used by one thread at a time (it owns scratch memory). Views are word-typed
(pages, page_size, heads, words) tensors: bytes move, the KV dtype is irrelevant. The engines
themselves: cpu_engine.py and cuda_engine.py.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hicache.kernels.cpu_engine import CpuEngine
from hicache.kernels.cuda_engine import CudaEngine
from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.pools import HostPool

__all__ = ["CopyEngine", "CpuEngine", "CudaEngine", "engine_for"]


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


def engine_for(
    device: torch.device, stream: Any = None, *, transfer_sms: int = DEFAULT_TRANSFER_SMS
) -> CopyEngine:
    """The engine that moves bytes between host memory and `device` (`transfer_sms`: the SMs
    a CUDA engine's copy kernel may occupy)."""
    if device.type == "cuda":
        return CudaEngine(device, stream, transfer_sms=transfer_sms)
    return CpuEngine()
