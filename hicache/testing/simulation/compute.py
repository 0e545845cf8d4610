"""A built-in client's request after its prefix is read: allocate and compute chunk by chunk,
`cache_unfinished`, `cache_finished`, then its pins and its fate."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.results import CapacityError, PinLimitError, UnknownRequest
from hicache.testing.simulation.checks import check_slots
from hicache.testing.simulation.errors import short_slots

if TYPE_CHECKING:
    from hicache.testing.simulation.context import SimContext
    from hicache.testing.simulation.workload import RequestSpec


async def compute_request(ctx: SimContext, spec: RequestSpec, prefix: np.ndarray) -> None:
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
            new = check_slots(ctx, f"allocate({rid}, {k})", new, n=k)
            if np.intersect1d(new, slots).size:
                ctx.violate(
                    f"allocate({rid}, {k}) returned slots the request already holds",
                    detail=f"new={short_slots(new)} held={short_slots(slots)}",
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
            tree = check_slots(ctx, f"cache_unfinished({rid})", out.device_slots, n=aligned)
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
    check_slots(ctx, f"cache_finished({rid})", out.device_slots, n=aligned)
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
