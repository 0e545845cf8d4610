"""The file store's bookkeeping: which values it holds, how big, how recently used, until when.

Recency and expiry live in each value file's timestamps, so they survive a restart and are
seen by every process sharing the directory, with no sidecar files:
- mtime is the last read or write (on the store's clock): writes set it, reads touch it (an
  instance alone in the directory only once its mtime is `TOUCH_AFTER_S` old). A rescan
  orders values by it, so least-recently-used is global across processes as of the scan.
- atime holds the expiry deadline, marked by a fixed sub-millisecond tail (`_MARK_NS`) and
  later than mtime: an atime without the mark, or at or before mtime (a value written without
  a ttl keeps the kernel's times, and a fresh file's atime is at most its mtime; one some
  other program read on a `strictatime` mount), means no expiry. A deadline is always later
  than the write and the reads that touch mtime before it passes. The store reads with
  O_NOATIME, so its own reads never move atime; with `relatime` (Linux's default) the kernel
  leaves a future atime alone.

`FileIndex` is one instance's in-memory view: page hash -> (file size, expiry) in LRU order
(reads and writes move a value to the end), the byte total, the bytes of writes in flight
(reserved before they start, so the cap holds while they run) and the bytes this instance
wrote since its last scan (which drives the periodic rescan that bounds multi-process
overshoot). Thread-safe: the event loop updates it, a worker thread rebuilds it from a scan.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Sequence

from hicache.backends.deadlines import Deadlines
from hicache.policies.storage import DEFAULT_STORE_POLICY, make_store_policy

TMP_DIR = "tmp"
WRITERS_DIR = "writers"  # writers.py: one lock file per open instance
_MARK_NS = 424_242  # atime's tail within its millisecond when atime is an expiry deadline
_NS = 1_000_000_000
TOUCH_AFTER_S = 1.0
"""Alone in its directory, a store touches a value's mtime on a read only once the mtime is
this old: recency to within a second for a restart, a system call saved per read of a value
used that recently. Beside other instances every read touches (their rescans compare mtimes)."""

Entry = tuple[int, float | None]  # file size, expiry deadline (None: never)


def expiry_to_atime_ns(deadline: float) -> int:
    """The atime that records `deadline` (seconds, millisecond precision, rounded up)."""
    return math.ceil(deadline * 1000) * 1_000_000 + _MARK_NS


def atime_ns_to_expiry(atime_ns: int, mtime_ns: int) -> float | None:
    """The deadline a file's atime records, or None when it carries no mark or is not later
    than its mtime."""
    if atime_ns % 1_000_000 != _MARK_NS or atime_ns <= mtime_ns:
        return None
    return (atime_ns - _MARK_NS) / _NS


def seconds_to_ns(t: float) -> int:
    return round(t * _NS)


def plain_atime_ns(t_ns: int) -> int:
    """An atime for a value that never expires: `t_ns`, nudged off the mark if it has it."""
    return t_ns + 1 if t_ns % 1_000_000 == _MARK_NS else t_ns


def marks_survive(directory: str) -> bool:
    """Whether this filesystem keeps an atime to the nanosecond (so expiry marks survive):
    written and read back on a scratch file in `directory`."""
    probe = os.path.join(directory, f".expiry-probe.{os.getpid()}.{threading.get_ident()}")
    want = expiry_to_atime_ns(2_000_000_000.0)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.utime(fd, ns=(want, want))
            return os.fstat(fd).st_atime_ns == want
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def check_options(
    max_bytes: object,
    free_fraction: object,
    stale_temp_s: object,
    failure_streak: object,
    clock: object,
) -> None:
    """The file backend's numeric options and clock, checked at open (ValueError/TypeError)."""
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    if (
        isinstance(free_fraction, bool)
        or not isinstance(free_fraction, (int, float))
        or not 0 < free_fraction <= 1
    ):
        raise ValueError(f"free_fraction must be a number in (0, 1], got {free_fraction!r}")
    if not isinstance(stale_temp_s, (int, float)) or stale_temp_s < 0:
        raise ValueError(f"stale_temp_s must be a number >= 0, got {stale_temp_s!r}")
    if (
        isinstance(failure_streak, bool)
        or not isinstance(failure_streak, int)
        or failure_streak < 1
    ):
        raise ValueError(f"failure_streak must be a positive int, got {failure_streak!r}")
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")


