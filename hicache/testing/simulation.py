"""A seeded whole-cache simulation: random configs, concurrent clients, injected faults, and
the checks that must hold whatever happens: never wrong KV, never hung, never leaked.

One seed fixes everything: the configuration (page size, capacities, every write, prefetch and
eviction policy, exclusive mode, storage none / memory / file, layouts), the workload (several
clients sharing prefixes drawn from a small token alphabet, multi-turn, chunked prefill
through `cache_unfinished`, decode steps, releases mid-prefetch and mid-load, abandoned
requests) and the faults (failed and slow copies, storage latency, slow, failed, hung and
corrupted calls, outages). In deterministic mode (`mode="virtual"`, the default) the run is on
virtual time and the kernel's turnstile, so the same seed replays the same run exactly.
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
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import numpy as np

from hicache.cache import HiCache, LedgerImbalance
from hicache.config import EVICTION_POLICIES, WRITE_POLICIES, CacheConfig
from hicache.kernels.faults import FaultPlan
from hicache.kernels.streams.base import FaultPoint, LoadHandle, OnDone, TransferFailed
from hicache.policies.prefetch import PREFETCH_POLICIES
from hicache.results import CapacityError, PinLimitError, Retention, UnknownRequest
from hicache.runtime import run_deterministic
from hicache.testing.faulty_backend import BackendFaults, FaultyBackend
from hicache.testing.synthetic import kv_seeds

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend
    from hicache.backends.keys import Namespace
    from hicache.backends.memory import MemoryStore
    from hicache.kernels.indices import SlotArray
    from hicache.kernels.streams.virtual import VirtualLoadHandle, VirtualStreams
    from hicache.observability import EventLog
    from hicache.results import MatchOutcome, PrefetchOutcome

T = TypeVar("T")

REPRO = "pytest tests/sim/test_simulation.py --sim-seed {seed}"
"""The one-line reproduction printed with every violation (`{seed}`, `{mode}` are filled)."""

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

FAULT_KINDS = (
    "load_fail",
    "backup_fail",
    "load_delay",
    "backup_delay",
    "latency",
    "slow_call",
    "outage",
    "fail_get",
    "fail_set",
    "fail_exists",
    "hang",
    "corrupt",
)
"""Fault kinds a seed may draw; `skip=` removes some (e.g. to narrow a failure down)."""

SKIPPABLE = FAULT_KINDS + FATES + ("late_landing",)


# ---------------------------------------------------------------------------------- errors
class SimViolation(AssertionError):
    """A simulation found the cache misbehaving. `seed`, `what` (one line), `repro`."""

    def __init__(
        self, seed: int, what: str, *, config: str = "", repro: str = "", detail: str = ""
    ) -> None:
        self.seed, self.what, self.config, self.repro = seed, what, config, repro
        lines = [f"seed {seed}: {what}"]
        if config:
            lines.append(f"  config: {config}")
        if detail:
            lines.append(f"  {detail}")
        if repro:
            lines.append(f"  reproduce: {repro}")
        super().__init__("\n".join(lines))


class _Stop(Exception):
    """Ends a client after the run recorded a violation."""


# ---------------------------------------------------------------------------------- configs
@dataclass
class SimFaults:
    """The faults of one seed: transfer-stream faults (`FaultPlan` keys) and storage faults
    (a `BackendFaults`, None without storage)."""

    load_fail: set[tuple[int, int]] = field(default_factory=set)  # (load job, layer)
    backup_fail: set[int] = field(default_factory=set)  # backup job
    load_delay: dict[tuple[int, int], float] = field(default_factory=dict)
    backup_delay: dict[int, float] = field(default_factory=dict)
    backend: BackendFaults | None = None

    def kinds(self) -> set[str]:
        out = set()
        for name in ("load_fail", "backup_fail", "load_delay", "backup_delay"):
            if getattr(self, name):
                out.add(name)
        b = self.backend
        if b is not None:
            for kind, on in (
                ("latency", b.latency),
                ("slow_call", b.delays),
                ("outage", b.outages or b.down),
                ("fail_get", b.fail_gets),
                ("fail_set", b.fail_sets),
                ("fail_exists", b.fail_exists),
                ("hang", b.hang or b.hang_gets or b.hang_sets or b.hang_exists),
                ("corrupt", b.corrupt_gets),
            ):
                if on:
                    out.add(kind)
        return out


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
            f"exclusive={c['exclusive']} eviction={c['eviction']} storage={storage} "
            f"landing={'late' if self.late_landing else 'submit'} warm_l3={self.warm_l3} "
            f"clients={self.clients}x{self.requests} alphabet={self.alphabet} faults={faults}"
        )


def _pick(rng: np.random.Generator, options: Sequence[T]) -> T:
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
    page = _pick(rng, (1, 4, 8, 16))
    target = int(rng.integers(2, 7)) * 8  # 16 .. 48 tokens of L1: eviction all the time
    device_pages = max(3, target // page)
    host_pages = device_pages + int(rng.integers(2, device_pages + 3))
    kv = _pick(rng, ("mha:2:1:8:float32", "mha:3:2:4:bfloat16", "mla:2:8:4:float16"))
    layouts = ("page_first", "layer_first") + (("page_head",) if kv.startswith("mha") else ())
    exclusive = bool(rng.random() < 0.25)
    storage = _pick(rng, ("none", "memory", "memory", "file"))
    virtual = mode == "virtual"
    cache = dict(
        kv=kv,
        page_size=page,
        device_tokens=device_pages * page,
        host_tokens=host_pages * page,
        layout=_pick(rng, layouts),
        io_backend=_pick(rng, ("kernel", "kernel", "direct")),
        eviction=_pick(rng, EVICTION_POLICIES),
        write_policy=_pick(rng, WRITE_POLICIES),
        exclusive=exclusive,
        prefetch_policy=_pick(rng, PREFETCH_POLICIES),
        model_id="sim-model",
        load_back_threshold=_pick(rng, (0, 1, page, 10)),
        prefetch_threshold=_pick(rng, (0, 0, page, 2 * page)),
        prefetch_timeout_base=_pick(rng, (0.005, 0.05, 0.5)) if virtual else 0.05,
        prefetch_timeout_per_ki_token=_pick(rng, (0.0, 0.25)),
        prefetch_rate_fraction=_pick(rng, (0.5, 0.8, 1.0)),
        storage_batch_pages=_pick(rng, (1, 2, 4, 128)),
        upload_retries=_pick(rng, (0, 1, 3)),
        upload_backoff=0.01,
        storage_timeout=0.5,
        close_timeout=20.0 if virtual else 5.0,
        max_upload_backlog=_pick(rng, (2, 1024)),
        channel_capacity=_pick(rng, (4, 8, 16, 64)),
        deterministic=virtual,
        seed=seed,
        device="cpu",
        cpu_transfers="inline" if virtual else "thread",
        transfer_bandwidth=_pick(rng, (20e9, 2e6, 2e5)),
    )
    late = virtual and "late_landing" not in skip and bool(rng.random() < 0.5)
    faults = _random_faults(rng, storage != "none", virtual, skip)
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
        alphabet=_pick(rng, (2, 3, 8, 1000)),
        faults=faults,
    )


def _random_faults(
    rng: np.random.Generator, storage: bool, virtual: bool, skip: set[str]
) -> SimFaults:
    f = SimFaults()
    if rng.random() < 0.2:  # a clean run now and then
        return f
    on = {k: bool(rng.random() < 0.35) and k not in skip for k in FAULT_KINDS}
    scale = 1.0 if virtual else 0.02  # thread mode: real seconds, keep them short
    jobs = range(48)
    if on["load_fail"]:
        f.load_fail = {(j, int(rng.integers(0, 3))) for j in jobs if rng.random() < 0.12}
    if on["backup_fail"]:
        f.backup_fail = {j for j in jobs if rng.random() < 0.1}
    if on["load_delay"]:
        f.load_delay = {
            (j, int(rng.integers(0, 3))): float(rng.uniform(0.001, 0.2)) * scale
            for j in jobs
            if rng.random() < 0.3
        }
    if on["backup_delay"]:
        f.backup_delay = {
            j: float(rng.uniform(0.001, 0.2)) * scale for j in jobs if rng.random() < 0.3
        }
    if not storage:
        return f
    b = BackendFaults()
    calls = range(24)  # a seed makes a few dozen storage calls per method

    def some(p: float) -> set[int]:
        return {n for n in calls if rng.random() < p}

    if on["latency"]:
        b.latency = float(rng.uniform(0.0005, 0.05)) * scale
    if on["slow_call"]:
        b.delays = {
            (m, n): float(rng.uniform(0.01, 0.4)) * scale
            for m in ("exists", "get_into", "set_from")
            for n in calls
            if rng.random() < 0.15
        }
    if on["outage"]:
        windows = []
        for _ in range(int(rng.integers(1, 3))):
            start = float(rng.uniform(0.0, 0.3)) * scale
            windows.append((start, start + float(rng.uniform(0.005, 0.3)) * scale))
        b.outages = tuple(windows)
    if on["fail_get"]:
        b.fail_gets = some(0.3)
    if on["fail_set"]:
        b.fail_sets = some(0.2)
    if on["fail_exists"]:
        b.fail_exists = some(0.2)
    if on["hang"]:
        # a few calls that never return; thread mode pays storage_timeout in real time each
        hung = [
            (m, int(rng.integers(0, 6)))
            for m in ("exists", "get_into", "set_from")
            if rng.random() < 0.5
        ][: 3 if virtual else 1]
        b.hang_exists = {n for m, n in hung if m == "exists"}
        b.hang_gets = {n for m, n in hung if m == "get_into"}
        b.hang_sets = {n for m, n in hung if m == "set_from"}
    if on["corrupt"]:
        b.corrupt_gets = some(0.5)
    f.backend = b if b.is_set() else None
    return f


# ---------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload.

    `tokens` is the whole sequence (prompt, then the tokens "generated" by decode steps);
    `match_len` how many are matched (the prompt, or all but its last token); `chunks` the
    positions where compute stops (chunked prefill, then one per decode step); `unfinished_at`
    the subset of those where the request is inserted with `cache_unfinished`. `prefetch`:
    none | wait | poll | nowait. `fate`: finish (cache_finished) | finish_then_poke (then a
    call on the ended request, which must raise UnknownRequest) | wrong_tokens (first a
    cache_finished whose tokens differ inside the matched prefix, which must raise a
    ValueError and change nothing) | rematch (a shorter match
    first) | release_after_match | release_mid_prefetch (release while its prefetch runs) |
    release_mid_load (release after load_back, before the load landed) | release_mid_compute |
    abandon (drop the request without a release at `abandon_at`: match | load | compute; the
    close must clean it up). `think`: seconds the client waits before it."""

    rid: str
    tokens: np.ndarray
    prompt_len: int
    match_len: int
    chunks: tuple[int, ...]
    unfinished_at: frozenset[int]
    prefetch: str
    fate: str
    abandon_at: str
    think: float
    alloc_batches: int  # allocate a chunk in this many calls (1 or 2)
    retention: tuple[Retention, ...] = ()  # ranges given at its match
    # after it finished: pin its first `pin[0]` tokens in tiers `pin[1]` for `pin[2]` seconds
    pin: tuple[int, tuple[str, ...], float | None] | None = None
    unpin: bool = False  # after it finished: unpin its first page (often no pin: False back)


