"""The actor system: starts every actor in one task group and supervises them.

Lifecycle: `add` actors, then `async with system:`. On a clean exit the actor system waits
until idle, cancels helper tasks and timers, closes every inbox, lets each actor drain it and run
`on_stop`, and joins. When an actor (or helper, or timer callback) raises, the actor system emits
`kernel.actor_failed`, fails every pending reply with `ActorFailed`, closes every inbox, cancels
the group, and `__aexit__` raises that `ActorFailed`. Either way no task outlives the block.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import anyio
from typing_extensions import Self

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport there
    from exceptiongroup import BaseExceptionGroup

import anyio.lowlevel

from hicache.observability.events import EventLog
from hicache.runtime.actor import Actor
from hicache.runtime.clock import Clock, MonotonicClock, TimerHandle
from hicache.runtime.deterministic import deterministic_seed, on_trio
from hicache.runtime.errors import ActorFailed, ActorSystemClosed, ReplyTimeout
from hicache.runtime.mailbox import LoopWakeup, Mailbox
from hicache.runtime.reply import Reply
from hicache.runtime.sequencer import TURN_KEY, Sequencer

T = TypeVar("T")
M = TypeVar("M")

_NEW, _RUNNING, _STOPPING, _STOPPED = "new", "running", "stopping", "stopped"


class _LoopTimer:
    """An asyncio timer as `TimerHandle` sees it (cancel, cancel_called)."""

    __slots__ = ("_timer", "_forget", "cancel_called")

    def __init__(self, timer: asyncio.Handle, forget: Callable[[], object]) -> None:
        self._timer = timer
        self._forget = forget
        self.cancel_called = False

    def cancel(self) -> None:
        self.cancel_called = True
        self._timer.cancel()
        self._forget()


class ActorSystem:
    """Starts, supervises and stops a set of actors. Runs once.

    `deterministic=None` means: deterministic inside `run_deterministic`, otherwise not.
    `seed=None` means: the seed given to `run_deterministic` (0 outside it). Seed 0 grants turns
    in sorted key order; any other seed perturbs the schedule reproducibly.
    `stop_timeout`: clock seconds a clean shutdown may take before the actor system cancels the
    rest."""

    def __init__(
        self,
        *,
        log: EventLog | None = None,
        clock: Clock | None = None,
        deterministic: bool | None = None,
        seed: int | None = None,
        stop_timeout: float = 30.0,
    ) -> None:
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not (stop_timeout > 0 and math.isfinite(stop_timeout)):
            raise ValueError(f"stop_timeout must be a positive finite number, got {stop_timeout!r}")
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.log = log if log is not None else EventLog(clock=self.clock.now)
        self._events = self.log.bind("kernel")
        self._want_deterministic = deterministic
        self._want_seed = seed
        self.deterministic = bool(deterministic)
        self.seed = seed if seed is not None else 0
        self.stop_timeout = stop_timeout
        self.failure: ActorFailed | None = None
        self._actors: dict[str, Actor[Any]] = {}
        self._pending: dict[Reply[Any], None] = {}  # insertion-ordered set of unanswered replies
        self._helpers: dict[int, anyio.CancelScope] = {}
        self._next_helper = 0
        self._state = _NEW
        self._tg: Any = None
        self._sequencer: Sequencer | None = None
        self._sequencer_scope: anyio.CancelScope | None = None
        self._turn: Callable[..., Awaitable[None]] | None = None
        self._aborted = False  # set once by _abort: stop without draining or on_stop
        self._live_actors = 0
        self._actors_done: anyio.Event | None = None
        # asyncio without the sequencer: timers are the loop's own (see `call_later`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_timers: dict[int, _LoopTimer] = {}

    # -- setup ---------------------------------------------------------------------------------

    def add(self, actor: Actor[Any]) -> None:
        """Register an actor; only before the actor system starts. Names must be unique."""
        if self._state != _NEW:
            raise RuntimeError(
                f"cannot add actor {getattr(actor, 'name', actor)!r}: actor system already started"
            )
        if not isinstance(actor, Actor):
            raise TypeError(f"ActorSystem.add needs an Actor, got {type(actor).__name__}")
        if actor.name in self._actors:
            raise ValueError(f"an actor named {actor.name!r} is already added")
        if actor._system is not None:
            raise ValueError(f"actor {actor.name!r} already belongs to another actor system")
        actor._system = self
        self._actors[actor.name] = actor

    @property
    def actors(self) -> dict[str, Actor[Any]]:
        """The added actors by name (a copy)."""
        return dict(self._actors)

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state != _NEW:
            raise RuntimeError("an ActorSystem runs once; create a new one")
        run_seed = deterministic_seed()
        self.deterministic = (
            self._want_deterministic
            if self._want_deterministic is not None
            else run_seed is not None
        )
        self.seed = self._want_seed if self._want_seed is not None else (run_seed or 0)
        if self.deterministic and not on_trio():
            raise RuntimeError(
                "deterministic mode needs anyio's trio backend; run it with run_deterministic()"
            )
        self._actors_done = anyio.Event()
        if self.deterministic:
            self._sequencer = Sequencer(self.seed, self._idle)
            self._turn = self._sequencer.turn
            for actor in self._actors.values():
                actor.inbox._turn = self._turn
        if self._turn is None:
            try:  # asyncio (trio runs no asyncio loop)
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self._loop = None
            else:
                for actor in self._actors.values():
                    actor.inbox.new_event = LoopWakeup
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._state = _RUNNING
        if self._sequencer is not None:
            self._tg.start_soon(self._run_sequencer, name="hicache.sequencer")
        self._live_actors = len(self._actors)
        if not self._actors:
            self._actors_done.set()
        for actor in self._actors.values():
            actor._busy = True  # until it first waits on its inbox
            self._tg.start_soon(self._run_actor, actor, name=f"hicache.actor.{actor.name}")
        self._events.info(
            "kernel.started",
            actors=list(self._actors),
            deterministic=self.deterministic,
            seed=self.seed,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        error = exc
        if error is None and self.failure is None:
            try:
                await self._stop_gracefully()
            except BaseException as raised:  # noqa: BLE001 - handed to the task group below
                error = raised
        if self.failure is not None:
            reason = "failure"
        elif error is None:
            reason = "stop_timeout" if self._aborted else "exit"
        else:
            reason = "cancelled" if isinstance(error, anyio.get_cancelled_exc_class()) else "error"
            self._abort(
                lambda: ActorSystemClosed("the actor system stopped before this reply was set")
            )
        suppressed: bool | None = False
        try:
            suppressed = await self._tg.__aexit__(
                type(error) if error is not None else None,
                error,
                error.__traceback__ if error is not None else None,
            )
        except BaseExceptionGroup as group:
            if not (
                error is not None and len(group.exceptions) == 1 and group.exceptions[0] is error
            ):
                raise
        finally:
            self._state = _STOPPED
            leftover = list(self._pending)
            for reply in leftover:
                reply.fail(ActorSystemClosed("the actor system stopped before this reply was set"))
            if self._sequencer is not None:
                self._events.info("kernel.stopped", reason=reason, turns=self._sequencer.turns)
            else:
                self._events.info("kernel.stopped", reason=reason)
        if self.failure is not None:
            raise self.failure
        if error is not None and error is not exc and not suppressed:
            raise error
        return suppressed if error is exc else None

    async def _stop_gracefully(self) -> None:
        self._state = _STOPPING
        assert self._actors_done is not None
        with self.clock.move_on_after(self.stop_timeout) as scope:
            await self.run_until_idle()
            for helper in list(self._helpers.values()):
                helper.cancel()
            self._cancel_loop_timers()
            for actor in self._actors.values():
                actor.inbox.close()
            await self._actors_done.wait()
        if scope.cancelled_caught:
            self._events.warning("kernel.stop_timeout", timeout=self.stop_timeout)
            self._abort(
                lambda: ActorSystemClosed("the actor system stopped before this reply was set")
            )
            return
        if self._turn is not None:
            await self._turn()
        if self._sequencer_scope is not None:
            self._sequencer_scope.cancel()

    def _abort(self, make_error: Callable[[], BaseException]) -> None:
        """Fail pending replies, close every inbox, cancel every task. Idempotent."""
        self._aborted = True
        self._cancel_loop_timers()
        for reply in list(self._pending):
            reply.fail(make_error())
        for actor in self._actors.values():
            actor.inbox.close()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _on_task_failed(self, name: str, exc: Exception) -> None:
        self._events.error(
            "kernel.actor_failed",
            actor=name,
            error=type(exc).__name__,
            message=str(exc),
            first=self.failure is None and not self._aborted,
        )
        if self.failure is not None or self._aborted:
            return  # a consequence of the first failure or of the abort, not a new cause
        self.failure = ActorFailed(name, exc)
        self._abort(lambda: ActorFailed(name, exc))

    # -- tasks ---------------------------------------------------------------------------------

    async def _run_sequencer(self) -> None:
        assert self._sequencer is not None
        with anyio.CancelScope() as self._sequencer_scope:
            await self._sequencer.run()

    async def _run_actor(self, actor: Actor[Any]) -> None:
        TURN_KEY.set(actor.name)
        turn = self._turn
        inbox = actor.inbox
        try:
            if turn is not None:
                await turn()
            await actor.on_start()
            while True:
                actor._busy = False
                try:
                    msg = await inbox.receive()
                except anyio.EndOfStream:
                    break
                actor._busy = True
                if turn is not None:
                    await turn()
                await actor.handle(msg)
                actor._handled += 1
            if turn is not None:
                await turn()
            if self._aborted:
                return  # inbox closed by an abort: no clean stop
            await actor.on_stop()
            stats = inbox.statistics()
            actor.log.info(
                "actor.stopped",
                handled=actor._handled,
                delivered=stats.delivered,
                blocked_sends=stats.blocked_sends,
                high_water=stats.high_water,
            )
        except Exception as exc:  # noqa: BLE001 - any crash stops everything (ActorFailed)
            self._on_task_failed(actor.name, exc)
        finally:
            actor._busy = False
            inbox.discard_receiver()
            self._live_actors -= 1
            if self._live_actors == 0 and self._actors_done is not None:
                self._actors_done.set()

    def _spawn(
        self, fn: Callable[[], Awaitable[None]], *, name: str, key: str, turn_first: bool = True
    ) -> anyio.CancelScope:
        if self._state not in (_RUNNING, _STOPPING):
            raise ActorSystemClosed(f"cannot start {name!r}: the actor system is not running")
        number = self._next_helper
        self._next_helper += 1
        scope = anyio.CancelScope()
        self._helpers[number] = scope
        turn = self._turn if turn_first else None

        async def helper() -> None:
            TURN_KEY.set(f"{key}#{number:06d}")
            try:
                with scope:
                    if turn is not None:
                        await turn()
                    await fn()
            except Exception as exc:  # noqa: BLE001 - any crash stops everything (ActorFailed)
                self._on_task_failed(name, exc)
            finally:
                del self._helpers[number]

        self._tg.start_soon(helper, name=f"hicache.{name}")
        return scope

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> None:
        """Run `fn(*args)` as a helper task in the actor system's group (e.g. waiting on a stream).

        Helpers are cancelled at clean shutdown (after the actor system is idle); one that raises
        stops the actor system like a failing actor, under `name`.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"helper task name must be a non-empty string, got {name!r}")

        async def call() -> None:
            await fn(*args)

        self._spawn(call, name=name, key=f"~task:{name}")

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        """Call `fn()` on the loop after `delay` seconds of the actor system's clock (virtual in
        deterministic mode). Pending timers are cancelled at shutdown."""
        if not (isinstance(delay, (int, float)) and delay >= 0 and math.isfinite(delay)):
            raise ValueError(f"call_later delay must be a finite number >= 0, got {delay!r}")
        handle: TimerHandle

        async def fire() -> None:
            await self.clock.sleep(delay)
            if self._turn is not None:
                await self._turn()
            handle.fired = True
            fn()

        name = f"timer:{getattr(fn, '__qualname__', type(fn).__name__)}"
        if self._loop is not None:
            return self._loop_timer(delay, fn, name)
        # A timer sleeps first and takes its turn when it wakes, not when it starts.
        handle = TimerHandle(self._spawn(fire, name=name, key="~timer", turn_first=False))
        return handle

    def _loop_timer(self, delay: float, fn: Callable[[], None], name: str) -> TimerHandle:
        """`call_later` on asyncio without the sequencer: the loop's own timer calls `fn`, with
        no task (a task per timer cost more than what inline transfer streams schedule with
        it: one completion per copy). Same contract: cancelled at shutdown, a raise stops the
        actor system under `name`."""
        if self._state not in (_RUNNING, _STOPPING):
            raise ActorSystemClosed(f"cannot start {name!r}: the actor system is not running")
        assert self._loop is not None
        number = self._next_helper
        self._next_helper += 1
        handle: TimerHandle

        def fire() -> None:
            self._loop_timers.pop(number, None)
            handle.fired = True
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - any crash stops everything (ActorFailed)
                self._on_task_failed(name, exc)

        loop = self._loop
        timer = _LoopTimer(
            loop.call_soon(fire) if delay == 0 else loop.call_later(delay, fire),
            lambda: self._loop_timers.pop(number, None),
        )
        self._loop_timers[number] = timer
        handle = TimerHandle(timer)
        return handle

    def _cancel_loop_timers(self) -> None:
        for timer in list(self._loop_timers.values()):
            timer.cancel()

    # -- requests ------------------------------------------------------------------------------

    def reply(self) -> Reply[Any]:
        """A one-shot reply tracked by this actor system (failed with `ActorFailed` if an actor
        crashes)."""
        if self._state == _STOPPED:
            raise ActorSystemClosed("the actor system has stopped")
        if self.failure is not None:
            raise self.failure
        reply: Reply[Any] = Reply(
            on_done=self._reply_done, turn=self._turn, loop_event=self._loop is not None
        )
        self._pending[reply] = None
        return reply

    def _reply_done(self, reply: Reply[Any]) -> None:
        self._pending.pop(reply, None)

    @property
    def pending_replies(self) -> int:
        return len(self._pending)

    async def request(
        self,
        target: Mailbox[M],
        make: Callable[[Reply[T]], M],
        *,
        timeout: float | None = None,
    ) -> T:
        """Send `make(reply)` to `target` and wait for the answer.

        With `timeout` (clock seconds, covering the send too) raises `ReplyTimeout(target, timeout)`
        and marks the reply failed, so a late answer is ignored.
        """
        if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"request timeout must be a finite number >= 0, got {timeout!r}")
        reply: Reply[T] = self.reply()
        msg = make(reply)
        if timeout is None:
            await self._send_request(target, msg, reply)
            return await reply.wait()
        with self.clock.move_on_after(timeout):
            await self._send_request(target, msg, reply)
            await reply._event.wait()
        if not reply.done:
            reply.fail(ReplyTimeout(target.name, timeout))
            self._events.warning("kernel.reply_timeout", target=target.name, timeout=timeout)
        if self._turn is not None:
            await self._turn(keep_result=True)
        return reply.result()

    async def _send_request(self, target: Mailbox[M], msg: M, reply: Reply[Any]) -> None:
        try:
            await target.send(msg)
        except BaseException:
            self._reply_done(reply)  # never delivered: nobody can answer it
            raise

    # -- time and idleness ---------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    async def sleep(self, delay: float) -> None:
        """Sleep on the actor system's clock; deterministic mode resumes only on a granted turn."""
        await self.clock.sleep(delay)
        if self._turn is not None:
            await self._turn()

    def _idle(self) -> bool:
        return all(a.inbox.settled() and not a._busy for a in self._actors.values())

    async def run_until_idle(self) -> None:
        """Return once every actor waits on an empty inbox and no sender waits to fill one.

        An actor inside `handle` (sleeping, awaiting a reply) is busy, so virtual time advances
        for it; pending `call_later` timers and helper tasks do not count (they are outside
        input). A run that never settles (a deadlock) never returns: guard with a timeout.
        Deterministic mode: exact (every task blocked, no turn requested, the above holds).
        Production: best effort, the above seen three times in a row with yields between;
        helper tasks are seen only through the messages they send.
        """
        if self._sequencer is not None:
            await self._sequencer.wait_idle()
            return
        quiet_looks = 0
        spins = 0
        while quiet_looks < 3:
            if spins < 100:
                await anyio.lowlevel.checkpoint()
            else:
                await self.clock.sleep(
                    0.001
                )  # something is slow (a thread, real I/O): stop spinning
            spins += 1
            if self._idle():
                quiet_looks += 1
            else:
                quiet_looks = 0
