"""Process-level logging setup, for the application or CLI that embeds hicache."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

import structlog

from hicache.observability.events import LEVELS, EventLog, plain


def configure_logging(
    *, sink: TextIO | None = None, level: str = "info", clock: Callable[[], float] | None = None
) -> EventLog:
    """Render JSON lines to `sink` (default stderr) and return an `EventLog` writing there.

    Also sets structlog's process-wide defaults to the same JSON-lines format with sorted keys,
    so an embedding application's own `structlog.get_logger()` events interleave cleanly. That is
    the one process-wide effect; call it once, from the application, never from library code.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {sorted(LEVELS)}")
    out = sink if sink is not None else sys.stderr
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.JSONRenderer(sort_keys=True, default=plain, separators=(",", ":")),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    return EventLog(clock=clock, sink=out, level=level)
