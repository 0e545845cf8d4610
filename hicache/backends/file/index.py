"""The file store's bookkeeping: which values it holds, how big, how recently used, until when.

Recency and expiry live in each value file's timestamps, so they survive a restart and are
seen by every process sharing the directory, with no sidecar files:
- mtime is the last read or write (on the store's clock): writes set it, reads touch it. A
  rescan orders values by it, so least-recently-used is global across processes as of the scan.
- atime holds the expiry deadline, marked by a fixed sub-millisecond tail (`_MARK_NS`): an
  atime without the mark (a value written without a ttl, or one some other program read on a
  `strictatime` mount) means no expiry. The store reads with O_NOATIME, so its own reads never
  move atime; with `relatime` (Linux's default) the kernel leaves a future atime alone.

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
from collections import OrderedDict
from collections.abc import Iterable

TMP_DIR = "tmp"
_MARK_NS = 424_242  # atime's tail within its millisecond when atime is an expiry deadline
_NS = 1_000_000_000

Entry = tuple[int, float | None]  # file size, expiry deadline (None: never)


def expiry_to_atime_ns(deadline: float) -> int:
    """The atime that records `deadline` (seconds, millisecond precision, rounded up)."""
    return math.ceil(deadline * 1000) * 1_000_000 + _MARK_NS


def atime_ns_to_expiry(atime_ns: int) -> float | None:
    """The deadline an atime records, or None when it carries no mark."""
    if atime_ns % 1_000_000 != _MARK_NS:
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


def scan(directory: str) -> list[tuple[int, str, int, float | None]]:
    """Every value file under a namespace directory as (mtime_ns, page hash, size, expiry),
    oldest first. Files vanishing during the scan are skipped."""
    found: list[tuple[int, str, int, float | None]] = []
    append = found.append
    for top in _entries(directory, dirs=True):
        if top.name == TMP_DIR:
            continue
        for mid in _entries(top.path, dirs=True):
            for entry in _entries(mid.path, dirs=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                atime = st.st_atime_ns  # atime_ns_to_expiry, inlined: a scan stats every value
                expiry = (atime - _MARK_NS) / _NS if atime % 1_000_000 == _MARK_NS else None
                append((st.st_mtime_ns, entry.name, st.st_size, expiry))
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

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._during_scan: dict[str, Entry] | None = None
        self.stored = 0  # bytes of the indexed values
        self.reserved = 0  # bytes of writes in flight
        self._in_flight: dict[str, int] = {}  # their page hashes (how many writes of each)
        self.unscanned = 0  # bytes this instance reserved since its last scan
        self.peak = 0  # most of stored + reserved seen

    @property
    def total(self) -> int:
        return self.stored + self.reserved

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: str) -> bool:
        return page_hash in self._entries

    def put(self, page_hash: str, size: int, expiry: float | None) -> None:
        """A value written or read: indexed (or re-indexed) as the most recent."""
        with self._lock:
            self._put(page_hash, (size, expiry))
            if self._during_scan is not None:
                self._during_scan[page_hash] = (size, expiry)
            self.peak = max(self.peak, self.stored + self.reserved)

    def put_many(self, entries: Iterable[tuple[str, int, float | None]]) -> None:
        """`put` of each (page hash, size, expiry), in order, under one lock."""
        with self._lock:
            during = self._during_scan
            index = self._entries
            stored, peak, reserved = self.stored, self.peak, self.reserved
            for page_hash, size, expiry in entries:
                entry = (size, expiry)
                old = index.get(page_hash)
                if old is None:
                    index[page_hash] = entry
                    stored += size
                    peak = max(peak, stored + reserved)
                else:  # re-indexed: the most recent now
                    index.move_to_end(page_hash)
                    if old != entry:
                        index[page_hash] = entry
                        stored += size - old[0]
                        peak = max(peak, stored + reserved)
                if during is not None:
                    during[page_hash] = entry
            self.stored, self.peak = stored, peak

    def forget(self, page_hash: str) -> None:
        with self._lock:
            old = self._entries.pop(page_hash, None)
            if old is not None:
                self.stored -= old[0]
            if self._during_scan is not None:
                self._during_scan.pop(page_hash, None)

    def reserve(self, page_hashes: list[str], nbytes: int) -> None:
        """Count a batch's bytes before it is written (its values are put when written)."""
        with self._lock:
            self.reserved += nbytes
            self.unscanned += nbytes
            for page_hash in page_hashes:
                self._in_flight[page_hash] = self._in_flight.get(page_hash, 0) + 1
            self.peak = max(self.peak, self.stored + self.reserved)

    def release(self, page_hashes: list[str], nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
            for page_hash in page_hashes:
                left = self._in_flight.pop(page_hash) - 1
                if left:
                    self._in_flight[page_hash] = left

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stored = 0

    def begin_scan(self) -> None:
        """Values put from now until `replace` are kept even if the scan missed them."""
        with self._lock:
            self._during_scan = {}

    def replace(self, scanned: Iterable[tuple[int, str, int, float | None]]) -> None:
        """Rebuild from a scan (oldest first), keeping values put since `begin_scan`; values
        being written are left to their writes' `put` (already counted as reserved)."""
        # Built outside the lock (a scan holds every value of the directory), then fixed up
        # under it for the few values put or being written meanwhile.
        fresh: OrderedDict[str, Entry] = OrderedDict()
        stored = 0
        for _mtime, page_hash, size, expiry in scanned:
            old = fresh.pop(page_hash, None)
            if old is not None:
                stored -= old[0]
            fresh[page_hash] = (size, expiry)
            stored += size
        with self._lock:
            during = self._during_scan or {}
            self._during_scan = None
            for page_hash in self._in_flight:
                old = fresh.pop(page_hash, None)
                if old is not None:
                    stored -= old[0]
            for page_hash, entry in during.items():
                old = fresh.pop(page_hash, None)
                if old is not None:
                    stored -= old[0]
                fresh[page_hash] = entry
                stored += entry[0]
            self._entries = fresh
            self.stored = stored
            self.unscanned = 0
            self.peak = max(self.peak, self.stored + self.reserved)

    def take_victims(self, now: float, limit: int | None) -> tuple[list[str], int]:
        """Remove from the index every expired value, then (with `limit`) the least recently
        used ones until stored + reserved <= limit. Returns (page hashes, how many expired)."""
        with self._lock:
            victims = [h for h, (_, exp) in self._entries.items() if exp is not None and exp <= now]
            for page_hash in victims:
                self.stored -= self._entries.pop(page_hash)[0]
            expired = len(victims)
            if limit is not None:
                while self._entries and self.stored + self.reserved > limit:
                    page_hash, (size, _) = self._entries.popitem(last=False)
                    self.stored -= size
                    victims.append(page_hash)
            return victims, expired

    def _put(self, page_hash: str, entry: Entry) -> None:
        old = self._entries.pop(page_hash, None)
        self.stored += entry[0] - (old[0] if old is not None else 0)
        self._entries[page_hash] = entry


__all__ = [
    "TMP_DIR",
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
