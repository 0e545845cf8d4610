"""What a run's driver works with (`SimContext`: the cache, the workload, the KV and call
checks) and the ways to change a run (`SimHooks`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import numpy as np

from hicache.kernels.streams.base import LoadHandle, TransferFailed
from hicache.testing.simulation.errors import SimViolation, StopRun, short_slots
from hicache.testing.synthetic import kv_seeds

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend
    from hicache.cache import HiCache
    from hicache.testing.faulty_backend import FaultyBackend
    from hicache.testing.simulation.config import SimConfig
    from hicache.testing.simulation.faults import SimFaultPlan
    from hicache.testing.simulation.workload import Workload

T = TypeVar("T")


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
        raise StopRun(what)

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
                detail=f"tokens={len(tokens)} slots={short_slots(slots)}",
            )

    def check_live(self, where: str) -> None:
        """Every page every live request verified so far still holds its KV; the upload
        backlog stays within `max_upload_backlog`."""
        tree = self._cache.system.actors.get("tree") if self._cache is not None else None
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
                    detail=f"tokens={len(tokens)} slots={short_slots(slots)}",
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
            raise StopRun("stopped")
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
        except StopRun:
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
            raise StopRun("stopped")
        self.check_live(what)
        return result

    def _trace(self, what: str, result: object) -> None:
        if self.trace is None:
            return
        if isinstance(result, BaseException):
            text = f"raised {type(result).__name__}: {result}"
        elif isinstance(result, np.ndarray):
            text = short_slots(result)
        elif hasattr(result, "__dataclass_fields__"):
            parts = []
            for name in result.__dataclass_fields__:
                v = getattr(result, name)
                parts.append(f"{name}={short_slots(v) if isinstance(v, np.ndarray) else v!r}")
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
            await self.cache.system.sleep(seconds if self.virtual else min(seconds, 0.002))
