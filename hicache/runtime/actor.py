"""The actor base: one task, one mailbox, its state owned alone."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from hicache.runtime.mailbox import Mailbox

if TYPE_CHECKING:
    from hicache.observability.events import BoundEvents, EventLog
    from hicache.runtime.clock import Clock, TimerHandle
    from hicache.runtime.reply import Reply

M = TypeVar("M")
T = TypeVar("T")


class SystemServices(Protocol):
    """What an actor uses of the actor system that runs it (`Actor.system`; `ActorSystem` provides
    it). Time, waits and concurrent work go through these, so deterministic mode can sequence them.
    Declared here so that this module does not import the actor system, which imports it."""

    clock: Clock
    log: EventLog

    def now(self) -> float: ...

    async def sleep(self, delay: float) -> None: ...

    def reply(self) -> Reply[Any]: ...

    async def request(
        self, target: Mailbox[Any], make: Callable[[Reply[T]], Any], *, timeout: float | None = None
    ) -> T: ...

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> None: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle: ...


class Actor(Generic[M]):
    """Subclass and implement `handle`, dispatching on the message type::

        async def handle(self, msg: TreeMsg) -> None:
            match msg:
                case Insert(): ...
                case _: assert_never(msg)

    The actor system runs one task per actor: `on_start`, then `handle` for each message in arrival
    order (never two at once), then, after the inbox is closed and drained, `on_stop`. Whatever
    state the subclass keeps is touched only by that task. An exception escaping any of the three
    stops the whole actor system (see `ActorSystem`).
    """

    def __init__(self, name: str, *, capacity: int, reserve: int = 0) -> None:
        if not isinstance(name, str) or not name or name.startswith("~"):
            raise ValueError(
                f"actor name must be a non-empty string not starting with '~', got {name!r}"
            )
        self.name = name
        self.inbox: Mailbox[M] = Mailbox(name, capacity, reserve=reserve)
        self._system: SystemServices | None = None
        self._log: BoundEvents | None = None
        self._busy = False  # inside `handle` (read by production-mode run_until_idle)
        self._handled = 0

    @property
    def system(self) -> SystemServices:
        if self._system is None:
            raise RuntimeError(f"actor {self.name!r} has not been added to an actor system")
        return self._system

    @property
    def log(self) -> BoundEvents:
        """Events stamped with `component=<actor name>`."""
        if self._log is None:
            self._log = self.system.log.bind(self.name)
        return self._log

    @property
    def handled(self) -> int:
        """Messages handled so far."""
        return self._handled

    async def handle(self, msg: M) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    async def on_start(self) -> None:
        """Runs in the actor's task before the first message."""

    async def on_stop(self) -> None:
        """Runs in the actor's task after the inbox is closed and drained (not after a crash)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
