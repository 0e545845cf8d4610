"""A conformance kit for L3 backends: one class of pytest tests that any `StorageBackend`, ours
or a third party's, runs to show it is a correct L3 store.

Use: subclass `BackendConformance` in a test module (its name must start with `Test` so pytest
collects it) and give it a `harness` fixture returning an object with `open(namespace, emit)`
(the backend for that namespace, sharing one underlying store across calls; sync or async):

    import pytest
    from hicache.testing.conformance import BackendConformance

    class MyHarness:
        def open(self, namespace, emit):
            return MyBackend(namespace=namespace, emit=emit)

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def harness(self):
            return MyHarness()

The tests run on anyio (the `anyio` pytest plugin, installed with anyio) on asyncio; override
the `anyio_backend` fixture for trio. What the harness can also offer, and what it unlocks
(each test that needs a missing one is skipped and says which):

- `read_raw(key) -> bytes | None` and `write_raw(key, value)`: the stored value as the store
  holds it (framing header and all), to corrupt, truncate and swap values behind the backend.
- `stall()`: a context manager during which the store accepts requests but answers none
  (Redis: SIGSTOP), and `stall_grace`: seconds a cancelled call may take to return then.
- `advance(seconds)`: moves the clock the backend's expiry runs on (passed by `open` as the
  backend's clock), to see a ttl expire without waiting.
- `piece_bytes`: the size of each of a page's four pieces (default 256).
- `keys_name_content = True`: the store keeps the first value written under a key (a write to
  an existing key counts as stored and changes nothing, as Mooncake does: a key names its
  page's content). The overwrite test then accepts either whole value.

What is covered: put/get/exists batches (several pieces per page, and one), partial batches
and the consecutive-prefix counts, missing keys (a miss, no event), overwrite, concurrent
writers of one key (a whole value of one of them, never a mix), corruption, truncation and
swapped values (a miss, a `storage.corrupt` event, the value deleted, neighbours kept), a value
of another page size, calls cancelled at a deadline (and, with `stall`, ended within the
grace while the store does not answer), tenant salts, model ids, ranks and secrets kept apart,
sealed values (the same sealing layer every backend gets), clear scoped to the namespace,
expiry where the backend enforces it, close with operations in flight, argument checks.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio
import numpy as np
import pytest

from hicache.backends.base import StorageBackend, enforces_ttl, set_from_ttl
from hicache.backends.keys import Namespace
from hicache.backends.sealing.backend import seal_backend
from hicache.radix.hashes import chain_page_hashes
from hicache.seal import Seal

KV = "mha:2:2:8:bfloat16"
MODEL = "conformance/model"
CALL_BOUND_S = 30.0
"""Seconds any one call may take before a test fails as hung (a bound, never a measure)."""


class BoundedCalls:
    """A backend (a stand-in for it, to the tests) whose every call fails the test, naming
    the call, when it has not returned within `CALL_BOUND_S`: a backend that hangs fails
    here rather than stopping the session at pytest's own timeout, if one is set at all.
    Cancellation from outside (a test's own deadline) passes through untouched."""

    CALLS = frozenset({"exists", "get_into", "set_from", "delete", "clear", "aclose"})

    def __init__(self, backend: StorageBackend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name in self.CALLS:
            return functools.partial(self._bounded, name, attr)
        return attr

    async def _bounded(
        self, name: str, call: Callable[..., Awaitable[Any]], *a: Any, **kw: Any
    ) -> Any:
        with anyio.move_on_after(CALL_BOUND_S):
            return await call(*a, **kw)
        pytest.fail(  # reached only when the bound cancelled the call
            f"{type(self._backend).__name__}.{name} did not return within {CALL_BOUND_S} s: "
            "a backend call must return, raise, or end when cancelled"
        )


Opener = Callable[..., Awaitable[Any]]
"""`await opened(namespace, emit=None)`: a backend of the harness (the `opened` fixture)."""


class ConformanceHarness(Protocol):
    """What the kit needs from a backend's test author (the optional parts: module docstring)."""

    def open(
        self, namespace: Namespace, emit: Callable[..., None]
    ) -> StorageBackend | Awaitable[StorageBackend]: ...


class Events:
    """An event sink recording (name, fields)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for e, f in self.seen if e == event]

    def names(self) -> list[str]:
        return [e for e, _ in self.seen]


class Pages:
    """Host pages laid out layer-first, [layers, K/V, pages, piece_bytes]: each page is four
    pieces, as a layer-first host pool hands them to a backend. Owns its memory."""

    def __init__(self, pages: int, piece_bytes: int = 256, layers: int = 2) -> None:
        self.data = np.zeros((layers, 2, pages, piece_bytes), dtype=np.uint8)

    def buffer(self, page: int) -> list[memoryview]:
        layers = self.data.shape[0]
        return [memoryview(self.data[layer, kv, page]) for layer in range(layers) for kv in (0, 1)]

    def buffers(self, pages: range | list[int]) -> list[list[memoryview]]:
        return [self.buffer(p) for p in pages]

    def fill(self, seed: int) -> Pages:
        rng = np.random.default_rng(seed)
        self.data[:] = rng.integers(0, 256, self.data.shape, dtype=np.uint8)
        return self

    def page_bytes(self, page: int) -> bytes:
        return b"".join(bytes(p) for p in self.buffer(page))


def namespace(tenant: str = "", **fields: Any) -> Namespace:
    """A namespace of the kit's geometry; every test uses fresh tenants, so tests sharing one
    store (a module's server) never see each other's values."""
    return Namespace(model=fields.pop("model", MODEL), kv=KV, page_size=4, tenant=tenant, **fields)


def page_keys(ns: Namespace, count: int, start: int = 0) -> list[str]:
    tokens = np.arange(start, start + count * ns.page_size)
    return ns.keys(chain_page_hashes(tokens, ns.page_size))


def _need(harness: object, *names: str) -> None:
    missing = [n for n in names if not callable(getattr(harness, n, None))]
    if missing:
        pytest.skip(f"the harness has no {' / '.join(missing)}")


def _flip_last(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 1])


class BackendConformance:
    """The tests. Subclass with a `harness` fixture (module docstring)."""

    piece_bytes_default = 256

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @pytest.fixture
    def harness(self) -> ConformanceHarness:
        raise NotImplementedError("a conformance test class defines a `harness` fixture")

    @pytest.fixture
    def tenant(self) -> str:
        return f"conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def ns(self, tenant: str) -> Namespace:
        return namespace(tenant)

    @pytest.fixture
    def opened(self, harness: ConformanceHarness) -> Iterator[Callable[..., Awaitable[Any]]]:
        """`await opened(ns, emit=None)`: a backend (sealed when `ns` has a seal, as the
        registry seals every backend). Backends a test leaves open are closed at teardown."""
        backends: list[BoundedCalls] = []

        async def open_one(ns: Namespace, emit: Callable[..., None] | None = None) -> Any:
            sink = emit if emit is not None else Events()
            made = harness.open(ns, sink)
            backend = await made if inspect.isawaitable(made) else made
            assert isinstance(backend, StorageBackend), f"{type(backend).__name__} is no backend"
            connect = getattr(backend, "connect", None)
            if callable(connect):
                await connect()
            bounded = BoundedCalls(seal_backend(backend, ns, emit=sink))
            backends.append(bounded)
            return bounded

        open_one.backends = backends  # type: ignore[attr-defined]
        yield open_one

    @pytest.fixture(autouse=True)
    async def _close_left_open(self, opened: Opener) -> AsyncIterator[None]:
        yield
        for backend in opened.backends:  # type: ignore[attr-defined]
            with anyio.fail_after(CALL_BOUND_S):
                await backend.aclose()

    @pytest.fixture
    def piece_bytes(self, harness: ConformanceHarness) -> int:
        return int(getattr(harness, "piece_bytes", self.piece_bytes_default))

    def pages(self, count: int, piece_bytes: int, seed: int) -> Pages:
        return Pages(count, piece_bytes).fill(seed)

    # -- put / get / exists ---------------------------------------------------------------

    @pytest.mark.anyio
    async def test_round_trip_batch_through_pieces(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 6)
        src = self.pages(6, piece_bytes, seed=1)
        assert await backend.set_from(keys, src.buffers(range(6))) == 6
        assert await backend.exists(keys) == 6
        dst = Pages(8, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(2, 8))) == 6
        assert [dst.page_bytes(p + 2) for p in range(6)] == [src.page_bytes(p) for p in range(6)]
        assert dst.page_bytes(0) == dst.page_bytes(1) == bytes(4 * piece_bytes)  # untouched
        stats = backend.stats()
        for counter in ("gets", "get_hits", "sets", "bytes_read", "bytes_written", "corrupt"):
            assert counter in stats, f"stats() lacks {counter!r}"
        assert (stats["gets"], stats["get_hits"], stats["sets"], stats["corrupt"]) == (6, 6, 6, 0)
        assert stats["bytes_read"] == stats["bytes_written"] == 6 * 4 * piece_bytes

    @pytest.mark.anyio
    async def test_one_piece_pages_read_into_four_pieces(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 3)
        whole = np.random.default_rng(7).integers(0, 256, (3, 4 * piece_bytes), dtype=np.uint8)
        assert await backend.set_from(keys, [[memoryview(row)] for row in whole]) == 3
        dst = Pages(3, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(3))) == 3
        assert [dst.page_bytes(p) for p in range(3)] == [row.tobytes() for row in whole]

    @pytest.mark.anyio
    async def test_partial_batches_count_the_consecutive_prefix(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 6)
        src = self.pages(6, piece_bytes, seed=2)
        assert await backend.set_from(keys, src.buffers(range(6))) == 6
        await backend.delete([keys[3]])
        assert await backend.exists(keys) == 3
        assert await backend.exists(keys[4:]) == 2
        assert await backend.exists(keys[3:]) == 0
        assert await backend.exists([]) == 0
        dst = Pages(6, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(6))) == 3
        assert [dst.page_bytes(p) for p in range(3)] == [src.page_bytes(p) for p in range(3)]
        assert await backend.get_into(keys[4:], dst.buffers(range(2))) == 2
        assert dst.page_bytes(1) == src.page_bytes(5)
        assert await backend.get_into([], []) == 0
        assert await backend.set_from([], []) == 0

    @pytest.mark.anyio
    async def test_missing_keys_are_misses_without_events(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        events = Events()
        backend = await opened(ns, events)
        keys = page_keys(ns, 3, start=1000)
        dst = Pages(3, piece_bytes)
        assert await backend.exists(keys) == 0
        assert await backend.get_into(keys, dst.buffers(range(3))) == 0
        await backend.delete(keys)  # absent keys are ignored
        assert events.named("storage.corrupt") == []
        assert backend.stats()["get_hits"] == 0

    @pytest.mark.anyio
    async def test_overwrite_replaces_the_value(
        self, harness: Any, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 2)
        first, second = self.pages(2, piece_bytes, 3), self.pages(2, piece_bytes, 4)
        assert await backend.set_from(keys, first.buffers(range(2))) == 2
        assert await backend.set_from(keys, second.buffers(range(2))) == 2
        dst = Pages(2, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(2))) == 2
        got = [dst.page_bytes(p) for p in range(2)]
        if getattr(harness, "keys_name_content", False):
            # A store that keeps the first value under a key (keys name content) may answer
            # either, but always a whole one.
            assert got in (
                [first.page_bytes(p) for p in range(2)],
                [second.page_bytes(p) for p in range(2)],
            )
        else:
            assert got == [second.page_bytes(p) for p in range(2)]

    @pytest.mark.anyio
    async def test_concurrent_writers_of_one_key_leave_one_whole_value(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        writers = [await opened(ns) for _ in range(2)]
        key = page_keys(ns, 1)
        values = [self.pages(1, piece_bytes, seed=10 + i) for i in range(4)]
        for _round in range(3):
            async with anyio.create_task_group() as tg:
                for i, value in enumerate(values):
                    tg.start_soon(writers[i % 2].set_from, key, value.buffers([0]))
            dst = Pages(1, piece_bytes)
            assert await writers[0].get_into(key, dst.buffers([0])) == 1
            assert dst.page_bytes(0) in {v.page_bytes(0) for v in values}

    @pytest.mark.anyio
    async def test_many_concurrent_round_trips(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        n = 16
        keys = page_keys(ns, n)
        src, dst = self.pages(n, piece_bytes, seed=5), Pages(n, piece_bytes)
        got: dict[int, int] = {}

        async def round_trip(i: int) -> None:
            assert await backend.set_from([keys[i]], src.buffers([i])) == 1
            got[i] = await backend.get_into([keys[i]], dst.buffers([i]))

        with anyio.fail_after(CALL_BOUND_S):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(round_trip, i)
        assert got == dict.fromkeys(range(n), 1)
        assert np.array_equal(src.data, dst.data)

    # -- corruption -----------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        "change",
        [
            pytest.param(_flip_last, id="payload-bit"),
            pytest.param(lambda v: b"XXXX" + v[4:], id="magic"),
            pytest.param(lambda v: v[: len(v) // 2], id="half"),
            pytest.param(lambda v: v[:10], id="header-cut"),
            pytest.param(lambda v: v[:-1], id="last-byte-cut"),
            pytest.param(lambda v: v + b"\0", id="extra-byte"),
        ],
    )
    async def test_corrupt_or_truncated_value_is_a_miss_an_event_and_deleted(
        self,
        harness: Any,
        opened: Opener,
        ns: Namespace,
        piece_bytes: int,
        change: Callable[[bytes], bytes],
    ) -> None:
        _need(harness, "read_raw", "write_raw")
        events = Events()
        backend = await opened(ns, events)
        keys = page_keys(ns, 3)
        src = self.pages(3, piece_bytes, seed=6)
        assert await backend.set_from(keys, src.buffers(range(3))) == 3
        raw = harness.read_raw(keys[1])
        assert raw is not None, "read_raw found no value the backend stored"
        harness.write_raw(keys[1], change(raw))
        dst = Pages(3, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(3))) == 1
        assert dst.page_bytes(0) == src.page_bytes(0)
        corrupt = events.named("storage.corrupt")
        assert [f["key"] for f in corrupt] == [keys[1]]
        assert harness.read_raw(keys[1]) is None, "a corrupt value must be deleted"
        assert await backend.exists(keys[2:]) == 1  # the neighbour is kept
        assert backend.stats()["corrupt"] == 1

    @pytest.mark.anyio
    async def test_value_moved_to_another_key_is_rejected(
        self, harness: Any, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        _need(harness, "read_raw", "write_raw")
        events = Events()
        backend = await opened(ns, events)
        keys = page_keys(ns, 2)
        assert await backend.set_from(keys, self.pages(2, piece_bytes, 8).buffers(range(2))) == 2
        harness.write_raw(keys[1], harness.read_raw(keys[0]))
        dst = Pages(1, piece_bytes)
        assert await backend.get_into(keys[1:], dst.buffers([0])) == 0
        assert [f["key"] for f in events.named("storage.corrupt")] == [keys[1]]
        assert await backend.exists(keys[:1]) == 1

    @pytest.mark.anyio
    async def test_value_of_another_page_size_is_a_miss(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 1)
        assert await backend.set_from(keys, self.pages(1, piece_bytes, 9).buffers([0])) == 1
        small = Pages(1, piece_bytes // 2)
        assert await backend.get_into(keys, small.buffers([0])) == 0
        big = Pages(1, piece_bytes * 2)
        assert await backend.get_into(keys, big.buffers([0])) == 0

    # -- deadlines and close --------------------------------------------------------------

    @pytest.mark.anyio
    async def test_calls_cancelled_at_a_deadline_leave_the_backend_usable(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 8)
        src = self.pages(8, piece_bytes, seed=11)
        assert await backend.set_from(keys[:4], src.buffers(range(4))) == 4
        dst = Pages(8, piece_bytes)
        for yields in range(4):  # cancel after 0..3 scheduling points of the calls
            with anyio.fail_after(CALL_BOUND_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(backend.get_into, keys[:4], dst.buffers(range(4)))
                    tg.start_soon(backend.set_from, keys[4:], src.buffers(range(4, 8)))
                    for _ in range(yields):
                        await anyio.lowlevel.checkpoint()
                    tg.cancel_scope.cancel()
        # Whatever a cancelled write left, a read gives the right bytes or a miss.
        got = await backend.get_into(keys, dst.buffers(range(8)))
        assert got >= 4
        assert [dst.page_bytes(p) for p in range(got)] == [src.page_bytes(p) for p in range(got)]
        assert await backend.set_from(keys[4:], src.buffers(range(4, 8))) == 4
        assert await backend.get_into(keys, dst.buffers(range(8))) == 8
        assert np.array_equal(src.data, dst.data)

    @pytest.mark.anyio
    async def test_a_stalled_store_costs_the_deadline_not_a_hang(
        self, harness: Any, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        _need(harness, "stall")
        grace = float(getattr(harness, "stall_grace", 5.0))
        backend = await opened(ns)
        keys = page_keys(ns, 4)
        src = self.pages(4, piece_bytes, seed=12)
        assert await backend.set_from(keys, src.buffers(range(4))) == 4
        deadline = 0.5
        dst = Pages(4, piece_bytes)
        with harness.stall():
            calls: list[Callable[[], Awaitable[int]]] = [
                lambda: backend.get_into(keys, dst.buffers(range(4))),
                lambda: backend.set_from(keys, src.buffers(range(4))),
                lambda: backend.exists(keys),
            ]
            for call in calls:
                with anyio.fail_after(deadline + grace), anyio.move_on_after(deadline):
                    await call()
        recovered = 0
        for _attempt in range(3):  # a backend may spend a call on reconnecting
            recovered = await backend.get_into(keys, dst.buffers(range(4)))
            if recovered == 4:
                break
        assert recovered == 4
        assert np.array_equal(src.data, dst.data)

    @pytest.mark.anyio
    async def test_close_with_operations_in_flight(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        n = 8
        keys = page_keys(ns, n)
        src = self.pages(n, piece_bytes, seed=13)
        assert await backend.set_from(keys[: n // 2], src.buffers(range(n // 2))) == n // 2
        dst = Pages(n, piece_bytes)
        results: list[tuple[str, int, object]] = []

        async def op(name: str, i: int) -> None:
            try:
                if name == "get":
                    got = await backend.get_into([keys[i]], dst.buffers([i]))
                else:
                    got = await backend.set_from([keys[i]], src.buffers([i]))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                results.append((name, i, exc))
            else:
                results.append((name, i, got))

        with anyio.fail_after(CALL_BOUND_S):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(op, "get" if i < n // 2 else "set", i)
                await anyio.lowlevel.checkpoint()
                await backend.aclose()
            await backend.aclose()  # idempotent
        errors = [r for r in results if not isinstance(r[2], int)]
        assert errors == [], f"calls in flight at close raised: {errors}"
        for name, i, got in results:
            if name == "get" and got == 1:
                assert dst.page_bytes(i) == src.page_bytes(i)

    # -- namespaces, salts, secrets -------------------------------------------------------

    @pytest.mark.anyio
    async def test_salts_model_ids_and_ranks_are_kept_apart(
        self, opened: Opener, tenant: str, ns: Namespace, piece_bytes: int
    ) -> None:
        writer = await opened(ns)
        keys = page_keys(ns, 3)
        assert await writer.set_from(keys, self.pages(3, piece_bytes, 14).buffers(range(3))) == 3
        twin = await opened(namespace(tenant))
        assert await twin.exists(keys) == 3  # same namespace, another instance: shared
        for other in (
            namespace(tenant + "-other"),
            namespace(tenant, model=MODEL + "-b"),
            namespace(tenant, rank=1, tp_size=2),
        ):
            stranger = await opened(other)
            same_tokens = page_keys(other, 3)
            assert await stranger.exists(same_tokens) == 0
            assert (
                await stranger.get_into(same_tokens, Pages(3, piece_bytes).buffers(range(3))) == 0
            )
            with pytest.raises(ValueError, match="namespace"):
                await stranger.exists(keys)  # a foreign key is a caller's bug

    @pytest.mark.anyio
    @pytest.mark.parametrize("encrypt", [False, True], ids=["tag", "aes-gcm"])
    async def test_sealed_values_round_trip_and_other_secrets_see_nothing(
        self, opened: Opener, tenant: str, piece_bytes: int, encrypt: bool
    ) -> None:
        if encrypt:
            pytest.importorskip("cryptography", reason="encryption needs `cryptography`")
        ns = namespace(tenant, seal=Seal(b"conformance-secret-1", encrypt=encrypt))
        backend = await opened(ns)
        keys = page_keys(ns, 3)
        src = self.pages(3, piece_bytes, 15)
        assert await backend.set_from(keys, src.buffers(range(3))) == 3
        dst = Pages(3, piece_bytes)
        assert await backend.get_into(keys, dst.buffers(range(3))) == 3
        assert np.array_equal(src.data, dst.data)
        other = namespace(tenant, seal=Seal(b"conformance-secret-2", encrypt=encrypt))
        assert other.prefix != ns.prefix
        assert await (await opened(other)).exists(page_keys(other, 3)) == 0

    @pytest.mark.anyio
    async def test_sealed_value_altered_in_the_store_is_rejected(
        self, harness: Any, opened: Opener, tenant: str, piece_bytes: int
    ) -> None:
        _need(harness, "read_raw", "write_raw")
        events = Events()
        ns = namespace(tenant, seal=Seal(b"conformance-secret-1"))
        backend = await opened(ns, events)
        keys = page_keys(ns, 2)
        src = self.pages(2, piece_bytes, 16)
        assert await backend.set_from(keys, src.buffers(range(2))) == 2
        harness.write_raw(keys[1], _flip_last(harness.read_raw(keys[1])))
        assert await backend.get_into(keys, Pages(2, piece_bytes).buffers(range(2))) == 1
        assert [f["key"] for f in events.named("storage.corrupt")] == [keys[1]]
        assert harness.read_raw(keys[1]) is None

    # -- clear, expiry, arguments ---------------------------------------------------------

    @pytest.mark.anyio
    async def test_clear_removes_only_its_namespace(
        self, opened: Opener, tenant: str, ns: Namespace, piece_bytes: int
    ) -> None:
        a, ns_b = await opened(ns), namespace(tenant + "-b")
        b = await opened(ns_b)
        keys_a, keys_b = page_keys(ns, 3), page_keys(ns_b, 3)
        src = self.pages(3, piece_bytes, 17)
        assert await a.set_from(keys_a, src.buffers(range(3))) == 3
        assert await b.set_from(keys_b, src.buffers(range(3))) == 3
        try:
            await a.clear()
        except NotImplementedError as exc:
            pytest.skip(f"the backend has no clear: {exc}")
        assert await a.exists(keys_a) == 0
        assert await b.exists(keys_b) == 3
        assert await a.set_from(keys_a, src.buffers(range(3))) == 3  # usable after clear

    @pytest.mark.anyio
    async def test_expiry_where_enforced(
        self, harness: Any, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 3)
        src = self.pages(3, piece_bytes, 18)
        if not enforces_ttl(backend):
            # Without expiry a ttl is dropped: the values are stored and live on.
            assert await set_from_ttl(backend, keys, src.buffers(range(3)), ttl=0.0) == 3
            assert await backend.exists(keys) == 3
            pytest.skip("the backend does not enforce a ttl (its values live until evicted)")
        assert await set_from_ttl(backend, keys, src.buffers(range(3)), ttl=3600.0) == 3
        assert await backend.exists(keys) == 3
        # A ttl <= 0 counts as stored and removes the older value (expired on arrival).
        assert await set_from_ttl(backend, keys[2:], src.buffers([2]), ttl=0.0) == 1
        assert await backend.exists(keys) == 2
        with pytest.raises(ValueError, match="ttl"):
            await set_from_ttl(backend, keys, src.buffers(range(3)), ttl=float("nan"))
        if not callable(getattr(harness, "advance", None)):
            return
        assert await set_from_ttl(backend, keys[:1], src.buffers([0]), ttl=10.0) == 1
        harness.advance(5.0)
        assert await backend.exists(keys[:1]) == 1
        harness.advance(10.0)
        assert await backend.exists(keys[:1]) == 0
        assert await backend.get_into(keys[:1], Pages(1, piece_bytes).buffers([0])) == 0
        assert await backend.exists(keys[1:2]) == 1  # written without expiry: still there

    @pytest.mark.anyio
    async def test_bad_arguments_raise_before_any_io(
        self, opened: Opener, ns: Namespace, piece_bytes: int
    ) -> None:
        backend = await opened(ns)
        keys = page_keys(ns, 2)
        src = self.pages(2, piece_bytes, 19)
        with pytest.raises(ValueError, match="2 keys but 1"):
            await backend.set_from(keys, src.buffers([0]))
        with pytest.raises(TypeError):
            await backend.set_from(keys[:1], [bytearray(8)])
        with pytest.raises(ValueError, match="read-only"):
            await backend.get_into(keys[:1], [[memoryview(bytes(4 * piece_bytes))]])
        with pytest.raises(TypeError):
            await backend.exists(keys[0])
        assert await backend.exists(keys) == 0
        assert backend.stats()["sets"] == 0


def stall_process(pid: int) -> AbstractContextManager[None]:
    """A `stall()` for harnesses whose store is a process of the test's: SIGSTOP, then SIGCONT."""
    import contextlib
    import os
    import signal

    @contextlib.contextmanager
    def stalled() -> Iterator[None]:
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    return stalled()
