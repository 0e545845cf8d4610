"""Hit rates on slices of the shipped trace: the exclusive L2 against one tier of the same total
size, and an unbounded L3 against the trace's infinite-capacity bound."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from hicache import CacheConfig
from hicache.cli.coremodel import replay_trace
from hicache.cli.replay.command import replay
from hicache.cli.trace import bound_hit_rate, read_trace
from hicache.components.controller.ledger import SlotLedger
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree
from hicache.runtime import run_deterministic
from hicache.testing.chat import ChatShape, multi_turn_chat, write_trace

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


# ------------------------------------------------------------------ L3 under every write policy
CHAT = ChatShape(active=120, system_prompts=2, system_blocks=2, turns=(2, 6), turn_blocks=(1, 3))
CHAT_TIERS = dict(
    kv="mha:1:1:8:float16",
    page_size=16,
    device_tokens=2048,
    host_tokens=4096,
    storage="memory",
    model_id="chat",
)
POLICIES = {  # name -> CacheConfig fields; "defaults": every field but the tiers left as is
    "write_through": {"write_policy": "write_through"},
    "write_back": {"write_policy": "write_back"},
    "write_through_selective": {"write_policy": "write_through_selective"},
    "defaults": {},
}


def chat_requests(tmp_path: Path, count: int = 600) -> list:
    path = tmp_path / "chat.jsonl"
    write_trace(path, multi_turn_chat(count, shape=CHAT, block_tokens=64))
    return read_trace(path, block_tokens=64)


def test_l3_pays_off_under_every_write_policy_on_multi_turn_chat(tmp_path):
    """A conversation's pages leave L1 and L2 between its turns (120 interleaved, 2 shared
    system prompts that stay hot on L1): its next turn finds them in L3 under every policy,
    below a system prompt that may have no L2 copy. Instant workers (wait_complete): the
    controller's own decisions, deterministic, in a fraction of a second each."""
    requests = chat_requests(tmp_path)
    runs = {}
    for name, fields in POLICIES.items():
        cfg = CacheConfig(**CHAT_TIERS, **fields, prefetch_policy="wait_complete")
        runs[name] = replay_trace(cfg, requests, storage=True, block_tokens=64).summary()
    through = runs["write_through"]
    bound = bound_hit_rate(requests, block_tokens=64, page_size=16)
    assert through["hit_rate"] >= 0.8 * bound, (through, bound)
    assert through["hit_tokens"]["storage"] > through["hit_tokens"]["host"]  # L3 does the work
    for name, run in runs.items():
        assert run["hit_rate"] >= 0.95 * through["hit_rate"], (name, run, through)
        assert run["transfer_tokens"]["d2h"] <= through["transfer_tokens"]["d2h"], (name, run)
        assert run["hit_tokens"]["storage"] >= 0.9 * through["hit_tokens"]["storage"], name


def test_defaults_with_l3_reach_write_through_on_chat_with_every_page_verified(tmp_path):
    """The same workload through the real cache (actors, bytes moved, virtual time): the
    defaults (write_through_selective, prefetch timeout) against write_through, every page
    that comes back from L2 or L3 checked."""
    requests = chat_requests(tmp_path, 300)
    rates = {}
    for name in ("write_through", "defaults"):
        cfg = CacheConfig(**CHAT_TIERS, **POLICIES[name], deterministic=True)
        tally, extra = run_deterministic(
            lambda cfg=cfg: replay(
                cfg,
                requests,
                block_tokens=64,
                batch=8,
                verify=True,
                log=None,
                progress=lambda n: None,
            )
        )
        assert tally.corrupt_pages == 0 and tally.verified_pages > 0, name
        rates[name] = ((tally.device_hit + tally.host_hit) / tally.input_tokens, tally, extra)
    (through, t_tally, t_extra), (default, d_tally, d_extra) = rates.values()
    assert t_tally.storage_hit > 0 and d_tally.storage_hit >= 0.9 * t_tally.storage_hit
    assert default >= 0.95 * through, (default, through)
    assert d_extra["bytes"]["d2h"] <= t_extra["bytes"]["d2h"]
