"""Transfer streams: CUDA (cuda-python), CPU (worker threads) and virtual (deterministic)."""

from hicache.kernels.streams.base import (
    FaultHook,
    FaultPoint,
    LayerNotReady,
    LoadHandle,
    OnDone,
    StreamSelection,
    TransferFailed,
    TransferStreams,
)
from hicache.kernels.streams.select import cuda_driver_status, make_streams

__all__ = [
    "FaultHook",
    "FaultPoint",
    "LayerNotReady",
    "LoadHandle",
    "OnDone",
    "StreamSelection",
    "TransferFailed",
    "TransferStreams",
    "cuda_driver_status",
    "make_streams",
]
