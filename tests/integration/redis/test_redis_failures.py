"""A killed, stuck, restarted or refusing server: misses and events, never an exception or a
hang. Every wait here is bounded by the client's own (short) timeouts; nothing sleeps."""

from __future__ import annotations

import anyio
import pytest
from redis_helpers import Pages, page_keys

from hicache.backends.redis import RedisBackend

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

# Generous bound on any single backend call below; the client timeouts are far shorter.
CALL_BOUND_S = 10


async def test_killed_mid_operation_is_a_miss_and_one_event(server, ns, events):
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events, timeout=5)
    keys = page_keys(ns, 8)
    pages = Pages(8, piece_bytes=32 * 1024).fill(seed=1)
    assert await backend.set_from(keys, pages.buffers(range(8))) == 8
    result: list[int] = []

    async def read() -> None:
        result.append(
            await backend.get_into(keys, Pages(8, piece_bytes=32 * 1024).buffers(range(8)))
        )

    server.pause()  # requests go out, replies never come ...
    with anyio.fail_after(CALL_BOUND_S):
        async with anyio.create_task_group() as group:
            group.start_soon(read)
            await anyio.wait_all_tasks_blocked()  # ... the read is now waiting on the server
            server.kill()  # the connection is reset under it, before the 5 s timeout
    assert result == [0]
    (unavailable,) = events.named("storage.unavailable")
    assert unavailable["op"] == "get" and "Timeout" not in unavailable["error"]
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.exists(keys) == 0
        assert await backend.set_from(keys, pages.buffers(range(8))) == 0
    assert len(events.named("storage.unavailable")) == 1  # one event per outage
    assert backend.stats()["errors"] >= 3
    await backend.aclose()


async def test_stuck_server_costs_a_timeout_not_a_hang(server, ns, events):
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events, timeout=0.2)
    keys = page_keys(ns, 3)
    pages = Pages(3).fill(seed=2)
    assert await backend.set_from(keys, pages.buffers(range(3))) == 3
    server.pause()
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.exists(keys) == 0
        assert await backend.get_into(keys, Pages(3).buffers(range(3))) == 0
        assert await backend.set_from(keys, pages.buffers(range(3))) == 0
        await backend.delete(keys[:1])
        await backend.clear()
        assert not await backend.ping()
    (unavailable,) = events.named("storage.unavailable")
    assert "Timeout" in unavailable["error"]
    server.resume()
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.exists(keys[1:]) == 2
    assert events.names() == ["storage.unavailable", "storage.reconnected"]
    await backend.aclose()


async def test_restart_reconnects_and_new_writes_hit(server, ns, events):
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events, timeout=2)
    old, new = page_keys(ns, 2), page_keys(ns, 2, start=100)
    pages = Pages(2).fill(seed=3)
    assert await backend.set_from(old, pages.buffers(range(2))) == 2
    # A restart between two calls: the pooled connections are dead, the next call reconnects
    # by itself and nothing is lost but the old (unpersisted) values.
    server.restart()
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.get_into(old, Pages(2).buffers(range(2))) == 0
        assert await backend.set_from(new, pages.buffers(range(2))) == 2
        read = Pages(2)
        assert await backend.get_into(new, read.buffers(range(2))) == 2
    assert read.page_bytes(1) == pages.page_bytes(1)
    assert events.seen == []  # a clean reconnect is no outage
    # Down across calls, then back: one event each way.
    server.kill()
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.exists(new) == 0
    server.start()
    with anyio.fail_after(CALL_BOUND_S):
        assert await backend.set_from(new, pages.buffers(range(2))) == 2
        assert await backend.exists(new) == 2
    assert events.names() == ["storage.unavailable", "storage.reconnected"]
    assert backend.stats()["corrupt"] == 0
    await backend.aclose()


async def test_a_full_server_is_full_writes_back_off_and_reads_go_on(server_factory, ns, events):
    server = server_factory("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    # One pipeline, so the pages arrive in order and the first ones fit.
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events, pipeline_bytes=1 << 40)
    keys = page_keys(ns, 12)
    pages = Pages(12, piece_bytes=128 * 1024).fill(seed=4)  # 512 KiB pages: 3 MiB fills up
    stored = await backend.set_from(keys, pages.buffers(range(12)))
    assert 0 < stored < 12
    # OOM is one condition, not an error per write: one event, and writes back off
    (full,) = events.named("storage.full")
    assert "OutOfMemoryError" in full["error"] or "OOM" in full["error"]
    assert not events.named("storage.error") and backend.stats()["errors"] == 0
    assert "storage.unavailable" not in events.names()  # the server is there, it said no
    assert not backend.accepts_writes()
    more = page_keys(ns, 2, start=1000)
    assert await backend.set_from(more, pages.buffers(range(2))) == 0  # refused, no I/O
    assert backend.stats()["refused_pages"] == 2
    assert (
        await backend.get_into(keys, Pages(12, piece_bytes=128 * 1024).buffers(range(12))) == stored
    )
    await backend.aclose()
