"""L1 and L2 eviction rules: leaf-first, demotion vs removal, write_back, exclusive mode, protection."""

import numpy as np

from hicache.radix.results import NodeState
from tests.unit.radix.tree_helpers import SlotSource, make_tree


def backed_up(tree, src, key, now):
    node = tree.insert(key, src.take(len(key)), now=now).last_node
    tree.begin_backup(node, src.take(tree.num_tokens(node)) + 10_000)
    tree.end_backup(node, ok=True)
    return node


def test_device_eviction_is_leaf_first_and_parents_join_after_their_last_child():
    tree = make_tree(1)
    src = SlotSource()
    trunk = tree.insert(np.arange(4), src.take(4), now=5).last_node  # oldest access last
    a = tree.insert(np.r_[np.arange(4), [7]], src.take(5), now=1).last_node
    b = tree.insert(np.r_[np.arange(4), [8]], src.take(5), now=2).last_node
    tree.match(np.arange(4), now=0)  # the trunk is least recently used, but has children
    ev = tree.evict_device(1, now=9)
    assert ev.removed == (a,)
    ev = tree.evict_device(5, now=9)
    assert ev.removed == (b, trunk) and ev.freed.size == 5
    assert len(tree) == 1
    tree.check_integrity()


def test_backed_up_leaves_are_demoted_and_stay_matchable():
    tree = make_tree(2)
    src = SlotSource()
    leaf = backed_up(tree, src, np.arange(4), now=1)
    dev = tree.device_slots(leaf).tolist()
    ev = tree.evict_device(2, now=2)
    assert ev.demoted == (leaf,) and ev.removed == () and ev.freed.tolist() == dev
    assert tree.state(leaf) == NodeState.HOST_ONLY
    m = tree.match(np.arange(4), now=3)
    assert m.device_slots.size == 0 and m.host_len == 4 and tree.has_host_copy(leaf)
    assert m.last_node == leaf


def test_match_reports_the_device_prefix_then_the_host_suffix():
    tree = make_tree(1)
    src = SlotSource()
    a = tree.insert(np.arange(3), src.take(3), now=5).last_node
    b = backed_up(tree, src, np.arange(6), now=1)
    tree.evict_device(3, now=2)
    m = tree.match(np.arange(8), now=3)
    assert m.device_slots.tolist() == tree.device_slots(a).tolist()
    assert m.host_len == 3 and m.last_node == b and tree.has_host_copy(b)


def test_write_back_reports_needs_backup_and_frees_nothing_for_it():
    tree = make_tree(1, policy="write_back")
    src = SlotSource()
    a = tree.insert(np.arange(2), src.take(2), now=1).last_node
    b = backed_up(tree, src, np.arange(10, 12), now=2)
    ev = tree.evict_device(4, now=3)
    assert ev.needs_backup == (a,) and ev.demoted == (b,) and ev.freed.size == 2
    assert tree.state(a) == NodeState.DEVICE_ONLY
    tree.begin_backup(a, src.take(2))
    tree.end_backup(a, ok=True)
    assert tree.evict_device(2, now=4).demoted == (a,)


def test_exclusive_mode_requires_a_host_copy_too():
    tree = make_tree(1)
    a = tree.insert(np.arange(2), np.arange(2), now=1).last_node
    ev = tree.evict_device(2, now=2, require_host_copy=True)
    assert ev.needs_backup == (a,) and ev.freed.size == 0
    assert tree.evict_device(2, now=2).removed == (a,)


def test_removing_a_device_only_node_takes_its_host_only_children_along():
    tree = make_tree(1)
    src = SlotSource()
    parent = tree.insert(np.arange(2), src.take(2), now=1).last_node
    child = backed_up(tree, src, np.arange(4), now=2)
    host = tree.host_slots(child).tolist()
    tree.evict_device(2, now=3)  # child demoted
    ev = tree.evict_device(2, now=3)  # parent has no host copy: removed with the child
    assert ev.removed == (child, parent) and ev.freed_host.tolist() == host
    assert tree.state(child) == tree.state(parent) == NodeState.GONE
    tree.check_integrity()


def test_a_host_protected_node_is_not_removed_from_the_device():
    tree = make_tree(1)
    parent = tree.insert(np.arange(2), np.arange(2), now=1).last_node
    tree.protect_host(parent)  # e.g. a prefetch hanging pages below it
    ev = tree.evict_device(2, now=2)
    assert ev.freed.size == 0 and tree.state(parent) == NodeState.DEVICE_ONLY
    tree.release_host(parent)
    assert tree.evict_device(2, now=2).removed == (parent,)


def test_host_eviction_only_takes_host_only_leaves():
    tree = make_tree(1)
    src = SlotSource()
    both = backed_up(tree, src, np.arange(2), now=1)
    gone = backed_up(tree, src, np.arange(10, 12), now=2)
    tree.evict_device(2, now=3)  # demotes `both` (older)
    assert tree.state(both) == NodeState.HOST_ONLY
    ev = tree.evict_host(10, now=0.0)
    assert ev.removed == (both,) and tree.state(gone) == NodeState.BOTH
    tree.check_integrity()


def test_host_eviction_exposes_host_only_parents_and_skips_locked():
    tree = make_tree(1)
    src = SlotSource()
    a = backed_up(tree, src, np.arange(2), now=1)
    b = backed_up(tree, src, np.arange(4), now=2)
    tree.evict_device(4, now=3)
    tree.lock(b)  # a request about to load them back
    assert tree.evict_host(4, now=0.0).removed == ()
    tree.unlock(b)
    ev = tree.evict_host(4, now=0.0)
    assert ev.removed == (b, a) and ev.freed.size == 4
    assert tree.evictable_host_tokens() == 0


def test_evict_zero_is_safe_and_does_nothing():
    tree = make_tree(1)
    tree.insert(np.arange(2), np.arange(2), now=1)
    before = tree.dump()
    assert tree.evict_device(0, now=1).freed.size == 0
    assert tree.evict_host(0, now=0.0).freed.size == 0
    assert tree.dump() == before
