"""HybridCache (hicache/hybrid/cache.py) through a whole cache, on virtual time: a hit is
never longer than every layer group can resume from, and the recurrent snapshot it hands
back is exactly the one taken after its last token, from L1, from L2 and from L3 (a second
instance over the same store). K/V of every hit is checked page by page. Each test runs with
the snapshots in the K/V pools and in a states cache of their own (`own`)."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import pytest

from hicache import HiCache, InvalidRequest
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.hybrid import (
    FullAttention,
    HybridCache,
    HybridModel,
    Recurrent,
    SlidingWindow,
    state_config,
)
from hicache.hybrid.states import TOKEN_LIMIT
from hicache.testing import bad_pages, run_virtual
from hicache.testing.kvfill import fill
from tests.integration.storage_helpers import PAGE, config, namespace_of, seeds_for, tokens_from

STATE = 100  # bytes per snapshot: one page of the pool below, with the header


def bamba_like(state_bytes: int = STATE) -> HybridModel:
    return HybridModel(
        (Recurrent((0, 1, 3), state_bytes=state_bytes, grid=8), FullAttention((2,))), PAGE
    )


def state_of(prefix: np.ndarray, size: int = STATE) -> bytes:
    """The stand-in model's recurrent state after `prefix`: depends on every token of it."""
    digest = hashlib.sha256(np.asarray(prefix, dtype=np.int64).tobytes()).digest()
    return (digest * (size // len(digest) + 1))[:size]


def recurrent_config(**overrides):
    base = dict(kv="mha:1:1:8:float32", device_tokens=64, host_tokens=256)
    base.update(overrides)
    return config(**base)


@pytest.fixture(params=[False, True], ids=["in-pool", "own-cache"])
def own(request):
    """Whether the snapshots live in a states cache of their own (`state_config`)."""
    return request.param


@asynccontextmanager
async def opened(cfg, model, *, own: bool, store: MemoryStore | None = None):
    """(K/V cache, HybridCache) over `cfg`, with a states cache when `own`; each over an L3
    in `store` when given."""
    async with AsyncExitStack() as stack:

        async def start(c):
            backend = (
                None if store is None else MemoryBackend(namespace=namespace_of(c), store=store)
            )
            return await stack.enter_async_context(HiCache(c, backend=backend))

        cache = await start(cfg)
        states = await start(state_config(cfg, model, device_snapshots=4)) if own else None
        yield cache, HybridCache(cache, model, states=states)


async def serve(
    hc: HybridCache, rid: str, tokens: np.ndarray, *, snapshots: bool = True, extra: bool = False
):
    """One request as an engine runs it: match, compute the rest, cache with its snapshots
    (with `extra`, also at the hit's `snapshot_hint`). Returns the hit after checking its K/V
    and its state."""
    cache = hc.cache
    hit = await hc.match(rid, tokens)
    assert (
        bad_pages(cache.device_pool, hit.device_slots, seeds_for(tokens), page_size=PAGE, first=0)
        == 0
    )
    if hit.state is not None:
        assert hit.state == state_of(tokens[: hit.length])
    fresh = await hc.allocate(rid, len(tokens) - hit.length)
    slots = np.concatenate([hit.device_slots, fresh])
    fill(cache.device_pool, fresh, seeds_for(tokens), page_size=PAGE, first=hit.length)
    points = hc.model.snapshot_points(len(tokens)) if snapshots else []
    if extra and hit.snapshot_hint is not None:
        points = sorted({*points, hit.snapshot_hint})
    states = {p: state_of(tokens[:p]) for p in points if p > hit.length}
    _, kept = await hc.cache_finished(rid, tokens, slots, snapshots=states)
    assert kept == tuple(sorted(states))
    return hit


PROMPT = tokens_from(0, 30)


def test_a_hit_ends_at_the_deepest_snapshot_and_carries_its_state(own):
    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (_cache, hc):
            first = await serve(hc, "a", PROMPT)
            longer = await serve(hc, "b", np.concatenate([PROMPT, tokens_from(500, 6)]))
            branch = await serve(hc, "c", np.concatenate([PROMPT[:18], tokens_from(900, 10)]))
            return first, longer, branch

    first, longer, branch = run_virtual(main)
    assert first.length == 0
    assert (longer.kv_len, longer.length) == (28, 28)  # a's end snapshot
    assert longer.probes == 4  # 28, 24, 16, 8 looked up at once
    assert longer.device_hit == 28 and longer.state_tier == "device"
    assert (branch.kv_len, branch.length) == (16, 16)  # a grid point below the branch


def test_without_a_snapshot_the_hit_is_zero_whatever_kv_is_cached(own):
    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (_cache, hc):
            await serve(hc, "a", PROMPT, snapshots=False)
            return await serve(hc, "b", PROMPT)

    hit = run_virtual(main)
    assert hit.kv_len == 28 and hit.length == 0 and hit.state is None
    assert hit.probes == 4  # 28, 24, 16, 8: none there
    assert hit.snapshot_hint == 28  # a snapshot there would have made the K/V usable


def test_a_snapshot_kept_at_the_hinted_branch_point_makes_the_next_hit(own):
    base, one, two = PROMPT[:22], tokens_from(4000, 8), tokens_from(5000, 8)

    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (_cache, hc):
            await serve(hc, "a", np.concatenate([base, one]))  # snapshots at 8, 16, 24, 28
            # b branches off at 22: K/V to 20, snapshot at 16; the hint says 20
            b = await serve(hc, "b", np.concatenate([base, two]), extra=True)
            c = await serve(hc, "c", np.concatenate([base, tokens_from(6000, 8)]))
            return b, c

    b, c = run_virtual(main)
    assert (b.length, b.snapshot_hint) == (16, 20)
    assert (c.length, c.snapshot_hint) == (20, None)  # resumed at the branch, thanks to b


def test_a_snapshot_of_another_geometry_reads_as_absent(own):
    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (cache, hc):
            await serve(hc, "a", PROMPT)
            other = HybridCache(cache, bamba_like(state_bytes=STATE - 10), states=hc.states)
            hit = await other.match("b", PROMPT)
            await other.release("b")
            return hit

    hit = run_virtual(main)
    assert hit.kv_len == 28 and hit.length == 0


def test_snapshots_and_kv_come_back_from_l2(own):
    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (cache, hc):
            await serve(hc, "a", PROMPT)
            for c in (cache, hc.states):  # every page demoted to L2 (write-through backed it)
                if c is not None:
                    await c.flush()
                    await c.clear(["device"])
            return await serve(hc, "b", PROMPT)

    hit = run_virtual(main)
    assert (hit.length, hit.device_hit) == (28, 0)  # all of it from L2; state and K/V checked
    assert hit.state_tier == "host"


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_a_snapshot_and_its_kv_reach_l2_together_whatever_the_write_policy(own, policy):
    """A snapshot is backed up as it is kept, and the K/V of the request that kept it with
    it: under the default policy (a backup at the second hit) neither alone would be in L2
    after L1 is cleared, and K/V without its state cannot be resumed from."""

    async def main():
        cfg = recurrent_config(write_policy=policy)
        async with opened(cfg, bamba_like(), own=own) as (cache, hc):
            await serve(hc, "a", PROMPT)
            await serve(hc, "s", tokens_from(8000, 13), snapshots=False)  # no snapshot: no backup
            for c in (cache, hc.states):
                if c is not None:
                    await c.flush()
                    await c.clear(["device"])
            lone = await hc.cache.match("t", tokens_from(8000, 13))
            await hc.cache.release("t")
            return await serve(hc, "b", PROMPT), lone

    hit, lone = run_virtual(main)
    assert (hit.length, hit.device_hit, hit.state_tier) == (28, 0, "host")
    if policy == "write_through_selective":  # its first insert: no backup, gone with L1
        assert lone.device_len + lone.host_len == 0


def test_a_second_instance_resumes_from_l3(own):
    store = MemoryStore()
    cfg = recurrent_config(prefetch_policy="wait_complete")

    async def main():
        async with opened(cfg, bamba_like(), own=own, store=store) as (a, hc):
            await serve(hc, "a", PROMPT)
            await a.flush()
            if hc.states is not None:
                await hc.states.flush()
        async with opened(cfg, bamba_like(), own=own, store=store) as (_b, hc):
            fetched = await hc.prefetch("b", PROMPT)
            hit = await serve(hc, "b", PROMPT)
            return fetched, hit

    fetched, hit = run_virtual(main)
    assert (fetched.kv_len, fetched.snapshot) == (28, 28)
    assert hit.length == 28


def test_sliding_and_full_attention_hit_every_whole_page_below_the_last_token():
    model = HybridModel((SlidingWindow((0, 1, 3), window=6), FullAttention((2,))), PAGE)

    async def main():
        async with HiCache(config(kv="mha:4:1:8:float32")) as cache:
            hc = HybridCache(cache, model)
            await serve(hc, "a", PROMPT)
            return await serve(hc, "b", PROMPT)

    hit = run_virtual(main)
    assert (hit.kv_len, hit.length, hit.state, hit.probes) == (28, 28, None, 0)


def test_bad_input_is_refused_and_changes_nothing(own):
    async def main():
        async with opened(recurrent_config(), bamba_like(), own=own) as (cache, hc):
            await serve(hc, "a", PROMPT)
            before = (await cache.stats()).device
            errors = []
            with pytest.raises(InvalidRequest, match="token ids must be in") as e1:
                await hc.match("x", np.array([1, 2, TOKEN_LIMIT]))
            errors.append(e1)
            tokens = tokens_from(3000, 8)
            await hc.match("y", tokens)
            slots = await hc.allocate("y", 8)
            with pytest.raises(InvalidRequest, match="multiple of the page size") as e2:
                await hc.cache_finished("y", tokens, slots, snapshots={6: state_of(tokens[:6])})
            with pytest.raises(InvalidRequest, match="has 3 bytes") as e3:
                await hc.cache_finished("y", tokens, slots, snapshots={8: b"abc"})
            await hc.release("y")
            with pytest.raises(InvalidRequest, match="pool has 1 layers"):
                HybridCache(cache, HybridModel((FullAttention((0, 1)),), PAGE))
            after = (await cache.stats()).device
            hit = await serve(hc, "b", PROMPT)
            return before, after, hit, [e1, e2, e3]

    before, after, hit, _ = run_virtual(main)
    assert before == after
    assert hit.length == 28  # what was cached is intact


def test_a_prefetch_may_take_its_own_threshold():
    store = MemoryStore()
    cfg = recurrent_config(prefetch_policy="wait_complete", prefetch_threshold=3 * PAGE)
    short = tokens_from(7000, 9)  # two whole pages: below the threshold

    async def main():
        async with HiCache(
            cfg, backend=MemoryBackend(namespace=namespace_of(cfg), store=store)
        ) as a:
            await serve(HybridCache(a, bamba_like()), "a", short, snapshots=False)
            await a.flush()
        async with HiCache(
            cfg, backend=MemoryBackend(namespace=namespace_of(cfg), store=store)
        ) as b:
            await b.match("x", short[:4])
            skipped = await b.prefetch("x", short)
            await b.match("y", short[:4])
            taken = await b.prefetch("y", short, threshold=0)
            done = await b.prefetch_wait("y")
            with pytest.raises(InvalidRequest, match="threshold must be an int"):
                await b.prefetch("z", short, threshold=-1)
            await b.release_many(["x", "y"])
            return skipped, taken, done

    skipped, taken, done = run_virtual(main)
    assert (skipped.state, skipped.reason) == ("skipped", "below_threshold")
    assert taken.state == "running" and done.state == "done"


def test_a_states_cache_leaves_the_kv_pools_to_kv():
    model = bamba_like()

    async def main():
        used = {}
        for own in (False, True):
            async with opened(recurrent_config(), model, own=own) as (cache, hc):
                await serve(hc, "a", PROMPT)
                stats = await cache.stats()
                used[own] = stats.device.used + stats.host.used
                if hc.states is not None:
                    states = await hc.states.stats()
                    used["states"] = (states.device.used, states.host.used)
        return used

    used = run_virtual(main)
    # a's K/V: its whole pages, 28 tokens; its snapshots at 8, 16, 24, 28 take a page each
    # in the K/V pools or in the states cache
    assert used[True] == 2 * 28  # K/V in L1 and its write-through copy in L2
    assert used[False] == used[True] + 2 * 4 * PAGE
    assert used["states"] == (4 * 8, 4 * 8)  # four snapshots, a digest page each, L1 and L2


def test_states_evicted_from_a_small_states_cache_only_shorten_hits():
    model = bamba_like()
    others = [tokens_from(10_000 + 100 * i, 30) for i in range(3)]

    async def main():
        async with AsyncExitStack() as stack:
            cfg = recurrent_config(device_tokens=256, host_tokens=512)
            cache = await stack.enter_async_context(HiCache(cfg))
            small = state_config(cfg, model, device_snapshots=2, host_snapshots=3)
            states = await stack.enter_async_context(HiCache(small))
            hc = HybridCache(cache, model, states=states)
            await serve(hc, "a", PROMPT)  # four snapshots: only three fit L2
            for i, other in enumerate(others):  # twelve more: a's are evicted everywhere
                await serve(hc, f"o{i}", other)
            last = await serve(hc, "c", others[-1])
            again = await serve(hc, "b", PROMPT)  # its K/V still cached; no state left
            return again, last, await states.stats()

    again, last, stats = run_virtual(main)
    assert (again.kv_len, again.length, again.state) == (28, 0, None)
    assert again.snapshot_hint == 28
    assert last.length == 28 and last.state_tier == "device"  # the newest states are kept
    assert stats.device.used <= 2 * 8 and stats.host.used <= 3 * 8


def test_state_config_sizes_in_snapshots_and_refuses_what_cannot_run():
    from hicache.config import ConfigError

    base = recurrent_config(device_tokens=64, host_tokens=4096)
    model = HybridModel(
        (Recurrent((0, 1, 3), state_bytes=1000, grid=16), FullAttention((2,))), PAGE
    )
    cfg = state_config(base, model)
    assert (cfg.page_size, cfg.device_tokens, cfg.host_tokens) == (8, 16 * 8, 256 * 8)
    assert cfg.model_id == "test-model#state:mha:1:1:8:float32"  # the K/V's spec: its dtype
    assert cfg.write_policy == "write_through"
    assert cfg.kv == "mha:1:1:16:float32"  # (1000 + 16 header bytes) / (8 slots x K,V x 4 bytes)
    # an MHA namespace: each TP rank keeps its own shard of a state under its own L3 keys
    ranks = [
        namespace_of(state_config(recurrent_config(tp_rank=r, tp_size=2), model)) for r in (0, 1)
    ]
    assert [ns.key_rank for ns in ranks] == [0, 1] and ranks[0].digest != ranks[1].digest
    with pytest.raises(ConfigError, match="keeps no snapshots"):
        state_config(base, HybridModel((FullAttention((0,)),), PAGE))
    with pytest.raises(ConfigError, match="host_snapshots=0"):
        state_config(base, model, host_snapshots=0)
    with pytest.raises(ConfigError, match="host_snapshots=4 must be larger"):
        state_config(base, model, device_snapshots=4, host_snapshots=4)

    async def main():
        async with HiCache(recurrent_config()) as cache:
            with pytest.raises(InvalidRequest, match="a cache of its own"):
                HybridCache(cache, bamba_like(), states=cache)
            other = state_config(recurrent_config(model_id="another"), bamba_like())
            async with HiCache(other) as states:
                with pytest.raises(InvalidRequest, match="is not the K/V cache's"):
                    HybridCache(cache, bamba_like(), states=states)
            wrong_page = recurrent_config(
                page_size=4, model_id="test-model#state:mha:1:1:8:float32"
            )
            async with HiCache(wrong_page) as s:
                with pytest.raises(InvalidRequest, match="page size is 4"):
                    HybridCache(cache, bamba_like(), states=s)
        return True

    assert run_virtual(main)


NO_POOL = {
    "recurrent": (Recurrent((0, 1), state_bytes=6144, grid=8),),  # Mamba2-like
    "windowed": (SlidingWindow((0, 1, 2), window=6, state_bytes=5 * 3 * 64, grid=8),),
    "windowed+recurrent": (  # Samba-like: no full attention
        Recurrent((0, 2), state_bytes=STATE, grid=8),
        SlidingWindow((1, 3), window=6, state_bytes=2 * 5 * 64, grid=8),
    ),
}


@pytest.mark.parametrize("groups", list(NO_POOL.values()), ids=list(NO_POOL))
def test_a_model_with_no_layer_kept_as_pages_hits_from_every_tier(groups):
    """A pool of 0 layers: the K/V cache's pages are tokens alone (no byte in L1 or L2, none
    moved), the snapshots in a states cache are all a hit resumes from, in L1, in L2 after
    clearing L1, and in L3 from a second instance; a snapshot poisoned in L3 is refused (the
    hit falls back to the deepest one intact)."""
    model = HybridModel(groups, PAGE)
    store = MemoryStore()
    cfg = recurrent_config(kv="mha:0:1:8:float32", prefetch_policy="wait_complete")
    longer = np.concatenate([PROMPT, tokens_from(700, 12)])  # 42 tokens: a snapshot at 40

    async def state_only(hc, rid, tokens, *, states=state_of):
        hit = await hc.match(rid, tokens)
        if hit.state is not None:
            assert hit.state == states(tokens[: hit.length], model.state_bytes)
        fresh = await hc.allocate(rid, len(tokens) - hit.length)
        points = [p for p in model.snapshot_points(len(tokens)) if p > hit.length]
        snaps = {p: states(tokens[:p], model.state_bytes) for p in points}
        slots = np.concatenate([hit.device_slots, fresh])
        _, kept = await hc.cache_finished(rid, tokens, slots, snapshots=snaps)
        assert kept == tuple(points)
        return hit

    async def main():
        async with opened(cfg, model, own=True, store=store) as (cache, hc):
            sizes = (cache.host_pool.nbytes, cache.device_pool.geometry.bytes_per_token)
            await state_only(hc, "a", PROMPT)
            for c in (cache, hc.states):
                await c.flush()
            before = set(store.scan(""))
            in_l1 = await state_only(hc, "b", longer)
            for c in (cache, hc.states):
                await c.flush()
                await c.clear(["device"])
            in_l2 = await state_only(hc, "c", longer)
            moved = (await cache.stats()).bytes
            for c in (cache, hc.states):
                await c.flush()
            with pytest.raises(InvalidRequest, match="keep its snapshots in a states cache"):
                HybridCache(cache, model)
        async with opened(cfg, model, own=True, store=store) as (_cache, hc):
            fetched = await hc.prefetch("d", longer)
            in_l3 = await state_only(hc, "d", longer)
        # b's snapshots (32 and 40): the new values that can hold a state
        new = [
            k for k in set(store.scan("")) - before if len(store.get(k) or b"") > model.state_bytes
        ]
        for key in new:
            value = bytearray(store.get(key) or b"")
            value[len(value) // 2] ^= 0xFF
            store.put(key, bytes(value))
        async with opened(cfg, model, own=True, store=store) as (_cache, hc):
            await hc.prefetch("e", longer)
            poisoned = await state_only(hc, "e", longer)
        return sizes, in_l1, in_l2, moved, fetched, in_l3, (len(new), poisoned)

    sizes, in_l1, in_l2, moved, fetched, in_l3, (n, poisoned) = run_virtual(main)
    assert n == 2 and (poisoned.length, poisoned.kv_len) == (24, 40)
    assert sizes == (0, 0) and moved == {"d2h": 0, "h2d": 0}
    assert (in_l1.length, in_l1.state_tier, in_l1.kv_len) == (28, "device", 28)
    assert (in_l2.length, in_l2.state_tier, in_l2.kv_len) == (40, "host", 40)
    assert (fetched.kv_len, fetched.snapshot) == (40, 40)
    assert (in_l3.length, in_l3.state_tier) == (40, "host")
    for hit in (in_l1, in_l2, in_l3):  # each state checked against its own prefix's above
        assert len(hit.device_slots) == hit.length  # the token pages, locked for the request
