"""The tree controller driven by Hypothesis, with no event loop: random requests (match,
load_back, allocate, compute, cache, release, prefetch) interleaved with random worker
progress (backups, loads, uploads, prefetch reads landing, some failing), against a model of
what every slot holds.

Each slot's content is the token prefix whose KV it would hold (a rolling hash). Workers copy
contents when their op completes (a backup: device -> host, a load: host -> device, an upload:
host -> the L3 dict, a prefetch read: L3 -> host). A request that computes first waits for the
loads its answer named, then checks that every prefix slot holds exactly its own prefix: any
wrong KV handed out fails the test. After every step: both ledgers and the tree are whole, no
call is parked with nothing in flight; at teardown a drain returns every slot and leaves every
table empty.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.components.controller.controller import Controller
from hicache.components.controller.effects import (
    Answer,
    CancelTimer,
    Drained,
    Event,
    Fail,
    Send,
    StartTimer,
    SubmitLoad,
)
from hicache.components.loader.ticket import LoadTicket
from hicache.components.topology import Topology
from hicache.config import CacheConfig
from hicache.kernels.streams.base import AllLoads
from hicache.messages import (
    AllocBatch,
    Backup,
    CacheBatch,
    CacheItem,
    Clear,
    Drain,
    LoadBackBatch,
    LoadDone,
    MatchBatch,
    MatchItem,
    Pin,
    PrefetchBatch,
    PrefetchProgress,
    ReadPrefetch,
    ReleaseBatch,
    StartPrefetch,
    StopPrefetch,
    Unpin,
    Upload,
    UploadDone,
    WriteDone,
)
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.radix.results import NodeState
from hicache.radix.tree import RadixTree
from hicache.results import CacheError, CapacityError, PinLimitError

PAGE = 2


class Reply:
    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.loads: tuple[tuple[int, ...], ...] | None = None

    def set(self, value: Any) -> None:
        assert not self.done, "a reply answered twice"
        self.done, self.value = True, value

    def fail(self, error: BaseException) -> None:
        assert not self.done, "a reply answered twice"
        self.done, self.error = True, error


def contents(tokens: list[int], salt: bytes = b"") -> list[int]:
    """Each token's KV: a rolling hash of the prefix, started from the salt, so that a page
    served to a request under another salt is wrong KV."""
    out, h = [], hash(salt)
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def _named_loads(value: Any) -> tuple[tuple[LoadTicket, ...], ...] | None:
    """The load handles each outcome of an answer carries (None: no outcome names one)."""
    if not isinstance(value, tuple):
        return None
    loads = []
    for outcome in value:
        handle = getattr(outcome, "handle", None)
        pending = getattr(outcome, "pending", ())
        handles = (handle,) if handle is not None else pending
        tickets: list[LoadTicket] = []
        for h in handles:
            tickets.extend(h.handles if isinstance(h, AllLoads) else (h,))
        loads.append(tuple(tickets))
    return tuple(loads) if any(loads) else None


class _Unused:
    """The loader's handle in this harness: nothing waits on it."""


_UNUSED_HANDLE: Any = _Unused()


class ControllerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        # Mostly inclusive and with L3: where a prefetch may need its anchor backed up.
        exclusive=st.sampled_from([False, False, False, True]),
        storage=st.sampled_from([True, True, False]),
        eviction=st.sampled_from(["lru", "lfu", "fifo"]),
        evict_to_storage=st.booleans(),
        # apply through the vectors TP ranks agree on, or what arrived directly (one rank)
        vectors=st.booleans(),
    )
    def setup(
        self,
        policy: str,
        exclusive: bool,
        storage: bool,
        eviction: str,
        evict_to_storage: bool = True,
        vectors: bool = False,
    ) -> None:
        self.vectors = vectors
        cfg, _ = CacheConfig(
            kv="mha:1:1:1:float16",
            page_size=PAGE,
            device_tokens=12 * PAGE,
            host_tokens=24 * PAGE,
            write_policy=policy,
            exclusive=exclusive,
            eviction=eviction,
            load_back_threshold=1,
            prefetch_threshold=PAGE,
            prefetch_rate_fraction=1.0,
            channel_capacity=16,
            storage="memory" if storage else None,
            model_id="m",
            evict_to_storage=evict_to_storage,
        ).resolve()
        tree = RadixTree(
            page_size=PAGE,
            eviction=make_strategy(cfg.eviction),
            write_policy=write_policy(cfg.write_policy),
        )
        self.core = Controller(
            config=cfg,
            tree=tree,
            bytes_per_token=1,
            credits=Topology.for_capacity(16).credits,
            storage_on=storage,
        )
        self.core.tiers.lease_host(0, cfg.host_capacity)  # the allocator's part
        self.tree = tree
        self.now = 0.0
        self.device: dict[int, int] = {}  # slot -> content
        self.host: dict[int, int] = {}
        self.l3: dict[str, tuple[int, ...]] = {}  # page hash -> contents
        self.queues: dict[str, deque[Any]] = {
            w: deque() for w in ("writer", "loader", "uploader", "prefetcher")
        }
        self.prefetch_state: dict[int, dict[str, Any]] = {}
        self.failed_loads: set[int] = set()
        self.landed: set[int] = set()
        self.requests: dict[int, dict[str, Any]] = {}
        self.next_rid = 0
        self.timers: set[int] = set()
        self.drained: Drained | None = None
        self.seen: list[tuple[list[int], bytes]] = []  # the pages and salt of every request

    # ------------------------------------------------------------------ driving
    def execute(self, effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.queues[e.to].append(e.msg)
            elif isinstance(e, SubmitLoad):
                self.queues["loader"].append(e)
                e.ticket.bind(_UNUSED_HANDLE)  # the driver binds the loader's handle
            elif isinstance(e, Answer):
                loads = _named_loads(e.value)
                for ops in loads or ():  # the loads' handles are in the answer, bound
                    assert all(t.bound for t in ops), f"answer names unsubmitted loads {ops}"
                e.reply.set(e.value)
                e.reply.loads = (
                    tuple(tuple(t.op for t in ops) for ops in loads) if loads is not None else None
                )
            elif isinstance(e, Fail):
                e.reply.fail(e.error)
            elif isinstance(e, StartTimer):
                self.timers.add(e.op)
            elif isinstance(e, CancelTimer):
                self.timers.remove(e.op)
            elif isinstance(e, Drained):
                self.drained = e
                for reply in e.replies:
                    reply.set(e.tables)
            else:
                assert isinstance(e, Event), e

    def pump(self) -> None:
        while self.core.ready() is not None:
            self.now += 1
            self.execute(self.core.run(self.now))

    def call(self, make: Any) -> Reply:
        reply = Reply()
        self.core.accept(make(reply))
        self.pump()
        while not reply.done:  # parked: loads land meanwhile; the oldest write or upload ends
            landed = self.step_worker("loader")
            assert landed or self.step_worker("writer") or self.step_worker("uploader"), (
                "a call is parked with nothing in flight"
            )
        return reply

    def complete(self, msg: Any) -> None:
        self.core.record(msg)
        self.now += 1
        if self.vectors:
            seen = self.core.progress()
            self.execute(self.core.apply(seen, seen.mins, seen.maxes, self.now))
        else:
            self.execute(self.core.apply_arrived(self.now))
        self.pump()

    def step_worker(self, worker: str, ok: bool = True) -> bool:
        queue = self.queues[worker]
        if not queue:
            return False
        cmd = queue.popleft()
        if isinstance(cmd, Backup):
            if ok:
                for d, h in zip(cmd.device_slots.tolist(), cmd.host_slots.tolist(), strict=True):
                    self.host[h] = self.device[d]
            self.complete(WriteDone(ops=(cmd.op,), ok=ok))
        elif isinstance(cmd, SubmitLoad):
            if ok:
                for h, d in zip(cmd.host_slots.tolist(), cmd.device_slots.tolist(), strict=True):
                    self.device[d] = self.host[h]
                self.landed.add(cmd.op)
            else:
                self.failed_loads.add(cmd.op)
            self.complete(LoadDone(op=cmd.op, ok=ok))
        elif isinstance(cmd, Upload):  # a failed one stores nothing
            slots = cmd.host_slots.tolist()
            for i, h in enumerate(cmd.hashes if ok else ()):
                self.l3[h] = tuple(self.host[s] for s in slots[i * PAGE : (i + 1) * PAGE])
            self.complete(UploadDone(op=cmd.op, stored_pages=len(cmd.hashes) if ok else 0))
        else:
            self.step_prefetcher(cmd)
        return True

    def step_prefetcher(self, cmd: Any) -> None:
        st_ = self.prefetch_state.setdefault(cmd.op, {"hit": -1, "done": 0, "over": False})
        if st_["over"]:
            return
        if isinstance(cmd, StartPrefetch):
            hit = 0
            while hit < len(cmd.hashes) and cmd.hashes[hit] in self.l3:
                hit += 1
            st_["hit"], st_["hashes"] = hit, cmd.hashes
            self.complete(PrefetchProgress(op=cmd.op, hit_pages=hit, done_pages=0, finished=False))
        elif isinstance(cmd, ReadPrefetch):
            slots = cmd.host_slots.tolist()
            for i in range(st_["hit"]):
                for j, c in enumerate(self.l3[st_["hashes"][i]]):
                    self.host[slots[i * PAGE + j]] = c
            st_["done"], st_["over"] = st_["hit"], True
            self.complete(
                PrefetchProgress(
                    op=cmd.op, hit_pages=st_["hit"], done_pages=st_["hit"], finished=True
                )
            )
        else:
            assert isinstance(cmd, StopPrefetch)
            st_["over"] = True
            self.complete(
                PrefetchProgress(
                    op=cmd.op,
                    hit_pages=max(st_["hit"], 0),
                    done_pages=st_["done"],
                    finished=True,
                    stopped=True,
                )
            )

    # ------------------------------------------------------------------ requests
    def rid_of(self, i: int) -> int | None:
        return sorted(self.requests)[i % len(self.requests)] if self.requests else None

    @rule(
        pages=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        extra=st.integers(0, 1),
        load=st.booleans(),
        prefetch=st.booleans(),
        salt=st.sampled_from([b"", b"", b"tenant-a", b"tenant-b"]),
        keep=st.one_of(
            st.none(),
            st.tuples(
                st.integers(0, 3),
                st.integers(1, 4),
                st.integers(0, 100),
                st.sampled_from([1.0, 5.0, float("inf")]),
            ),
        ),
    )
    def new_request(
        self,
        pages: list[int],
        extra: int,
        load: bool,
        prefetch: bool,
        salt: bytes,
        keep: tuple[int, int, int, float] | None,
    ) -> None:
        tokens = [p for p in pages for _ in range(PAGE)] + [7] * extra
        self.seen.append((pages, salt))
        rid = self.next_rid
        self.next_rid += 1
        arr = np.array(tokens, dtype=np.uint32)
        retention = ()
        if keep is not None:  # a range of pages [start, start + length) with a priority
            start, length, priority, duration = keep
            retention = ((start * PAGE, (start + length) * PAGE, priority, duration),)
        item = MatchItem(rid=rid, tokens=arr, salt=salt, retention=retention)
        reply = self.call(lambda r: MatchBatch(items=(item,), reply=r))
        (out,) = reply.value
        req = {"tokens": tokens, "prefix": out.device_slots, "waits": set(), "salt": salt}
        req["waits"] |= set(reply.loads[0]) if reply.loads else set()
        self.requests[rid] = req
        if prefetch:
            self.call(lambda r: PrefetchBatch(items=(item,), reply=r))
        if load:
            reply = self.call(lambda r: LoadBackBatch(rids=(rid,), reply=r))
            (lb,) = reply.value
            req["prefix"] = lb.device_slots
            req["waits"] |= set(reply.loads[0]) if reply.loads else set()

    @precondition(lambda self: self.seen)
    @rule(
        i=st.integers(0, 20),
        more=st.lists(st.integers(0, 2), max_size=2),
        wait=st.booleans(),
    )
    def next_turn(self, i: int, more: list[int], wait: bool) -> None:
        """A conversation comes back: an earlier request's pages, maybe extended, prefetched
        (with `wait`, every prefetch probes and reads first, then it loads back). Its prefix
        may be only on L1 by now and the rest only in L3: the anchor is backed up on demand,
        racing what the other rules do meanwhile (evictions, releases, failed uploads)."""
        pages, salt = self.seen[-1 - i % len(self.seen)]
        self.new_request(pages + more, 0, False, True, salt, None)
        if not wait:
            return
        while self.step_worker("prefetcher"):
            pass
        rid = self.next_rid - 1
        reply = self.call(lambda r: LoadBackBatch(rids=(rid,), reply=r))
        (lb,) = reply.value
        req = self.requests[rid]
        req["prefix"] = lb.device_slots
        req["waits"] |= set(reply.loads[0]) if reply.loads else set()

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 20))
    def compute_and_cache(self, i: int) -> None:
        rid = self.rid_of(i)
        req = self.requests[rid]
        tokens = req["tokens"]
        while req["waits"] - self.landed - self.failed_loads:  # wait for its loads to land
            assert self.step_worker("loader")
        if req["waits"] & self.failed_loads:
            reply = self.call(
                lambda r: CacheBatch(
                    items=(
                        CacheItem(
                            rid=rid,
                            tokens=np.array(tokens, dtype=np.uint32),
                            device_slots=np.arange(len(tokens)),
                            finished=True,
                            salt=req["salt"],
                        ),
                    ),
                    reply=r,
                )
            )
            assert isinstance(reply.error, CacheError)
            self.release(rid)
            return
        prefix = req["prefix"]
        want = contents(tokens, req["salt"])
        got = [self.device.get(s) for s in prefix.tolist()]
        assert got == want[: len(prefix)], f"request {rid} read wrong KV"
        n = len(tokens) - len(prefix)
        reply = self.call(lambda r: AllocBatch(sizes=((rid, n),), reply=r))
        if isinstance(reply.error, CapacityError):
            self.release(rid)
            return
        assert reply.error is None, reply.error
        (slots,) = reply.value
        for s, c in zip(slots.tolist(), want[len(prefix) :], strict=True):
            self.device[s] = c  # the model computes the request's new KV
        all_slots = np.concatenate([prefix, slots])
        reply = self.call(
            lambda r: CacheBatch(
                items=(
                    CacheItem(
                        rid=rid,
                        tokens=np.array(tokens, dtype=np.uint32),
                        device_slots=all_slots,
                        finished=True,
                        salt=req["salt"],
                    ),
                ),
                reply=r,
            )
        )
        assert reply.error is None, reply.error
        del self.requests[rid]

    def release(self, rid: int) -> None:
        reply = self.call(lambda r: ReleaseBatch(rids=(rid,), reply=r))
        assert reply.error is None
        del self.requests[rid]

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 20))
    def release_one(self, i: int) -> None:
        rid = self.rid_of(i)
        assert rid is not None
        self.release(rid)

    @precondition(lambda self: len(self.requests) >= 2)
    @rule(i=st.integers(0, 20), n=st.integers(2, 3))
    def load_back_many(self, i: int, n: int) -> None:
        """One step's load-backs in one batch: the batch may park on an eviction mid-way, and
        the loads it started before must still be named in its answer with their handles."""
        rids = sorted(self.requests)
        chosen = list(dict.fromkeys(rids[(i + k) % len(rids)] for k in range(n)))
        reply = self.call(lambda r: LoadBackBatch(rids=tuple(chosen), reply=r))
        assert reply.error is None, reply.error
        for k, (rid, lb) in enumerate(zip(chosen, reply.value, strict=True)):
            req = self.requests[rid]
            req["prefix"] = lb.device_slots
            req["waits"] |= set(reply.loads[k]) if reply.loads else set()

    # ------------------------------------------------------------------ pins
    @rule(
        pages=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        tiers=st.sampled_from([("device",), ("host",), ("device", "host")]),
        ttl=st.sampled_from([None, 3.0, 20.0]),
        salt=st.sampled_from([b"", b"tenant-a"]),
    )
    def pin(self, pages: list[int], tiers: tuple[str, ...], ttl: float | None, salt: bytes) -> None:
        tokens = np.array([p for p in pages for _ in range(PAGE)], dtype=np.uint32)
        reply = self.call(lambda r: Pin(tokens=tokens, salt=salt, tiers=tiers, ttl=ttl, reply=r))
        assert reply.error is None or isinstance(reply.error, PinLimitError), reply.error

    @rule(pages=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def unpin(self, pages: list[int]) -> None:
        tokens = np.array([p for p in pages for _ in range(PAGE)], dtype=np.uint32)
        reply = self.call(lambda r: Unpin(tokens=tokens, salt=b"", reply=r))
        assert reply.error is None and isinstance(reply.value, bool)

    @rule(tiers=st.sampled_from([("host",), ("device",)]))
    def clear(self, tiers: tuple[str, ...]) -> None:
        """Let every worker finish, then drop a tier's unlocked pages. Clearing L2 leaves
        prefixes only on L1 above pages only in L3: a prefetch below them backs its anchor up."""
        while any(self.step_worker(w) for w in self.queues):
            pass
        reply = self.call(lambda r: Clear(tiers=tiers, reply=r, poll=True))
        assert reply.error is None and reply.value is not None, reply.error

    # ------------------------------------------------------------------ workers
    @rule(
        worker=st.sampled_from(["writer", "loader", "uploader", "prefetcher"]),
        ok=st.sampled_from([True, True, True, False]),
    )
    def worker_step(self, worker: str, ok: bool) -> None:
        self.step_worker(worker, ok=ok or worker == "prefetcher")

    # ------------------------------------------------------------------ checks
    @invariant()
    def whole(self) -> None:
        if not hasattr(self, "core"):
            return
        self.tree.check_integrity()
        for led in self.core.tiers.ledgers.values():
            led.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for rid in list(self.requests):
            self.release(rid)
        reply = Reply()
        self.core.accept(Drain(reply=reply))
        self.pump()
        for _ in range(10_000):
            if reply.done:
                break
            assert any(self.step_worker(w) for w in self.queues), "drain waits on nothing"
        assert reply.done and self.drained is not None
        assert not any(reply.value.values()), reply.value
        for tier, led in self.core.tiers.ledgers.items():
            assert led.used == 0 and led.size == led.capacity, f"{tier} slots leaked"
        assert not self.timers


ControllerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
TestController = ControllerMachine.TestCase


def run_steps(steps: list[tuple[str, dict[str, Any]]]) -> None:
    m = ControllerMachine()
    m.setup(policy="write_through", exclusive=False, storage=False, eviction="lru")
    defaults = dict(extra=0, keep=None, load=False, prefetch=False, salt=b"")
    for name, args in steps:
        if name == "new_request":
            m.new_request(**{**defaults, **args})
        elif name in ("compute_and_cache", "release_one"):
            getattr(m, name)(i=0)
        else:
            getattr(m, name)(**args)
        m.whole()
    m.teardown()


def test_no_load_lands_below_a_load_still_in_flight():
    """Found by this machine at 1,500 examples: a load fills [2]; another request's load-back
    of [2, 0] would put [0] on L1 below it; the first load fails and [2] cannot go back to L2
    under a device child: the next match of [2] would read KV that never arrived. Load-backs
    below a load in flight are skipped (the request computes that stretch)."""
    cache, finish = ("compute_and_cache", {}), ("release_one", {})
    run_steps([
        ("new_request", dict(pages=[2, 0, 0, 0, 0, 0])), cache,
        ("new_request", dict(pages=[0])), cache,
        ("new_request", dict(pages=[0] * 6, salt=b"tenant-a")), cache,
        ("new_request", dict(pages=[2], load=True)), finish,  # load of [2] in flight
        ("new_request", dict(pages=[0])),
        ("new_request", dict(pages=[0])),
        ("new_request", dict(pages=[2, 0], load=True)),  # would load [0] below it
        cache, cache,
        ("worker_step", dict(worker="loader", ok=False)),  # the load of [2] fails
        cache,
        ("new_request", dict(pages=[2])), cache,  # reads [2]: must be right
    ])  # fmt: skip


def test_a_failed_load_reverts_the_pieces_a_later_match_split_off():
    """Found by this machine at 1,500 examples: a load in flight fills one node; a later match
    splits it (the upper piece is a new node); the load fails. Every piece must go back to
    L2 only, or the next match is handed device slots the load never filled."""
    run_steps([
        ("new_request", dict(pages=[0])), ("compute_and_cache", {}),
        ("new_request", dict(pages=[0] * 6)), ("compute_and_cache", {}),
        ("new_request", dict(pages=[2, 0])), ("compute_and_cache", {}),
        ("new_request", dict(pages=[0, 0])), ("compute_and_cache", {}),
        ("worker_step", dict(worker="writer", ok=True)),
        ("worker_step", dict(worker="writer", ok=True)),
        ("worker_step", dict(worker="writer", ok=True)),
        ("new_request", dict(pages=[0] * 5, salt=b"tenant-a")), ("compute_and_cache", {}),
        ("new_request", dict(pages=[2, 0], load=True)),  # L2 -> L1 load of node [2, 0]
        ("release_one", {}),
        ("new_request", dict(pages=[2])),  # splits that node: [2] | [0]
        ("release_one", {}),
        ("worker_step", dict(worker="loader", ok=False)),  # the load fails
        ("new_request", dict(pages=[2])), ("compute_and_cache", {}),  # reads [2]: must be right
    ])  # fmt: skip


# ---------------------------------------------------------------------- anchors backed up on demand
def _anchor_only_on_l1(policy: str = "write_back") -> tuple[ControllerMachine, dict[str, Any]]:
    """A machine with L3 whose prefix [0, 0] is only on L1 (no L2 copy: the policy never made
    one) while the pages after it, [1, 1, 1, 1], are only in L3; then a request for
    [0, 0, 1, 1, 1, 1] is matched (on [0, 0]) and prefetches the rest. Its op is started,
    not yet probed."""
    m = ControllerMachine()
    m.setup(policy=policy, exclusive=False, storage=True, eviction="lru")
    request = dict(extra=0, keep=None, load=False, prefetch=False, salt=b"")

    def cached(pages: list[int]) -> None:
        m.new_request(**{**request, "pages": pages})
        m.compute_and_cache(i=0)
        while m.step_worker("writer") or m.step_worker("uploader"):
            pass

    cached([0, 0, 1, 1, 1, 1])
    for pages in ([1, 2, 1, 2, 1, 2], [2, 2, 2, 2, 2, 2], [2, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 2]):
        cached(pages)  # L1 evicts [0, 0, 1, 1, 1, 1]'s tail through L2 into L3
    for pages in ([1, 2, 1, 2, 2, 2], [2, 2, 1, 2, 2, 2], [2, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 2]):
        cached(pages)  # and L2 drops it
    cached([0, 0])  # [0, 0] stays hot on L1
    m.new_request(**{**request, "pages": [0, 0, 1, 1, 1, 1], "prefetch": True})
    m.whole()
    ops = m.core.prefetches.ops
    assert len(ops) == 1, "the prefetch did not start"
    (op,) = ops.values()
    assert not m.tree.has_host_copy(op.anchor) and m.tree.num_tokens(op.anchor) == 2 * PAGE
    return m, {**request, "pages": [0, 0, 1, 1, 1, 1]}


def _pressure(m: ControllerMachine) -> None:
    """Two requests of other pages, cached: L1 evicts (under write_back, backing up first)."""
    for pages in ([2, 2, 0, 2, 2, 0], [1, 0, 2, 0, 1, 0]):
        m.new_request(pages=pages, extra=0, load=False, prefetch=False, salt=b"", keep=None)
        m.compute_and_cache(i=len(m.requests) - 1)
        m.whole()


def _read_back(m: ControllerMachine, request: dict[str, Any]) -> None:
    """Run every worker out, finish what is open, read the prefetched request again (its
    prefix's KV is checked against what it must be) and drain (every slot back)."""
    while any(m.step_worker(w) for w in m.queues):
        m.whole()
    while m.requests:
        m.compute_and_cache(i=0)
    m.new_request(**{**request, "load": True})
    m.compute_and_cache(i=0)
    m.whole()
    m.teardown()


def _step(m: ControllerMachine, worker: str, ok: bool = True) -> None:
    assert m.step_worker(worker, ok=ok), f"nothing for the {worker}"
    m.whole()


def test_a_prefetch_below_an_anchor_only_on_l1_backs_the_anchor_up():
    m, request = _anchor_only_on_l1()
    (op,) = m.core.prefetches.ops.values()
    _step(m, "prefetcher")  # the probe: the 4 pages are in L3
    assert m.core.counters.anchor_backups == 1 and m.tree.backup_in_flight(op.anchor)
    _step(m, "writer")
    assert m.tree.has_host_copy(op.anchor)
    _step(m, "prefetcher")  # the read lands below it
    assert m.core.counters.storage_hit_tokens == 4 * PAGE
    _read_back(m, request)


@pytest.mark.parametrize(
    "race",
    ["evicted_before_probe", "evicted_during_backup", "released", "backup_failed", "upload_failed"],
)
def test_an_anchor_backed_up_on_demand_races(race: str):
    """The on-demand anchor backup against what may happen meanwhile: L1 evicts the anchor
    (before the probe: its eviction backs it up first; during its backup: it waits, locked),
    the request is released mid-prefetch, the backup fails, its upload fails. Whatever the
    order, the tree stays whole and every page read back holds its own KV."""
    m, request = _anchor_only_on_l1()
    rid = next(iter(m.requests))
    (op,) = m.core.prefetches.ops.values()
    if race in ("evicted_before_probe", "released", "evicted_during_backup"):
        m.release(rid)  # its lock goes: only the prefetch holds the anchor now
    if race == "evicted_before_probe":
        _pressure(m)  # its eviction backs it up first (L3 is on), then demotes it
        assert m.tree.state(op.anchor) is NodeState.HOST_ONLY
    _step(m, "prefetcher")  # the probe
    backups = [c for c in m.queues["writer"] if isinstance(c, Backup)]
    on_demand = 0 if race == "evicted_before_probe" else 1
    assert m.core.counters.anchor_backups == on_demand and len(backups) == on_demand
    if race == "evicted_during_backup":
        _pressure(m)  # parks on the backup (the anchor is locked by it), then evicts it
        assert m.tree.state(op.anchor) is NodeState.HOST_ONLY
    if race == "backup_failed":
        while m.queues["writer"]:
            _step(m, "writer", ok=False)
        _pressure(m)
    if race == "upload_failed":
        while m.queues["writer"]:
            _step(m, "writer")
        while m.queues["uploader"]:
            _step(m, "uploader", ok=False)
    _read_back(m, request)
