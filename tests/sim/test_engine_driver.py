"""An engine's own scheduler through the simulation: the same configs, workloads, faults and
close checks as the built-in clients, with the engine deciding what to call when.

`batched_engine` is the shape docs/testing.md describes: a scheduler that runs the workload in
steps of a few requests with the batched calls (`*_many`), where the model's forward pass is
`ctx.compute` and every read of a prefix goes through `ctx.read_prefix`.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from hicache.results import CapacityError
from hicache.testing.simulation import SimContext, SimHooks, SimViolation, run_simulation


async def batched_engine(ctx: SimContext, batch_size: int = 3, shift: int = 0) -> None:
    cache = ctx.cache
    queue = deque(ctx.workload.requests)
    while queue:
        batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        await ctx.call(
            "match_many", cache.match_many, [(r.rid, r.tokens[: r.match_len]) for r in batch]
        )
        if cache.backend is not None:
            await ctx.call(
                "prefetch_many",
                cache.prefetch_many,
                [(r.rid, r.tokens[: r.prompt_len]) for r in batch],
            )
            for r in batch:
                await ctx.call("prefetch_wait", cache.prefetch_wait, r.rid)
        loads = await ctx.call("load_back_many", cache.load_back_many, [r.rid for r in batch])
        running, prefixes, dropped = [], [], []
        for r, lb in zip(batch, loads):
            prefix = np.asarray(lb.device_slots, dtype=np.int64)
            if await ctx.read_prefix(r.rid, r.tokens, prefix, (lb.handle,)):
                running.append(r)
                prefixes.append(prefix)
            else:
                dropped.append(r.rid)
        if dropped:
            await ctx.call("release_many", cache.release_many, dropped)
        if not running:
            continue
        for r in running:
            ctx.drop(r.rid)  # allocate_many may fail: nothing is computed before it returns
        wants = [(r.rid, len(r.tokens) - len(p)) for r, p in zip(running, prefixes)]
        try:
            news = await ctx.call(
                "allocate_many", cache.allocate_many, wants, allowed=(CapacityError,)
            )
        except CapacityError:  # the step does not fit: admit one by one, release the rest
            ctx.counts["capacity_errors"] += 1
            news = []
            for rid, n in wants:
                try:
                    news.append(
                        await ctx.call("allocate", cache.allocate, rid, n, allowed=(CapacityError,))
                    )
                except CapacityError:
                    news.append(None)
                    await ctx.call("release", cache.release, rid)
        items = []
        for r, prefix, new in zip(running, prefixes, news):
            if new is None:
                continue
            slots = np.concatenate([prefix, new])
            at = max(0, len(prefix) - shift)  # shift: a planted indexing bug (see below)
            ctx.compute(r.tokens, slots[at : at + len(new)], len(prefix))  # the forward pass
            ctx.check_reads(r.rid, r.tokens, slots, "before cache_many")
            items.append((r.rid, r.tokens, slots, True))
            ctx.counts["requests"] += 1
        await ctx.call("cache_many", cache.cache_many, items)


@pytest.mark.parametrize("seed", range(12))
def test_a_batched_engine_passes_the_simulation(seed):
    try:
        report = run_simulation(seed, hooks=SimHooks(driver=batched_engine))
    except SimViolation as violation:
        pytest.fail(str(violation), pytrace=False)
    assert report.requests and report.pages_verified


@pytest.mark.parametrize("seed", range(2))
def test_a_batched_engine_passes_with_thread_transfers(seed):
    try:
        run_simulation(seed, mode="thread", hooks=SimHooks(driver=batched_engine))
    except SimViolation as violation:
        pytest.fail(str(violation), pytrace=False)


def test_an_engine_with_an_off_by_one_in_its_slots_is_caught():
    """Planted engine bug: the forward pass writes each new token's K/V one slot early, over
    the last slot of the prefix the tree owns (and leaves its last own slot unwritten)."""

    async def off_by_one(ctx: SimContext) -> None:
        await batched_engine(ctx, batch_size=2, shift=1)

    caught = 0
    for seed in range(10):
        try:
            run_simulation(seed, hooks=SimHooks(driver=off_by_one))
        except SimViolation as violation:
            assert "wrong KV" in violation.what
            caught += 1
    assert caught
