"""One-shot replies for request/response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")

_PENDING, _SET, _FAILED = 0, 1, 2


class Reply(Generic[T]):
    """A one-shot answer slot. Create with `ActorSystem.reply()` so a crash can fail it.

    The first outcome wins. `set` on a reply already set is a bug and raises; `set` or `fail` on
    a reply already failed (its requester timed out, or the actor system failed it after a crash) is
    ignored, so a late answer never crashes the answering actor.
    """

    __slots__ = ("_event", "_value", "_error", "_state", "_on_done", "_turn")

    def __init__(
        self,
        *,
        on_done: Callable[[Reply[T]], None] | None = None,
        turn: Callable[..., Awaitable[None]] | None = None,
        loop_event: bool = False,
    ) -> None:
        """`loop_event`: wait on a plain `asyncio.Event` (the actor system asks for it on asyncio
        without the sequencer): anyio's wrapper finds the backend on every creation and
        yields once more on every wait, and a frontend call makes one reply."""
        self._event: anyio.Event | asyncio.Event = asyncio.Event() if loop_event else anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._state = _PENDING
        self._on_done = on_done
        self._turn = turn

    @property
    def done(self) -> bool:
        return self._state != _PENDING

    def set(self, value: T) -> None:
        """Answer. Mutates the reply once; wakes the waiter."""
        if self._state == _SET:
            raise RuntimeError("reply already set: a one-shot reply takes one answer")
        if self._state == _FAILED:
            return
        self._value = value
        self._finish(_SET)

    def fail(self, exc: BaseException) -> None:
        """Answer with an error that `wait` raises. No effect on a reply already done."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"Reply.fail needs an exception, got {type(exc).__name__}")
        if self._state != _PENDING:
            return
        self._error = exc
        self._finish(_FAILED)

    def _finish(self, state: int) -> None:
        self._state = state
        self._event.set()
        if self._on_done is not None:
            self._on_done(self)

    async def wait(self) -> T:
        """Wait for the answer; raise the failure if it failed (e.g. `ActorFailed`)."""
        await self._event.wait()
        if self._turn is not None:
            await self._turn(keep_result=True)
        return self.result()

    def result(self) -> T:
        """The answer, without waiting. Raises `RuntimeError` while still pending."""
        if self._state == _PENDING:
            raise RuntimeError("reply is still pending")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = ("pending", "set", "failed")[self._state]
        return f"<Reply {state}>"
