"""Hit rates on slices of the shipped trace: the exclusive L2 against one tier of the same total
size, and an unbounded L3 against the trace's infinite-capacity bound."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from hicache import CacheConfig
from hicache.cli.replay import replay
from hicache.cli.trace import bound_hit_rate, read_trace
from hicache.components.allocator.core import SlotLedger
from hicache.components.tree.core import RadixTree
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"
PAGE = 64


def single_tier_hit_rate(requests, capacity: int) -> float:
    """One LRU tier of `capacity` tokens, driven through the tree core, one request at a time."""
    tree = RadixTree(
        page_size=PAGE,
        eviction=make_strategy("lru"),
        write_policy=write_policy("write_through_selective"),
    )
    ledger = SlotLedger(size=capacity, page_size=PAGE, tier="device")
    hit = total = 0
    for now, req in enumerate(requests):
        tokens = req.tokens(512)
        total += len(tokens)
        m = tree.match(tokens, now=float(now))
        hit += len(m.device_slots)
        aligned = len(tokens) // PAGE * PAGE
        need = aligned - len(m.device_slots)
        tree.lock(m.last_node)
        slots = ledger.alloc(need)
        if slots is None:
            ev = tree.evict_device(
                need - ledger.available,
                now=float(now),  # the shortfall
                require_host_copy=False,
            )
            ledger.free(ev.freed)
            slots = ledger.alloc(need)
        tree.unlock(m.last_node)
        if slots is None:
            continue
        res = tree.insert(tokens[:aligned], np.concatenate([m.device_slots, slots]), now=float(now))
        dup = slots[: max(0, res.prefix_len - len(m.device_slots))]
        if len(dup):
            ledger.free(dup)
    return hit / total


def run_replay(cfg: CacheConfig, requests, batch: int = 1):
    tally, _ = anyio.run(
        lambda: replay(
            cfg,
            requests,
            block_tokens=512,
            batch=batch,
            verify=True,
            log=None,
            progress=lambda n: None,
        )
    )
    assert tally.corrupt_pages == 0
    return (tally.device_hit + tally.host_hit) / tally.input_tokens, tally


@pytest.mark.slow
def test_exclusive_l2_reaches_single_tier_of_same_total_size():
    requests = read_trace(TRACE, limit=300)
    device = 160_000  # 480k tokens in all: the slice's reuse spans more than 2 x 160k
    cfg = CacheConfig(
        kv="mha:1:1:8:float16",
        page_size=PAGE,
        device_tokens=device,
        host_tokens=2 * device,
        exclusive=True,
    )
    exclusive, _ = run_replay(cfg, requests)
    single = single_tier_hit_rate(requests, 3 * device)
    inclusive, _ = run_replay(
        CacheConfig(
            kv="mha:1:1:8:float16",
            page_size=PAGE,
            device_tokens=device,
            host_tokens=2 * device,
            write_policy="write_through",
        ),
        requests,
    )
    assert single > 0.01  # the slice has reuse at this size
    assert exclusive >= 0.97 * single, (exclusive, single)
    assert inclusive < exclusive  # duplicates cost the inclusive hierarchy capacity


@pytest.mark.slow
def test_unbounded_storage_reaches_the_infinite_capacity_bound():
    requests = read_trace(TRACE, limit=300)
    bound = bound_hit_rate(requests, block_tokens=512, page_size=PAGE)
    # L1 + L2 big enough for the largest request (134k tokens) and for the prefetch rate limit
    # (0.8 x (host - device)) to admit a step's prefetches: all other reuse must come from L3.
    tiers = dict(
        kv="mha:1:1:8:float16",
        page_size=PAGE,
        device_tokens=160_000,
        host_tokens=480_000,
        write_policy="write_through",
    )
    with_l3, tally = run_replay(
        CacheConfig(**tiers, storage="memory", model_id="trace", prefetch_policy="wait_complete"),
        requests,
        batch=4,
    )
    small = dict(tiers, device_tokens=12_800, host_tokens=25_600)
    l1_only, _ = run_replay(CacheConfig(**small), requests, batch=4)
    assert with_l3 >= 0.98 * bound, (with_l3, bound)
    assert tally.storage_hit > 0
    assert l1_only < 0.5 * bound, (l1_only, bound)
