"""An ordered job queue drained by one thread: the execution context of CPU and CUDA streams."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class OrderedWorker:
    """Runs submitted callables one at a time, in submission order, on its own thread.

    A job must not raise (streams wrap copies and report errors via on_done); if one does,
    the error is kept in `unexpected` and the worker goes on, so no later job hangs."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()  # None: stop
        self._closed = False
        self._lock = threading.Lock()
        self.unexpected: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer streams are closed")
            self._queue.put(job)

    def close(self) -> None:
        """Let queued jobs finish, then stop the thread. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - keep draining: a stuck queue hangs every waiter
                self.unexpected.append(exc)
