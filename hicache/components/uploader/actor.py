"""The uploader actor (L2 -> L3): owns every upload in flight and its retries.

Each completed L1 -> L2 write with storage on becomes an `Upload` (the tree keeps the host pages
protected until `UploadDone`). The storage call runs in a helper task so the inbox keeps
moving; a failed upload is retried with exponential backoff on the actor system's clock, and after
the last try it is an event and a later miss, never an error for any request.

Every storage call has a deadline (`storage_timeout`, components/deadline.py; why it ends the
wait but not the hold on the host pages, and why a timed-out upload is not retried:
docs/decisions.md). Past it the tree is told at once (`UploadTimedOut`); the op's one
`UploadDone` comes when the call has really returned.

The backend is the one the tree last handed over (`UseBackend`, on attach and detach of L3 at
run time; at open, the one it was built with). The tree switches only while no upload is in
flight, so every call of an upload goes to one backend; an `Upload` with none attached (which
the tree never sends) fails at once, storing nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import anyio
from typing_extensions import assert_never

from hicache.backends.base import StorageBackend, accepts_writes, set_from_ttl
from hicache.backends.keys import Namespace
from hicache.components.deadline import CallDeadline
from hicache.kernels.pools import HostPool
from hicache.messages import (
    IoDeadline,
    IoDone,
    TreeInbox,
    Upload,
    UploadDone,
    UploaderInbox,
    UploadTimedOut,
    UseBackend,
)
from hicache.runtime import Actor, Mailbox
from hicache.types import OpId


@dataclass(slots=True)
class _Job:
    msg: Upload
    attempt: int = 0
    deadline: CallDeadline = field(default_factory=CallDeadline)  # of the call in flight
    timed_out: bool = False
    started: float = (
        0.0  # when the Upload arrived (the actor system's clock), for the events' `seconds`
    )


class UploaderActor(Actor[UploaderInbox]):
    def __init__(
        self,
        *,
        backend: StorageBackend | None,
        namespace: Namespace,
        host_pool: HostPool,
        tree: Mailbox[TreeInbox],
        retries: int,
        backoff: float,
        timeout: float,
        capacity: int,
        reserve: int,
    ) -> None:
        super().__init__("uploader", capacity=capacity, reserve=reserve)
        self._backend = backend
        self._ns = namespace
        self._host = host_pool
        self._tree = tree
        self._retries = retries
        self._backoff = backoff
        self._timeout = timeout
        self._jobs: dict[OpId, _Job] = {}  # owned here alone

    async def handle(self, msg: UploaderInbox) -> None:
        match msg:
            case UseBackend(backend=backend):
                assert not self._jobs, "storage switched with uploads in flight"
                self._backend = backend
            case Upload(op=op):
                self._jobs[op] = _Job(msg, started=self.system.now())
                self._start(op)
            case IoDeadline(op=op, call=call):
                job = self._jobs.get(op)
                if job is None or not job.deadline.expire(call):
                    return  # that call already returned
                job.timed_out = True
                self.log.warning(
                    "uploader.timeout", op=op, pages=len(job.msg.hashes), timeout=self._timeout
                )
                self._tree.send_nowait(UploadTimedOut(op=op))  # reserved room: one per op
            case IoDone(op=op, pages=pages, error=error, refused=refused):
                job = self._jobs[op]
                job.deadline.disarm()
                wanted = len(job.msg.hashes)
                if refused and pages < wanted:
                    # The store is full and backing off: the pages go unstored now, and
                    # their host pages back to L2 at once (no retry holds them).
                    del self._jobs[op]
                    self.log.info("uploader.refused", op=op, pages=wanted - pages, stored=pages)
                    self._tree.send_nowait(
                        UploadDone(op=op, stored_pages=pages, dropped="store_full")
                    )
                    return
                if pages < wanted and job.attempt < self._retries and not job.timed_out:
                    job.attempt += 1
                    delay = self._backoff * 2 ** (job.attempt - 1)
                    self.log.warning(
                        "uploader.retry",
                        op=op,
                        attempt=job.attempt,
                        stored=pages,
                        pages=wanted,
                        delay=delay,
                        error=error or None,
                    )
                    self.system.call_later(delay, functools.partial(self._start, op))
                    return
                del self._jobs[op]
                nbytes = pages * self._host.page_nbytes if self._ns.writes else 0
                seconds = round(self.system.now() - job.started, 6)
                if pages < wanted:
                    self.log.error(
                        "uploader.failed",
                        op=op,
                        stored=pages,
                        pages=wanted,
                        error=error or None,
                        seconds=seconds,
                    )
                elif self._ns.writes:
                    # last_hash: the chain's last page, naming the pages stored (KV events)
                    self.log.info(
                        "uploader.stored",
                        op=op,
                        pages=pages,
                        bytes=nbytes,
                        seconds=seconds,
                        last_hash=job.msg.hashes[-1] if job.msg.hashes else None,
                    )
                dropped = "" if pages >= wanted else "timed_out" if job.timed_out else "failed"
                self._tree.send_nowait(UploadDone(op=op, stored_pages=pages, dropped=dropped))
            case _:
                assert_never(msg)

    def _start(self, op: OpId) -> None:
        scope = self._jobs[op].deadline.arm(self.system, self.inbox, op, self._timeout)
        self.system.start_soon(self._upload, op, scope, name=f"upload-{op}")

    async def _upload(self, op: OpId, scope: anyio.CancelScope) -> None:
        job = self._jobs[op].msg
        if not self._ns.writes:
            # MLA on a rank other than 0: rank 0 stores the shared keys. The op still runs
            # through the tree like everywhere else, so every rank's tree changes alike.
            self.inbox.send_nowait(IoDone(op=op, pages=len(job.hashes)))
            return
        backend = self._backend
        if backend is None:  # not sent by the tree: storage is off
            self.inbox.send_nowait(IoDone(op=op, pages=0, error="no storage attached"))
            return
        if not accepts_writes(backend):  # full a moment ago: no I/O, no retry
            self.inbox.send_nowait(IoDone(op=op, pages=0, error="store full", refused=True))
            return
        keys = self._ns.keys(job.hashes)
        pages = self._host.page_buffers(job.host_slots)
        stored, error = 0, ""
        with scope:
            try:
                stored = await set_from_ttl(backend, keys, pages, ttl=job.ttl)
            except Exception as exc:  # noqa: BLE001 - a backend bug is a failed upload, not a crash
                stored, error = 0, f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            stored, error = 0, f"timed out after {self._timeout} s"
        # A short write to a store that has just said "full" is not worth a retry.
        refused = stored < len(keys) and not error and not accepts_writes(backend)
        self.inbox.send_nowait(IoDone(op=op, pages=stored, error=error, refused=refused))
