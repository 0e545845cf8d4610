"""A seeded whole-cache simulation: random configs, concurrent clients, injected faults, and
the checks that must hold whatever happens: never wrong KV, never hung, never leaked.

One seed fixes everything: the configuration (page size, capacities, every write, prefetch and
eviction policy, exclusive mode, storage none / memory / file, layouts), the workload (several
clients sharing prefixes drawn from a small token alphabet, multi-turn, chunked prefill
through `cache_unfinished`, decode steps, releases mid-prefetch and mid-load, abandoned
requests) and the faults (failed and slow copies, storage latency, slow, failed, hung and
corrupted calls, outages). In deterministic mode (`mode="virtual"`, the default) the run is on
virtual time and the actor system's turnstile, so the same seed replays the same run exactly.
`mode="thread"` runs the same workload on asyncio with real CPU transfer threads
(`cpu_transfers="thread"`): interleavings are then whatever the threads make of it.

What is checked:
- every page a request reads holds exactly the KV of its own tokens (KV is a pure function of
  the page's chained hash, `hicache.testing.kv_seeds`): its prefix after `load_back` and the
  waits, before compute; its whole sequence before each `cache_*`; and, after *every* cache
  call of any client, every page every live request has verified so far;
- every outcome is well-formed (slot counts, page alignment, slot ranges, no duplicates);
- a call fails only with the errors the workload allows (`CapacityError` from `allocate`,
  `UnknownRequest` where the workload pokes a request it already ended, `TransferFailed` where
  load faults were injected); any other error, any `ActorFailed`, is a violation;
- no call and no close takes longer than a deadline (virtual seconds in deterministic mode);
- before close, after a flush: no write or load in flight, no request open but the abandoned
  ones; at close: both ledgers balance (`close_report`, `LedgerImbalance`) and every table of
  every actor is empty, no reply or helper task left behind.

A violation raises `SimViolation`, whose message has the seed, the config and a one-line
reproduction. `run_simulation` returns a `SimReport` otherwise.

Engine authors: pass `SimHooks(driver=...)` to run your own scheduler over the same configs,
workloads, faults and close checks (docs/testing.md): the driver gets a `SimContext` with the
cache, the workload, `ctx.compute` (the synthetic forward pass) and the checks
(`ctx.read_prefix`, `ctx.check_reads`).

Layout: `config` and `faults` (a seed's setup), `workload`, `context` (the checks a driver
calls), `checks` (outcome shapes), `clients` and `compute` (the built-in driver), `streams`,
`storage`, `close` (settle, then what close left), `run` and `report`.
"""

from __future__ import annotations

from hicache.testing.simulation.clients import builtin_clients
from hicache.testing.simulation.close import leftover_tables
from hicache.testing.simulation.config import FATES, SKIPPABLE, SimConfig, random_config
from hicache.testing.simulation.context import SimContext, SimHooks
from hicache.testing.simulation.errors import SimViolation
from hicache.testing.simulation.faults import FAULT_KINDS, SimFaultPlan, SimFaults
from hicache.testing.simulation.report import SimReport
from hicache.testing.simulation.run import REPRO, run_simulation
from hicache.testing.simulation.storage import cache_namespace
from hicache.testing.simulation.streams import LateLandingStreams
from hicache.testing.simulation.workload import RequestSpec, Workload, generate_workload

__all__ = [
    "FATES",
    "FAULT_KINDS",
    "REPRO",
    "SKIPPABLE",
    "LateLandingStreams",
    "RequestSpec",
    "SimConfig",
    "SimContext",
    "SimFaultPlan",
    "SimFaults",
    "SimHooks",
    "SimReport",
    "SimViolation",
    "Workload",
    "builtin_clients",
    "cache_namespace",
    "generate_workload",
    "leftover_tables",
    "random_config",
    "run_simulation",
]
