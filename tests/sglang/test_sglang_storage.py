"""hicache's SGLang storage backend against the real SGLang (its venv: `make sglang-env`):
built by SGLang's dynamic loader, pages moved through SGLang's own host pools on CPU, bit for
bit, in every layout, v1 and legacy, MHA and MLA, TP ranks, salts, a corrupt value, a store
that goes away, v2 hybrid pools checked against SGLang's own file backend. Elsewhere: skipped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sglang_cpu import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    mamba_host,
    mha_host,
    mla_host,
    open_dynamic,
    sglang_missing,
    storage_config,
)

if sglang_missing() is not None:  # one line in the summary, not one per test
    pytest.skip(str(sglang_missing()), allow_module_level=True)

import torch
from flaky_backend import FlakyBackend
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from hicache.integrations.sglang import HiCacheL3Storage

PAGE = 4


def hashes(pages: int, *, salt: str | None = None, base: int = 0) -> list[str]:
    """SGLang's storage page hashes of `pages` pages of tokens (seeded by a cache_salt)."""
    tokens = list(range(base, base + pages * PAGE))
    out = get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=PAGE)
    assert isinstance(out, list) and len(out) == pages
    return out


def slots(first_page: int, pages: int) -> torch.Tensor:
    """Host indices of `pages` consecutive pages from page `first_page`."""
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def page_bytes(host: Any, page: int) -> bytes:
    return bytes(host.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy())


@pytest.fixture
def closing() -> Any:
    opened: list[Any] = []
    yield opened.append
    for backend in opened:
        backend.close()


HOSTS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


def make_host(kind: str, layout: str) -> Any:
    return mha_host(layout, page_size=PAGE) if kind == "mha" else mla_host(layout, page_size=PAGE)


@pytest.mark.parametrize(("kind", "layout"), HOSTS)
def test_pages_round_trip_bit_for_bit(kind: str, layout: str, tmp_path: Path, closing: Any) -> None:
    host = make_host(kind, layout)
    backend = open_dynamic(host, f"file:{tmp_path}", mla=kind == "mla")
    closing(backend)
    assert isinstance(backend, HiCacheL3Storage)
    assert backend._pools["kv"].pages.zero_copy, "SGLang's KV host pools are read in place"
    keys = hashes(5)
    written = [page_bytes(host, 2 + i) for i in range(5)]
    assert backend.batch_set_v1(keys, slots(2, 5)) == [True] * 5
    assert backend.batch_exists(keys) == 5

    # v1 into other host pages: the same bytes
    assert backend.batch_get_v1(keys, slots(9, 5)) == [True] * 5
    assert [page_bytes(host, 9 + i) for i in range(5)] == written

    # legacy get into SGLang's dummy pages: the flat pages (what SGLang's own backends store)
    dummies = [host.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, dummies)
    assert all(t is d for t, d in zip(got, dummies))
    assert [bytes(d.view(torch.uint8).numpy()) for d in dummies] == written

    # legacy set of flat pages, then v1 get: the two interfaces read each other's values
    other = hashes(2, base=1000)
    assert backend.batch_set(other, [host.get_data_page(i * PAGE) for i in (12, 13)])
    assert backend.batch_get_v1(other, slots(0, 2)) == [True, True]
    assert [page_bytes(host, 0), page_bytes(host, 1)] == [
        page_bytes(host, 12),
        page_bytes(host, 13),
    ]


def test_exists_and_gets_stop_at_the_first_missing_page(tmp_path: Path, closing: Any) -> None:
    host = mha_host("page_first", page_size=PAGE)
    backend = open_dynamic(host, f"file:{tmp_path}")
    closing(backend)
    keys = hashes(4)
    assert (
        backend.batch_set_v1(keys[:2] + keys[3:], torch.cat([slots(0, 2), slots(3, 1)]))
        == [True] * 3
    )
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, slots(8, 4)) == [True, True, False, False]
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])[2:] == [
        None,
        None,
    ]


