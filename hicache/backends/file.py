"""`file:DIR`: the embedded default L3, one file per page value on a local or shared filesystem.

Layout: `DIR/<namespace digest>/<h[0:2]>/<h[2]>/<h>` holds the value of page hash `h`
(framing.py's header, then the payload); `DIR/<namespace digest>/tmp/` holds writes in
progress. Guarantees:
- Atomic: a value is written to a temporary file (optionally fsynced) and renamed into place,
  so a reader sees the whole old value, the whole new one, or none. A crash leaves at most a
  temporary file, which readers never look at and which opening a backend removes once it is
  older than `stale_temp_s`.
- Verified: every read checks the header (version, key, length) and the CRC-32; a value that
  fails is a miss, a `storage.corrupt` event, and is deleted.
- Zero-copy: reads `readv` straight into the page's pieces, writes `writev` from them.
- Size cap (`max_bytes`, per namespace directory): each instance indexes the value files it
  knows (a scan at open, then its own writes). When a write takes that total over the cap, it
  rescans the directory (counting other writers' files, forgetting removed ones) and deletes
  the oldest values by modification time until the total is at most 0.9 x the cap. With
  several writers the directory may exceed the cap by what others wrote since the last scan.
- Self-healing directories: a write whose temporary directory (or the namespace directory)
  has been deleted under it recreates it and goes on; shard directories likewise.
- Failing writes are loud once: each failed write is a `storage.error` event; after
  `failure_streak` consecutive failed page writes the backend also emits
  `storage.writes_failing` (once per streak), and on the next success `storage.writes_recovered`.

Blocking calls run in worker threads under a limiter of `threads` (or inline with threads=0).
"""

from __future__ import annotations

import heapq
import itertools
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from hicache.backends.base import PageBuffer
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.blocking import BlockingRunner
from hicache.backends.framing import CorruptValue, checksum, decode_header, header_size, pack_header
from hicache.backends.keys import Namespace
from hicache.backends.simple import EventSink, _no_events

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_LOW_WATER = 0.9
_CHUNK = 512 * 1024  # read/write + checksum granularity: small enough to stay in cache
_TMP = "tmp"
_OPEN_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def value_path(root: str | os.PathLike[str], namespace_digest: str, page_hash: str) -> str:
    """Where the value of `page_hash` lives under `root` for one namespace."""
    # 256 x 16 leaf directories: few enough that a young store does not create one per page.
    return os.path.join(root, namespace_digest, page_hash[:2], page_hash[2:3], page_hash)


