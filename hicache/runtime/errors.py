"""Typed failures raised by the runtime. Each names what failed, so a log line alone explains it."""

from __future__ import annotations


class ActorSystemError(Exception):
    """Base of every error the runtime raises on its own account."""


class ActorFailed(ActorSystemError):
    """An actor (or helper task of the actor system) raised; the actor system stopped.

    Every reply still pending when the failure happened is failed with one of these, and the
    actor system's `__aexit__` raises it. `cause` is the exception the actor raised (also
    `__cause__`)."""

    def __init__(self, actor: str, cause: BaseException) -> None:
        super().__init__(f"actor {actor!r} failed: {type(cause).__name__}: {cause}")
        self.actor = actor
        self.cause = cause
        self.__cause__ = cause

    def __reduce__(
        self,
    ) -> tuple[
        type[ActorFailed], tuple[str, BaseException]
    ]:  # keep pickling (e.g. across processes in tests) working
        return (type(self), (self.actor, self.cause))


class ReplyTimeout(ActorSystemError, TimeoutError):
    """A request got no reply within `timeout` seconds of the actor system's clock."""

    def __init__(self, target: str, timeout: float) -> None:
        super().__init__(f"no reply from {target!r} within {timeout:g} s")
        self.target = target
        self.timeout = timeout

    def __reduce__(self) -> tuple[type[ReplyTimeout], tuple[str, float]]:
        return (type(self), (self.target, self.timeout))


class ActorSystemClosed(ActorSystemError):
    """The actor system (or the mailbox) was shut down; the message was not delivered."""


KernelClosed = ActorSystemClosed
"""The same class under the name docs/api.md lists among the public errors."""
