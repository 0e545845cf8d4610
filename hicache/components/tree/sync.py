"""Sync points: completions are recorded as they arrive, then applied as far as every TP rank
has got (one rank agrees with itself).

`record` notes what arrived; `progress` is this rank's view of every op in flight as the
vectors the ranks agree on (MIN: arrived, ok so far, a prefetch's hit, read, finished and
stopped; MAX: a prefetch timer fired); `apply` applies what was agreed, in issue order:
writes, loads (each stops at the first not there yet: they complete in order), then uploads
(each on its own: a hung one holds up no other) and each prefetch's next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.components.tree.loads import LoadFlows
from hicache.components.tree.prefetches import PrefetchFlows
from hicache.components.tree.requests import Requests
from hicache.components.tree.writes import WriteFlows
from hicache.messages import (
    LoadDone,
    PrefetchProgress,
    TimerFired,
    UploadDone,
    UploadTimedOut,
    WriteDone,
)
from hicache.types import OpId

Completion = WriteDone | LoadDone | UploadDone | UploadTimedOut | PrefetchProgress | TimerFired
COMPLETIONS = (WriteDone, LoadDone, UploadDone, UploadTimedOut, PrefetchProgress, TimerFired)


@dataclass(frozen=True, slots=True)
class Progress:
    """What this rank has seen of every op in flight, as the vectors the ranks agree on."""

    writes: list[OpId]
    loads: list[OpId]
    uploads: list[OpId]
    prefetches: list[OpId]
    mins: list[int]
    maxes: list[int]


def record(
    msg: Completion, writes: WriteFlows, loads: LoadFlows, prefetches: PrefetchFlows
) -> None:
    """Note a completion. One for an op that already ended (a timer that fired as its
    prefetch ended, work abandoned at close) is stale and dropped."""
    match msg:
        case WriteDone(ops=ops, ok=ok, error=error):
            for op in ops:
                if op in writes.writes:
                    writes.arrived_writes.setdefault(op, (ok, error))
        case LoadDone(op=op, ok=ok, error=error):
            if op in loads.loads:
                loads.arrived.setdefault(op, (ok, error))
        case UploadDone(op=op, stored_pages=stored):
            if op in writes.uploads:
                writes.arrived_uploads.setdefault(op, stored)
        case UploadTimedOut(op=op):
            writes.upload_timed_out(op)
        case PrefetchProgress(op=op):
            if op in prefetches.ops:
                prefetches.reports[op] = msg  # later reports supersede earlier ones
        case TimerFired(op=op):
            if op in prefetches.ops:
                prefetches.timers_fired.add(op)


def progress(writes: WriteFlows, loads: LoadFlows, prefetches: PrefetchFlows) -> Progress:
    write_ops, load_ops = list(writes.writes), list(loads.loads)
    upload_ops, prefetch_ops = list(writes.uploads), list(prefetches.ops)
    mins: list[int] = []
    for table, arrived in ((write_ops, writes.arrived_writes), (load_ops, loads.arrived)):
        for op in table:
            got = arrived.get(op)
            mins += [got is not None, got is None or got[0]]
    mins += [op in writes.arrived_uploads for op in upload_ops]
    maxes: list[int] = []
    for op in prefetch_ops:
        report = prefetches.reports.get(op)
        if report is None:
            mins += [-1, 0, 0, 0]
        else:
            mins += [report.hit_pages, report.done_pages, report.finished, report.stopped]
        maxes.append(op in prefetches.timers_fired)
    return Progress(
        write_ops,
        load_ops,
        upload_ops,
        prefetch_ops,
        [int(v) for v in mins],
        [int(v) for v in maxes],
    )


def apply(
    seen: Progress,
    agreed: list[int],
    agreed_max: list[int],
    writes: WriteFlows,
    loads: LoadFlows,
    prefetches: PrefetchFlows,
    requests: Requests,
) -> None:
    at = 0
    for i, op in enumerate(seen.writes):
        if not agreed[2 * i]:
            break  # some rank is not there yet: later ones wait too (issue order)
        writes.finish_write(op, bool(agreed[2 * i + 1]), writes.arrived_writes.pop(op)[1])
    at = 2 * len(seen.writes)
    for i, op in enumerate(seen.loads):
        if not agreed[at + 2 * i]:
            break
        ok = bool(agreed[at + 2 * i + 1])
        loads.finish(op, ok, loads.arrived.pop(op)[1])
        if not ok:
            requests.load_failed(op)
    at += 2 * len(seen.loads)
    uploaded = False
    for op, got in zip(seen.uploads, agreed[at : at + len(seen.uploads)], strict=True):
        if got:
            writes.arrived_uploads.pop(op, None)
            writes.finish_upload(op)
            uploaded = True
    at += len(seen.uploads)
    for i, op in enumerate(seen.prefetches):
        hit, done, finished, stopped = agreed[at + 4 * i : at + 4 * i + 4]
        prefetches.agreed(
            op,
            hit=hit,
            done=done,
            finished=bool(finished),
            stopped=bool(stopped),
            timed_out=bool(agreed_max[i]),
        )
    if uploaded and prefetches.host_waiting:
        prefetches.retry_reads()  # an upload's end may have made host room
