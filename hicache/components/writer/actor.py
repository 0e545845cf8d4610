"""The writer actor (L1 -> L2): owns the backup stream and every backup in flight.

The tree sends a step's backups as one `Backups` (never more ops than its write credits); they
are copied as one stream job, which completes through the stream's callback as a `StreamDone`
in this inbox and is reported up as one `WriteDone` with a non-blocking send (the credits
guarantee the tree's inbox has room). The plumbing is `StreamWorker`'s
(components/streamworker.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hicache.components.streamworker import StreamWorker
from hicache.messages import Backups, WriteDone
from hicache.types import OpId


class WriterActor(StreamWorker[Backups]):
    actor_name = "writer"
    job_type = Backups
    done_event = "writer.backup_done"

    def _parts(self, job: Backups) -> list[tuple[OpId, int]]:
        return [(b.op, len(b.device_slots)) for b in job.jobs]

    def _submit(self, job: Backups, on_done: Callable[[BaseException | None], None]) -> None:
        jobs = job.jobs
        if len(jobs) == 1:
            device, host = jobs[0].device_slots, jobs[0].host_slots
        else:  # one copy for the step: page runs joined stay page runs
            device = np.concatenate([b.device_slots for b in jobs])
            host = np.concatenate([b.host_slots for b in jobs])
        self._streams.submit_backup(device, host, on_done=on_done)

    def _finished(self, job: Backups, error: str) -> None:
        ops = tuple(b.op for b in job.jobs)
        self._tree.send_nowait(WriteDone(ops=ops, ok=not error, error=error))
