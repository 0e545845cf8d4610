"""`hicache replay`: a Mooncake-format trace through L1 + L2 + L3 with real bytes moved.

Each request, in steps of `--batch`, is matched, prefetched from L3 (when storage is on),
loaded back from L2, computed (no model: the KV of its new tokens is written as a pure function
of page key, layer and position), inserted and released. Every page that reaches L1 from L2 is
checked against what it must be (`--verify`).

`--hybrid SPEC` runs each request through `HybridCache` instead, for a model with
sliding-window or recurrent layers (`hicache/cli/hybrid_replay.py`).

`--detach-at N` detaches L3 at run time after the step in which the Nth request finished
(`HiCache.detach_storage`), and `--attach-at M` attaches the same `--storage` again after the
Mth (`HiCache.attach_storage`): the replay goes on through both, requests see no L3 meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from typing_extensions import Self

from hicache.backends.keys import chain_page_hashes
from hicache.cache import HiCache
from hicache.cli.hybrid_replay import hybrid_kv, parse_hybrid, run_hybrid_step
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest, bound_hit_rate, read_trace, scheduler_steps
from hicache.config import CacheConfig
from hicache.hybrid import HybridCache, HybridModel
from hicache.hybrid.states import state_pages
from hicache.observability import EventLog
from hicache.results import CapacityError, PinLimitError
from hicache.runtime import run_deterministic
from hicache.secrets import redact_url
from hicache.testing.kvfill import count_bad_pages, fill, page_seeds
from hicache.types import RequestId


class _Timer:
    """Accumulates the time spent inside cache calls (the control plane)."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._tally.control_s += time.perf_counter() - self._t0


