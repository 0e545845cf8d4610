"""The prefetcher actor (L3 -> L2): owns every prefetch in flight, each moving through the
phases of `components/prefetch_state.py` (PROBING, WAITING_HOST, READING, STOPPING, DONE).

For a `StartPrefetch` it probes storage for the consecutive run of present pages and reports
the count; the tree then allocates host slots for exactly those pages (no L2 churn for pages
storage does not have) and sends `ReadPrefetch`, and the pages are read in batches of
`batch_pages`, with a report at the end. A `StopPrefetch` is answered at once with what has
arrived (a report with `finished=False`: the request must not wait for slow storage), and
ends the op after the I/O in flight, whose end report returns the rest of the slots. So an
op sends at most three reports: probe, stop, end. The I/O runs in a helper task per op so
stops and new ops are never stuck behind a slow read; what arrived is a consecutive prefix,
checked page by page by the backend.

Every storage call has a deadline (`storage_timeout`, components/deadline.py; why it ends the
wait but not the hold on the host slots: docs/decisions.md). Past it the op is stopped as if
the tree had asked; the end report, which returns the op's host slots, comes when the call has
really returned.

The backend is the one the tree last handed over (`UseBackend`, on attach and detach of L3 at
run time); the tree switches only while no prefetch is in flight. A `StartPrefetch` with none
attached (which the tree never sends) finds nothing: a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import numpy as np
from typing_extensions import assert_never

from hicache.backends.base import StorageBackend
from hicache.backends.keys import Namespace
from hicache.components.deadline import CallDeadline
from hicache.components.prefetch_state import Phase, advance
from hicache.kernels.pools import HostPool
from hicache.messages import (
    IoDeadline,
    IoDone,
    PrefetcherInbox,
    PrefetchProgress,
    ReadPrefetch,
    StartPrefetch,
    StopPrefetch,
    TreeInbox,
    UseBackend,
)
from hicache.runtime import Actor, Mailbox
from hicache.types import EMPTY_SLOTS, OpId


@dataclass(slots=True)
class _Op:
    """One prefetch in flight here. Its phase (`prefetch_state.py`) says what runs: a probe
    (PROBING), nothing until `ReadPrefetch` (WAITING_HOST), a batch of reads (READING), the
    last call before the end (STOPPING); at DONE it is let go."""

    msg: StartPrefetch
    phase: Phase = Phase.PROBING
    hit_pages: int | None = None  # what the probe found; None until it returns
    done_pages: int = 0
    host_slots: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)  # from ReadPrefetch
    deadline: CallDeadline = field(default_factory=CallDeadline)  # of the step in flight

    def to(self, op: OpId, phase: Phase) -> None:
        self.phase = advance(op, self.phase, phase)


class PrefetcherActor(Actor[PrefetcherInbox]):
    def __init__(
        self,
        *,
        backend: StorageBackend | None,
        namespace: Namespace,
        host_pool: HostPool,
        tree: Mailbox[TreeInbox],
        batch_pages: int,
        timeout: float,
        capacity: int,
        reserve: int,
    ) -> None:
        super().__init__("prefetcher", capacity=capacity, reserve=reserve)
        self._backend = backend
        self._ns = namespace
        self._host = host_pool
        self._tree = tree
        self._batch = batch_pages
        self._timeout = timeout
        self._ops: dict[OpId, _Op] = {}  # owned here alone

    async def handle(self, msg: PrefetcherInbox) -> None:
        match msg:
            case UseBackend(backend=backend):
                assert not self._ops, "storage switched with prefetches in flight"
                self._backend = backend
            case StartPrefetch(op=op):
                self._ops[op] = _Op(msg)
                self._spawn(op)
            case ReadPrefetch(op=op, host_slots=host_slots):
                state = self._ops.get(op)
                if state is not None and state.phase is not Phase.STOPPING:
                    state.to(op, Phase.READING)
                    state.host_slots = host_slots
                    # the pages every rank has (TP ranks agree on the smallest probe)
                    assert state.hit_pages is not None  # the tree reads only what was probed
                    state.hit_pages = min(state.hit_pages, len(host_slots) // self._host.page_size)
                    self._spawn(op)
            case StopPrefetch(op=op):
                state = self._ops.get(op)
                if state is not None and state.phase is not Phase.STOPPING:
                    self._stop(op, state)
            case IoDeadline(op=op, call=call):
                state = self._ops.get(op)
                if state is None or not state.deadline.expire(call):
                    return  # that step already returned
                self.log.warning(
                    "prefetcher.timeout",
                    op=op,
                    timeout=self._timeout,
                    step="probe" if state.hit_pages is None else "read",
                )
                if state.phase is not Phase.STOPPING:
                    self._stop(op, state)
            case IoDone(op=op, pages=pages, error=error):
                await self._io_done(op, pages, error)
            case _:
                assert_never(msg)

    def _stop(self, op: OpId, state: _Op) -> None:
        """Report what has arrived at once; the op ends when no call of it is in flight."""
        # Probed and waiting for a read that will not come: nothing in flight, it ends now.
        idle = state.phase is Phase.WAITING_HOST
        state.to(op, Phase.DONE if idle else Phase.STOPPING)
        self._tree.send_nowait(
            PrefetchProgress(  # reserved room: one per op
                op=op,
                hit_pages=-1 if state.hit_pages is None else state.hit_pages,  # -1: not probed
                done_pages=state.done_pages,
                finished=idle,
                stopped=True,
            )
        )
        if idle:
            del self._ops[op]

    def _spawn(self, op: OpId) -> None:
        state = self._ops[op]
        scope = state.deadline.arm(self.system, self.inbox, op, self._timeout)
        self.system.start_soon(self._io, op, scope, name=f"prefetch-{op}")

    async def _io_done(self, op: OpId, pages: int, error: str) -> None:
        state = self._ops[op]
        state.deadline.disarm()
        stopping = state.phase is Phase.STOPPING
        probed = state.hit_pages is None  # the call that returned was the probe
        if state.hit_pages is None:
            state.hit_pages = pages
            finished = pages == 0 or stopping
        else:
            batch_end = min(state.hit_pages, state.done_pages + self._batch)
            short = state.done_pages + pages < batch_end  # a page missing or corrupt: stop there
            state.done_pages += pages
            finished = stopping or short or state.done_pages >= state.hit_pages
        if error:
            self.log.warning("prefetcher.io_error", op=op, error=error)
            finished = True
        if finished:
            state.to(op, Phase.DONE)
        elif probed:
            state.to(op, Phase.WAITING_HOST)
        # With the stop report, at most three reports per op: the tree reserves room for
        # all of them, so these sends never block.
        if probed or finished:
            self._tree.send_nowait(
                PrefetchProgress(
                    op=op,
                    hit_pages=state.hit_pages,
                    done_pages=state.done_pages,
                    finished=finished,
                    stopped=stopping,
                )
            )
        if finished:
            del self._ops[op]
            self.log.info(
                "prefetcher.done",
                op=op,
                pages=len(state.msg.hashes),
                hit=state.hit_pages,
                read=state.done_pages,
            )
        elif not probed:
            self._spawn(op)  # the next batch (after the probe, the tree's ReadPrefetch starts it)

    async def _io(self, op: OpId, scope: anyio.CancelScope) -> None:
        """One step of an op: the probe first, then one batch of reads."""
        state = self._ops[op]
        msg = state.msg
        pages, error = 0, ""
        backend = self._backend
        if backend is None:  # not sent by the tree: storage is off, a miss
            self.inbox.send_nowait(IoDone(op=op, pages=0, error="no storage attached"))
            return
        with scope:
            try:
                if state.hit_pages is None:
                    keys = self._ns.keys(msg.hashes)
                    pages = await self._probe(backend, keys)
                else:
                    start = state.done_pages
                    end = min(state.hit_pages, start + self._batch)
                    page = self._host.page_size
                    keys = self._ns.keys(msg.hashes[start:end])
                    slots = state.host_slots[start * page : end * page]
                    targets = self._host.page_buffers(slots)
                    pages = await backend.get_into(keys, targets)
            except Exception as exc:  # noqa: BLE001 - a backend bug is a miss, never a crashed cache
                pages, error = 0, f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            pages, error = 0, f"timed out after {self._timeout} s"
        self.inbox.send_nowait(IoDone(op=op, pages=pages, error=error))  # reserved room

    async def _probe(self, backend: StorageBackend, keys: list[str]) -> int:
        """Consecutive present pages, asked in batches; stops at the first hole."""
        hit = 0
        for start in range(0, len(keys), self._batch):
            chunk = keys[start : start + self._batch]
            found = await backend.exists(chunk)
            hit += found
            if found < len(chunk):
                break
        return hit
