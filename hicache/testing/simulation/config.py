"""One seed's setup (`SimConfig`): cache fields, storage, workload shape and faults, drawn by
`random_config` as a pure function of the seed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hicache.config import EVICTION_POLICIES, WRITE_POLICIES, CacheConfig
from hicache.policies.prefetch import PREFETCH_POLICIES
from hicache.testing.devices import pool_device
from hicache.testing.simulation.faults import FAULT_KINDS, SimFaults, random_faults

T = TypeVar("T")

# FATES lives here, not in workload.py: SKIPPABLE (checked by random_config) needs it, and
# workload.py imports this module.
FATES = (
    "finish",
    "finish_then_poke",
    "wrong_tokens",
    "rematch",
    "release_after_match",
    "release_mid_prefetch",
    "release_mid_load",
    "release_mid_compute",
    "abandon",
)
"""What a request of the built-in clients does (see `RequestSpec.fate`)."""


SKIPPABLE = FAULT_KINDS + FATES + ("late_landing",)
"""What `skip=` accepts: fault kinds, fates, and `late_landing`."""


@dataclass
class SimConfig:
    """One seed's whole setup. `cache` holds `CacheConfig` fields; `storage` is "none",
    "memory" or "file" (a fresh temporary directory); `wrap_backend`: open the backend here
    and wrap it in a `FaultyBackend` (else the cache opens it from its spec string);
    `late_landing`: deterministic transfer streams that move each layer's bytes when it lands,
    as real streams do, not at submit."""

    seed: int
    mode: str  # "virtual" | "thread"
    cache: dict[str, Any]
    storage: str
    wrap_backend: bool
    late_landing: bool
    warm_l3: bool  # a previous cache instance left part of the workload in storage
    clients: int
    requests: int  # per client
    alphabet: int
    faults: SimFaults

    @property
    def page_size(self) -> int:
        size: int = self.cache["page_size"]
        return size

    def cache_config(self, storage_spec: str | None = None) -> CacheConfig:
        return CacheConfig(**self.cache, storage=storage_spec)

    def features(self) -> dict[str, object]:
        """What this seed covers, for the coverage summary."""
        c = self.cache
        return {
            "warm_l3": self.warm_l3,
            "page_size": c["page_size"],
            "write_policy": c["write_policy"],
            "prefetch_policy": c["prefetch_policy"],
            "exclusive": c["exclusive"],
            "evict_to_storage": c["evict_to_storage"],
            "eviction": c["eviction"],
            "storage": self.storage,
            "layout": c["layout"],
            "io": c["io_backend"],
            "kv": c["kv"].split(":")[0],
            "landing": "late" if self.late_landing else "submit",
        }

    def summary(self) -> str:
        c = self.cache
        faults = ",".join(sorted(self.faults.kinds())) or "none"
        storage = self.storage + (
            "(wrapped)" if self.wrap_backend and self.storage != "none" else ""
        )
        return (
            f"mode={self.mode} page={c['page_size']} L1={c['device_tokens']} "
            f"L2={c['host_tokens']} kv={c['kv']} layout={c['layout']} io={c['io_backend']} "
            f"write={c['write_policy']} prefetch={c['prefetch_policy']} "
            f"exclusive={c['exclusive']} evict_to_storage={c['evict_to_storage']} "
            f"eviction={c['eviction']} storage={storage} "
            f"landing={'late' if self.late_landing else 'submit'} warm_l3={self.warm_l3} "
            f"clients={self.clients}x{self.requests} alphabet={self.alphabet} faults={faults}"
        )


def pick(rng: np.random.Generator, options: Sequence[T]) -> T:
    return options[int(rng.integers(len(options)))]


def random_config(seed: int, *, mode: str = "virtual", skip: Iterable[str] = ()) -> SimConfig:
    """The configuration, workload shape and faults of one seed (a pure function of it)."""
    if mode not in ("virtual", "thread"):
        raise ValueError(f"mode must be 'virtual' or 'thread', got {mode!r}")
    skip = set(skip)
    unknown = skip - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"unknown skip names {sorted(unknown)}; known: {', '.join(SKIPPABLE)}")
    rng = np.random.default_rng([seed, 1])
    page = pick(rng, (1, 4, 8, 16))
    target = int(rng.integers(2, 7)) * 8  # 16 .. 48 tokens of L1: eviction all the time
    device_pages = max(3, target // page)
    host_pages = device_pages + int(rng.integers(2, device_pages + 3))
    kv = pick(rng, ("mha:2:1:8:float32", "mha:3:2:4:bfloat16", "mla:2:8:4:float16"))
    layouts = ("page_first", "layer_first") + (("page_head",) if kv.startswith("mha") else ())
    exclusive = bool(rng.random() < 0.25)
    storage = pick(rng, ("none", "memory", "memory", "file"))
    virtual = mode == "virtual"
    cache = dict(
        kv=kv,
        page_size=page,
        device_tokens=device_pages * page,
        host_tokens=host_pages * page,
        layout=pick(rng, layouts),
        io_backend=pick(rng, ("kernel", "kernel", "direct")),
        eviction=pick(rng, EVICTION_POLICIES),
        write_policy=pick(rng, WRITE_POLICIES),
        exclusive=exclusive,
        prefetch_policy=pick(rng, PREFETCH_POLICIES),
        model_id="sim-model",
        load_back_threshold=pick(rng, (0, 1, page, 10)),
        prefetch_threshold=pick(rng, (0, 0, page, 2 * page)),
        prefetch_timeout_base=pick(rng, (0.005, 0.05, 0.5)) if virtual else 0.05,
        prefetch_timeout_per_ki_token=pick(rng, (0.0, 0.25)),
        prefetch_rate_fraction=pick(rng, (0.5, 0.8, 1.0)),
        storage_batch_pages=pick(rng, (1, 2, 4, 128)),
        upload_retries=pick(rng, (0, 1, 3)),
        upload_backoff=0.01,
        storage_timeout=0.5,
        close_timeout=20.0 if virtual else 5.0,
        max_upload_backlog=pick(rng, (2, 1024)),
        channel_capacity=pick(rng, (4, 8, 16, 64)),
        deterministic=virtual,
        seed=seed,
        device=pool_device("cpu")[0],  # HICACHE_TEST_DEVICE moves the pools to a GPU
        cpu_transfers="inline" if virtual else "thread",
        transfer_bandwidth=pick(rng, (20e9, 2e6, 2e5)),
    )
    # Fields added later draw from their own stream, so every seed keeps the rest of its setup.
    later = np.random.default_rng([seed, 2])
    cache["evict_to_storage"] = bool(later.random() < 0.75)
    late = virtual and "late_landing" not in skip and bool(rng.random() < 0.5)
    faults = random_faults(rng, storage != "none", virtual, skip)
    wrap = storage != "none" and (faults.backend is not None or bool(rng.random() < 0.5))
    # a warm L3 needs a store two caches can share: a file directory, or a memory store the
    # simulation holds (not one the cache opens from its spec)
    warm = (storage == "file" or (storage == "memory" and wrap)) and bool(rng.random() < 0.5)
    clients = int(rng.integers(2, 5))
    return SimConfig(
        seed=seed,
        mode=mode,
        cache=cache,
        storage=storage,
        wrap_backend=wrap,
        late_landing=late,
        warm_l3=warm,
        clients=clients,
        requests=min(int(rng.integers(2, 5)), 12 // clients),
        alphabet=pick(rng, (2, 3, 8, 1000)),
        faults=faults,
    )
