"""A seeded fuzz test of HybridCache (hicache/hybrid/) over a whole cache, on virtual time: no
request ever resumes from an inconsistent set of layer groups.

Each example draws a hybrid geometry (sliding + full attention; recurrent + full; two
recurrent groups with different grids + sliding + full; sliding layers kept as windows in the
snapshots + full + recurrent; layers declared by model layer, two with K/V and a state, one
with a state alone, one with no cache; and with no layer kept as pages, so a pool of 0 layers
whose pages are tokens alone: recurrent layers alone, windowed sliding + recurrent), snapshots of 1 or 2 pool pages, a small L1 and L2 (so eviction
happens), a write policy (exclusive L2 included) and, maybe, an L3 memory store that later
cache instances open again; then 10-30 steps over a few shared base prompts: requests served
whole (match, compute, cache with a random subset of their snapshot points) or dropped after
the match (at once or one step later, some with slots allocated), `clear` of L1 or L2,
`flush`, and with L3 a switch to a fresh instance that first runs `HybridCache.prefetch`.
Geometries with snapshots keep them in the K/V pools or, in about a third of the examples
(always without pool layers), in a states cache of their own (`state_config`) of 1-6
snapshots in L1 and 1-6 more in L2, cleared, flushed and reopened with the K/V cache. After every match (against an oracle of
every snapshot kept and every prefix whose K/V was cached):

1. the hit is 0 or whole pages, below the last token, within `kv_len`, a prefix whose K/V
   was cached; with recurrent groups it ends where a snapshot was kept and its `state` is that
   snapshot's bytes (None at 0, and always None without recurrent groups);
2. the hit's K/V in L1 is byte-exact (with no pool layers: L1 and L2 hold no byte);
3. nothing but `CapacityError` escapes, and every instance closes without a leak.

Bounded by example count (50 per geometry, about 15 s in all; not by time) and derandomized,
so every run draws the same examples. Run more per geometry (the timeout grows with the
count) with `HICACHE_HYBRID_FUZZ_EXAMPLES=1000 pytest tests/sim/test_hybrid_fuzz.py`; pytest
prints a line of what the examples covered. A finding of a longer run, minimised and fixed,
is kept below as a regression test.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiCache
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.hybrid import (
    FullAttention,
    HybridCache,
    HybridModel,
    NoCache,
    Recurrent,
    SlidingWindow,
    state_config,
)
from hicache.hybrid.states import state_pages
from hicache.results import CapacityError
from hicache.testing import bad_pages, run_virtual
from hicache.testing.kvfill import fill
from tests.integration.storage_helpers import PAGE, config, namespace_of, seeds_for

EXAMPLES = int(os.environ.get("HICACHE_HYBRID_FUZZ_EXAMPLES", "50"))  # per geometry
TOTALS: Counter[str] = Counter()  # what the examples covered, summed (printed at the end)
PAGE_BYTES = PAGE * 2 * 8 * 4  # per attention layer: K and V, one head of 8 float32
HEADER = 16  # hybrid/states.py's snapshot header


@dataclass(frozen=True)
class Plan:
    # "a": sliding + full; "b": recurrent + full; "c": 2 recurrent + sliding + full;
    # "d": windowed sliding (its window kept in the snapshots) + full + recurrent;
    # "e": layers with K/V and a state, a state alone, or no cache (declared by model layer);
    # no layer kept as pages (a pool of 0 layers, snapshots in a states cache): "f": recurrent
    # alone; "g": windowed sliding + recurrent
    geometry: str
    model: HybridModel
    layers: int  # attention layers (the pool's)
    pages: int  # pool pages one snapshot takes
    device_tokens: int
    host_tokens: int
    write_policy: str  # or "exclusive" (write_back with an exclusive L2)
    l3: str | None  # the prefetch policy, None without L3
    seed: int
    steps: tuple[tuple, ...]
    states: tuple[int, int] | None = None  # snapshots in L1 and L2 of a states cache


def state_of(prefix: np.ndarray, size: int) -> bytes:
    """The stand-in recurrent state after `prefix`: depends on every token of it."""
    digest = hashlib.sha256(np.asarray(prefix, dtype=np.int64).tobytes()).digest()
    return (digest * (size // len(digest) + 1))[:size]


@st.composite
def plans(draw, geometry: str) -> Plan:
    window, pages = draw(st.integers(1, 16)), draw(st.integers(1, 2))
    layers = {"b": 1, "d": 1, "f": 0, "g": 0}.get(geometry, 2)
    per_page = layers * PAGE_BYTES
    if layers:
        low = max(2, (pages - 1) * per_page - HEADER + 1)
        size = draw(st.integers(low, pages * per_page - HEADER))
    else:  # no pool bytes: a snapshot is one page of its states cache, whatever its size
        pages, size = 0, draw(st.integers(2, 400))
    grids = st.sampled_from([4, 8, 12, 16])
    if geometry == "f":  # pure recurrent (Mamba2, RWKV-like): pages of tokens alone
        groups: tuple = (Recurrent((0, 1, 2), state_bytes=size, grid=draw(grids)),)
    elif geometry == "g":  # Samba-like: windowed sliding beside recurrent, no full attention
        g1, g2 = draw(st.lists(grids, min_size=2, max_size=2, unique=True))
        first = draw(st.integers(1, size - 1))
        groups = (
            Recurrent((0, 2), state_bytes=first, grid=g1),
            SlidingWindow((1, 3), window, state_bytes=size - first, grid=g2),
        )
    elif geometry == "a":
        groups: tuple = (SlidingWindow((0,), window), FullAttention((1,)))
    elif geometry == "b":
        groups = (Recurrent((0, 1, 3), state_bytes=size, grid=draw(grids)), FullAttention((2,)))
    elif geometry == "e":  # by model layer: layers 0 and 2 hold K/V and a state (Falcon-H1,
        # Zamba2's hybrid layers), 1 a state alone, 3 nothing (Nemotron-H's MLP layers)
        groups = (
            FullAttention((0, 2)),
            Recurrent((0, 1, 2), state_bytes=size, grid=draw(grids)),
            NoCache((3,)),
        )
    elif geometry == "d":  # the sliding layers keep only their window, in each snapshot
        g1, g2 = draw(st.lists(grids, min_size=2, max_size=2, unique=True))
        first = draw(st.integers(1, size - 1))
        groups = (
            SlidingWindow((0, 2), window, state_bytes=first, grid=g1),
            FullAttention((1,)),
            Recurrent((3,), state_bytes=size - first, grid=g2),
        )
    else:
        g1, g2 = draw(st.lists(grids, min_size=2, max_size=2, unique=True))
        first = draw(st.integers(1, size - 1))
        groups = (
            Recurrent((0, 3), state_bytes=first, grid=g1),
            SlidingWindow((1,), window),
            Recurrent((2,), state_bytes=size - first, grid=g2),
            FullAttention((4,)),
        )
    device = draw(st.integers(10, 20)) * PAGE
    host = device + draw(st.integers(6, 20)) * PAGE  # small enough to evict too
    policies = ["write_through", "write_back", "write_through_selective", "exclusive"]
    policy = draw(st.sampled_from(policies))
    l3 = draw(st.sampled_from([None, "wait_complete", "best_effort", "timeout"]))
    vocab = st.integers(0, 15)
    bases = draw(st.lists(st.lists(vocab, min_size=32, max_size=32), min_size=1, max_size=3))
    kinds = ["serve"] * 6 + ["drop"] * 2 + ["clear device", "clear host", "flush", "switch"]
    steps = []
    for _ in range(draw(st.integers(10, 30))):
        kind = draw(st.sampled_from(kinds))
        if kind in ("serve", "drop"):
            base = draw(st.sampled_from(bases))
            suffix = draw(st.lists(vocab, max_size=12))
            tokens = tuple(base[: draw(st.integers(0, 32))]) + tuple(suffix) or (0,)
            if kind == "serve":  # which snapshot points to keep: all, none, or a mask of them
                snaps = draw(st.one_of(st.just("all"), st.just("none"), st.integers(0, 255)))
                chunk = draw(st.one_of(st.none(), st.integers(1, 6)))  # pages of a first chunk
                steps.append(("serve", tokens, snaps, chunk))
            else:  # slots allocated first; released now or after the next step
                steps.append(("drop", tokens, draw(st.integers(0, 8)), draw(st.booleans())))
        elif kind == "switch":
            steps.append(("switch", draw(st.booleans())) if l3 else ("flush",))
        else:
            steps.append((kind,))
    seed = draw(st.integers(0, 3))  # run_virtual's interleaving
    model = HybridModel(groups, PAGE)
    states = None
    if not layers or (geometry != "a" and draw(st.booleans())):  # no pool bytes: states cache
        in_l1 = draw(st.integers(1, 6))
        states = (in_l1, in_l1 + draw(st.integers(1, 6)))
    return Plan(
        geometry, model, layers, pages, device, host, policy, l3, seed, tuple(steps), states
    )


@dataclass
class Oracle:
    plan: Plan
    stored: dict[tuple[int, ...], bytes] = field(default_factory=dict)  # every snapshot kept
    cached: set[tuple[int, ...]] = field(default_factory=set)  # every whole-page prefix cached
    held: list[str] = field(default_factory=list)  # dropped requests released after a step

    def check(self, hc: HybridCache, tokens: np.ndarray, hit) -> None:
        n, length, model = len(tokens), hit.length, self.plan.model
        key = prefix(tokens, length)
        assert len(hit.device_slots) == length and hit.probes <= hc.max_probes
        if length:
            assert length % PAGE == 0 and length <= n - 1 and length <= hit.kv_len, hit
            assert key in self.cached, f"hit {length}: its K/V was never cached"
        if model.stateful and length:
            assert key in self.stored, f"hit {length} (kv {hit.kv_len}): no snapshot kept there"
            assert hit.state == self.stored[key], f"hit {length}: the state of another prefix"
            TOTALS["hits with a state"] += 1
        else:
            assert hit.state is None, hit
        pool, seeds = hc.cache.device_pool, seeds_for(tokens)
        assert bad_pages(pool, hit.device_slots, seeds, page_size=PAGE, first=0) == 0, hit
        TOTALS["matches"] += 1
        TOTALS["hit tokens"] += length
        TOTALS["hits cut below the K/V"] += length < model.cap(n, hit.kv_len)


def prefix(tokens, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens[:n])


async def request(hc: HybridCache, oracle: Oracle, rid: str, step: tuple) -> None:
    """A request served whole (maybe in two chunks: `cache_unfinished`, then the rest) or
    dropped after its match."""
    kind, tokens, model = step[0], np.array(step[1], dtype=np.int64), oracle.plan.model
    n, seeds = len(tokens), seeds_for(tokens)
    try:
        hit = await hc.match(rid, tokens)
        oracle.check(hc, tokens, hit)
        if kind == "drop":
            if step[2]:
                await hc.allocate(rid, step[2])
            if step[3]:
                oracle.held.append(rid)
            else:
                await hc.release(rid)
            return
        snaps, chunk = step[2], step[3]
        points = [
            p
            for k, p in enumerate(model.snapshot_points(n))
            if p > hit.length and (snaps == "all" or (snaps != "none" and snaps >> k & 1))
        ]
        states = {p: state_of(tokens[:p], model.state_bytes) for p in points}
        ends = [hit.length + chunk * PAGE] if chunk and hit.length + chunk * PAGE < n else []
        done, slots, kept = hit.length, hit.device_slots, ()
        for end in [*ends, n]:
            fresh = await hc.allocate(rid, end - done)
            fill(hc.cache.device_pool, fresh, seeds, page_size=PAGE, first=done)
            part = {p: s for p, s in states.items() if done < p <= end}
            cache = hc.cache_finished if end == n else hc.cache_unfinished
            both = np.concatenate([slots, fresh])
            out, got = await cache(rid, tokens[:end], both, snapshots=part)
            assert set(got) <= set(part), (got, part)
            oracle.stored.update((prefix(tokens, p), part[p]) for p in got)
            kept += got
            oracle.cached.update(prefix(tokens, k) for k in range(PAGE, end + 1, PAGE))
            done, slots = end, out.device_slots
            for handle in out.pending:
                await handle.wait_async(hc.cache.device_pool.geometry.layers - 1)
            TOTALS["chunks cached unfinished"] += end < n
    except CapacityError:
        TOTALS["capacity errors"] += 1
        await hc.release(rid)
        return
    TOTALS["requests served"] += 1
    TOTALS["snapshots asked"] += len(points)
    TOTALS["snapshots kept"] += len(kept)


async def prefetch(hc: HybridCache, oracle: Oracle, rid: str, tokens: tuple) -> None:
    """A fresh instance's first call: fetch the next request's K/V and snapshot from L3."""
    try:
        got = await hc.prefetch(rid, np.array(tokens, dtype=np.int64))
    except CapacityError:
        TOTALS["capacity errors"] += 1
        await hc.release(rid)
        return
    if got.snapshot is not None:
        assert got.snapshot % PAGE == 0 and 0 < got.snapshot <= got.kv_len, got
        assert tuple(tokens[: got.snapshot]) in oracle.stored, f"a snapshot never kept: {got}"
        TOTALS["prefetches finding a snapshot"] += 1
    TOTALS["prefetches"] += 1


async def execute(plan: Plan) -> None:
    exclusive = plan.write_policy == "exclusive"
    cfg = config(
        write_policy="write_back" if exclusive else plan.write_policy,
        exclusive=exclusive,
        kv=f"mha:{plan.layers}:1:8:float32",
        device_tokens=plan.device_tokens,
        host_tokens=plan.host_tokens,
        prefetch_policy=plan.l3 or "best_effort",
    )
    store = MemoryStore() if plan.l3 else None
    oracle = Oracle(plan)
    segments: list[list[tuple[int, tuple]]] = [[]]  # one per cache instance
    for i, step in enumerate(plan.steps):
        segments[-1].append((i, step))
        if step[0] == "switch":
            segments.append([])
    state_cfg = None
    if plan.states is not None:
        in_l1, in_l2 = plan.states
        state_cfg = state_config(cfg, plan.model, device_snapshots=in_l1, host_snapshots=in_l2)

    def backend(c):
        return None if store is None else MemoryBackend(namespace=namespace_of(c), store=store)

    for n, segment in enumerate(segments):
        async with AsyncExitStack() as stack:
            cache = await stack.enter_async_context(HiCache(cfg, backend=backend(cfg)))
            states = None
            if state_cfg is not None:
                states = await stack.enter_async_context(
                    HiCache(state_cfg, backend=backend(state_cfg))
                )
            caches = [c for c in (cache, states) if c is not None]
            hc = HybridCache(cache, plan.model, states=states)
            if plan.model.stateful and states is None:
                assert state_pages(cache.device_pool, plan.model.state_bytes) == plan.pages
            if not plan.layers:  # no layer kept as pages: no K/V byte in L1 or L2
                assert cache.device_pool.geometry.bytes_per_token == cache.host_pool.nbytes == 0
            first = next(((i, s) for i, s in segment if s[0] in ("serve", "drop")), None)
            if n and first is not None:
                await prefetch(hc, oracle, f"r{first[0]}", first[1][1])
            for i, step in segment:
                held, oracle.held = oracle.held, []
                if step[0] in ("serve", "drop"):
                    await request(hc, oracle, f"r{i}", step)
                elif step[0] == "clear device":
                    for c in caches:
                        await c.clear(["device"])
                elif step[0] == "clear host":
                    for c in caches:
                        await c.clear(["host"])
                elif step[0] == "flush" or step[1]:  # a switch flushes first, or not
                    for c in caches:
                        await c.flush()
                for rid in held:
                    await hc.release(rid)
                TOTALS[f"step {step[0]}"] += 1
            for rid in oracle.held:
                await hc.release(rid)
            oracle.held = []
            stats = await cache.stats()
            TOTALS["tree hit tokens L1 (snapshot lookups too)"] += stats.device.hit_tokens
            TOTALS["tree hit tokens L2"] += stats.host.hit_tokens
            TOTALS["tree hit tokens L3"] += stats.storage_hit_tokens
            TOTALS["L1 evictions"] += stats.device.evictions
            TOTALS["L2 evictions"] += stats.host.evictions
            if states is not None:
                kept = await states.stats()
                TOTALS["states cache: L1 evictions"] += kept.device.evictions
                TOTALS["states cache: L2 evictions"] += kept.host.evictions
    TOTALS["examples"] += 1
    pages = f", {plan.pages}-page snapshots" if plan.model.stateful else ""
    if plan.states is not None:
        pages = ", snapshots in a states cache"
    TOTALS[f"geometry {plan.geometry}{pages}"] += 1
    TOTALS[f"policy {plan.write_policy}"] += 1
    TOTALS[f"L3 {plan.l3}"] += 1


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None and TOTALS:
        with capture.global_and_fixture_disabled():
            print("\nhybrid fuzz: " + "; ".join(f"{k}: {v}" for k, v in sorted(TOTALS.items())))


@pytest.mark.timeout(120 + EXAMPLES)
@pytest.mark.parametrize(
    "geometry",
    "abcdefg",
    ids=[
        "sliding+full",
        "recurrent+full",
        "2recurrent+sliding+full",
        "windowed+full+recurrent",
        "kv-and-state+state+nocache",
        "recurrent-only",
        "windowed+recurrent",
    ],
)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_no_hit_resumes_from_an_inconsistent_set_of_groups(geometry: str, data):
    plan = data.draw(plans(geometry), label="plan")
    run_virtual(lambda: execute(plan), seed=plan.seed)


def test_a_snapshot_over_a_half_kept_chain_is_kept_or_skipped():
    """Found by the fuzzer (2000 examples), minimised. Exclusive L2: request b's allocation
    moves the last page of a's 2-page snapshot chain at 8 to L2, `clear(["host"])` drops it,
    the first page stays in L1. c (a's first 8 tokens) hits 0, as it must; caching c with its
    snapshot at 8 makes `_store` match 12 of the chain's 16 tokens, allocate 8 and pass the
    8 prefix slots + 8 fresh ones: the tree refuses (InvalidRequest out of `cache_finished`,
    after c's own K/V was cached). Now the snapshot is skipped (the half chain is a leaf,
    evicted first; a later store works) and nothing escapes."""
    model = HybridModel((Recurrent((0, 1, 3), state_bytes=300, grid=8), FullAttention((2,))), PAGE)
    steps = (
        ("serve", (0, 0, 0, 1) + (0,) * 8, "all", None),  # snapshots at 8 and 12
        ("serve", (0,) * 24, "all", None),
        ("clear host",),
        ("serve", (0, 0, 0, 1) + (0,) * 4, "all", None),
    )
    saved = TOTALS.copy()
    try:
        run_virtual(lambda: execute(Plan("b", model, 1, 2, 64, 96, "exclusive", None, 0, steps)))
    finally:
        TOTALS.clear()
        TOTALS.update(saved)