async def _run_step(
    cache: HiCache,
    step: list[TraceRequest],
    tally: Tally,
    timer: _Timer,
    block_tokens: int,
    verify: bool,
    storage_on: bool,
    salts: int = 0,
    pin_first_block: tuple[str, ...] = (),
) -> None:
    """One scheduler step: match, prefetch, load back (verified), allocate, compute, insert.
    With `salts`, request i runs under salt `salt-{i % salts}` (tenants sharing the cache);
    with `pin_first_block`, each request's first block (its system prompt, in the trace's
    terms) is pinned in those tiers once cached."""
    page = cache.config.page_size
    pool = cache.device_pool
    toks = {RequestId(f"r{r.index}"): r.tokens(block_tokens) for r in step}
    salt = {RequestId(f"r{r.index}"): f"salt-{r.index % salts}" if salts else None for r in step}
    # One seed per whole page, plus one for a partial last page (computed, never cached).
    # Without verification nothing reads the KV's content: the stand-in model writes none
    # (the transfers still move every byte).
    seeds = (
        {
            rid: np.append(page_seeds(chain_page_hashes(t[: len(t) // page * page], page)), 0)
            for rid, t in toks.items()
        }
        if verify
        else {}
    )
    with timer:
        matches = await cache.match_many((rid, t, salt[rid]) for rid, t in toks.items())
    if storage_on:
        with timer:
            await cache.prefetch_many((rid, t, salt[rid]) for rid, t in toks.items())
            for rid in toks:
                await cache.prefetch_wait(rid)
    with timer:
        loads = await cache.load_back_many(toks)
    tally.loaded += sum(lb.loaded_tokens for lb in loads)
    bad = verified = 0
    for lb in loads:
        if lb.handle is not None:
            await lb.handle.wait_async(pool.geometry.layers - 1)
            first = len(lb.device_slots) - lb.loaded_tokens
            if verify:
                bad += count_bad_pages(
                    pool, lb.device_slots[first:], seeds[lb.rid], page_size=page, first=first
                )
                verified += lb.loaded_tokens // page
    with timer:
        news = await cache.allocate_many(
            (lb.rid, len(toks[lb.rid]) - len(lb.device_slots)) for lb in loads
        )
    items = []
    for lb, new in zip(loads, news):
        if verify:
            fill(pool, new, seeds[lb.rid], page_size=page, first=len(lb.device_slots))
        slots = np.concatenate([lb.device_slots, new])
        items.append((lb.rid, toks[lb.rid], slots, True, salt[lb.rid]))
    with timer:
        await cache.cache_many(items)
        if pin_first_block:
            await _pin_first_blocks(cache, step, toks, salt, block_tokens, pin_first_block, tally)
    tally.device_hit += sum(m.device_len for m in matches)
    if salts:
        for m, lb in zip(matches, loads):
            counts = tally.per_salt.setdefault(salt[m.rid] or "", [0, 0])
            counts[0] += len(toks[m.rid])
            counts[1] += m.device_len + lb.loaded_tokens
    tally.corrupt_pages += bad
    tally.verified_pages += verified
    tally.requests += len(step)
    tally.input_tokens += sum(len(t) for t in toks.values())


async def _pin_first_blocks(
    cache: HiCache,
    step: list[TraceRequest],
    toks: dict[RequestId, np.ndarray],
    salt: dict[RequestId, str | None],
    block_tokens: int,
    tiers: tuple[str, ...],
    tally: Tally,
) -> None:
    page = cache.config.page_size
    for req in step:
        rid = RequestId(f"r{req.index}")
        first = min(block_tokens, len(toks[rid])) // page * page
        block = (salt[rid], req.hash_ids[0]) if req.hash_ids else None
        if not first or block is None or block in tally.pinned:
            continue
        try:
            await cache.pin(toks[rid][:first], tiers=tiers, salt=salt[rid])
        except PinLimitError:
            tally.pins_refused += 1
        else:
            tally.pinned.add(block)


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
) -> tuple[Tally, dict[str, Any]]:
    """Replay `requests`; `progress(done)` after every step, and `on_step(tally)` too (the
    running counts: the live hit rate is (device_hit + loaded) / input_tokens). With
    `detach_at`, L3 is detached once that many requests are done; with `attach_at`, attached
    again (the same `cfg.storage`, with `cfg.extra`) once that many are. With `hybrid`,
    requests go one by one through `HybridCache` (hybrid_replay.py; its pool: the config's)."""
    check_storage_switch(cfg, detach_at, attach_at)
    if any(t not in ("device", "host") for t in pin_first_block):
        raise ValueError(
            f"pin_first_block: tiers must be device and/or host, got {pin_first_block}"
        )
    if hybrid is not None and pin_first_block:
        raise ValueError("--pin-first-block is not supported with --hybrid")
    tally = Tally()
    timer = _Timer(tally)
    async with HiCache(cfg, log=log) as cache:
        switches = _StorageSwitches(cfg, detach_at, attach_at)
        exporter = getattr(cache, "_metrics", None)
        if exporter is not None:
            print(
                f"hicache replay: Prometheus metrics on http://localhost:{exporter.port}/metrics",
                file=sys.stderr,
            )
        pins = pin_first_block
        hc = HybridCache(cache, hybrid) if hybrid is not None else None
        for step in scheduler_steps(requests, batch, budget=cfg.device_tokens // 2):
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
                    await _run_step(
                        cache, step, tally, timer, block_tokens, verify, storage_on, salts, pins
                    )
                except CapacityError:
                    # Too much at once for L1: drop the step's state and run it one by one.
                    await cache.release_many(RequestId(f"r{r.index}") for r in step)
                    for req in step:
                        try:
                            await _run_step(
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
        with timer:
            await cache.flush()
            stats = await cache.stats()
        extra: dict[str, Any] = {
            "bytes": {**stats.bytes},
            "evictions": {"device": stats.device.evictions, "host": stats.host.evictions},
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
                "attention_layers": len(model.attention_layers),
                "state_bytes": model.state_bytes,
                "grid": model.grid,
                "pages_per_snapshot": (
                    state_pages(cache.device_pool, model.state_bytes) if model.recurrent else 0
                ),
                **(counts.as_dict() if counts is not None else {}),
            }
    return tally, extra


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


def live_hit_rate(tally: Tally) -> float:
    """The hit rate so far: L1 hits of the completed steps plus every token loaded back."""
    return (tally.device_hit + tally.loaded) / tally.input_tokens if tally.input_tokens else 0.0


class _PlainProgress:
    """A one-line bar on stderr (when rich is not installed, or stdout is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._start = time.perf_counter()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()

    def __call__(self, tally: Tally) -> None:
        done, total, width = tally.requests, self.total, 30
        filled = width * done // max(total, 1)
        rate = done / max(time.perf_counter() - self._start, 1e-9)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"requests  {rate:6.1f} req/s  hit rate {live_hit_rate(tally):.4f}"
        )
        sys.stderr.flush()


class _RichProgress:
    """A live rich progress bar on stdout with the hit rate so far (stdout is a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "requests  hit rate [bold]{task.fields[hit]:.4f}[/]"
                "  ({task.fields[rate]:.1f} req/s)"
            ),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=sys.stdout),
            auto_refresh=False,
        )
        self._task = self._progress.add_task("replay", total=total, hit=0.0, rate=0.0)
        self._start = time.perf_counter()
        self._shown = 0.0

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.refresh()
        self._progress.stop()

    def __call__(self, tally: Tally) -> None:
        now = time.perf_counter()
        self._progress.update(
            self._task,
            completed=tally.requests,
            hit=live_hit_rate(tally),
            rate=tally.requests / max(now - self._start, 1e-9),
        )
        if now - self._shown >= 0.1:  # redraw at most ten times a second
            self._shown = now
            self._progress.refresh()


class _NoProgress:
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, tally: Tally) -> None:
        pass


def _progress_display(total: int, quiet: bool) -> _PlainProgress | _RichProgress | _NoProgress:
    """rich's live bar when stdout is a terminal and rich is installed; else a plain line on
    stderr when that is a terminal; else nothing."""
    if quiet:
        return _NoProgress()
    if sys.stdout.isatty():
        try:
            return _RichProgress(total)
        except ImportError:
            pass
    if sys.stderr.isatty():
        return _PlainProgress(total)
    return _NoProgress()


def _scratch_dir() -> str | None:
    """Where the default file store goes: RAM-backed /dev/shm when writable (a file store on
    local NVMe behaves like it; an overlay /tmp can cost milliseconds per file), else the
    system's temporary directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _storage_options(args: argparse.Namespace) -> dict[str, object]:
    """Backend options from the flags: the file store's cap."""
    cap = getattr(args, "storage_max_bytes", None)
    if cap is None:
        return {}
    from hicache.backends.mooncake_spec import parse_size

    return {"max_bytes": parse_size(cap, "--storage-max-bytes")}


def run(args: argparse.Namespace) -> int:
    _pin_tiers(getattr(args, "pin_first_block", None))  # a bad tier fails before any work
    spec = getattr(args, "hybrid", None)
    hybrid = parse_hybrid(spec, args.page_size) if spec is not None else None
    kv = hybrid_kv(args.kv, hybrid) if hybrid is not None else args.kv
    requests = read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
    with tempfile.TemporaryDirectory(prefix="hicache-replay-", dir=_scratch_dir()) as tmp:
        storage = args.storage
        if storage == "file":
            storage = f"file:{tmp}/store"
        cfg = CacheConfig(
            kv=kv,
            page_size=args.page_size,
            device_tokens=args.device_tokens,
            host_tokens=args.host_tokens,
            eviction=args.eviction,
            write_policy=args.write_policy,
            exclusive=args.exclusive,
            storage=None if storage == "none" else storage,
            extra=_storage_options(args),
            model_id=args.model_id,
            metrics_port=getattr(args, "metrics_port", None),
            prefetch_policy=args.prefetch_policy,
            deterministic=args.deterministic,
            seed=args.seed,
            layout=args.layout,
            io_backend=args.io,
            secret_env=getattr(args, "secret_env", None),
            secret_file=getattr(args, "secret_file", None),
            encrypt_at_rest=getattr(args, "encrypt_at_rest", False),
            **({"cpu_transfers": args.cpu_transfers} if args.cpu_transfers else {}),
        )
        with contextlib.ExitStack() as files:
            events_file = (
                files.enter_context(open(args.events, "w", encoding="utf-8"))
                if args.events
                else None
            )
            log = EventLog(sink=events_file) if events_file else None
            t0 = time.perf_counter()
            with _progress_display(len(requests), args.quiet) as show:

                async def main() -> tuple[Tally, dict[str, Any]]:
                    return await replay(
                        cfg,
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
                        pin_first_block=_pin_tiers(getattr(args, "pin_first_block", None)),
                        hybrid=hybrid,
                    )

                if args.deterministic:
                    tally, extra = run_deterministic(main, seed=args.seed)
                else:
                    tally, extra = anyio.run(main)
            wall = time.perf_counter() - t0
    summary = summarize(
        tally, extra, cfg, requests, block_tokens=args.block_tokens, storage=args.storage, wall=wall
    )
    tiers = _pin_tiers(getattr(args, "pin_first_block", None))
    if tiers:
        summary["config"]["pin_first_block"] = list(tiers)
        summary["pins"] = {"first_blocks": len(tally.pinned), "refused": tally.pins_refused}
    for flag in ("detach_at", "attach_at"):  # L3 switched at run time (only when asked)
        if getattr(args, flag, None) is not None:
            summary["config"][flag] = getattr(args, flag)
    if "hybrid" in extra:  # the pool's layers are the spec's attention layers (kv replaced)
        summary["hybrid"] = {"spec": spec, **extra["hybrid"]}
        summary["config"]["hybrid"] = spec
    _print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    corrupt_states = summary.get("hybrid", {}).get("corrupt_states", 0)
    return 1 if summary["corrupt_pages"] or corrupt_states else 0


def _pin_tiers(value: str | None) -> tuple[str, ...]:
    """`--pin-first-block device,host` as the tiers to pin in (empty: no pins)."""
    tiers = tuple(t.strip() for t in (value or "").split(",") if t.strip())
    bad = [t for t in tiers if t not in ("device", "host")]
    if bad or (value is not None and not tiers):
        raise ValueError(f"--pin-first-block: tiers must be device and/or host, got {value!r}")
    return tiers


def summarize(
    tally: Tally,
    extra: dict[str, Any],
    cfg: CacheConfig,
    requests: list[TraceRequest],
    *,
    block_tokens: int,
    storage: str,
    wall: float,
) -> dict[str, Any]:
    """The summary `--json` writes (and the table shows)."""
    hits = tally.device_hit + tally.host_hit
    summary: dict[str, Any] = {
        "requests": tally.requests,
        "input_tokens": tally.input_tokens,
        "hit_tokens": {
            "device": tally.device_hit,
            "host": tally.host_hit - tally.storage_hit,
            "storage": tally.storage_hit,
        },
        "hit_rate": hits / tally.input_tokens if tally.input_tokens else 0.0,
        "bound_hit_rate": bound_hit_rate(
            requests, block_tokens=block_tokens, page_size=cfg.page_size
        ),
        "bytes": {"d2h": 0, "h2d": 0, "h2s": 0, "s2h": 0, **extra.get("bytes", {})},
        "evictions": extra.get("evictions", {}),
        "rejected_requests": tally.rejected,
        "verified_pages": tally.verified_pages,
        "corrupt_pages": tally.corrupt_pages,
        "wall_s": round(wall, 3),
        "control_us_per_request": round(tally.control_s / max(tally.requests, 1) * 1e6, 1),
        "config": {
            "kv": cfg.kv,
            "page_size": cfg.page_size,
            "device_tokens": cfg.device_tokens,
            "host_tokens": cfg.host_capacity,
            "storage": redact_url(storage),
            "keyed_storage": any(
                x is not None for x in (cfg.secret, cfg.secret_env, cfg.secret_file)
            ),
            "encrypt_at_rest": cfg.encrypt_at_rest,
            "write_policy": cfg.write_policy,
            "eviction": cfg.eviction,
            "exclusive": cfg.exclusive,
            "prefetch_policy": cfg.prefetch_policy,
        },
    }
    if "backend" in extra:
        summary["storage_stats"] = extra["backend"]
    if tally.per_salt:  # requests spread over salts: each salt's own hit rate (live measure)
        summary["hit_rate_per_salt"] = {
            k: round(hit / max(total, 1), 4) for k, (total, hit) in sorted(tally.per_salt.items())
        }
    return summary


def _print_table(s: dict[str, Any]) -> None:
    tok = s["input_tokens"] or 1
    rows = [
        ("requests", f"{s['requests']}"),
        ("input tokens", f"{s['input_tokens']:,}"),
        ("hit rate", f"{s['hit_rate']:.4f}  (bound {s['bound_hit_rate']:.4f})"),
        ("  from L1 (device)", f"{s['hit_tokens']['device'] / tok:.4f}"),
        ("  from L2 (host)", f"{s['hit_tokens']['host'] / tok:.4f}"),
        ("  from L3 (storage)", f"{s['hit_tokens']['storage'] / tok:.4f}"),
        ("bytes d2h / h2d", f"{s['bytes']['d2h']:,} / {s['bytes']['h2d']:,}"),
        ("bytes h2s / s2h", f"{s['bytes']['h2s']:,} / {s['bytes']['s2h']:,}"),
        (
            "evictions device / host",
            (f"{s['evictions'].get('device', 0):,} / {s['evictions'].get('host', 0):,} tokens"),
        ),
        ("verified / corrupt pages", f"{s['verified_pages']:,} / {s['corrupt_pages']}"),
        ("wall", f"{s['wall_s']:.2f} s"),
        ("control plane", f"{s['control_us_per_request']:.0f} us/request"),
    ]
    hy = s.get("hybrid")
    if hy is not None:
        kept_of = f"{hy['snapshots_offered']:,}  ({hy['pages_per_snapshot']} pages each)"
        rows.insert(1, ("hybrid", f"{hy['spec']}  (pool: kv {s['config']['kv']})"))
        rows += [
            ("K/V cut by the groups' rule", f"{hy['cut_tokens'] / tok:.4f}"),
            ("snapshots kept / offered", f"{hy['snapshots_kept']:,} / {kept_of}"),
            (
                "snapshot hits / probes",
                f"{hy['snapshot_hits']:,} / {hy['snapshot_probes']:,}",
            ),
            ("verified / corrupt states", f"{hy['verified_states']:,} / {hy['corrupt_states']}"),
        ]
    store = s.get("storage_stats", {})
    if "peak_stored_bytes" in store:  # a file store: how full it got against its cap
        sizes = (store["stored_bytes"], store["peak_stored_bytes"], store["max_bytes"])
        rows.append(("L3 bytes stored / peak / cap", " / ".join(f"{n:,}" for n in sizes)))
    per_salt = s.get("hit_rate_per_salt")
    if per_salt:
        rates = sorted(per_salt.values())
        rows.append(
            (f"hit rate per salt ({len(rates)})", f"{rates[0]:.4f} min / {rates[-1]:.4f} max")
        )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
