"""The loader actor (L2 -> L1): owns the load stream and every load in flight.

A `Load` is answered at once with its `LoadHandle` (the engine waits per layer on it); the
completion arrives from the stream as `StreamDone` and is reported up as `LoadDone`.
"""

from __future__ import annotations

from collections.abc import Callable

from typing_extensions import assert_never

from hicache.components.writer.actor import describe
from hicache.messages import Load, LoadDone, LoaderInbox, StreamDone
from hicache.runtime import Actor, Mailbox
from hicache.types import OpId


class LoaderActor(Actor[LoaderInbox]):
    def __init__(self, *, streams, tree: Mailbox, bytes_per_token: int, capacity: int,
                 reserve: int) -> None:
        super().__init__("loader", capacity=capacity, reserve=reserve)
        self._streams = streams
        self._tree = tree
        self._bytes_per_token = bytes_per_token
        self._inflight: dict[OpId, Load] = {}  # owned here alone
        self._deliver: Callable[[StreamDone], None] | None = None

    async def on_start(self) -> None:
        self._deliver = self.inbox.threadsafe_sender()

    async def handle(self, msg: LoaderInbox) -> None:
        match msg:
            case Load(op=op, reply=reply):
                self._inflight[op] = msg
                deliver = self._deliver
                assert deliver is not None
                handle = self._streams.submit_load(
                    msg.host_slots,
                    msg.device_slots,
                    on_done=lambda err, op=op: deliver(StreamDone(op=op, error=describe(err))),
                )
                reply.set(handle)
            case StreamDone(op=op, error=error):
                job = self._inflight.pop(op)
                tokens = len(job.device_slots)
                self.log.info(
                    "loader.load_done", op=op, tokens=tokens,
                    bytes=tokens * self._bytes_per_token, ok=not error, error=error or None,
                )
                self._tree.send_nowait(LoadDone(op=op, ok=not error, error=error))
            case _:
                assert_never(msg)
