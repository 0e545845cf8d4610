"""`hf3fs:DIR`: page values in files on a 3FS mount, moved by 3FS's usrbio client.

3FS is a POSIX file system at its FUSE mount, so `file:DIR` on the mount already works; every
byte then crosses the FUSE kernel path (a system call and a copy per read or write). usrbio
(`hf3fs_fuse.io`, from the `hf3fs-py-usrbio` package) bypasses it: I/O is prepared on a ring
shared with the 3FS client (`make_ioring`) against a shared-memory buffer registered with the
mount (`make_iovec`), then submitted as one batch and reaped with a timeout; the client moves
the bytes between that buffer and the storage servers (RDMA on a real cluster).

Values are the standard framed values (framing.py: header, then the page), one file per page at
the file store's paths (`DIR/<digest>/<h[0:2]>/<h[2]>/<h>`), so a directory written here reads
the same with `file:DIR` on the mount and back. A batch goes through one lane: a read ring, a
write ring and one shared-memory iov. Writing, each page's pieces are copied into the iov behind
its header slot, checksummed there in one pass, and written by one I/O per page to a temporary
file renamed into place once done. Reading, each present file is read whole into the iov by one
I/O, its header and CRC-32 checked there, and only a verified page is copied into the caller's
pieces: a torn, truncated or foreign value never touches the host pool (it is a miss, a
`storage.corrupt` event, and its file is deleted). A batch larger than the iov or the ring goes
in rounds. There is one copy each way between the iov and the host pool: usrbio moves only
memory registered with the mount.

Every submission is reaped with a timeout of `timeout` seconds: past it the batch is a miss and
its lane is retired (its ring and iov are never reused, since I/O may still land in them) and
replaced. `exists` stats the files. There is no size cap and no expiry.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from types import ModuleType
from typing import Any

import anyio

from hicache.backends.base import BackendUnavailable, EventSink
from hicache.backends.framing import CorruptValue, checksum, decode_header, pack_header
from hicache.backends.keys import Namespace
from hicache.backends.page_files import (
    PageFileBackend,
    ReadResult,
    WriteResult,
    create_temp,
    os_error,
    place,
    size_mismatch,
    unlink_all,
)
from hicache.backends.spec_options import flag, integer, number, split_dir_spec

_OPTIONS = ("threads", "timeout", "fsync", "entries", "iov_mb", "mount")


def load_usrbio() -> ModuleType:
    """3FS's usrbio Python API (`hf3fs_fuse.io`). Raises ImportError saying how to get it."""
    try:
        return importlib.import_module("hf3fs_fuse.io")
    except ImportError as exc:
        raise ImportError(
            "the hf3fs backend needs 3FS's usrbio client (hf3fs_fuse.io, from the "
            "hf3fs-py-usrbio package, built against 3FS; pip install 'hicache[hf3fs]' where it "
            f"builds): {exc}"
        ) from exc


def usrbio_missing() -> str | None:
    """Why the usrbio client cannot be used here, or None."""
    try:
        load_usrbio()
    except ImportError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class Hf3fsSpec:
    """A parsed `hf3fs:DIR[?option=value&...]` spec."""

    root: str
    threads: int = 2  # lanes: batches in flight at once
    timeout: float = 30.0  # seconds a submission may take
    fsync: bool = False
    entries: int = 64  # I/Os per ring submission
    iov_mb: int = 64  # each lane's shared-memory buffer
    mount: str = ""  # the 3FS mount point; found from DIR when empty

    @classmethod
    def parse(cls, spec: str, **options: Any) -> Hf3fsSpec:
        """Spec options in the query, overridden by keywords. Raises ValueError naming the
        option, TypeError for an unknown keyword."""
        split = split_dir_spec(
            spec, "hf3fs", known=_OPTIONS, options=options, example="hf3fs:/3fs/stage/hicache"
        )
        root, values = split.root, split.values
        return cls(
            root=root,
            threads=integer(values.get("threads", 2), "hf3fs option threads", lo=1),
            timeout=number(values.get("timeout", 30.0), "hf3fs option timeout", lo=0, open_lo=True),
            fsync=flag(values.get("fsync", False), "hf3fs option fsync"),
            entries=integer(values.get("entries", 64), "hf3fs option entries", lo=1),
            iov_mb=integer(values.get("iov_mb", 64), "hf3fs option iov_mb", lo=1),
            mount=str(values.get("mount", "")),
        )


