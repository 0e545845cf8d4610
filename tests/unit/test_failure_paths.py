"""Failure paths a user of the API meets: a bad number is refused where it enters (never
truncated), a closed cache says so, a configuration too large for the machine fails before
allocating, a backend that cannot work fails at open, and the memory store is bounded."""

from __future__ import annotations

import numpy as np
import pytest

import hicache
from hicache import (
    ActorSystemClosed,
    BackendUnavailable,
    CacheConfig,
    ConfigError,
    HiCache,
    InvalidRequest,
)
from hicache.backends import memory as memory_mod
from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.backends.registry import connect_backend
from hicache.sizing import TierBytes, shortfall
from hicache.testing import run_virtual, virtual_config

PAGE = 4


def toks(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def test_kernel_closed_is_public():
    assert hicache.ActorSystemClosed is ActorSystemClosed and "ActorSystemClosed" in hicache.__all__


def test_counts_tokens_and_slots_must_be_integers():
    async def main() -> list[str]:
        errors = []
        async with HiCache(virtual_config()) as cache:
            await cache.match("r", toks(10))
            for bad in (3.5, "3", True):
                with pytest.raises(InvalidRequest, match="num_tokens") as e:
                    await cache.allocate("r", bad)
                errors.append(str(e.value))
            new = await cache.allocate("r", 10)
            with pytest.raises(InvalidRequest, match="device_slots must be integers"):
                await cache.cache_finished("r", toks(10), new + 0.5)
            with pytest.raises(InvalidRequest, match="tokens must be integers, got str"):
                await cache.match("q", ["a", "b"])
            with pytest.raises(InvalidRequest, match="tokens must be integers, got float"):
                await cache.match("q", np.arange(8, dtype=np.float32))
            out = await cache.cache_finished("r", toks(10), new)  # nothing was lost meanwhile
            assert out is not None
            assert (await cache.match("s", toks(10))).device_len == 8
            await cache.release("s")
        return errors

    errors = run_virtual(main)
    assert "3.5" in errors[0] and "'3'" in errors[1] and "True" in errors[2]


def test_allocate_returns_a_writable_array_the_tree_does_not_share():
    async def main() -> None:
        async with HiCache(virtual_config()) as cache:
            await cache.match("r", toks(8))
            new = await cache.allocate("r", 8)
            assert new.flags.writeable and new.dtype == np.int64
            kept = new.copy()
            await cache.cache_finished("r", toks(8), new)
            new[:] = 0  # the caller's array; the tree's copy is untouched
            m = await cache.match("s", toks(8))
            assert np.array_equal(m.device_slots, kept)
            await cache.release("s")

    run_virtual(main)


def test_closed_cache_raises_kernel_closed_and_does_not_reopen():
    async def main() -> None:
        cache = HiCache(virtual_config())
        async with cache:
            await cache.match("r", toks(8))
            await cache.release("r")
        with pytest.raises(ActorSystemClosed, match="closed"):
            await cache.match("r", toks(8))
        with pytest.raises(ActorSystemClosed, match="opens once"):
            async with cache:
                pytest.fail("a closed cache opened again")

    run_virtual(main)


def test_pools_too_large_fail_before_allocating_with_the_sizes():
    cfg = CacheConfig(
        kv="mha:64:64:128:float32", page_size=64, device_tokens=64 * 100_000, device="cpu"
    )

    async def main() -> None:
        async with HiCache(cfg):
            pytest.fail("opened pools larger than the machine")

    with pytest.raises(ConfigError, match=r"the pools do not fit: L1 .* \+ L2 .* available"):
        run_virtual(main)


def test_shortfall_names_each_tier():
    need = TierBytes(device="cuda:0", l1=8_000_000_000, l2=30_000_000_000)
    problems = shortfall(need, host_free=lambda: 20_000_000_000, device_free=lambda d: 10)
    assert problems is not None
    assert "L2 30 GB of host memory, 20 GB available" in problems
    assert "L1 8 GB on cuda:0, 10 B free there" in problems
    assert shortfall(need, host_free=lambda: 10**12, device_free=lambda d: 10**12) is None
    assert shortfall(need, host_free=lambda: None) is None  # unknown: nothing to check against


def test_memory_store_is_bounded_by_default(monkeypatch):
    monkeypatch.setattr(memory_mod, "available_memory", lambda: 2_000)
    store = MemoryStore()
    assert store.capacity_bytes == 1_000  # half of what is available
    for i in range(30):
        assert store.put(f"k{i}", b"x" * 100)
    assert store.nbytes <= 1_000 and store.evictions == 20 and store.peak_bytes == 1_000
    assert store.get("k29") is not None and store.get("k0") is None  # least recent out first
    assert MemoryStore(None).capacity_bytes is None  # unbounded only when asked
    ns = Namespace(model="m", kv="mha:1:1:4:float16", page_size=PAGE)
    stats = MemoryBackend(namespace=ns).stats()
    assert stats["max_bytes"] == 1_000 and "peak_stored_bytes" in stats


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_mooncake_without_a_server_fails_at_open(anyio_backend):
    ns = Namespace(model="m", kv="mha:1:1:4:float16", page_size=PAGE)
    with pytest.raises(BackendUnavailable, match=r"Mooncake master 127\.0\.0\.1:1"):
        await connect_backend("mooncake://127.0.0.1:1?probe_timeout=2", namespace=ns)


def test_file_store_that_cannot_be_made_fails_at_open(tmp_path):
    (tmp_path / "afile").write_text("x")
    ns = Namespace(model="m", kv="mha:1:1:4:float16", page_size=PAGE)
    with pytest.raises(BackendUnavailable, match="cannot create directory"):
        FileBackend(tmp_path / "afile", namespace=ns)


def test_deterministic_cache_refuses_network_storage():
    for spec in ("redis://127.0.0.1:6379", "mooncake://127.0.0.1:50051"):
        cfg = CacheConfig(deterministic=True, storage=spec, model_id="m")
        with pytest.raises(ConfigError, match="deterministic=True"):
            cfg.resolve()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_file_store_whose_directory_vanishes_makes_it_again(tmp_path, anyio_backend):
    """A directory removed under a running store: what it held is gone (misses, no error and no
    wrong bytes), and the next writes make the directory again and are read back."""
    import shutil

    from tests.unit.backends.conftest import FakeHostPool, page_keys

    ns = Namespace(model="test/model", kv="mha:2:2:4:bfloat16", page_size=PAGE)
    backend = FileBackend(tmp_path / "store", namespace=ns, threads=0)
    pool = FakeHostPool(pages=4)
    for page in range(4):
        pool.fill(page, seed=page)
    keys = page_keys(ns, 4)
    assert await backend.set_from(keys[:2], [pool.page_buffer(p) for p in range(2)]) == 2
    shutil.rmtree(tmp_path / "store")
    assert await backend.set_from(keys[2:], [pool.page_buffer(p) for p in (2, 3)]) == 2
    out = FakeHostPool(pages=4)
    assert await backend.exists(keys[:2]) == 0
    assert await backend.get_into(keys[:1], [out.page_buffer(0)]) == 0
    assert await backend.get_into(keys[2:], [out.page_buffer(p) for p in (2, 3)]) == 2
    assert out.page_bytes(2) == pool.page_bytes(2) and out.page_bytes(3) == pool.page_bytes(3)
    assert backend.stats()["corrupt"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("threads", [0, 2])
async def test_file_store_alone_sees_its_directory_removed_without_a_write(
    tmp_path, anyio_backend, threads
):
    """Alone in its directory the store answers probes from its index; once the directory is
    removed, the next probe sees it (no write in between) and answers a miss, and a store
    opened again later holds only what is on disk."""
    import shutil

    from tests.unit.backends.conftest import FakeHostPool, page_keys

    ns = Namespace(model="test/model", kv="mha:2:2:4:bfloat16", page_size=PAGE)
    backend = FileBackend(tmp_path / "store", namespace=ns, threads=threads)
    pool = FakeHostPool(pages=3)
    for page in range(3):
        pool.fill(page, seed=page)
    keys = page_keys(ns, 3)
    assert await backend.set_from(keys, [pool.page_buffer(p) for p in range(3)]) == 3
    assert await backend.exists(keys) == 3
    shutil.rmtree(tmp_path / "store")
    assert await backend.exists(keys) == 0
    assert backend.stats()["stored_bytes"] == 0
    assert await backend.set_from(keys[:1], [pool.page_buffer(0)]) == 1
    assert await backend.exists(keys) == 1
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_mooncake_without_its_client_library_fails_at_open(anyio_backend):
    from hicache.backends.mooncake import MooncakeBackend
    from hicache.backends.mooncake.spec import parse_spec

    def no_library(spec: object) -> object:
        raise ModuleNotFoundError("No module named 'mooncake'")

    ns = Namespace(model="m", kv="mha:1:1:4:float16", page_size=PAGE)
    backend = MooncakeBackend(
        parse_spec("mooncake://127.0.0.1:50051", {}), namespace=ns, client_factory=no_library
    )
    with pytest.raises(BackendUnavailable, match="client is not installed"):
        await backend.connect()
    await backend.aclose()
