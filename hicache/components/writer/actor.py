"""The writer actor (L1 -> L2): owns the backup stream and every backup in flight.

The tree sends `Backup` commands, never more than its write credits; each completes through the
stream's callback as a `StreamDone` in this inbox, and is reported up as `WriteDone` with a
non-blocking send (the credit guarantees the tree's inbox has room).
"""

from __future__ import annotations

from collections.abc import Callable

from typing_extensions import assert_never

from hicache.messages import Backup, StreamDone, WriteDone, WriterInbox
from hicache.runtime import Actor, Mailbox
from hicache.types import OpId


def describe(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


class WriterActor(Actor[WriterInbox]):
    def __init__(self, *, streams, tree: Mailbox, bytes_per_token: int, capacity: int) -> None:
        super().__init__("writer", capacity=capacity)
        self._streams = streams
        self._tree = tree
        self._bytes_per_token = bytes_per_token
        self._inflight: dict[OpId, Backup] = {}  # owned here alone
        self._deliver: Callable[[StreamDone], None] | None = None

    async def on_start(self) -> None:
        self._deliver = self.inbox.threadsafe_sender()

    async def handle(self, msg: WriterInbox) -> None:
        match msg:
            case Backup(op=op):
                self._inflight[op] = msg
                deliver = self._deliver
                assert deliver is not None
                self._streams.submit_backup(
                    msg.device_slots,
                    msg.host_slots,
                    on_done=lambda err, op=op: deliver(StreamDone(op=op, error=describe(err))),
                )
            case StreamDone(op=op, error=error):
                job = self._inflight.pop(op)
                tokens = len(job.device_slots)
                self.log.info(
                    "writer.backup_done", op=op, tokens=tokens,
                    bytes=tokens * self._bytes_per_token, ok=not error, error=error or None,
                )
                if job.reply is not None:
                    job.reply.set(not error)
                self._tree.send_nowait(WriteDone(op=op, ok=not error, error=error))
            case _:
                assert_never(msg)
