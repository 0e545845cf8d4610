"""Sync points: completions are recorded in the op table as they arrive (`ops.py`), and applied
at sync points as far as every TP rank has got (one rank: as far as it has got itself).

This module hands each op's end to the flow that gives it its meaning, in the op table's apply
order: backups, loads (each stops at the first op not there yet: they complete in order), then
uploads (each on its own: a hung one holds up no other) and each prefetch's next step.
"""

from __future__ import annotations

from hicache.components.controller.loads import LoadFlows
from hicache.components.controller.ops import OpTable
from hicache.components.controller.prefetches import PrefetchFlows
from hicache.components.controller.progress import Progress
from hicache.components.controller.requests import Requests
from hicache.components.controller.shared import Step
from hicache.components.controller.writes import WriteFlows
from hicache.messages import (
    LoadDone,
    PrefetchProgress,
    TimerFired,
    UploadDone,
    UploadTimedOut,
    WriteDone,
)

Completion = WriteDone | LoadDone | UploadDone | UploadTimedOut | PrefetchProgress | TimerFired
COMPLETIONS = (WriteDone, LoadDone, UploadDone, UploadTimedOut, PrefetchProgress, TimerFired)


def record(msg: Completion, ops: OpTable, writes: WriteFlows) -> None:
    """Note a completion. An upload past its deadline is no longer waited for at once (no
    rank waits on storage), everything else when applied."""
    if isinstance(msg, UploadTimedOut):
        writes.upload_timed_out(msg.op)
    else:
        ops.record(msg)


def apply(
    step: Step,
    agreed: Progress | None,
    ops: OpTable,
    writes: WriteFlows,
    loads: LoadFlows,
    prefetches: PrefetchFlows,
    requests: Requests,
) -> None:
    """End what every rank has got (`agreed`; None: one rank, what has arrived here)."""
    uploaded = False
    for end in ops.ends(agreed):
        match end.kind:
            case "backup":
                writes.finish_backup(step, end.op, end.ok, end.error)
            case "load":
                loads.finish(step, end.op, end.ok, end.error)
                if not end.ok:  # the requests that counted on it may not cache what they hold
                    requests.load_failed(end.op)
            case "upload":
                writes.finish_upload(step, end.op, stored=end.stored, dropped=end.error)
                uploaded = True
            case "prefetch":
                prefetches.agreed(
                    step,
                    end.op,
                    hit=end.hit,
                    done=end.done,
                    finished=end.finished,
                    stopped=end.stopped,
                    timed_out=end.timed_out,
                )
    if uploaded:  # an upload's end may have made host room
        prefetches.host_freed(step)
