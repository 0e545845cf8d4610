"""Eviction strategies: each one's order on the same tree, and the heap routine."""

import pytest

from hicache.policies.eviction import (
    FIFO,
    FILO,
    LFU,
    LRU,
    MRU,
    SLRU,
    STRATEGIES,
    PriorityFirst,
    evict_in_order,
    make_strategy,
)
from tests.unit.radix.tree_helpers import SlotSource, make_tree, toks


def four_leaves(strategy):
    """Leaves A..D (one token each, under the root) with distinct created / last access / hits / priority.

    created A1 B2 C3 D4; hits A1 B3 C2 D1; priority A5 B0 C0 D3; last access A9 B8 C6 D7.
    """
    tree = make_tree(strategy=strategy)
    src = SlotSource()
    ids = {}
    for name, tok, t, prio in (("A", 1, 1, 5), ("B", 2, 2, 0), ("C", 3, 3, 0), ("D", 4, 4, 3)):
        ids[tree.insert(toks(tok), src.take(1), now=t, priority=prio).last_node] = name
    for tok in (2, 2, 3):  # extra hits: B twice, C once
        tree.insert(toks(tok), src.take(1), now=5)
    for tok, t in ((3, 6), (4, 7), (2, 8), (1, 9)):
        tree.match(toks(tok), now=t)
    return tree, ids


def eviction_order(strategy):
    tree, ids = four_leaves(strategy)
    order = []
    for _ in range(4):
        ev = tree.evict_device(1, now=10)
        assert len(ev.removed) == 1
        order.append(ids[ev.removed[0]])
        tree.check_integrity()
    return "".join(order)


@pytest.mark.parametrize(
    "strategy, expected",
    [
        (LRU(), "CDBA"),
        (MRU(), "ABDC"),
        (FIFO(), "ABCD"),
        (FILO(), "DCBA"),
        (LFU(), "DACB"),
        (PriorityFirst(), "CBDA"),
        (SLRU(), "DACB"),  # probation (hits < 2) by LRU: D7 A9, then protected: C6 B8
    ],
)
def test_strategy_order(strategy, expected):
    assert eviction_order(strategy) == expected


def test_slru_differs_from_lfu_when_recency_disagrees_with_hit_count():
    # LFU ranks a 3-hit node after a 2-hit one; SLRU treats both as protected and uses recency.
    tree, ids = four_leaves(SLRU())
    tree.match(toks(3), now=20)  # C becomes the most recently used protected node
    order = [ids[tree.evict_device(1, now=21).removed[0]] for _ in range(4)]
    assert order == ["D", "A", "B", "C"]


def test_one_strategy_serves_both_tiers():
    tree, ids = four_leaves(LRU())
    src = SlotSource(1000)
    for node in list(ids):
        tree.begin_backup(node, src.take(1))
        tree.end_backup(node, ok=True)
    demoted = [ids[tree.evict_device(1, now=10).demoted[0]] for _ in range(4)]
    removed = [ids[tree.evict_host(1, now=0.0).removed[0]] for _ in range(4)]
    assert demoted == removed == list("CDBA")


def test_make_strategy_by_name_and_unknown_name():
    assert set(STRATEGIES) == {"lru", "lfu", "fifo", "mru", "filo", "priority", "slru"}
    assert isinstance(make_strategy("slru"), SLRU)
    with pytest.raises(ValueError, match="unknown eviction strategy 'arc'"):
        make_strategy("arc")
    with pytest.raises(ValueError):
        SLRU(protect_after=0)


def test_heap_routine_ties_break_by_id_and_exposed_candidates_join():
    # Items: (id, key, size, parent id exposed when evicted)
    items = {1: (5, 2, None), 2: (5, 2, 9), 3: (1, 1, None), 9: (0, 4, None)}
    order = []

    def evict(i):
        order.append(i)
        _, size, exposed = items[i]
        return size, exposed

    freed = evict_in_order(
        [2, 1, 3], key=lambda i: items[i][0], ident=lambda i: i, evict=evict, target=7
    )
    assert order == [3, 1, 2, 9] and freed == 9


def test_heap_routine_stops_at_target_and_when_empty():
    evicted = []

    def evict(i):
        evicted.append(i)
        return 3, None

    assert evict_in_order([1, 2, 3], key=lambda i: i, ident=lambda i: i, evict=evict, target=4) == 6
    assert evicted == [1, 2]
    assert evict_in_order([], key=lambda i: i, ident=lambda i: i, evict=evict, target=4) == 0
    assert evict_in_order([5], key=lambda i: i, ident=lambda i: i, evict=evict, target=0) == 0
