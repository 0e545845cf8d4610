from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.backends.base import enforces_ttl, set_from_ttl
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.backends.simple import SimpleStoreBackend

from .conftest import FakeHostPool, page_keys
from .harness import Events

pytestmark = pytest.mark.anyio


async def test_capacity_evicts_least_recently_used(ns, pool):
    value_bytes = None
    store = MemoryStore()
    backend = MemoryBackend(namespace=ns, store=store)
    keys = page_keys(ns, 4)
    for i in range(4):
        pool.fill(i, seed=i)
    await backend.set_from(keys[:1], [pool.page_buffer(0)])
    value_bytes = store.nbytes
    capped = MemoryBackend(namespace=ns, capacity_bytes=3 * value_bytes, policy="lru")
    assert await capped.set_from(keys[:3], [pool.page_buffer(i) for i in range(3)]) == 3
    out = FakeHostPool(pages=1)
    assert await capped.get_into(keys[:1], [out.page_buffer(0)]) == 1  # key 0 now most recent
    assert await capped.set_from(keys[3:], [pool.page_buffer(3)]) == 1
    assert [await capped.exists([k]) for k in keys] == [1, 0, 1, 1]
    assert capped.stats()["evictions"] == 1
    capped.store.check_integrity()


async def test_value_larger_than_capacity_is_a_failed_set(ns, pool):
    backend = MemoryBackend(namespace=ns, capacity_bytes=16)
    keys = page_keys(ns, 1)
    assert await backend.set_from(keys, [pool.page_buffer(0)]) == 0
    assert backend.stats()["set_ok"] == 0 and len(backend.store) == 0


def test_memory_spec_and_option_errors(ns):
    assert isinstance(MemoryBackend.from_spec("memory", namespace=ns), MemoryBackend)
    with pytest.raises(TypeError, match="unknown memory backend options"):
        MemoryBackend.from_spec("memory", namespace=ns, size=3)
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryBackend(namespace=ns, capacity_bytes=0)
    with pytest.raises(ValueError, match="not both"):
        MemoryBackend(namespace=ns, store=MemoryStore(), capacity_bytes=10)


