"""One direction of the transfer streams as an actor: the writer's and the loader's common part.

A command from the tree (`Backups`, `Load`) is kept in flight here and submitted to the stream;
the stream's callback posts `StreamDone` into this inbox (from its thread, or the loop for
inline and virtual streams) with `threadsafe_sender`, and the job's end is logged and reported
up with a non-blocking send (the tree's credit guarantees room). Subclasses say how a job is
submitted and how its end is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hicache.kernels.streams.base import TransferStreams
from hicache.messages import Backups, Load, StreamDone, TreeInbox
from hicache.runtime import Actor, Mailbox
from hicache.types import OpId

J = TypeVar("J", Backups, Load)


def describe(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


class StreamWorker(Actor[J | StreamDone]):
    actor_name: str  # "writer" or "loader"
    job_type: type[J]  # the command this direction takes: Backups or Load
    done_event: str  # the event logged when a job ends, e.g. "writer.backup_done"

    def __init__(
        self,
        *,
        streams: TransferStreams,
        tree: Mailbox[TreeInbox],
        bytes_per_token: int,
        capacity: int,
        reserve: int,
    ) -> None:
        super().__init__(self.actor_name, capacity=capacity, reserve=reserve)
        self._streams = streams
        self._tree = tree
        self._bytes_per_token = bytes_per_token
        self._inflight: dict[OpId, J] = {}  # owned here alone
        self._started: dict[
            OpId, float
        ] = {}  # when each job arrived (the actor system's clock): `seconds`
        self._deliver: Callable[[StreamDone], None] | None = None

    async def on_start(self) -> None:
        self._deliver = self.inbox.threadsafe_sender()

    async def handle(self, msg: J | StreamDone) -> None:
        if isinstance(msg, StreamDone):
            job = self._inflight.pop(msg.op)
            started = self._started.pop(msg.op, None)
            if started is not None:  # the log records (see below): an event per op
                seconds = round(self.system.now() - started, 6)
                for op, tokens in self._parts(job):
                    self.log.info(
                        self.done_event,
                        op=op,
                        tokens=tokens,
                        bytes=tokens * self._bytes_per_token,
                        ok=not msg.error,
                        error=msg.error or None,
                        seconds=seconds,
                    )
            self._finished(job, msg.error)
        elif isinstance(msg, self.job_type):
            self._inflight[msg.op] = msg
            if self.log.recording:  # the done event is built only for a log that records
                self._started[msg.op] = self.system.now()
            deliver = self._deliver
            assert deliver is not None
            op = msg.op

            def on_done(err: BaseException | None) -> None:
                deliver(StreamDone(op=op, error=describe(err)))

            self._submit(msg, on_done)
        else:
            raise TypeError(
                f"{self.name} takes {self.job_type.__name__} and StreamDone, "
                f"not {type(msg).__name__}"
            )

    def _parts(self, job: J) -> list[tuple[OpId, int]]:
        """The ops a job carries and their tokens (one for a load; a step's backups)."""
        raise NotImplementedError

    def _submit(self, job: J, on_done: Callable[[BaseException | None], None]) -> None:
        """Queue the job's copy on the stream; `on_done(error or None)` fires once it ends."""
        raise NotImplementedError

    def _finished(self, job: J, error: str) -> None:
        """Report the job's end up (`error` is empty on success)."""
        raise NotImplementedError
