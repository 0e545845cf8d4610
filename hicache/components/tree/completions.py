"""How the tree actor takes completions: recorded as they arrive, applied at sync points.

A part of `TreeActor` (a mixin over its state). Workers report completions at their own pace;
on several TP ranks those paces differ, yet every rank's tree must change the same way. So a
completion only records what arrived; `_sync_point` then agrees with the other ranks
(`agreement.py`) how far every rank has got and applies exactly that, in issue order:
writes, loads, uploads, then prefetch steps. A single rank agrees with itself, so there a sync
point follows every completion and nothing waits.
"""

from __future__ import annotations

from hicache.messages import (
    LoadDone, PrefetchProgress, TimerFired, UploadDone, UploadTimedOut, WriteDone,
)


class CompletionFlows:
    def _record(self, msg) -> None:
        """Note a completion; applied at the next sync point. One for an op that already
        ended (a write or upload an eviction waited for through its reply, a timer that fired
        as its prefetch ended, work abandoned at close) is stale and dropped."""
        match msg:
            case WriteDone(op=op, ok=ok, error=error):
                if op in self._writes:
                    self._arrived_writes.setdefault(op, (ok, error))
            case LoadDone(op=op, ok=ok, error=error):
                if op in self._loads:
                    self._arrived_loads.setdefault(op, (ok, error))
            case UploadDone(op=op, stored_pages=stored):
                if op in self._uploads:
                    self._arrived_uploads.setdefault(op, stored)
            case UploadTimedOut(op=op):
                job = self._uploads.get(op)
                if job is not None and not job.timed_out:
                    job.timed_out = True
                    self.counters.upload_timeouts += 1
            case PrefetchProgress(op=op):
                if op in self._prefetches:
                    self._prefetch_reports[op] = msg  # later reports supersede earlier ones
            case TimerFired(op=op):
                if op in self._prefetches:
                    self._timers_fired.add(op)

    async def _sync_point(self) -> None:
        """Agree with the other ranks how far every op has got, and apply that."""
        writes, loads, uploads = list(self._writes), list(self._loads), list(self._uploads)
        prefetches = list(self._prefetches)
        mins: list[int] = []
        for table, arrived in ((writes, self._arrived_writes), (loads, self._arrived_loads)):
            for op in table:
                got = arrived.get(op)
                mins += [got is not None, got is None or got[0]]  # arrived; ok so far
        mins += [op in self._arrived_uploads for op in uploads]
        maxes: list[int] = []
        for op in prefetches:
            report = self._prefetch_reports.get(op)
            if report is None:
                mins += [-1, 0, 0, 0]
            else:
                mins += [report.hit_pages, report.done_pages, report.finished, report.stopped]
            maxes.append(op in self._timers_fired)
        if not mins and not maxes and self._agreement.trivial:
            return
        agreed, agreed_max = await self._agreement.agree([int(v) for v in mins],
                                                         [int(v) for v in maxes])
        at = 0
        for table, pending, arrived, finish in (
            (writes, self._writes, self._arrived_writes, self._finish_write),
            (loads, self._loads, self._arrived_loads, self._finish_load),
        ):
            flags, at = agreed[at:at + 2 * len(table)], at + 2 * len(table)
            for i, op in enumerate(table):
                if not flags[2 * i]:
                    break  # some rank is not there yet: later ones wait too (issue order)
                if op in pending:  # not already applied by a nested sync point
                    error = arrived.pop(op)[1]
                    await finish(op, bool(flags[2 * i + 1]), error)
        flags, at = agreed[at:at + len(uploads)], at + len(uploads)
        for op, got in zip(uploads, flags):
            if not got:
                continue  # uploads end independently: a hung one holds up no other
            self._arrived_uploads.pop(op, None)
            if op in self._uploads:
                await self._finish_upload(op)
        for i, op in enumerate(prefetches):
            hit, done, finished, stopped = agreed[at + 4 * i:at + 4 * i + 4]
            if op in self._prefetches:
                await self._prefetch_agreed(op, hit=hit, done=done, finished=bool(finished),
                                            stopped=bool(stopped), timed_out=bool(agreed_max[i]))
