"""One seed from start to verdict (`run_simulation`): open the storage and the cache, run the
driver, settle, close, and check what close left."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio

from hicache.cache import HiCache, LedgerImbalance
from hicache.runtime import run_deterministic
from hicache.testing.simulation.clients import builtin_clients
from hicache.testing.simulation.close import leftover_tables, quiesce
from hicache.testing.simulation.config import SimConfig, random_config
from hicache.testing.simulation.context import SimContext, SimHooks
from hicache.testing.simulation.errors import SimViolation, StopRun
from hicache.testing.simulation.faults import SimFaultPlan
from hicache.testing.simulation.report import SimReport
from hicache.testing.simulation.storage import make_backend, warm_storage
from hicache.testing.simulation.streams import LateLandingStreams
from hicache.testing.simulation.workload import generate_workload

if TYPE_CHECKING:
    from hicache.observability import EventLog


REPRO = "pytest tests/sim/test_simulation.py --sim-seed {seed}"
"""The one-line reproduction printed with every violation (`{seed}`, `{mode}` are filled)."""


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
                    await warm_storage(ctx, cfg, root, store)
            except Exception as exc:  # noqa: BLE001 - a fault-free run must not fail either
                ctx.violation = SimViolation(
                    sim.seed,
                    f"the warm-up cache (fault-free) failed: {type(exc).__name__}: {exc}",
                    config=sim.summary(),
                    repro=ctx.repro,
                )
                return
        if sim.storage != "none" and spec is None:
            faulty, backend = make_backend(sim, cfg, root, hooks, store)
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
                    except StopRun:
                        pass
                    if ctx.violation is None:
                        await quiesce(ctx)
                    if ctx.violation is not None:
                        return  # close anyway (below), but the first violation is the finding
        except StopRun:
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
