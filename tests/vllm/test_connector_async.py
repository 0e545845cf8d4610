"""The connector's asynchronous loads, prefetch policies, write-back and layer-wise loads,
without vLLM (these run in the main environment too): the scheduler half's decisions and the
worker half's loads over fake KV tensors, a real file store, or a store that never answers."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_connector_units import BS, H, _Blocks, _load, _meta, _Req, _sched_output, _worker

from hicache.integrations.vllm import (
    ConnectorOptions,
    Geometry,
    HiCacheWorkerMetadata,
    LoadPlan,
    SchedulerSide,
    WorkerSide,
)

# ------------------------------------------------------------------------- scheduler half


class _L3:
    """The scheduler's view of L3: `exists` counts the leading pages it holds."""

    def __init__(self, pages: set[str]) -> None:
        self.pages = pages
        self.namespace = SimpleNamespace(writes=True)

    def exists(self, hashes: list[str]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.pages:
            n += 1
        return n


def _sched(slots: int, l3: set[str] | None = None, **options) -> SchedulerSide:
    geo = Geometry(BS, ("l0",), 1024, "mha:1:1:64:float32", "t")
    storage = _L3(l3) if l3 is not None else None
    return SchedulerSide(ConnectorOptions(**options), geo, slots, storage, tp_size=2)  # type: ignore[arg-type]


def _hashes_of(s: SchedulerSide, req: _Req, pages: int) -> list[str]:
    st = s._state(req)
    return s._hashes(st, pages)


def test_an_l3_hit_is_asynchronous_and_holds_its_pages_until_it_ends():
    tokens = list(range(3 * BS + 1))
    probe = _sched(8)
    l3 = set(_hashes_of(probe, _Req("x", tokens), 3))
    s = _sched(3, l3)
    a = _Req("a", tokens)
    assert s.get_num_new_matched_tokens(a, 0) == (3 * BS, True)
    s.update_state_after_alloc(a, _Blocks([0, 1, 2, 3]), 3 * BS)
    meta = s.build_meta(_sched_output([]))  # a waits for its KV: not scheduled
    (plan,) = meta.loads
    assert (
        plan.background and plan.read == [True, True, True] and plan.block_ids == [(0,), (1,), (2,)]
    )
    # A second request sharing the pages: in L2, but still arriving, so asynchronous too.
    b = _Req("b", tokens)
    assert s.get_num_new_matched_tokens(b, 0) == (3 * BS, True)
    # Held: a new page finds no slot to evict while the load is in flight.
    c = _Req("c", list(range(500, 500 + BS + 1)))
    s.get_num_new_matched_tokens(c, 0)
    meta = s.build_meta(_sched_output([(c, [5, 6], 0, BS + 1)]))
    assert meta.store_slots == [] and s.take_stats()["no_slot"] == 1
    assert s.in_flight == 1 and s.index.held == 3
    s.loads_ended({"a"})
    assert s.in_flight == 0 and s.idle
    assert s.get_num_new_matched_tokens(b, 0) == (3 * BS, False)  # landed: plain L2 now


def test_a_request_gets_one_asynchronous_load():
    """A load that failed in part sends the request back to vLLM's waiting queue, where it is
    looked up again; L3 still lists the pages, so offering them again could loop forever.
    After one asynchronous load a request is offered only pages landed in L2."""
    tokens = list(range(2 * BS + 1))
    l3 = set(_hashes_of(_sched(8), _Req("x", tokens), 2))
    s = _sched(8, l3)
    a = _Req("a", tokens)
    assert s.get_num_new_matched_tokens(a, 0) == (2 * BS, True)
    s.update_state_after_alloc(a, _Blocks([0, 1, 2]), 2 * BS)
    meta = s.build_meta(_sched_output([]))
    bad = HiCacheWorkerMetadata({(meta.loads[0].slots[1], meta.loads[0].hashes[1])})
    s.worker_feedback(bad)  # page 1's read failed; page 0 landed
    s.loads_ended({"a"})
    assert s.get_num_new_matched_tokens(a, BS) == (0, False)  # not page 1 from L3 again
    assert s.get_num_new_matched_tokens(a, 0) == (BS, False)  # page 0, landed in L2
    assert s.build_meta(_sched_output([])).prefetch_slots == []


def test_best_effort_never_waits_and_prefetches_into_l2():
    tokens = list(range(2 * BS + 1))
    l3 = set(_hashes_of(_sched(8), _Req("x", tokens), 2))
    s = _sched(4, l3, prefetch_policy="best_effort")
    a = _Req("a", tokens)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = s.build_meta(_sched_output([]))
    assert len(meta.prefetch_slots) == 2 and meta.prefetch_hashes == _hashes_of(s, a, 2)
    # Arriving pages end a best_effort hit (no waiting) and are not prefetched twice.
    assert s.get_num_new_matched_tokens(_Req("b", tokens), 0) == (0, False)
    assert s.build_meta(_sched_output([])).prefetch_slots == []
    # Both TP ranks must report before the pages are the index's like any other.
    done = HiCacheWorkerMetadata()
    done.prefetched = dict.fromkeys(meta.prefetch_hashes, 1)
    s.worker_feedback(done)
    assert s.in_flight == 2
    s.worker_feedback(done)
    assert s.in_flight == 0 and s.idle
    assert s.get_num_new_matched_tokens(_Req("c", tokens), 0) == (2 * BS, False)
    assert s.take_stats()["prefetch_pages"] == 2


def test_reset_releases_prefetches_never_sent():
    tokens = list(range(2 * BS + 1))
    l3 = set(_hashes_of(_sched(8), _Req("x", tokens), 2))
    s = _sched(4, l3, prefetch_policy="best_effort")
    s.get_num_new_matched_tokens(_Req("a", tokens), 0)
    s.reset()
    assert s.idle and len(s.index) == 0
    assert s.build_meta(_sched_output([])).prefetch_slots == []


def test_write_back_stores_at_the_free_and_keeps_the_blocks_until_then():
    s = _sched(8, write_policy="write_back")
    a = _Req("a", list(range(2 * BS + 5)))
    s.get_num_new_matched_tokens(a, 0)
    meta = s.build_meta(_sched_output([(a, [0, 1, 2], 0, 2 * BS + 5)]))
    assert meta.store_slots == []  # nothing while it runs
    a.num_computed_tokens = 2 * BS + 4
    assert s.request_finished(a, ([0, 1, 2],)) is True
    meta = s.build_meta(_sched_output([]))
    assert meta.store_blocks == [(0,), (1,)] and meta.saving == ["a"]
    assert s.idle
    # The same pages again: L2 has them, nothing to keep the blocks for.
    b = _Req("b", list(range(2 * BS + 5)))
    s.get_num_new_matched_tokens(b, 0)
    b.num_computed_tokens = 2 * BS + 4
    assert s.request_finished(b, ([7, 8, 9],)) is False
    assert s.take_stats()["write_back_requests"] == 1


def test_a_request_aborted_while_its_load_is_in_flight_stores_nothing():
    tokens = list(range(2 * BS + 1))
    l3 = set(_hashes_of(_sched(8), _Req("x", tokens), 2))
    s = _sched(8, l3, write_policy="write_back")
    a = _Req("a", tokens)
    assert s.get_num_new_matched_tokens(a, 0) == (2 * BS, True)
    s.update_state_after_alloc(a, _Blocks([0, 1, 2]), 2 * BS)
    s.build_meta(_sched_output([]))
    a.num_computed_tokens = 2 * BS  # vLLM sets it before the load lands
    assert s.request_finished(a, ([0, 1, 2],)) is False
    s.loads_ended({"a"})
    assert s.idle


def test_options_validate_policies():
    from hicache.integrations.vllm import parse_options

    o = parse_options({"prefetch_policy": "timeout", "prefetch_timeout_base": 0.5})
    assert o.prefetch_deadline(2048) == 0.5 + 0.25 * 2
    assert parse_options({}).prefetch_deadline(10**6) == 5.0  # the storage timeout
    with pytest.raises(ValueError, match="prefetch_policy"):
        parse_options({"prefetch_policy": "eager"})
    with pytest.raises(ValueError, match="write_policy"):
        parse_options({"write_policy": "write_through_selective"})
    with pytest.raises(ValueError, match="prefetch_timeout_base"):
        parse_options({"prefetch_timeout_base": -1})


# ---------------------------------------------------------------------------- worker half


def _stored(tmp: Path) -> WorkerSide:
    """A worker that stored blocks 1 and 5 as H[0], H[1] and wrote them to L3."""
    src = _worker(tmp, "src")
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [(1,), (5,)], [0, 1], H[:2]
    src.save(m)
    src.shutdown()
    return src


def _same(dst: WorkerSide, src: WorkerSide, pairs: list[tuple[int, int]]) -> bool:
    return all(
        torch.equal(dst.kv[n][b], src.kv[n][a])  # type: ignore[attr-defined]
        for n in src.kv  # type: ignore[attr-defined]
        for b, a in pairs
    )


def test_an_async_load_lands_only_when_polled_then_is_reported(tmp_path):
    src = _stored(tmp_path)
    dst = _worker(tmp_path, "dst")
    m = _meta(dst)
    m.loads = [LoadPlan("r", [(2,), (3,)], [3, 2], H[:2], [True, True], background=True)]
    dst.start_load(m)
    assert not _same(dst, src, [(2, 1)])  # nothing written before it lands
    recving: set[str] = set()
    for _ in range(1000):  # each poll is an engine step; the file read is quick
        recving |= dst.poll(set())[1]
        if recving:
            break
        concurrent.futures.wait([f for ld in dst.loads.inflight for _, _, f in ld.chunks])
    assert recving == {"r"} and dst.take_errors() == set()
    assert _same(dst, src, [(2, 1), (3, 5)])
    assert dst.holds(3, H[0]) and dst.holds(2, H[1])  # and L2 keeps them
    assert not dst.loads.inflight and not dst.loads.filling
    dst.shutdown()


def test_a_prefetch_lands_in_l2_and_is_reported_once(tmp_path):
    _stored(tmp_path)
    dst = _worker(tmp_path, "dst")
    m = _meta(dst)
    m.prefetch_slots, m.prefetch_hashes = [2, 3], H[:2]
    dst.start_load(m)
    for _ in range(1000):  # each poll is an engine step; the file read is quick
        assert dst.poll(set())[1] == set()  # a prefetch is no request's load
        if not dst.loads.inflight:
            break
        concurrent.futures.wait([f for ld in dst.loads.inflight for _, _, f in ld.chunks])
    assert dst.holds(2, H[0]) and dst.holds(3, H[1])
    assert dst.loads.take_prefetched() == dict.fromkeys(H[:2], 1)
    assert dst.loads.take_prefetched() == {}  # reported once: nothing kept after
    assert not dst.loads.inflight and not dst.loads.filling and not dst.loads.prefetched
    dst.shutdown()


class _Hanging:
    """A store whose reads never come back (the worker's view: `read_async`)."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[int]] = []
        self.namespace = SimpleNamespace(writes=True)

    def read_async(self, hashes, targets) -> concurrent.futures.Future[int]:
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.futures.append(fut)
        return fut

    def close(self) -> None:
        pass


def _hanging_worker(**options) -> WorkerSide:
    w = _worker(None, "w")
    w.options = ConnectorOptions(storage="file:/nowhere", **options)
    w.storage = _Hanging()  # type: ignore[assignment]
    return w


def test_timeout_policy_gives_up_at_the_deadline_and_keeps_the_landed_prefix():
    w = _hanging_worker(
        prefetch_policy="timeout", prefetch_timeout_base=0.0, prefetch_timeout_per_ki_token=0.0
    )
    before = {n: t.clone() for n, t in w.kv.items()}  # type: ignore[attr-defined]
    m = _meta(w)
    m.loads = [LoadPlan("r", [(2,), (3,), (4,)], [0, 1, 2], H, [True, True, True], background=True)]
    w.start_load(m)
    (fut,) = w.storage.futures  # type: ignore[union-attr]
    assert w.poll(set())[1] == {"r"}  # deadline 0: ended at the first step
    assert fut.cancelled()
    assert w.take_errors() == {2, 3, 4} and w.take_bad() == {(0, H[0]), (1, H[1]), (2, H[2])}
    assert w.stats.take()["load_timeouts"] == 3
    for n, t in w.kv.items():  # type: ignore[attr-defined]
        assert torch.equal(t, before[n])
    assert not w.loads.inflight and not w.loads.filling


def test_an_aborted_request_s_load_is_dropped_and_reported_ended():
    w = _hanging_worker()
    m = _meta(w)
    m.loads = [LoadPlan("r", [(2,), (3,)], [0, 1], H[:2], [True, True], background=True)]
    w.start_load(m)
    assert w.poll(set())[1] == set()  # still waiting (deadline: the storage timeout)
    assert w.poll({"r"})[1] == {"r"}
    assert w.take_errors() == set()  # vLLM frees the blocks; nothing to recompute
    assert w.take_bad() == {(0, H[0]), (1, H[1])} and w.stats.take()["aborted_loads"] == 1
    assert not w.loads.inflight and not w.loads.filling


def test_a_load_from_a_slot_being_filled_waits_for_the_filler(tmp_path):
    src = _stored(tmp_path)
    dst = _worker(tmp_path, "dst")
    m = _meta(dst)
    m.loads = [
        LoadPlan("a", [(2,), (3,)], [0, 1], H[:2], [True, True], background=True),
        LoadPlan("b", [(6,)], [0], H[:1], [False], background=True),
    ]
    dst.start_load(m)
    (a, b) = dst.loads.inflight
    assert b.after == [a]
    ended: set[str] = set()
    while ended != {"a", "b"}:
        concurrent.futures.wait([f for _, _, f in a.chunks])
        ended |= dst.poll(set())[1]
    assert dst.take_errors() == set() and _same(dst, src, [(2, 1), (3, 5), (6, 1)])


def test_a_store_that_takes_a_slot_wins_over_a_load_still_filling_it(tmp_path):
    src = _stored(tmp_path)
    dst = _worker(tmp_path, "dst")
    m = _meta(dst)
    m.loads = [LoadPlan("a", [(2,)], [0], H[:1], [True], background=True)]
    dst.start_load(m)
    # A later step reuses slot 0 for another page (after a reset of the index).
    s = _meta(dst)
    s.store_blocks, s.store_slots, s.store_hashes = [(7,)], [0], [H[2]]
    dst.save(s)
    while not dst.poll(set())[1]:
        concurrent.futures.wait([f for ld in dst.loads.inflight for _, _, f in ld.chunks])
    assert _same(dst, src, [(2, 1)])  # the load still lands in its block, from its buffer
    assert dst.holds(0, H[2]) and not dst.holds(0, H[0])  # and the slot keeps the store
    dst.shutdown()


def test_layerwise_loads_equal_synchronous_ones(tmp_path):
    src = _stored(tmp_path)
    outs = []
    for layerwise in (True, False):
        w = _worker(tmp_path, "w")
        w.options = ConnectorOptions(layerwise_loads=layerwise)
        m = _meta(w)
        m.store_blocks, m.store_slots, m.store_hashes = [(1,), (5,)], [0, 1], H[:2]
        w.save(m)
        m2 = _meta(w)
        m2.loads = [LoadPlan("r", [(6,), (7,)], [0, 1], H[:2], [False, False])]
        _load(w, m2)
        assert w.take_errors() == set() and w.layers.usable
        outs.append({n: t.clone() for n, t in w.kv.items()})  # type: ignore[attr-defined]
    for n in outs[0]:
        assert torch.equal(outs[0][n], outs[1][n])
    del src


def test_a_layer_never_waited_for_fails_the_step_s_loads_and_turns_layerwise_off():
    w = _worker(None, "w")
    w.options = ConnectorOptions(layerwise_loads=True)
    m = _meta(w)
    m.store_blocks, m.store_slots, m.store_hashes = [(1,)], [0], H[:1]
    w.save(m)
    m2 = _meta(w)
    m2.loads = [LoadPlan("r", [(6,)], [0], H[:1], [False])]
    w.start_load(m2)
    w.wait_layer(w.geometry.layers[0])  # the forward skipped the hook of layer 1
    w.poll(set())
    assert w.take_errors() == {6} and not w.layers.usable
    _load(w, m2)  # synchronous from now on
    assert w.take_errors() == set()
    for t in w.kv.values():  # type: ignore[attr-defined]
        assert torch.equal(t[6], t[1])
