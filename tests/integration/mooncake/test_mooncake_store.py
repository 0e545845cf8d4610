"""MooncakeBackend against a real master and storage process on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest
from mc_support import PAGE_BYTES, namespace, page_content, page_hash

from hicache.backends import framing
from hicache.backends.mooncake import MooncakeBackend

pytestmark = [pytest.mark.mooncake, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Events(list):
    def __call__(self, name: str, **fields: object) -> None:
        self.append((name, fields))

    def named(self, name: str) -> list[dict]:
        return [f for n, f in self if n == name]


def pool_of(n: int, first: int = 0) -> np.ndarray:
    return np.stack([page_content(first + i) for i in range(n)])


def views(pool: np.ndarray) -> list[list[memoryview]]:
    return [[memoryview(row)] for row in pool]


async def open_backend(
    store, tenant: str = "", events: Events | None = None, **options
) -> MooncakeBackend:
    return MooncakeBackend.from_spec(
        store.spec, namespace=namespace(tenant), emit=events, **options
    )


async def test_round_trip_zero_copy_and_staged(store) -> None:
    events = Events()
    backend = await open_backend(store, "round-trip", events)
    ns = backend.namespace
    src = pool_of(6)
    dst = np.zeros_like(src)
    backend.register_host_memory(src.ctypes.data, src.nbytes)
    backend.register_host_memory(dst.ctypes.data, dst.nbytes)
    keys = [ns.key(page_hash(i, "rt")) for i in range(6)]
    assert await backend.set_from(keys, views(src)) == 6
    assert await backend.exists(keys) == 6
    assert await backend.get_into(keys, views(dst)) == 6
    np.testing.assert_array_equal(dst, src)
    assert backend.stats()["staged_pages"] == 0
    # Layer-first pages: several pieces per page, in memory the backend never saw registered.
    loose = [[memoryview(np.zeros(PAGE_BYTES // 4, np.uint8)) for _ in range(4)] for _ in range(6)]
    assert await backend.get_into(keys, loose) == 6
    for i, page in enumerate(loose):
        np.testing.assert_array_equal(
            np.concatenate([np.frombuffer(p, np.uint8) for p in page]), src[i]
        )
    assert backend.stats()["staged_pages"] == 6
    assert backend.stats()["bytes_read"] == 12 * PAGE_BYTES
    assert events == []
    await backend.clear()
    assert await backend.exists(keys) == 0
    await backend.aclose()


async def test_pages_with_header_room_store_the_same_values(store, raw) -> None:
    """Pages handed out with header room (as host pools do) move as one piece with the header
    written in the room; the values are the same as through the header slot, both ways."""
    from hicache.kernels.pools import PagePieces

    room = 512
    backend = await open_backend(store, "room")
    ns = backend.namespace
    src = pool_of(4)
    roomy = np.zeros((4, room + PAGE_BYTES), np.uint8)
    roomy[:, room:] = src
    plain = np.zeros_like(src)
    for a in (roomy, plain):
        backend.register_host_memory(a.ctypes.data, a.nbytes)
    pages = [PagePieces([memoryview(row[room:])], room) for row in roomy]
    keys = [ns.key(page_hash(i, "room")) for i in range(4)]
    assert await backend.set_from(keys[:2], pages[:2]) == 2  # through the room
    assert await backend.set_from(keys[2:], views(src[2:])) == 2  # through the header slot
    for key, page in zip(keys, src):
        payload = page.tobytes()
        assert raw.get(key) == framing.encode_header(key, [payload]) + payload
    roomy[:, room:] = 0
    assert await backend.get_into(keys, pages) == 4
    np.testing.assert_array_equal(roomy[:, room:], src)
    assert await backend.get_into(keys, views(plain)) == 4
    np.testing.assert_array_equal(plain, src)
    await backend.clear()
    await backend.aclose()


async def test_exists_counts_the_present_prefix(store) -> None:
    backend = await open_backend(store, "prefix")
    ns = backend.namespace
    src = pool_of(5)
    keys = [ns.key(page_hash(i, "px")) for i in range(5)]
    assert await backend.set_from([keys[0], keys[1], keys[3]], views(src[[0, 1, 3]])) == 3
    assert await backend.exists(keys) == 2
    assert await backend.exists(keys[3:]) == 1
    assert await backend.exists([]) == 0
    dst = np.zeros_like(src)
    assert await backend.get_into(keys, views(dst)) == 2  # stops at the absent third page
    np.testing.assert_array_equal(dst[:2], src[:2])
    await backend.clear()
    await backend.aclose()


async def test_missing_key_is_a_miss_without_events(store) -> None:
    events = Events()
    backend = await open_backend(store, "missing", events)
    dst = pool_of(2)
    keys = [backend.namespace.key(page_hash(i, "never-written")) for i in range(2)]
    assert await backend.get_into(keys, views(dst)) == 0
    assert await backend.exists(keys) == 0
    assert events == []
    assert backend.stats()["get_hits"] == 0
    await backend.aclose()


async def test_namespaces_do_not_share_keys_and_clear_is_scoped(store) -> None:
    a = await open_backend(store, "tenant-a")
    b = await open_backend(store, "tenant-b")
    src = pool_of(3)
    hashes = [page_hash(i, "ns") for i in range(3)]
    assert await a.set_from([a.namespace.key(h) for h in hashes], views(src)) == 3
    assert await b.exists([b.namespace.key(h) for h in hashes]) == 0
    assert await b.set_from([b.namespace.key(h) for h in hashes], views(src)) == 3
    await b.clear()
    assert await b.exists([b.namespace.key(h) for h in hashes]) == 0
    assert await a.exists([a.namespace.key(h) for h in hashes]) == 3
    await a.clear()
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("tamper", ["checksum", "key", "length", "magic"])
async def test_corrupt_value_is_a_miss_an_event_and_deleted(store, raw, tamper: str) -> None:
    events = Events()
    backend = await open_backend(store, "corrupt-" + tamper, events)
    ns = backend.namespace
    src = pool_of(2)
    keys = [ns.key(page_hash(i, tamper)) for i in range(2)]
    assert await backend.set_from(keys, views(src)) == 2
    payload = src[0].tobytes()
    header = framing.encode_header(keys[0], [payload])
    if tamper == "checksum":
        value = header + payload[:-1] + bytes([payload[-1] ^ 1])
    elif tamper == "key":
        value = framing.encode_header(keys[1], [payload]) + payload
    elif tamper == "length":
        value = header + payload[:-7]
    else:
        value = b"XXXX" + header[4:] + payload
    assert raw.remove(keys[0], True) == 0
    assert raw.put(keys[0], value) == 0
    dst = np.zeros_like(src)
    assert await backend.get_into(keys, views(dst)) == 0
    assert events.named("storage.corrupt") == [{"key": keys[0], "reason": tamper}]
    assert backend.stats()["corrupt"] == 1
    assert raw.is_exist(keys[0]) == 0  # deleted
    assert await backend.exists(keys[1:]) == 1  # the neighbour is untouched
    await backend.clear()
    await backend.aclose()


async def test_two_processes_share_one_store(store) -> None:
    caller = os.environ.get("PYTHONPATH")  # kept: packages installed beside the checkout
    path = os.pathsep.join(p for p in (str(ROOT), str(Path(__file__).parent), caller) if p)
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "writer.py"), store.spec, "shared", "4", "xp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.stdout.strip() == "done 4", out.stderr[-2000:]
    reader = await open_backend(store, "shared")
    other = await open_backend(store, "someone-else")
    hashes = [page_hash(i, "xp") for i in range(4)]
    dst = np.zeros((4, PAGE_BYTES), np.uint8)
    assert await reader.get_into([reader.namespace.key(h) for h in hashes], views(dst)) == 4
    np.testing.assert_array_equal(dst, pool_of(4))
    assert await other.exists([other.namespace.key(h) for h in hashes]) == 0
    assert (
        await other.get_into([other.namespace.key(h) for h in hashes], views(np.zeros_like(dst)))
        == 0
    )
    await reader.clear()
    await reader.aclose()
    await other.aclose()


@pytest.mark.slow
async def test_master_killed_gives_misses_and_events_not_hangs(private_store) -> None:
    events = Events()
    backend = await open_backend(private_store, "killed", events, retry=30)
    ns = backend.namespace
    src = pool_of(2)
    keys = [ns.key(page_hash(i, "kill")) for i in range(2)]
    assert await backend.set_from(keys, views(src)) == 2
    private_store.master.kill()
    private_store.master.wait()
    with anyio.fail_after(60):  # a hang guard, not a timing assertion
        assert await backend.get_into(keys, views(np.zeros_like(src))) == 0
        assert await backend.exists(keys) == 0
        assert await backend.set_from(keys, views(src)) == 0
    unreachable = events.named("storage.unreachable")
    assert len(unreachable) == 1 and unreachable[0]["op"] == "get"
    assert backend.stats()["skipped"] == 2  # the probe and the set answered at once
    assert events.named("storage.corrupt") == []
    await backend.aclose()


async def test_unreachable_master_at_first_use_is_a_miss(mooncake_ready) -> None:
    events = Events()
    from socket import socket

    with socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata&host=127.0.0.1"
    backend = MooncakeBackend.from_spec(spec, namespace=namespace("nowhere"), emit=events)
    with anyio.fail_after(60):
        assert await backend.exists([backend.namespace.key(page_hash(0))]) == 0
    assert [n for n, _ in events] == ["storage.unreachable"]
    await backend.aclose()
