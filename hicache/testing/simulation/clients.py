"""The built-in clients (`builtin_clients`, the default driver): each runs its requests in
order, from match through prefetch and `load_back` to their fates."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.results import CapacityError
from hicache.testing.simulation.checks import check_match, check_prefetch, check_slots
from hicache.testing.simulation.compute import compute_request
from hicache.testing.simulation.errors import SimViolation, StopRun, short_slots

if TYPE_CHECKING:
    from hicache.kernels.streams.base import LoadHandle
    from hicache.testing.simulation.context import SimContext
    from hicache.testing.simulation.workload import RequestSpec


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
        check_match(ctx, rid, short, m0)
    match = functools.partial(cache.match, retention=spec.retention)
    if spec.retention:
        ctx.counts["retained"] += 1
    m = await ctx.call(f"match({rid})", match, rid, matched)
    check_match(ctx, rid, matched, m)
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
        check_prefetch(ctx, rid, p, "prefetch")
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
            check_prefetch(ctx, rid, p, "prefetch_wait", ready=True)
        elif spec.prefetch == "poll":
            p = await ctx.call(f"prefetch_poll({rid})", cache.prefetch_poll, rid)
            check_prefetch(ctx, rid, p, "prefetch_poll")
    lb = await ctx.call(f"load_back({rid})", cache.load_back, rid)
    prefix = check_slots(ctx, f"load_back({rid})", lb.device_slots, whole_pages=True)
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
                detail=f"match={short_slots(m.device_slots)} load_back={short_slots(prefix)}",
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
    await compute_request(ctx, spec, prefix)
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
        new = check_slots(ctx, f"allocate({rid}, {n})", new, n=n)
        ctx.compute(tokens, new, 0)
        ctx.hold(rid, tokens, new)
        await ctx.wait_handle(handle, f"the load released by {released}")
        ctx.check_reads(rid, tokens, new, f"after the load {released} released landed")
        ctx.drop(rid)
        ctx.counts["squeezed_tokens"] += n
    await ctx.call(f"release({rid})", cache.release, rid)


async def builtin_clients(ctx: SimContext) -> None:
    """The default driver: one actor system task per client, each running its requests in order."""
    cache = ctx.cache
    done = cache.system.reply()
    left = [len(ctx.workload.clients)]

    async def client(requests: tuple[RequestSpec, ...]) -> None:
        try:
            hurry = False
            for spec in requests:
                if ctx.stopped():
                    break
                hurry = bool(await _run_request(ctx, spec, hurry))
        except StopRun:
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
        cache.system.start_soon(client, requests, name=f"sim-client{i}")
    await done.wait()
