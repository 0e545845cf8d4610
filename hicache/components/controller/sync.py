"""Sync points: each flow records the completions that arrive for it, reports how far its ops
have got as one section of the vectors the TP ranks agree on, and applies what was agreed.

This module only lays the sections out and loops over the flows, in issue order: writes,
loads (each stops at the first op not there yet: they complete in order), then uploads (each
on its own: a hung one holds up no other) and each prefetch's next step.
"""

from __future__ import annotations

from hicache.components.controller.loads import LoadFlows
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


def record(
    msg: Completion, writes: WriteFlows, loads: LoadFlows, prefetches: PrefetchFlows
) -> None:
    """Hand a completion to the flow it belongs to."""
    match msg:
        case WriteDone() | UploadDone() | UploadTimedOut():
            writes.record(msg)
        case LoadDone():
            loads.record(msg)
        case PrefetchProgress() | TimerFired():
            prefetches.record(msg)


def progress(writes: WriteFlows, loads: LoadFlows, prefetches: PrefetchFlows) -> Progress:
    return Progress.of(
        backups=writes.backup_progress(),
        loads=loads.progress(),
        uploads=writes.upload_progress(),
        prefetches=prefetches.progress(),
    )


def apply(
    step: Step,
    agreed: Progress,
    writes: WriteFlows,
    loads: LoadFlows,
    prefetches: PrefetchFlows,
    requests: Requests,
) -> None:
    """Apply what every rank has got, flow by flow in issue order."""
    writes.apply_backups(step, agreed.backups)
    for op in loads.apply(step, agreed.loads):
        requests.load_failed(op)
    uploaded = writes.apply_uploads(step, agreed.uploads)
    prefetches.apply(step, agreed.prefetches, host_freed=uploaded)


def apply_arrived(
    step: Step,
    writes: WriteFlows,
    loads: LoadFlows,
    prefetches: PrefetchFlows,
    requests: Requests,
) -> None:
    """One rank: apply what has arrived, in the order `apply` would, with no vectors (there
    is no one to agree with)."""
    writes.apply_arrived_backups(step)
    for op in loads.apply_arrived(step):
        requests.load_failed(op)
    uploaded = writes.apply_arrived_uploads(step)
    prefetches.apply_arrived(step, host_freed=uploaded)
