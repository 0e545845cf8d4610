"""`hicache check-log EVENTS.jsonl`: re-derive what the event log says happened and check the
invariants it lets one check. Exit 0 when the log holds, 1 naming the first violation, 2 when
the file cannot be read, is not text, or holds no events.

What is checked (docs/events.md, "Checking a log", lists what the events do not let it check
and the fields that would), in layers: the framing of each line (`read.py`); runs,
requests, their locks, slots and L1 (`runs.py`); the ops handed to the workers: op
ids, loads, backups, uploads, prefetches (`ops.py`). Here: the checker they make up,
and the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hicache.cli.checklog.ops import OpChecks
from hicache.cli.checklog.read import Report, Violation


class LogChecker(OpChecks):
    """Feed events in order (`feed`), then `finish()`. Raises `Violation` at the first break."""


def check_events(events: Iterable[dict[str, Any]], *, device_tokens: int | None = None) -> Report:
    """Check a sequence of event dicts (e.g. `EventLog(capture=True).events`)."""
    checker = LogChecker(device_tokens=device_tokens)
    for i, e in enumerate(events, 1):
        checker._line = i
        checker.feed(e)
    return checker.finish()


def check_file(path: str | Path, *, device_tokens: int | None = None) -> Report:
    checker = LogChecker(device_tokens=device_tokens)
    with open(path, encoding="utf-8") as f:
        for text in f:
            checker.feed_line(text)
    return checker.finish()


def run(args: argparse.Namespace) -> int:
    try:
        report = check_file(args.events, device_tokens=args.device_tokens)
    except Violation as v:
        print(f"hicache check-log: {args.events}: {v}", file=sys.stdout)
        return 1
    except OSError as exc:
        print(f"hicache check-log: error: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # not a text file: not an event log at all
        print(
            f"hicache check-log: error: {args.events}: not a UTF-8 event log (byte "
            f"{exc.start}: {exc.reason})",
            file=sys.stderr,
        )
        return 2
    if not report.events:
        print(
            f"hicache check-log: error: {args.events}: holds no events (nothing to check)",
            file=sys.stderr,
        )
        return 2
    if not args.quiet:
        r = report
        print(
            f"{args.events}: ok: {r.events} events, {r.runs} run(s); {r.matches} matches, "
            f"{r.inserts} inserts, {r.loads} loads, {r.backups} backups, {r.uploads} "
            f"uploads, {r.prefetches} prefetches; L1 held at most {r.max_device_tokens} "
            "tokens"
        )
    return 0
