"""Hybrid hits as long as the rule allows, with the default `load_back_threshold` (10 tokens):
a snapshot chain that sits only in L2 below a prefix in L1 is loaded when it is what makes
the hit, the threshold weighs the tokens a load saves (not the tokens it moves), and when L1
cannot take an L2 part the hit falls back to the deepest point whose every group landed.
Each case keeps a negative control where the shorter hit is the right one.

The geometry is a Bamba-like one: layer 0 full attention, layer 1 recurrent (a 100-byte
snapshot every 8 tokens), pages of 4 tokens, K/V and states checked on every hit."""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np
import pytest

from hicache import HiCache
from hicache.hybrid import FullAttention, HybridCache, HybridModel, Recurrent, state_config
from hicache.testing import bad_pages, run_virtual, virtual_config
from hicache.testing.kvfill import fill
from tests.integration.storage_helpers import PAGE, seeds_for
from tests.integration.test_hybrid_cache import state_of

MODEL = HybridModel((FullAttention((0,)), Recurrent((1,), state_bytes=100, grid=8)), page_size=4)
STORED = np.arange(1, 49, dtype=np.int64)  # tokens 1..48, snapshots at 8, 16, ..., 48
NEW = np.arange(1000, 1100, dtype=np.int64)


def cfg(**overrides):
    """The issue's cache: one pool layer, 256 tokens in L1, 1,024 in L2, the default
    write policy and thresholds."""
    base = dict(
        kv="mha:1:1:8:float32", page_size=4, device_tokens=256, host_tokens=1024, device="cpu"
    )
    base.update(overrides)
    return virtual_config(**base)


async def opened(stack: AsyncExitStack, config, *, own: bool, model=MODEL) -> HybridCache:
    cache = await stack.enter_async_context(HiCache(config))
    states = None
    if own:
        states = await stack.enter_async_context(HiCache(state_config(config, model)))
    return HybridCache(cache, model, states=states)


async def store(hc: HybridCache, tokens: np.ndarray, points) -> None:
    """Cache `tokens` whole, K/V computed, a snapshot at each of `points`."""
    hit = await hc.match("store", tokens)
    assert hit.length == 0
    slots = await hc.allocate("store", len(tokens))
    fill(hc.cache.device_pool, slots, seeds_for(tokens), page_size=PAGE, first=0)
    states = {p: state_of(tokens[:p]) for p in points}
    _, kept = await hc.cache_finished("store", tokens, slots, snapshots=states)
    assert kept == tuple(sorted(states))


async def to_l2(hc: HybridCache) -> None:
    """Everything demoted: L1 cleared, its write-through copies kept in L2."""
    for c in (hc.cache, hc.states):
        if c is not None:
            await c.flush()
            await c.clear(["device"])


async def hit_of(hc: HybridCache, rid: str, tokens: np.ndarray):
    """Match, check the hit's K/V page by page and its state, release."""
    hit = await hc.match(rid, tokens)
    pool = hc.cache.device_pool
    assert bad_pages(pool, hit.device_slots, seeds_for(tokens), page_size=PAGE, first=0) == 0
    if hit.length:
        assert hit.state == state_of(tokens[: hit.length])
    await hc.release(rid)
    return hit


def pool_case(threshold: int | None, points=range(8, 49, 8)):
    """Snapshots in the pools: the first match loads [0, 48) and the chain at 48 into L1; the
    second matches 44 tokens of it, whose deepest snapshot (40) is a chain in L2 alone."""

    async def main():
        over = {} if threshold is None else {"load_back_threshold": threshold}
        async with AsyncExitStack() as stack:
            hc = await opened(stack, cfg(**over), own=False)
            await store(hc, STORED, points)
            await to_l2(hc)
            first = await hit_of(hc, "a", np.concatenate([STORED, NEW[:4]]))
            second = await hit_of(hc, "b", np.concatenate([STORED[:44], NEW[10:18]]))
            return first, second

    return run_virtual(main)


def test_a_snapshot_chain_in_l2_below_a_prefix_in_l1_makes_the_hit():
    first, second = pool_case(None)
    assert (first.length, first.device_hit, first.state_tier) == (48, 0, "host")
    # [0, 44) in L1, the chain at 40 in L2 alone: 0 when it was skipped as too short a load
    assert (second.kv_len, second.length, second.device_hit) == (44, 40, 40)
    assert second.state_tier == "host"


def test_the_threshold_does_not_change_that_hit():
    _, second = pool_case(1)
    assert second.length == 40


def test_without_a_snapshot_within_the_kv_the_hit_stays_zero():
    """Negative control: only the end (48) was kept, past the 44 tokens matched."""
    first, second = pool_case(None, points=(48,))
    assert first.length == 48
    assert (second.kv_len, second.length, second.state) == (44, 0, None)


