"""vLLM's connector base classes where vLLM is installed, `object` where not (so hicache's
modules import, and their unit tests run, without vLLM; nothing here can run vLLM then)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    ConnectorBase = object
    MetadataBase = object
    WorkerMetadataBase = object

    class HMABase:
        """vLLM's `SupportsHMA` (a marker with `request_finished_all_groups`)."""

    TransferResults: Any = None
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1 as ConnectorBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorMetadata as MetadataBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorWorkerMetadata as WorkerMetadataBase,
        )
    except ImportError:  # pragma: no cover - exercised only where vLLM is absent
        ConnectorBase = object
        MetadataBase = object
        WorkerMetadataBase = object
    try:  # the marker that vLLM's hybrid KV cache manager may hand several groups
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults as TransferResults,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as HMABase
    except ImportError:  # pragma: no cover - vLLM absent or older than SupportsHMA

        class HMABase:
            pass

        TransferResults = None

__all__ = [
    "ConnectorBase",
    "HMABase",
    "MetadataBase",
    "TransferResults",
    "WorkerMetadataBase",
    "log",
]

log = logging.getLogger("hicache.vllm")