def test_mha_tp_ranks_keep_their_own_heads(tmp_path: Path, closing: Any) -> None:
    host = mha_host("layer_first", page_size=PAGE)
    rank0 = open_dynamic(host, f"file:{tmp_path}", tp_rank=0, tp_size=2)
    rank1 = open_dynamic(host, f"file:{tmp_path}", tp_rank=1, tp_size=2)
    alone = open_dynamic(host, f"file:{tmp_path}", tp_rank=0, tp_size=1)
    for b in (rank0, rank1, alone):
        closing(b)
    keys = hashes(2)
    assert rank0.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert rank0.batch_exists(keys) == 2
    assert rank1.batch_exists(keys) == 0, "another rank's heads are not this rank's"
    assert alone.batch_exists(keys) == 0, "rank 0 of TP2 holds other heads than TP1's rank 0"


def test_mla_rank_zero_writes_and_every_rank_reads(tmp_path: Path, closing: Any) -> None:
    host = mla_host("page_first", page_size=PAGE)
    rank0 = open_dynamic(host, f"file:{tmp_path}", tp_rank=0, tp_size=2, mla=True)
    rank1 = open_dynamic(host, f"file:{tmp_path}", tp_rank=1, tp_size=2, mla=True)
    closing(rank0)
    closing(rank1)
    keys, late = hashes(2), hashes(1, base=500)
    assert rank1.batch_set_v1(late, slots(5, 1)) == [True], "the writer stores it: SGLang moves on"
    assert rank0.batch_exists(late) == 0, "rank 1 wrote nothing"
    assert rank0.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert rank1.batch_get_v1(keys, slots(6, 2)) == [True, True]
    assert [page_bytes(host, 6), page_bytes(host, 7)] == [page_bytes(host, 0), page_bytes(host, 1)]


def test_salts_keep_tenants_apart(tmp_path: Path, closing: Any) -> None:
    host = mha_host("page_first", page_size=PAGE)
    a = open_dynamic(host, f"file:{tmp_path}", options={"salt": "tenant-a"})
    a2 = open_dynamic(host, f"file:{tmp_path}", options={"salt": "tenant-a"})
    b = open_dynamic(host, f"file:{tmp_path}", options={"salt": "tenant-b"})
    for x in (a, a2, b):
        closing(x)
    keys = hashes(2)
    assert a.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert a2.batch_exists(keys) == 2
    assert b.batch_exists(keys) == 0
    # a request's cache_salt seeds SGLang's hash chain, so its pages are other keys
    salted = hashes(2, salt="user-1")
    assert salted != keys
    assert a.batch_exists(salted) == 0
    assert a.batch_set_v1(salted, slots(2, 2)) == [True, True]
    assert a.batch_exists(hashes(2, salt="user-2")) == 0


def test_a_corrupt_value_is_a_miss(tmp_path: Path, closing: Any) -> None:
    host = mha_host("page_first_direct", page_size=PAGE)
    backend = open_dynamic(host, f"file:{tmp_path}")
    closing(backend)
    keys = hashes(3)
    assert backend.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    # flip one byte of the second page's stored value
    name = backend._pools["kv"].namespace.page_hash_of(
        backend._pools["kv"].namespace.keys([keys[1]])[0]
    )
    files = [p for p in tmp_path.rglob(name) if p.is_file()]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-7] ^= 0x40
    files[0].write_bytes(bytes(raw))
    assert backend.batch_get_v1(keys, slots(8, 3)) == [True, False, False]
    assert page_bytes(host, 8) == page_bytes(host, 0)
    assert backend.stats()["corrupt"] == 1
    assert backend.batch_exists(keys) == 1, "the corrupt value was deleted"


