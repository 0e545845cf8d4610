"""The StorageBackend contract, run over every embedded backend."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from hicache.backends.base import StorageBackend
from hicache.backends.keys import Namespace

from .conftest import FakeHostPool, page_keys
from .harness import Events, FileHarness, MemoryHarness

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[MemoryHarness, FileHarness], ids=lambda h: h.kind)
def harness(request, tmp_path):
    return request.param(tmp_path)


async def write_pages(backend, pool: FakeHostPool, keys: list[str]) -> None:
    for i in range(len(keys)):
        pool.fill(i, seed=i)
    stored = await backend.set_from(keys, [pool.page_buffer(i) for i in range(len(keys))])
    assert stored == len(keys)


async def test_round_trip_through_pieces(harness, ns, pool):
    backend = harness.open(ns)
    assert isinstance(backend, StorageBackend)
    keys = page_keys(ns, 4)
    await write_pages(backend, pool, keys)
    expected = [pool.page_bytes(i) for i in range(4)]
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys, [out.page_buffer(i + 2) for i in range(4)]) == 4
    assert [out.page_bytes(i + 2) for i in range(4)] == expected
    assert out.page_bytes(0) == bytes(len(expected[0]))  # untouched pages stay untouched
    s = backend.stats()
    assert (s["gets"], s["get_hits"], s["sets"], s["corrupt"]) == (4, 4, 4, 0)
    assert s["bytes_read"] == s["bytes_written"] == 4 * len(expected[0])
    await backend.aclose()
    await backend.aclose()  # idempotent


async def test_exists_and_get_count_consecutive_prefix(harness, ns, pool):
    backend = harness.open(ns)
    keys = page_keys(ns, 5)
    await write_pages(backend, pool, keys)
    await backend.delete([keys[2], ns.key("0" * 64)])  # an absent key is ignored
    assert await backend.exists(keys) == 2
    assert await backend.exists(keys[3:]) == 2
    assert await backend.exists([]) == 0
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(5)]) == 2
    assert backend.stats()["get_hits"] == 2


async def test_two_instances_share_pages_but_not_namespaces(harness, ns, pool):
    writer = harness.open(ns)
    keys = page_keys(ns, 3)
    await write_pages(writer, pool, keys)
    reader = harness.open(Namespace(model=ns.model, kv=ns.kv, page_size=ns.page_size))
    assert await reader.exists(keys) == 3
    out = FakeHostPool(pages=8)
    assert await reader.get_into(keys, [out.page_buffer(i) for i in range(3)]) == 3
    assert out.page_bytes(2) == pool.page_bytes(2)
    for other in (
        Namespace(model=ns.model, kv=ns.kv, page_size=ns.page_size, tenant="other"),
        Namespace(
            model=ns.model, kv=ns.kv.replace("bfloat16", "float8_e4m3fn"), page_size=ns.page_size
        ),
        Namespace(model=ns.model, kv=ns.kv, page_size=ns.page_size, rank=1),
    ):
        stranger = harness.open(other)
        same_tokens = page_keys(other, 3)
        assert await stranger.exists(same_tokens) == 0
        assert await stranger.get_into(same_tokens, [out.page_buffer(i) for i in range(3)]) == 0
        with pytest.raises(ValueError, match="namespace"):
            await stranger.exists(keys)  # a foreign key is a caller's bug


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
        (lambda v: v[: len(v) // 2], "truncated"),
        (lambda v: v[:10], "truncated"),
        (lambda v: b"", "truncated"),
    ],
)
async def test_corrupt_value_is_miss_event_and_deleted(harness, ns, pool, change, reason):
    events = Events()
    backend = harness.open(ns, emit=events)
    keys = page_keys(ns, 3)
    await write_pages(backend, pool, keys)
    harness.tamper(keys[1], change)
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(3)]) == 1
    assert [f["reason"] for f in events.named("storage.corrupt")] == [reason]
    assert events.named("storage.corrupt")[0]["key"] == keys[1]
    assert not harness.present(keys[1])
    assert harness.present(keys[2])
    assert backend.stats()["corrupt"] == 1


async def test_swapped_value_is_foreign_key(harness, ns, pool):
    events = Events()
    backend = harness.open(ns, emit=events)
    keys = page_keys(ns, 2)
    await write_pages(backend, pool, keys)
    other = {}
    harness.tamper(keys[0], lambda v: other.setdefault("v", v))
    harness.tamper(keys[1], lambda v: other["v"])  # page 1's slot now holds page 0's value
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys[1:], [out.page_buffer(0)]) == 0
    assert [f["reason"] for f in events.named("storage.corrupt")] == ["key"]
    assert not harness.present(keys[1]) and harness.present(keys[0])


async def test_wrong_target_size_is_a_miss(harness, ns, pool):
    events = Events()
    backend = harness.open(ns, emit=events)
    keys = page_keys(ns, 1)
    await write_pages(backend, pool, keys)
    small = FakeHostPool(pages=1, piece_bytes=32)
    assert await backend.get_into(keys, [small.page_buffer(0)]) == 0
    assert [f["reason"] for f in events.named("storage.corrupt")] == ["length"]


async def test_clear_removes_only_own_namespace(harness, ns, pool):
    a = harness.open(ns)
    ns_b = Namespace(model=ns.model, kv=ns.kv, page_size=ns.page_size, tenant="b")
    b = harness.open(ns_b)
    keys_a, keys_b = page_keys(ns, 3), page_keys(ns_b, 3)
    await write_pages(a, pool, keys_a)
    await write_pages(b, pool, keys_b)
    await a.clear()
    assert await a.exists(keys_a) == 0
    assert await b.exists(keys_b) == 3


async def test_bad_arguments_raise_before_io(harness, ns, pool):
    backend = harness.open(ns)
    keys = page_keys(ns, 2)
    with pytest.raises(ValueError, match="2 keys but 1"):
        await backend.set_from(keys, [pool.page_buffer(0)])
    with pytest.raises(TypeError, match="sequence of pieces"):
        await backend.set_from(keys[:1], [bytearray(8)])
    with pytest.raises(ValueError, match="read-only"):
        await backend.get_into(keys[:1], [[memoryview(b"abcd")]])
    with pytest.raises(TypeError, match="single string"):
        await backend.exists(keys[0])
    assert await backend.exists(keys) == 0
    assert backend.stats()["sets"] == 0


async def test_many_concurrent_gets_and_sets(harness, ns):
    backend = harness.open(ns)
    n = 24
    keys = page_keys(ns, n)
    src = FakeHostPool(pages=n)
    for i in range(n):
        src.fill(i, seed=100 + i)
    dst = FakeHostPool(pages=n)
    results: dict[int, int] = {}

    async def roundtrip(i: int) -> None:
        assert await backend.set_from([keys[i]], [src.page_buffer(i)]) == 1
        results[i] = await backend.get_into([keys[i]], [dst.page_buffer(i)])

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(roundtrip, i)
    assert results == dict.fromkeys(range(n), 1)
    assert np.array_equal(src.data, dst.data)
    assert await backend.exists(keys) == n
