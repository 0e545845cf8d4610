"""The file store's blocking I/O, run in worker threads (or inline): plain system calls, each
result returned (never raised), no counters or events; the backend (backend.py) owns those.
native.py compiles the same loops (the backend uses them where they build); these are
the reference they are tested against, and the fallback.

Reads open with O_NOATIME (the atime is the value's expiry mark, index.py), check the
expiry against the caller's `now`, read and verify the value into its pieces, then touch its
mtime (recency) when older than the job says. Writes go to a temporary file created 0600 that
gets its timestamps (recency and expiry) before the rename, where the job gives them: a value
without a ttl written on the kernel's clock keeps the kernel's. Directories are created 0700.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, NamedTuple

from hicache.backends.batch import prefix_count
from hicache.backends.file.index import TMP_DIR, WRITERS_DIR, atime_ns_to_expiry
from hicache.backends.framing import CorruptValue, checksum, decode_header, header_size, pack_header

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_CHUNK = 512 * 1024  # read/write + checksum granularity: small enough to stay in cache
_OPEN_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOATIME = getattr(os, "O_NOATIME", 0)
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
FILE_MODE = 0o600
DIR_MODE = 0o700


class Read(NamedTuple):
    """A value read and verified: its payload bytes, its file size and its expiry."""

    payload: int
    file_size: int
    expiry: float | None


class Expired(NamedTuple):
    """The value's expiry had passed: a miss (the file is removed)."""

    file_size: int