def default_cap(directory: str, held: int, fraction: float) -> int:
    """The default size cap: what the store holds at open plus `fraction` of the space free
    to this user on `directory`'s filesystem at open."""
    st = os.statvfs(directory)
    return held + int(st.f_bavail * st.f_frsize * fraction)


def scan(directory: str, block: int = 1) -> list[tuple[int, str, int, float | None]]:
    """Every value file under a namespace directory as (mtime_ns, page hash, size in whole
    `block`s, expiry), oldest first. Files vanishing during the scan are skipped."""
    found: list[tuple[int, str, int, float | None]] = []
    append = found.append
    for top in _entries(directory, dirs=True):
        if top.name in (TMP_DIR, WRITERS_DIR):
            continue
        for mid in _entries(top.path, dirs=True):
            for entry in _entries(mid.path, dirs=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                # atime_ns_to_expiry, inlined: a scan stats every value
                atime, mtime = st.st_atime_ns, st.st_mtime_ns
                marked = atime % 1_000_000 == _MARK_NS and atime > mtime
                expiry = (atime - _MARK_NS) / _NS if marked else None
                size = -(-st.st_size // block) * block  # whole blocks, as allocated
                append((mtime, entry.name, size, expiry))
    found.sort()
    return found


def _entries(path: str, *, dirs: bool) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [
                e
                for e in it
                if (e.is_dir(follow_symlinks=False) if dirs else e.is_file(follow_symlinks=False))
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []


class FileIndex:
    """One instance's view of its namespace directory; see the module docstring."""

    def __init__(self, policy: str = DEFAULT_STORE_POLICY) -> None:
        self._lock = threading.Lock()
        self.policy = policy
        self._book = make_store_policy(policy)  # which values are held, in eviction order
        self._deadlines = Deadlines()  # of the values that have one
        # While a rescan runs: what this instance learnt meanwhile (an entry; None: gone),
        # which beats what the scan saw.
        self._during_scan: dict[str, Entry | None] | None = None
        self.reserved = 0  # bytes of writes in flight
        self._in_flight: dict[str, int] = {}  # their page hashes (how many writes of each)
        self.unscanned = 0  # bytes this instance reserved since its last scan
        self.peak = 0  # the most bytes ever held (indexed values)
        self._seen_mtime_ns = 0  # the newest mtime the last scan saw: later ones were touched

    @property
    def stored(self) -> int:
        """Bytes of the indexed values."""
        return self._book.held_bytes

    @property
    def total(self) -> int:
        return self.stored + self.reserved

    def __len__(self) -> int:
        return len(self._book)

    def __contains__(self, page_hash: str) -> bool:
        return page_hash in self._book

    def deadline_rows(self) -> int:
        """Rows of the expiry heap (stale ones included): bounded by the values with one."""
        return self._deadlines.rows()

    def held_prefix(self, page_hashes: Iterable[str], now: float) -> int:
        """How many leading values this index holds unexpired at `now`."""
        with self._lock:
            book, deadline = self._book, self._deadlines.get
            n = 0
            for page_hash in page_hashes:
                if page_hash not in book:
                    break
                expiry = deadline(page_hash)
                if expiry is not None and expiry <= now:
                    break
                n += 1
            return n

    def admit(self, page_hash: str, size: int) -> bool:
        """Whether the policy takes a write of this value (one it holds always is)."""
        with self._lock:
            return page_hash in self._book or self._book.admit(page_hash, size)

    def wrote(self, entries: Iterable[tuple[str, int, float | None]]) -> None:
        """Values written (page hash, file size, expiry), in order: each the most recent."""
        with self._lock:
            insert = self._book.insert
            deadlines, during = self._deadlines, self._during_scan
            for page_hash, size, expiry in entries:  # `_hold`, inlined: once per page
                insert(page_hash, size)
                if expiry is not None:
                    deadlines.set(page_hash, expiry)
                elif deadlines:
                    deadlines.drop(page_hash)
                if during is not None:
                    during[page_hash] = (size, expiry)
            self.peak = max(self.peak, self._book.held_bytes)

    def was_read(self, entries: Iterable[tuple[str, int, float | None]]) -> None:
        """Values read, in order: each the most recent (indexed if another process wrote it
        since the last scan)."""
        with self._lock:
            book = self._book
            for page_hash, size, expiry in entries:
                if page_hash in book:
                    book.touch(page_hash)
                else:
                    self._hold(page_hash, size, expiry)
            self.peak = max(self.peak, book.held_bytes)

    def missed(self, page_hashes: Iterable[str]) -> None:
        """Reads or probes that found nothing (admission policies remember them)."""
        with self._lock:
            for page_hash in page_hashes:
                self._book.missed(page_hash)

    def forget(self, page_hash: str) -> None:
        with self._lock:
            self._drop(page_hash)

    def reserve(self, page_hashes: Sequence[str], nbytes: int) -> None:
        """Count a batch's bytes before it is written (its values are put when written)."""
        with self._lock:
            self.reserved += nbytes
            self.unscanned += nbytes
            for page_hash in page_hashes:
                self._in_flight[page_hash] = self._in_flight.get(page_hash, 0) + 1

    def release(self, page_hashes: Sequence[str], nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
            for page_hash in page_hashes:
                left = self._in_flight.pop(page_hash) - 1
                if left:
                    self._in_flight[page_hash] = left

    def clear(self) -> None:
        with self._lock:
            self._book = make_store_policy(self.policy)
            self._deadlines.clear()

    def begin_scan(self) -> None:
        """Values put or forgotten from now until `merge_scan` keep what this instance knows
        of them, whatever the scan saw."""
        with self._lock:
            self._during_scan = {}
            self.unscanned = 0

    def skip_scan(self) -> None:
        """A rescan period passed with no other writer: nothing to learn."""
        with self._lock:
            self.unscanned = 0

    def merge_scan(
        self, scanned: list[tuple[int, str, int, float | None]], *, adopt: bool
    ) -> tuple[int, int]:
        """Bring the index in line with a scan (oldest first): values no longer on disk are
        forgotten, held values another process read since the last scan (a newer mtime) move
        to the recent end in mtime order, and with `adopt` the values nobody holds (at
        open; a dead writer's) are held, in the scan's order. What this instance changed
        during the scan, and values being written, are left as they are. Returns (values
        adopted, values forgotten)."""
        on_disk = {page_hash for _mtime, page_hash, _size, _expiry in scanned}
        with self._lock:
            during = self._during_scan or {}
            self._during_scan = None
            book, in_flight = self._book, self._in_flight
            gone = [h for h in list(book.keys()) if h not in on_disk and h not in during]
            for page_hash in gone:
                if page_hash not in in_flight:
                    self._drop(page_hash)
            seen, adopted = self._seen_mtime_ns, 0
            for mtime, page_hash, size, expiry in scanned:
                if page_hash in during or page_hash in in_flight:
                    continue
                if page_hash in book:
                    if mtime > seen:
                        book.touch(page_hash)
                elif adopt:
                    self._hold(page_hash, size, expiry)
                    adopted += 1
            if scanned:
                self._seen_mtime_ns = max(seen, scanned[-1][0])
            self.peak = max(self.peak, book.held_bytes)
            return adopted, len(gone)

    def take_victims(self, now: float, limit: int | None) -> tuple[list[str], int]:
        """Remove from the index every expired value, then (with `limit`) the policy's
        victims until stored + reserved <= limit. O(values removed). Returns (page hashes,
        how many expired)."""
        with self._lock:
            victims = self._deadlines.due(now)
            for page_hash in victims:
                self._drop(page_hash)
            expired = len(victims)
            if limit is not None:
                book = self._book
                while book.held_bytes + self.reserved > limit:
                    victim = book.pop_victim()
                    if victim is None:
                        break
                    page_hash = victim[0]
                    self._deadlines.drop(page_hash)
                    if self._during_scan is not None:
                        self._during_scan[page_hash] = None
                    victims.append(page_hash)
            return victims, expired

    # -- under the lock -------------------------------------------------------------------

    def _hold(self, page_hash: str, size: int, expiry: float | None) -> None:
        self._book.insert(page_hash, size)
        if expiry is None:
            self._deadlines.drop(page_hash)
        else:
            self._deadlines.set(page_hash, expiry)
        if self._during_scan is not None:
            self._during_scan[page_hash] = (size, expiry)

    def _drop(self, page_hash: str) -> None:
        self._book.remove(page_hash)
        self._deadlines.drop(page_hash)
        if self._during_scan is not None:
            self._during_scan[page_hash] = None


__all__ = [
    "TMP_DIR",
    "WRITERS_DIR",
    "FileIndex",
    "atime_ns_to_expiry",
    "check_options",
    "default_cap",
    "expiry_to_atime_ns",
    "marks_survive",
    "plain_atime_ns",
    "scan",
    "seconds_to_ns",
]
