"""Load-back plans and commits, exclusive mode, prefetch inserts (insert_host), hashes and dump."""

import numpy as np
import pytest

from hicache.radix.results import NodeState, TreeError
from tests.unit.radix.tree_helpers import SlotSource, make_tree


def host_only_path(tree, src, *lengths):
    ids, total = [], 0
    for n in lengths:
        total += n
        node = tree.insert(np.arange(total), src.take(total), now=total).last_node
        tree.begin_backup(node, src.take(n) + 10_000)
        tree.end_backup(node, ok=True)
        ids.append(node)
    tree.evict_device(total, now=100)
    return ids


def test_plan_covers_host_only_nodes_root_first_and_commit_makes_them_both():
    tree = make_tree(2)
    src = SlotSource()
    a, b = host_only_path(tree, src, 2, 4)
    tree.lock(b)
    plan = tree.plan_load_back(b)
    assert plan.nodes == (a, b) and plan.num_tokens == 6
    assert plan.host_slots.tolist() == tree.host_slots(a).tolist() + tree.host_slots(b).tolist()
    tree.commit_load_back(plan, np.arange(500, 506))
    assert tree.state(a) == tree.state(b) == NodeState.BOTH
    assert tree.match(np.arange(6), now=200).device_slots.tolist() == list(range(500, 506))
    tree.unlock(b)
    tree.check_integrity()


def test_plan_of_a_device_node_is_empty():
    tree = make_tree(1)
    leaf = tree.insert(np.arange(2), np.arange(2), now=0).last_node
    plan = tree.plan_load_back(leaf)
    assert plan.nodes == () and plan.num_tokens == 0
    tree.commit_load_back(plan, np.arange(0))
    assert tree.state(leaf) == NodeState.DEVICE_ONLY


def test_commit_tolerates_a_split_since_planning():
    tree = make_tree(1)
    src = SlotSource()
    (a,) = host_only_path(tree, src, 6)
    plan = tree.plan_load_back(a)
    upper = tree.match(np.arange(2), now=300).last_node  # splits the planned node
    tree.commit_load_back(plan, np.arange(50, 56))
    assert tree.device_slots(upper).tolist() == [50, 51] and tree.device_slots(a).tolist() == [
        52,
        53,
        54,
        55,
    ]
    tree.check_integrity()


def test_stale_plan_raises_and_changes_nothing():
    tree = make_tree(1)
    src = SlotSource()
    _a, b = host_only_path(tree, src, 2, 2)
    plan = tree.plan_load_back(b)
    tree.insert(np.arange(2), np.arange(900, 902), now=300)  # recomputed: a is on the device again
    before = tree.dump()
    with pytest.raises(TreeError, match="stale plan"):
        tree.commit_load_back(plan, np.arange(50, 54))
    with pytest.raises(TreeError, match="expected 2 slots"):
        tree.commit_load_back(tree.plan_load_back(b), np.arange(3))
    assert tree.dump() == before


def test_drop_host_after_a_load_returns_host_slots_and_leaves_device_only():
    tree = make_tree(1)
    src = SlotSource()
    (a,) = host_only_path(tree, src, 3)
    host = tree.host_slots(a).tolist()
    plan = tree.plan_load_back(a)
    tree.commit_load_back(plan, np.arange(40, 43))
    assert tree.drop_host(plan).tolist() == host
    assert tree.state(a) == NodeState.DEVICE_ONLY
    tree.check_integrity()


def test_drop_host_keeps_protected_nodes():
    tree = make_tree(1)
    src = SlotSource()
    (a,) = host_only_path(tree, src, 3)
    tree.protect_host(a)
    plan = tree.plan_load_back(a)
    tree.commit_load_back(plan, np.arange(3))
    assert tree.drop_host(plan).size == 0
    assert tree.state(a) == NodeState.BOTH
    tree.check_integrity()


def test_insert_host_hangs_host_only_pages_with_hashes_and_reports_duplicates():
    tree = make_tree(2)
    base = tree.insert(np.arange(4), np.arange(4), now=0).last_node
    r = tree.insert_host(base, np.arange(4, 8), np.arange(100, 104), ["h2", "h3"], now=1)
    assert r.matched_len == 0 and tree.state(r.last_node) == NodeState.HOST_ONLY
    assert tree.page_hashes(r.last_node) == ("h2", "h3")
    m = tree.match(np.arange(8), now=2)
    assert (
        m.device_slots.tolist() == [0, 1, 2, 3] and m.host_len == 4 and m.last_node == r.last_node
    )
    r2 = tree.insert_host(base, np.arange(4, 10), np.arange(200, 206), ["h2", "h3", "h4"], now=3)
    assert r2.matched_len == 4 and r2.duplicate_slots.tolist() == [200, 201, 202, 203]
    assert tree.page_hashes(r2.last_node) == ("h4",) and tree.parent(r2.last_node) == r.last_node
    tree.check_integrity()


def test_insert_host_validates_before_changing_anything():
    tree = make_tree(2)
    before = tree.dump()
    with pytest.raises(TreeError, match="page hashes"):
        tree.insert_host(tree.root, np.arange(4), np.arange(4), ["h"], now=0)
    with pytest.raises(TreeError, match="multiple of page_size"):
        tree.insert_host(tree.root, np.arange(3), np.arange(3), ["h"], now=0)
    with pytest.raises(TreeError, match="not a node"):
        tree.insert_host(7, np.arange(2), np.arange(2), ["h"], now=0)
    assert tree.dump() == before


def test_set_page_hashes_needs_one_per_page():
    tree = make_tree(2)
    leaf = tree.insert(np.arange(4), np.arange(4), now=0).last_node
    with pytest.raises(TreeError, match="3 hashes for 2 pages"):
        tree.set_page_hashes(leaf, ["a", "b", "c"])
    tree.set_page_hashes(leaf, ["a", "b"])
    assert tree.page_hashes(leaf) == ("a", "b")


def test_dump_is_plain_and_deterministic():
    def build():
        tree = make_tree(1)
        src = SlotSource()
        tree.insert(np.arange(4), src.take(4), now=1)
        tree.insert(np.r_[np.arange(2), [9]], src.take(3), now=2)
        return tree.dump()

    d = build()
    assert d == build()
    assert [row["id"] for row in d] == sorted(row["id"] for row in d)
    assert d[0]["state"] == "root" and {row["state"] for row in d[1:]} == {"device_only"}
    assert all(type(v) in (int, float, str, bool, type(None)) for row in d for v in row.values())