def states_case(threshold: int | None):
    """A states cache: [0, 40) is loaded into L1 by a first match, then all 48 tokens are
    matched: K/V [40, 48) is in L2 alone (8 tokens), the states at 40 and 48 both kept."""

    async def main():
        over = {} if threshold is None else {"load_back_threshold": threshold}
        async with AsyncExitStack() as stack:
            hc = await opened(stack, cfg(**over), own=True)
            await store(hc, STORED, range(8, 49, 8))
            await to_l2(hc)
            first = await hit_of(hc, "a", np.concatenate([STORED[:40], NEW[:5]]))
            second = await hit_of(hc, "b", np.concatenate([STORED, NEW[10:14]]))
            return first, second

    return run_virtual(main)


def test_with_a_states_cache_the_hit_falls_back_to_what_l1_holds():
    """Loading K/V [40, 48) would save 8 tokens, under the threshold of 10: the hit is the
    deepest point L1 holds whole (40), not 0."""
    first, second = states_case(None)
    assert (first.length, first.device_hit) == (40, 0)
    assert (second.kv_len, second.length, second.device_hit) == (48, 40, 40)
    assert second.snapshot_hint == 48


def test_with_a_states_cache_a_load_worth_it_reaches_the_end():
    _, second = states_case(1)
    assert (second.length, second.device_hit) == (48, 40)


@pytest.mark.parametrize("own", [False, True], ids=["in-pool", "own-cache"])
def test_when_l1_cannot_take_the_l2_part_the_hit_is_the_deepest_point_that_landed(own):
    """L1 full (a request holds the rest of it): K/V [40, 48) cannot be loaded back, so the
    hit is the snapshot at 40, under [0, 40) in L1, not 0."""
    small = cfg(device_tokens=64, load_back_threshold=1)

    async def main():
        async with AsyncExitStack() as stack:
            hc = await opened(stack, small, own=own)
            await store(hc, STORED, range(8, 49, 8))
            await to_l2(hc)
            first = await hit_of(hc, "a", np.concatenate([STORED[:40], NEW[:5]]))
            free = (await hc.cache.stats()).device
            await hc.cache.match("hog", NEW[:0])
            hog = await hc.allocate("hog", free.size - free.used)  # L1 is now full
            second = await hit_of(hc, "b", np.concatenate([STORED, NEW[10:14]]))
            await hc.release("hog")
            third = await hit_of(hc, "c", np.concatenate([STORED, NEW[20:24]]))
            return first, len(hog), second, third

    first, hogged, second, third = run_virtual(main)
    assert first.length == 40 and hogged > 0
    assert (second.kv_len, second.length, second.device_hit) == (48, 40, 40)
    assert third.length == 48  # with room again, the whole of it


def test_a_load_back_may_take_its_own_threshold():
    """What the snapshots' reads use: `load_back(threshold=)` in place of the config's."""
    from hicache import InvalidRequest

    short = NEW[:8]  # two pages: below the default threshold of 10

    async def main():
        async with HiCache(cfg(write_policy="write_through")) as cache:
            await cache.match("a", short)
            slots = await cache.allocate("a", 8)
            await cache.cache_finished("a", short, slots)
            await cache.flush()
            await cache.clear(["device"])
            await cache.match("x", short)
            skipped = await cache.load_back("x")
            await cache.match("y", short)
            taken = await cache.load_back("y", threshold=0)
            with pytest.raises(InvalidRequest, match="threshold must be an int"):
                await cache.load_back("y", threshold=-1)
            await cache.release_many(["x", "y"])
            return skipped, taken

    skipped, taken = run_virtual(main)
    assert (skipped.loaded_tokens, len(skipped.device_slots)) == (0, 0)
    assert (taken.loaded_tokens, len(taken.device_slots)) == (8, 8)


def test_a_match_cancelled_while_reading_a_snapshot_leaves_no_probe_behind(monkeypatch):
    """The snapshot lookups' probe requests are released even when the match is cancelled
    in the middle (a request aborted by its engine): none stays locked in the tree."""
    import anyio

    from hicache.hybrid.snapshots import Snapshots

    async def never(self, chain):
        await anyio.sleep_forever()

    async def main():
        async with AsyncExitStack() as stack:
            hc = await opened(stack, cfg(), own=False)
            await store(hc, STORED, range(8, 49, 8))
            monkeypatch.setattr(Snapshots, "read", never)
            with anyio.move_on_after(5) as scope:
                await hc.match("c", np.concatenate([STORED, NEW[:4]]))
            await hc.release("c")  # what the engine does with an aborted request
            return scope.cancelled_caught, (await hc.cache.stats()).inflight["requests"]

    assert run_virtual(main) == (True, 0)
