"""Match and insert: page cutting, splits, duplicates, hit counts, write-policy candidates, bad input."""

import numpy as np
import pytest

from hicache.radix.results import NodeState, TreeError
from tests.unit.radix.tree_helpers import SlotSource, make_tree, toks


def test_empty_tree_matches_nothing():
    tree = make_tree(4)
    m = tree.match(toks(1, 2, 3, 4), now=0)
    assert m.device_slots.size == 0 and m.host_len == 0
    assert m.last_node == tree.root


def test_insert_then_match_returns_the_slots():
    tree = make_tree(4)
    slots = np.arange(100, 108)
    r = tree.insert(np.arange(8), slots, now=1)
    assert r.prefix_len == 0 and r.duplicate_slots.size == 0
    m = tree.match(np.arange(8), now=2)
    assert m.device_slots.tolist() == slots.tolist()
    assert m.last_node == r.last_node
    assert not m.device_slots.flags.writeable
    tree.check_integrity()


def test_match_cuts_the_key_to_whole_pages():
    tree = make_tree(4)
    tree.insert(np.arange(8), np.arange(8), now=1)
    assert tree.match(np.arange(7), now=2).device_slots.tolist() == [0, 1, 2, 3]
    assert tree.match(np.arange(3), now=2).device_slots.size == 0


def test_mismatch_inside_a_page_counts_the_whole_page_as_missed():
    tree = make_tree(4)
    tree.insert(np.arange(12), np.arange(12), now=1)
    key = np.arange(12)
    key[6] = 99
    m = tree.match(key, now=2)
    assert m.device_slots.tolist() == [0, 1, 2, 3]
    tree.check_integrity()


def test_match_ending_inside_a_node_splits_it_keeping_the_id_on_the_suffix():
    tree = make_tree(2)
    leaf = tree.insert(np.arange(8), np.arange(10, 18), now=1).last_node
    tree.set_page_hashes(leaf, ["h0", "h1", "h2", "h3"])
    m = tree.match(np.r_[np.arange(4), [7, 7]], now=5)
    upper = m.last_node
    assert upper != leaf
    assert tree.parent(leaf) == upper and tree.parent(upper) == tree.root
    assert tree.key(upper).tolist() == [0, 1, 2, 3] and tree.key(leaf).tolist() == [4, 5, 6, 7]
    assert tree.device_slots(upper).tolist() == [10, 11, 12, 13]
    assert tree.device_slots(leaf).tolist() == [14, 15, 16, 17]
    assert tree.page_hashes(upper) == ("h0", "h1") and tree.page_hashes(leaf) == ("h2", "h3")
    assert tree.hit_count(upper) == tree.hit_count(leaf) == 1
    # As SGLang does, a split refreshes the suffix too (exact hit-rate parity with its HiCache:
    # docs/benchmarks.md, "Against SGLang's HiCache").
    assert tree.dump()[upper]["last_access"] == 5 and tree.dump()[leaf]["last_access"] == 5
    tree.check_integrity()


def test_match_of_a_key_shorter_than_the_node_splits_at_its_end():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(6), np.arange(6), now=1).last_node
    m = tree.match(np.arange(3), now=2)
    assert m.device_slots.tolist() == [0, 1, 2]
    assert tree.num_tokens(m.last_node) == 3 and tree.num_tokens(leaf) == 3
    assert len(tree) == 3


def test_full_match_of_a_node_does_not_split():
    tree = make_tree(1)
    tree.insert(np.arange(6), np.arange(6), now=1)
    tree.match(np.arange(6), now=2)
    tree.match(np.arange(9), now=2)
    assert len(tree) == 2


def test_insert_reports_duplicates_and_adds_only_the_new_part():
    tree = make_tree(1)
    tree.insert(np.arange(4), np.arange(4), now=1)
    r = tree.insert(np.arange(6), np.arange(50, 56), now=2)
    assert r.prefix_len == 4 and r.duplicate_slots.tolist() == [50, 51, 52, 53]
    assert tree.device_slots(r.last_node).tolist() == [54, 55]
    assert tree.match(np.arange(6), now=3).device_slots.tolist() == [0, 1, 2, 3, 54, 55]
    tree.check_integrity()


def test_insert_that_diverges_inside_a_node_splits_and_branches():
    tree = make_tree(2)
    a = tree.insert(np.arange(8), np.arange(8), now=1).last_node
    r = tree.insert(np.r_[np.arange(4), [9, 9]], np.arange(20, 26), now=2)
    assert r.prefix_len == 4
    upper = tree.parent(a)
    assert tree.parent(r.last_node) == upper and tree.num_tokens(upper) == 4
    assert tree.match(np.r_[np.arange(4), [9, 9]], now=3).device_slots.tolist() == [
        0,
        1,
        2,
        3,
        24,
        25,
    ]
    tree.check_integrity()


def test_insert_of_an_existing_key_prefix_splits_and_adds_nothing():
    tree = make_tree(1)
    tree.insert(np.arange(6), np.arange(6), now=1)
    r = tree.insert(np.arange(3), np.arange(30, 33), now=2)
    assert r.prefix_len == 3 and tree.num_tokens(r.last_node) == 3
    assert len(tree) == 3


def test_hit_counts_chunked_inserts_and_write_through_selective_candidates():
    tree = make_tree(1, policy="write_through_selective")
    src = SlotSource()
    r1 = tree.insert(np.arange(4), src.take(4), now=1)
    assert r1.backup_candidates == () and tree.hit_count(r1.last_node) == 1
    r2 = tree.insert(np.arange(4), src.take(4), now=2, chunked=True)
    assert r2.backup_candidates == () and tree.hit_count(r1.last_node) == 1
    r3 = tree.insert(np.arange(6), src.take(6), now=3)
    assert r3.backup_candidates == (r1.last_node,)
    assert tree.hit_count(r1.last_node) == 2 and tree.hit_count(r3.last_node) == 1


