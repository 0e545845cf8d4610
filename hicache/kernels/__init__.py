"""The data plane: KV pools, host layouts, transfer functions, streams and events.

The names below load their module on first use (PEP 562), so importing one light submodule
(`hicache.kernels.names`, which config.py reads) does not load torch and the whole data plane.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.kernels.faults import FaultPlan
    from hicache.kernels.geometry import DTYPES, Geometry, MHAGeometry, MLAGeometry, parse_geometry
    from hicache.kernels.indices import PagePlan, plan_transfer
    from hicache.kernels.names import IO_BACKENDS, LAYOUTS, Layout
    from hicache.kernels.pools import DevicePool, HostPool
    from hicache.kernels.streams import (
        FaultHook,
        FaultPoint,
        LayerNotReady,
        LoadHandle,
        StreamSelection,
        TransferFailed,
        TransferStreams,
        cuda_driver_status,
        make_streams,
    )
    from hicache.kernels.transfer import (
        backup,
        load_layer,
        run_backup,
        run_load_all,
        run_load_layer,
    )

_MODULE_OF = {
    name: module
    for module, names in {
        "faults": ("FaultPlan",),
        "geometry": ("DTYPES", "Geometry", "MHAGeometry", "MLAGeometry", "parse_geometry"),
        "indices": ("PagePlan", "plan_transfer"),
        "names": ("IO_BACKENDS", "LAYOUTS", "Layout"),
        "pools": ("DevicePool", "HostPool"),
        "streams": (
            "FaultHook",
            "FaultPoint",
            "LayerNotReady",
            "LoadHandle",
            "StreamSelection",
            "TransferFailed",
            "TransferStreams",
            "cuda_driver_status",
            "make_streams",
        ),
        "transfer": ("backup", "load_layer", "run_backup", "run_load_all", "run_load_layer"),
    }.items()
    for name in names
}

__all__ = [
    "DTYPES",
    "IO_BACKENDS",
    "LAYOUTS",
    "DevicePool",
    "FaultHook",
    "FaultPlan",
    "FaultPoint",
    "Geometry",
    "HostPool",
    "LayerNotReady",
    "Layout",
    "LoadHandle",
    "MHAGeometry",
    "MLAGeometry",
    "PagePlan",
    "StreamSelection",
    "TransferFailed",
    "TransferStreams",
    "backup",
    "cuda_driver_status",
    "load_layer",
    "make_streams",
    "parse_geometry",
    "plan_transfer",
    "run_backup",
    "run_load_all",
    "run_load_layer",
]  # the names of `_MODULE_OF`, spelt out so that tools see them (tests/unit/test_layering.py)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