def test_sealed_and_encrypted_values_round_trip(tmp_path: Path, closing: Any) -> None:
    pytest.importorskip("cryptography")
    host = mha_host("layer_first", page_size=PAGE)
    opts = {"secret": "0123456789abcdef-secret", "encrypt_at_rest": True}
    backend = open_dynamic(host, f"file:{tmp_path}", options=opts)
    closing(backend)
    keys = hashes(2)
    assert backend.batch_set_v1(keys, slots(0, 2)) == [True, True]
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert page_bytes(host, 0)[:64] not in stored, "pages are encrypted at rest"
    assert backend.batch_get_v1(keys, slots(4, 2)) == [True, True]
    assert page_bytes(host, 4) == page_bytes(host, 0)
    other = open_dynamic(host, f"file:{tmp_path}", options={"secret": "another-secret-of-16+"})
    closing(other)
    assert other.batch_exists(keys) == 0


def test_a_store_that_goes_away_is_misses_never_exceptions(closing: Any) -> None:
    host = mha_host("page_first", page_size=PAGE)
    backend = open_dynamic(host, "flaky_backend:FlakyBackend", options={"storage_timeout": 0.2})
    closing(backend)
    store = FlakyBackend.opened[-1]
    keys = hashes(2)
    assert backend.batch_set_v1(keys, slots(0, 2)) == [True, True]
    store.mode = "raise"
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots(4, 2)) == [False, False]
    assert backend.batch_set_v1(hashes(1, base=99), slots(1, 1)) == [False]
    assert backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
    assert backend.batch_set(keys, [host.get_data_page(0)] * 2) is False
    assert backend.clear() is False
    store.mode = "hang"
    assert backend.batch_get_v1(keys, slots(4, 2)) == [False, False]
    assert store.cancelled >= 1, "the hung read was cancelled before the call returned"
    assert backend.batch_exists(keys) == 0
    store.mode = ""
    assert backend.batch_get_v1(keys, slots(4, 2)) == [True, True], "back once the store is"
    assert backend.stats()["failures"] >= 7


def test_arguments_that_do_not_fit_are_failures_not_exceptions(
    tmp_path: Path, closing: Any
) -> None:
    host = mha_host("page_first", page_size=PAGE)
    backend = open_dynamic(host, f"file:{tmp_path}")
    closing(backend)
    keys = hashes(3)
    assert backend.batch_set_v1(keys, slots(0, 2)) == [False] * 3  # too few indices
    assert backend.batch_get(keys, [host.get_dummy_flat_data_page()]) == [None] * 3
    assert backend.batch_set(keys, None) is False


def test_bad_extra_config_fails_the_start_naming_the_key(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_cpu import dynamic_extra

    for extra, needle in [
        (dynamic_extra(f"file:{tmp_path}", storag_timeout=3), "storag_timeout"),
        (dynamic_extra("ftp://host/x"), "ftp://host/x"),
        (dynamic_extra(f"file:{tmp_path}", storage_timeout=0), "storage_timeout"),
        (dynamic_extra(f"file:{tmp_path}", encrypt_at_rest=True), "encrypt_at_rest"),
    ]:
        with pytest.raises(ValueError, match=needle):
            StorageBackendFactory.create_backend("dynamic", storage_config(extra=extra), None)
    with pytest.raises(ValueError, match="model_id"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra=dynamic_extra(f"file:{tmp_path}"), model=None), None
        )


def test_stats_and_clear_as_sglang_expects(tmp_path: Path, closing: Any) -> None:
    host = mha_host("page_first", page_size=PAGE)
    quiet = open_dynamic(host, "memory")
    loud = open_dynamic(host, f"file:{tmp_path}", metrics=True)
    closing(quiet)
    closing(loud)
    keys = hashes(3)
    assert quiet.get_stats() is None, "SGLang's metrics off: None"
    assert loud.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert loud.batch_get_v1(keys, slots(4, 3)) == [True] * 3
    metrics = loud.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert loud.get_stats().backup_pgs == [], "each call reports what came since the last"
    assert loud.clear() is True
    assert loud.batch_exists(keys) == 0


# ------------------------------------------------------------------ v2: hybrid pools


