"""`hicache replay`'s progress display: rich's live bar, a plain line on stderr, or nothing,
each showing the hit rate so far."""

from __future__ import annotations

import sys
import time

from typing_extensions import Self

from hicache.cli.tally import Tally

__all__ = ["live_hit_rate", "progress_display"]


def live_hit_rate(tally: Tally) -> float:
    """The hit rate so far: L1 hits of the completed steps plus every token loaded back."""
    return (tally.device_hit + tally.loaded) / tally.input_tokens if tally.input_tokens else 0.0


class _PlainProgress:
    """A one-line bar on stderr (when rich is not installed, or stdout is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._start = time.perf_counter()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()

    def __call__(self, tally: Tally) -> None:
        done, total, width = tally.requests, self.total, 30
        filled = width * done // max(total, 1)
        rate = done / max(time.perf_counter() - self._start, 1e-9)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"requests  {rate:6.1f} req/s  hit rate {live_hit_rate(tally):.4f}"
        )
        sys.stderr.flush()


class _RichProgress:
    """A live rich progress bar on stdout with the hit rate so far (stdout is a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "requests  hit rate [bold]{task.fields[hit]:.4f}[/]"
                "  ({task.fields[rate]:.1f} req/s)"
            ),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=sys.stdout),
            auto_refresh=False,
        )
        self._task = self._progress.add_task("replay", total=total, hit=0.0, rate=0.0)
        self._start = time.perf_counter()
        self._shown = 0.0

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.refresh()
        self._progress.stop()

    def __call__(self, tally: Tally) -> None:
        now = time.perf_counter()
        self._progress.update(
            self._task,
            completed=tally.requests,
            hit=live_hit_rate(tally),
            rate=tally.requests / max(now - self._start, 1e-9),
        )
        if now - self._shown >= 0.1:  # redraw at most ten times a second
            self._shown = now
            self._progress.refresh()


class _NoProgress:
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, tally: Tally) -> None:
        pass


def progress_display(total: int, quiet: bool) -> _PlainProgress | _RichProgress | _NoProgress:
    """rich's live bar when stdout is a terminal and rich is installed; else a plain line on
    stderr when that is a terminal; else nothing."""
    if quiet:
        return _NoProgress()
    if sys.stdout.isatty():
        try:
            return _RichProgress(total)
        except ImportError:
            pass
    if sys.stderr.isatty():
        return _PlainProgress(total)
    return _NoProgress()
