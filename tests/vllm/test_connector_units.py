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
    from hicache.components.tree.structure import salt_seed

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


H = [f"{i:064x}" for i in range(1, 4)]


def test_worker_round_trip_through_l2_and_l3(tmp_path):
    src = _worker(tmp_path, "src")
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [1, 5], [0, 1], H[:2]
    src.save(m)
    src.shutdown()  # waits for the write-through
    # L2 -> L1 in the same worker.
    m2 = _meta(src)
    m2.loads = [LoadPlan("r", [6, 7], [0, 1], H[:2], [False, False])]
    src.start_load(m2)
    assert src.take_errors() == set()
    for name, t in src.kv.items():  # type: ignore[attr-defined]
        assert torch.equal(t[6], t[1]) and torch.equal(t[7], t[5]), name
    # Another worker (another process in vLLM) reads them from L3 into its own blocks.
    dst = _worker(tmp_path, "dst")
    m3 = _meta(dst)
    m3.loads = [LoadPlan("r", [2, 3], [3, 2], H[:2], [True, True])]
    dst.start_load(m3)
    assert dst.take_errors() == set()
    for name in src.kv:  # type: ignore[attr-defined]
        assert torch.equal(dst.kv[name][2], src.kv[name][1])  # type: ignore[attr-defined]
        assert torch.equal(dst.kv[name][3], src.kv[name][5])  # type: ignore[attr-defined]
    dst.shutdown()


def test_worker_reports_corrupt_and_missing_reads_as_load_errors(tmp_path):
    src = _worker(tmp_path, "src")
    m = _meta(src)
    m.store_blocks, m.store_slots, m.store_hashes = [1, 5], [0, 1], H[:2]
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
    m2.loads = [LoadPlan("r", [2, 3, 4], [0, 1, 2], H, [True, True, True])]
    dst.start_load(m2)
    assert dst.take_errors() == {3, 4}
    assert dst.take_errors() == set()  # reported once
    assert dst.take_bad() == {(1, H[1]), (2, H[2])}
    for name, t in dst.kv.items():  # type: ignore[attr-defined]
        assert torch.equal(t[2], src.kv[name][1])  # type: ignore[attr-defined]
        assert torch.equal(t[3], before[name][3]) and torch.equal(t[4], before[name][4])
    # A later L2 load from a slot whose read failed is refused too.
    m3 = _meta(dst)
    m3.loads = [LoadPlan("q", [6], [1], [H[1]], [False])]
    dst.start_load(m3)
    assert dst.take_errors() == {6}
    dst.shutdown()


def test_worker_without_storage_loads_only_what_it_stored():
    w = _worker(None, "w")
    m = _meta(w)
    m.loads = [LoadPlan("r", [2], [0], [H[0]], [False])]  # slot 0 never written
    w.start_load(m)
    assert w.take_errors() == {2}
