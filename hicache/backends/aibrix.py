"""`aibrix:DIR`: page values in AIBrix KVCache's local L2 connector (RocksDB).

[AIBrix KVCache](https://github.com/vllm-project/aibrix) (`aibrix-kvcache`) offloads KV cache
through pluggable L2 connectors; its local one keeps values in a RocksDB database under a
directory. This backend drives that connector through its Python API (`open`, and the async
`exists`, `get`, `put`, `delete`, each run on the connector's own thread pool): values are the
standard framed values (framing.py: header, then the page), put from and got into AIBrix
`MemoryRegion`s, and checked on read like every backend's (a value that fails is a miss, a
`storage.corrupt` event, and is deleted). The connector copies each value once each way (its
RocksDB put takes the region's bytes, its get fills the region), so this backend joins a page's
pieces on write and copies them out on read.

The connector's API runs on asyncio (it awaits `loop.run_in_executor`), so this backend does
too, like the Redis one. RocksDB lets one process open a database: instances of this backend
in one process share one open connector per directory; another process needs its own
directory. The connector has no key scan, so `clear` is not available (NotImplementedError);
its time-to-live (`ttl=`) is database-wide and enforced at compaction, so `enforces_ttl` is
false.

`aibrix-kvcache` pins `redis==6.0.0` (and pulls rocksdict, pyroscope-io, uvloop, nvtx), which
clashes with the Redis backend's newer redis-py: install it in a venv of its own
(`make aibrix-env`), where its tests run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio

from hicache.backends.base import BackendUnavailable, EventSink, PageBuffer, no_events
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.framing import header_size
from hicache.backends.keys import Namespace
from hicache.backends.simple import _frame, unframe_values
from hicache.backends.spec_options import integer, split_dir_spec

_OPTIONS = frozenset({"threads", "ttl"})


def aibrix_missing() -> str | None:
    """Why AIBrix KVCache's RocksDB connector cannot be imported here, or None."""
    try:
        from aibrix_kvcache.l2.connectors.rocksdb import RocksDBConnector  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - absent, or present without its native parts
        return f"aibrix-kvcache is not importable ({type(exc).__name__}: {exc}); `make aibrix-env`"
    return None


class _Shared:
    """One open connector per database directory in this process (RocksDB's lock allows one),
    counted by the backends using it."""

    lock = threading.Lock()
    open: dict[str, tuple[Any, ThreadPoolExecutor, int]] = {}  # noqa: RUF012 - one per process


def _acquire(path: str, threads: int, ttl: int | None) -> Any:
    with _Shared.lock:
        held = _Shared.open.get(path)
        if held is not None:
            conn, pool, users = held
            _Shared.open[path] = (conn, pool, users + 1)
            return conn
        import rocksdict
        from aibrix_kvcache.l2.connectors.rocksdb import RocksDBConnector

        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        access = rocksdict.AccessType.read_write()
        if ttl is not None:
            access = access.with_ttl(ttl)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="hicache-aibrix")
        conn = RocksDBConnector(path, opts, access, pool)
        status = conn.open()
        if not status.is_ok():
            pool.shutdown(wait=False)
            raise OSError(f"the RocksDB connector did not open {path!r}: {status}")
        _Shared.open[path] = (conn, pool, 1)
        return conn


def _release(path: str) -> None:
    with _Shared.lock:
        conn, pool, users = _Shared.open[path]
        if users > 1:
            _Shared.open[path] = (conn, pool, users - 1)
            return
        del _Shared.open[path]
    pool.shutdown(wait=True)
    conn.close()


def _regions() -> tuple[type, type]:
    """AIBrix MemoryRegion subclasses: one over a buffer hicache owns (nothing to free), and
    one that receives whatever value a get finds, of any length (the connector's own `fill`
    insists on the region's length, which would turn a truncated value into an error instead
    of a corrupt one)."""
    import torch
    from aibrix_kvcache.memory import MemoryRegion

    class Owned(MemoryRegion):  # type: ignore[misc]
        def __init__(self, data: bytearray) -> None:
            super().__init__(torch.frombuffer(data, dtype=torch.uint8), 0, len(data))

        def destroy_unsafe(self) -> None:
            return None

    class Landing(MemoryRegion):  # type: ignore[misc]
        def __init__(self, length: int) -> None:
            super().__init__(torch.empty(0, dtype=torch.uint8), 0, length)
            self.value: bytes | None = None

        def fill(self, data: bytes) -> None:
            self.value = bytes(data)

        def destroy_unsafe(self) -> None:
            return None

    return Owned, Landing


