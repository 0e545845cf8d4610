"""What engine authors use to test their own scheduler with the cache embedded, on virtual time.

- `virtual_config(**overrides)`: a small `CacheConfig` in deterministic mode, its pools where
  `HICACHE_TEST_DEVICE` says (`pool_device`; default: a GPU where CUDA is).
- `run_virtual(main, seed=0)`: run an async test body on virtual time (trio + MockClock); the
  same seed replays the same interleaving, another seed explores another.
- `ScriptedScheduler`: a step-by-step serving loop over a `HiCache`.
- `FaultyBackend` / `BackendFaults`: storage with injected latency, outages and failures.
- `FaultPlan` (from the data plane): transfer streams with scripted failures and delays.
- `synthetic_compute(cache)`, `bad_prefix_pages`, `kv_seeds` (and the lower-level `fill_kv` /
  `bad_pages`): synthetic KV that is a pure function of page, layer and position, and its check,
  to prove that what comes back from a lower tier is what went in.
- `run_simulation(seed, ...)` / `SimViolation` / `SimHooks` (`hicache.testing.simulation`): the
  seeded whole-cache simulation (random configs, concurrent clients, injected faults; never
  wrong KV, never hung, never leaked), also over an engine's own scheduler (docs/testing.md).
- `hicache.testing.conformance` (imported on its own: it needs pytest): the L3 conformance kit,
  one class of tests any storage backend runs to show it is a correct L3 (docs/backends.md).
- `multi_turn_chat(requests, shape=ChatShape(...))` / `write_trace` (`hicache.testing.chat`):
  a multi-turn chat workload as Mooncake-format trace records, for `hicache replay --trace`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.kernels.faults import FaultPlan
from hicache.runtime import run_deterministic as run_virtual
from hicache.testing.chat import ChatShape, multi_turn_chat, write_trace
from hicache.testing.devices import pool_device
from hicache.testing.faulty_backend import BackendFaults, FaultyBackend
from hicache.testing.kvfill import count_bad_pages as bad_pages
from hicache.testing.kvfill import fill as fill_kv
from hicache.testing.kvfill import page_seeds
from hicache.testing.scheduler import ScriptedScheduler, StepRecord
from hicache.testing.simulation import SimHooks, SimReport, SimViolation, run_simulation
from hicache.testing.synthetic import bad_prefix_pages, kv_seeds, synthetic_compute

if TYPE_CHECKING:
    from hicache.config import CacheConfig


def virtual_config(**overrides: Any) -> CacheConfig:
    """A small deterministic configuration: 4 pages of 4 tokens... overridable field by field.
    Its pools live where `HICACHE_TEST_DEVICE` says (default "auto": a GPU where CUDA is)."""
    from hicache.config import CacheConfig

    base: dict[str, Any] = dict(
        device=pool_device("auto")[0],  # HICACHE_TEST_DEVICE (hicache.testing.devices)
        kv="mha:2:1:8:float32",
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        deterministic=True,
        channel_capacity=64,
    )
    base.update(overrides)
    return CacheConfig(**base)


__all__ = [
    "BackendFaults",
    "ChatShape",
    "FaultPlan",
    "FaultyBackend",
    "ScriptedScheduler",
    "SimHooks",
    "SimReport",
    "SimViolation",
    "StepRecord",
    "bad_pages",
    "bad_prefix_pages",
    "fill_kv",
    "kv_seeds",
    "multi_turn_chat",
    "page_seeds",
    "pool_device",
    "run_simulation",
    "run_virtual",
    "synthetic_compute",
    "virtual_config",
    "write_trace",
]
