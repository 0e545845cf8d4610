"""RadixTree.observer: every page entering or leaving L1 or L2 is reported, once, and what the
reports add up to is the tree's own state after every step of the stateful machine.

Pages are named by the whole token prefix they end (not by node id or hash), so splits,
which move no page, cannot hide a missed or doubled report.
"""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from hicache.radix.results import NodeState
from tests.unit.radix.test_tree_stateful import SETTINGS, TreeMachine
from tests.unit.radix.tree_helpers import SlotSource, make_tree, toks


class PageRecorder:
    """A TreeObserver that keeps, per tier, the set of pages the reports say it holds."""

    def __init__(self, tree):
        self.tree = tree
        self.held = {"device": set(), "host": set()}
        self.calls = []

    def pages(self, node):
        parts, x = [], node
        while x is not None and x != self.tree.root:
            parts.append(np.asarray(self.tree.key(x)).tolist())
            x = self.tree.parent(x)
        path = [t for part in reversed(parts) for t in part]
        ps, own = self.tree.page_size, self.tree.num_tokens(node)
        return {tuple(path[:end]) for end in range(len(path) - own + ps, len(path) + 1, ps)}

    def node_gained(self, node, tier, how):
        pages = self.pages(node)
        assert not pages & self.held[tier], f"node {node} gained {tier} pages it already had"
        self.held[tier] |= pages
        self.calls.append(("gained", node, tier, how))

    def node_lost(self, node, tier):
        pages = self.pages(node)
        assert pages <= self.held[tier], f"node {node} lost {tier} pages never reported"
        self.held[tier] -= pages
        self.calls.append(("lost", node, tier))

    def tree_cleared(self):
        self.held = {"device": set(), "host": set()}
        self.calls.append(("cleared",))

    def expected(self):
        """Per tier, the pages the tree holds: device copies; complete host copies."""
        out = {"device": set(), "host": set()}
        for row in self.tree.dump()[1:]:
            if self.tree.device_slots(row["id"]) is not None:
                out["device"] |= self.pages(row["id"])
            if self.tree.host_slots(row["id"]) is not None and not row["backup_in_flight"]:
                out["host"] |= self.pages(row["id"])
        return out


class ObservedMachine(TreeMachine):
    @initialize(
        strategy=st.sampled_from(["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]),
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    )
    def setup(self, strategy, policy):
        super().setup(strategy, policy)
        self.recorder = PageRecorder(self.tree)
        self.tree.observer = self.recorder

    @precondition(lambda self: not self.locks and not self.protected and not self.backups)
    @rule()
    def clear(self):
        cleared = self.tree.clear()
        self.free_dev(cleared.device)
        self.free_host(cleared.host)
        assert self.recorder.calls[-1] == ("cleared",)

    @rule(i=st.integers(0, 999))
    def failed_load_back(self, i):
        """A load committed, then reverted (its copy failed)."""
        node = self.pick(i)
        if node is None or self.tree.state(node) != NodeState.HOST_ONLY:
            return
        self.tree.lock(node)
        plan = self.tree.plan_load_back(node)
        slots = self.alloc_dev(plan.num_tokens)
        if slots is not None:
            for s, h in zip(slots.tolist(), plan.host_slots.tolist()):
                self.dev_content[s] = self.host_content[h]
            self.tree.commit_load_back(plan, slots)
            freed, _kept = self.tree.revert_load_back(plan)
            self.free_dev(freed)
        self.tree.unlock(node)

    @rule(i=st.integers(0, 999))
    def discard_device(self, i):
        """Exclusive mode's drop of an L1 victim older than all of L2."""
        node = self.pick(i)
        if (
            node is None
            or self.tree.state(node) != NodeState.DEVICE_ONLY
            or self.tree.lock_ref(node)
            or self.tree.backup_in_flight(node)
            or any(
                self.tree.parent(r["id"]) == node and r["state"] != "host_only"
                for r in self.tree.dump()[1:]
            )
        ):
            return
        ev = self.tree.discard_device(node)
        self.free_dev(ev.freed)
        self.free_host(ev.freed_host)

    @invariant()
    def reports_add_up(self):
        if hasattr(self, "recorder"):
            assert self.recorder.held == self.recorder.expected()


@pytest.mark.parametrize("page_size", [1, 4])
def test_observer_reports_add_up_to_the_tree(page_size):
    machine = type(f"ObservedMachinePage{page_size}", (ObservedMachine,), {"page_size": page_size})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


def test_observer_calls_name_the_transition():
    tree = make_tree(page_size=2, policy="write_through")
    rec = PageRecorder(tree)
    tree.observer = rec
    dev, host = SlotSource(), SlotSource(1000)
    r = tree.insert(toks(1, 2, 3, 4), dev.take(4), now=1.0)
    assert rec.calls == [("gained", r.last_node, "device", "insert")]
    tree.begin_backup(r.last_node, host.take(4))
    assert len(rec.calls) == 1  # a host copy being written is not reported
    tree.end_backup(r.last_node, ok=True)
    assert rec.calls[-1] == ("gained", r.last_node, "host", "backup")
    ev = tree.evict_device(4, now=2.0)
    assert ev.demoted == (r.last_node,) and rec.calls[-1] == ("lost", r.last_node, "device")
    tree.lock(r.last_node)
    plan = tree.plan_load_back(r.last_node)
    tree.commit_load_back(plan, dev.take(4))
    assert rec.calls[-1] == ("gained", r.last_node, "device", "load_back")
    tree.drop_host(plan)
    assert rec.calls[-1] == ("lost", r.last_node, "host")
    tree.unlock(r.last_node)
    leaf = tree.insert_host(r.last_node, toks(5, 6), host.take(2), ["a" * 64], now=3.0).last_node
    assert rec.calls[-1] == ("gained", leaf, "host", "insert_host")
    # A failed backup reports nothing; an L1 eviction without host copy removes the node
    # (and the host-only leaf below it) after reporting what each held.
    tree.begin_backup(r.last_node, host.take(4))
    n = len(rec.calls)
    tree.end_backup(r.last_node, ok=False)
    assert len(rec.calls) == n
    tree.evict_device(4, now=4.0)
    assert rec.calls[n:] == [("lost", r.last_node, "device"), ("lost", leaf, "host")]
    assert rec.held == rec.expected() == {"device": set(), "host": set()}
    tree.insert(toks(7, 8), dev.take(2), now=5.0)
    tree.clear()
    assert rec.calls[-1] == ("cleared",) and rec.held == {"device": set(), "host": set()}
