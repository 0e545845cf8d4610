"""A stand-in for 3FS's usrbio Python API (`hf3fs_fuse.io`) over ordinary files, recording
every call, so the hf3fs backend's own logic runs where 3FS is not installed.

It keeps the real API's shape and its rules that a caller can break: an iov is made from a
`multiprocessing.shared_memory.SharedMemory` still present in /dev/shm, and its slices are
opaque (the bytes are reached only through the shared memory, never through the slice); a ring
holds at most `entries` prepared I/Os, reads only if made `for_read`, writes only otherwise;
an I/O needs its fd registered (`register_fd`); `submit().wait(min_results, timeout)` returns
objects with `.result` (bytes moved or a negative errno). `stall()` makes `wait` answer nothing
until its timeout, as a stuck 3FS client would.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Done:
    result: int


class IovSlice:
    """What `iovec[a:b]` gives: a region of the iov, not a buffer."""

    def __init__(self, iov: Iovec, start: int, stop: int) -> None:
        self.iov, self.start, self.stop = iov, start, stop


class Iovec:
    def __init__(self, api: UsrbioStandIn, shm: Any, mount: str) -> None:
        self.api, self.buf, self.mount = api, shm.buf, mount

    def __getitem__(self, item: slice) -> IovSlice:
        start, stop, step = item.indices(len(self.buf))
        assert step == 1, "an iov slice is contiguous"
        return IovSlice(self, start, stop)


class Ioring:
    def __init__(self, api: UsrbioStandIn, mount: str, entries: int, for_read: bool) -> None:
        self.api, self.mount, self.entries, self.for_read = api, mount, entries, for_read
        self.prepared: list[tuple[IovSlice, int, int]] = []
        self.submitted: list[tuple[IovSlice, int, int]] = []

    def prepare(
        self, iov: IovSlice, read: bool, fd: int, offset: int, userdata: Any = None
    ) -> None:
        api = self.api
        api.calls.append(("prepare", "read" if read else "write", iov.stop - iov.start))
        if not isinstance(iov, IovSlice) or iov.iov.mount != self.mount:
            raise ValueError("prepare needs a slice of an iov made on this ring's mount")
        if read != self.for_read:
            raise ValueError(
                f"a ring made with for_read={self.for_read} cannot {'read' if read else 'write'}"
            )
        if fd not in api.registered:
            raise ValueError(f"fd {fd} is not registered (register_fd)")
        if len(self.prepared) + len(self.submitted) >= self.entries:
            raise ValueError(f"ring full: {self.entries} entries")
        self.prepared.append((iov, fd, offset))

    def submit(self) -> Ioring:
        self.api.calls.append(("submit", len(self.prepared)))
        self.submitted += self.prepared
        self.prepared = []
        return self

    def wait(self, min_results: int = 1, timeout: datetime.timedelta | None = None) -> list[Done]:
        api = self.api
        api.calls.append(("wait", min_results))
        limit = None if timeout is None else timeout.total_seconds()
        if api.stalled.is_set() and not api.resumed.wait(limit):
            return []  # nothing reaped within the timeout
        done = []
        for iov, fd, offset in self.submitted:
            view = iov.iov.buf[iov.start : iov.stop]
            try:
                if self.for_read:
                    moved = os.preadv(fd, [view], offset)
                else:
                    moved = os.pwrite(fd, api.tear(view), offset)
            except OSError as exc:
                moved = -(exc.errno or 5)
            done.append(Done(moved))
        self.submitted = []
        return done


class UsrbioStandIn:
    """The module's functions, over files under `mount`. `writes_short_by` makes every write
    move that many bytes fewer (a torn write)."""

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self.registered: set[int] = set()
        self.calls: list[tuple[Any, ...]] = []
        self.live: weakref.WeakSet[Any] = weakref.WeakSet()  # iovs and rings not yet dropped
        self.rings: list[weakref.ref[Ioring]] = []
        self.stalled = threading.Event()
        self.resumed = threading.Event()
        self.writes_short_by = 0
        self.refuse_fds_after: int | None = None  # register_fd fails once this many are held
        self._lock = threading.Lock()

    def tear(self, view: memoryview) -> memoryview:
        return view[: max(0, len(view) - self.writes_short_by)]

    def register_fd(self, fd: int) -> None:
        with self._lock:
            self.calls.append(("register_fd",))
            if self.refuse_fds_after is not None and len(self.registered) >= self.refuse_fds_after:
                raise OSError(24, "too many registered fds")
            if fd in self.registered:
                raise ValueError(f"fd {fd} registered twice")
            os.fstat(fd)  # an open fd
            self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        with self._lock:
            self.calls.append(("deregister_fd",))
            self.registered.remove(fd)

    def extract_mount_point(self, path: str) -> str:
        if not os.path.abspath(path).startswith(self.mount):
            raise ValueError(f"{path} is not on the 3FS mount {self.mount}")
        return self.mount

    def make_iovec(self, shm: Any, mount: str, block_size: int = 0, numa: int = -1) -> Iovec:
        self.calls.append(("make_iovec", shm.size))
        if not os.path.exists(f"/dev/shm/{shm.name.lstrip('/')}"):
            raise FileNotFoundError(f"shared memory {shm.name} is gone (unlinked too early)")
        iov = Iovec(self, shm, mount)
        self.live.add(iov)
        return iov

    def make_ioring(
        self,
        mount: str,
        entries: int,
        for_read: bool = True,
        io_depth: int = 0,
        priority: Any = None,
        timeout: Any = None,
        numa: int = -1,
        flags: int = 0,
    ) -> Ioring:
        self.calls.append(("make_ioring", entries, for_read))
        ring = Ioring(self, mount, entries, for_read)
        self.live.add(ring)
        self.rings.append(weakref.ref(ring))
        return ring

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        self.resumed.clear()
        self.stalled.set()
        try:
            yield
        finally:
            self.stalled.clear()
            self.resumed.set()

    def count(self, name: str) -> int:
        return sum(1 for call in self.calls if call[0] == name)
