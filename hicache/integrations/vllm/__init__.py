"""hicache as a vLLM KV connector (v1): vLLM's paged KV cache is L1, hicache adds L2 and L3.

Load it into an unmodified vLLM with

    KVTransferConfig(kv_connector="HiCacheConnector",
                     kv_connector_module_path="hicache.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...})     # keys: docs/vllm.md

Split across vLLM's processes (docs/decisions.md, "vLLM: the scheduler keeps the index, the
workers keep the bytes"):

- scheduler side (`SchedulerSide`, scheduler.py, vLLM's scheduler process): the L2 index
  (`HostIndex`: hicache page hash -> host slot, least recently used first, pins for the step
  being built) and, with storage, a probe of L3 (`exists`). It decides every transfer and
  sends it in the step's metadata; it never touches bytes.
- worker side (`WorkerSide`, worker.py, each vLLM worker): the host pool (one page-first
  array of host slots), the copies L1 <-> L2 and the L3 reads and writes (hicache's storage
  backends, their framing and CRC-32 checksums). Workers run the steps' metadata in order:
  L2 -> L1 loads before the forward (layer by layer: layers.py), L1 -> L2 stores after it,
  and L3 reads in the background, each into a buffer of its own, landing at a step's end
  (loads.py: asynchronous loads, vLLM's `load_async`, and best_effort prefetches); so the
  index the scheduler keeps is the truth for every later step. The one thing it cannot know
  ahead, a failed, late or corrupt L3 read, the worker detects (a per-slot validity flag and
  page name), reports as vLLM load errors (vLLM recomputes those blocks) and sends back to
  the scheduler, which forgets the page.

Pages are vLLM blocks (`page_size` = vLLM's `block_size`) named by hicache's chained SHA-256
page hashes (`hicache.radix.hashes.chain_page_hashes`), starting from hicache's salt seed for
a request's `cache_salt`, so L3 keys are the ones an embedded `HiCache` with the same salt
would use for the same tokens and namespace.

Hybrid models (vLLM's hybrid KV cache manager, `SupportsHMA`): a page is every KV cache
group's block of it; groups.py maps the groups onto hicache.hybrid's declaration, whose rule
gives the hit, and says which blocks each group restores (docs/vllm.md, Hybrid models).

Modules: options.py (the extra config), layout.py (geometry, namespace, salts), groups.py
(vLLM's groups as a hicache HybridModel), storage.py
(L3 off the event loop), plan.py (the L2 index and the per-step metadata), scheduler.py,
worker.py, loads.py, layers.py, connector.py (vLLM's interface), metrics.py (stats, Prometheus, KV events),
compat.py (vLLM's base classes, or `object` without vLLM).
"""

from __future__ import annotations

from hicache.integrations.vllm.connector import HiCacheConnector
from hicache.integrations.vllm.layout import Geometry, geometry_of, namespace_of, salt_prior
from hicache.integrations.vllm.metrics import METRICS, HiCachePromMetrics, HiCacheStats
from hicache.integrations.vllm.options import ConnectorOptions, parse_options
from hicache.integrations.vllm.plan import (
    HiCacheMetadata,
    HiCacheWorkerMetadata,
    HostIndex,
    LoadPlan,
)
from hicache.integrations.vllm.scheduler import SCHEDULER_METRICS, SchedulerSide
from hicache.integrations.vllm.storage import Storage
from hicache.integrations.vllm.worker import WORKER_METRICS, WorkerSide

__all__ = [
    "METRICS",
    "SCHEDULER_METRICS",
    "WORKER_METRICS",
    "ConnectorOptions",
    "Geometry",
    "HiCacheConnector",
    "HiCacheMetadata",
    "HiCachePromMetrics",
    "HiCacheStats",
    "HiCacheWorkerMetadata",
    "HostIndex",
    "LoadPlan",
    "SchedulerSide",
    "Storage",
    "WorkerSide",
    "geometry_of",
    "namespace_of",
    "parse_options",
    "salt_prior",
]