def test_write_through_reports_the_new_leaf_at_once_and_not_once_backed_up():
    tree = make_tree(1, policy="write_through")
    src = SlotSource()
    r = tree.insert(np.arange(4), src.take(4), now=1)
    assert r.backup_candidates == (r.last_node,)
    assert tree.insert(np.arange(4), src.take(4), now=1, chunked=True).backup_candidates == ()
    tree.begin_backup(r.last_node, src.take(4))
    assert tree.insert(np.arange(4), src.take(4), now=2).backup_candidates == ()
    tree.end_backup(r.last_node, ok=True)
    assert tree.insert(np.arange(4), src.take(4), now=2).backup_candidates == ()


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_an_insert_asking_for_a_backup_reports_its_whole_path_whatever_the_policy(policy):
    tree = make_tree(1, policy=policy)
    src = SlotSource()
    first = tree.insert(np.arange(4), src.take(4), now=1)
    assert first.backup_candidates == ()
    more = tree.insert(np.arange(6), src.take(6), now=2, backup=True)
    assert more.backup_candidates == (first.last_node, more.last_node)
    chunk = tree.insert(np.arange(8), src.take(8), now=3, chunked=True, backup=True)
    assert chunk.backup_candidates == (first.last_node, more.last_node, chunk.last_node)
    tree.begin_backup(first.last_node, src.take(4))  # a copy on its way is not asked again
    again = tree.insert(np.arange(8), src.take(8), now=4, backup=True)
    assert first.last_node not in again.backup_candidates


def test_write_back_never_reports_candidates_but_still_counts_hits():
    tree = make_tree(1, policy="write_back")
    src = SlotSource()
    for t in range(3):
        r = tree.insert(np.arange(4), src.take(4), now=t)
        assert r.backup_candidates == ()
    assert tree.hit_count(r.last_node) == 3


def test_priority_is_raised_along_the_path():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(4), np.arange(4), now=1, priority=1).last_node
    tree.insert(np.arange(4), np.arange(10, 14), now=2, priority=7)
    tree.insert(np.arange(4), np.arange(20, 24), now=3, priority=2)
    assert tree.dump()[leaf]["priority"] == 7


def test_insert_adopts_slots_for_host_only_nodes():
    tree = make_tree(1)
    src = SlotSource()
    a = tree.insert(np.arange(4), src.take(4), now=1).last_node
    b = tree.insert(np.arange(8), src.take(8), now=1).last_node
    for n in (a, b):
        tree.begin_backup(n, src.take(4) + 1000)
        tree.end_backup(n, ok=True)
    tree.evict_device(8, now=2)
    assert tree.state(a) == tree.state(b) == NodeState.HOST_ONLY
    fresh = np.arange(200, 208)
    r = tree.insert(np.arange(8), fresh, now=3)
    assert r.prefix_len == 0 and r.duplicate_slots.size == 0
    assert tree.state(a) == tree.state(b) == NodeState.BOTH
    assert tree.match(np.arange(8), now=4).device_slots.tolist() == fresh.tolist()
    tree.check_integrity()


def test_bigram_keys():
    tree = make_tree(2, bigram=True)
    key = [(1, 2), (2, 3), (3, 4), (4, 5)]
    tree.insert(key, np.arange(4), now=1)
    assert tree.match([(1, 2), (2, 3), (3, 9), (9, 9)], now=2).device_slots.tolist() == [0, 1]
    assert tree.match(np.array(key, dtype=np.int64), now=2).device_slots.tolist() == [0, 1, 2, 3]
    with pytest.raises(TreeError, match="bigram"):
        tree.match([1, 2, 3, 4], now=2)
    tree.check_integrity()


def test_lists_and_other_integer_dtypes_are_the_same_key():
    tree = make_tree(1)
    tree.insert([5, 6, 7], np.arange(3), now=1)
    assert tree.match(np.array([5, 6, 7], dtype=np.int16), now=2).device_slots.tolist() == [0, 1, 2]
    assert tree.match((5, 6), now=2).device_slots.tolist() == [0, 1]


@pytest.mark.parametrize(
    "key, slots, message",
    [
        (np.arange(3), np.arange(3), "not a multiple of page_size=2"),
        (np.arange(4), np.arange(3), "expected 4 slots"),
        (np.arange(4), np.arange(4.0), "integers"),
        (np.array([-1, 2, 3, 4]), np.arange(4), "outside"),
        (np.array([2**32, 2, 3, 4]), np.arange(4), "outside"),
        (np.arange(4.0), np.arange(4), "integer token ids"),
        (np.arange(4).reshape(2, 2), np.arange(4), "shape"),
    ],
)
def test_bad_insert_raises_and_changes_nothing(key, slots, message):
    tree = make_tree(2)
    tree.insert(np.arange(2), np.arange(2), now=0)
    before = tree.dump()
    with pytest.raises(TreeError, match=message):
        tree.insert(key, slots, now=1)
    assert tree.dump() == before


def test_insert_keeps_a_private_copy_of_writeable_slots():
    tree = make_tree(1)
    slots = np.arange(4)
    tree.insert(np.arange(4), slots, now=1)
    slots[:] = -1
    assert tree.match(np.arange(4), now=2).device_slots.tolist() == [0, 1, 2, 3]
