"""Attach and detach L3 at run time: the controller's storage switch.

`AttachStorage` and `DetachStorage` are frontend calls, taken in call order, but they do not
hold up the calls behind them: each waits here, in its own queue, until it can be applied.

The switch owns whether storage is on (`on`); the flows ask it.

- A detach turns storage off at once: no upload or prefetch starts from then on (uploads
  waiting for a credit are dropped and counted as skipped, running prefetches are stopped and
  settle with what has arrived, which the backend verified). It then waits until no upload and
  no prefetch is in flight, so that nothing still calls the backend, and only then asks the
  driver to swap the backend out (`SwitchStorage(storage=None)`): the uploader and prefetcher
  drop it, and the facade closes it if the cache opened it.
- An attach behind a detach waits for it; at the head of the queue it turns storage on
  and asks the driver to install the backend first (the `UseBackend` command reaches each
  worker before any upload or prefetch started after it). With a backend attached already it
  is answered False and changes nothing.

Requests never wait for a switch and never fail because of one: while detached they just see
no L3 (`prefetch` answers state `none`, backups are not uploaded).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hicache.components.controller.effects import SwitchStorage
from hicache.components.controller.ops import OpTable
from hicache.components.controller.shared import Step
from hicache.messages import AttachStorage, DetachStorage

Stop = Callable[[Step], tuple[int, int]]
"""What a detach asks of the flows once storage is off: drop the uploads waiting for a credit
and stop the running prefetches; how many of each (the controller's `_stop_storage_work`)."""


@dataclass(slots=True)
class _Detaching:
    """The detach at the head of the queue, started: what it found in flight, and when."""

    started: float
    uploads: int
    prefetches: int
    skipped_uploads: int


class StorageSwitch:
    def __init__(self, on: bool) -> None:
        self.on = on  # storage attached and in use: uploads and prefetches may start
        self.calls: deque[AttachStorage | DetachStorage] = deque()  # in call order
        self._detaching: _Detaching | None = None

    def tables(self) -> dict[str, int]:
        return {"storage_calls": len(self.calls)}

    def accept(self, msg: AttachStorage | DetachStorage) -> None:
        self.calls.append(msg)

    def settle(self, step: Step, ops: OpTable, stop: Stop) -> None:
        """Apply the queued switches that can be applied now, in order; a detach waits until
        no upload and no prefetch is in flight (`ops`)."""
        while self.calls:
            msg = self.calls[0]
            if isinstance(msg, AttachStorage):
                self.calls.popleft()
                if self.on:
                    step.out.answer(msg.reply, False)
                else:
                    self.on = True
                    step.out.add(SwitchStorage(msg.reply, msg.storage))
                continue
            if self._detaching is None:
                if not self.on:
                    self.calls.popleft()
                    step.out.answer(msg.reply, None)
                    continue
                self._detaching = self._start_detach(step, ops, stop)
            if ops.of("upload") or ops.of("prefetch"):
                return  # retried after every completion applied (`Controller._settle`)
            self.calls.popleft()
            done, self._detaching = self._detaching, None
            step.out.add(
                SwitchStorage(
                    msg.reply,
                    None,
                    {
                        "uploads": done.uploads,
                        "prefetches": done.prefetches,
                        "skipped_uploads": done.skipped_uploads,
                        "seconds": round(step.now - done.started, 6),
                    },
                )
            )

    def _start_detach(self, step: Step, ops: OpTable, stop: Stop) -> _Detaching:
        """Storage off for new work; stop what would still start storage calls."""
        self.on = False
        skipped, running = stop(step)
        return _Detaching(
            started=step.now,
            uploads=len(ops.of("upload")),
            prefetches=running,
            skipped_uploads=skipped,
        )
