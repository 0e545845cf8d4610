"""The tree controller with instant workers: the cache's control plane without bytes, actors
or time (what `hicache sweep` replays, `hicache/cli/coremodel.py`).

`InstantCache` drives the tree actor's own controller (`hicache/components/controller/controller.py`)
in one thread, as `actor.py` drives it, and carries out the effects it returns with workers
that take no time and never fail: a backup or a load has landed as soon as it is asked for, an
upload writes its pages to L3, a prefetch probes L3 and reads what it holds. No KV bytes
exist: slots are only counted (on the controller's own ledgers). Its clock is the count of
steps it has taken.

L3, when on, is a `StoreBook` (`hicache/policies/storage.py`) over the pages' keys: unbounded,
or capped with a store policy, each page counted at the framed size a store holds for it
(header, key and the page's bytes under `config.kv`). Its calls are the memory store's under
the replay's storage workers: an upload writes each page in order, a probe asks for the
pages in order until the first one missing, a read asks for a batch of
`storage_batch_pages` at a time (every page of it) and stops after a short batch. A capped
store may therefore evict a page between its probe and its read, or refuse one (a set that
succeeds, keeping nothing). Values have no ttl here, and a page never exceeds the cap
(`hicache sweep` refuses a cap below one page).

Time is the order of calls: every completion a worker would report (a backup, a load, an
upload, a prefetch's probe and read) is applied before the next frontend call, as the actor
applies it when the worker answers in time. Inside a call that has to wait for an op (an
allocation parked on an eviction backup or an upload), the workers answer one at a time, in
the order they were asked, until the call can go on. A real cache whose transfers or storage
calls are still in flight when the next call arrives can therefore take other decisions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from hicache.assembly import storage_namespace
from hicache.backends.batch import prefix_count
from hicache.backends.framing import header_size
from hicache.components.controller.controller import Controller
from hicache.components.controller.effects import (
    Answer,
    ClearBackend,
    Drained,
    Effect,
    Fail,
    Send,
    SubmitLoad,
)
from hicache.components.topology import Topology
from hicache.config import CacheConfig
from hicache.kernels.geometry import parse_geometry
from hicache.kernels.native.rowcopy import u32_ids
from hicache.messages import (
    Backup,
    Drain,
    LoadDone,
    PrefetchProgress,
    ReadPrefetch,
    StartPrefetch,
    StopPrefetch,
    TreeInbox,
    Upload,
    UploadDone,
    WriteDone,
)
from hicache.policies.eviction import make_strategy
from hicache.policies.storage import DEFAULT_STORE_POLICY, StoreBook
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree
from hicache.types import OpId, PageHash

__all__ = ["InstantCache", "framed_page_bytes"]

Work = Backup | SubmitLoad | Upload | StartPrefetch | ReadPrefetch | StopPrefetch


def framed_page_bytes(config: CacheConfig) -> int:
    """The bytes a store holds for one page of `config` (resolved here): the page's KV under
    `config.kv` and the framing header with its key (`hicache/backends/framing.py`)."""
    cfg, _ = config.resolve()
    key = storage_namespace(cfg).key(PageHash("0" * 64))
    return parse_geometry(cfg.kv).bytes_per_token * cfg.page_size + header_size(key)


class _Reply:
    """A frontend call's reply: the value, or the error, once the controller answers."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def set(self, value: Any) -> None:
        self.value, self.done = value, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


class _Landed:
    """The handle of a load with no bytes: every layer has landed."""

    def wait(self, layer: int) -> None:
        return None

    async def wait_async(self, layer: int) -> None:
        return None

    def done(self) -> bool:
        return True

    def layer_done(self, layer: int) -> bool:
        return True


_LANDED = _Landed()


