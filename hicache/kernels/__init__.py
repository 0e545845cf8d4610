"""The data plane: KV pools, host layouts, transfer functions, streams and events."""

from hicache.kernels.faults import FaultPlan
from hicache.kernels.geometry import DTYPES, Geometry, MHAGeometry, MLAGeometry, parse_geometry
from hicache.kernels.indices import PagePlan, plan_transfer
from hicache.kernels.layouts import LAYOUTS, Layout
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.rewrites import SettingRewrite, TransferSettings, resolve_transfer_settings
from hicache.kernels.streams import (
    FaultHook, FaultPoint, LayerNotReady, LoadHandle, StreamSelection, TransferFailed, TransferStreams,
    cuda_driver_status, make_streams,
)
from hicache.kernels.transfer import IO_BACKENDS, backup, load_layer, run_backup, run_load_all, run_load_layer

__all__ = [
    "DTYPES", "DevicePool", "FaultHook", "FaultPlan", "FaultPoint", "Geometry", "HostPool", "IO_BACKENDS",
    "LAYOUTS", "LayerNotReady", "Layout", "LoadHandle", "MHAGeometry", "MLAGeometry", "PagePlan",
    "SettingRewrite", "StreamSelection", "TransferFailed", "TransferSettings", "TransferStreams",
    "backup", "cuda_driver_status", "load_layer", "make_streams", "parse_geometry", "plan_transfer",
    "resolve_transfer_settings", "run_backup", "run_load_all", "run_load_layer",
]
