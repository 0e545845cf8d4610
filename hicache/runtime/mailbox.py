"""Bounded FIFO mailboxes: one receiver (the owning actor), many senders, nothing ever dropped."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from hicache.runtime.errors import ActorSystemClosed

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class MailboxStatistics:
    """A snapshot of one mailbox. `used` never exceeds `capacity + reserve`."""

    used: int  # messages buffered now
    capacity: int  # bound for ordinary (blocking) sends
    waiting_senders: int  # tasks blocked in `send` right now
    reserve: int  # extra room only `send_nowait` (credited completions) may use
    delivered: int  # messages accepted since creation
    blocked_sends: int  # sends that had to wait for room (backpressure events)
    high_water: int  # the largest `used` ever seen


class LoopWakeup:
    """What a mailbox's one receiver parks on while it is empty, on an asyncio loop: a bare
    future (an `asyncio.Event` builds a waiter list and a future per wait). One waiter only: a
    cancelled wait cancels the future, and the next wait makes a new one."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future = asyncio.get_running_loop().create_future()

    def set(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        await self._future


class _Waiter:
    """One blocked sender's place in line; the event is replaced when it must wait again."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


class Mailbox(Generic[M]):
    """A typed, bounded mailbox: a deque, and an anyio event the receiver parks on while it is
    empty (a memory object stream costs several times as much per message, and an actor
    exchanges several messages per cache call).

    Ownership: the buffer belongs to the receiving actor; senders only append.
    Invariants: FIFO; ordinary senders are admitted only while `used < capacity` and strictly in
    arrival order (a blocked sender is never overtaken by a later ordinary sender); `send_nowait`
    may also use the `reserve` (room that credit-holding senders of completions count on, so a
    completion never waits behind ordinary traffic); `used <= capacity + reserve` always.
    Nothing is dropped: a send either delivers, waits, or raises (`ActorSystemClosed`,
    `WouldBlock`)."""

    def __init__(self, name: str, capacity: int, *, reserve: int = 0) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"mailbox name must be a non-empty string, got {name!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"mailbox {name!r}: capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
            raise ValueError(f"mailbox {name!r}: reserve must be an int >= 0, got {reserve!r}")
        self.name = name
        self.capacity = capacity
        self.reserve = reserve
        self._buffer: deque[M] = deque()
        self._ready: anyio.Event | LoopWakeup | None = None  # the receiver's, while it waits
        # What the receiver waits on: the actor system swaps in `LoopWakeup` on an asyncio loop
        # without its sequencer (anyio's event finds the backend on every creation).
        self.new_event: Callable[[], anyio.Event | LoopWakeup] = anyio.Event
        self._waiters: deque[_Waiter] = deque()
        self._used = 0
        self._closed = False
        # Set by a deterministic actor system: awaited before a woken sender touches shared state.
        self._turn: Callable[..., Awaitable[None]] | None = None
        self._delivered = 0
        self._blocked_sends = 0
        self._high_water = 0

    # -- senders ---------------------------------------------------------------------------

    async def send(self, msg: M) -> None:
        """Deliver `msg`, waiting while the mailbox is full. Raises `ActorSystemClosed` once closed.

        Cancellation-safe: a send cancelled while waiting has not delivered its message.
        """
        if self._closed:
            raise ActorSystemClosed(f"mailbox {self.name!r} is closed")
        if self._used < self.capacity and not self._waiters:
            self._put(msg)
            return
        await self._send_after_wait(msg)

    def send_nowait(self, msg: M) -> None:
        """Deliver `msg` now, using the reserve if needed.

        Raises `anyio.WouldBlock` when even the reserve is full: for a sender holding a credit
        that is a credit-accounting bug, never a reason to drop. Raises `ActorSystemClosed` once
        closed."""
        if self._closed:
            raise ActorSystemClosed(f"mailbox {self.name!r} is closed")
        if self._used >= self.capacity + self.reserve:
            raise anyio.WouldBlock(
                f"mailbox {self.name!r} is full ({self._used}/{self.capacity}+{self.reserve})"
            )
        self._put(msg)

    def threadsafe_sender(self) -> Callable[[M], None]:
        """A function any thread may call to deliver a message (with `send_nowait` semantics).

        Must be created on the event loop that runs the owning actor. From a worker thread the
        call blocks that thread until the loop has accepted (or refused) the message, so errors
        (`WouldBlock`, `ActorSystemClosed`) reach the caller.
        """
        token = anyio.lowlevel.current_token()
        loop_thread = threading.get_ident()
        send_nowait = self.send_nowait

        def deliver(msg: M) -> None:
            if threading.get_ident() == loop_thread:
                send_nowait(msg)
            else:
                anyio.from_thread.run_sync(send_nowait, msg, token=token)

        return deliver

    async def _send_after_wait(self, msg: M) -> None:
        self._blocked_sends += 1
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while True:
                await waiter.event.wait()
                if self._turn is not None:
                    await self._turn()
                if self._closed:
                    raise ActorSystemClosed(f"mailbox {self.name!r} is closed")
                if self._used < self.capacity and self._waiters[0] is waiter:
                    break
                waiter.event = anyio.Event()
        except BaseException:
            self._waiters.remove(waiter)
            self._wake_next()  # pass on a wake-up this waiter may have consumed
            raise
        self._waiters.popleft()
        self._put(msg)
        self._wake_next()

    def _put(self, msg: M) -> None:
        self._buffer.append(msg)
        ready = self._ready
        if ready is not None:
            self._ready = None
            ready.set()
        self._used += 1
        self._delivered += 1
        if self._used > self._high_water:
            self._high_water = self._used

    def _wake_next(self) -> None:
        if self._waiters and (self._closed or self._used < self.capacity):
            self._waiters[0].event.set()

    # -- the owning actor --------------------------------------------------------------------

    async def receive(self) -> M:
        """Take the oldest message, waiting while empty. Only the owning actor calls this.

        Raises `anyio.EndOfStream` once the mailbox is closed and drained.
        """
        buffer = self._buffer
        while not buffer:  # a cancelled wait leaves every message where it was
            if self._closed:
                raise anyio.EndOfStream
            ready = self._ready = self.new_event()
            await ready.wait()
        msg = buffer.popleft()
        self._used -= 1
        if self._waiters and self._used < self.capacity:
            self._waiters[0].event.set()
        return msg

    def close(self) -> None:
        """Refuse new messages; the owner still drains what is buffered. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ready is not None:  # the receiver drains what is left, then ends
            self._ready.set()
            self._ready = None
        for waiter in self._waiters:
            waiter.event.set()

    def discard_receiver(self) -> None:
        """The owner is gone (crash or cancel): release the buffer. Only the actor system calls
        this."""
        self.close()
        self._buffer.clear()
        self._used = 0

    # -- inspection --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def empty(self) -> bool:
        """No message buffered."""
        return self._used == 0

    def settled(self) -> bool:
        """No message buffered and no sender waiting to add one."""
        return self._used == 0 and not self._waiters

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            used=self._used,
            capacity=self.capacity,
            waiting_senders=len(self._waiters),
            reserve=self.reserve,
            delivered=self._delivered,
            blocked_sends=self._blocked_sends,
            high_water=self._high_water,
        )

    def __repr__(self) -> str:
        return f"Mailbox({self.name!r}, capacity={self.capacity}, reserve={self.reserve})"