def hybrid(backend: Any, kv: Any, mamba: Any) -> None:
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)


@pytest.mark.parametrize("policy", [PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
def test_v2_matches_sglangs_file_backend(
    policy: PoolHitPolicy, tmp_path: Path, closing: Any
) -> None:
    """The same writes through both; batch_exists_v2 must give the same verdicts, and reads
    the same bytes."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_cpu import dynamic_extra

    kv, mamba = mha_host("page_first", page_size=PAGE), mamba_host(slots=8)
    ours = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra=dynamic_extra(f"file:{tmp_path / 'ours'}")), kv
    )
    closing(ours)
    theirs = HiCacheFile(storage_config(extra={"file_storage_path": str(tmp_path / "theirs")}))
    hybrid(ours, kv, mamba)
    hybrid(theirs, kv, mamba)
    keys = hashes(6)

    def state(present: list[int]) -> PoolTransfer:
        return PoolTransfer(
            name=PoolName.MAMBA,
            host_indices=torch.tensor(present, dtype=torch.int64),
            keys=[keys[i] for i in present],
        )

    # KV for pages 0-4, Mamba state for pages 0, 1, 3, 4 (not 2)
    for b in (ours, theirs):
        kv_t = PoolTransfer(name=PoolName.KV, host_indices=slots(0, 5), keys=keys[:5])
        done = b.batch_set_v2([kv_t, state([0, 1, 3, 4])])
        assert done[PoolName.KV] == [True] * 5 and done[PoolName.MAMBA] == [True] * 4
    for trailing in (1, 2):
        probe = PoolTransfer(name=PoolName.MAMBA, keys=keys[:trailing], hit_policy=policy)
        mine, ref = ours.batch_exists_v2(keys, [probe]), theirs.batch_exists_v2(keys, [probe])
        assert (
            mine.kv_hit_pages,
            dict(mine.extra_pool_hit_pages),
            mine.restorable_prefix_pages,
        ) == (
            ref.kv_hit_pages,
            dict(ref.extra_pool_hit_pages),
            ref.restorable_prefix_pages,
        ), (policy, trailing)
    # reads: KV pages and the state of slot 4, into other slots
    read = ours.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=slots(8, 5), keys=keys[:5]),
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=torch.tensor([6, 7]), keys=[keys[4], keys[2]]
            ),
        ]
    )
    assert read[PoolName.KV] == [True] * 5 and read[PoolName.MAMBA] == [True, False]
    assert [page_bytes(kv, 8 + i) for i in range(5)] == [page_bytes(kv, i) for i in range(5)]
    assert torch.equal(mamba.get_data_page(6), mamba.get_data_page(4))


def test_open_needs_a_reachable_store(tmp_path: Path) -> None:
    from hicache.backends.base import BackendUnavailable

    host = mha_host("page_first", page_size=PAGE)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((BackendUnavailable, ValueError)):
        open_dynamic(host, f"file:{blocker / 'store'}")
    assert os.path.isfile(blocker)


def test_a_redis_store_and_a_server_that_dies(tmp_path: Path, closing: Any) -> None:
    pytest.importorskip("redis")
    from hicache.testing.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed here (make services installs it)")
    server = RedisServer(tmp_path / "redis").start()
    try:
        host = mha_host("page_first", page_size=PAGE)
        backend = open_dynamic(host, server.url, options={"storage_timeout": 5})
        closing(backend)
        keys = hashes(3)
        assert backend.batch_set_v1(keys, slots(0, 3)) == [True] * 3
        assert backend.batch_get_v1(keys, slots(8, 3)) == [True] * 3
        assert [page_bytes(host, 8 + i) for i in range(3)] == [
            page_bytes(host, i) for i in range(3)
        ]
        server.kill()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, slots(4, 3)) == [False] * 3
        assert backend.batch_set_v1(hashes(1, base=77), slots(3, 1)) == [False]
    finally:
        server.stop()
