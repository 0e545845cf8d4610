"""The end of a run: settle the cache before close (`quiesce`), and find what close left in
the actors' tables (`leftover_tables`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import anyio

from hicache.testing.simulation.errors import StopRun

if TYPE_CHECKING:
    from hicache.cache import HiCache
    from hicache.testing.simulation.context import SimContext


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
    lists counts as empty when its lists are), and the actor system's pending replies and helpers.
    """
    out = []
    system = cache.system
    for name, actor in system.actors.items():
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
    if system.pending_replies:
        out.append(f"actor system: {system.pending_replies} pending replies")
    if system._helpers:
        out.append(f"actor system: {len(system._helpers)} helper tasks")
    return out


def _describe(value: Any) -> str:
    items = list(value.items() if isinstance(value, dict) else value)
    text = repr(items[:3])
    return (
        (text[:150] + "...")
        if len(text) > 150
        else text + (f" ({len(items)})" if len(items) > 3 else "")
    )


async def quiesce(ctx: SimContext) -> None:
    """Let every load land, flush, settle; then nothing may be in flight but what the
    abandoned requests hold."""
    cache = ctx.cache
    for handle in ctx.handles:
        try:
            await ctx.wait_handle(handle, "a load at the end of the run")
        except StopRun:
            return
    try:
        # Prefetches of released or abandoned requests, uploads and their retries end by
        # themselves (every storage call has a deadline): give them a bounded while.
        patience = 30.0 if ctx.virtual else 10.0
        start = anyio.current_time()
        while True:
            await ctx.call("flush()", cache.flush)
            if ctx.virtual:
                await cache.system.run_until_idle()
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
                await cache.system.sleep(0.05)
            else:
                await anyio.sleep(0.01)
        if ctx.virtual:
            # Past every prefetch deadline: a timer left running for an op that ended would
            # fire now, and what it leaves behind shows in the tables at close.
            c = ctx.sim.cache
            await cache.system.sleep(
                c["prefetch_timeout_base"] + c["prefetch_timeout_per_ki_token"] + 1.0
            )
            await cache.system.run_until_idle()
            stats = await ctx.call("stats()", cache.stats)
            flying = {k: v for k, v in stats.inflight.items() if k != "requests" and v}
            if flying:
                ctx.violate(f"work in flight again after the cache had settled: {flying}")
        ctx.counts["l1_evicted_tokens"] += stats.device.evictions
        ctx.counts["l2_evicted_tokens"] += stats.host.evictions
        ctx.counts["l3_hit_tokens"] += stats.storage_hit_tokens
        tree = cache.system.actors.get("tree")
        counters = getattr(getattr(tree, "core", None), "counters", None)  # looked at if there
        if counters is not None:
            ctx.counts["evict_backups"] += counters.evict_backups
            ctx.counts["anchor_backups"] += counters.anchor_backups
        if stats.inflight["requests"] != len(ctx.abandoned_rids):
            ctx.violate(
                f"{stats.inflight['requests']} requests open after the run; only "
                f"{len(ctx.abandoned_rids)} were abandoned"
            )
        ctx.check_live("the run")
    except StopRun:
        return
    ctx.close_started = anyio.current_time()
