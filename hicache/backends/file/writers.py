"""Who else writes a file store's directory: one lock file per open instance.

Each instance creates `DIR/<namespace digest>/writers/<pid>.<n>` and holds an exclusive
`flock` on it while open. Another instance tells a live writer from a dead one by trying the
same lock without blocking: held means alive; granted means its owner is gone (closed, or
killed: the kernel drops a dead process's locks), and the file is removed. An instance alone
in its directory therefore knows it and skips the rescans that only serve to see other
writers' values (backend.py); the check is one small directory listing per rescan period.

Where `flock` is missing or refused (some network filesystems), every other file counts as a
live writer: rescans then run as if the directory were shared, which is always safe.
"""

from __future__ import annotations

import fcntl
import itertools
import os

from hicache.backends.file.index import WRITERS_DIR

_SEQ = itertools.count()


class WriterRegistry:
    """This instance's lock file in a namespace directory, and a count of the others."""

    def __init__(self, namespace_dir: str) -> None:
        self._dir = os.path.join(namespace_dir, WRITERS_DIR)
        self._fd: int | None = None
        self._seen_ns = -1  # the directory's mtime at the last census
        self._path = os.path.join(self._dir, f"{os.getpid()}.{next(_SEQ)}")
        self._register()

    def _register(self) -> None:
        try:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError:
            return  # others then see no file of ours: they treat the directory as theirs
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        self._fd = fd

    def changed(self) -> bool:
        """Whether an instance opened or closed the directory since the last census, or the
        directory was removed: one `stat` (a killed one shows only at a census)."""
        try:
            return os.stat(self._dir).st_mtime_ns != self._seen_ns
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def reregister_if_removed(self) -> bool:
        """True when the directory was removed under this instance (with every value in it);
        this instance's lock file is then made again."""
        if self._fd is None or os.path.exists(self._path):
            return False
        os.close(self._fd)
        self._fd = None
        self._register()
        return True

    def census(self) -> tuple[int, int]:
        """(other instances with the directory open now, dead ones found): a dead one's file
        is removed on the way, and the values it wrote belong to nobody until an instance
        adopts them (backend.py rescans then)."""
        try:
            self._seen_ns = os.stat(self._dir).st_mtime_ns
            with os.scandir(self._dir) as it:
                paths = [e.path for e in it if e.path != self._path]
        except OSError:
            return 0, 0
        alive = sum(1 for path in paths if _alive(path))
        return alive, len(paths) - alive

    def __del__(self) -> None:  # an instance dropped without aclose (the process goes on)
        self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self._path)
        except OSError:
            pass
        os.close(fd)


def _alive(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return True  # no flock here: assume a writer
        try:
            os.unlink(path)  # its owner is gone
        except OSError:
            pass
        return False
    finally:
        os.close(fd)
