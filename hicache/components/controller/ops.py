"""The controller's op table: every op in flight (backups, loads, uploads, prefetches), the
credits of each kind, and the completions recorded for them and not applied yet.

One pair of verbs for every kind: `start` takes a credit and adds the op's row, `finish`
removes it, gives the credit back and forgets what was recorded for it. One `record` notes a
completion; `progress` lays out what this rank has seen as the vectors TP ranks agree on, and
`ends` says, in apply order, which ops end now and with what values: as the ranks agreed, or
(one rank, `agreed=None`) as they arrived. The flows give each kind its meaning: they decide
when to start an op and what its end does (`sync.py` hands each end to its flow).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

from hicache.components.controller.progress import Progress, Section
from hicache.components.controller.rows import LoadOp, PrefetchOp, UploadOp, WriteOp
from hicache.messages import LoadDone, PrefetchProgress, TimerFired, UploadDone, WriteDone
from hicache.types import OpId

Kind = Literal["backup", "load", "upload", "prefetch"]
KINDS: Final[tuple[Kind, ...]] = ("backup", "load", "upload", "prefetch")  # the apply order
Row = WriteOp | LoadOp | UploadOp | PrefetchOp


@dataclass(frozen=True, slots=True)
class Wait:
    """An allocation that can go on only once this op has ended (its backup frees device
    slots, its upload unprotects host pages, its load unlocks the pages it filled): the
    caller parks, and is retried then."""

    table: OpTable
    kind: Kind
    op: OpId

    def ended(self) -> bool:
        """The op no longer holds up a waiter: it ended, or it is an upload past its deadline
        (no longer waited for)."""
        row = self.table.of(self.kind).get(self.op)
        return row is None or (self.kind == "upload" and row.timed_out)

    def arrived(self) -> bool:
        """Its completion has arrived here (not applied yet: the ranks agree first), or it
        is an upload past its deadline."""
        if self.table.arrived(self.op):
            return True
        row = self.table.of(self.kind).get(self.op)
        return self.kind == "upload" and row is not None and row.timed_out


@dataclass(frozen=True, slots=True)
class End:
    """An op's next step, as agreed: a backup or load ends (`ok`, `error`), an upload ends
    (`stored` pages, why short), a prefetch takes its next step (`hit` pages in storage, -1
    before the probe; `done` pages read; `finished`; `stopped`; `timed_out` somewhere)."""

    kind: Kind
    op: OpId
    ok: bool = True
    error: str = ""
    stored: int = 0
    hit: int = -1
    done: int = 0
    finished: bool = False
    stopped: bool = False
    timed_out: bool = False


class OpTable:
    def __init__(self, credits: int) -> None:
        self._rows: dict[Kind, dict[OpId, Any]] = {kind: {} for kind in KINDS}  # issue order
        self._views = {kind: MappingProxyType(rows) for kind, rows in self._rows.items()}
        self._credits: dict[Kind, int] = dict.fromkeys(KINDS, credits)
        # recorded, not applied yet: a backup's or load's (ok, error), an upload's (stored, why)
        self._arrived: dict[OpId, tuple[Any, str]] = {}
        self._reports: dict[OpId, PrefetchProgress] = {}  # a prefetch's latest
        self._fired: set[OpId] = set()  # prefetches whose timer fired

    # ------------------------------------------------------------------ rows
    def start(self, kind: Kind, op: OpId, row: Row) -> None:
        self._credits[kind] -= 1
        self._rows[kind][op] = row

    def finish(self, kind: Kind, op: OpId) -> Any:
        """Remove the op (its row is returned), give its credit back, forget what was
        recorded for it."""
        row = self._rows[kind].pop(op)
        self._credits[kind] += 1
        self._arrived.pop(op, None)
        self._reports.pop(op, None)
        self._fired.discard(op)
        return row

    def of(self, kind: Kind) -> Mapping[OpId, Any]:
        """The ops of a kind in flight, in issue order (read only)."""
        return self._views[kind]

    def credit(self, kind: Kind) -> int:
        return self._credits[kind]

    def wait(self, kind: Kind, op: OpId | None) -> Wait | None:
        """A wait for `op` of `kind` (None for None)."""
        return None if op is None else Wait(self, kind, op)

    def oldest(self, kind: Kind) -> Wait | None:
        """A wait for the op of `kind` started first."""
        return self.wait(kind, next(iter(self._rows[kind]), None))

    def arrived_count(self, kind: Kind) -> int:
        if kind == "prefetch":
            return len(self._reports)
        rows = self._rows[kind]
        return sum(1 for op in self._arrived if op in rows)

    def fired_count(self) -> int:
        return len(self._fired)

    # ------------------------------------------------------------------ completions
    def record(
        self, msg: WriteDone | LoadDone | UploadDone | PrefetchProgress | TimerFired
    ) -> None:
        """Note a completion (the first one per op; a prefetch's later reports supersede
        earlier ones). One for an op that already ended (work abandoned at close, a timer
        that fired as its prefetch ended) is stale and dropped."""
        rows, arrived = self._rows, self._arrived
        match msg:
            case WriteDone(ops=ops, ok=ok, error=error):
                for op in ops:
                    if op in rows["backup"]:
                        arrived.setdefault(op, (ok, error))
            case LoadDone(op=op, ok=ok, error=error):
                if op in rows["load"]:
                    arrived.setdefault(op, (ok, error))
            case UploadDone(op=op, stored_pages=stored, dropped=dropped):
                if op in rows["upload"]:
                    arrived.setdefault(op, (stored, dropped))
            case PrefetchProgress(op=op):
                if op in rows["prefetch"]:
                    self._reports[op] = msg
            case TimerFired(op=op):
                if op in rows["prefetch"]:
                    self._fired.add(op)

    def arrived(self, op: OpId) -> bool:
        """A completion for the op has arrived here (not applied yet)."""
        return op in self._arrived

    def progress(self) -> Progress:
        """This rank's view of every op in flight, as the vectors the ranks agree on: MIN of
        (arrived, succeeded so far) per backup and load, of (arrived) per upload, per prefetch
        MIN of (hit pages, -1 before the probe; pages read; finished; stopped) and MAX of (its
        timer fired)."""
        arrived = self._arrived

        def done(kind: Kind) -> Section:
            rows = []
            for op in self._rows[kind]:
                got = arrived.get(op)
                rows.append((op, (int(got is not None), int(got is None or got[0])), ()))
            return Section.of(rows, 2)

        prefetches = []
        for op in self._rows["prefetch"]:
            report = self._reports.get(op)
            if report is None:
                mins: tuple[int, ...] = (-1, 0, 0, 0)
            else:
                mins = (
                    report.hit_pages,
                    report.done_pages,
                    int(report.finished),
                    int(report.stopped),
                )
            prefetches.append((op, mins, (int(op in self._fired),)))
        return Progress.of(
            backups=done("backup"),
            loads=done("load"),
            uploads=Section.of([(op, (int(op in arrived),), ()) for op in self._rows["upload"]], 1),
            prefetches=Section.of(prefetches, 4, 1),
        )

    def ends(self, agreed: Progress | None) -> Iterator[End]:
        """The ops to end now (a prefetch: to step), in apply order: backups, then loads, in
        issue order up to the first one not there yet (they complete in order); then every
        upload there (each on its own: a hung one holds up no other); then each prefetch. With
        `agreed` (TP ranks), as far as every rank has got; without (one rank), as far as this
        one has. Lazy: each end is taken as the caller finishes the one before."""
        for kind in ("backup", "load"):
            yield from self._in_order(kind, agreed)
        yield from self._uploads(agreed)
        yield from self._prefetches(agreed)

    def _in_order(self, kind: Literal["backup", "load"], agreed: Progress | None) -> Iterator[End]:
        arrived = self._arrived
        if agreed is not None:
            section = agreed.backups if kind == "backup" else agreed.loads
            for op, (there, ok), _ in section.rows():
                if not there:
                    return
                yield End(kind, op, ok=bool(ok), error=arrived[op][1])
            return
        rows = self._rows[kind]
        while rows:
            op = next(iter(rows))
            got = arrived.get(op)
            if got is None:
                return
            yield End(kind, op, ok=got[0], error=got[1])

    def _uploads(self, agreed: Progress | None) -> Iterator[End]:
        arrived = self._arrived
        if agreed is not None:
            ops = [op for op, (there,), _ in agreed.uploads.rows() if there]
        else:  # op ids grow with issue order
            ops = sorted(op for op in arrived if op in self._rows["upload"])
        for op in ops:
            stored, dropped = arrived[op]
            yield End("upload", op, stored=stored, error=dropped)

    def _prefetches(self, agreed: Progress | None) -> Iterator[End]:
        if agreed is not None:
            for op, (hit, done, finished, stopped), (timer,) in agreed.prefetches.rows():
                yield End(
                    "prefetch",
                    op,
                    hit=hit,
                    done=done,
                    finished=bool(finished),
                    stopped=bool(stopped),
                    timed_out=bool(timer),
                )
            return
        # One rank: a prefetch with no report and no timer fired has no step to take.
        reports, fired = self._reports, self._fired
        for op in sorted(reports.keys() | fired):
            report = reports.get(op)
            yield End(
                "prefetch",
                op,
                hit=-1 if report is None else report.hit_pages,
                done=0 if report is None else report.done_pages,
                finished=report is not None and report.finished,
                stopped=report is not None and report.stopped,
                timed_out=op in fired,
            )