class _Lane:
    """One batch's usrbio resources: a read ring, a write ring, and a shared-memory buffer
    registered with the mount as their iov. Used by one worker thread at a time."""

    def __init__(self, usrbio: Any, mount: str, entries: int, nbytes: int) -> None:
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            self.iov = usrbio.make_iovec(self.shm, mount)
            self.reads = usrbio.make_ioring(mount, entries, for_read=True)
            self.writes = usrbio.make_ioring(mount, entries, for_read=False)
        except BaseException:
            self.close()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()  # the mapping stays; nothing is left behind in /dev/shm
        buf = self.shm.buf
        if buf is None:  # pragma: no cover - a fresh SharedMemory always has its buffer
            raise RuntimeError("shared memory without a buffer")
        self.buf: memoryview = buf
        self.stalled = False  # a submission outlived the timeout: never reuse this lane

    def close(self) -> None:
        for name in ("reads", "writes", "iov"):
            with contextlib.suppress(AttributeError):
                delattr(self, name)  # usrbio releases them when dropped
        with contextlib.suppress(AttributeError):
            del self.buf
        with contextlib.suppress(BufferError):
            self.shm.close()


class _Stalled(Exception):
    """A submission not reaped within the timeout (its lane is marked stalled)."""


class Hf3fsBackend(PageFileBackend):
    """StorageBackend over files on a 3FS mount through usrbio; see the module docstring. Owns
    its lanes, its counters and its temporary files."""

    def __init__(
        self,
        spec: Hf3fsSpec,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        usrbio: Any = None,
    ) -> None:
        super().__init__(spec.root, spec.threads, namespace=namespace, emit=emit)
        self.spec = spec
        self._usrbio = usrbio  # the API module: hf3fs_fuse.io unless given (tests)
        self._lock = threading.Lock()  # opening, and the lane set
        self._mount = ""
        self._idle_lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        self._lanes: list[_Lane] = []  # every live lane, idle or taken (closed at aclose)

    def __repr__(self) -> str:
        return f"Hf3fsBackend({self.root!r})"

    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        usrbio: Any = None,
        **options: Any,
    ) -> Hf3fsBackend:
        """Spec `hf3fs:DIR[?threads=2&timeout=30&fsync=no&entries=64&iov_mb=64&mount=PATH]`;
        `usrbio` replaces the `hf3fs_fuse.io` module (a stand-in, in tests)."""
        return cls(Hf3fsSpec.parse(spec, **options), namespace=namespace, emit=emit, usrbio=usrbio)

    # -- opening --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Load usrbio, find the mount, make the directory and one lane. BackendUnavailable
        when usrbio is missing or DIR is not on a 3FS mount."""
        try:
            await anyio.to_thread.run_sync(self._ready)
        except (ImportError, OSError, RuntimeError, ValueError) as exc:
            raise BackendUnavailable(f"hf3fs store {self.root!r} cannot open: {exc}") from exc

    def _ready(self) -> Any:
        """The usrbio module, with the mount found and the directory made. Worker thread."""
        with self._lock:
            if self._usrbio is None:
                self._usrbio = load_usrbio()
            if not self._mount:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                self._mount = self.spec.mount or str(self._usrbio.extract_mount_point(self.root))
            return self._usrbio

    def _take_lane(self) -> _Lane:
        usrbio = self._ready()
        try:
            return self._idle_lanes.get_nowait()
        except queue.Empty:
            pass
        lane = _Lane(usrbio, self._mount, self.spec.entries, self.spec.iov_mb << 20)
        with self._lock:
            self._lanes.append(lane)
        return lane

    def _retire(self, lane: _Lane) -> None:
        with self._lock, contextlib.suppress(ValueError):  # aclose may have taken them all
            self._lanes.remove(lane)
        lane.close()

    def stats(self) -> Mapping[str, int | float]:
        return {**super().stats(), "lanes": len(self._lanes)}

    def _release(self) -> None:
        """Release every lane (rings, iovs, shared memory); nothing is in flight."""
        with self._lock:
            lanes, self._lanes = self._lanes, []
        while not self._idle_lanes.empty():
            self._idle_lanes.get_nowait()
        for lane in lanes:
            lane.close()

    # -- worker-thread side: files and I/O; no counters, no events ------------------------

    def _read_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> ReadResult:
        result = ReadResult(ok=[False] * len(keys), corrupt=[], errors=[])
        done: ReadResult | None = self._with_lane(
            self._read_batch, result.errors, keys, paths, pages
        )
        return result if done is None else done

    def _write_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> WriteResult:
        oks: list[bool] = [False] * len(keys)
        errors: list[tuple[str, str]] = []
        done: WriteResult | None = self._with_lane(self._write_batch, errors, keys, paths, pages)
        return (oks, errors) if done is None else done

    def _with_lane(
        self, batch: Callable[..., Any], errors: list[tuple[str, str]], keys: list[str], *args: Any
    ) -> Any:
        """`batch(lane, keys, *args)` on an idle lane (made if none); a lane whose submission
        stalled is retired, any other goes back to the idle set. None, the failure added to
        `errors`, when no lane can be made."""
        try:
            lane = self._take_lane()
        except (ImportError, OSError, RuntimeError, ValueError) as exc:
            errors.append((keys[0], f"no usrbio lane: {os_error(exc)}"))
            return None
        try:
            return batch(lane, keys, *args)
        finally:
            if lane.stalled or self._closed:
                self._retire(lane)
            else:
                self._idle_lanes.put(lane)

    def _submit(self, lane: _Lane, ring: Any, ios: int) -> list[int]:
        """Submit what was prepared on `ring` and reap `ios` results (bytes moved, or a
        negative errno each). Raises _Stalled, the lane marked, past the timeout."""
        timeout = datetime.timedelta(seconds=self.spec.timeout)
        try:
            done = ring.submit().wait(min_results=ios, timeout=timeout)
        except Exception as exc:
            lane.stalled = True
            raise _Stalled(f"usrbio submission failed: {type(exc).__name__}: {exc}") from exc
        if len(done) < ios:
            lane.stalled = True
            raise _Stalled(f"{len(done)} of {ios} I/Os done after {self.spec.timeout}s")
        return [int(d.result) for d in done]

    def _rounds(self, sizes: list[int]) -> list[range]:
        """The batch split into runs of pages that fit one lane's iov and ring."""
        limit = self.spec.iov_mb << 20
        runs: list[range] = []
        start, used = 0, 0
        for i, size in enumerate(sizes):
            if size > limit:
                raise ValueError(
                    f"a value of {size} bytes does not fit the {self.spec.iov_mb} MiB iov "
                    "(raise the hf3fs option iov_mb)"
                )
            if i > start and (used + size > limit or i - start == self.spec.entries):
                runs.append(range(start, i))
                start, used = i, 0
            used += size
        runs.append(range(start, len(sizes)))
        return runs

    def _write_batch(
        self, lane: _Lane, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> WriteResult:
        hsize = self._header_size
        lengths = [sum(p.nbytes for p in pieces) for pieces in pages]
        oks = [False] * len(keys)
        errors: list[tuple[str, str]] = []
        usrbio, buf = self._ready(), lane.buf
        try:
            rounds = self._rounds([hsize + n for n in lengths])
        except ValueError as exc:
            return oks, [(keys[0], str(exc))]
        for run in rounds:
            opened: list[tuple[str, int, bool]] = []  # (temporary path, fd, registered)
            prepared = 0  # pages whose I/O is on the ring: submitted even if a later one fails
            try:
                offset = 0
                for i in run:
                    try:
                        tmp = self._temp_path()
                        fd = create_temp(tmp)
                        opened.append((tmp, fd, False))
                        usrbio.register_fd(fd)
                        opened[-1] = (tmp, fd, True)
                        at = offset + hsize
                        for piece in pages[i]:
                            buf[at : at + piece.nbytes] = piece
                            at += piece.nbytes
                        payload = buf[offset + hsize : at]
                        buf[offset : offset + hsize] = pack_header(
                            keys[i], lengths[i], checksum([payload])
                        )
                        payload.release()
                        lane.writes.prepare(lane.iov[offset:at], False, fd, 0)
                    except (OSError, RuntimeError, ValueError) as exc:  # a file, or usrbio
                        errors.append((keys[i], os_error(exc)))
                        break
                    prepared += 1
                    offset = at
                moved = self._submit(lane, lane.writes, prepared) if prepared else []
                for i, n, (tmp, fd, _) in zip(run, moved, opened):
                    if n != hsize + lengths[i]:
                        errors.append((keys[i], _io_error(n, hsize + lengths[i])))
                        break
                    if self.spec.fsync:
                        os.fsync(fd)
                    place(tmp, paths[i])
                    oks[i] = True
            except _Stalled as exc:
                errors.append((keys[run[0]], str(exc)))
            except OSError as exc:  # fsync or rename
                errors.append((keys[run[0]], os_error(exc)))
            finally:
                for tmp, fd, registered in opened:
                    if registered:
                        with contextlib.suppress(Exception):
                            usrbio.deregister_fd(fd)
                    os.close(fd)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)  # placed ones were renamed away already
            if not all(oks[i] for i in run):
                break  # what follows a failed page cannot be counted as stored
        return oks, errors

    def _read_batch(
        self, lane: _Lane, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> ReadResult:
        result = ReadResult(ok=[False] * len(keys), corrupt=[], errors=[])
        hsize = self._header_size
        wants = [sum(p.nbytes for p in pieces) for pieces in pages]
        usrbio, buf = self._ready(), lane.buf
        try:
            rounds = self._rounds([hsize + n for n in wants])
        except ValueError as exc:
            result.errors.append((keys[0], str(exc)))
            return result
        for run in rounds:
            fds: list[tuple[int, bool]] = []  # (fd, registered)
            present: list[int] = []  # pages whose I/O is on the ring, a prefix of the round
            try:
                offset = 0
                for i in run:
                    try:
                        fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        result.errors.append((keys[i], os_error(exc)))
                        break
                    fds.append((fd, False))
                    try:
                        size = os.fstat(fd).st_size
                        if size != hsize + wants[i]:
                            reason = size_mismatch(fd, keys[i], size, wants[i])
                            result.corrupt.append((keys[i], reason))
                            unlink_all([paths[i]])
                            break
                        usrbio.register_fd(fd)
                        fds[-1] = (fd, True)
                        lane.reads.prepare(lane.iov[offset : offset + size], True, fd, 0)
                    except (OSError, RuntimeError, ValueError) as exc:  # a file, or usrbio
                        result.errors.append((keys[i], os_error(exc)))
                        break
                    present.append(i)
                    offset += size
                if present:
                    moved = self._submit(lane, lane.reads, len(present))
                    offset = 0
                    for i, n in zip(present, moved):
                        size = hsize + wants[i]
                        if n != size:
                            result.errors.append((keys[i], _io_error(n, size)))
                            break
                        self._deliver(buf, offset, keys[i], pages[i], paths[i], result, i)
                        offset += size
            except _Stalled as exc:
                result.errors.append((keys[run[0]], str(exc)))
            finally:
                for fd, registered in fds:
                    if registered:
                        with contextlib.suppress(Exception):
                            usrbio.deregister_fd(fd)
                    os.close(fd)
            if len(present) < len(run) or not all(result.ok[i] for i in run):
                break  # a miss ends what the count can report
        return result

    def _deliver(
        self,
        buf: memoryview,
        offset: int,
        key: str,
        pieces: list[memoryview],
        path: str,
        result: ReadResult,
        i: int,
    ) -> None:
        """Check the value read at `offset` of the iov and, if sound, copy it into `pieces`."""
        hsize = self._header_size
        want = sum(p.nbytes for p in pieces)
        payload = buf[offset + hsize : offset + hsize + want]
        try:
            header = decode_header(buf[offset : offset + hsize], key)
            if header.payload_len != want:
                raise CorruptValue("length", f"payload of {want} bytes, header says more")
            if header.crc32 != checksum([payload]):
                raise CorruptValue("checksum", f"checksum mismatch for {key!r}")
        except CorruptValue as exc:
            result.corrupt.append((key, exc.reason))
            unlink_all([path])
            return
        finally:
            payload.release()
        at = offset + hsize
        for piece in pieces:
            piece[:] = buf[at : at + piece.nbytes]
            at += piece.nbytes
        result.ok[i] = True


def _io_error(moved: int, expected: int) -> str:
    if moved < 0:
        return f"usrbio I/O failed: {os.strerror(-moved)} (errno {-moved})"
    return f"usrbio I/O moved {moved} of {expected} bytes"
