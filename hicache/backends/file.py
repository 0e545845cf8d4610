"""`file:DIR`: the embedded default L3, one file per page value on a local or shared filesystem.

Layout: `DIR/<namespace digest>/<h[0:2]>/<h[2]>/<h>` holds the value of page hash `h`
(framing.py's header, then the payload); `DIR/<namespace digest>/tmp/` holds writes in
progress. Values are created 0600, directories 0700. Guarantees:
- Atomic: a value is written to a temporary file (optionally fsynced) and renamed into place,
  so a reader sees the whole old value, the whole new one, or none. A crash leaves at most a
  temporary file, which readers never look at and which opening a backend removes once it is
  older than `stale_temp_s`.
- Verified: every read checks the header (version, key, length) and the CRC-32; a value that
  fails is a miss, a `storage.corrupt` event, and is deleted.
- Zero-copy: reads `readv` straight into the page's pieces, writes `writev` from them.
- Bounded (per namespace directory): `max_bytes`, by default what the directory holds at open
  plus `free_fraction` (0.9) of the filesystem's free space at open. Opening scans the
  directory into an LRU index (mtime order: a restart keeps what was there); reads and writes
  move a value to the recent end, and touch its mtime so other processes see the recency.
  Room is reserved before a batch is written: when it would take the total over the cap the
  backend rescans the directory (counting other writers' values) and removes expired values,
  then the least recently used, down to 0.9 x the cap (batches wait for a running eviction,
  or for writes in flight to land when those alone fill the cap). It also rescans after
  writing 0.1 x cap since its last scan, so P processes sharing a directory keep it within
  cap + (P - 1) x (0.1 x cap + one batch) (docs/backends.md).
- Expiry: `set_from(..., ttl=s)` values are misses `s` seconds later on `clock`, and removed by
  the next read, rescan or `sweep()`; the deadline lives in the file's atime (file_index.py).
- Self-healing directories: a write whose temporary directory (or the namespace directory)
  has been deleted under it recreates it and goes on; shard directories likewise.
- Failing writes are loud once: each failed write is a `storage.error` event; after
  `failure_streak` consecutive failed page writes the backend also emits
  `storage.writes_failing` (once per streak), and on the next success `storage.writes_recovered`.

Blocking calls run in worker threads under a limiter of `threads` (or inline with threads=0);
file_io.py holds them.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import anyio

from hicache.backends.base import PageBuffer, check_ttl
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.blocking import BlockingRunner
from hicache.backends.file_index import (
    TMP_DIR,
    FileIndex,
    check_options,
    default_cap,
    expiry_to_atime_ns,
    marks_survive,
    plain_atime_ns,
    scan,
    seconds_to_ns,
)
from hicache.backends.file_io import (
    Expired,
    Read,
    clean_temps,
    clear_values,
    count_present,
    make_dirs,
    read_value,
    unlink_all,
    write_value,
)
from hicache.backends.framing import CorruptValue, header_size
from hicache.backends.keys import Namespace
from hicache.backends.simple import EventSink, _no_events

_LOW_WATER = 0.9  # eviction goes down to this share of the cap; 1 - it is the rescan period
_OPTIONS = {
    "fsync",
    "max_bytes",
    "free_fraction",
    "threads",
    "stale_temp_s",
    "failure_streak",
    "clock",
}


def value_path(root: str | os.PathLike[str], namespace_digest: str, page_hash: str) -> str:
    """Where the value of `page_hash` lives under `root` for one namespace."""
    # 256 x 16 leaf directories: few enough that a young store does not create one per page.
    return os.path.join(root, namespace_digest, page_hash[:2], page_hash[2:3], page_hash)


class FileBackend:
    """StorageBackend over a directory. Owns its counters, its LRU index and its temporary
    files; shares value files with any other instance over the same directory."""

    # Under a virtual clock (deterministic caches) its file calls run inline, not in threads.
    VIRTUAL_TIME_OPTIONS: ClassVar[Mapping[str, object]] = {"threads": 0}

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        fsync: bool = False,
        max_bytes: int | None = None,
        free_fraction: float = 0.9,
        threads: int = 4,
        stale_temp_s: float = 600.0,
        failure_streak: int = 8,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        check_options(max_bytes, free_fraction, stale_temp_s, failure_streak, clock)
        self.namespace = namespace
        self.root = os.fspath(root)
        self.fsync = bool(fsync)
        self._emit = emit or _no_events
        self._clock = clock
        self._runner = BlockingRunner(threads)
        self._temp_seq = itertools.count()
        self._counters = Counters()
        self._expired = 0  # values found or swept expired
        # Consecutive failed page writes (loop side); the streak is reported once it reaches
        # `failure_streak`, and its end once a write succeeds again.
        self.failure_streak = failure_streak
        self._failed_writes = 0
        self._streaks = 0
        self._dir = os.path.join(self.root, namespace.digest)
        self._tmp = os.path.join(self._dir, TMP_DIR)
        try:
            make_dirs(self._tmp)
        except OSError as exc:
            raise ValueError(f"file backend cannot create directory {self._tmp!r}: {exc}") from exc
        clean_temps(self._tmp, stale_temp_s)
        # Expiry marks need nanosecond atimes: where they do not survive, a ttl is not enforced.
        self.enforces_ttl = marks_survive(self._tmp)
        self._index = FileIndex()
        self._evicting: anyio.Event | None = None  # set while an eviction runs
        self._landed: anyio.Event | None = None  # set when a batch's writes end (if awaited)
        self.max_bytes = 1  # set below, once the scan knows what the directory holds
        self._rescan_bytes = 1
        self._expired += self._sweep_sync(None)[1]
        self.max_bytes = (
            max_bytes
            if max_bytes is not None
            else default_cap(self._dir, self._index.stored, free_fraction)
        )
        self._rescan_bytes = max(1, int(self.max_bytes * (1 - _LOW_WATER)))

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> FileBackend:
        """Spec `file:DIR`. Options: fsync, max_bytes, free_fraction, threads (0 = inline),
        stale_temp_s, failure_streak, clock."""
        if not isinstance(spec, str) or not spec.startswith("file:") or len(spec) == len("file:"):
            raise ValueError(f"file backend spec must be file:DIR, got {spec!r}")
        if set(options) - _OPTIONS:
            raise TypeError(
                f"unknown file backend options {sorted(set(options) - _OPTIONS)}; "
                f"known: {sorted(_OPTIONS)}"
            )
        return cls(spec[len("file:") :], namespace=namespace, emit=emit, **options)

    # -- protocol ------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        check_keys(self.namespace, keys)
        paths = [self._path(k) for k in keys]
        self._counters.exists_calls += 1
        return await self._runner.run(count_present, paths, self._clock())

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        now = self._clock()
        jobs = [(k, self._path(k), p, now, seconds_to_ns(now)) for k, p in zip(keys, pages)]
        self._counters.gets += len(jobs)
        results = await self._runner.map(read_value, jobs)
        oks = []
        for (key, *_), result in zip(jobs, results):
            if isinstance(result, Read):
                self._counters.bytes_read += result.payload
                self._index.put(_hash(key), result.file_size, result.expiry)
            elif isinstance(result, Expired):
                self._expired += 1
                self._index.forget(_hash(key))
            elif isinstance(result, CorruptValue):
                self._counters.corrupt += 1
                self._emit("storage.corrupt", key=key, reason=result.reason)
                self._index.forget(_hash(key))
            elif isinstance(result, Exception):
                self._error("get", key, result)
            oks.append(isinstance(result, Read))
        hits = prefix_count(oks)
        self._counters.get_hits += hits
        return hits

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        """Store each page (expiring `ttl` seconds from now, if given); the stored prefix."""
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        check_ttl(ttl)
        self._counters.sets += len(keys)
        now = self._clock()
        if ttl is not None and ttl <= 0:  # expired on arrival: nothing to keep, nor the old one
            for key in keys:
                self._index.forget(_hash(key))
            for path, exc in await self._runner.run(unlink_all, [self._path(k) for k in keys]):
                self._error("set", path, exc)
            self._counters.set_ok += len(keys)
            return len(keys)
        sizes = [header_size(k) + sum(p.nbytes for p in page) for k, page in zip(keys, pages)]
        # A batch larger than the whole cap stores the prefix that fits.
        fit = prefix_count(total <= self.max_bytes for total in itertools.accumulate(sizes))
        need = sum(sizes[:fit])
        await self._make_room(need)
        expiry = None if ttl is None else now + ttl
        now_ns = seconds_to_ns(now)
        times = (
            expiry_to_atime_ns(expiry) if expiry is not None else plain_atime_ns(now_ns),
            now_ns,
        )
        jobs = [
            (k, self._path(k), self._temp_path(k), p, self.fsync, times)
            for k, p in zip(keys[:fit], pages[:fit])
        ]
        hashes = [_hash(k) for k in keys[:fit]]
        self._index.reserve(hashes, need)  # counted from now: the cap holds while they are written
        try:
            results = await self._runner.map(write_value, jobs)
        finally:
            self._index.release(hashes, need)
            if self._landed is not None:
                self._landed.set()
                self._landed = None
        oks = []
        for (key, *_), result in zip(jobs, results):
            if isinstance(result, Exception):
                self._error("set", key, result)
                self._write_failed(result)
                oks.append(False)
                continue
            self._write_succeeded()
            size, payload = result
            self._counters.set_ok += 1
            self._counters.bytes_written += payload
            self._index.put(_hash(key), size, expiry)
            oks.append(True)
        return prefix_count(oks)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        self._counters.deletes += len(keys)
        for key in keys:
            self._index.forget(_hash(key))
        for path, exc in await self._runner.run(unlink_all, [self._path(k) for k in keys]):
            self._error("delete", path, exc)

    async def clear(self) -> None:
        """Remove this namespace's values (and stale temporary files); other namespaces
        under the same directory are untouched."""
        await self._runner.run(clear_values, self._dir)
        self._index.clear()

    async def sweep(self) -> int:
        """Rescan the directory now, remove expired values (and least recently used ones if
        the directory is over the cap); how many values were removed."""
        while self._evicting is not None:
            await self._evicting.wait()
        return await self._evict(0)

    def stats(self) -> Mapping[str, int | float]:
        out: dict[str, int | float] = dict(self._counters.as_dict())
        out["write_failure_streaks"] = self._streaks
        out["stored_bytes"] = self._index.stored
        out["peak_stored_bytes"] = self._index.peak
        out["max_bytes"] = self.max_bytes
        out["expired"] = self._expired
        return out

    async def aclose(self) -> None:
        return None  # no open handles between calls

    # -- the cap -------------------------------------------------------------------------

    async def _make_room(self, need: int) -> None:
        """Before writing `need` bytes: wait out a running eviction (its victims may still be
        on disk), then evict if the bytes would take the total over the cap, or rescan if this
        instance has written a rescan period's worth since its last scan."""
        index = self._index
        while True:
            while self._evicting is not None:  # its victims may still be on disk: let it finish
                await self._evicting.wait()
            if (
                index.total + need <= self.max_bytes
                and index.unscanned + need <= self._rescan_bytes
            ):
                return
            await self._evict(need)  # down to the low-water mark, counting writes in flight
            if index.total + need <= self.max_bytes:
                return
            if index.reserved:
                # Writes in flight fill the cap: once one lands, its values can be evicted.
                self._landed = self._landed or anyio.Event()
                await self._landed.wait()
            # Otherwise writes in flight when the eviction chose its victims landed before it
            # ended: their values are stored now, not reserved, and evictable. Evict again
            # (never return over the cap just because nothing is in flight any more).

    async def _evict(self, need: int) -> int:
        self._evicting = done = anyio.Event()
        try:
            removed, expired = await self._runner.run(self._sweep_sync, need)
        finally:
            self._evicting = None
            done.set()
        self._counters.evictions += removed
        self._expired += expired
        if removed:
            self._emit(
                "storage.evicted",
                values=removed,
                expired=expired,
                stored_bytes=self._index.stored,
            )
        return removed

    def _sweep_sync(self, need: int | None) -> tuple[int, int]:
        """Worker thread (or the constructor, with need=None: no cap yet): rebuild the index
        from the directory, drop expired values and, if `need` more bytes would pass the cap,
        the least recently used down to the low-water mark. Returns (removed, of which
        expired)."""
        index = self._index
        index.begin_scan()
        index.replace(scan(self._dir))
        limit = None
        if need is not None and index.total + need > self.max_bytes:
            limit = max(0, int(self.max_bytes * _LOW_WATER) - need)
        victims, expired = index.take_victims(self._clock(), limit)
        digest = self.namespace.digest
        unlink_all([value_path(self.root, digest, h) for h in victims])
        return len(victims), expired

    # -- helpers (loop side unless noted) ---------------------------------------------------

    def _path(self, key: str) -> str:
        return value_path(self.root, self.namespace.digest, self.namespace.page_hash_of(key))

    def _temp_path(self, key: str) -> str:
        # unique without a syscall: pid, this instance, a counter (next() is atomic under the GIL)
        name = f"{_hash(key)}.{os.getpid()}.{id(self):x}.{next(self._temp_seq)}.tmp"
        return os.path.join(self._tmp, name)

    def _error(self, op: str, key: str, exc: Exception) -> None:
        self._counters.errors += 1
        self._emit("storage.error", op=op, key=key, error=f"{type(exc).__name__}: {exc}")

    def _write_failed(self, exc: Exception) -> None:
        self._failed_writes += 1
        if self._failed_writes == self.failure_streak:
            self._streaks += 1
            self._emit(
                "storage.writes_failing",
                directory=self._dir,
                failures=self._failed_writes,
                error=f"{type(exc).__name__}: {exc}",
            )

    def _write_succeeded(self) -> None:
        if self._failed_writes >= self.failure_streak:
            self._emit(
                "storage.writes_recovered", directory=self._dir, failures=self._failed_writes
            )
        self._failed_writes = 0


def _hash(key: str) -> str:
    return key.rsplit(":", 1)[1]


__all__ = ["FileBackend", "value_path"]
