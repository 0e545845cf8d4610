"""The connector's two halves without vLLM (these run in the main environment too): the L2
index's eviction and pins, option parsing, and a worker half over fake KV tensors and a real
file store, L1 -> L2 -> L3 -> L2 -> L1, with a corrupt value reported as a load error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.integrations.vllm import (
    ConnectorOptions,
    Geometry,
    HiCacheMetadata,
    HostIndex,
    LoadPlan,
    Storage,
    WorkerSide,
    namespace_of,
    parse_options,
    salt_prior,
)


def test_index_evicts_least_recent_unpinned_and_pins_hold():
    ix = HostIndex(2)
    a = ix.allocate("a")
    b = ix.allocate("b")
    assert {a, b} == {0, 1}
    ix.unpin_all()
    ix.touch("a")  # b is now the least recent
    c = ix.allocate("c")
    assert c == b and ix.lookup("b") is None and ix.lookup("a") == a
    # c is pinned (allocated this step); a is not: a goes next.
    d = ix.allocate("d")
    assert d == a
    # Both pinned: nothing to evict.
    assert ix.allocate("e") is None
    ix.unpin_all()
    assert ix.allocate("e") is not None


def test_index_forgets_only_the_page_it_was_told():
    ix = HostIndex(1)
    s = ix.allocate("a")
    ix.unpin_all()
    assert not ix.forget(s, "other")
    assert ix.forget(s, "a")
    assert ix.lookup("a") is None and ix.allocate("b") == s


def test_options():
    assert parse_options({}) == ConnectorOptions()
    assert parse_options(None).storage is None
    assert parse_options({"host_gib": 0.5}).host_bytes == 1 << 29
    with pytest.raises(ValueError, match="unknown"):
        parse_options({"host_gb": 1})
    with pytest.raises(ValueError, match="not both"):
        parse_options({"host_gib": 1, "host_bytes": 5})
    with pytest.raises(ValueError, match="unknown storage spec"):
        parse_options({"storage": "nfs://x"})


def test_salt_prior_is_hicaches_salt_seed():
    from hicache.radix.hashes import salt_seed

    assert salt_prior(None) is None and salt_prior("") is None
    assert salt_prior("t") == salt_seed(b"t")


BLOCKS, LAYERS, HEADS, BS, DIM = 8, 2, 1, 32, 64


def _worker(tmp: Path | None, name: str) -> WorkerSide:
    page = LAYERS * HEADS * BS * 2 * DIM * 4
    geo = Geometry(BS, tuple(f"l{i}" for i in range(LAYERS)), page, "mha:2:1:64:float32", "t")
    storage = None
    opts = ConnectorOptions(storage=f"file:{tmp}" if tmp else None, storage_timeout=10)
    if tmp is not None:
        storage = Storage(f"file:{tmp}", namespace_of(geo, "m", rank=0, tp_size=1), opts)
    w = WorkerSide(opts, geo, BLOCKS, storage)
    torch.manual_seed(hash(name) % 1000)
    kv = {f"l{i}": torch.randn(BLOCKS, HEADS, BS, 2 * DIM) for i in range(LAYERS)}
    w.register_kv_caches(kv)
    w.kv = kv  # type: ignore[attr-defined]
    return w


def _meta(w: WorkerSide) -> HiCacheMetadata:
    return HiCacheMetadata(4, w.geometry.page_bytes)


def _load(w: WorkerSide, m: HiCacheMetadata) -> None:
    """One step's loads as vLLM runs them: start, the forward waits for every layer, then
    the end of the step (layer-wise copies finished)."""
    w.start_load(m)
    for name in w.geometry.layers:
        w.wait_layer(name)
    w.poll(set())


H = [f"{i:064x}" for i in range(1, 4)]


def test_worker_round_trip_through_l2_and_l3(tmp_path):
    src = _worker(tmp_path, "src")
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [(1,), (5,)], [0, 1], H[:2]
    src.save(m)
    src.shutdown()  # waits for the write-through
    # L2 -> L1 in the same worker.
    m2 = _meta(src)
    m2.loads = [LoadPlan("r", [(6,), (7,)], [0, 1], H[:2], [False, False])]
    _load(src, m2)
    assert src.take_errors() == set()
    for name, t in src.kv.items():  # type: ignore[attr-defined]
        assert torch.equal(t[6], t[1]) and torch.equal(t[7], t[5]), name
    # Another worker (another process in vLLM) reads them from L3 into its own blocks.
    dst = _worker(tmp_path, "dst")
    m3 = _meta(dst)
    m3.loads = [LoadPlan("r", [(2,), (3,)], [3, 2], H[:2], [True, True])]
    _load(dst, m3)
    assert dst.take_errors() == set()
    for name in src.kv:  # type: ignore[attr-defined]
        assert torch.equal(dst.kv[name][2], src.kv[name][1])  # type: ignore[attr-defined]
        assert torch.equal(dst.kv[name][3], src.kv[name][5])  # type: ignore[attr-defined]
    dst.shutdown()


def test_worker_reports_corrupt_and_missing_reads_as_load_errors(tmp_path):
    src = _worker(tmp_path, "src")
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [(1,), (5,)], [0, 1], H[:2]
    src.save(m)
    src.shutdown()
    values = [
        p for p in tmp_path.rglob("*") if p.is_file() and "tmp" not in p.relative_to(tmp_path).parts
    ]
    assert len(values) == 2
    victim = next(p for p in values if p.name == H[1])
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    dst = _worker(tmp_path, "dst")
    before = {n: t.clone() for n, t in dst.kv.items()}  # type: ignore[attr-defined]
    m2 = _meta(dst)
    # page 0 fine, page 1 corrupt, page 2 never stored: blocks 3 and 4 fail, 2 loads.
    m2.loads = [LoadPlan("r", [(2,), (3,), (4,)], [0, 1, 2], H, [True, True, True])]
    _load(dst, m2)
    assert dst.take_errors() == {3, 4}
    assert dst.take_errors() == set()  # reported once
    assert dst.take_bad() == {(1, H[1]), (2, H[2])}
    for name, t in dst.kv.items():  # type: ignore[attr-defined]
        assert torch.equal(t[2], src.kv[name][1])  # type: ignore[attr-defined]
        assert torch.equal(t[3], before[name][3]) and torch.equal(t[4], before[name][4])
    # A later L2 load from a slot whose read failed is refused too.
    m3 = _meta(dst)
    m3.loads = [LoadPlan("q", [(6,)], [1], [H[1]], [False])]
    _load(dst, m3)
    assert dst.take_errors() == {6}
    dst.shutdown()


def test_worker_without_storage_loads_only_what_it_stored():
    w = _worker(None, "w")
    m = _meta(w)
    m.loads = [LoadPlan("r", [(2,)], [0], [H[0]], [False])]  # slot 0 never written
    _load(w, m)
    assert w.take_errors() == {2}


# ---------------------------------------------------------------- metrics, events (item 1)


def test_counters_hand_out_increments_once():
    from hicache.integrations.vllm.metrics import Counters

    c = Counters(("a", "b"))
    c.add("a", 3)
    assert c.take() == {"a": 3}
    assert c.take() == {}
    c.add("b")
    c.add("a")
    assert c.take() == {"a": 1, "b": 1} and c.totals == {"a": 4, "b": 1}


def test_stats_aggregate_across_workers_and_reduce():
    from hicache.integrations.vllm import HiCacheConnector
    from hicache.integrations.vllm.metrics import METRICS, HiCacheStats

    a = HiCacheConnector.build_kv_connector_stats({"l2_load_pages": 2, "l3_read_bytes": 10})
    b = HiCacheStats({"l2_load_pages": 3, "lookups": 1, "not_ours": 5})
    assert isinstance(a, HiCacheStats) and not a.is_empty()
    a.aggregate(b)
    assert a.to_dict() == {"l2_load_pages": 5, "l3_read_bytes": 10, "lookups": 1}
    assert a.reduce() == {
        "hicache_lookups": 1,
        "hicache_l2_load_pages": 5,
        "hicache_l3_read_bytes": 10,
    }
    assert HiCacheStats().is_empty() and HiCacheStats({"lookups": 0}).is_empty()
    a.reset()
    assert a.is_empty()
    # Every counter either half keeps is documented in METRICS (and in docs/vllm.md).
    from hicache.integrations.vllm import SCHEDULER_METRICS, WORKER_METRICS

    assert set(SCHEDULER_METRICS) | set(WORKER_METRICS) == set(METRICS)
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    for name in METRICS:
        assert f"`{name}`" in doc, name


def test_worker_counts_loads_stores_reads_writes_and_failures(tmp_path):
    src = _worker(tmp_path, "src")
    page = src.geometry.page_bytes
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [(1,), (5,)], [0, 1], H[:2]
    src.save(m)
    src.shutdown()  # waits for the write-through
    assert src.stats.take() == {
        "l2_store_pages": 2,
        "l2_store_bytes": 2 * page,
        "l3_write_pages": 2,
        "l3_write_bytes": 2 * page,
    }
    assert src.take_uploads() == (H[:2], [])
    assert src.take_uploads() == ([], [])
    dst = _worker(tmp_path, "dst")
    m2 = _meta(dst)
    m2.loads = [LoadPlan("r", [(2,), (3,), (4,)], [0, 1, 2], H, [True, True, True])]  # H[2]: absent
    _load(dst, m2)
    assert dst.stats.take() == {
        "l3_read_pages": 2,
        "l3_read_bytes": 2 * page,
        "l3_read_failures": 1,
        "l2_load_pages": 2,
        "l2_load_bytes": 2 * page,
        "load_errors": 1,
    }
    dst.shutdown()


def test_worker_metadata_aggregates_upload_acks():
    from hicache.integrations.vllm import HiCacheWorkerMetadata

    a = HiCacheWorkerMetadata({(1, "x")})
    a.uploaded = {"p": 1}
    b = HiCacheWorkerMetadata()
    b.uploaded, b.upload_failed = {"p": 1, "q": 1}, {"r"}
    c = a.aggregate(b)
    assert c.bad == {(1, "x")} and c.uploaded == {"p": 2, "q": 1} and c.upload_failed == {"r"}


class _Req:
    def __init__(self, rid: str, tokens: list[int], block_hashes: list[bytes] | None = None):
        self.request_id = rid
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.cache_salt = None
        self.lora_request = None
        self.block_hashes = block_hashes or []


class _Blocks:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _sched_output(new: list[tuple[_Req, list[int], int, int]]):
    from types import SimpleNamespace

    return SimpleNamespace(
        num_scheduled_tokens={r.request_id: n for r, _, _, n in new},
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c)
            for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )


def _scheduler(slots: int, events: bool):
    from hicache.integrations.vllm import SchedulerSide
    from hicache.integrations.vllm.metrics import EventLog

    geo = Geometry(BS, ("l0",), 1024, "mha:1:1:64:float32", "t")
    return SchedulerSide(ConnectorOptions(), geo, slots, None, EventLog(events, BS))


def test_scheduler_counts_lookups_hits_and_evictions():
    s = _scheduler(2, events=False)
    a = _Req("a", list(range(3 * BS + 1)))
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = s.build_meta(_sched_output([(a, [0, 1, 2, 3], 0, 3 * BS + 1)]))
    assert len(meta.store_slots) == 2  # two slots: the third page finds every slot pinned
    assert s.take_stats() == {"lookups": 1, "no_slot": 1}
    b = _Req("b", list(range(3 * BS + 1)))
    assert s.get_num_new_matched_tokens(b, 0) == (2 * BS, False)
    s.update_state_after_alloc(b, _Blocks([4, 5, 6, 7]), 2 * BS)
    s.build_meta(_sched_output([(b, [4, 5, 6, 7], 2 * BS, BS + 1)]))
    c = _Req("c", list(range(100, 100 + 2 * BS + 1)))
    s.get_num_new_matched_tokens(c, 0)
    s.build_meta(_sched_output([(c, [8, 9, 10], 0, 2 * BS + 1)]))
    stats = s.take_stats()
    assert stats["hit_l2_pages"] == 2 and stats["l2_evictions"] == 2, stats
    assert s.take_stats() == {}


def test_scheduler_events_for_l2_and_l3_with_vllms_block_hashes():
    pytest.importorskip("vllm.distributed.kv_events")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    s = _scheduler(1, events=True)
    s._uploads = True  # as with a writable store
    raw = [b"h0" * 16, b"h1" * 16]
    vh = [maybe_convert_block_hash(h) for h in raw]
    a = _Req("a", list(range(2 * BS + 1)), raw)
    s.get_num_new_matched_tokens(a, 0)
    s.build_meta(_sched_output([(a, [0, 1, 2], 0, BS)]))  # page 0 computed this step
    (ev,) = s.events.take()
    assert isinstance(ev, BlockStored) and ev.medium == "CPU"
    assert ev.block_hashes == [vh[0]] and ev.parent_block_hash is None
    assert ev.token_ids == list(range(BS)) and ev.block_size == BS
    # The worker confirms the L3 write: a STORAGE event for the same page.
    from hicache.integrations.vllm import HiCacheWorkerMetadata

    fb = HiCacheWorkerMetadata()
    fb.uploaded = {s._requests["a"].hashes[0]: 1}
    s.worker_feedback(fb)
    (ev,) = s.events.take()
    assert isinstance(ev, BlockStored) and ev.medium == "STORAGE" and ev.block_hashes == [vh[0]]
    # Page 1 evicts page 0 from the one-slot L2: BlockRemoved (CPU), then BlockStored.
    from types import SimpleNamespace

    out = _sched_output([])
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["a"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[BS]
    )
    out.num_scheduled_tokens = {"a": BS}
    s.build_meta(out)
    removed, stored = s.events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [vh[0]]
    assert removed.medium == "CPU"
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == vh[0]
    # reset_prefix_cache(reset_connector=True): every L2 page leaves.
    s.reset()
    (removed,) = s.events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [vh[1]]


def test_events_off_by_default_collect_nothing():
    s = _scheduler(4, events=False)
    a = _Req("a", list(range(2 * BS + 1)))
    s.get_num_new_matched_tokens(a, 0)
    s.build_meta(_sched_output([(a, [0, 1, 2], 0, 2 * BS + 1)]))
    s.reset()
    assert s.events.take() == []


def test_prometheus_counters_carry_vllms_labels():
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    from types import SimpleNamespace

    from hicache.integrations.vllm import HiCacheConnector
    from hicache.integrations.vllm.metrics import METRICS

    made: dict[str, _FakeCounter] = {}

    class _FakeCounter:
        def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None:
            self.name, self.labelnames, self.values = name, labelnames, {}
            made[name] = self

        def labels(self, *values: object) -> _FakeCounter:
            self.bound = values
            self.values.setdefault(values, 0)
            return self

        def inc(self, n: float) -> None:
            self.values[self.bound] += n

    from prometheus_client import Counter, Gauge, Histogram

    types = {Counter: _FakeCounter, Gauge: object, Histogram: object}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = HiCacheConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    assert set(made) == {f"vllm:hicache_{k}" for k in METRICS}
    assert all(c.labelnames == ["model_name", "engine"] for c in made.values())
    prom.observe({"l2_load_pages": 3, "lookups": 0}, engine_idx=0)
    assert made["vllm:hicache_l2_load_pages"].values == {("m", "0"): 3}
    assert made["vllm:hicache_lookups"].values == {("m", "0"): 0}
