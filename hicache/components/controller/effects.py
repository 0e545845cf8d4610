"""What the controller asks its driver to do, as data: the controller never awaits, sends,
logs or reads a clock; each step returns a list of these, which the tree actor executes in
order (`actor.py`). Tests of the controller read them instead of running an event loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hicache.components.loader.ticket import LoadTicket
from hicache.messages import (
    Backup,
    ReadPrefetch,
    StartPrefetch,
    StopPrefetch,
    StorageAttachment,
    Upload,
)
from hicache.results import ClearOutcome
from hicache.runtime.reply import Reply
from hicache.types import OpId

Worker = Literal["writer", "uploader", "prefetcher"]
Command = Backup | Upload | StartPrefetch | ReadPrefetch | StopPrefetch  # what `Send` carries


@dataclass(frozen=True, slots=True)
class Send:
    """A command down to a worker (bounded by the controller's credits)."""

    to: Worker
    msg: Command


@dataclass(frozen=True, slots=True)
class SubmitLoad:
    """A load to the loader: bind the handle it answers with into `ticket` (which the answers
    naming the load already carry) before carrying out the next effect."""

    ticket: LoadTicket
    host_slots: np.ndarray
    device_slots: np.ndarray

    @property
    def op(self) -> OpId:
        return self.ticket.op


@dataclass(frozen=True, slots=True)
class Answer:
    """Set a frontend reply."""

    reply: Reply[Any]
    value: Any


@dataclass(frozen=True, slots=True)
class Fail:
    reply: Reply[Any]
    error: BaseException


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    fields: dict[str, Any]
    level: Literal["info", "warning", "error"] = "info"


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Deliver `TimerFired(op)` to the tree after `delay` seconds (a prefetch's timeout)."""

    op: OpId
    delay: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    op: OpId


@dataclass(frozen=True, slots=True)
class ClearBackend:
    """Run the attached backend's clear (with its deadline) and answer `reply`: True, or
    `answer` with `storage=True` when given (a `clear` of several tiers)."""

    reply: Reply[Any]
    answer: ClearOutcome | None = None


@dataclass(frozen=True, slots=True)
class SwitchStorage:
    """Attach `storage` (a `StorageAttachment`) or, with None, detach what is attached (no
    upload or prefetch is in flight then): hand the uploader and prefetcher the backend, keep
    the attachment, emit `storage.attached` / `storage.detached` (with `fields`), answer
    `reply` (attach: True; detach: the attachment, which the facade closes if it owns it)."""

    reply: Reply[Any]
    storage: StorageAttachment | None = None
    fields: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Drained:
    """Everything is released and the tree is empty: answer each reply with the controller's
    ledgers and the bookkeeping tables (`tables`, to which the driver adds its own)."""

    replies: tuple[Reply[Any], ...]
    tables: dict[str, int]


Effect = (
    Send
    | SubmitLoad
    | Answer
    | Fail
    | Event
    | StartTimer
    | CancelTimer
    | ClearBackend
    | SwitchStorage
    | Drained
)


class Effects:
    """The list one controller step fills, with a method per kind of effect. Without `events`
    (the driver's log goes nowhere) events are not built at all; `detail` asks for the slot
    events too (`tree.slots`)."""

    __slots__ = ("detail", "items", "quiet")

    def __init__(self, *, events: bool = True, detail: bool = False) -> None:
        self.items: list[Effect] = []
        self.quiet = not events
        self.detail = detail and events

    def take(self) -> list[Effect]:
        items, self.items = self.items, []
        return items

    def send(self, to: Worker, msg: Command) -> None:
        self.items.append(Send(to, msg))

    def answer(self, reply: Reply[Any], value: Any) -> None:
        self.items.append(Answer(reply, value))

    def fail(self, reply: Reply[Any], error: BaseException) -> None:
        self.items.append(Fail(reply, error))

    def info(self, name: str, **fields: Any) -> None:
        if not self.quiet:
            self.items.append(Event(name, fields))

    def warning(self, name: str, **fields: Any) -> None:
        if not self.quiet:
            self.items.append(Event(name, fields, "warning"))

    def error(self, name: str, **fields: Any) -> None:
        if not self.quiet:
            self.items.append(Event(name, fields, "error"))

    def add(self, effect: Effect) -> None:
        self.items.append(effect)