class GetPutOnly:
    """The least an out-of-tree store offers; fails on demand."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.fail = False

    def get(self, key):
        if self.fail:
            raise ConnectionError("store down")
        return self.values.get(key)

    def put(self, key, value):
        if self.fail:
            raise ConnectionError("store down")
        self.values[key] = value


@pytest.mark.parametrize("threads", [0, 2])
async def test_simple_store_adapter_get_put_only(ns, pool, threads):
    events = Events()
    store = GetPutOnly()
    backend = SimpleStoreBackend(store, namespace=ns, emit=events, threads=threads)
    keys = page_keys(ns, 2)
    for i in range(2):
        pool.fill(i, seed=i)
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(2)]) == 2
    assert await backend.exists(keys) == 2  # probes with get when there is no contains
    out = FakeHostPool(pages=2)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(2)]) == 2
    assert out.page_bytes(1) == pool.page_bytes(1)
    store.fail = True
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(2)]) == 0
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(2)]) == 0
    assert await backend.exists(keys) == 0
    assert len(events.named("storage.error")) == 4
    with pytest.raises(NotImplementedError, match="scan"):
        await backend.clear()


def test_simple_store_adapter_rejects_non_stores(ns):
    with pytest.raises(TypeError, match="get\\(key\\) and put"):
        SimpleStoreBackend(object(), namespace=ns)


async def test_values_put_with_a_ttl_expire_on_the_stores_clock(ns, pool):
    now = [100.0]
    store = MemoryStore(clock=lambda: now[0])
    backend = MemoryBackend(namespace=ns, store=store)
    keys = page_keys(ns, 3)
    assert enforces_ttl(backend)
    pages = [pool.page_buffer(i) for i in range(3)]
    assert await set_from_ttl(backend, keys[:2], pages[:2], ttl=5) == 2
    assert await set_from_ttl(backend, keys[2:], pages[2:]) == 1  # no ttl: never expires
    now[0] += 4.9
    assert await backend.exists(keys) == 3
    now[0] += 0.2
    assert await backend.exists(keys[:2]) == 0 and await backend.exists(keys[2:]) == 1
    out = FakeHostPool(pages=1)
    assert await backend.get_into(keys[:1], [out.page_buffer(0)]) == 0
    assert await set_from_ttl(backend, keys[2:], pages[2:], ttl=0) == 1  # expired on arrival
    assert await backend.exists(keys[2:]) == 0
    store.check_integrity()


async def test_a_store_without_expiry_keeps_the_value_and_drops_the_ttl(ns, pool):
    class Plain:
        def __init__(self) -> None:
            self.values: dict[str, bytes] = {}

        def get(self, key: str) -> bytes | None:
            return self.values.get(key)

        def put(self, key: str, value: bytes) -> None:  # no ttl parameter at all
            self.values[key] = value

    backend = SimpleStoreBackend(Plain(), namespace=ns, threads=0)
    keys = page_keys(ns, 1)
    assert not enforces_ttl(backend)
    assert await set_from_ttl(backend, keys, [pool.page_buffer(0)], ttl=5) == 1
    assert await backend.exists(keys) == 1


def test_expired_values_go_first_when_the_capacity_needs_room():
    now = [0.0]
    store = MemoryStore(40, policy="lru", clock=lambda: now[0])
    store.put("a", b"x" * 10)
    store.put("b", b"x" * 10, ttl=5)
    store.put("c", b"x" * 10, ttl=50)
    store.put("d", b"x" * 10)
    store.get("a")  # most recent: LRU alone would evict "b", then "c"
    now[0] = 10.0
    assert store.put("e", b"x" * 20)  # needs 10 bytes beyond the expired "b": LRU's "c"
    assert sorted(k for k in "abcde" if store.contains(k)) == ["a", "d", "e"]
    assert store.evictions == 2
    store.check_integrity()


def test_a_put_at_the_cap_pops_only_expired_deadlines_not_every_value():
    """Many values with far deadlines and a put at the cap: the deadlines looked at are the
    ones that passed (the heap's head), not all of them."""
    now = [0.0]
    store = MemoryStore(1000, policy="lru", clock=lambda: now[0])
    for n in range(100):
        store.put(f"k{n}", b"x" * 10, ttl=1000 + n)
    for n in range(100):  # puts again: the old heap entries are stale and get compacted
        store.put(f"k{n}", b"x" * 10, ttl=2000 + n)
    assert store._deadlines.rows() <= 2 * len(store._deadlines) + 64
    now[0] = 2000.5  # only k0's deadline has passed
    assert store.put("new", b"x" * 10)
    assert not store.contains("k0") and store.contains("k1") and store.evictions == 1
    store.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "second-hit", "tinylfu"])
def test_every_policy_runs_the_store_within_its_cap(policy, ns):
    store = MemoryStore(100, policy=policy)
    for n in range(300):
        store.put(f"k{n % 37}", bytes(7 + n % 3))
        store.get(f"k{(n * 7) % 41}")
        store.contains(f"k{(n * 5) % 43}")
        if n % 11 == 0:
            store.delete(f"k{n % 13}")
        store.check_integrity()
    assert store.nbytes <= 100 and store.evictions > 0
    backend = MemoryBackend.from_spec("memory", namespace=ns, capacity_bytes=100, policy=policy)
    assert backend.store.policy == policy


def test_a_refused_write_is_not_kept_not_a_failure_and_counted():
    """A set the policy refuses succeeds (an uploader retries failed sets, which would offer
    the value again and undo the decision) but keeps nothing."""
    store = MemoryStore(20, policy="second-hit")
    assert store.put("a", bytes(10)) and store.put("b", bytes(10))
    assert store.put("c", bytes(10))  # would evict: first offer refused
    assert store.refused == 1 and sorted(k for k in "abc" if store.contains(k)) == ["a", "b"]
    assert store.put("c", bytes(10)) and store.contains("c") and store.refused == 1
    store.check_integrity()


