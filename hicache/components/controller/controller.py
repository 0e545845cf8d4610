"""The controller: the cache's whole control plane as one synchronous core.

It takes one thing at a time (a frontend call, a completion, the values the TP ranks agreed
on) and returns what to do as data (`effects.py`): commands for the workers, answers, events,
timers. No await, no clock (the driver passes `now`), no I/O. `actor.py` drives it.

Frontend calls run in arrival order. A call that needs an op in flight to end first (an
allocation waiting for an eviction backup or an upload) *parks*: the calls after it wait,
completions keep being taken, and the parked call is run again, from where it stopped, once
that op has ended. Completions are recorded as they arrive and applied at *sync points*, as
far as every TP rank has got (`progress`, then `apply` of what the ranks agreed); one rank
has no one to agree with and applies what has arrived at once (`apply_arrived`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typing_extensions import assert_never

from hicache.components.controller import sync
from hicache.components.controller.allocation import Allocator
from hicache.components.controller.effects import ClearBackend, Drained, Effect, Effects, Fail
from hicache.components.controller.loads import LoadFlows
from hicache.components.controller.ops import OpTable, Wait
from hicache.components.controller.pins import PinTable
from hicache.components.controller.prefetches import PrefetchFlows
from hicache.components.controller.progress import Progress
from hicache.components.controller.requests import Requests
from hicache.components.controller.shared import Counters, Shared, Step
from hicache.components.controller.storage_switch import StorageSwitch
from hicache.components.controller.sync import Completion
from hicache.components.controller.tiers import TIERS, Tiers
from hicache.components.controller.writes import WriteFlows
from hicache.config import CacheConfig
from hicache.messages import (
    AllocBatch,
    AttachStorage,
    CacheBatch,
    Clear,
    ClearStorage,
    DetachStorage,
    Drain,
    DumpTree,
    Flush,
    GetStats,
    HostSlotsReady,
    LoadBackBatch,
    LoadDone,
    MatchBatch,
    Pin,
    PrefetchBatch,
    PrefetchPoll,
    PrefetchProgress,
    PrefetchWait,
    ReleaseBatch,
    TimerFired,
    TreeInbox,
    Unpin,
    UploadDone,
    UploadTimedOut,
    WriteDone,
)
from hicache.radix.tree import RadixTree
from hicache.results import (
    CacheError,
    CacheStats,
    ClearOutcome,
    InvalidRequest,
    LoadBackOutcome,
)


@dataclass(slots=True)
class Parked:
    wait: Wait
    done: list[LoadBackOutcome] = field(default_factory=list)  # a load-back's, so far


class Controller:
    def __init__(
        self,
        *,
        config: CacheConfig,
        tree: RadixTree,
        bytes_per_token: int,
        credits: int,
        storage_on: bool,
    ) -> None:
        self.shared = shared = Shared(cfg=config, tree=tree, bytes_per_token=bytes_per_token)
        self.tiers = Tiers(shared)
        self.storage = StorageSwitch(storage_on)  # attach / detach L3
        self.ops = OpTable(credits)  # every op in flight, credits per kind
        self.writes = WriteFlows(shared, self.tiers, self.storage, self.ops)
        self.loads = LoadFlows(shared, self.tiers, self.ops)
        self.alloc = Allocator(shared, self.tiers, self.storage, self.writes, self.loads)
        self.pins = PinTable(shared, self.tiers)
        self.requests = Requests(shared, self.tiers, self.alloc, self.writes, self.loads, self.pins)
        self.prefetches = PrefetchFlows(
            shared,
            self.tiers,
            self.alloc,
            self.writes,
            self.requests,
            self.pins,
            self.storage,
            self.ops,
        )
        self._calls: deque[TreeInbox] = deque()  # frontend calls not yet run, in order
        self._parked: Parked | None = None  # the head call, waiting for an op to end
        self._flush_waiters: list[Any] = []  # answered when no write is pending
        self._drain_waiters: list[Any] = []  # answered when nothing at all is in flight
        self._clear_waiters: list[Clear] = []  # run when nothing at all is in flight
        self._between: list[Effect] = []  # what `accept` said, for the next step to return

    @property
    def counters(self) -> Counters:
        return self.shared.counters

    # ------------------------------------------------------------------ frontend calls
    def accept(self, msg: TreeInbox) -> None:
        """Queue a frontend call. Close's last resort (`Drain(abandon=True)`) goes first and
        ends a parked call, failing it: nothing it waits for will come."""
        if isinstance(msg, Drain) and msg.abandon:
            if self._parked is not None:
                self._parked = None
                self._between.append(
                    Fail(
                        self._calls.popleft().reply,  # type: ignore[union-attr]
                        CacheError("the cache closed while this call waited"),
                    )
                )
            self._calls.appendleft(msg)
        else:
            self._calls.append(msg)

    def ready(self) -> bool | None:
        """None: no call can run now; True: the next call is new; False: the parked call can
        go on (the op it waited for has ended)."""
        if not self._calls:
            return None
        parked = self._parked
        if parked is None:
            return True
        return False if parked.wait.ended() else None

    def wants_sync(self) -> bool:
        """TP ranks: the op the parked call waits for has arrived here, so meet the other ranks
        now (they do the same once it arrives there) rather than at the next frontend call."""
        parked = self._parked
        return parked is not None and parked.wait.arrived()

    def run(self, now: float, *, events: bool = True, detail: bool = False) -> list[Effect]:
        """Run the next call (see `ready`): a new one, or the parked one from where it stopped.
        `events`: build events at all (the driver's log goes somewhere); `detail`: also the
        slot events (`tree.slots`, what `hicache check-log` re-derives ownership from)."""
        step = self._step(now, events, detail)
        msg = self._calls.popleft()
        parked, self._parked = self._parked, None
        try:
            wait = self._dispatch(step, msg, parked)
        except CacheError as exc:  # a caller's mistake, found before anything changed
            step.out.fail(msg.reply, exc)  # type: ignore[union-attr]
        else:
            if wait is not None:
                self._parked = wait
                self._calls.appendleft(msg)
        self._settle(step)
        return step.out.take()

    def _dispatch(self, step: Step, msg: TreeInbox, parked: Parked | None) -> Parked | None:
        out, requests, prefetches = step.out, self.requests, self.prefetches
        match msg:
            case MatchBatch(items=items, reply=reply):
                out.answer(reply, requests.match_batch(step, items))
            case LoadBackBatch(rids=rids, reply=reply, threshold=threshold):
                done = parked.done if parked is not None else []
                wait = requests.load_back_batch(step, rids, done, threshold)
                if wait is not None:
                    return Parked(wait, done)
                out.answer(reply, tuple(done))
            case AllocBatch(sizes=sizes, reply=reply):
                slots: list[np.ndarray] = []
                wait = requests.alloc_batch(step, sizes, slots)
                if wait is not None:
                    return Parked(wait)
                out.answer(reply, tuple(slots))
            case CacheBatch(items=items, reply=reply):
                out.answer(reply, requests.cache_batch(step, items))
            case ReleaseBatch(rids=rids, reply=reply):
                requests.release_batch(step, rids)
                out.answer(reply, None)
            case Flush(reply=reply, poll=poll):
                if poll:
                    out.answer(reply, not self.writes.pending())
                elif self.writes.pending():
                    self._flush_waiters.append(reply)
                else:
                    out.answer(reply, None)
            case GetStats(reply=reply):
                out.answer(reply, self.stats())
            case DumpTree(reply=reply):
                out.answer(reply, self.shared.tree.dump())
            case Drain(reply=reply, poll=poll, abandon=abandon):
                prefetches.stop_all(step)
                if abandon:
                    self._abandon_in_flight(step)
                if not (poll or abandon):
                    self._drain_waiters.append(reply)
                elif self.in_flight():
                    out.answer(reply, None)
                else:
                    self._drain(step, (reply,))
            case PrefetchBatch(items=items, reply=reply):
                requests.check_rids([item.rid for item in items], "prefetch")
                keys = []
                for item in items:
                    if requests.state(item.rid, "prefetch").salt != item.salt:
                        raise InvalidRequest(
                            f"prefetch: request {item.rid!r} names another salt than its match"
                        )
                    keys.append(requests.check_tokens(item.tokens))
                outcomes = []
                for item, key in zip(items, keys, strict=True):
                    state = requests.state(item.rid, "prefetch")
                    admitted = prefetches.start(step, state, item.rid, key, item.threshold)
                    if admitted.skipped:
                        requests.prefetch_ended(item.rid, admitted.outcome)
                    outcomes.append(admitted.outcome)
                out.answer(reply, tuple(outcomes))
            case PrefetchWait(rid=rid, reply=reply, poll=poll):
                prefetches.wait(step, rid, reply, poll=poll)
            case PrefetchPoll(rid=rid, reply=reply):
                out.answer(reply, prefetches.poll(rid))
            case Clear(tiers=tiers, reply=reply, poll=poll):
                bad = [t for t in tiers if t not in TIERS]
                if bad or not tiers:
                    raise InvalidRequest(f"clear: tiers must be some of {TIERS}, got {tiers!r}")
                if not self.in_flight():
                    self._clear(step, msg)
                elif poll:
                    out.answer(reply, None)
                else:
                    self._clear_waiters.append(msg)
            case AttachStorage() | DetachStorage():
                self.storage.accept(msg)  # applied in order, as in-flight work allows (_settle)
            case Pin(tokens=tokens, salt=salt, tiers=tiers, ttl=ttl, reply=reply):
                out.answer(reply, self.pins.pin(step, tokens, salt, tiers, ttl))
            case Unpin(tokens=tokens, salt=salt, reply=reply):
                out.answer(reply, self.pins.unpin(step, tokens, salt))
            case ClearStorage(reply=reply):
                if self.storage.on:
                    out.add(ClearBackend(reply))
                else:
                    out.answer(reply, False)
            case (
                WriteDone()
                | LoadDone()
                | UploadDone()
                | UploadTimedOut()
                | PrefetchProgress()
                | TimerFired()
            ):
                raise AssertionError("completions are recorded, not run")
            case HostSlotsReady():
                raise AssertionError("host leases go to the tiers (`Tiers.lease_host`), not run")
            case _:
                assert_never(msg)
        return None

    # ------------------------------------------------------------------ completions
    def record(self, msg: Completion) -> None:
        """Note a completion; applied at the next sync point (`sync.py`)."""
        sync.record(msg, self.ops, self.writes)

    def progress(self) -> Progress:
        """This rank's view of every op in flight, as the vectors the ranks agree on."""
        return self.ops.progress()

    def apply(
        self,
        seen: Progress,
        agreed: list[int],
        agreed_max: list[int],
        now: float,
        *,
        events: bool = True,
        detail: bool = False,
    ) -> list[Effect]:
        """Apply what every rank has got (for one rank: `seen.mins`, `seen.maxes`)."""
        step = self._step(now, events, detail)
        sync.apply(
            step,
            seen.agreed(agreed, agreed_max),
            self.ops,
            self.writes,
            self.loads,
            self.prefetches,
            self.requests,
        )
        self._settle(step)
        return step.out.take()

    def apply_arrived(
        self, now: float, *, events: bool = True, detail: bool = False
    ) -> list[Effect]:
        """One rank: apply every completion that has arrived, as `apply` of this rank's own
        progress would, without laying out vectors to agree on."""
        step = self._step(now, events, detail)
        if self._ops_in_flight():
            sync.apply(
                step, None, self.ops, self.writes, self.loads, self.prefetches, self.requests
            )
            self._settle(step)
        return step.out.take()

    def _ops_in_flight(self) -> bool:
        """Any op a completion can arrive for (what `progress` has a row for)."""
        return bool(
            any(self.writes.in_flight().values())
            or self.loads.in_flight()["loads"]
            or self.prefetches.in_flight()["prefetches"]
        )

    def _step(self, now: float, events: bool, detail: bool) -> Step:
        """A fresh step, starting with what `accept` had to say between steps."""
        out = Effects(events=events, detail=detail)
        if self._between:
            out.items.extend(self._between)
            self._between.clear()
        return Step(now, out)

    # ------------------------------------------------------------------ flush, close, stats
    def _clear(self, step: Step, msg: Clear) -> None:
        """Drop every unlocked page of the tiers asked (nothing is in flight now)."""
        device = self.tiers.clear_device(step) if "device" in msg.tiers else 0
        host = self.tiers.clear_host(step) if "host" in msg.tiers else 0
        outcome = ClearOutcome(device_tokens=device, host_tokens=host)
        step.out.info("tree.cleared", tiers=list(msg.tiers), device=device, host=host)
        if "storage" in msg.tiers and self.storage.on:
            step.out.add(ClearBackend(msg.reply, outcome))
        else:
            step.out.answer(msg.reply, outcome)

    def _settle(self, step: Step) -> None:
        """Answer flushes once no write is pending, and drains once nothing is in flight."""
        # a detach waits for the uploads and prefetches in flight
        self.storage.settle(step, self.ops, self._stop_storage_work)
        if self._flush_waiters and not self.writes.pending():
            for reply in self._flush_waiters:
                step.out.answer(reply, None)
            self._flush_waiters.clear()
        if self._clear_waiters and not self.in_flight():
            waiting, self._clear_waiters = self._clear_waiters, []
            for msg in waiting:
                self._clear(step, msg)
        if self._drain_waiters and not self.in_flight():
            waiters, self._drain_waiters = self._drain_waiters, []
            self._drain(step, tuple(waiters))

    def _stop_storage_work(self, step: Step) -> tuple[int, int]:
        """Storage is off: the uploads waiting for a credit are dropped (counted as skipped)
        and the running prefetches stopped; how many of each."""
        return self.writes.drop_upload_backlog(step), self.prefetches.stop_all(step)

    def in_flight(self) -> bool:
        return bool(
            self.writes.busy()
            or self.loads.in_flight()["loads"]
            or self.prefetches.in_flight()["prefetches"]
        )

    def _drain(self, step: Step, replies: tuple[Any, ...]) -> None:
        """Release every request and free every slot the tree holds; the driver answers with
        the ledgers and the bookkeeping tables (all empty now)."""
        # nothing in flight: a detach still queued goes through first
        self.storage.settle(step, self.ops, self._stop_storage_work)
        self.requests.release_all(step)
        self.pins.clear()
        self.tiers.drain(step)
        step.out.add(Drained(replies, self.bookkeeping()))

    def _abandon_in_flight(self, step: Step) -> None:
        """Close's last resort past its deadline: end every op still in flight as if it had
        failed, so its slots go back. Its worker may still be inside a storage call; the
        actor system stops right after, and nothing reuses the slots."""
        counts = self.writes.abandon(step)
        loads = self.loads.abandon(step)
        for op in loads:
            self.requests.load_failed(op)
        counts = {
            "writes": counts["writes"],
            "loads": len(loads),
            "uploads": counts["uploads"],
            "prefetches": self.prefetches.abandon(step),
        }
        self.shared.counters.abandoned_ops += sum(counts.values())
        step.out.warning("tree.abandoned", **counts)

    def bookkeeping(self) -> dict[str, int]:
        """Sizes of every table that grows with requests or ops: all 0 after a drain."""
        return {
            **self.requests.tables(),
            **self.writes.tables(),
            **self.loads.tables(),
            **self.prefetches.tables(),
            **self.pins.tables(),
            "flush_waiters": len(self._flush_waiters),
            "clear_waiters": len(self._clear_waiters),
            "calls": len(self._calls),
            **self.storage.tables(),
            "salt_roots": self.shared.tree.salts,
        }

    def stats(self) -> CacheStats:
        inflight = {
            **self.writes.in_flight(),
            **self.loads.in_flight(),
            **self.prefetches.in_flight(),
            **self.requests.tables(),
        }
        return self.tiers.stats(inflight)
