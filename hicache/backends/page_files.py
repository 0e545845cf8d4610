"""The protocol side shared by the backends that keep one framed value file per page at the file
store's paths and move the bytes their own way (nixl.py: a NIXL agent; hf3fs.py: usrbio rings).

`PageFileBackend` holds what those backends do alike: checking keys and buffers, the counters,
the `storage.corrupt` / `storage.error` events, `exists` (stat), `delete`, `clear`, and running
every batch in a worker thread while `aclose` waits for the batches in flight. A subclass moves
the bytes through two hooks, each called in a worker thread with no counters and no events:
`_read_pages` (read the present prefix into the pages, checking each value) and `_write_pages`
(write the pages to temporary files and place them); and `_release`, what `aclose` frees once
nothing is in flight. The value files' format is the file store's: a framed value (framing.py)
per file, written under a temporary name and renamed into place (`create_temp`, `place`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from hicache.backends.base import EventSink, PageBuffer, no_events
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.blocking import BlockingRunner
from hicache.backends.file import value_path
from hicache.backends.framing import FIXED_HEADER_SIZE, CorruptValue, decode_header, header_size
from hicache.backends.keys import Namespace


@dataclass(slots=True)
class ReadResult:
    """What a batch read found, reported by the loop side (counters, events)."""

    ok: list[bool]
    corrupt: list[tuple[str, str]]  # (key, reason); their files are deleted
    errors: list[tuple[str, str]]  # (key, error)


WriteResult = tuple[list[bool], list[tuple[str, str]]]
"""Per page whether it was stored, and the (key, error) failures."""


def create_temp(tmp: str) -> int:
    """A new temporary file (its directory made if missing), open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
        return os.open(tmp, flags, 0o600)


def place(tmp: str, path: str) -> None:
    """Rename a written temporary file into place (its shard directory made if missing)."""
    try:
        os.replace(tmp, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.replace(tmp, path)


def size_mismatch(fd: int, key: str, size: int, want: int) -> str:
    """Why a value file of `size` bytes cannot be a `want`-byte page: its header's reason."""
    head = os.pread(fd, FIXED_HEADER_SIZE + 4096, 0)
    try:
        header = decode_header(head, key)
    except CorruptValue as exc:
        return exc.reason
    return "length" if header.payload_len != want else "truncated"


def count_present(paths: list[str]) -> int:
    """How many leading paths exist (the consecutive prefix `exists` reports)."""
    return prefix_count(os.path.exists(p) for p in paths)


def unlink_all(paths: list[str]) -> None:
    """Remove the files that exist among `paths`."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def os_error(exc: Exception) -> str:
    """An exception as a `storage.error` event's error text."""
    return f"{type(exc).__name__}: {exc}"


class PageFileBackend:
    """A StorageBackend's protocol over page value files; see the module docstring. Owns the
    counters and the count of batches in flight."""

    def __init__(
        self, root: str, threads: int, *, namespace: Namespace, emit: EventSink | None
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        self.namespace = namespace
        self.root = os.fspath(root)
        self._emit = emit or no_events
        self._runner = BlockingRunner(threads)
        self._counters = Counters()
        self._header_size = header_size(namespace.prefix + "0" * 64)
        self._temp_seq = itertools.count()
        self._closed = False
        self._inflight = 0
        self._idle: anyio.Event | None = None

    # -- the subclass's hooks (worker thread) ---------------------------------------------

    def _read_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> ReadResult:
        raise NotImplementedError

    def _write_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> WriteResult:
        raise NotImplementedError

    def _release(self) -> None:
        """Free what the batches used; nothing is in flight."""

    # -- protocol -------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        check_keys(self.namespace, keys)
        self._counters.exists_calls += 1
        if self._closed or not keys:
            return 0
        present: int = await self._run(count_present, [self._path(k) for k in keys])
        return present

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        self._counters.gets += len(keys)
        if self._closed or not keys:
            return 0
        paths = [self._path(k) for k in keys]
        result: ReadResult = await self._run(self._read_pages, list(keys), paths, pages)
        for key, reason in result.corrupt:
            self._counters.corrupt += 1
            self._emit("storage.corrupt", key=key, reason=reason)
        for key, error in result.errors:
            self._error("get", key, error)
        hits = prefix_count(result.ok)
        self._counters.get_hits += hits
        self._counters.bytes_read += sum(p.nbytes for page in pages[:hits] for p in page)
        return hits

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        self._counters.sets += len(keys)
        if self._closed or not keys:
            return 0
        paths = [self._path(k) for k in keys]
        oks, errors = await self._run(self._write_pages, list(keys), paths, pages)
        for key, error in errors:
            self._error("set", key, error)
        self._counters.set_ok += sum(oks)
        self._counters.bytes_written += sum(
            p.nbytes for page, ok in zip(pages, oks) if ok for p in page
        )
        return prefix_count(oks)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        self._counters.deletes += len(keys)
        if keys:
            await self._run(unlink_all, [self._path(k) for k in keys])

    async def clear(self) -> None:
        """Remove this namespace's directory (its values and temporary files), nothing else."""
        await self._run(shutil.rmtree, os.path.join(self.root, self.namespace.digest), True)

    def stats(self) -> Mapping[str, int | float]:
        return self._counters.as_dict()

    async def aclose(self) -> None:
        """Wait for the batches in flight, then release what they used. Idempotent; later
        calls are misses."""
        self._closed = True
        while self._inflight:
            self._idle = self._idle or anyio.Event()
            await self._idle.wait()
        self._release()

    # -- helpers --------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return value_path(self.root, self.namespace.digest, self.namespace.page_hash_of(key))

    def _temp_path(self) -> str:
        """A fresh temporary file's path in this namespace's `tmp/` directory."""
        name = f"{os.getpid()}.{next(self._temp_seq)}"
        return os.path.join(self.root, self.namespace.digest, "tmp", name)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._inflight += 1
        try:
            return await self._runner.run(fn, *args)
        finally:
            self._inflight -= 1
            if not self._inflight and self._idle is not None:
                self._idle.set()
                self._idle = None

    def _error(self, op: str, key: str, error: str) -> None:
        self._counters.errors += 1
        self._emit("storage.error", op=op, key=key, error=error)
