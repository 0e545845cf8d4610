"""The writer actor (L1 -> L2): owns the backup stream and every backup in flight.

The tree sends `Backup` commands, never more than its write credits; each completes through the
stream's callback as a `StreamDone` in this inbox, and is reported up as `WriteDone` with a
non-blocking send (the credit guarantees the tree's inbox has room). The plumbing is
`StreamWorker`'s (components/streamworker.py).
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.components.streamworker import StreamWorker
from hicache.messages import Backup, WriteDone


class WriterActor(StreamWorker[Backup]):
    actor_name = "writer"
    job_type = Backup
    done_event = "writer.backup_done"

    def _submit(self, job: Backup, on_done: Callable[[BaseException | None], None]) -> None:
        self._streams.submit_backup(job.device_slots, job.host_slots, on_done=on_done)

    def _finished(self, job: Backup, error: str) -> None:
        self._tree.send_nowait(WriteDone(op=job.op, ok=not error, error=error))
