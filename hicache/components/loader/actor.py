"""The loader actor (L2 -> L1): owns the load stream and every load in flight.

A `Load` is answered at once with its `LoadHandle` (the engine waits per layer on it); the
completion arrives from the stream as `StreamDone` and is reported up as `LoadDone`. The
plumbing is `StreamWorker`'s (components/streamworker.py).
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.components.streamworker import StreamWorker
from hicache.messages import Load, LoadDone
from hicache.types import OpId


class LoaderActor(StreamWorker[Load]):
    actor_name = "loader"
    job_type = Load
    done_event = "loader.load_done"

    def _parts(self, job: Load) -> list[tuple[OpId, int]]:
        return [(job.op, len(job.device_slots))]

    def _submit(self, job: Load, on_done: Callable[[BaseException | None], None]) -> None:
        job.reply.set(self._streams.submit_load(job.host_slots, job.device_slots, on_done=on_done))

    def _finished(self, job: Load, error: str) -> None:
        self._tree.send_nowait(LoadDone(op=job.op, ok=not error, error=error))
