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
  plus `free_fraction` (0.9) of the filesystem's free space at open, and never more than the
  filesystem can hold for it. Sizes count whole filesystem blocks. Opening scans the directory
  into an index ordered by the store's policy (policies/storage.py; mtime order at open, so a
  restart keeps what was there); reads and writes update it, and touch the file's mtime so
  other processes see the recency (alone in the directory, a read touches an mtime only once
  it is `TOUCH_AFTER_S`, 1 s, old: a restart's order is right to within that). Room is
  reserved before a batch is written: when it would take the total over the cap, the
  policy's victims leave the index and their files are unlinked, down to 0.9 x the cap:
  O(values removed), never a scan (batches wait for a running eviction, or for writes in
  flight to land when those alone fill the cap).
- Shared directories: P open instances (writers.py counts them) each keep at most cap / P of
  what they wrote; beside others an instance rescans once per 0.1 x its share written, in a
  thread the writes never wait for, and a departed instance's values are adopted by the next
  rescan (docs/backends.md).
- Full filesystems: ENOSPC / EDQUOT lower the cap in force to what the store holds, evict, and
  close writes for a backoff (fullness.py): one `storage.full` event, no error per page.
- Expiry: `set_from(..., ttl=s)` values are misses `s` seconds later on `clock`, and removed by
  the next read, rescan or `sweep()`; the deadline lives in the file's atime (index.py).
- Self-healing directories: a write whose temporary directory (or the namespace directory)
  has been deleted under it recreates it and goes on; shard directories likewise.
- Failing writes are loud once: each failed write is a `storage.error` event; after
  `failure_streak` consecutive failed page writes the backend also emits
  `storage.writes_failing` (once per streak), and on the next success `storage.writes_recovered`.

Blocking calls run in worker threads under a limiter of `threads` (or inline with threads=0),
a batch in runs of at least `_STRIPE_BYTES` of pages per thread call; io.py holds them.
Where the compiled loops build (native.py: the same calls and results, a whole run per
call without the GIL), reads, writes and `exists` go through them; io.py's Python loops
otherwise, and whenever a test has replaced one of the calls they stand for.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import anyio

import hicache.backends.file.io as file_io
from hicache.backends.base import BackendUnavailable, EventSink, PageBuffer, check_ttl, no_events
from hicache.backends.batch import Counters, check_buffers, check_keys, prefix_count
from hicache.backends.blocking import BlockingRunner
from hicache.backends.file.index import (
    TMP_DIR,
    TOUCH_AFTER_S,
    FileIndex,
    check_options,
    default_cap,
    expiry_to_atime_ns,
    marks_survive,
    plain_atime_ns,
    scan,
    seconds_to_ns,
)
from hicache.backends.file.io import (
    Expired,
    Read,
    clean_temps,
    clear_values,
    count_present,
    make_dirs,
    python_io_untouched,
    read_value,
    unlink_all,
    write_value,
)
from hicache.backends.file.native import NativeFileIO, native_file_io
from hicache.backends.file.writers import WriterRegistry
from hicache.backends.framing import CorruptValue, header_size
from hicache.backends.fullness import WriteGate, is_full_error
from hicache.backends.keys import Namespace
from hicache.policies.storage import DEFAULT_STORE_POLICY
from hicache.types import PageHash

_LOW_WATER = 0.9  # eviction goes down to this share of the cap; 1 - it is the rescan period
_OPTIONS = {
    "fsync",
    "max_bytes",
    "free_fraction",
    "threads",
    "stale_temp_s",
    "failure_streak",
    "clock",
    "policy",
}


def value_path(root: str | os.PathLike[str], namespace_digest: str, page_hash: str) -> str:
    """Where the value of `page_hash` lives under `root` for one namespace."""
    # 256 x 16 leaf directories: few enough that a young store does not create one per page.
    return os.path.join(root, namespace_digest, page_hash[:2], page_hash[2:3], page_hash)


class StoreDirectoryUnavailable(BackendUnavailable, ValueError):
    """The store's directory cannot be created or written at open (a `BackendUnavailable`;
    also a ValueError, as a bad `file:DIR` spec is)."""


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
        policy: str = DEFAULT_STORE_POLICY,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(
                f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
            )
        check_options(max_bytes, free_fraction, stale_temp_s, failure_streak, clock)
        self.namespace = namespace
        self.root = os.fspath(root)
        self.fsync = bool(fsync)
        self._emit = emit or no_events
        self._clock = clock
        # On the kernel's own clock a value without a ttl keeps the times the kernel gives a
        # new file (mtime: the write; atime: no later), saving a system call per write.
        self._kernel_times = clock is time.time
        self._runner = BlockingRunner(threads)  # writes, removals, scans
        # Reads have threads of their own: a prefetch (a request waiting) never queues
        # behind uploads (background work) for a thread.
        self._reader = BlockingRunner(threads)
        self._temp_seq = itertools.count()
        self._counters = Counters()
        self._expired = 0  # values found or swept expired
        self._declined = 0  # pages the policy did not admit
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
            raise StoreDirectoryUnavailable(
                f"file backend cannot create directory {self._tmp!r}: {exc}"
            ) from exc
        clean_temps(self._tmp, stale_temp_s)
        # Expiry marks need nanosecond atimes: where they do not survive, a ttl is not enforced.
        self.enforces_ttl = marks_survive(self._tmp)
        # Sizes are counted as the filesystem allocates them (whole blocks): a 16 KiB page
        # with its header takes five 4 KiB blocks, and the cap is about the disk.
        self._block = _block_size(self._dir)
        self._index = FileIndex(policy)
        self._gate = WriteGate(clock)
        self._evicting: anyio.Event | None = None  # set while an eviction runs
        self._landed: anyio.Event | None = None  # set when a batch's writes end (if awaited)
        self._rescan: threading.Thread | None = None  # a rescan running beside the writes
        self._rescans = 0
        self._adopt_pending = False  # a departed instance's values wait for the next rescan
        self._peers_once_adopted = 0  # the count of instances to take once they are adopted
        self._free_fraction = free_fraction
        self._index.begin_scan()
        self._index.merge_scan(scan(self._dir, self._block), adopt=True)
        self._expired += self._sweep_sync(None)[1]
        self._writers = WriterRegistry(self._dir)
        self._peers = 1 + self._writers.census()[0]  # instances sharing the cap, this one too
        # The cap asked for (or the default), and the one in force: never more than the
        # filesystem can hold for this store (what it holds plus what is free).
        self.configured_max_bytes = (
            max_bytes
            if max_bytes is not None
            else default_cap(self._dir, self._index.stored, free_fraction)
        )
        self.max_bytes = self.configured_max_bytes
        self._fit_cap_to_disk()
        if max_bytes is not None and self.max_bytes < max_bytes:
            self._emit(
                "storage.cap_lowered",
                directory=self._dir,
                requested=max_bytes,
                effective=self.max_bytes,
                reason="filesystem",
            )

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> FileBackend:
        """Spec `file:DIR`. Options: fsync, max_bytes, free_fraction, threads (0 = inline),
        stale_temp_s, failure_streak, clock, policy (policies/storage.py)."""
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
        hashes = self.namespace.page_hashes_of(keys)
        self._counters.exists_calls += 1
        now = self._clock()
        if self._writers.changed() and self._recount():
            self._start_rescan(left=True)
        if self._peers == 1:
            # Alone in the directory, the index is every value there is (written here or
            # found by the scan at open): no system call. A file removed behind the store's
            # back is a miss when read, as every read is checked.
            return self._index.held_prefix(hashes, now)
        return await self._reader.run(_count_present, self._paths(hashes), now)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        now = self._clock()
        now_ns = seconds_to_ns(now)
        hashes, paths = self._locate(keys)
        if self._writers.changed() and self._recount():
            self._start_rescan(left=True)
        jobs: list[_Job]
        if self._peers == 1:
            # Alone: recency to within TOUCH_AFTER_S is enough for a restart's order, and
            # nobody else reads mtimes meanwhile.
            before = now_ns - seconds_to_ns(TOUCH_AFTER_S)
            jobs = [(k, path, p, now, now_ns, before) for k, path, p in zip(keys, paths, pages)]
        else:
            jobs = [(k, path, p, now, now_ns) for k, path, p in zip(keys, paths, pages)]
        self._counters.gets += len(jobs)
        results = await self._map(_read_all, jobs, _nbytes(pages[0]) if pages else 0, self._reader)
        oks = []
        read = []  # (page hash, file size, expiry) of the values read, for the index
        missed = []
        payload = 0
        for key, page_hash, result in zip(keys, hashes, results):
            if isinstance(result, Read):
                payload += result.payload
                read.append((page_hash, self._on_disk(result.file_size), result.expiry))
            elif result is None:
                missed.append(page_hash)
                self._index.forget(page_hash)  # another process removed it
            elif isinstance(result, Expired):
                self._expired += 1
                self._index.forget(page_hash)
            elif isinstance(result, CorruptValue):
                self._counters.corrupt += 1
                self._emit("storage.corrupt", key=key, reason=result.reason)
                self._index.forget(page_hash)
            elif isinstance(result, Exception):
                self._error("get", key, result)
            oks.append(isinstance(result, Read))
        self._counters.bytes_read += payload
        self._index.was_read(read)
        self._index.missed(missed)
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
            hashes, paths = self._locate(keys)
            for page_hash in hashes:
                self._index.forget(page_hash)
            for path, exc in await self._runner.run(unlink_all, paths):
                self._error("set", path, exc)
            self._counters.set_ok += len(keys)
            return len(keys)
        if not self._gate.is_open():  # full a moment ago: refuse at once, no I/O
            self._gate.refuse(len(keys))
            return 0
        if self._writers.changed() and self._recount():  # one left: its values need a holder
            self._start_rescan(left=True)
        share = self._share()
        hashes, paths = self._locate(keys)
        # Every key of the namespace has one length (the page hashes were checked): one
        # header size, and one size on disk per payload size.
        hsize = header_size(keys[0]) if keys else 0
        payloads = [_nbytes(page) for page in pages]
        on_disk = {n: self._on_disk(hsize + n) for n in set(payloads)}
        sizes = [on_disk[n] for n in payloads]
        # A batch that fits is taken whole; one that would evict is offered to the policy
        # page by page. Pages it declines count as stored: not an error, and a retry would
        # be declined the same way.
        if self._index.total + sum(sizes) <= share:
            wanted = [True] * len(sizes)
        else:
            wanted = [self._index.admit(h, size) for h, size in zip(hashes, sizes)]
        self._declined += wanted.count(False)
        fit = len(sizes)
        need = sum(size for size, want in zip(sizes, wanted) if want)
        if need > share:  # a batch larger than the whole cap stores the prefix that fits
            taken = itertools.accumulate(size if want else 0 for size, want in zip(sizes, wanted))
            fit = prefix_count(total <= share for total in taken)
            need = sum(size for size, want in zip(sizes[:fit], wanted) if want)
        await self._make_room(need)
        expiry = None if ttl is None else now + ttl
        now_ns = seconds_to_ns(now)
        times: tuple[int, int] | None = (
            expiry_to_atime_ns(expiry) if expiry is not None else plain_atime_ns(now_ns),
            now_ns,
        )
        if expiry is None and self._kernel_times:
            times = None
        chosen = [i for i in range(fit) if wanted[i]]
        hashes_w = [hashes[i] for i in chosen]
        temps = self._temp_paths(hashes_w)
        fsync = self.fsync
        jobs = [(keys[i], paths[i], temp, pages[i], fsync, times) for i, temp in zip(chosen, temps)]
        self._index.reserve(hashes_w, need)  # counted from now: the cap holds while written
        try:
            page_bytes = _nbytes(pages[chosen[0]]) if chosen else 0
            results = await self._map(_write_all, jobs, page_bytes) if jobs else []
        finally:
            self._index.release(hashes_w, need)
            if self._landed is not None:
                self._landed.set()
                self._landed = None
        ok_at = [True] * fit  # declined pages count as stored
        stored = []  # (page hash, file size, expiry) of the values written, for the index
        written = 0
        full = 0
        for i, result in zip(chosen, results):
            if isinstance(result, Exception):
                ok_at[i] = False
                if is_full_error(result):
                    full += 1  # one "full" answer for the batch, not an error per page
                    continue
                self._error("set", keys[i], result)
                self._write_failed(result)
                continue
            if self._failed_writes:
                self._write_succeeded()
            size, payload = result
            written += payload
            stored.append((hashes[i], self._on_disk(size), expiry))
        self._counters.set_ok += len(stored)
        self._counters.bytes_written += written
        self._index.wrote(stored)
        if full:
            await self._filled(full)
        elif stored and self._gate.landed():
            self._emit("storage.writes_resumed", directory=self._dir, stored_bytes=self.stored)
        if self._index.unscanned > self._share() * (1 - _LOW_WATER):  # a rescan period
            self._start_rescan()
        return prefix_count(ok_at)

    async def delete(self, keys: Sequence[str]) -> None:
        check_keys(self.namespace, keys)
        self._counters.deletes += len(keys)
        hashes, paths = self._locate(keys)
        for page_hash in hashes:
            self._index.forget(page_hash)
        for path, exc in await self._runner.run(unlink_all, paths):
            self._error("delete", path, exc)

    async def clear(self) -> None:
        """Remove this namespace's values (and stale temporary files); other namespaces
        under the same directory are untouched."""
        await self._runner.run(clear_values, self._dir)
        self._index.clear()

    async def sweep(self) -> int:
        """Rescan the directory now (forgetting what other processes removed, taking up the
        values nobody else holds), remove expired values, and the policy's victims if the
        store is over its share of the cap; how many values were removed."""
        while self._evicting is not None:
            await self._evicting.wait()
        self._join_rescan()
        left = self._recount()
        # alone, it holds whatever the directory has; beside others, its own values and
        # what a departed one left
        adopt = left or self._adopt_pending or self._peers == 1
        self._adopt_pending = False
        await self._runner.run(functools.partial(self._rescan_sync, adopt=adopt))
        return await self._evict(0)

    def accepts_writes(self) -> bool:
        """False while the filesystem was full a moment ago (writes back off; reads go on)."""
        return self._gate.is_open()

    @property
    def stored(self) -> int:
        """Bytes of the values this instance knows the directory holds."""
        return self._index.stored

    def stats(self) -> Mapping[str, int | float]:
        out: dict[str, int | float] = dict(self._counters.as_dict())
        out["write_failure_streaks"] = self._streaks
        out["stored_bytes"] = self._index.stored
        out["peak_stored_bytes"] = self._index.peak
        out["max_bytes"] = self.max_bytes
        out["configured_max_bytes"] = self.configured_max_bytes
        out["share_bytes"] = self._share()
        out["writers"] = self._peers
        out["expired"] = self._expired
        out["full"] = self._gate.full_answers
        out["refused_pages"] = self._gate.refused_pages
        out["declined_pages"] = self._declined
        out["rescans"] = self._rescans
        return out

    async def aclose(self) -> None:
        self._join_rescan()
        self._writers.close()

    # -- the cap -------------------------------------------------------------------------

    def _share(self) -> int:
        """What this instance may hold: the cap in force, divided among the instances that
        have the directory open (counted once per rescan period)."""
        return max(1, self.max_bytes // self._peers)

    async def _make_room(self, need: int) -> None:
        """Before writing `need` bytes: wait out a running eviction (its victims may still be
        on disk), then, if the bytes would take this instance's total over its share of the
        cap, evict the policy's victims from the index (no scan: O(values removed)) down to
        the low-water mark."""
        index = self._index
        while True:
            while self._evicting is not None:  # its victims may still be on disk: let it finish
                await self._evicting.wait()
            if index.total + need <= self._share():
                return
            await self._evict(need)  # down to the low-water mark, counting writes in flight
            if index.total + need <= self._share():
                return
            if index.reserved:
                # Writes in flight fill the cap: once one lands, its values can be evicted.
                self._landed = self._landed or anyio.Event()
                await self._landed.wait()
            elif not len(index):
                return  # nothing left to evict (the cap is smaller than this batch's need)
            # Otherwise the writes that were in flight when the eviction chose its victims
            # landed while it ran: their values count as stored, not reserved, so they can be
            # evicted. Evict again rather than return over the cap.

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
        """Worker thread (or the constructor, with need=None: no cap yet): drop expired values
        and, if `need` more bytes would pass the cap, the policy's victims down to the
        low-water mark; unlink their files. Returns (removed, of which expired)."""
        index = self._index
        limit = None
        if need is not None and index.total + need > (share := self._share()):
            limit = max(0, int(share * _LOW_WATER) - need)
        victims, expired = index.take_victims(self._clock(), limit)
        digest = self.namespace.digest
        unlink_all([value_path(self.root, digest, h) for h in victims])
        return len(victims), expired

    async def _filled(self, pages: int) -> None:
        """The filesystem refused `pages` for lack of space: what the store holds now is
        what it can hold. The cap in force comes down to it, the store evicts to its
        low-water mark, and writes stop for the gate's backoff."""
        self._gate.refuse(pages)
        first = self._gate.full()
        # every instance on the directory holds about its share: the directory, P of them
        self.max_bytes = max(1, min(self.max_bytes, self._index.stored * self._peers))
        if first:
            self._emit(
                "storage.full",
                directory=self._dir,
                stored_bytes=self._index.stored,
                effective_max_bytes=self.max_bytes,
                configured_max_bytes=self.configured_max_bytes,
            )
        while self._evicting is not None:
            await self._evicting.wait()
        await self._evict(0)

    def _fit_cap_to_disk(self) -> None:
        """The cap in force: the configured one, or less where the filesystem cannot hold
        it (what the store holds plus `free_fraction` of the free space); rechecked each
        rescan period, so room freed on the disk raises it again up to the configured cap
        (not while writes back off from a "full" answer: that cap stands until then)."""
        if not self._gate.is_open():
            return
        try:
            # The directory holds about P shares like this instance's; writes in flight
            # already take their part of the free space, so they are not counted twice.
            held = self._index.stored * self._peers
            room = default_cap(self._dir, held, self._free_fraction)
        except OSError:
            room = self.configured_max_bytes
        self.max_bytes = max(1, min(self.configured_max_bytes, room))

    def _on_disk(self, size: int) -> int:
        block = self._block
        return -(-size // block) * block

    # -- other writers ---------------------------------------------------------------------

    def _recount(self) -> bool:
        """Count the instances that have the directory open (this one's share of the cap
        follows); True when one left, closed or killed, since the last count: the values it
        wrote are nobody's until a rescan adopts them, and until then the share stays as it
        was (a larger share before the orphans count again would let the directory pass
        the cap)."""
        removed = self._writers.reregister_if_removed()
        if removed:
            # The directory went with everything in it: the index describes nothing that is
            # there. Forgotten values are misses; the rescan that follows adopts what was
            # written since.
            self._index.clear()
        others, dead = self._writers.census()
        left = removed or dead > 0 or 1 + others < self._peers
        if left:
            self._peers_once_adopted = 1 + others
        else:
            self._peers = 1 + others
        return left

    def _start_rescan(self, *, left: bool | None = None) -> None:
        """Each rescan period's worth written (and whenever an instance left): recount the
        instances, check the cap against the disk and, where others write the same
        directory or one left values behind, rescan it beside the writes (the writes never
        wait for it; with threads=0, inline). A rescan forgets what others removed, takes
        the recency of their reads, and adopts what a departed instance left."""
        if left is None:
            left = self._recount()
        self._fit_cap_to_disk()
        if self._rescan is not None and self._rescan.is_alive():
            self._adopt_pending = self._adopt_pending or left
            return
        adopt, self._adopt_pending = left or self._adopt_pending, False
        if self._peers == 1 and not adopt:
            self._index.skip_scan()  # alone in the directory: the index is the truth
            return
        self._index.begin_scan()
        kwargs = {"begun": True, "adopt": adopt}
        if self._runner.inline:
            self._rescan_sync(**kwargs)
            return
        self._rescan = threading.Thread(
            target=self._rescan_sync, kwargs=kwargs, name="hicache-file-rescan"
        )
        self._rescan.start()

    def _rescan_sync(self, begun: bool = False, adopt: bool = False) -> None:
        """Any thread: forget the values others removed, take the recency of their reads
        and, with `adopt`, hold the values nobody holds (a dead writer's)."""
        if not begun:
            self._index.begin_scan()
        self._index.merge_scan(scan(self._dir, self._block), adopt=adopt)
        if adopt and self._peers_once_adopted:  # the orphans count now: the share may grow
            self._peers, self._peers_once_adopted = self._peers_once_adopted, 0
        self._rescans += 1

    def _join_rescan(self) -> None:
        rescan, self._rescan = self._rescan, None
        if rescan is not None:
            rescan.join()

    # -- helpers (loop side unless noted) ---------------------------------------------------

    async def _map(
        self,
        run_all: Callable[[list[_Job]], list[_Result]],
        jobs: list[_Job],
        page_bytes: int,
        runner: BlockingRunner | None = None,
    ) -> list[_Result]:
        """`run_all` over `jobs` (pages of `page_bytes`) cut into runs of at least
        `_STRIPE_BYTES` (one worker-thread call each, at most `threads` at once); the results
        in order."""
        stripes = len(jobs) * page_bytes // _STRIPE_BYTES
        runner = runner or self._runner
        runs = max(1, min(runner.threads, len(jobs), stripes))
        bounds = [len(jobs) * i // runs for i in range(runs + 1)]
        parts = await runner.map(run_all, [jobs[a:b] for a, b in itertools.pairwise(bounds)])
        return [result for part in parts for result in part]

    def _path(self, key: str) -> str:
        return value_path(self.root, self.namespace.digest, self.namespace.page_hash_of(key))

    def _locate(self, keys: Sequence[str]) -> tuple[list[PageHash], list[str]]:
        """The page hash and `_path` of each key, the path built by concatenation
        (`value_path`'s result)."""
        hashes = self.namespace.page_hashes_of(keys)
        return hashes, self._paths(hashes)

    def _paths(self, hashes: Sequence[str]) -> list[str]:
        base = self._dir + os.sep
        sep = os.sep
        return [f"{base}{h[:2]}{sep}{h[2]}{sep}{h}" for h in hashes]

    def _temp_paths(self, hashes: Sequence[str]) -> list[str]:
        # unique without a syscall per page: pid, this instance, a counter (next() is atomic
        # under the GIL)
        head = f"{self._tmp}{os.sep}"
        tail = f".{os.getpid()}.{id(self):x}."
        seq = self._temp_seq
        return [f"{head}{h}{tail}{next(seq)}.tmp" for h in hashes]

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


_STRIPE_BYTES = 128 * 16384
"""Fewest page bytes per worker-thread call of a batch: 128 pages of 16 KiB (a prefetch's batch
at the replay's geometry) are one call, 512 or more go out as `threads` calls; a batch of
large pages (2 MiB: 16 layers of a real model) spreads over the threads from a few pages on,
so its checksums and copies run on every core. Handing a call to a worker thread costs the
event loop tens of microseconds, and the batches in flight at once already spread over the
threads: `hicache replay --limit 2500` used 13-16 % less CPU than with runs of 32 small
pages (docs/benchmarks.md)."""

_Job = tuple[Any, ...]
_Result = Any


def _nbytes(pieces: list[memoryview]) -> int:
    n = 0
    for piece in pieces:
        n += piece.nbytes
    return n


def _block_size(directory: str) -> int:
    """The filesystem's allocation unit under `directory` (4096 where it cannot be read)."""
    try:
        return os.statvfs(directory).f_frsize or 4096
    except OSError:
        return 4096


def _native() -> NativeFileIO | None:
    """The compiled loops (native.py), where built and while nothing they stand for has
    been replaced (tests wrap `write_value` here, or system calls in io.py)."""
    if write_value is not file_io.write_value or read_value is not file_io.read_value:
        return None
    if count_present is not file_io.count_present or not python_io_untouched():
        return None
    return native_file_io()


def _read_all(jobs: list[_Job]) -> list[_Result]:
    """Worker thread: `read_value` of each job (one compiled call where built)."""
    native = _native()
    if native is not None:
        try:
            return native.read_values(jobs)
        except UnicodeEncodeError:  # a path with undecodable bytes: os.fsencode's job
            pass
    return [read_value(job) for job in jobs]


def _write_all(jobs: list[_Job]) -> list[_Result]:
    """Worker thread: `write_value` of each job (one compiled call where built; looked up per
    call, so tests can wrap it)."""
    native = _native()
    if native is not None:
        try:
            return native.write_values(jobs)
        except UnicodeEncodeError:
            pass
    return [write_value(job) for job in jobs]


def _count_present(paths: list[str], now: float) -> int:
    """Worker thread: `count_present` (compiled where built)."""
    native = _native()
    if native is not None:
        try:
            return native.count_present(paths, now)
        except UnicodeEncodeError:
            pass
    return count_present(paths, now)


__all__ = ["FileBackend", "value_path"]
