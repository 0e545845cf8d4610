"""Property-based stateful test: random operation sequences against the tree and both ledgers.

Every slot carries a model "content": a rolling hash of the token prefix whose KV it would hold. A
match must return slots whose contents are exactly the key's prefixes, so a wrong slot anywhere
(a bad split, a lost adoption, a stale load) shows up. After every step: tree and ledger integrity
(evicted-suffix invariant, page-aligned lengths, one hash per page, distinct first pages, no slot
owned twice), slot conservation (the tree holds exactly the ledgers' held slots), locked nodes still
on the device, protected nodes still present with their host copies.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.components.controller.ledger import SlotLedger
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.radix.results import NodeState
from hicache.radix.tree import RadixTree

DEVICE_PAGES = 12
HOST_PAGES = 24

# A key is a list of page "patterns"; pattern p fills its page with token p. `nick` changes the last
# token of the last page, so a match can also fail inside a page.
pages_st = st.lists(st.integers(0, 3), min_size=1, max_size=5)


def prefix_contents(key: np.ndarray) -> list[int]:
    out, h = [], 0
    for tok in key.tolist():
        h = hash((h, tok))
        out.append(h)
    return out


class TreeMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize(
        strategy=st.sampled_from(["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]),
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    )
    def setup(self, strategy, policy):
        ps = self.page_size
        self.tree = RadixTree(
            page_size=ps, eviction=make_strategy(strategy), write_policy=write_policy(policy)
        )
        self.dev = SlotLedger(size=DEVICE_PAGES * ps, page_size=ps, tier="device")
        self.host = SlotLedger(size=HOST_PAGES * ps, page_size=ps, tier="host")
        self.dev_content: dict[int, int] = {}
        self.host_content: dict[int, int] = {}
        self.ids: list[int] = []
        self.locks: list[int] = []
        self.protected: list[tuple[int, bool]] = []  # (node, had a host copy when protected)
        self.backups: list[int] = []
        self.now = 0.0

    # ------------------------------------------------------------------ helpers

    def key(self, pages, nick):
        ps = self.page_size
        key = np.repeat(np.array(pages, dtype=np.uint32), ps)
        if nick:
            key[-1] = 9
        return key

    def tick(self):
        self.now += 1.0
        return self.now

    def pick(self, i):
        live = [n for n in self.ids if self.tree.state(n) != NodeState.GONE]
        return live[i % len(live)] if live else None

    def free_dev(self, slots):
        for s in slots.tolist():
            self.dev_content.pop(s)
        self.dev.free(slots)

    def free_host(self, slots):
        for s in slots.tolist():
            self.host_content.pop(s)
        self.host.free(slots)

    def evict_dev(self, n):
        ev = self.tree.evict_device(n, now=self.tick())
        self.free_dev(ev.freed)
        self.free_host(ev.freed_host)
        return ev

    def alloc_dev(self, n):
        slots = self.dev.alloc(n)
        if slots is None:
            self.evict_dev(n - self.dev.available)
            slots = self.dev.alloc(n)
        return slots

    def alloc_host(self, n):
        slots = self.host.alloc(n)
        if slots is None:
            self.free_host(self.tree.evict_host(n - self.host.available, now=self.now).freed)
            slots = self.host.alloc(n)
        return slots

    def check_match(self, key, m):
        contents = prefix_contents(key)
        dev = m.device_slots.tolist()
        assert [self.dev_content[s] for s in dev] == contents[: len(dev)]
        host = self.tree.plan_load_back(m.last_node).host_slots.tolist()
        assert len(host) == m.host_len
        assert [self.host_content[s] for s in host] == contents[len(dev) : len(dev) + len(host)]

    # ------------------------------------------------------------------ rules

    @rule(pages=pages_st, nick=st.booleans())
    def match(self, pages, nick):
        key = self.key(pages, nick)
        m = self.tree.match(key, now=self.tick())
        self.check_match(key, m)
        self.ids.append(m.last_node)

    @rule(pages=pages_st, chunked=st.booleans(), priority=st.integers(0, 2), lock=st.booleans())
    def insert(self, pages, chunked, priority, lock):
        key = self.key(pages, False)
        slots = self.alloc_dev(key.size)
        if slots is None:
            return
        for s, c in zip(slots.tolist(), prefix_contents(key)):
            self.dev_content[s] = c
        r = self.tree.insert(key, slots, now=self.tick(), chunked=chunked, priority=priority)
        assert r.duplicate_slots.tolist() == slots[: r.prefix_len].tolist()
        self.free_dev(r.duplicate_slots)
        self.check_match(key, self.tree.match(key, now=self.now))
        self.ids.append(r.last_node)
        self.ids.extend(r.backup_candidates)
        for c in r.backup_candidates:
            assert self.tree.state(c) == NodeState.DEVICE_ONLY
        if lock:
            self.tree.lock(r.last_node)
            self.locks.append(r.last_node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 99))
    def unlock(self, i):
        self.tree.unlock(self.locks.pop(i % len(self.locks)))

    @rule(i=st.integers(0, 999))
    def begin_backup(self, i):
        node = self.pick(i)
        if node is None or self.tree.state(node) != NodeState.DEVICE_ONLY:
            return
        n = self.tree.num_tokens(node)
        host = self.alloc_host(n)
        if host is None:
            return
        for s, d in zip(host.tolist(), self.tree.device_slots(node).tolist()):
            self.host_content[s] = self.dev_content[d]
        self.tree.begin_backup(node, host)
        self.backups.append(node)

    @precondition(lambda self: self.backups)
    @rule(i=st.integers(0, 99), ok=st.booleans())
    def end_backup(self, i, ok):
        node = self.backups.pop(i % len(self.backups))
        freed = self.tree.end_backup(node, ok=ok)
        assert (freed.size == 0) == ok
        self.free_host(freed)

    @rule(n=st.integers(0, DEVICE_PAGES), exclusive=st.booleans())
    def evict_device(self, n, exclusive):
        n *= self.page_size
        ev = self.tree.evict_device(n, now=self.tick(), require_host_copy=exclusive)
        self.free_dev(ev.freed)
        self.free_host(ev.freed_host)
        for node in ev.demoted:  # a demoted node is gone only if its unbacked parent went after it
            assert self.tree.state(node) == NodeState.HOST_ONLY or node in ev.removed
        for node in ev.removed:
            assert self.tree.state(node) == NodeState.GONE
        for node in ev.needs_backup:
            assert self.tree.state(node) == NodeState.DEVICE_ONLY

    @rule(n=st.integers(0, HOST_PAGES))
    def evict_host(self, n):
        self.free_host(self.tree.evict_host(n * self.page_size, now=self.now).freed)

    @rule(i=st.integers(0, 999))
    def protect_host(self, i):
        node = self.pick(i)
        if node is None or self.tree.backup_in_flight(node):
            return
        self.tree.protect_host(node)
        self.protected.append((node, self.tree.host_slots(node) is not None))

    @precondition(lambda self: self.protected)
    @rule(i=st.integers(0, 99))
    def release_host(self, i):
        node, _ = self.protected.pop(i % len(self.protected))
        self.tree.release_host(node)

    @rule(i=st.integers(0, 999), drop_host=st.booleans())
    def load_back(self, i, drop_host):
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
            assert self.tree.state(node) == NodeState.BOTH
            if drop_host:  # exclusive mode, once the load has landed
                self.free_host(self.tree.drop_host(plan))
        self.tree.unlock(node)

    @rule(pages=pages_st)
    def insert_host(self, pages):
        key = self.key(pages, False)
        m = self.tree.match(key, now=self.tick())
        start = m.device_slots.size + m.host_len
        suffix = key[start:]
        if suffix.size == 0:
            return
        host = self.alloc_host(suffix.size)
        if host is None:
            return
        # The host eviction above may have removed part of the matched path: match again.
        m = self.tree.match(key, now=self.now)
        if m.device_slots.size + m.host_len != start:
            self.host.free(host)
            return
        for s, c in zip(host.tolist(), prefix_contents(key)[start:]):
            self.host_content[s] = c
        hashes = [f"p{j}" for j in range(suffix.size // self.page_size)]
        r = self.tree.insert_host(m.last_node, suffix, host, hashes, now=self.now)
        self.free_host(r.duplicate_slots)
        self.ids.append(r.last_node)
        self.check_match(key, self.tree.match(key, now=self.now))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        self.dev.check_integrity()
        self.host.check_integrity()
        dump = self.tree.dump()
        dev_held, host_held = [], []
        for row in dump[1:]:
            d = self.tree.device_slots(row["id"])
            h = self.tree.host_slots(row["id"])
            if d is not None:
                dev_held.extend(d.tolist())
            if h is not None:
                host_held.extend(h.tolist())
        # Conservation: the tree holds exactly what the ledgers count as held, each slot once.
        assert sorted(dev_held) == sorted(self.dev_content) and len(dev_held) == self.dev.used
        assert sorted(host_held) == sorted(self.host_content) and len(host_held) == self.host.used
        assert self.dev.is_held(np.array(dev_held)) and self.host.is_held(np.array(host_held))
        for node in self.locks + self.backups:
            assert self.tree.state(node) in (NodeState.DEVICE_ONLY, NodeState.BOTH)
        for node, had_host in self.protected:
            assert self.tree.state(node) != NodeState.GONE
            if had_host:
                assert self.tree.host_slots(node) is not None
        assert self.tree.evictable_device_tokens() <= self.dev.used


def machine_for(page_size):
    return type(f"TreeMachinePage{page_size}", (TreeMachine,), {"page_size": page_size})


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_tree_stateful(page_size):
    machine = machine_for(page_size)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
