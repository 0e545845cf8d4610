"""The deadline of a worker's storage calls, one op at a time (uploader and prefetcher): past
`storage_timeout` the call is cancelled and the worker told; what that means for the op's host
pages is docs/decisions.md's "A storage deadline ends the wait, not the memory claim"."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from hicache.messages import IoDeadline, PrefetcherInbox, UploaderInbox
from hicache.runtime import Mailbox, TimerHandle
from hicache.runtime.actor import SystemServices
from hicache.types import OpId


@dataclass(slots=True)
class CallDeadline:
    """Per op: the running storage call's cancel scope and timer, and a count of calls so a
    deadline that fires just as its call returns is recognised as stale."""

    call: int = 0
    scope: anyio.CancelScope | None = None
    timer: TimerHandle | None = None

    def arm(
        self,
        system: SystemServices,
        inbox: Mailbox[UploaderInbox] | Mailbox[PrefetcherInbox],
        op: OpId,
        timeout: float,
    ) -> anyio.CancelScope:
        """Start a call: its scope, and a timer posting `IoDeadline` to the worker's inbox
        (reserved room: one pending deadline per op)."""
        self.call += 1
        self.scope = anyio.CancelScope()
        deliver, call = inbox.send_nowait, self.call
        self.timer = system.call_later(timeout, lambda: deliver(IoDeadline(op=op, call=call)))
        return self.scope

    def disarm(self) -> None:
        """The call returned."""
        self.scope = None
        if self.timer is not None:
            self.timer.cancel()

    def expire(self, call: int) -> bool:
        """An `IoDeadline` arrived: cancel the call it names if that call is still running.
        False for a stale one."""
        if self.scope is None or call != self.call:
            return False
        self.scope.cancel()
        return True
