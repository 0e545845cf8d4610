"""vLLM's connector base classes where vLLM is installed, `object` where not (so hicache's
modules import, and their unit tests run, without vLLM; nothing here can run vLLM then)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    ConnectorBase = object
    MetadataBase = object
    WorkerMetadataBase = object
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

__all__ = ["ConnectorBase", "MetadataBase", "WorkerMetadataBase", "log"]

log = logging.getLogger("hicache.vllm")
