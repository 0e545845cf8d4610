"""Retention ranges and pins on the tree core: eviction order by live priority, fall-back at the
range's end, page-boundary splits, pins per tier and their expiry, on the tree's own clock."""

import numpy as np
import pytest

from hicache.policies.eviction import LFU, LRU, SLRU
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree
from tests.unit.radix.tree_helpers import SlotSource

INF = float("inf")


def tree_of(page_size=1, *, strategy=None, policy="write_through_selective", default=35):
    return RadixTree(
        page_size=page_size,
        eviction=strategy or LRU(),
        write_policy=write_policy(policy),
        default_priority=default,
    )


def leaves(tree, src, count, *, width=2):
    """`count` sibling leaves under the root, leaf i last used at time i."""
    keys = [np.arange(width) + 100 * i for i in range(count)]
    ids = [tree.insert(k, src.take(width), now=float(i)).last_node for i, k in enumerate(keys)]
    return keys, ids


def evicted_order(tree, n, now):
    order = []
    for _ in range(n):
        ev = tree.evict_device(1, now=now)
        order.extend(ev.removed)
    return order


@pytest.mark.parametrize("strategy", [LRU(), LFU(), SLRU()])
@pytest.mark.parametrize("at, first", [(8.0, 1), (10.0, 0)])
def test_a_high_priority_range_outlives_lru_pressure_then_falls_back(strategy, at, first):
    tree = tree_of(strategy=strategy)
    keys, ids = leaves(tree, SlotSource(), 4)
    tree.retain(keys[0], [(0, 2, 80, 10.0)], now=4.0)  # kept until t=10 (retaining is a use)
    for i in (1, 2, 3):
        tree.match(keys[i], now=4.0 + i)  # leaf 0 is now the least recently used
    # Before t=10 the others go first; from t=10 on the range has ended and leaf 0 is the
    # ordinary least recently used leaf again.
    assert evicted_order(tree, 1, now=at) == [ids[first]]
    if first:
        assert evicted_order(tree, 2, now=at) == ids[2:]
    tree.check_integrity()


def test_a_range_below_the_default_goes_first_even_when_recent():
    tree = tree_of()
    keys, ids = leaves(tree, SlotSource(), 3)
    tree.retain(keys[2], [(0, 2, 10, INF)], now=3.0)  # the most recent leaf, low priority
    assert evicted_order(tree, 3, now=4.0) == [ids[2], ids[0], ids[1]]


def test_higher_priority_wins_and_equal_priority_keeps_the_later_end():
    tree = tree_of()
    keys, ids = leaves(tree, SlotSource(), 2)
    tree.retain(keys[0], [(0, 2, 80, 20.0)], now=2.0)
    tree.retain(keys[0], [(0, 2, 50, 100.0)], now=2.0)  # lower: ignored while 80 lives
    tree.retain(keys[0], [(0, 2, 80, 30.0)], now=2.0)  # same: the end moves to 30
    node = {d["id"]: d for d in tree.dump()}[ids[0]]
    assert node["priority"] == 80 and node["retain_until"] == 30.0
    assert evicted_order(tree, 1, now=25.0) == [ids[1]]


def test_a_range_inside_a_node_splits_it_at_page_boundaries():
    tree = tree_of(page_size=4)
    src = SlotSource()
    key = np.arange(12)
    leaf = tree.insert(key, src.take(12), now=1.0).last_node
    other = tree.insert(np.arange(100, 104), src.take(4), now=2.0).last_node
    # Tokens [1, 5) touch pages 0 and 1: both are kept, page 2 is not.
    tree.retain(key, [(1, 5, 90, INF)], now=3.0)
    tree.match(np.arange(100, 104), now=3.5)  # the other leaf is now the more recent
    tree.check_integrity()
    ev = tree.evict_device(4, now=4.0)
    assert ev.removed == (leaf,) and ev.freed.size == 4  # the tail page, the lowest priority
    ev = tree.evict_device(4, now=4.0)
    assert ev.removed == (other,)
    m = tree.match(key, now=5.0)
    assert m.device_slots.size == 8  # the retained pages are still there
    tree.check_integrity()


def test_priority_ranks_before_the_strategy_in_l2_and_for_exclusive_admission():
    tree = tree_of(policy="write_through")
    src = SlotSource()
    keys, ids = leaves(tree, src, 3)
    for node in ids:
        tree.begin_backup(node, src.take(2) + 10_000)
        tree.end_backup(node, ok=True)
    tree.retain(keys[0], [(0, 2, 90, INF)], now=3.0)
    tree.evict_device(6, now=4.0)  # all demoted to L2
    ev = tree.evict_host(2, now=5.0)
    assert ev.removed == (ids[1],)  # leaf 0 is older but retained
    # Exclusive admission into L2 ranks the same way: a fresh L1 leaf of the default priority
    # beats L2's next victim (leaf 2, older); one ranked below the default loses to all of L2.
    fresh = tree.insert(np.arange(500, 502), src.take(2), now=6.0).last_node
    assert tree.outranks_host(fresh, now=6.0)
    tree.retain(np.arange(500, 502), [(0, 2, 10, INF)], now=6.0)
    assert not tree.outranks_host(fresh, now=6.0)


def test_a_device_pin_keeps_pages_in_l1_until_it_expires():
    tree = tree_of()
    keys, ids = leaves(tree, SlotSource(), 3)
    assert tree.mark_pins(keys[0], device_until=10.0, host_until=-INF, now=3.0) == 2
    assert evicted_order(tree, 3, now=4.0) == ids[1:]  # the pinned leaf is no candidate
    assert tree.evict_device(2, now=5.0).freed.size == 0
    assert tree.evict_device(2, now=10.0).removed == (ids[0],)  # expired
    tree.check_integrity()


def test_a_host_pin_lets_pages_leave_l1_but_not_l2():
    tree = tree_of(policy="write_through")
    src = SlotSource()
    keys, ids = leaves(tree, src, 2)
    tree.mark_pins(keys[0], device_until=-INF, host_until=INF, now=2.0)
    # No host copy yet: leaving L1 would lose the pages, so it asks for a backup first.
    ev = tree.evict_device(4, now=3.0)
    assert ev.removed == (ids[1],) and ev.needs_backup == (ids[0],)
    tree.begin_backup(ids[0], src.take(2) + 10_000)
    tree.end_backup(ids[0], ok=True)
    ev = tree.evict_device(4, now=4.0)
    assert ids[0] in ev.demoted
    assert tree.evict_host(2, now=5.0).freed.size == 0  # pinned to L2
    tree.unmark_pins(keys[0], now=6.0)
    assert tree.evict_host(2, now=6.0).removed == (ids[0],)
    tree.check_integrity()


def test_pins_cover_the_prefix_and_a_pin_shorter_than_the_node_splits_it():
    tree = tree_of(page_size=2)
    src = SlotSource()
    key = np.arange(8)
    tree.insert(key, src.take(8), now=1.0)
    assert tree.mark_pins(key[:4], device_until=INF, host_until=-INF, now=2.0) == 4
    tree.check_integrity()
    ev = tree.evict_device(8, now=3.0)
    assert ev.freed.size == 4  # the unpinned tail only
    assert tree.match(key, now=4.0).device_slots.size == 4
    # Marks hold for nodes cached later under a pinned prefix only when marked again: a pin
    # is applied to what is cached when it is applied (the controller re-applies on insert).
    tree.insert(np.arange(10), src.take(10), now=5.0)
    assert tree.mark_pins(np.arange(10), device_until=INF, host_until=-INF, now=5.0) == 10
    assert tree.evict_device(10, now=6.0).freed.size == 0