def test_memory_policy_errors(ns):
    with pytest.raises(ValueError, match="unknown store policy 'mru'"):
        MemoryBackend.from_spec("memory", namespace=ns, policy="mru")
    with pytest.raises(ValueError, match="not both"):
        MemoryBackend(namespace=ns, store=MemoryStore(), policy="lru")


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "second-hit", "tinylfu"])
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put_ttl", "get", "contains", "delete", "tick"]),
            st.integers(0, 30),
            st.integers(1, 40),
        ),
        max_size=200,
    )
)
def test_the_store_is_its_book_under_any_calls(policy, ops):
    """Puts (with and without a ttl), reads, probes, deletes and a clock that moves: after
    each call the byte total is the values', the book holds the values' keys, the cap holds,
    a value read back is the last one put, and an expired value is never returned."""
    now = [0.0]
    store = MemoryStore(200, policy=policy, clock=lambda: now[0])
    last: dict[str, tuple[bytes, float]] = {}  # key -> (value, deadline) of its last put
    for op, n, size in ops:
        key = f"k{n}"
        if op in ("put", "put_ttl"):
            value = bytes([n]) * size
            ttl = float(size % 7) if op == "put_ttl" else None
            assert store.put(key, value, ttl=ttl)
            last[key] = (value, now[0] + ttl if ttl is not None else float("inf"))
        elif op == "get":
            got = store.get(key)
            if got is not None:
                assert got == last[key][0] and last[key][1] > now[0]
        elif op == "contains":
            if store.contains(key):
                assert last[key][1] > now[0]
        elif op == "delete":
            store.delete(key)
            assert not store.contains(key)
        else:
            now[0] += size / 10
        store.check_integrity()


class Batched(GetPutOnly):
    """A store with the batch forms too; counts their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_calls = 0
        self.short = False

    def get_many(self, keys):
        self.batch_calls += 1
        if self.fail:
            raise ConnectionError("store down")
        values = [self.values.get(k) for k in keys]
        return values[:-1] if self.short else values

    def put_many(self, keys, values):
        self.batch_calls += 1
        if self.fail:
            raise ConnectionError("store down")
        self.values.update(zip(keys, values))
        return [True] * len(keys)


@pytest.mark.parametrize("threads", [0, 2])
async def test_simple_store_adapter_uses_the_batch_forms(ns, pool, threads):
    events = Events()
    store = Batched()
    backend = SimpleStoreBackend(store, namespace=ns, emit=events, threads=threads)
    keys = page_keys(ns, 3)
    for i in range(3):
        pool.fill(i, seed=i)
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(3)]) == 3
    out = FakeHostPool(pages=3)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(3)]) == 3
    assert store.batch_calls == 2  # one call a batch each way
    assert [out.page_bytes(i) for i in range(3)] == [pool.page_bytes(i) for i in range(3)]
    assert (
        backend.stats()["bytes_written"]
        == backend.stats()["bytes_read"]
        == 3 * len(pool.page_bytes(0))
    )
    store.short = True  # a store that answers for fewer keys than asked: every page a miss
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(3)]) == 0
    store.short, store.fail = False, True
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(3)]) == 0
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(3)]) == 0
    assert len(events.named("storage.error")) == 9


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "second-hit", "tinylfu"])
@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.tuples(
            st.sampled_from(["put", "put_ttl", "get", "tick"]),
            st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40)), max_size=8),
            st.sampled_from([None, 0.0, 3.0]),
        ),
        max_size=40,
    )
)
def test_batch_calls_are_the_calls_one_by_one(policy, batches):
    """put_many and get_many leave a store as the same puts and gets one at a time would:
    the same values, totals, peak, evictions, refusals and answers."""
    now = [0.0]
    one = MemoryStore(160, policy=policy, clock=lambda: now[0])
    many = MemoryStore(160, policy=policy, clock=lambda: now[0])
    for op, items, ttl_given in batches:
        keys = [f"k{n}" for n, _ in items]
        if op in ("put", "put_ttl"):
            values = [bytes([n]) * size for n, size in items]
            ttl = ttl_given if op == "put_ttl" else None
            expect = [one.put(k, v, ttl=ttl) for k, v in zip(keys, values)]
            assert many.put_many(keys, values, ttl=ttl) == expect
        elif op == "get":
            assert many.get_many(keys) == [one.get(k) for k in keys]
        else:
            now[0] += len(items)
        for store in (one, many):
            store.check_integrity()
        assert dict(many._values) == dict(one._values)
        assert (many.nbytes, many.peak_bytes, many.evictions, many.refused) == (
            one.nbytes,
            one.peak_bytes,
            one.evictions,
            one.refused,
        )
