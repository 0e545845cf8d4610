"""Redis / Valkey (standalone, unix socket, TLS, Cluster) as the L3 storage backend.

Ownership: a `RedisBackend` owns its client (through `RedisLink`, and so its connection pool)
and its counters; it is used from one asyncio event loop (redis.asyncio is asyncio-only). Keys
are full L3 keys and must start with the namespace prefix; the Redis key is exactly that
string, so `clear` finds the namespace by a prefix scan and namespaces never share a key.

Values are the framing header followed by the page's pieces (hicache.backends.framing). A value
that fails verification (bad magic or version, another key's value, wrong length, checksum, a
non-string Redis type) is a miss, a `storage.corrupt` event, and deleted.

Opening (`connect`, awaited by registry.connect_backend, hence by the cache at open): the
backend logs in and PINGs the server once, and raises `BackendUnavailable` (a ConnectionError)
naming the server, never the password, when it cannot reach it or is refused (wrong password or
user, a db it may not use). The spec option `lazy_connect=true` skips the check: the backend
then opens whatever the server's state, as it did before the check existed.

Failure contract (base.py): after the open, a missing value, a dropped connection, a timeout or
a restarted server is a miss or a failed write, never an exception. Every socket operation is
bounded by the spec's timeouts; a dropped connection is resent once on a fresh connection,
later calls reconnect by themselves. Events: the first unreachable-server failure after a
success emits `storage.unavailable`, the first success after it `storage.reconnected` (so an
outage costs two events, not one per call); a command the server refuses (out of memory, ACL)
emits `storage.error` per call.

A batch is cut into pipelines of at most `pipeline_bytes` page bytes (a larger page goes alone),
sent concurrently over the pool (calls.py): small pages share round trips, large ones
overlap their transfers (bench/storage_redis.py compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from hicache.backends.base import EventSink, PageBuffer, check_ttl, no_events
from hicache.backends.batch import prefix_count
from hicache.backends.framing import CorruptValue, encode_header, header_size
from hicache.backends.redis.calls import (
    Counters,
    RedisCalls,
    check_open,
    ignore,
    unlinks,
)
from hicache.backends.redis.client import FAILURES, RedisLink, is_wrong_type
from hicache.backends.redis.direct import Landed, Target, WrongLength
from hicache.backends.redis.spec import RedisSpec, parse_redis_spec
from hicache.backends.redis.values import (
    byte_views,
    explain_wrong_length,
    read_value_into,
    verify_landed,
)
from hicache.backends.redis.wire import Parts

if TYPE_CHECKING:
    from hicache.backends.keys import Namespace

__all__ = ["RedisBackend"]

_SCAN_BATCH = 1000


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisBackend:
    """StorageBackend over a Redis/Valkey server or cluster; see the module docstring."""

    def __init__(
        self, spec: RedisSpec, *, namespace: Namespace, emit: EventSink | None = None
    ) -> None:
        self.spec = spec
        self.namespace = namespace
        self._emit = emit or no_events
        self._link = RedisLink(spec)
        self._counters = Counters()
        self._calls = RedisCalls(spec, self._link, self._counters, self._emit)
        self._closed = False
        self.enforces_ttl = True  # per-value expiry: set_from(..., ttl=) sends SET ... PX
        ttl_ms = None if spec.ttl_s is None else max(1, round(spec.ttl_s * 1000))
        self._set_tail: tuple[Any, ...] = () if ttl_ms is None else ("PX", ttl_ms)
        refresh = ttl_ms is not None and spec.refresh_ttl
        self._get_head: str = "GETEX" if refresh else "GET"
        self._get_tail: tuple[Any, ...] = ("PX", ttl_ms) if refresh else ()
        if spec.tls and not spec.tls_verify:  # anyone on the path can pose as the server
            self._emit(
                "storage.tls_unverified",
                backend="redis",
                server=spec.redacted(),
                detail="verify=no: the server's certificate is not checked (testing only)",
            )

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> RedisBackend:
        """Parse `spec` plus `options` (spec.py lists every form and option). Raises
        ValueError for a bad spec; does not connect (`connect`, or else the first call, does)."""
        return cls(parse_redis_spec(spec, options), namespace=namespace, emit=emit)

    async def connect(self) -> None:
        """The open-time check: log in and PING (unless the spec says `lazy_connect`). Raises
        BackendUnavailable naming the server, never the password. Bounded by the spec's
        timeouts (and a guard over all of them)."""
        self._check_keys(())
        if not self.spec.lazy_connect:
            await check_open(self.spec, self._link)

    # --- StorageBackend ---------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        """Count of the present prefix of `keys`, asked in one round trip (per shard)."""
        self._check_keys(keys)
        self._counters.exists_calls += 1
        if not keys:
            return 0
        present = [False] * len(keys)

        def take(index: int, reply: Any) -> None:
            present[index] = reply == 1

        await self._calls.run("exists", [("EXISTS", key) for key in keys], [0] * len(keys), take)
        count = prefix_count(present)
        self._counters.probes += len(keys)
        self._counters.probe_hits += count
        return count

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        """Read, verify and copy each value into its target pieces; count of the verified
        prefix. Corrupt values are deleted; pages past the count may hold garbage."""
        self._check_keys(keys)
        if len(targets) != len(keys):
            raise ValueError(f"get_into: {len(keys)} keys but {len(targets)} targets")
        pages = [
            byte_views(t, writable=True, what=f"get_into target {i}") for i, t in enumerate(targets)
        ]
        if not keys:
            return 0
        ok = [False] * len(keys)
        corrupt: list[str] = []

        def take(index: int, value: Any) -> None:
            if value is None or (isinstance(value, BaseException) and not is_wrong_type(value)):
                return  # absent, or the call failed (already counted and reported)
            key = keys[index]
            try:
                if isinstance(value, BaseException):
                    raise CorruptValue("foreign", str(value))
                if isinstance(value, WrongLength):
                    raise explain_wrong_length(
                        key,
                        value.prefix,
                        value.length,
                        in_place[index].total - in_place[index].header_size,
                    )
                if isinstance(value, Landed):  # received in place: verify the page where it lies
                    self._counters.bytes_read += verify_landed(key, value.header, pages[index])
                else:
                    self._counters.bytes_read += read_value_into(key, value, pages[index])
                ok[index] = True
            except CorruptValue as error:
                self._counters.corrupt += 1
                self._emit("storage.corrupt", key=key, reason=error.reason, backend="redis")
                corrupt.append(key)

        commands = [(self._get_head, key, *self._get_tail) for key in keys]
        in_place = [Target(header_size(key), page) for key, page in zip(keys, pages)]
        await self._calls.run(
            "get",
            commands,
            [sum(p.nbytes for p in page) for page in pages],
            take,
            targets=in_place if self._link.reads_in_place else None,
        )
        if corrupt:
            await self._calls.run("delete", unlinks(corrupt), [0] * len(corrupt), ignore)
        hits = prefix_count(ok)
        self._counters.gets += len(keys)
        self._counters.get_hits += hits
        return hits

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        """Store each page under its key; count of the stored prefix. `ttl` (seconds) is this
        batch's expiry (`SET ... PX`), overriding the spec's `ttl`; a ttl <= 0 unlinks the key
        instead (expired on arrival) and counts as stored. Without it, the spec's ttl."""
        self._check_keys(keys)
        check_ttl(ttl)
        if len(sources) != len(keys):
            raise ValueError(f"set_from: {len(keys)} keys but {len(sources)} sources")
        pages = [
            byte_views(s, writable=False, what=f"set_from source {i}")
            for i, s in enumerate(sources)
        ]
        if not keys:
            return 0
        if not self._calls.gate.is_open():  # the server was out of memory a moment ago
            self._counters.sets += len(keys)
            self._counters.refused_pages += len(keys)
            return 0
        sizes = [sum(p.nbytes for p in page) for page in pages]
        ok = [False] * len(keys)

        def unlinked(index: int, reply: Any) -> None:
            ok[index] = isinstance(reply, int)

        def take(index: int, reply: Any) -> None:
            ok[index] = reply is True or reply in (b"OK", "OK")

        if ttl is not None and ttl <= 0:
            await self._calls.run("set", unlinks(keys), [0] * len(keys), unlinked)
        else:
            tail = self._set_tail if ttl is None else ("PX", max(1, round(ttl * 1000)))
            # The header goes before the pieces on the wire; the pieces are never joined.
            commands = [
                ("SET", key, Parts((encode_header(key, page), *page)), *tail)
                for key, page in zip(keys, pages)
            ]
            await self._calls.run(
                "set",
                commands,
                sizes,
                take,
                targets=[None] * len(commands) if self._link.reads_in_place else None,
            )
            self._counters.bytes_written += sum(size for size, done in zip(sizes, ok) if done)
        stored = prefix_count(ok)
        self._counters.sets += len(keys)
        self._counters.set_ok += stored
        return stored

    async def delete(self, keys: Sequence[str]) -> None:
        self._check_keys(keys)
        self._counters.deletes += len(keys)
        if keys:
            await self._calls.run("delete", unlinks(keys), [0] * len(keys), ignore)

    async def clear(self) -> None:
        """Remove every key under the namespace prefix (SCAN + UNLINK, on every primary)."""
        self._check_keys(())
        match = _glob_escape(self.namespace.prefix) + "*"
        calls = self._calls
        try:
            async with calls.permits:
                batch: list[str] = []
                async for key in self._link.scan(match, _SCAN_BATCH):
                    batch.append(key)
                    if len(batch) >= _SCAN_BATCH:
                        await calls.unlink_or_raise(batch)
                        batch = []
                if batch:
                    await calls.unlink_or_raise(batch)
        except FAILURES as error:
            calls.failed("clear", error)
        else:
            calls.succeeded()

    def stats(self) -> Mapping[str, int | float]:
        return asdict(self._counters)

    def accepts_writes(self) -> bool:
        """False for a backoff after the server answered OOM (reads go on)."""
        return self._calls.gate.is_open()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._link.aclose()

    async def ping(self) -> bool:
        """Whether the server answers now (emits the same events as any other call)."""
        replies: list[Any] = []
        await self._calls.run("ping", [("PING",)], [0], lambda _, reply: replies.append(reply))
        return replies in ([True], [b"PONG"])

    def _check_keys(self, keys: Sequence[str]) -> None:
        if self._closed:
            raise RuntimeError("RedisBackend used after aclose()")
        if isinstance(keys, (str, bytes)):  # a lone key would be checked character by character
            raise TypeError("keys must be a sequence of key strings, not a single string")
        prefix = self.namespace.prefix
        for key in keys:
            if not isinstance(key, str) or not key.startswith(prefix):
                raise ValueError(f"key {key!r} is not under this backend's namespace {prefix!r}")
