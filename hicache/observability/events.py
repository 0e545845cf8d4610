"""The event log: every state transition is one JSON object with a stable dotted name.

Every event carries `event`, `seq` (1, 2, ... per log), `t` (clock seconds, rounded to the
microsecond), `component`, `level`, and the ids and values of what changed. Lines are rendered
with sorted keys and never contain wall-clock time or object addresses, so under a virtual clock
the same run writes the same bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Any, TextIO

import anyio
import numpy as np
import structlog

from hicache.observability.capture import _CAPTURES, deliver_to_captures
from hicache.secrets import safe_fields

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
RESERVED_FIELDS = frozenset({"event", "seq", "t", "component", "level"})


def plain(value: Any) -> Any:
    """JSON fallback: a stable, address-free rendering of values `json` cannot encode. A slot
    array becomes its runs of consecutive slots, `[[first, end), ...]` (a page is one run)."""
    if isinstance(value, np.ndarray):
        return slot_runs(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return safe_fields(value)  # no password or secret field reaches a log
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    return f"<{type(value).__name__}>"


def slot_runs(slots: np.ndarray) -> list[list[int]]:
    """`[[first, end), ...]`: the runs of consecutive values of a 1-D int array, in order."""
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    if not arr.size:
        return []
    cuts = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [arr.size]])
    return [[int(arr[s]), int(arr[e - 1]) + 1] for s, e in zip(starts, ends)]


def loop_time() -> float:
    """The running event loop's monotonic time: virtual under `run_deterministic` (trio's
    `MockClock`), real otherwise; `time.monotonic()` outside a loop. What events are stamped
    with by default, and what the runtime's `MonotonicClock` reads, so the two always agree."""
    try:  # asyncio's own clock first: what anyio reads there, without finding the backend
        return asyncio.get_running_loop().time()
    except RuntimeError:  # trio, or no loop at all
        pass
    try:
        return anyio.current_time()
    except RuntimeError:  # no running event loop (sniffio cannot tell which library)
        return time.monotonic()


class EventLog:
    """A structlog-based event log. Owned by whoever created it (usually one actor system).

    `sink`: where JSON lines go (None: nowhere; events can still be captured).
    `capture=True` keeps every emitted event dict in `events` (for tests and replay tools).
    Mutates only its own counter, its sink and its capture list.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        sink: TextIO | None = None,
        level: str = "info",
        capture: bool = False,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"unknown log level {level!r}; expected one of {sorted(LEVELS)}")
        self._clock = clock if clock is not None else loop_time
        self._sink = sink
        self._seq = 0
        self._events: list[dict[str, Any]] | None = [] if capture else None
        self._listeners: tuple[Callable[[dict[str, Any]], None], ...] = ()
        self.level = level
        processors: list[Any] = [structlog.processors.add_log_level, self._stamp, self._collect]
        if sink is None:
            processors.append(_drop)
            logger: Any = structlog.ReturnLogger()
        else:
            processors.append(
                structlog.processors.JSONRenderer(
                    sort_keys=True, default=plain, separators=(",", ":")
                )
            )
            logger = structlog.WriteLogger(file=sink)
        self._logger = structlog.wrap_logger(
            logger,
            processors=processors,
            wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
            context_class=dict,
            cache_logger_on_first_use=True,
        )

    @property
    def recording(self) -> bool:
        """Whether an emitted event goes anywhere (a sink, the capture list, a listener, a
        test's `capture_events`): detail events are worth building only then."""
        return bool(
            self._sink is not None or self._events is not None or self._listeners or _CAPTURES.get()
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event emitted so far; only for a log created with `capture=True`."""
        if self._events is None:
            raise RuntimeError("this EventLog does not capture; create it with capture=True")
        return self._events

    @property
    def seq(self) -> int:
        """The `seq` of the last event emitted (0 before the first)."""
        return self._seq

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(event_dict)` for every event emitted from now on (after the level
        filter, with `seq` and `t` stamped), in emission order, on the emitting thread. The
        dict is the log's own: read it, do not keep or change it. A listener that raises is
        ignored for that event: observers never break the cache."""
        self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Stop calling `listener` (no error if it was not added)."""
        self._listeners = tuple(x for x in self._listeners if x != listener)  # bound methods

    def bind(self, component: str, **ids: Any) -> BoundEvents:
        """A logger that stamps `component` and `ids` on every event it emits."""
        return BoundEvents(self, component, ids)

    def emit(self, event: str, *, component: str, level: str = "info", **fields: Any) -> None:
        """Emit one event. Raises `ValueError` for an unknown level or a reserved field name."""
        method = getattr(self._logger, level, None) if level in LEVELS else None
        if method is None:
            raise ValueError(f"unknown log level {level!r}; expected one of {sorted(LEVELS)}")
        clash = RESERVED_FIELDS.intersection(fields)
        if clash:
            raise ValueError(f"event {event!r}: field names {sorted(clash)} are reserved")
        method(event, component=component, **fields)

    def _stamp(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        event_dict["seq"] = self._seq
        event_dict["t"] = round(self._clock(), 6)
        return event_dict

    def _collect(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if self._events is not None:
            self._events.append(dict(event_dict))
        deliver_to_captures(event_dict)
        for listener in self._listeners:
            try:
                listener(event_dict)
            except Exception:  # noqa: BLE001, S110 - an observer's bug must not stop an actor
                pass
        return event_dict


def _drop(_logger: Any, _method: str, _event_dict: dict[str, Any]) -> Any:
    raise structlog.DropEvent


class BoundEvents:
    """An `EventLog` view with a fixed component and ids. Cheap; create freely."""

    __slots__ = ("_log", "component", "_ids")

    def __init__(self, log: EventLog, component: str, ids: dict[str, Any]) -> None:
        self._log = log
        self.component = component
        self._ids = ids

    def bind(self, **ids: Any) -> BoundEvents:
        return BoundEvents(self._log, self.component, {**self._ids, **ids})

    @property
    def recording(self) -> bool:
        return self._log.recording

    def debug(self, event: str, **fields: Any) -> None:
        self._log.emit(event, component=self.component, level="debug", **self._ids, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log.emit(event, component=self.component, level="info", **self._ids, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log.emit(event, component=self.component, level="warning", **self._ids, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log.emit(event, component=self.component, level="error", **self._ids, **fields)
