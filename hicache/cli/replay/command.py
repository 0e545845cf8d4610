"""`hicache replay`: a Mooncake-format trace through L1 + L2 + L3 with real bytes moved.

Each request, in steps of `--batch`, is matched, prefetched from L3 (when storage is on),
loaded back from L2, computed (no model: the KV of its new tokens is written as a pure function
of page key, layer and position), inserted and released. Every page that reaches L1 from L2 is
checked against what it must be (`--verify`).

`--hybrid SPEC` runs each request through `HybridCache` instead, for a model with
sliding-window or recurrent layers (`hicache/cli/replay/hybrid.py`).

`--detach-at N` detaches L3 at run time after the step in which the Nth request finished
(`HiCache.detach_storage`), and `--attach-at M` attaches the same `--storage` again after the
Mth (`HiCache.attach_storage`): the replay goes on through both, requests see no L3 meanwhile.

Here: the loop and the command. The batched step is `step.py`; the flags, progress
display and report are `args.py`, `progress.py` and `report.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from hicache.cache import HiCache
from hicache.cli.replay.args import cache_config, pin_tiers, scratch_dir
from hicache.cli.replay.exit import (
    Stopped,
    StopRequest,
    exit_code,
    owned_scratch,
    reinstall_stop_handlers,
    stop_on_signals,
    sweep_stale,
    watch_signals,
)
from hicache.cli.replay.hybrid import (
    hybrid_kv,
    parse_hybrid,
    parse_state_snapshots,
    run_hybrid_step,
)
from hicache.cli.replay.link import LinkReference, link_utilization, measure_link
from hicache.cli.replay.progress import progress_display
from hicache.cli.replay.report import add_flags, print_table, summarize
from hicache.cli.replay.step import Timer, run_step
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest, read_trace, scheduler_steps
from hicache.config import CacheConfig
from hicache.hybrid import HybridCache, HybridModel, state_config
from hicache.hybrid.states import state_pages
from hicache.observability import EventLog
from hicache.results import CapacityError
from hicache.runtime import run_deterministic
from hicache.types import RequestId

_T = TypeVar("_T")


def _warn_if_cap_lowered(backend: object) -> None:
    """Say at start when the store's cap in force is below the one asked for (a file store
    on a filesystem that cannot hold it)."""
    stats = getattr(backend, "stats", None)
    got = dict(stats()) if callable(stats) else {}
    asked, cap = got.get("configured_max_bytes"), got.get("max_bytes")
    if isinstance(asked, int) and isinstance(cap, int) and cap < asked:
        print(
            f"hicache replay: L3 cap lowered to {cap:,} bytes (asked {asked:,}): that is "
            "what the store holds plus 90% of its filesystem's free space",
            file=sys.stderr,
        )


async def replay(
    cfg: CacheConfig,
    requests: list[TraceRequest],
    *,
    block_tokens: int,
    batch: int,
    verify: bool,
    log: EventLog | None,
    progress: Callable[[int], object],
    on_step: Callable[[Tally], object] | None = None,
    salts: int = 0,
    detach_at: int | None = None,
    attach_at: int | None = None,
    pin_first_block: tuple[str, ...] = (),
    hybrid: HybridModel | None = None,
    state_snapshots: tuple[int | None, int | None] | None = None,
    tally: Tally | None = None,
    stop: StopRequest | None = None,
) -> tuple[Tally, dict[str, Any]]:
    """Replay `requests`; `progress(done)` after every step, and `on_step(tally)` too (the
    running counts: the live hit rate is (device_hit + loaded) / input_tokens). With
    `detach_at`, L3 is detached once that many requests are done; with `attach_at`, attached
    again (the same `cfg.storage`, with `cfg.extra`) once that many are. With `hybrid`,
    requests go one by one through `HybridCache` (hybrid.py; its pool: the config's),
    with `state_snapshots` (L1, L2; None: state_config's default) keeping the snapshots in a
    states cache of their own. `tally` (a new one by default) is filled as steps end; once
    `stop` records a signal, no step starts and the cache closes as after the last one."""
    check_storage_switch(cfg, detach_at, attach_at)
    if any(t not in ("device", "host") for t in pin_first_block):
        raise ValueError(
            f"pin_first_block: tiers must be device and/or host, got {pin_first_block}"
        )
    if hybrid is not None and pin_first_block:
        raise ValueError("--pin-first-block is not supported with --hybrid")
    tally = Tally() if tally is None else tally
    timer = Timer(tally)
    async with (
        HiCache(cfg, log=log) as cache,
        _states_cache(cfg, hybrid, state_snapshots) as states,
        _setup_frozen(),
    ):
        opened = time.perf_counter()  # the pools exist (allocated, pinned): the run starts
        switches = _StorageSwitches(cfg, detach_at, attach_at)
        exporter = getattr(cache, "_metrics", None)
        if exporter is not None:
            print(
                f"hicache replay: Prometheus metrics on http://localhost:{exporter.port}/metrics",
                file=sys.stderr,
            )
        _warn_if_cap_lowered(cache.backend)
        pins = pin_first_block
        hc = HybridCache(cache, hybrid, states=states) if hybrid is not None else None
        for step in scheduler_steps(requests, batch, budget=cfg.device_tokens // 2):
            if stop is not None and stop.signum is not None:
                break
            storage_on = cache.backend is not None
            if hc is not None:
                await run_hybrid_step(
                    hc,
                    step,
                    tally,
                    timer,
                    block_tokens=block_tokens,
                    verify=verify,
                    storage_on=storage_on,
                    salts=salts,
                )
            else:
                try:
                    await run_step(
                        cache, step, tally, timer, block_tokens, verify, storage_on, salts, pins
                    )
                except CapacityError:
                    # Too much at once for L1: drop the step's state and run it one by one.
                    await cache.release_many(RequestId(f"r{r.index}") for r in step)
                    for req in step:
                        try:
                            await run_step(
                                cache,
                                [req],
                                tally,
                                timer,
                                block_tokens,
                                verify,
                                storage_on,
                                salts,
                                pins,
                            )
                        except CapacityError:
                            await cache.release(RequestId(f"r{req.index}"))
                            tally.rejected += 1
                            tally.requests += 1
                            tally.input_tokens += req.input_length
            progress(tally.requests)
            if on_step is not None:
                on_step(tally)
            await switches.after(cache, tally.requests)
        backend = cache.backend
        with timer("flush"):
            if stop is None or stop.signum is None:  # stopped: close without waiting on L3
                await cache.flush()
            stats = await cache.stats()
        extra: dict[str, Any] = {
            "run_s": time.perf_counter() - opened,  # first step to the last write flushed
            "bytes": {**stats.bytes},
            "evictions": {"device": stats.device.evictions, "host": stats.host.evictions},
            "storage_dropped": dict(stats.storage_dropped),
        }
        if backend is not None:
            backend_stats = dict(backend.stats())
            extra["backend"] = backend_stats
            extra["bytes"]["h2s"] = int(backend_stats.get("bytes_written", 0))
            extra["bytes"]["s2h"] = int(backend_stats.get("bytes_read", 0))
        if hc is None:
            tally.host_hit = stats.host.hit_tokens
            tally.storage_hit = stats.storage_hit_tokens
        else:  # hits were counted per request (the stats count snapshot pages as hits too)
            model = hc.model
            counts = tally.extra.get("hybrid")
            extra["hybrid"] = {
                "pool_layers": len(model.pool_layers),
                "state_bytes": model.state_bytes,
                "grid": model.grid,
                "pages_per_snapshot": (
                    state_pages(cache.device_pool, model.state_bytes)
                    if model.stateful and states is None
                    else 0
                ),
                **(counts.as_dict() if counts is not None else {}),
            }
            if states is not None:
                extra["hybrid"]["states_cache"] = await _states_report(states)
    return tally, extra


@contextlib.asynccontextmanager
async def _states_cache(
    cfg: CacheConfig, hybrid: HybridModel | None, sizes: tuple[int | None, int | None] | None
) -> AsyncIterator[HiCache | None]:
    """The states cache `--state-snapshots` asks for, opened (None: snapshots in the pools)."""
    if hybrid is None or sizes is None:
        yield None
        return
    config = state_config(cfg, hybrid, device_snapshots=sizes[0], host_snapshots=sizes[1])
    async with HiCache(config) as states:
        yield states


async def _states_report(states: HiCache) -> dict[str, Any]:
    """The states cache's room and traffic, in snapshots (a page each) and bytes."""
    await states.flush()
    stats = await states.stats()
    page = states.config.page_size
    return {
        "device_snapshots": states.config.device_tokens // page,
        "host_snapshots": states.config.host_capacity // page,
        "evictions": {
            "device": stats.device.evictions // page,
            "host": stats.host.evictions // page,
        },
        "bytes": {**stats.bytes},
        "h2s": int(states.backend.stats().get("bytes_written", 0)) if states.backend else 0,
    }


def check_storage_switch(cfg: CacheConfig, detach_at: int | None, attach_at: int | None) -> None:
    """ValueError for --detach-at / --attach-at that cannot work."""
    if detach_at is not None and (not cfg.storage or detach_at < 1):
        raise ValueError("--detach-at needs storage (--storage) and a count of requests >= 1")
    if attach_at is not None and (detach_at is None or attach_at <= detach_at):
        raise ValueError(
            "--attach-at needs --detach-at and a larger count: storage is attached from the "
            "start and re-attached only after it was detached"
        )


class _StorageSwitches:
    """Detach L3 once `detach_at` requests are done, attach it again at `attach_at`."""

    def __init__(self, cfg: CacheConfig, detach_at: int | None, attach_at: int | None) -> None:
        self._cfg = cfg
        self._detach_at = detach_at
        self._attach_at = attach_at

    async def after(self, cache: HiCache, done: int) -> None:
        if self._detach_at is not None and done >= self._detach_at:
            self._detach_at = None
            await cache.detach_storage()
        elif self._attach_at is not None and self._detach_at is None and done >= self._attach_at:
            self._attach_at = None
            assert self._cfg.storage is not None  # check_storage_switch
            await cache.attach_storage(self._cfg.storage, **self._cfg.extra)


def run(args: argparse.Namespace) -> int:
    tiers = pin_tiers(getattr(args, "pin_first_block", None))  # a bad tier fails before any work
    spec = getattr(args, "hybrid", None)
    hybrid = parse_hybrid(spec, args.page_size, args.kv) if spec is not None else None
    kv = hybrid_kv(args.kv, hybrid) if hybrid is not None else args.kv
    state_sizes = parse_state_snapshots(getattr(args, "state_snapshots", None), hybrid)
    parent = getattr(args, "tmp_dir", None)
    if parent is not None and not Path(parent).is_dir():
        raise ValueError(f"--tmp-dir {parent}: not a directory")
    parent = parent or scratch_dir()
    stop = StopRequest()
    tally = Tally()  # filled as the replay goes: a stopped run reports what it did
    outcome: tuple[Tally, dict[str, Any]] | None = None
    requests: list[TraceRequest] = []
    cfg: CacheConfig | None = None
    link: LinkReference | None = None
    t0 = time.perf_counter()
    with stop_on_signals():
        try:
            report_swept(sweep_stale(parent))
            requests = read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
            if not requests:
                raise ValueError(f"--trace {args.trace}: holds no requests")
            with owned_scratch(parent) as tmp:
                cfg = cache_config(args, kv=kv, tmp=tmp)
                with contextlib.ExitStack() as files:
                    events_file = (
                        files.enter_context(open(args.events, "w", encoding="utf-8"))
                        if args.events
                        else None
                    )
                    log = EventLog(sink=events_file) if events_file else None
                    # the link's contiguous copy rate, before the clock starts (virtual time: none)
                    link = None if args.deterministic else measure_link(cfg.device)
                    t0 = time.perf_counter()
                    with progress_display(len(requests), args.quiet) as show:
                        run_cfg = cfg

                        async def replay_once() -> tuple[Tally, dict[str, Any]]:
                            return await replay(
                                run_cfg,
                                requests,
                                block_tokens=args.block_tokens,
                                batch=args.batch,
                                verify=args.verify,
                                log=log,
                                progress=lambda done: None,
                                on_step=show,
                                salts=args.salts,
                                detach_at=getattr(args, "detach_at", None),
                                attach_at=getattr(args, "attach_at", None),
                                pin_first_block=tiers,
                                hybrid=hybrid,
                                state_snapshots=state_sizes,
                                tally=tally,
                                stop=stop,
                            )

                        async def main() -> tuple[Tally, dict[str, Any]] | None:
                            return await until_stopped(replay_once, stop)

                        if args.deterministic:
                            outcome = run_deterministic(main, seed=args.seed)
                        else:
                            outcome = anyio.run(main)
                        reinstall_stop_handlers()  # the event loop put the defaults back
        except Stopped as s:
            stop.signum = stop.signum if stop.signum is not None else s.signum
    wall = time.perf_counter() - t0
    if stop.signum is not None and (cfg is None or not tally.requests):
        print(f"hicache replay: {stop.name}: stopped before any request ran", file=sys.stderr)
        return exit_code(stop.signum)
    assert cfg is not None
    tally, extra = outcome if outcome is not None else (tally, {})
    done = requests if stop.signum is None else requests[: tally.requests]
    summary = summarize(
        tally, extra, cfg, done, block_tokens=args.block_tokens, storage=args.storage, wall=wall
    )
    if link is not None and "run_s" in extra:
        moved = summary["bytes"]["d2h"] + summary["bytes"]["h2d"]
        summary["link"] = link_utilization(moved, extra["run_s"], link)
    add_flags(
        summary,
        tally,
        extra,
        pin_tiers=tiers,
        detach_at=getattr(args, "detach_at", None),
        attach_at=getattr(args, "attach_at", None),
        hybrid_spec=spec,
    )
    if stop.signum is not None:  # what it did before the signal: marked so
        summary["partial"] = {"stopped_by": stop.name, "requests_in_trace": len(requests)}
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if stop.signum is not None:
        return exit_code(stop.signum)
    corrupt_states = summary.get("hybrid", {}).get("corrupt_states", 0)
    return 1 if summary["corrupt_pages"] or corrupt_states else 0


async def until_stopped(work: Callable[[], Awaitable[_T]], stop: StopRequest) -> _T | None:
    """`work()`, with SIGTERM, SIGHUP and SIGINT watched meanwhile (exit.py): None when a
    second signal cancelled it."""
    result: list[_T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals, stop, tg.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:  # noqa: BLE001 - raised as is below, not as a group
            failure.append(exc)
        finally:
            tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return result[0] if result else None


def report_swept(removed: list[tuple[str, int]]) -> None:
    """One line on stderr per stale store removed at start."""
    for path, size in removed:
        print(
            f"hicache replay: removed {path} ({size / 1e9:.2f} GB), the store of a replay that "
            "ended without removing it",
            file=sys.stderr,
        )


@contextlib.asynccontextmanager
async def _setup_frozen() -> AsyncIterator[None]:
    """While the run lasts, what exists when it starts (modules, pools, actors, all living as
    long as it) is out of the collector's reach: each full collection then walks only what
    the run makes, not the ~200k objects of the imports (a serving process does the same
    after start-up). Undone at the end, so that a later collection frees it all."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
