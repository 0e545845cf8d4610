"""A run's storage: the backend under the cache (wrapped in a `FaultyBackend`), and the
fault-free warm-up that fills it first."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.cache import HiCache
from hicache.testing.faulty_backend import BackendFaults, FaultyBackend

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend
    from hicache.backends.keys import Namespace
    from hicache.backends.memory import MemoryStore
    from hicache.config import CacheConfig
    from hicache.testing.simulation.config import SimConfig
    from hicache.testing.simulation.context import SimContext, SimHooks


def cache_namespace(cfg: CacheConfig) -> Namespace:
    """The namespace the cache builds from this config (its resolved fields)."""
    from hicache.backends.keys import Namespace

    resolved, _ = cfg.resolve()
    fields: dict[str, Any] = dict(
        model=resolved.model_id,
        kv=resolved.kv,
        page_size=resolved.page_size,
        tenant=resolved.tenant,
        rank=resolved.tp_rank,
        layout=resolved.layout,
    )
    if "tp_size" in Namespace.__dataclass_fields__:  # the cache's own namespace carries it
        fields["tp_size"] = resolved.tp_size
    return Namespace(**fields)


def _inner_backend(
    sim: SimConfig, cfg: CacheConfig, root: str | None, store: MemoryStore | None
) -> StorageBackend:
    if sim.storage == "memory":
        from hicache.backends.memory import MemoryBackend

        return MemoryBackend(namespace=cache_namespace(cfg), store=store)
    from hicache.backends.file import FileBackend

    assert root is not None  # a file store has its directory
    return FileBackend(
        root, namespace=cache_namespace(cfg), threads=0 if sim.mode == "virtual" else 2
    )


async def warm_storage(
    ctx: SimContext, cfg: CacheConfig, root: str | None, store: MemoryStore | None
) -> None:
    """A previous, fault-free cache instance over the same storage computes about half of
    the workload's prompts and flushes them to L3: the run then starts with cold L1 and L2
    and a warm L3, so prefetches find pages."""
    from hicache.testing.scheduler import ScriptedScheduler

    sim = ctx.sim
    rng = np.random.default_rng([sim.seed, 4])
    warm_cfg = replace(cfg, write_policy="write_through", exclusive=False, storage=None)
    backend = _inner_backend(sim, cfg, root, store)
    try:
        async with HiCache(warm_cfg, backend=backend) as warm:
            sched = ScriptedScheduler(
                warm,
                wait_prefetch=False,
                compute=lambda rid, t, slots, first: ctx.compute_into(
                    warm, t, slots[first:], first
                ),
            )
            for spec in ctx.workload.requests:
                if rng.random() < 0.5:
                    await sched.run([[(f"warm-{spec.rid}", spec.tokens[: spec.prompt_len])]])
            await warm.flush()
            ctx.counts["warm_l3_requests"] += len(sched.records)
    finally:
        await backend.aclose()


def make_backend(
    sim: SimConfig, cfg: CacheConfig, root: str | None, hooks: SimHooks, store: MemoryStore | None
) -> tuple[FaultyBackend, StorageBackend]:
    backend = FaultyBackend(
        _inner_backend(sim, cfg, root, store), sim.faults.backend or BackendFaults()
    )
    if hooks.wrap_backend is not None:
        return backend, hooks.wrap_backend(backend)
    return backend, backend