class AibrixBackend:
    """StorageBackend over AIBrix KVCache's RocksDB connector; see the module docstring."""

    def __init__(
        self,
        root: str,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        threads: int = 4,
        ttl: int | None = None,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"aibrix option threads must be an int >= 1, got {threads!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"aibrix option ttl must be whole seconds > 0, got {ttl!r}")
        self.namespace = namespace
        self.path = os.path.abspath(root)
        self._threads, self._ttl = threads, ttl
        self._emit = emit or no_events
        self._counters = Counters()
        self._conn: Any = None
        self._opening: anyio.Lock | None = None  # the first calls at once take one share
        self._closed = False
        self._inflight = 0  # calls using the connector; close waits for them
        self._idle: anyio.Event | None = None

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> AibrixBackend:
        """Spec `aibrix:DIR[?threads=4&ttl=SECONDS]` (keywords override the query)."""
        split = split_dir_spec(
            spec, "aibrix", known=_OPTIONS, options=options, example="aibrix:/var/cache/kv"
        )
        given = split.values
        ttl = given.get("ttl")
        return cls(
            split.root,
            namespace=namespace,
            emit=emit,
            threads=integer(given.get("threads", 4), "aibrix option threads", lo=1),
            ttl=None if ttl is None else integer(ttl, "aibrix option ttl", lo=1),
        )

    async def connect(self) -> None:
        """Open (or share) the connector; BackendUnavailable when AIBrix is missing or the
        database cannot be opened (e.g. another process holds it)."""
        try:
            await self._ready()
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(f"aibrix store {self.path!r} cannot open: {exc}") from exc

    async def _ready(self) -> Any:
        if self._conn is None:
            self._opening = self._opening or anyio.Lock()  # made in the loop that uses it
            async with self._opening:
                if self._conn is None:
                    os.makedirs(self.path, mode=0o700, exist_ok=True)
                    self._conn = await anyio.to_thread.run_sync(
                        _acquire, self.path, self._threads, self._ttl
                    )
        return self._conn

    # -- protocol -------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        self._inflight += 1
        try:
            return await self._exists(keys)
        finally:
            self._done()

    async def _exists(self, keys: Sequence[str]) -> int:
        check_keys(self.namespace, keys)
        self._counters.exists_calls += 1
        if self._closed or not keys:
            return 0
        conn = await self._ready()
        present = 0
        for key in keys:  # the first absent one ends the count: no need to ask further
            status = await conn.exists(key.encode())
            if not status.is_ok():
                break
            present += 1
        return present

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        self._inflight += 1
        try:
            return await self._get_into(keys, targets)
        finally:
            self._done()

    async def _get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        self._counters.gets += len(keys)
        if self._closed or not keys:
            return 0
        conn = await self._ready()
        _, landing_type = _regions()
        landings = [
            landing_type(header_size(k) + sum(p.nbytes for p in page))
            for k, page in zip(keys, pages)
        ]
        statuses: list[Any] = [None] * len(keys)

        async def fetch(i: int) -> None:
            statuses[i] = await conn.get(keys[i].encode(), landings[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(keys)):
                tg.start_soon(fetch, i)
        for key, status in zip(keys, statuses):
            if not status.is_ok() and not status.is_not_found():
                self._error("get", key, status)
        found = [
            landing.value if status.is_ok() else None for status, landing in zip(statuses, landings)
        ]
        oks, corrupt = unframe_values(keys, found, pages, self._counters, self._emit)
        if corrupt:
            await self.delete(corrupt)
        hits = prefix_count(oks)
        self._counters.get_hits += hits
        return hits

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        self._inflight += 1
        try:
            return await self._set_from(keys, sources)
        finally:
            self._done()

    async def _set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        self._counters.sets += len(keys)
        if self._closed or not keys:
            return 0
        conn = await self._ready()
        owned_type, _ = _regions()
        regions = [owned_type(bytearray(_frame(k, p))) for k, p in zip(keys, pages)]
        statuses: list[Any] = [None] * len(keys)

        async def store(i: int) -> None:
            statuses[i] = await conn.put(keys[i].encode(), regions[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(keys)):
                tg.start_soon(store, i)
        oks = []
        for key, status, pieces in zip(keys, statuses, pages):
            ok = bool(status.is_ok())
            if ok:
                self._counters.set_ok += 1
                self._counters.bytes_written += sum(p.nbytes for p in pieces)
            else:
                self._error("set", key, status)
            oks.append(ok)
        return prefix_count(oks)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        self._counters.deletes += len(keys)
        if self._closed or not keys:
            return
        conn = await self._ready()
        for key in keys:
            status = await conn.delete(key.encode())
            if not status.is_ok() and not status.is_not_found():
                self._error("delete", key, status)

    async def clear(self) -> None:
        raise NotImplementedError(
            "the AIBrix RocksDB connector has no key scan: clear is not available "
            "(remove the aibrix directory while no process has it open)"
        )

    def stats(self) -> Mapping[str, int | float]:
        return self._counters.as_dict()

    async def aclose(self) -> None:
        """Wait for the calls in flight, then release this instance's share of the connector
        (closed with its last user). Idempotent; later calls are misses."""
        if self._closed:
            return
        self._closed = True
        while self._inflight:
            self._idle = self._idle or anyio.Event()
            await self._idle.wait()
        if self._conn is not None:
            self._conn = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_release, self.path)

    def _done(self) -> None:
        self._inflight -= 1
        if not self._inflight and self._idle is not None:
            self._idle.set()
            self._idle = None

    def _error(self, op: str, key: str, status: Any) -> None:
        self._counters.errors += 1
        self._emit("storage.error", op=op, key=key, error=str(status))
