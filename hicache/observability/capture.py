"""Capturing events in tests without any process-wide state: a context variable."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CAPTURES: contextvars.ContextVar[tuple[list[dict[str, Any]], ...]] = contextvars.ContextVar(
    "hicache_event_captures", default=()
)


@contextmanager
def capture_events() -> Iterator[list[dict[str, Any]]]:
    """Collect every event any `EventLog` emits in this context (and tasks started inside it).

    Yields the list the events are appended to (copies of the event dicts, in emission order).
    Enter it before starting the run or actor system: tasks inherit the context when they start.
    """
    captured: list[dict[str, Any]] = []
    token = _CAPTURES.set(_CAPTURES.get() + (captured,))
    try:
        yield captured
    finally:
        _CAPTURES.reset(token)


def deliver_to_captures(event_dict: dict[str, Any]) -> None:
    """Append a copy of `event_dict` to every active capture. Called by `EventLog`."""
    for captured in _CAPTURES.get():
        captured.append(dict(event_dict))