def make_dirs(path: str) -> None:
    """`os.makedirs` with every directory it creates 0700 (makedirs gives the mode to the
    leaf only)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        make_dirs(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass


def clean_temps(tmp: str, older_than_s: float) -> None:
    """Remove temporary files older than `older_than_s` (by the kernel's real-time mtime:
    young ones may be another writer's)."""
    cutoff = time.time() - older_than_s
    try:
        with os.scandir(tmp) as it:
            entries = [e for e in it if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.stat().st_mtime <= cutoff:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass


def clear_values(namespace_dir: str) -> None:
    """Remove a namespace's shard directories and every temporary file."""
    try:
        with os.scandir(namespace_dir) as it:
            tops = [
                e.path
                for e in it
                if e.name not in (TMP_DIR, WRITERS_DIR) and e.is_dir(follow_symlinks=False)
            ]
    except FileNotFoundError:
        tops = []
    for top in tops:
        shutil.rmtree(top, ignore_errors=True)
    clean_temps(os.path.join(namespace_dir, TMP_DIR), 0.0)


def count_present(paths: list[str], now: float) -> int:
    """How many of `paths`, from the first, hold a value that has not expired at `now`."""

    def alive(path: str) -> bool:
        try:
            st = os.stat(path)
            expiry = atime_ns_to_expiry(st.st_atime_ns, st.st_mtime_ns)
        except OSError:
            return False
        return expiry is None or expiry > now

    return prefix_count(alive(p) for p in paths)


def _open_for_read(path: str) -> int:
    if _NOATIME:
        try:
            return os.open(path, _OPEN_READ | _NOATIME)
        except PermissionError:  # O_NOATIME needs the file's owner: read as anyone else
            pass
    return os.open(path, _OPEN_READ)


def read_value(
    job: tuple[str, str, list[memoryview], float, int]
    | tuple[str, str, list[memoryview], float, int, int],
) -> Read | Expired | CorruptValue | OSError | None:
    """Read and verify one value into its pieces: a Read, None (absent), Expired, the
    CorruptValue (file already deleted), or the OSError. The header and the first chunk of
    the payload come in one `readv` (a page of at most one chunk: the whole value), the rest a
    chunk at a time; each chunk is checksummed right after it is read, so the checksum reads
    bytes still in the CPU cache. `job` is (key, path, pieces, now in seconds, now in ns for
    the mtime touch[, touch only an mtime older than this, in ns])."""
    key, path, pieces, now, now_ns = job[:5]
    touch_before_ns = job[5] if len(job) > 5 else None
    try:
        fd = _open_for_read(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    try:
        st = os.fstat(fd)
        expiry = atime_ns_to_expiry(st.st_atime_ns, st.st_mtime_ns)
        if expiry is not None and expiry <= now:
            _unlink_quietly(path)
            return Expired(st.st_size)
        head = memoryview(bytearray(header_size(key)))
        chunks = _chunks(pieces)
        first = chunks[0] if chunks else []
        got = _readv_all(fd, [head, *first])
        header = decode_header(head[: min(got, head.nbytes)], key)
        want = sum(p.nbytes for p in pieces)
        if st.st_size - header.size != header.payload_len:
            raise CorruptValue(
                "truncated",
                f"{st.st_size - header.size} payload bytes, header says {header.payload_len}",
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
        if touch_before_ns is None or st.st_mtime_ns < touch_before_ns:
            try:  # recency for every process sharing the directory; atime (expiry) kept
                os.utime(fd, ns=(st.st_atime_ns, now_ns))
            except OSError:
                pass  # a read-only store still serves reads
        return Read(want, st.st_size, expiry)
    except CorruptValue as exc:
        _unlink_quietly(path)
        return exc
    except OSError as exc:
        return exc
    finally:
        os.close(fd)


def write_value(
    job: tuple[str, str, str, list[memoryview], bool, tuple[int, int] | None],
) -> tuple[int, int] | OSError:
    """Write one value through a temporary file and rename: (file size, payload) or the
    OSError (the temporary file then removed). A value of at most one chunk is checksummed,
    then written with one `writev` (header, then its pieces); a larger one goes payload first,
    a chunk at a time right after checksumming it, and the header, which needs the checksum,
    last. Then the timestamps `times_ns` = (atime: expiry mark or plain, mtime: recency),
    unless None (the kernel's: atime at most mtime, no expiry)."""
    key, path, temp, pieces, fsync, times_ns = job
    hsize = header_size(key)
    try:
        try:
            fd = os.open(temp, _OPEN_WRITE, FILE_MODE)
        except FileNotFoundError:  # the temporary directory was deleted under us: make it again
            make_dirs(os.path.dirname(temp))
            fd = os.open(temp, _OPEN_WRITE, FILE_MODE)
    except OSError as exc:
        return exc
    try:
        try:
            chunks = _chunks(pieces)
            if len(chunks) <= 1:  # one chunk: checksum it, then header and payload in one call
                run = chunks[0] if chunks else []
                head = pack_header(key, sum(v.nbytes for v in run), checksum(run))
                payload = _writev_all(fd, [memoryview(head), *run]) - hsize
            else:
                os.lseek(fd, hsize, os.SEEK_SET)
                crc, payload = 0, 0
                for chunk in chunks:
                    crc = checksum(chunk, crc)
                    payload += _writev_all(fd, chunk)
                os.pwrite(fd, pack_header(key, payload, crc), 0)
            if times_ns is not None:
                os.utime(fd, ns=times_ns)  # after the last write, which would move mtime
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, path)
        except FileNotFoundError:  # shard directory not made yet (or removed by a clear)
            make_dirs(os.path.dirname(path))
            os.replace(temp, path)
        if fsync:
            _fsync_dir(os.path.dirname(path))
        return hsize + payload, payload
    except OSError as exc:
        _unlink_quietly(temp)
        return exc


def _chunks(pieces: list[memoryview], size: int = _CHUNK) -> list[list[memoryview]]:
    """The pieces regrouped (and large ones cut) into runs of at most `size` bytes, in order.
    Views only; no copies."""
    if sum(p.nbytes for p in pieces) <= size:  # the common case: the pieces are one run
        whole = [p for p in pieces if p.nbytes]
        return [whole] if whole else []
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
    if not views:
        return 0
    if len(views) <= _IOV_MAX:  # one call usually moves everything
        want = 0
        for v in views:
            want += v.nbytes
        n = op(fd, views)
        if n == want:
            return int(n)
        if n == 0:
            if stop_at_zero:
                return 0
            raise OSError("writev wrote nothing")
        return int(n) + _vector_io(op, fd, _after(views, n), stop_at_zero=stop_at_zero)
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


def _after(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `views` once their first `n` bytes have moved (non-empty views)."""
    rest = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
        else:
            rest.append(v[n:] if n else v)
            n = 0
    return rest


def unlink_all(paths: list[str]) -> list[tuple[str, OSError]]:
    """Remove each path (absent ones ignored); the errors."""
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


def _calls() -> tuple[Any, ...]:
    return (
        os.open,
        os.close,
        os.fstat,
        os.stat,
        os.readv,
        os.writev,
        os.pwrite,
        os.lseek,
        os.utime,
        os.fsync,
        os.replace,
        os.unlink,
        _unlink_quietly,
        read_value,
        write_value,
        count_present,
    )


_CALLS = _calls()


def python_io_untouched() -> bool:
    """Whether the system calls and functions this module's loops use are the real ones. A
    test that replaces one (to simulate a crash or a failing disk) is only seen by these
    Python loops, so backend.py uses the compiled ones (native.py) only while this holds."""
    return all(a is b for a, b in zip(_calls(), _CALLS))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