class InstantCache:
    """One cache's control plane, driven synchronously. `config` as for `HiCache` (resolved
    here); `storage`: L3 on or off; `storage_capacity`: L3's cap in framed bytes (None:
    unbounded) and `store_policy` its policy's name. With L3, the `wait_complete` prefetch
    policy only: the others stop prefetches at times only a clock decides."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        storage: bool,
        storage_capacity: int | None = None,
        store_policy: str = DEFAULT_STORE_POLICY,
    ) -> None:
        cfg, _ = config.resolve()
        if storage and cfg.prefetch_policy != "wait_complete":
            raise ValueError(
                "instant workers model prefetch_policy='wait_complete' only "
                f"(got {cfg.prefetch_policy!r}): the others depend on timing"
            )
        self.cfg = cfg
        tree = RadixTree(
            page_size=cfg.page_size,
            eviction=make_strategy(cfg.eviction),
            write_policy=write_policy(cfg.write_policy),
            default_priority=cfg.default_priority,
            u32_ids=u32_ids,
        )
        self.controller = Controller(
            config=cfg,
            tree=tree,
            bytes_per_token=1,  # the byte counters count tokens
            credits=Topology.for_capacity(cfg.channel_capacity).credits,
            storage_on=storage,
        )
        self.controller.tiers.lease_host(0, cfg.host_capacity)  # no allocator: all of L2 at once
        self.storage = storage
        self._keys = storage_namespace(cfg)
        self.page_bytes = parse_geometry(cfg.kv).bytes_per_token * cfg.page_size + header_size(
            self._keys.key(PageHash("0" * 64))
        )  # what a store holds for one page: its framed value
        self._store_policy = store_policy
        self._storage_capacity = storage_capacity
        self.stored = StoreBook(store_policy, storage_capacity)  # L3, by key
        self._probed: dict[OpId, int] = {}  # the prefetcher's ops: op -> pages storage has
        self._probe_hashes: dict[OpId, tuple[PageHash, ...]] = {}  # ... and their hashes
        self._owed: deque[Work] = deque()  # what the workers were asked, not reported yet
        self._clock = 0

    def _now(self) -> float:
        self._clock += 1
        return float(self._clock)

    # ------------------------------------------------------------------ frontend calls
    def call(self, make: Callable[[Any], TreeInbox]) -> Any:
        """One frontend call, after every completion owed has been applied: its answer, or
        the error it failed with, raised. `make(reply)` builds the message; the reply is a
        plain object (`set` / `fail`), not an actor system's `Reply`: nothing here awaits."""
        self.settle()
        reply = _Reply()
        controller = self.controller
        controller.accept(make(reply))
        while True:
            while controller.ready() is not None:
                self._execute(controller.run(self._now()))
            if reply.done or not self._owed:
                break
            self._land()  # parked (or answered later): the oldest worker reports
        if not reply.done:
            raise AssertionError("the call was not answered, and nothing is in flight")
        if reply.error is not None:
            raise reply.error
        return reply.value

    def settle(self) -> None:
        """Apply every completion the workers owe, and those they owe next, until none is."""
        while self._owed:
            self._land()

    # ------------------------------------------------------------------ the workers
    def _land(self) -> None:
        """The oldest op owed reports, and the controller applies it: one sync point per
        completion, as the actor takes them on one rank."""
        work = self._owed.popleft()
        report: WriteDone | LoadDone | UploadDone | PrefetchProgress | None
        if isinstance(work, Backup):
            report = WriteDone(ops=(work.op,), ok=True)
        elif isinstance(work, SubmitLoad):
            report = LoadDone(op=work.op, ok=True)
        elif isinstance(work, Upload):
            for key in self._keys.keys(work.hashes):
                self.stored.write(key, self.page_bytes)
            # A refused page is a set that succeeded, as the memory store answers it.
            report = UploadDone(op=work.op, stored_pages=len(work.hashes))
        else:
            report = self._prefetch(work)
        if report is None:
            return
        controller = self.controller
        controller.record(report)
        self._execute(controller.apply_arrived(self._now()))

    def _prefetch(
        self, work: StartPrefetch | ReadPrefetch | StopPrefetch
    ) -> PrefetchProgress | None:
        """The prefetcher's report (`components/prefetcher/actor.py`), its I/O instant."""
        op = work.op
        stored = self.stored
        if isinstance(work, StartPrefetch):
            hit = prefix_count(stored.probe(k) for k in self._keys.keys(work.hashes))
            if hit:
                self._probed[op] = hit
                self._probe_hashes[op] = work.hashes
            return PrefetchProgress(op=op, hit_pages=hit, done_pages=0, finished=hit == 0)
        hit = self._probed.pop(op, -1)
        hashes = self._probe_hashes.pop(op, ())
        if hit < 0:  # over already: a stop or a read that came after the end is dropped
            return None
        if isinstance(work, StopPrefetch):
            return PrefetchProgress(op=op, hit_pages=hit, done_pages=0, finished=True, stopped=True)
        hit = min(hit, len(work.host_slots) // self.cfg.page_size)
        keys = self._keys.keys(hashes[:hit])
        done, batch = 0, self.cfg.storage_batch_pages
        while done < hit:  # the prefetcher's reads: a batch at a time, every page asked
            chunk = keys[done : done + batch]
            got = prefix_count([stored.read(k) for k in chunk])
            done += got
            if got < len(chunk):
                break
        return PrefetchProgress(op=op, hit_pages=hit, done_pages=done, finished=True)

    def _execute(self, effects: list[Effect]) -> None:
        """Carry out the controller's effects, as the actor does (events and timers: none)."""
        for effect in effects:
            if isinstance(effect, Send):
                if not isinstance(effect.msg, Work):
                    raise AssertionError(f"no instant worker takes {effect.msg!r}")
                self._owed.append(effect.msg)
            elif isinstance(effect, SubmitLoad):
                effect.ticket.bind(_LANDED)  # lands at once, as the loader's handle would say
                self._owed.append(effect)
            elif isinstance(effect, Answer):
                effect.reply.set(effect.value)
            elif isinstance(effect, Fail):
                effect.reply.fail(effect.error)
            elif isinstance(effect, ClearBackend):
                self.stored = StoreBook(self._store_policy, self._storage_capacity)
                effect.reply.set(True)
            elif isinstance(effect, Drained):
                for reply in effect.replies:
                    reply.set((self.controller.tiers.view(), effect.tables))

    # ------------------------------------------------------------------ close
    def drain(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """Close: finish everything, release every request, free every slot the tree holds;
        the ledgers and the bookkeeping tables after (all empty)."""
        drained: tuple[dict[str, dict[str, int]], dict[str, int]] = self.call(
            lambda r: Drain(reply=r)
        )
        return drained
