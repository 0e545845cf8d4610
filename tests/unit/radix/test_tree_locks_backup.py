"""Locks, host protection and backups, including how they survive splits."""

import numpy as np
import pytest

from hicache.radix.results import NodeState, TreeError
from tests.unit.radix.tree_helpers import SlotSource, make_tree


def chain(tree, src, *lengths):
    """Insert nested keys 0..sum(lengths[:i]) so the tree is one path of nodes; return their ids."""
    ids, total = [], 0
    for n in lengths:
        total += n
        ids.append(tree.insert(np.arange(total), src.take(total), now=total).last_node)
    return ids


def test_lock_covers_the_path_and_unlock_below_zero_raises():
    tree = make_tree(1)
    a, b = chain(tree, SlotSource(), 2, 2)
    tree.lock(b)
    assert (tree.lock_ref(a), tree.lock_ref(b)) == (1, 1)
    assert tree.evictable_device_tokens() == 0
    assert tree.evict_device(4, now=9).freed.size == 0
    tree.unlock(b)
    assert tree.evictable_device_tokens() == 4
    with pytest.raises(TreeError, match="not locked"):
        tree.unlock(b)
    tree.lock(a)
    with pytest.raises(TreeError, match="not locked"):
        tree.unlock(b)
    assert (tree.lock_ref(a), tree.lock_ref(b)) == (1, 0)
    tree.check_integrity()


def test_lock_on_root_is_a_no_op_and_unknown_ids_raise():
    tree = make_tree(1)
    tree.lock(tree.root)
    tree.unlock(tree.root)
    tree.unlock(tree.root)
    with pytest.raises(TreeError, match="not a node"):
        tree.lock(42)
    leaf = tree.insert(np.arange(2), np.arange(2), now=0).last_node
    tree.evict_device(2, now=1)
    with pytest.raises(TreeError, match="was removed"):
        tree.lock(leaf)
    assert tree.state(leaf) == NodeState.GONE
    with pytest.raises(TreeError):
        tree.state(99)


def test_a_lock_still_protects_the_whole_path_after_a_split():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(8), np.arange(8), now=0).last_node
    tree.lock(leaf)
    upper = tree.match(np.arange(3), now=1).last_node
    assert tree.lock_ref(upper) == 1
    assert tree.evict_device(8, now=2).freed.size == 0
    tree.unlock(leaf)
    assert tree.lock_ref(upper) == 0
    assert sorted(tree.evict_device(8, now=2).freed.tolist()) == list(range(8))
    tree.check_integrity()


def test_protect_host_path_and_release_below_zero():
    tree = make_tree(1)
    src = SlotSource()
    a, b = chain(tree, src, 2, 2)
    for n in (a, b):
        tree.begin_backup(n, src.take(2) + 500)
        tree.end_backup(n, ok=True)
    tree.evict_device(4, now=9)
    assert tree.evictable_host_tokens() == 4
    tree.protect_host(b)
    assert (tree.host_ref(a), tree.host_ref(b)) == (1, 1)
    assert tree.evictable_host_tokens() == 0
    assert tree.evict_host(4, now=0.0).removed == ()
    tree.release_host(b)
    with pytest.raises(TreeError, match="not protected"):
        tree.release_host(b)
    assert tree.evict_host(4, now=0.0).removed == (b, a)
    tree.check_integrity()


def test_backup_success_makes_both_and_unlocks():
    tree = make_tree(2)
    src = SlotSource()
    leaf = tree.insert(np.arange(4), src.take(4), now=0).last_node
    host = np.arange(100, 104)
    tree.begin_backup(leaf, host)
    assert tree.state(leaf) == NodeState.BOTH and tree.backup_in_flight(leaf)
    assert tree.lock_ref(leaf) == 1
    assert not tree.has_host_copy(leaf)  # not until written
    with pytest.raises(TreeError, match="still being written"):
        tree.protect_host(leaf)
    assert tree.end_backup(leaf, ok=True).size == 0
    assert tree.lock_ref(leaf) == 0 and not tree.backup_in_flight(leaf)
    assert tree.has_host_copy(leaf)
    assert tree.host_slots(leaf).tolist() == host.tolist()
    tree.check_integrity()


def test_backup_errors_change_nothing():
    tree = make_tree(2)
    leaf = tree.insert(np.arange(4), np.arange(4), now=0).last_node
    before = tree.dump()
    with pytest.raises(TreeError, match="expected 4 slots"):
        tree.begin_backup(leaf, np.arange(2))
    with pytest.raises(TreeError, match="no backup"):
        tree.end_backup(leaf, ok=True)
    with pytest.raises(TreeError, match="root"):
        tree.begin_backup(tree.root, np.arange(0))
    assert tree.dump() == before
    tree.begin_backup(leaf, np.arange(10, 14))
    with pytest.raises(TreeError, match="already has a host copy"):
        tree.begin_backup(leaf, np.arange(20, 24))


def test_backup_of_a_split_node_covers_all_pieces():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(6), np.arange(6), now=0).last_node
    tree.begin_backup(leaf, np.arange(100, 106))
    top = tree.match(np.arange(2), now=1).last_node  # split: top [0,2), leaf [2,6)
    mid = tree.match(np.arange(4), now=1).last_node  # split again: mid [2,4), leaf [4,6)
    assert [tree.backup_in_flight(n) for n in (top, mid, leaf)] == [True] * 3
    assert tree.host_slots(top).tolist() == [100, 101] and tree.host_slots(leaf).tolist() == [
        104,
        105,
    ]
    tree.check_integrity()
    freed = tree.end_backup(leaf, ok=False)
    assert freed.tolist() == list(range(100, 106))
    assert [tree.state(n) for n in (top, mid, leaf)] == [NodeState.DEVICE_ONLY] * 3
    assert [tree.lock_ref(n) for n in (top, mid, leaf)] == [0, 0, 0]
    tree.check_integrity()


def test_backup_success_after_split_keeps_every_piece_backed_up():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(6), np.arange(6), now=0).last_node
    tree.begin_backup(leaf, np.arange(100, 106))
    top = tree.match(np.arange(2), now=1).last_node
    tree.end_backup(leaf, ok=True)
    assert tree.state(top) == tree.state(leaf) == NodeState.BOTH
    assert not tree.backup_in_flight(top)
    tree.check_integrity()


def test_backup_lock_keeps_the_node_on_the_device():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(4), np.arange(4), now=0).last_node
    tree.begin_backup(leaf, np.arange(10, 14))
    ev = tree.evict_device(4, now=1)
    assert ev.freed.size == 0 and tree.state(leaf) == NodeState.BOTH
