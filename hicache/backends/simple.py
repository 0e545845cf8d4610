"""The generic bytes path: a full StorageBackend over a store that only gets and puts bytes.

An out-of-tree store needs just `get(key) -> bytes | None` and `put(key, value)` (returning
False when it did not store the value);
`delete(key)`, `contains(key) -> bool` and `scan(prefix) -> Iterable[str]` are used when
present (`clear` needs `delete` and `scan`), and so are the batch forms `get_many(keys) ->
list[value | None]` and `put_many(keys, values) -> list[bool]` (a batch in one call, e.g. under
one lock). A store whose `put` (and `put_many`) takes `ttl=` (seconds) and
that says so with a true `enforces_ttl` gets the ttl of `set_from(..., ttl=)`; for any other
store the ttl is dropped. The adapter frames every value with
`framing.py`'s header, so a torn or foreign value is a miss, a `storage.corrupt` event and a
deletion, never KV. Unlike zero-copy backends it joins a page's pieces into one bytes object
on write and copies out of the returned bytes on read: a batch's headers, copies and
checksums in one call of the file store's compiled module where it builds (file/native.py),
page by page in Python otherwise (the same values and results).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from hicache.backends.base import EventSink, PageBuffer, check_ttl, no_events
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.blocking import BlockingRunner
from hicache.backends.file.native import native_file_io
from hicache.backends.framing import (
    CorruptValue,
    decode_header,
    encode_header,
    header_size,
    verify_payload,
)
from hicache.backends.keys import Namespace


@runtime_checkable
class SimpleStore(Protocol):
    """The least an out-of-tree store offers. Calls may block; they run in worker threads
    unless the adapter is inline. Errors raised are reported as misses, not propagated."""

    def get(self, key: str) -> bytes | bytearray | memoryview | None: ...

    def put(self, key: str, value: bytes) -> bool | None:
        """Store `value`; return False when it was not stored (None and True: stored)."""
        ...


class SimpleStoreBackend:
    """StorageBackend over a SimpleStore. Mutates only its counters and the store."""

    def __init__(
        self,
        store: SimpleStore,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        threads: int = 4,
    ) -> None:
        if not callable(getattr(store, "get", None)) or not callable(getattr(store, "put", None)):
            raise TypeError(
                f"{type(store).__name__} is not a simple store: it needs get(key) and put(key, value)"
            )
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        self.store = store
        self.namespace = namespace
        self._emit = emit or no_events
        self._runner = BlockingRunner(threads)  # writes, deletes, clears
        # Reads on threads of their own: a prefetch never queues behind a backlog of uploads.
        self._reader = BlockingRunner(threads)
        self._counters = Counters()

    @property
    def enforces_ttl(self) -> bool:
        """Whether the store expires values put with a ttl (base.ExpiringBackend)."""
        return getattr(self.store, "enforces_ttl", False) is True

    # -- protocol ------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        check_keys(self.namespace, keys)
        self._counters.exists_calls += 1
        contains = getattr(self.store, "contains", None)
        probe = contains if callable(contains) else (lambda k: self.store.get(k) is not None)
        return await self._reader.run(_count_present, probe, keys)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        self._counters.gets += len(keys)
        if callable(getattr(self.store, "get_many", None)):
            values = await self._reader.run(self._fetch_many, list(keys))
        else:
            values = await self._reader.map(self._fetch, list(keys))
        for key, value in zip(keys, values):
            if isinstance(value, Exception):
                self._error("get", key, value)
        found = [None if isinstance(v, Exception) else v for v in values]
        oks, corrupt = unframe_values(keys, found, pages, self._counters, self._emit)
        if corrupt:
            await self.delete(corrupt)
        hits = prefix_count(oks)
        self._counters.get_hits += hits
        return hits

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        """Store each page; with `ttl` (and a store that enforces it) expiring that many
        seconds from now. The stored prefix."""
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        check_ttl(ttl)
        self._counters.sets += len(keys)
        framed = frame_values(keys, pages)
        expiry = ttl if self.enforces_ttl else None
        if callable(getattr(self.store, "put_many", None)):
            results = await self._runner.run(self._store_many, list(keys), framed, expiry)
        else:
            results = await self._runner.map(
                self._store_one, [(k, v, expiry) for k, v in zip(keys, framed)]
            )
        oks = []
        written = 0
        for key, value, result in zip(keys, framed, results):
            if isinstance(result, Exception):
                self._error("set", key, result)
            ok = result is True
            if ok:
                written += len(value) - header_size(key)
            oks.append(ok)
        self._counters.set_ok += oks.count(True)
        self._counters.bytes_written += written
        return prefix_count(oks)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        delete = getattr(self.store, "delete", None)
        if not callable(delete):
            raise NotImplementedError(f"{type(self.store).__name__} has no delete(key)")
        self._counters.deletes += len(keys)
        errors = await self._runner.run(_delete_all, delete, list(keys))
        for key, exc in errors:
            self._error("delete", key, exc)

    async def clear(self) -> None:
        delete, scan = getattr(self.store, "delete", None), getattr(self.store, "scan", None)
        if not (callable(delete) and callable(scan)):
            raise NotImplementedError(
                f"{type(self.store).__name__} needs delete(key) and scan(prefix) for clear"
            )
        prefix = self.namespace.prefix

        def clear_all() -> list[tuple[str, Exception]]:
            try:
                keys = [k for k in list(scan(prefix)) if k.startswith(prefix)]
            except Exception as exc:  # noqa: BLE001
                return [(prefix, exc)]
            return _delete_all(delete, keys)

        for key, exc in await self._runner.run(clear_all):
            self._error("clear", key, exc)

    def stats(self) -> Mapping[str, int | float]:
        return self._counters.as_dict()

    async def aclose(self) -> None:
        close = getattr(self.store, "close", None)
        if callable(close):
            close()

    # -- worker-thread side: no counters, no events ---------------------------------------

    def _fetch(self, key: str) -> bytes | bytearray | memoryview | Exception | None:
        try:
            return self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss
            return exc

    def _fetch_many(
        self, keys: list[str]
    ) -> list[bytes | bytearray | memoryview | Exception | None]:
        try:
            values = list(self.store.get_many(keys))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss
            return [exc] * len(keys)
        if len(values) != len(keys):
            wrong = ValueError(f"get_many gave {len(values)} values for {len(keys)} keys")
            return [wrong] * len(keys)
        return values

    def _store_many(
        self, keys: list[str], values: list[bytes], ttl: float | None
    ) -> list[bool | Exception]:
        put_many: Callable[..., Sequence[bool | None]] = self.store.put_many  # type: ignore[attr-defined]
        try:
            results = put_many(keys, values) if ttl is None else put_many(keys, values, ttl=ttl)
        except Exception as exc:  # noqa: BLE001 - a failed store is reported, not raised
            return [exc] * len(keys)
        return [r is not False for r in results]

    def _store_one(self, item: tuple[str, bytes, float | None]) -> bool | Exception:
        key, value, ttl = item
        try:
            if ttl is not None:
                put: Callable[..., bool | None] = self.store.put
                return put(key, value, ttl=ttl) is not False
            return self.store.put(key, value) is not False
        except Exception as exc:  # noqa: BLE001 - a failed store is reported, not raised
            return exc

    def _error(self, op: str, key: str, exc: Exception) -> None:
        self._counters.errors += 1
        self._emit("storage.error", op=op, key=key, error=f"{type(exc).__name__}: {exc}")


def _count_present(probe: Callable[[str], bool], keys: Sequence[str]) -> int:
    try:
        return prefix_count(bool(probe(k)) for k in keys)
    except Exception:  # noqa: BLE001 - an unreachable store has nothing present
        return 0


def _delete_all(delete: Callable[[str], object], keys: list[str]) -> list[tuple[str, Exception]]:
    errors = []
    for k in keys:
        try:
            delete(k)
        except Exception as exc:  # noqa: BLE001
            errors.append((k, exc))
    return errors


def _frame(key: str, pieces: list[memoryview]) -> bytes:
    return b"".join([encode_header(key, pieces), *pieces])


def frame_values(keys: Sequence[str], pages: Sequence[list[memoryview]]) -> list[bytes]:
    """Each page's stored value: framing.py's header, then its pieces joined."""
    native = native_file_io()
    if native is not None:
        return native.frame_values(keys, pages)
    return [_frame(k, p) for k, p in zip(keys, pages)]


def unframe_values(
    keys: Sequence[str],
    values: Sequence[bytes | bytearray | memoryview | None],
    pages: Sequence[list[memoryview]],
    counters: Counters,
    emit: EventSink,
) -> tuple[list[bool], list[str]]:
    """Each value read (None: a miss) verified and copied into its page: (whether each
    landed, the keys whose value was corrupt, for the caller to delete). Counts the bytes
    read and the corrupt values, and emits `storage.corrupt` for each of those."""
    native = native_file_io()
    results: list[int | CorruptValue | None] | None = None
    if native is not None:
        try:
            results = native.unframe_values(keys, values, pages)
        except UnicodeEncodeError:  # a key UTF-8 cannot hold: no value can be framed as it
            results = None
    if results is None:
        results = [_unframe_result(k, v, p) for k, v, p in zip(keys, values, pages)]
    oks: list[bool] = []
    corrupt: list[str] = []
    read = 0
    for key, result in zip(keys, results):
        if result is None:
            oks.append(False)
        elif isinstance(result, CorruptValue):
            counters.corrupt += 1
            emit("storage.corrupt", key=key, reason=result.reason)
            corrupt.append(key)
            oks.append(False)
        else:
            read += result
            oks.append(True)
    counters.bytes_read += read
    return oks, corrupt


def _unframe_result(
    key: str, value: bytes | bytearray | memoryview | None, pieces: list[memoryview]
) -> int | CorruptValue | None:
    if value is None:
        return None
    try:
        return _unframe_into(key, value, pieces)
    except CorruptValue as exc:
        return exc


def _unframe_into(key: str, value: bytes | bytearray | memoryview, pieces: list[memoryview]) -> int:
    """Verify `value` as `key`'s framed page and copy its payload into `pieces`; returns the
    payload size. Raises CorruptValue (pieces may then hold part of the value)."""
    view = memoryview(value).cast("B")
    header = decode_header(view, key)
    payload = view[header.size :]
    want = sum(p.nbytes for p in pieces)
    if payload.nbytes != header.payload_len:
        raise CorruptValue(
            "truncated", f"{payload.nbytes} payload bytes, header says {header.payload_len}"
        )
    if header.payload_len != want:
        raise CorruptValue("length", f"value holds {header.payload_len} bytes, page has {want}")
    verify_payload(header, [payload])
    offset = 0
    for p in pieces:
        p[:] = payload[offset : offset + p.nbytes]
        offset += p.nbytes
    return want
