"""The tree actor: the task that drives the controller (`controller.py`).

It feeds the controller each message with the time (and the host slots the allocator leases
to its L2 ledger), runs the sync points with the other TP ranks (`agreement.py`), and carries
out the effects the controller returns: commands to the workers, answers, events, timers,
binding each load's handle into its ticket, the backend's clear and the switch of L3 backends
(attach / detach at run time). Every decision is the controller's; what is here is I/O.

The storage attached now (`storage`) is this driver's: it hands the backend to the uploader and
prefetcher (`UseBackend`) when the controller switches, clears it for `clear_storage`, and
closes it at close if the cache opened it (`close_storage`, run after the actor system stopped). A
detached backend is handed to the facade in the detach's answer, which closes it if owned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hicache.components.controller.agreement import RankAgreement, SingleRank
from hicache.components.controller.controller import Controller
from hicache.components.controller.effects import (
    Answer,
    CancelTimer,
    ClearBackend,
    Drained,
    Effect,
    Event,
    Fail,
    Send,
    StartTimer,
    SubmitLoad,
    SwitchStorage,
)
from hicache.components.controller.shared import Counters
from hicache.components.controller.sync import COMPLETIONS
from hicache.components.topology import Topology
from hicache.config import CacheConfig
from hicache.kernels.streams.base import LoadHandle
from hicache.messages import (
    Backup,
    Backups,
    HostSlotsReady,
    Load,
    LoaderInbox,
    PrefetcherInbox,
    ReadPrefetch,
    StartPrefetch,
    StopPrefetch,
    StorageAttachment,
    TimerFired,
    TreeInbox,
    Upload,
    UploaderInbox,
    UseBackend,
    WriterInbox,
)
from hicache.observability.events import slot_runs
from hicache.radix.tree import RadixTree
from hicache.results import StorageTimeout
from hicache.runtime import Actor, Mailbox, Reply
from hicache.runtime.clock import TimerHandle
from hicache.types import OpId


@dataclass(frozen=True, slots=True)
class _Workers:
    """The inboxes of the actors the tree commands."""

    writer: Mailbox[WriterInbox]
    loader: Mailbox[LoaderInbox]
    uploader: Mailbox[UploaderInbox]
    prefetcher: Mailbox[PrefetcherInbox]


class TreeActor(Actor[TreeInbox]):
    def __init__(
        self,
        *,
        config: CacheConfig,
        tree: RadixTree,
        bytes_per_token: int,
        topology: Topology,
        agreement: RankAgreement | None = None,
        storage_on: bool = False,
    ) -> None:
        bounds = topology.edges()["tree"]
        super().__init__("tree", capacity=bounds.capacity, reserve=bounds.reserve)
        self._cfg = config
        self._tree = tree
        self._agreement = agreement or SingleRank()
        self.controller = Controller(
            config=config,
            tree=tree,
            bytes_per_token=bytes_per_token,
            credits=topology.credits,
            storage_on=storage_on,
        )
        self._workers: _Workers | None = None  # set by `connect`
        self.storage: StorageAttachment | None = None  # the L3 attached now (None: storage off)
        self._timers: dict[OpId, TimerHandle] = {}  # prefetch timeouts (until CancelTimer)
        self._tick = 0  # frontend calls run so far: the tree's clock across TP ranks
        self._recording = True  # the log goes somewhere (as of the message being handled)

    def connect(
        self,
        *,
        writer: Mailbox[WriterInbox],
        loader: Mailbox[LoaderInbox],
        uploader: Mailbox[UploaderInbox],
        prefetcher: Mailbox[PrefetcherInbox],
        storage: StorageAttachment | None = None,
    ) -> None:
        """Set the workers' inboxes (they are built after the tree: they report to its inbox)
        and the storage attached at open (the workers were built with its backend)."""
        self._workers = _Workers(writer, loader, uploader, prefetcher)
        self.storage = storage

    @property
    def workers(self) -> _Workers:
        assert self._workers is not None, "the tree actor runs only once connected"
        return self._workers

    async def close_storage(self) -> None:
        """At close, after the actor system stopped: close the attached backend if the cache opened
        it (a caller's backend is the caller's)."""
        storage, self.storage = self.storage, None
        if storage is not None and storage.owned:
            await storage.backend.aclose()

    @property
    def counters(self) -> Counters:
        return self.controller.counters

    def ledgers(self) -> dict[str, dict[str, int]]:
        """Each tier's size, used and available tokens (the controller's own ledgers)."""
        return self.controller.tiers.view()

    def bookkeeping(self) -> dict[str, int]:
        return self.controller.bookkeeping() | {
            "timers": len(self._timers),
        }

    def _now(self) -> float:
        """The controller's clock for recency and order: the actor system's clock on one rank; on TP
        ranks the count of frontend calls, the same on every rank (wall clocks are not)."""
        return self.system.now() if self._agreement.trivial else float(self._tick)

    # ------------------------------------------------------------------ the loop
    async def handle(self, msg: TreeInbox) -> None:
        controller = self.controller
        # Every slot the ledgers hand out or take back is an event (what `hicache check-log`
        # re-derives slot ownership from), built only while the log goes somewhere; so is
        # every other event (several per request, each a dict and a structlog pass to drop).
        self._recording = self.log.recording
        if isinstance(msg, HostSlotsReady):  # the allocator leases a prepared chunk of L2
            controller.tiers.lease_host(msg.start, msg.stop)
            return
        if isinstance(msg, COMPLETIONS):
            controller.record(msg)
            if self._agreement.trivial or controller.wants_sync():
                await self._sync()
        else:
            controller.accept(msg)
        while (fresh := controller.ready()) is not None:
            if fresh:
                self._tick += 1
            if not self._agreement.trivial:  # one rank applied every completion on arrival
                await self._sync()  # frontend calls reach every rank in the same order
            await self._execute(
                controller.run(self._now(), events=self._recording, detail=self._recording)
            )

    async def _sync(self) -> None:
        """Agree with the other ranks how far every op has got, and apply that."""
        if self._agreement.trivial:  # no one to agree with: no vectors
            await self._execute(
                self.controller.apply_arrived(
                    self._now(), events=self._recording, detail=self._recording
                )
            )
            return
        seen = self.controller.progress()
        agreed, agreed_max = await self._agreement.agree(seen.mins, seen.maxes)
        await self._execute(
            self.controller.apply(
                seen,
                agreed,
                agreed_max,
                self._now(),
                events=self._recording,
                detail=self._recording,
            )
        )

    async def _execute(self, effects: list[Effect]) -> None:
        log = self.log
        backups: list[Backup] = []  # the step's backups, sent to the writer as one message
        for effect in effects:
            match effect:
                case Event(name=name, fields=fields, level=level):
                    if name == "tree.slots":  # slots as runs: small, comparable, JSON as is
                        fields = {**fields, "slots": slot_runs(fields["slots"])}
                    getattr(log, level)(name, **fields)
                    continue
                case Answer(reply=reply, value=value):
                    reply.set(value)
                    continue
                case Send(to="writer", msg=Backup() as backup):
                    backups.append(backup)
                    continue
            if backups:  # before anything that may wait: what waits may need them done
                await self.workers.writer.send(Backups(jobs=tuple(backups)))
                backups = []
            match effect:
                case Send(msg=Upload() as upload):
                    await self.workers.uploader.send(upload)
                case Send(msg=StartPrefetch() | ReadPrefetch() | StopPrefetch() as command):
                    await self.workers.prefetcher.send(command)
                case Send(msg=Backup()):
                    raise AssertionError("backups are sent as one Backups per step (above)")
                case SubmitLoad(ticket=ticket, host_slots=host, device_slots=device):
                    ticket.bind(
                        await self.system.request(
                            self.workers.loader, _load(ticket.op, host, device)
                        )
                    )
                case Fail(reply=reply, error=error):
                    reply.fail(error)
                case StartTimer(op=op, delay=delay):
                    # a reserved slot per op: the send never blocks
                    self._timers[op] = self.system.call_later(
                        delay, functools.partial(self.inbox.send_nowait, TimerFired(op=op))
                    )
                case CancelTimer(op=op):
                    self._timers.pop(op).cancel()
                case ClearBackend(reply=reply, answer=answer):
                    await self._clear(reply, answer)
                case SwitchStorage(reply=reply, storage=storage, fields=extra):
                    await self._switch(reply, storage, extra or {})
                case Drained(replies=replies, tables=tables):
                    report = (
                        self.controller.tiers.view(),
                        tables | {"timers": len(self._timers)},
                    )
                    for reply in replies:
                        reply.set(report)
        if backups:
            await self.workers.writer.send(Backups(jobs=tuple(backups)))

    async def _switch(
        self, reply: Any, storage: StorageAttachment | None, fields: dict[str, Any]
    ) -> None:
        """Attach `storage`, or detach (None): the workers have nothing in flight, and get the
        new backend before any command the controller issues after this step."""
        old, self.storage = self.storage, storage
        backend = None if storage is None else storage.backend
        await self.workers.uploader.send(UseBackend(backend=backend))
        await self.workers.prefetcher.send(UseBackend(backend=backend))
        if storage is not None:
            self.system.log.emit(
                "storage.attached", component="cache", spec=storage.spec, owned=storage.owned
            )
            reply.set(True)
        else:
            assert old is not None  # the controller detaches only what it attached
            self.system.log.emit(
                "storage.detached", component="cache", spec=old.spec, owned=old.owned, **fields
            )
            reply.set(old)

    async def _clear(self, reply: Any, answer: Any) -> None:
        assert self.storage is not None
        timeout = self._cfg.storage_timeout
        with self.system.clock.move_on_after(timeout) as scope:
            await self.storage.backend.clear()
        if scope.cancelled_caught:
            self.log.warning("tree.storage_timeout", call="clear", timeout=timeout)
            reply.fail(StorageTimeout(f"clear_storage: no answer within {timeout} s"))
        else:
            self.log.info("tree.storage_cleared")
            reply.set(True if answer is None else replace(answer, storage=True))


def _load(op: OpId, host: np.ndarray, device: np.ndarray) -> Callable[[Reply[LoadHandle]], Load]:
    def make(reply: Reply[LoadHandle]) -> Load:
        return Load(op=op, host_slots=host, device_slots=device, reply=reply)

    return make
