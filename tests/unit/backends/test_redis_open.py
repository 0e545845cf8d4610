"""Opening a Redis backend checks the server: an unreachable one fails the open with a clear
error (host:port, never the password) instead of a silent 0% L3 hit rate. No server needed:
nothing listens on the port these tests use. Wrong credentials against a real server are in
tests/integration/redis/test_redis_open.py."""

from __future__ import annotations

import pytest

pytest.importorskip("redis")

from hicache import CacheConfig, HiCache
from hicache.backends.base import BackendUnavailable
from hicache.backends.redis.spec import parse_redis_spec
from hicache.backends.registry import connect_backend, open_backend
from hicache.testing.redis_server import free_port

from .conftest import FakeHostPool, page_keys
from .harness import Events

pytestmark = pytest.mark.anyio
SECRET = "s3cret-pw"


@pytest.fixture
def dead_url() -> str:
    return f"redis://alice:{SECRET}@127.0.0.1:{free_port()}"  # nothing listens there


async def test_unreachable_server_fails_the_open(ns, dead_url):
    events = Events()
    with pytest.raises(BackendUnavailable) as raised:
        await connect_backend(dead_url + "?connect_timeout=5", namespace=ns, emit=events)
    assert isinstance(raised.value, ConnectionError) and isinstance(raised.value, OSError)
    message = str(raised.value)
    assert dead_url.rsplit("@", 1)[1] in message  # host:port
    assert SECRET not in message and SECRET not in repr(raised.value)
    assert "lazy_connect" in message  # says how to open anyway


async def test_unreachable_server_fails_the_cache_open(dead_url):
    cfg = CacheConfig(
        kv="mha:2:1:8:float32",
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        device="cpu",
        storage=dead_url,
        model_id="m",
    )

    async def open_it() -> None:
        async with HiCache(cfg):
            pass

    with pytest.raises(BackendUnavailable, match=dead_url.rsplit("@", 1)[1]) as raised:
        await open_it()
    assert SECRET not in str(raised.value)


async def test_a_failed_open_leaves_no_transfer_threads(dead_url):
    import threading

    def ours() -> set[str]:  # stream threads (the checksum pool is shared and long-lived)
        return {
            t.name
            for t in threading.enumerate()
            if t.name.startswith("hicache-") and not t.name.startswith("hicache-crc")
        }

    assert ours() == set()
    cfg = CacheConfig(
        kv="mha:2:1:8:float32",
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        device="cpu",
        cpu_transfers="thread",
        storage=dead_url,
        model_id="m",
    )
    with pytest.raises(BackendUnavailable):
        async with HiCache(cfg):
            pass
    assert ours() == set()  # the copy threads the open had started are stopped (and joined)


async def test_lazy_connect_keeps_the_old_behaviour(ns, dead_url):
    events = Events()
    backend = await connect_backend(dead_url, namespace=ns, emit=events, lazy_connect=True)
    keys = page_keys(ns, 2)
    pool = FakeHostPool(pages=2)
    assert await backend.exists(keys) == 0
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(2)]) == 0
    (unavailable,) = events.named("storage.unavailable")  # one event per outage
    assert SECRET not in repr(unavailable)
    await backend.aclose()


def test_lazy_connect_is_a_spec_option():
    assert parse_redis_spec("redis://h:1").lazy_connect is False
    assert parse_redis_spec("redis://h:1?lazy_connect=yes").lazy_connect is True
    assert parse_redis_spec("redis://h:1", {"lazy_connect": True}).lazy_connect is True
    with pytest.raises(ValueError, match="lazy_connect"):
        parse_redis_spec("redis://h:1?lazy_connect=maybe")


def test_open_backend_alone_does_not_connect(ns, dead_url):
    backend = open_backend(dead_url, namespace=ns)  # building is pure; connect_backend checks
    assert backend is not None


def test_replay_command_reports_an_unreachable_store(capsys):
    from hicache.cli.main import main

    port = free_port()
    rc = main(
        ["replay", "--storage", f"redis://:{SECRET}@127.0.0.1:{port}", "--limit", "1", "--quiet"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and SECRET not in err
