"""How `hicache replay` ends when it is told to stop, and what it leaves behind.

A replay's default file store lives in a temporary directory (in RAM, /dev/shm, where that is
writable). Three rules keep it from outliving the replay:

- The directory is owned: `owned_scratch` holds an exclusive `flock` on a file inside it for
  the whole run, and removes the directory on every exit.
- SIGTERM, SIGHUP and SIGINT stop the replay after the step in flight (`watch_signals`): the
  cache closes as at the end of a run, the temporary store is removed, a partial summary is
  printed, and the command exits 128 + the signal's number. A second signal cancels at once
  (the cache still closes, without waiting for work in flight). Before and after the event
  loop runs, the same signals raise `Stopped` (`stop_on_signals`).
- At start, `sweep_stale` removes `hicache-replay-*` directories whose lock no process holds:
  replays killed by SIGKILL or a power cut.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import anyio

__all__ = [
    "PREFIX",
    "SIGNALS",
    "StopRequest",
    "Stopped",
    "exit_code",
    "owned_scratch",
    "reinstall_stop_handlers",
    "stop_on_signals",
    "sweep_stale",
    "watch_signals",
]

PREFIX = "hicache-replay-"
_OWNER = ".owner"  # locked by the live replay; holds its pid, for people reading the directory
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(BaseException):
    """A signal arrived outside the event loop; a BaseException, as KeyboardInterrupt is, so
    no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(slots=True)
class StopRequest:
    """The first signal the replay received (None: none yet), read between steps."""

    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGTERM, SIGHUP and SIGINT raise `Stopped` (the default handlers restored after)."""

    def raise_stopped(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    if not _main_thread():  # only the main thread may set handlers; the caller's stay
        yield
        return
    previous = {sig: signal.signal(sig, raise_stopped) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reinstall_stop_handlers() -> None:
    """The event loop restores default handlers when it ends: put `Stopped` back."""

    def raise_stopped(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    if not _main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, raise_stopped)


async def watch_signals(stop: StopRequest, scope: anyio.CancelScope) -> None:
    """Record the first signal in `stop` (the replay ends after its current step); cancel
    `scope` on a second one. Runs until cancelled (at once outside the main thread, where
    signals cannot be received: the replay then runs to its end)."""
    if not _main_thread():
        return
    try:
        with anyio.open_signal_receiver(*SIGNALS) as signals:
            async for signum in signals:
                if stop.signum is None:
                    stop.signum = signum
                    print(
                        f"\nhicache replay: {stop.name}: stopping after this step, closing the cache "
                        "(again to stop at once)",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    scope.cancel()
    finally:  # the loop's receiver put the default handlers back: a signal from here on
        reinstall_stop_handlers()  # until the loop ends raises Stopped, not a plain exit


@contextlib.contextmanager
def owned_scratch(parent: str | None) -> Iterator[str]:
    """A new `hicache-replay-*` directory under `parent` (None: the system's temporary
    directory), locked as this process's for as long as the context runs, and removed on
    every exit from it."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    try:
        # Locked under another name, then renamed (the lock stays with the file): a concurrent
        # `sweep_stale` never finds this directory's owner file unlocked and removes it.
        claiming = os.path.join(path, _OWNER + ".new")
        fd = os.open(claiming, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(claiming, os.path.join(path, _OWNER))
            yield path
        finally:
            os.close(fd)  # releases the lock
    finally:
        remove_tree(path)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """`shutil.rmtree(path, ignore_errors=True)`, with the first level of directories that has
    enough of them (a file store's shard directories, at most `_SPLIT_DEPTH` down) removed by
    a few threads at once: removing a store is a system call per file, some 330,000 for the
    whole trace, and two cores do that in about two thirds of the time one takes. Symbolic
    links are removed, never followed."""
    level = [os.fspath(path)]
    for _ in range(_SPLIT_DEPTH):
        below: list[str] = []
        for directory in level:
            try:
                with os.scandir(directory) as entries:
                    below += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:  # gone, or unreadable: rmtree below does what can be done
                pass
        if not below:
            break
        level = below
        if len(level) >= 4 * _REMOVE_THREADS:
            break
    threads = min(_REMOVE_THREADS, len(level))
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="hicache-remove") as pool:
            for _ in pool.map(functools.partial(shutil.rmtree, ignore_errors=True), level):
                pass
    shutil.rmtree(path, ignore_errors=True)


_SPLIT_DEPTH = 4
_REMOVE_THREADS = min(4, os.cpu_count() or 1)


def sweep_stale(parent: str | None) -> list[tuple[str, int]]:
    """Remove the `hicache-replay-*` directories under `parent` whose owner lock no process
    holds (their replay ended without cleaning up); (path, bytes) of each removed. A
    directory without an owner file is left alone (it may be being created)."""
    root = Path(parent if parent is not None else tempfile.gettempdir())
    removed: list[tuple[str, int]] = []
    try:
        candidates = sorted(root.glob(f"{PREFIX}*"))
    except OSError:
        return removed
    for path in candidates:
        owner = path / _OWNER
        try:
            fd = os.open(owner, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live replay holds it
            size = _tree_bytes(path)
            remove_tree(path)
            if not path.exists():
                removed.append((str(path), size))
        finally:
            os.close(fd)
    return removed


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal."""
    return 128 + signum