@dataclass(frozen=True)
class Workload:
    clients: tuple[tuple[RequestSpec, ...], ...]

    @property
    def requests(self) -> list[RequestSpec]:
        return [r for client in self.clients for r in client]


def generate_workload(sim: SimConfig, *, skip: Iterable[str] = ()) -> Workload:
    """The seed's clients and their requests (a pure function of the config)."""
    skip = set(skip)
    rng = np.random.default_rng([sim.seed, 2])
    page = sim.page_size
    capacity = sim.cache["device_tokens"]
    max_len = max(page + 2, capacity * 3 // 4)
    stems = [
        rng.integers(0, sim.alphabet, size=int(rng.integers(0, max_len * 3 // 4 + 1)))
        for _ in range(3)
    ]
    weights = {
        "finish": 40,
        "finish_then_poke": 5,
        "wrong_tokens": 3,
        "rematch": 5,
        "release_after_match": 4,
        "release_mid_prefetch": 8 if sim.storage != "none" else 0,
        "release_mid_load": 12,
        "release_mid_compute": 6,
        "abandon": 3,
    }
    for name in skip:
        weights.pop(name, None)
    fates = list(weights)
    probs = np.array([weights[k] for k in fates], dtype=float)
    probs /= probs.sum()
    # Conversations shared by every client: a request extends one (its next turn), repeats
    # it (a retry, a regenerate), or starts it over from a shared stem. Their total outgrows
    # L1 and often L2, so pages keep moving down the tiers and coming back.
    conversations = [
        stems[int(rng.integers(len(stems)))][: max_len // 2].copy()
        for _ in range(int(rng.integers(2, 7)))
    ]
    per_client: list[list[RequestSpec]] = [[] for _ in range(sim.clients)]
    abandoned = [False] * sim.clients
    for i in range(sim.requests):
        for c in range(sim.clients):
            k = int(rng.integers(len(conversations)))
            conv = conversations[k]
            roll = rng.random()
            if roll < 0.2 and len(conv):  # the same conversation again
                tokens = conv
            else:
                if roll > 0.85 or len(conv) >= max_len - 1:  # start over from a stem
                    stem = stems[int(rng.integers(len(stems)))]
                    conv = stem[: int(rng.integers(0, len(stem) + 1))]
                extra = int(rng.integers(1, max(2, min(max_len - len(conv), max_len // 2) + 1)))
                tokens = np.concatenate([conv, rng.integers(0, sim.alphabet, size=extra)])
            tokens = tokens.astype(np.int64)
            conversations[k] = tokens
            decode = int(rng.integers(0, min(2, len(tokens) - 1) + 1))
            prompt_len = len(tokens) - decode
            match_len = prompt_len - 1 if prompt_len > 1 and rng.random() < 0.5 else prompt_len
            cuts = {
                int(x)
                for x in rng.integers(1, max(2, len(tokens)), size=int(rng.integers(0, 3)))
                if x < len(tokens)
            }
            chunks = tuple(sorted(cuts | set(range(prompt_len, len(tokens) + 1)) | {len(tokens)}))
            unfinished = frozenset(x for x in chunks if x < len(tokens) and rng.random() < 0.5)
            fate = fates[int(rng.choice(len(fates), p=probs))]
            if fate == "abandon":
                if abandoned[c]:
                    fate = "finish"
                abandoned[c] = True
            prefetch = "none"
            if sim.storage != "none":
                prefetch = _pick(rng, ("none", "wait", "wait", "wait", "poll", "nowait"))
                if fate == "release_mid_prefetch":
                    prefetch = "nowait"
            retention: tuple[Retention, ...] = ()
            if rng.random() < 0.2:  # a range of its tokens kept (or dropped) ahead of LRU
                a = int(rng.integers(0, len(tokens)))
                b = int(rng.integers(a + 1, len(tokens) + 1))
                retention = (
                    Retention(
                        a,
                        b if rng.random() < 0.8 else None,
                        int(rng.integers(0, 101)),
                        _pick(rng, (None, 0.05, 0.5)),
                    ),
                )
            pin = None
            if rng.random() < 0.06 and prompt_len >= page:
                pin = (
                    int(rng.integers(1, prompt_len // page + 1)) * page,
                    _pick(rng, (("device",), ("host",), ("device", "host"))),
                    _pick(rng, (None, 0.1, 1.0)),
                )
            per_client[c].append(
                RequestSpec(
                    rid=f"c{c}r{i}",
                    tokens=tokens,
                    prompt_len=prompt_len,
                    match_len=match_len,
                    chunks=chunks,
                    unfinished_at=unfinished,
                    prefetch=prefetch,
                    fate=fate,
                    abandon_at=_pick(rng, ("match", "load", "compute")),
                    think=float(rng.exponential(0.02)),
                    alloc_batches=1 + int(rng.random() < 0.2),
                    retention=retention,
                    pin=pin,
                    unpin=bool(rng.random() < 0.04) and len(tokens) >= page,
                )
            )
    clients = [tuple(r) for r in per_client]
    return Workload(tuple(clients))


# ---------------------------------------------------------------------------------- streams
class LateLandingStreams:
    """Deterministic transfer streams whose bytes move when each layer *lands* (as real
    streams do: a copy runs some time after it was queued), not at submit like the default
    virtual streams. Timing and faults as `VirtualStreams`. Built unbound: `bind(cache)` once
    the cache is open (the pools and the kernel's timers exist only then)."""

    kind = "virtual"

    def __init__(self, *, bandwidth: float, fault: FaultPlan | None = None) -> None:
        self._bandwidth = bandwidth
        self._fault = fault
        self._inner: VirtualStreams | None = None

    def bind(self, cache: HiCache) -> None:
        from hicache.kernels.streams.virtual import VirtualStreams

        outer = self

        class _Late(VirtualStreams):
            def submit_load(
                self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
            ) -> VirtualLoadHandle:
                return outer._submit_load(self, host_slots, device_slots, on_done)

            def submit_backup(
                self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
            ) -> None:
                outer._submit_backup(self, device_slots, host_slots, on_done)

        self._inner = _Late(
            cache.device_pool,
            cache.host_pool,
            io=cache.config.io_backend,
            schedule=cache.kernel.call_later,
            bandwidth=self._bandwidth,
            fault=self._fault,
        )

    @staticmethod
    def _submit_load(
        s: VirtualStreams, host_slots: SlotArray, device_slots: SlotArray, on_done: OnDone
    ) -> VirtualLoadHandle:
        from hicache.kernels.indices import plan_transfer
        from hicache.kernels.streams.virtual import VirtualLoadHandle
        from hicache.kernels.transfer import run_load_layer

        s._check_open()
        plan = plan_transfer(s.host_pool, s.device_pool, host_slots, device_slots)
        layers = s.device_pool.geometry.layers
        handle = VirtualLoadHandle(layers)
        job = s._load_jobs
        s._load_jobs += 1
        layer_bytes = plan.tokens * s.device_pool.geometry.bytes_per_token // layers

        def step(layer: int, fault: BaseException | None) -> Callable[[], bool]:
            def action() -> bool:
                error = fault
                if error is None:
                    try:
                        run_load_layer(plan, s.host_pool, s.device_pool, layer, s.io, s._engine)
                    except Exception as exc:  # noqa: BLE001 - reported like a stream would
                        error = exc
                if error is not None:
                    handle._fail(error)
                    on_done(error)
                    return True
                handle._land(layer)
                if layer == layers - 1:
                    on_done(None)
                return False

            return action

        steps: list[tuple[float, Callable[[], bool]]] = []
        for layer in range(layers):
            extra, fault = s._extra(FaultPoint("load", job, layer))
            steps.append((layer_bytes / s.bandwidth + extra, step(layer, fault)))
        s._loads.push(steps)
        return handle

    @staticmethod
    def _submit_backup(
        s: VirtualStreams, device_slots: SlotArray, host_slots: SlotArray, on_done: OnDone
    ) -> None:
        from hicache.kernels.indices import plan_transfer
        from hicache.kernels.transfer import run_backup

        s._check_open()
        plan = plan_transfer(s.host_pool, s.device_pool, host_slots, device_slots)
        job = s._backup_jobs
        s._backup_jobs += 1
        extra, fault = s._extra(FaultPoint("backup", job, None))
        nbytes = plan.tokens * s.device_pool.geometry.bytes_per_token

        def action() -> bool:
            error = fault
            if error is None:
                try:
                    run_backup(plan, s.device_pool, s.host_pool, s.io, s._engine)
                except Exception as exc:  # noqa: BLE001
                    error = exc
            on_done(error)
            return True

        s._backups.push([(nbytes / s.bandwidth + extra, action)])

    def _bound(self) -> VirtualStreams:
        if self._inner is None:
            raise RuntimeError("LateLandingStreams used before bind(cache)")
        return self._inner

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> LoadHandle:
        return self._bound().submit_load(host_slots, device_slots, on_done=on_done)

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        self._bound().submit_backup(device_slots, host_slots, on_done=on_done)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


class SimFaultPlan(FaultPlan):
    """A `FaultPlan` that counts the faults it injected, and in thread mode sleeps its delays
    on the stream's worker thread (CPU streams ignore a returned delay)."""

    def __init__(self, faults: SimFaults, *, real_delays: bool) -> None:
        super().__init__()
        for job, layer in faults.load_fail:
            self.fail[("load", job, layer)] = OSError(f"injected: load {job} layer {layer}")
        for job in faults.backup_fail:
            self.fail[("backup", job, None)] = OSError(f"injected: backup {job}")
        for (job, layer), d in faults.load_delay.items():
            self.delay[("load", job, layer)] = d
        for job, d in faults.backup_delay.items():
            self.delay[("backup", job, None)] = d
        self.real_delays = real_delays
        self.injected: Counter[str] = Counter()

    def __call__(self, point: FaultPoint) -> float | None:
        key = (point.direction, point.job, point.layer)
        if key in self.fail:
            self.injected[f"{point.direction}_fail"] += 1
        elif key in self.delay:
            self.injected[f"{point.direction}_delay"] += 1
        delay = super().__call__(point)
        if delay and self.real_delays:
            time.sleep(delay)
            return None
        return delay


# ---------------------------------------------------------------------------------- reports
@dataclass
class SimReport:
    """What one seed did: counts of calls, requests, verified pages, faults injected (by
    kind), request outcomes, and the config it ran."""

    seed: int
    mode: str
    config: str
    features: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    virtual_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return self.counts["steps"]

    @property
    def requests(self) -> int:
        return self.counts["requests"]

    @property
    def pages_verified(self) -> int:
        return self.counts["pages_verified"]

    def line(self) -> str:
        faults = ",".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"seed {self.seed}: {self.steps} steps, {self.requests} requests, "
            f"{self.pages_verified} pages verified, faults {faults}"
        )


# ---------------------------------------------------------------------------------- context
@dataclass
class SimHooks:
    """Ways to change a run, for engine authors and for tests of the simulation itself.

    `compute(cache, tokens, slots, first)`: write the KV of `tokens[first:first+len(slots)]`
    into `slots` (default: the synthetic KV). `wrap_backend(backend) -> backend`: put
    something between the cache and its storage. `driver(ctx)`: run the workload yourself
    instead of the built-in clients (see `SimContext`)."""

    compute: Callable[[HiCache, np.ndarray, np.ndarray, int], None] | None = None
    wrap_backend: Callable[[StorageBackend], StorageBackend] | None = None
    driver: Callable[[SimContext], Awaitable[None]] | None = None


class SimContext:
    """What a run's driver works with: `cache`, `sim` (the config), `workload`, `rng`, and the
    checks. A custom driver (an engine's scheduler) makes its cache calls through
    `await ctx.call(what, fn, *args, allowed=(...))` (counted, under a deadline, errors
    checked, and after each one every held page re-checked), calls `read_prefix` before its
    model reads a request's prefix, `compute` where its model writes K/V, `check_reads` where
    it reads a request's slots, `hold`/`drop` around the slots a request keeps reading,
    `note_handle` for load handles it does not wait on, and `abandoned(rid)` for a request it
    drops without a release (close must clean it up)."""

    def __init__(self, sim: SimConfig, workload: Workload, hooks: SimHooks, repro: str) -> None:
        self.sim = sim
        self.workload = workload
        self.hooks = hooks
        self.repro = repro
        self._cache: HiCache | None = None
        self.rng = np.random.default_rng([sim.seed, 3])
        self.counts: Counter[str] = Counter()
        self.violation: SimViolation | None = None
        self.handles: list[LoadHandle] = []
        self.abandoned_rids: set[Any] = set()
        self.live: dict[object, tuple[np.ndarray, np.ndarray]] = {}  # rid -> (tokens, slots)
        self._seeds: dict[bytes, np.ndarray] = {}
        self.virtual = sim.mode == "virtual"
        self.call_deadline = 60.0 if self.virtual else 30.0
        self.load_faults = bool(sim.faults.load_fail)
        self.plan: SimFaultPlan | None = None
        self.faulty: FaultyBackend | None = None
        self.close_started = math.inf
        self.trace: list[str] | None = None  # every call and its answer, when asked for

    @property
    def cache(self) -> HiCache:
        """The open cache (set before the driver runs)."""
        if self._cache is None:
            raise RuntimeError("the simulation's cache is not open yet")
        return self._cache

    @cache.setter
    def cache(self, cache: HiCache) -> None:
        self._cache = cache

    # -- violations
    def violate(self, what: str, detail: str = "") -> NoReturn:
        """Record a violation (the first one wins) and stop the run."""
        if self.violation is None:
            self.violation = SimViolation(
                self.sim.seed, what, config=self.sim.summary(), repro=self.repro, detail=detail
            )
        raise _Stop(what)

    def stopped(self) -> bool:
        return self.violation is not None

    # -- KV
    def seeds(self, tokens: np.ndarray) -> np.ndarray:
        key = tokens.tobytes()
        seeds = self._seeds.get(key)
        if seeds is None:
            seeds = self._seeds[key] = kv_seeds(tokens, self.sim.page_size)
        return seeds

    def compute(self, tokens: np.ndarray, slots: np.ndarray, first: int) -> None:
        """Write the KV of tokens[first : first + len(slots)] into `slots`."""
        self.compute_into(self.cache, tokens, slots, first)
        self.counts["tokens_computed"] += len(slots)

    def compute_into(
        self, cache: HiCache, tokens: np.ndarray, slots: np.ndarray, first: int
    ) -> None:
        if self.hooks.compute is not None:
            self.hooks.compute(cache, tokens, slots, first)
            return
        from hicache.testing.kvfill import fill

        fill(
            cache.device_pool,
            slots,
            self.seeds(np.asarray(tokens)),
            page_size=self.sim.page_size,
            first=first,
        )

    def bad_pages(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        from hicache.testing.kvfill import count_bad_pages

        return count_bad_pages(
            self.cache.device_pool, slots, self.seeds(tokens), page_size=self.sim.page_size, first=0
        )

    def check_reads(self, rid: Any, tokens: np.ndarray, slots: np.ndarray, where: str) -> None:
        """The request reads tokens[:len(slots)] at `slots`: each page must hold its own KV."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        bad = self.bad_pages(tokens, slots)
        pages = -(-len(slots) // self.sim.page_size)
        self.counts["pages_verified"] += pages
        if bad:
            self.violate(
                f"wrong KV: request {rid} reads {bad} bad page(s) of {pages} {where}",
                detail=f"tokens={len(tokens)} slots={_short(slots)}",
            )

    def check_live(self, where: str) -> None:
        """Every page every live request verified so far still holds its KV; the upload
        backlog stays within `max_upload_backlog`."""
        tree = self._cache.kernel.actors.get("tree") if self._cache is not None else None
        backlog = getattr(tree, "_upload_backlog", None)  # private: looked at when present
        bound = self.sim.cache.get("max_upload_backlog")
        if backlog is not None and bound is not None and len(backlog) > bound:
            self.violate(
                f"upload backlog of {len(backlog)} past max_upload_backlog={bound} (after {where})"
            )
        for rid, (tokens, slots) in list(self.live.items()):
            if len(slots) and self.bad_pages(tokens, slots):
                self.violate(
                    f"wrong KV: pages request {rid} holds were overwritten (seen after {where})",
                    detail=f"tokens={len(tokens)} slots={_short(slots)}",
                )

    def hold(self, rid: Any, tokens: np.ndarray, slots: np.ndarray) -> None:
        """`rid` now reads tokens[:len(slots)] at `slots` (verified): from now on they are
        checked after every cache call, until `drop(rid)`."""
        self.live[rid] = (tokens, np.asarray(slots, dtype=np.int64))

    def drop(self, rid: Any) -> None:
        """`rid` gives its slots up (call this *before* the cache call that may free them:
        cache_*, release)."""
        self.live.pop(rid, None)

    def note_handle(self, handle: LoadHandle | None) -> None:
        if handle is not None:
            self.handles.append(handle)

    def abandoned(self, rid: Any) -> None:
        self.abandoned_rids.add(rid)
        self.counts["abandoned"] += 1

    # -- calls
    async def call(
        self,
        what: str,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        allowed: tuple[type[BaseException], ...] = (),
    ) -> T:
        """One cache call: counted, under a deadline, errors checked; afterwards every live
        request's pages are checked."""
        if self.stopped():
            raise _Stop("stopped")
        self.counts["steps"] += 1
        try:
            with anyio.fail_after(self.call_deadline):
                result = await fn(*args)
            self._trace(what, result)
        except allowed as exc:
            self._trace(what, exc)
            if not self.stopped():
                self.check_live(what)
            raise
        except _Stop:
            raise
        except TimeoutError:
            self.violate(
                f"hung: {what} did not return within {self.call_deadline} "
                f"{'virtual ' if self.virtual else ''}seconds"
            )
        except Exception as exc:  # noqa: BLE001 - every unexpected error is a finding
            self._trace(what, exc)
            self.violate(f"{what} raised {type(exc).__name__}: {exc}")
        if self.stopped():
            raise _Stop("stopped")
        self.check_live(what)
        return result

    def _trace(self, what: str, result: object) -> None:
        if self.trace is None:
            return
        if isinstance(result, BaseException):
            text = f"raised {type(result).__name__}: {result}"
        elif isinstance(result, np.ndarray):
            text = _short(result)
        elif hasattr(result, "__dataclass_fields__"):
            parts = []
            for name in result.__dataclass_fields__:
                v = getattr(result, name)
                parts.append(f"{name}={_short(v) if isinstance(v, np.ndarray) else v!r}")
            text = f"{type(result).__name__}({', '.join(parts)})"
        else:
            text = repr(result)
        self.trace.append(f"{anyio.current_time():10.5f} {what} -> {text}")

    async def wait_handle(self, handle: LoadHandle | None, what: str) -> bool:
        """Wait for every layer of a load; False if it failed (allowed only with load faults)."""
        if handle is None:
            return True
        layers = self.cache.device_pool.geometry.layers
        try:
            with anyio.fail_after(self.call_deadline):
                await handle.wait_async(layers - 1)
        except TransferFailed as exc:
            if not self.load_faults:
                self.violate(f"{what}: load failed without an injected load fault: {exc}")
            self.counts["loads_failed_seen"] += 1
            return False
        except TimeoutError:
            self.violate(f"hung: {what}: a load handle did not land within {self.call_deadline} s")
        return True

    async def read_prefix(
        self,
        rid: Any,
        tokens: np.ndarray,
        prefix: np.ndarray,
        waits: Iterable[LoadHandle | None] = (),
    ) -> bool:
        """What an engine does before its model reads a request's prefix (`load_back`'s
        device slots): wait on `waits` (its load handle, `MatchOutcome.pending`), then check
        every page and `hold` them. False when the request must not read them (a load
        failed): the caller releases it (an engine would recompute). A wrong page is a
        violation."""
        for h in waits:
            self.note_handle(h)
        ok = True
        for h in waits:
            if h is not None:
                ok = await self.wait_handle(h, f"the loads under {rid}'s prefix") and ok
        if not ok:
            self.counts["released_after_failed_load"] += 1
            return False
        self.check_reads(rid, tokens, prefix, "in its prefix after load_back")
        self.hold(rid, tokens, prefix)
        return True

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await self.cache.kernel.sleep(seconds if self.virtual else min(seconds, 0.002))


def _short(slots: np.ndarray) -> str:
    s = list(map(int, slots))
    return str(s) if len(s) <= 24 else f"{s[:12]}...{s[-4:]} ({len(s)})"


# ---------------------------------------------------------------------------------- checks
def _check_slots(
    ctx: SimContext, what: str, slots: Any, *, n: int | None = None, whole_pages: bool = False
) -> np.ndarray:
    arr = np.asarray(slots)
    size = ctx.sim.cache["device_tokens"]
    if arr.ndim != 1 or (len(arr) and arr.dtype.kind not in "iu"):
        ctx.violate(f"{what}: slots are not a 1-D integer array ({arr.dtype}, {arr.shape})")
    if n is not None and len(arr) != n:
        ctx.violate(f"{what}: {len(arr)} slots, expected {n}")
    if whole_pages and len(arr) % ctx.sim.page_size:
        ctx.violate(f"{what}: {len(arr)} slots is not whole pages of {ctx.sim.page_size}")
    if len(arr) and (arr.min() < 0 or arr.max() >= size):
        ctx.violate(f"{what}: slot outside the device pool [0, {size}): {_short(arr)}")
    if len(np.unique(arr)) != len(arr):
        ctx.violate(f"{what}: duplicate slots {_short(arr)}")
    return arr.astype(np.int64, copy=False)


def _check_match(ctx: SimContext, rid: Any, tokens: np.ndarray, out: MatchOutcome) -> None:
    page = ctx.sim.page_size
    if out.rid != rid:
        ctx.violate(f"match({rid}) answered for {out.rid!r}")
    slots = _check_slots(ctx, f"match({rid})", out.device_slots, whole_pages=True)
    aligned = len(tokens) // page * page
    if out.host_len < 0 or out.host_len % page or len(slots) + out.host_len > aligned:
        ctx.violate(
            f"match({rid}): device {len(slots)} + host {out.host_len} tokens for "
            f"{len(tokens)} tokens of page {page}"
        )


def _check_prefetch(
    ctx: SimContext, rid: Any, out: PrefetchOutcome, what: str, *, ready: bool = False
) -> None:
    page = ctx.sim.page_size
    if out.rid != rid:
        ctx.violate(f"{what}({rid}) answered for {out.rid!r}")
    if out.state not in ("none", "skipped", "running", "done", "revoked"):
        ctx.violate(f"{what}({rid}): unknown state {out.state!r}")
    if (out.state == "skipped") != (out.reason is not None):
        ctx.violate(f"{what}({rid}): state {out.state} with reason {out.reason!r}")
    for name in ("hit_tokens", "done_tokens", "wanted_tokens"):
        v = getattr(out, name)
        if v < 0 or v % page:
            ctx.violate(f"{what}({rid}): {name}={v} is not whole pages of {page}")
    if out.done_tokens > max(out.hit_tokens, 0) and out.state != "skipped":
        ctx.violate(f"{what}({rid}): done {out.done_tokens} > hit {out.hit_tokens}")
    if out.state == "revoked" and out.done_tokens:
        ctx.violate(f"{what}({rid}): revoked with done_tokens={out.done_tokens}")
    if ready and out.state == "running":
        ctx.violate(f"{what}({rid}): returned while still running")
    ctx.counts[f"prefetch_{out.state}"] += 1
    if out.reason is not None:
        ctx.counts[f"prefetch_skipped_{out.reason}"] += 1


# ---------------------------------------------------------------------------------- clients
async def _run_request(ctx: SimContext, spec: RequestSpec, hurry: bool = False) -> bool:
    """One request of a built-in client, from match to its fate. Returns True when it was
    released with its load still in flight: the client's next request then starts at once
    (no think time), so its allocation presses on the slots that load is still filling."""
    cache = ctx.cache
    rid, tokens, page = spec.rid, spec.tokens, ctx.sim.page_size
    ctx.counts["requests"] += 1
    ctx.counts[f"fate_{spec.fate}"] += 1
    if not hurry:
        await ctx.sleep(spec.think)
    matched = tokens[: spec.match_len]
    if spec.fate == "rematch":
        short = matched[: len(matched) // 2]
        m0 = await ctx.call(f"match({rid})", cache.match, rid, short)
        _check_match(ctx, rid, short, m0)
    match = functools.partial(cache.match, retention=spec.retention)
    if spec.retention:
        ctx.counts["retained"] += 1
    m = await ctx.call(f"match({rid})", match, rid, matched)
    _check_match(ctx, rid, matched, m)
    ctx.counts["matched_tokens"] += len(matched)
    ctx.counts["hit_l1_tokens"] += m.device_len
    ctx.counts["hit_l2_tokens"] += m.host_len
    if spec.fate == "release_after_match":
        await ctx.call(f"release({rid})", cache.release, rid)
        return False
    if spec.fate == "abandon" and spec.abandon_at == "match":
        ctx.abandoned(rid)
        return False
    prefetched = False
    if spec.prefetch != "none":
        p = await ctx.call(f"prefetch({rid})", cache.prefetch, rid, tokens[: spec.prompt_len])
        _check_prefetch(ctx, rid, p, "prefetch")
        prefetched = p.state == "running" or p.state == "done"
        if spec.fate == "release_mid_prefetch" or (
            p.state == "running" and spec.fate == "finish" and ctx.rng.random() < 0.15
        ):
            ctx.counts[
                "released_mid_prefetch" if p.state == "running" else "released_after_prefetch"
            ] += 1
            await ctx.call(f"release({rid})", cache.release, rid)
            return False
        if spec.prefetch == "wait":
            p = await ctx.call(f"prefetch_wait({rid})", cache.prefetch_wait, rid)
            _check_prefetch(ctx, rid, p, "prefetch_wait", ready=True)
        elif spec.prefetch == "poll":
            p = await ctx.call(f"prefetch_poll({rid})", cache.prefetch_poll, rid)
            _check_prefetch(ctx, rid, p, "prefetch_poll")
    lb = await ctx.call(f"load_back({rid})", cache.load_back, rid)
    prefix = _check_slots(ctx, f"load_back({rid})", lb.device_slots, whole_pages=True)
    if lb.rid != rid:
        ctx.violate(f"load_back({rid}) answered for {lb.rid!r}")
    if lb.loaded_tokens < 0 or lb.loaded_tokens % page:
        ctx.violate(f"load_back({rid}): loaded_tokens={lb.loaded_tokens}")
    if lb.loaded_tokens and lb.handle is None:
        ctx.violate(
            f"load_back({rid}): loaded_tokens={lb.loaded_tokens} with no handle "
            "(a load needs one; a handle may also cover others' loads on the prefix)"
        )
    if len(prefix) > len(matched) // page * page:
        ctx.violate(
            f"load_back({rid}): a prefix of {len(prefix)} tokens for {len(matched)} matched"
        )
    if not prefetched:
        if not np.array_equal(prefix[: m.device_len], m.device_slots):
            ctx.violate(
                f"load_back({rid}): the prefix does not start with the matched slots",
                detail=f"match={_short(m.device_slots)} load_back={_short(prefix)}",
            )
        # load_back takes the prefix as the tree has it then: others may have loaded or
        # cached more of it since the match, so it can be longer, never shorter than what the
        # match found once something was loaded (the request's lock kept its L2 part).
        cut_short = lb.loaded_tokens and len(prefix) < m.device_len + m.host_len
        if len(prefix) < m.device_len + lb.loaded_tokens or cut_short:
            ctx.violate(
                f"load_back({rid}): {len(prefix)} prefix slots after a match of "
                f"{m.device_len} on L1 + {m.host_len} on L2 and {lb.loaded_tokens} loaded"
            )
    ctx.note_handle(lb.handle)
    if lb.loaded_tokens:
        ctx.counts["loads"] += 1
        ctx.counts["loaded_tokens"] += lb.loaded_tokens
    in_flight = lb.handle is not None and not lb.handle.done()
    if spec.fate == "release_mid_load" or (
        in_flight and spec.fate == "finish" and ctx.rng.random() < 0.25
    ):
        ctx.counts["released_mid_load" if in_flight else "released_after_load"] += 1
        await ctx.call(f"release({rid})", cache.release, rid)
        if in_flight:
            await _squeeze(ctx, rid, lb.handle)
        return in_flight
    if spec.fate == "abandon" and spec.abandon_at == "load":
        ctx.abandoned(rid)
        return False
    if not await ctx.read_prefix(rid, tokens, prefix, (lb.handle, *m.pending)):
        await ctx.call(f"release({rid})", cache.release, rid)
        return False
    await _compute(ctx, spec, prefix)
    return False


async def _squeeze(ctx: SimContext, released: Any, handle: LoadHandle | None) -> None:
    """Right after a release mid-load: another request takes as much of L1 as it can get
    (evicting whatever is unlocked, the released load's pages included), computes into it,
    and after that load has landed its pages must still be its own."""
    cache = ctx.cache
    rid = f"{released}-squeeze"
    size = ctx.sim.cache["device_tokens"]
    tokens = ctx.rng.integers(1 << 20, 1 << 21, size=size).astype(np.int64)  # shares nothing
    await ctx.call(f"match({rid})", cache.match, rid, tokens)
    n, new = size, None
    while n >= 1:
        try:
            new = await ctx.call(
                f"allocate({rid}, {n})", cache.allocate, rid, n, allowed=(CapacityError,)
            )
            break
        except CapacityError:
            n //= 2
    if new is not None:
        new = _check_slots(ctx, f"allocate({rid}, {n})", new, n=n)
        ctx.compute(tokens, new, 0)
        ctx.hold(rid, tokens, new)
        await ctx.wait_handle(handle, f"the load released by {released}")
        ctx.check_reads(rid, tokens, new, f"after the load {released} released landed")
        ctx.drop(rid)
        ctx.counts["squeezed_tokens"] += n
    await ctx.call(f"release({rid})", cache.release, rid)


async def _compute(ctx: SimContext, spec: RequestSpec, prefix: np.ndarray) -> None:
    """Allocate and compute chunk by chunk (cache_unfinished between), then the fate."""
    cache = ctx.cache
    rid, tokens, page = spec.rid, spec.tokens, ctx.sim.page_size
    slots = prefix
    pos = len(prefix)
    stop_at = None
    if spec.fate == "release_mid_compute":
        stop_at = pos + (len(tokens) - pos) // 2
    for end in spec.chunks:
        if end <= pos:
            continue
        n = end - pos
        parts = [n] if spec.alloc_batches == 1 or n < 2 else [n // 2, n - n // 2]
        for k in parts:
            try:
                new = await ctx.call(
                    f"allocate({rid}, {k})", cache.allocate, rid, k, allowed=(CapacityError,)
                )
            except CapacityError:
                ctx.counts["capacity_errors"] += 1
                ctx.drop(rid)
                await ctx.call(f"release({rid})", cache.release, rid)
                return
            new = _check_slots(ctx, f"allocate({rid}, {k})", new, n=k)
            if np.intersect1d(new, slots).size:
                ctx.violate(
                    f"allocate({rid}, {k}) returned slots the request already holds",
                    detail=f"new={_short(new)} held={_short(slots)}",
                )
            ctx.compute(tokens, new, pos)
            slots = np.concatenate([slots, new])
            pos += k
            ctx.hold(rid, tokens, slots)
        if stop_at is not None and pos >= stop_at:
            ctx.drop(rid)
            await ctx.call(f"release({rid})", cache.release, rid)
            return
        if spec.fate == "abandon" and spec.abandon_at == "compute":
            ctx.abandoned(rid)  # stays live: its pages stay locked until close
            return
        if end in spec.unfinished_at:
            ctx.check_reads(rid, tokens, slots, "before cache_unfinished")
            ctx.drop(rid)  # the call may free slots it passed (duplicates)
            out = await ctx.call(
                f"cache_unfinished({rid})", cache.cache_unfinished, rid, tokens[:pos], slots
            )
            aligned = pos // page * page
            tree = _check_slots(ctx, f"cache_unfinished({rid})", out.device_slots, n=aligned)
            if out.new_tokens < 0 or out.new_tokens > aligned:
                ctx.violate(f"cache_unfinished({rid}): new_tokens={out.new_tokens} of {aligned}")
            slots = np.concatenate([tree, slots[aligned:]])
            landed = True
            for h in out.pending:  # the tree's copy of some tokens may still be landing
                ctx.note_handle(h)
                landed = await ctx.wait_handle(h, f"the loads under {rid}'s prefix") and landed
            if not landed:
                ctx.counts["released_after_failed_load"] += 1
                await ctx.call(f"release({rid})", cache.release, rid)
                return
            ctx.check_reads(rid, tokens, slots, "after cache_unfinished")
            ctx.hold(rid, tokens, slots)
            ctx.counts["cache_unfinished"] += 1
    ctx.check_reads(rid, tokens, slots, "before cache_finished")
    ctx.drop(rid)
    if spec.fate == "wrong_tokens" and len(prefix):
        other = tokens.copy()
        other[int(ctx.rng.integers(len(prefix)))] += 1  # not the tokens its prefix holds
        try:
            await ctx.call(
                f"cache_finished({rid}) with other tokens",
                cache.cache_finished,
                rid,
                other,
                slots,
                allowed=(ValueError,),
            )
        except ValueError:
            ctx.counts["invalid_request_ok"] += 1
        else:
            ctx.violate(
                f"cache_finished({rid}) accepted tokens that differ from the ones its "
                "prefix was matched for"
            )
        ctx.check_reads(rid, tokens, slots, "after a refused cache_finished")
    out = await ctx.call(f"cache_finished({rid})", cache.cache_finished, rid, tokens, slots)
    aligned = len(tokens) // page * page
    _check_slots(ctx, f"cache_finished({rid})", out.device_slots, n=aligned)
    ctx.counts["finished"] += 1
    if spec.pin is not None:
        length, tiers, ttl = spec.pin
        pin = functools.partial(cache.pin, tiers=tiers, ttl=ttl)
        try:
            await ctx.call(f"pin({rid})", pin, tokens[:length], allowed=(PinLimitError,))
            ctx.counts["pins"] += 1
        except PinLimitError:
            ctx.counts["pins_refused"] += 1
    if spec.unpin and await ctx.call(f"unpin({rid})", cache.unpin, tokens[:page]):
        ctx.counts["unpinned"] += 1
    if spec.fate == "finish_then_poke":
        # The request is over: anything on it must be UnknownRequest, changing nothing.
        poke = int(ctx.rng.integers(3))
        pokes: list[tuple[str, Callable[..., Awaitable[object]], tuple[Any, ...]]] = [
            ("release", cache.release, (rid,)),
            ("load_back", cache.load_back, (rid,)),
            ("allocate", cache.allocate, (rid, 1)),
        ]
        name, fn, args = pokes[poke]
        try:
            await ctx.call(f"{name}({rid}) after finish", fn, *args, allowed=(UnknownRequest,))
        except UnknownRequest:
            ctx.counts["unknown_request_ok"] += 1
        else:
            ctx.violate(f"{name}({rid}) after cache_finished did not raise UnknownRequest")


async def builtin_clients(ctx: SimContext) -> None:
    """The default driver: one kernel task per client, each running its requests in order."""
    cache = ctx.cache
    done = cache.kernel.reply()
    left = [len(ctx.workload.clients)]

    async def client(requests: tuple[RequestSpec, ...]) -> None:
        try:
            hurry = False
            for spec in requests:
                if ctx.stopped():
                    break
                hurry = bool(await _run_request(ctx, spec, hurry))
        except _Stop:
            pass
        except Exception as exc:  # noqa: BLE001 - a fuzzer bug still must not hang the run
            if ctx.violation is None:
                ctx.violation = SimViolation(
                    ctx.sim.seed,
                    f"client crashed: {type(exc).__name__}: {exc}",
                    config=ctx.sim.summary(),
                    repro=ctx.repro,
                )
        finally:
            left[0] -= 1
            if not left[0]:
                done.set(None)

    for i, requests in enumerate(ctx.workload.clients):
        cache.kernel.start_soon(client, requests, name=f"sim-client{i}")
    await done.wait()


# ---------------------------------------------------------------------------------- the run
_NOT_TABLES = {"_cfg", "_actors", "counters", "_ledgers", "_slots", "_workers", "ledgers"}


def _owners(actor: Any) -> list[tuple[str, Any]]:
    """The actor and the parts of its controller, if it has one (each owns tables)."""
    core = getattr(actor, "core", None)
    if core is None:
        return [("", actor)]
    parts = [
        (f"core.{k}.", v)
        for k, v in vars(core).items()
        if hasattr(v, "__dict__") and type(v).__module__.startswith("hicache.components")
    ]
    return [("", actor), ("core.", core), *parts]


def leftover_tables(cache: HiCache) -> list[str]:
    """After close: every dict, set, list or deque an actor keeps that is not empty (a dict of
    lists counts as empty when its lists are), and the kernel's pending replies and helpers."""
    out = []
    kernel = cache.kernel
    for name, actor in kernel.actors.items():
        for prefix, owner in _owners(actor):
            for attr, value in vars(owner).items():
                if attr in _NOT_TABLES or not isinstance(value, (dict, set, list, deque)):
                    continue
                if (
                    isinstance(value, dict)
                    and value
                    and all(isinstance(v, (list, deque)) for v in value.values())
                ):
                    if any(len(v) for v in value.values()):
                        out.append(f"{name}.{prefix}{attr}")
                elif len(value):
                    out.append(f"{name}.{prefix}{attr}={_describe(value)}")
    if kernel.pending_replies:
        out.append(f"kernel: {kernel.pending_replies} pending replies")
    if kernel._helpers:
        out.append(f"kernel: {len(kernel._helpers)} helper tasks")
    return out


def _describe(value: Any) -> str:
    items = list(value.items() if isinstance(value, dict) else value)
    text = repr(items[:3])
    return (
        (text[:150] + "...")
        if len(text) > 150
        else text + (f" ({len(items)})" if len(items) > 3 else "")
    )


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


async def _warm_storage(
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


def _make_backend(
    sim: SimConfig, cfg: CacheConfig, root: str | None, hooks: SimHooks, store: MemoryStore | None
) -> tuple[FaultyBackend, StorageBackend]:
    backend = FaultyBackend(
        _inner_backend(sim, cfg, root, store), sim.faults.backend or BackendFaults()
    )
    if hooks.wrap_backend is not None:
        return backend, hooks.wrap_backend(backend)
    return backend, backend


async def _simulate(ctx: SimContext, log: EventLog | None = None) -> None:
    sim = ctx.sim
    hooks = ctx.hooks
    root = tempfile.mkdtemp(prefix=f"hicache-sim-{sim.seed}-") if sim.storage == "file" else None
    plan = SimFaultPlan(sim.faults, real_delays=sim.mode == "thread")
    ctx.plan = plan
    faulty = None
    backend = None
    try:
        spec = None
        if sim.storage != "none" and not sim.wrap_backend and hooks.wrap_backend is None:
            spec = "memory" if sim.storage == "memory" else f"file:{root}"
        cfg = sim.cache_config(spec)
        store = None
        if sim.storage == "memory" and spec is None:
            from hicache.backends.memory import MemoryStore

            store = MemoryStore()
        if sim.warm_l3:
            try:
                with anyio.fail_after(3600.0 if ctx.virtual else 120.0):
                    await _warm_storage(ctx, cfg, root, store)
            except Exception as exc:  # noqa: BLE001 - a fault-free run must not fail either
                ctx.violation = SimViolation(
                    sim.seed,
                    f"the warm-up cache (fault-free) failed: {type(exc).__name__}: {exc}",
                    config=sim.summary(),
                    repro=ctx.repro,
                )
                return
        if sim.storage != "none" and spec is None:
            faulty, backend = _make_backend(sim, cfg, root, hooks, store)
        ctx.faulty = faulty
        streams = None
        if sim.late_landing:
            streams = LateLandingStreams(bandwidth=sim.cache["transfer_bandwidth"], fault=plan)
        cache = HiCache(cfg, backend=backend, transfer_faults=plan, streams=streams, log=log)
        ctx.cache = cache
        run_deadline = 3600.0 if ctx.virtual else 120.0
        try:
            with anyio.fail_after(run_deadline):
                async with cache:
                    if streams is not None:
                        streams.bind(cache)
                    driver = hooks.driver or builtin_clients
                    try:
                        await driver(ctx)
                    except _Stop:
                        pass
                    if ctx.violation is None:
                        await _quiesce(ctx)
                    if ctx.violation is not None:
                        return  # close anyway (below), but the first violation is the finding
        except _Stop:
            return
        except TimeoutError:
            if ctx.violation is None:
                ctx.violation = SimViolation(
                    sim.seed,
                    f"hung: the run (or its close) did not end within {run_deadline} "
                    f"{'virtual ' if ctx.virtual else ''}seconds",
                    config=sim.summary(),
                    repro=ctx.repro,
                )
            return
        except LedgerImbalance as exc:
            if ctx.violation is None:
                ctx.violation = SimViolation(
                    sim.seed, f"leak at close: {exc}", config=sim.summary(), repro=ctx.repro
                )
            return
        except Exception as exc:  # noqa: BLE001 - ActorFailed and the like
            if ctx.violation is None:
                ctx.violation = SimViolation(
                    sim.seed,
                    f"close raised {type(exc).__name__}: {exc}",
                    config=sim.summary(),
                    repro=ctx.repro,
                )
            return
        if ctx.stopped():
            return
        took = anyio.current_time() - ctx.close_started
        if took >= sim.cache["close_timeout"]:
            ctx.violation = SimViolation(
                sim.seed,
                f"hung: close took {took:.1f} s, past close_timeout: it abandoned work in flight",
                config=sim.summary(),
                repro=ctx.repro,
            )
            return
        report = cache.close_report or {}
        used = {t: v["used"] for t, v in report.items() if v.get("used")}
        if used or not report:
            ctx.violation = SimViolation(
                sim.seed, f"leak at close: ledgers {report}", config=sim.summary(), repro=ctx.repro
            )
            return
        left = leftover_tables(cache)
        if left:
            ctx.violation = SimViolation(
                sim.seed,
                "tables not empty after close: " + "; ".join(left),
                config=sim.summary(),
                repro=ctx.repro,
            )
    finally:
        if faulty is not None:
            await faulty.aclose()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


async def _quiesce(ctx: SimContext) -> None:
    """Let every load land, flush, settle; then nothing may be in flight but what the
    abandoned requests hold."""
    cache = ctx.cache
    for handle in ctx.handles:
        try:
            await ctx.wait_handle(handle, "a load at the end of the run")
        except _Stop:
            return
    try:
        # Prefetches of released or abandoned requests, uploads and their retries end by
        # themselves (every storage call has a deadline): give them a bounded while.
        patience = 30.0 if ctx.virtual else 10.0
        start = anyio.current_time()
        while True:
            await ctx.call("flush()", cache.flush)
            if ctx.virtual:
                await cache.kernel.run_until_idle()
            stats = await ctx.call("stats()", cache.stats)
            flying = {k: v for k, v in stats.inflight.items() if k != "requests" and v}
            if not flying:
                break
            if anyio.current_time() - start > patience:
                ctx.violate(
                    f"hung: still in flight {patience} s after the clients finished "
                    f"(every load landed, flushed): {flying}"
                )
            if ctx.virtual:
                await cache.kernel.sleep(0.05)
            else:
                await anyio.sleep(0.01)
        if ctx.virtual:
            # Past every prefetch deadline: a timer left running for an op that ended would
            # fire now, and what it leaves behind shows in the tables at close.
            c = ctx.sim.cache
            await cache.kernel.sleep(
                c["prefetch_timeout_base"] + c["prefetch_timeout_per_ki_token"] + 1.0
            )
            await cache.kernel.run_until_idle()
            stats = await ctx.call("stats()", cache.stats)
            flying = {k: v for k, v in stats.inflight.items() if k != "requests" and v}
            if flying:
                ctx.violate(f"work in flight again after the cache had settled: {flying}")
        ctx.counts["l1_evicted_tokens"] += stats.device.evictions
        ctx.counts["l2_evicted_tokens"] += stats.host.evictions
        ctx.counts["l3_hit_tokens"] += stats.storage_hit_tokens
        if stats.inflight["requests"] != len(ctx.abandoned_rids):
            ctx.violate(
                f"{stats.inflight['requests']} requests open after the run; only "
                f"{len(ctx.abandoned_rids)} were abandoned"
            )
        ctx.check_live("the run")
    except _Stop:
        return
    ctx.close_started = anyio.current_time()


def run_simulation(
    seed: int,
    *,
    mode: str = "virtual",
    config: SimConfig | None = None,
    hooks: SimHooks | None = None,
    skip: Iterable[str] = (),
    repro: str | None = None,
    log: EventLog | None = None,
    trace: list[str] | None = None,
) -> SimReport:
    """Run one seed; return its `SimReport`, or raise `SimViolation`.

    `mode`: "virtual" (deterministic: the same seed replays exactly) or "thread" (asyncio,
    real CPU transfer threads, real time). `config`: a `SimConfig` to run instead of the
    seed's own (e.g. `replace(random_config(7), storage="file")`). `skip`: fault kinds, fates
    or `late_landing` to leave out (`SKIPPABLE`). `repro`: the reproduction line to print
    (default `REPRO`). `log`: an `EventLog` for the cache (e.g. `EventLog(capture=True)` to
    look at a failing seed's events). `trace`: a list that receives one line per cache call
    (virtual time, the call, its answer), for triage."""
    skip = tuple(skip)
    sim = config if config is not None else random_config(seed, mode=mode, skip=skip)
    workload = generate_workload(sim, skip=skip)
    line = (repro or REPRO).format(seed=seed, mode=sim.mode)
    if repro is None and sim.mode != "virtual":
        line += f" --sim-mode {sim.mode}"
    ctx = SimContext(sim, workload, hooks or SimHooks(), line)
    ctx.trace = trace
    started = time.perf_counter()
    clock: list[float] = [0.0]

    async def main() -> None:
        await _simulate(ctx, log=log)
        clock[0] = anyio.current_time()

    if sim.mode == "virtual":
        run_deterministic(main, seed=seed)
    else:
        anyio.run(main, backend="asyncio")
    if ctx.violation is not None:
        raise ctx.violation
    assert ctx.plan is not None  # _simulate sets it first
    faults = Counter(ctx.plan.injected)
    if ctx.faulty is not None:
        faults.update(ctx.faulty.injected)
    return SimReport(
        seed=seed,
        mode=sim.mode,
        config=sim.summary(),
        features=sim.features(),
        counts=ctx.counts,
        faults=faults,
        virtual_seconds=clock[0] if sim.mode == "virtual" else 0.0,
        wall_seconds=time.perf_counter() - started,
    )


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
