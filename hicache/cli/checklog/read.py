"""Reading an event log for `hicache check-log`: each line parsed, its framing checked, and
the event handed to the `_on_<event>` handler of the layer that checks it
(`runs.py`, `ops.py`).

Framing: every line is a JSON object with `event`, `seq`, `t`, `component`, `level`; `seq`
runs 1, 2, 3, ... without gaps; `t` never goes back; a worker's events carry its component.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["LogReader", "Report", "Violation", "rid_of"]

_WORKERS = ("tree", "writer", "loader", "uploader", "prefetcher")


class Violation(Exception):
    """The first invariant the log breaks: where, and what."""

    def __init__(self, line: int, event: dict[str, Any] | None, message: str) -> None:
        where = f"line {line}"
        if event is not None:
            where += f" (seq {event.get('seq')}, {event.get('event')})"
        super().__init__(f"{where}: {message}")
        self.line, self.event, self.message = line, event, message


@dataclass
class Report:
    """What a log that holds contained."""

    events: int = 0
    runs: int = 0
    loads: int = 0
    backups: int = 0
    uploads: int = 0
    prefetches: int = 0
    matches: int = 0
    inserts: int = 0
    max_device_tokens: int = 0
    slot_events: int = 0


class LogReader:
    """Reads events in order and fails at the first break; subclasses add the `_on_<event>`
    handlers and the state they re-derive."""

    def __init__(self) -> None:
        self.report = Report()
        self._line = 0
        self._event: dict[str, Any] | None = None
        self._seq = 0
        self._t = float("-inf")
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        """Forget what a run left behind (at each `kernel.started`); subclasses extend it."""

    def _fail(self, message: str) -> NoReturn:
        raise Violation(self._line, self._event, message)

    def _count(self, e: dict[str, Any], name: str) -> int:
        value = e.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self._fail(f"field {name!r} is {value!r}, not a count")
        return value

    def feed_line(self, text: str) -> None:
        self._line += 1
        self._event = None
        if not text.strip():
            return
        try:
            event = json.loads(text)
        except json.JSONDecodeError as exc:
            self._fail(f"not JSON: {exc}")
        if not isinstance(event, dict):
            self._fail("not a JSON object")
        self.feed(event)

    def feed(self, e: dict[str, Any]) -> None:
        self._event = e
        for name in ("event", "seq", "t", "component", "level"):
            if name not in e:
                self._fail(f"no {name!r} field")
        self.report.events += 1
        seq, t = e["seq"], e["t"]
        if seq != self._seq + 1:
            self._fail(f"seq {seq} follows seq {self._seq}: events are missing or out of order")
        self._seq = seq
        if not isinstance(t, (int, float)) or t < self._t:
            self._fail(f"t {t!r} goes back from {self._t}")
        self._t = t
        name, component = e["event"], e["component"]
        prefix = name.split(".", 1)[0]
        if prefix in _WORKERS and component != prefix:
            self._fail(f"component {component!r} for a {prefix} event")
        handler = getattr(self, "_on_" + name.replace(".", "_"), None)
        if handler is not None:
            handler(e)

    def finish(self) -> Report:
        self._event = None
        return self.report


def rid_of(e: dict[str, Any]) -> Any:
    """The event's request id, hashable (a JSON list read back as a tuple)."""
    rid = e.get("rid")
    return tuple(rid) if isinstance(rid, list) else rid
