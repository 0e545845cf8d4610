"""Checks that an outcome the cache returned is well-formed: slots, match and prefetch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.testing.simulation.errors import short_slots

if TYPE_CHECKING:
    from hicache.results import MatchOutcome, PrefetchOutcome
    from hicache.testing.simulation.context import SimContext


def check_slots(
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
        ctx.violate(f"{what}: slot outside the device pool [0, {size}): {short_slots(arr)}")
    if len(np.unique(arr)) != len(arr):
        ctx.violate(f"{what}: duplicate slots {short_slots(arr)}")
    return arr.astype(np.int64, copy=False)


def check_match(ctx: SimContext, rid: Any, tokens: np.ndarray, out: MatchOutcome) -> None:
    page = ctx.sim.page_size
    if out.rid != rid:
        ctx.violate(f"match({rid}) answered for {out.rid!r}")
    slots = check_slots(ctx, f"match({rid})", out.device_slots, whole_pages=True)
    aligned = len(tokens) // page * page
    if out.host_len < 0 or out.host_len % page or len(slots) + out.host_len > aligned:
        ctx.violate(
            f"match({rid}): device {len(slots)} + host {out.host_len} tokens for "
            f"{len(tokens)} tokens of page {page}"
        )


def check_prefetch(
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