class FileBackend:
    """StorageBackend over a directory. Owns its counters, its size index and its temporary
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
        threads: int = 4,
        stale_temp_s: float = 600.0,
        failure_streak: int = 8,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
        ):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        if not isinstance(stale_temp_s, (int, float)) or stale_temp_s < 0:
            raise ValueError(f"stale_temp_s must be a number >= 0, got {stale_temp_s!r}")
        if (
            isinstance(failure_streak, bool)
            or not isinstance(failure_streak, int)
            or failure_streak < 1
        ):
            raise ValueError(f"failure_streak must be a positive int, got {failure_streak!r}")
        self.namespace = namespace
        self.root = os.fspath(root)
        self.fsync = bool(fsync)
        self.max_bytes = max_bytes
        self._emit = emit or _no_events
        self._runner = BlockingRunner(threads)
        self._temp_seq = itertools.count()
        self._counters = Counters()
        # Consecutive failed page writes (loop side); the streak is reported once it reaches
        # `failure_streak`, and its end once a write succeeds again.
        self.failure_streak = failure_streak
        self._failed_writes = 0
        self._streaks = 0
        self._dir = os.path.join(self.root, namespace.digest)
        self._tmp = os.path.join(self._dir, _TMP)
        try:
            os.makedirs(self._tmp, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"file backend cannot create directory {self._tmp!r}: {exc}") from exc
        self._clean_temps(stale_temp_s)
        # Size index (only with a cap): page hash -> (mtime_ns, size); guarded by _index_lock.
        self._index_lock = threading.Lock()
        self._index: dict[str, tuple[int, int]] = {}
        self._indexed_bytes = 0
        self._evicting = False
        if max_bytes is not None:
            self._rescan()

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> FileBackend:
        """Spec `file:DIR`. Options: fsync, max_bytes, threads (0 = inline), stale_temp_s,
        failure_streak."""
        if not isinstance(spec, str) or not spec.startswith("file:") or len(spec) == len("file:"):
            raise ValueError(f"file backend spec must be file:DIR, got {spec!r}")
        known = {"fsync", "max_bytes", "threads", "stale_temp_s", "failure_streak"}
        if set(options) - known:
            raise TypeError(
                f"unknown file backend options {sorted(set(options) - known)}; known: {sorted(known)}"
            )
        return cls(spec[len("file:") :], namespace=namespace, emit=emit, **options)

    # -- protocol ------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        check_keys(self.namespace, keys)
        paths = [self._path(k) for k in keys]
        self._counters.exists_calls += 1
        return await self._runner.run(_count_existing, paths)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        jobs = [(k, self._path(k), p) for k, p in zip(keys, pages)]
        self._counters.gets += len(jobs)
        results = await self._runner.map(_read_value, jobs)
        oks = []
        for (key, _, _), result in zip(jobs, results):
            if isinstance(result, int):
                self._counters.bytes_read += result
            elif isinstance(result, CorruptValue):
                self._counters.corrupt += 1
                self._emit("storage.corrupt", key=key, reason=result.reason)
                self._forget(key)
            elif isinstance(result, Exception):
                self._error("get", key, result)
            oks.append(isinstance(result, int))
        hits = prefix_count(oks)
        self._counters.get_hits += hits
        return hits

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        jobs = [(k, self._path(k), self._temp_path(k), p, self.fsync) for k, p in zip(keys, pages)]
        self._counters.sets += len(jobs)
        results = await self._runner.map(_write_value, jobs)
        oks = []
        for (key, *_), result in zip(jobs, results):
            if isinstance(result, Exception):
                self._error("set", key, result)
                self._write_failed(result)
                oks.append(False)
                continue
            self._write_succeeded()
            size, mtime_ns, payload = result
            self._counters.set_ok += 1
            self._counters.bytes_written += payload
            if self.max_bytes is not None:
                self._remember(key, mtime_ns, size)
            oks.append(True)
        if (
            self.max_bytes is not None
            and self._indexed_bytes > self.max_bytes
            and not self._evicting
        ):
            self._evicting = True
            try:
                evicted = await self._runner.run(self._enforce_cap)
            finally:
                self._evicting = False
            self._counters.evictions += evicted
            if evicted:
                self._emit("storage.evicted", values=evicted, stored_bytes=self._indexed_bytes)
        return prefix_count(oks)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        self._counters.deletes += len(keys)
        for key in keys:
            self._forget(key)
        for path, exc in await self._runner.run(_unlink_all, [self._path(k) for k in keys]):
            self._error("delete", path, exc)

    async def clear(self) -> None:
        """Remove this namespace's values (and stale temporary files); other namespaces
        under the same directory are untouched."""
        await self._runner.run(self._clear_sync)
        with self._index_lock:
            self._index.clear()
            self._indexed_bytes = 0

    def stats(self) -> Mapping[str, int | float]:
        out: dict[str, int | float] = dict(self._counters.as_dict())
        out["write_failure_streaks"] = self._streaks
        if self.max_bytes is not None:
            out["stored_bytes"] = self._indexed_bytes
        return out

    async def aclose(self) -> None:
        return None  # no open handles between calls

    # -- helpers (loop side unless noted) ---------------------------------------------------

    def _path(self, key: str) -> str:
        page_hash = self.namespace.page_hash_of(key)
        return value_path(self.root, self.namespace.digest, page_hash)

    def _temp_path(self, key: str) -> str:
        # unique without a syscall: pid, this instance, a counter (next() is atomic under the GIL)
        name = f"{key.rsplit(':', 1)[1]}.{os.getpid()}.{id(self):x}.{next(self._temp_seq)}.tmp"
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

    def _remember(self, key: str, mtime_ns: int, size: int) -> None:
        page_hash = key.rsplit(":", 1)[1]
        with self._index_lock:
            old = self._index.pop(page_hash, None)
            self._indexed_bytes += size - (old[1] if old else 0)
            self._index[page_hash] = (mtime_ns, size)

    def _forget(self, key: str) -> None:
        if self.max_bytes is None:
            return
        with self._index_lock:
            old = self._index.pop(key.rsplit(":", 1)[1], None)
            if old:
                self._indexed_bytes -= old[1]

    def _rescan(self) -> None:
        """Rebuild the size index from the directory (worker thread or constructor)."""
        index: dict[str, tuple[int, int]] = {}
        for top in _scandir_dirs(self._dir):
            if top.name == _TMP:
                continue
            for mid in _scandir_dirs(top.path):
                for entry in _scandir_files(mid.path):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    index[entry.name] = (st.st_mtime_ns, st.st_size)
        with self._index_lock:
            self._index = index
            self._indexed_bytes = sum(size for _, size in index.values())

    def _enforce_cap(self) -> int:
        """Worker thread: rescan, then delete oldest values down to the low-water mark."""
        assert self.max_bytes is not None
        self._rescan()
        target = int(self.max_bytes * _LOW_WATER)
        with self._index_lock:
            if self._indexed_bytes <= self.max_bytes:
                return 0
            excess = self._indexed_bytes - target
            victims = []
            for _mtime_ns, page_hash, size in heapq.nsmallest(
                len(self._index), ((m, h, s) for h, (m, s) in self._index.items())
            ):
                if excess <= 0:
                    break
                victims.append(page_hash)
                excess -= size
                self._indexed_bytes -= size
                del self._index[page_hash]
        for page_hash in victims:
            try:
                os.unlink(value_path(self.root, self.namespace.digest, page_hash))
            except FileNotFoundError:
                pass
        return len(victims)

    def _clear_sync(self) -> None:
        for top in _scandir_dirs(self._dir):
            if top.name != _TMP:
                shutil.rmtree(top.path, ignore_errors=True)
        self._clean_temps(0.0)

    def _clean_temps(self, older_than_s: float) -> None:
        cutoff = time.time() - older_than_s
        for entry in _scandir_files(self._tmp):
            try:
                if entry.stat().st_mtime <= cutoff:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass


# -- worker-thread functions: plain I/O, results returned, no counters or events -------------


def _count_existing(paths: list[str]) -> int:
    return prefix_count(os.path.exists(p) for p in paths)


def _read_value(job: tuple[str, str, list[memoryview]]) -> int | CorruptValue | OSError | None:
    """Read and verify one value into its pieces: payload size, None (absent), the
    CorruptValue (file already deleted), or the OSError. The payload is read and checksummed
    a chunk at a time, so the checksum reads bytes still in the CPU cache."""
    key, path, pieces = job
    try:
        fd = os.open(path, _OPEN_READ)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    try:
        head = memoryview(bytearray(header_size(key)))
        chunks = _chunks(pieces)
        first = chunks[0] if chunks else []
        file_size = os.fstat(fd).st_size
        got = _readv_all(fd, [head, *first])
        header = decode_header(head[: min(got, head.nbytes)], key)
        want = sum(p.nbytes for p in pieces)
        if file_size - header.size != header.payload_len:
            raise CorruptValue(
                "truncated",
                f"{file_size - header.size} payload bytes, header says {header.payload_len}",
            )
        if header.payload_len != want:
            raise CorruptValue("length", f"value holds {header.payload_len} bytes, page has {want}")
        crc = checksum(first)
        for chunk in chunks[1:]:
            got += _readv_all(fd, chunk)
            crc = checksum(chunk, crc)
        if got != header.size + want:
            raise CorruptValue("truncated", f"read {got - header.size} of {want} payload bytes")
        if crc != header.crc32:
            raise CorruptValue("checksum", f"checksum mismatch for {key!r}")
        return want
    except CorruptValue as exc:
        _unlink_quietly(path)
        return exc
    except OSError as exc:
        return exc
    finally:
        os.close(fd)


def _write_value(
    job: tuple[str, str, str, list[memoryview], bool],
) -> tuple[int, int, int] | OSError:
    """Write one value through a temporary file and rename: (file size, mtime_ns, payload)
    or the OSError (the temporary file then removed). The payload goes first, a chunk at a
    time right after checksumming it; the header, which needs the checksum, goes last."""
    key, path, temp, pieces, fsync = job
    hsize = header_size(key)
    try:
        try:
            fd = os.open(temp, _OPEN_WRITE, 0o644)
        except FileNotFoundError:  # the temporary directory was deleted under us: make it again
            os.makedirs(os.path.dirname(temp), exist_ok=True)
            fd = os.open(temp, _OPEN_WRITE, 0o644)
    except OSError as exc:
        return exc
    try:
        try:
            os.lseek(fd, hsize, os.SEEK_SET)
            crc, payload = 0, 0
            for chunk in _chunks(pieces):
                crc = checksum(chunk, crc)
                payload += _writev_all(fd, chunk)
            os.pwrite(fd, pack_header(key, payload, crc), 0)
            if fsync:
                os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, path)
        except FileNotFoundError:  # shard directory not made yet (or removed by a clear)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(temp, path)
        if fsync:
            _fsync_dir(os.path.dirname(path))
        return st.st_size, st.st_mtime_ns, payload
    except OSError as exc:
        _unlink_quietly(temp)
        return exc


def _chunks(pieces: list[memoryview], size: int = _CHUNK) -> list[list[memoryview]]:
    """The pieces regrouped (and large ones cut) into runs of at most `size` bytes, in order.
    Views only; no copies."""
    out: list[list[memoryview]] = []
    run: list[memoryview] = []
    room = size
    for piece in pieces:
        at = 0
        while at < piece.nbytes:
            take = min(room, piece.nbytes - at)
            run.append(piece[at : at + take])
            at += take
            room -= take
            if room == 0:
                out.append(run)
                run, room = [], size
    if run:
        out.append(run)
    return out


def _readv_all(fd: int, views: list[memoryview]) -> int:
    """readv until every view is full or end of file; returns bytes read."""
    return _vector_io(os.readv, fd, views, stop_at_zero=True)


def _writev_all(fd: int, views: list[memoryview]) -> int:
    return _vector_io(os.writev, fd, views, stop_at_zero=False)


def _vector_io(op: Any, fd: int, views: list[memoryview], *, stop_at_zero: bool) -> int:
    views = [v for v in views if v.nbytes]
    total, i = 0, 0
    while i < len(views):
        n = op(fd, views[i : i + _IOV_MAX])
        if n == 0:
            if stop_at_zero:
                break
            raise OSError("writev wrote nothing")
        total += n
        while n and i < len(views):  # skip past what was transferred
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def _unlink_all(paths: list[str]) -> list[tuple[str, OSError]]:
    errors = []
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append((p, exc))
    return errors


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scandir_dirs(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _scandir_files(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


__all__ = ["FileBackend", "value_path"]
