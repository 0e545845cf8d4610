"""The tree actor: the one owner of the radix tree, the per-request table and the tier policy.

It turns frontend requests into core calls and the core's results into commands for the
allocator (request/response: a leaf), the writer, loader, uploader and prefetcher (commands
bounded by credits, completions back as fire-and-forget messages), and events. Its flows live
in a few files, all over this one object's state: `backups.py` (L1 -> L2 -> L3),
`prefetching.py` (L3 -> L2), `completions.py` (sync points and TP agreement).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from typing_extensions import assert_never

from hicache.components.allocator.core import SlotLedger
from hicache.components.tree.agreement import RankAgreement, SingleRank
from hicache.components.tree.backups import BackupFlows
from hicache.components.tree.completions import CompletionFlows
from hicache.components.tree.core import RadixTree
from hicache.components.tree.prefetching import PrefetchFlows
from hicache.components.tree.records import (
    Counters, LoadOp, PrefetchOp, RequestState, UploadOp, WriteOp,
)
from hicache.config import CacheConfig
from hicache.components.tree.results import TreeError
from hicache.kernels.streams.base import AllLoads
from hicache.messages import (
    Alloc, AllocBatch, CacheBatch, ClearStorage, Drain, DumpTree, Flush, Free, GetStats,
    LedgerStats, Load, LoadBackBatch, LoadDone, MatchBatch, PrefetchBatch, PrefetchPoll,
    PrefetchProgress, PrefetchWait, ReleaseBatch, TimerFired, TreeInbox, UploadDone,
    UploadTimedOut, WriteDone,
)
from hicache.results import (
    CacheError, CacheOutcome, CacheStats, CapacityError, InvalidRequest, LoadBackOutcome,
    MatchOutcome, StorageTimeout, TierStats, UnknownRequest,
)
from hicache.runtime import Actor, Mailbox
from hicache.types import EMPTY_SLOTS, NodeId, OpId, RequestId

_COMPLETIONS = (WriteDone, LoadDone, UploadDone, UploadTimedOut, PrefetchProgress, TimerFired)


class TreeActor(BackupFlows, PrefetchFlows, CompletionFlows, Actor[TreeInbox]):
    def __init__(
        self,
        *,
        config: CacheConfig,
        tree: RadixTree,
        allocator: Mailbox,
        bytes_per_token: int,
        topology,
        agreement: RankAgreement | None = None,
    ) -> None:
        bounds = topology.edges()["tree"]
        super().__init__("tree", capacity=bounds.capacity, reserve=bounds.reserve)
        credits = topology.credits
        self._cfg = config
        self._tree = tree
        self._allocator = allocator
        self._agreement = agreement or SingleRank()
        self._bpt = bytes_per_token
        self._writer: Mailbox | None = None  # the workers are set by connect()
        self._loader: Mailbox | None = None
        self._uploader: Mailbox | None = None
        self._prefetcher: Mailbox | None = None
        self._namespace = None
        self._clear_storage = None  # the backend's clear, when storage is on
        self._requests: dict[RequestId, RequestState] = {}
        # operations in flight, in issue order (every TP rank issues the same ones)
        self._writes: dict[OpId, WriteOp] = {}
        self._loads: dict[OpId, LoadOp] = {}
        self._uploads: dict[OpId, UploadOp] = {}
        self._prefetches: dict[OpId, PrefetchOp] = {}
        self._prefetch_by_rid: dict[RequestId, OpId] = {}
        self._write_backlog: deque[NodeId] = deque()  # waiting for a write credit
        self._upload_backlog: deque[tuple[NodeId, ...]] = deque()  # waiting for an upload credit
        self._write_credits = self._load_credits = credits
        self._upload_credits = self._prefetch_credits = credits
        self._prefetch_tokens = 0  # in flight, for the rate limit
        # completions that arrived and are not applied yet (see completions.py)
        self._arrived_writes: dict[OpId, tuple[bool, str]] = {}
        self._arrived_loads: dict[OpId, tuple[bool, str]] = {}
        self._arrived_uploads: dict[OpId, int] = {}
        self._prefetch_reports: dict[OpId, PrefetchProgress] = {}
        self._timers_fired: set[OpId] = set()
        self._flush_waiters: list = []  # answered when no write is pending
        self._drain_waiters: list = []  # answered when nothing at all is in flight
        self._slots: dict[str, SlotLedger] = {}  # both tiers, leased at start (on_start)
        self._lease_returned = False
        self._next_op = 0
        self._tick = 0  # frontend calls so far: the tree's clock across TP ranks
        self.counters = Counters()

    def connect(self, *, writer: Mailbox, loader: Mailbox, uploader: Mailbox | None = None,
                prefetcher: Mailbox | None = None, namespace=None, clear_storage=None) -> None:
        """Set the workers' inboxes (they are built after the tree: they report to its inbox)."""
        self._writer, self._loader = writer, loader
        self._uploader, self._prefetcher = uploader, prefetcher
        self._namespace, self._clear_storage = namespace, clear_storage

    @property
    def storage_on(self) -> bool:
        return self._prefetcher is not None

    # ------------------------------------------------------------------ dispatch
    async def handle(self, msg: TreeInbox) -> None:
        if isinstance(msg, _COMPLETIONS):
            self._record(msg)
            if self._agreement.trivial:  # one rank: apply at once
                await self._sync_point()
        else:
            self._tick += 1
            await self._sync_point()  # frontend calls reach every rank in the same order
            await self._dispatch(msg)
        await self._settle()

    async def _dispatch(self, msg: TreeInbox) -> None:
        match msg:
            case MatchBatch(items=items, reply=reply):
                await self._answer(reply, self._match_batch(items))
            case LoadBackBatch(rids=rids, reply=reply):
                await self._answer(reply, self._load_back_batch(rids))
            case AllocBatch(sizes=sizes, reply=reply):
                await self._answer(reply, self._alloc_batch(sizes))
            case CacheBatch(items=items, reply=reply):
                await self._answer(reply, self._cache_batch(items))
            case ReleaseBatch(rids=rids, reply=reply):
                await self._answer(reply, self._release_batch(rids))
            case Flush(reply=reply, poll=poll):
                if poll:
                    reply.set(not self._writes_pending())
                elif self._writes_pending():
                    self._flush_waiters.append(reply)
                else:
                    reply.set(None)
            case GetStats(reply=reply):
                await self._answer(reply, self._stats())
            case DumpTree(reply=reply):
                reply.set(self._tree.dump())
            case Drain(reply=reply, poll=poll, abandon=abandon):
                for op_id, op in list(self._prefetches.items()):
                    if op.state == "running":
                        self._stop_prefetch(op_id)
                if abandon:
                    await self._abandon_in_flight()
                if poll or abandon:
                    reply.set(None if self._in_flight() else await self._drain())
                else:
                    self._drain_waiters.append(reply)
            case PrefetchBatch(items=items, reply=reply):
                await self._answer(reply, self._prefetch_batch(items))
            case PrefetchWait(rid=rid, reply=reply, poll=poll):
                self._prefetch_wait(rid, reply, poll=poll)
            case PrefetchPoll(rid=rid, reply=reply):
                reply.set(self._prefetch_outcome(rid, self._prefetch_by_rid.get(rid)))
            case ClearStorage(reply=reply):
                if self._clear_storage is None:
                    reply.set(False)
                    return
                timeout = self._cfg.storage_timeout
                with self.kernel.clock.move_on_after(timeout) as scope:
                    await self._clear_storage()
                if scope.cancelled_caught:
                    self.log.warning("tree.storage_timeout", call="clear", timeout=timeout)
                    reply.fail(StorageTimeout(f"clear_storage: no answer within {timeout} s"))
                else:
                    self.log.info("tree.storage_cleared")
                    reply.set(True)
            case (WriteDone() | LoadDone() | UploadDone() | UploadTimedOut() | PrefetchProgress()
                  | TimerFired()):
                raise AssertionError("completions are recorded, not dispatched")
            case _:
                assert_never(msg)

    @staticmethod
    async def _answer(reply, coro) -> None:
        """Run a request's work and answer it. A caller's mistake (a `CacheError`, raised
        before anything changed) fails only that request; any other exception is the cache's
        own fault and stops it (`ActorFailed`), rather than being passed off as the caller's."""
        try:
            value = await coro
        except CacheError as exc:
            reply.fail(exc)
        else:
            reply.set(value)

    def _check_rids(self, rids, action: str) -> None:
        """Every request id of a batch hashable and named once."""
        seen = set()
        for rid in rids:
            try:
                hash(rid)
            except TypeError:
                raise InvalidRequest(
                    f"{action}: request id {rid!r} is not hashable ({type(rid).__name__})"
                ) from None
            if rid in seen:
                raise InvalidRequest(f"{action}: request {rid!r} appears twice in one batch")
            seen.add(rid)

    def _check_tokens(self, tokens):
        """The tokens converted once to the tree's encoding where that is a plain uint32 array
        (so every later match or insert of them skips the conversion), else as given.
        InvalidRequest for a malformed key."""
        try:
            encoded = self._tree.check_key(tokens)
            return encoded if encoded.dtype == np.uint32 else tokens
        except TreeError as exc:
            raise InvalidRequest(str(exc)) from None

    def _op(self) -> OpId:
        self._next_op += 1
        return OpId(self._next_op)

    def _now(self) -> float:
        """The tree's clock for recency and order: the kernel's clock on one rank; on TP ranks
        the count of frontend calls, the same on every rank (wall clocks are not)."""
        return self.kernel.now() if self._agreement.trivial else float(self._tick)

    async def _settle(self) -> None:
        """Answer flushes once no write is pending, and drains once nothing is in flight."""
        if not self._writes_pending():
            for reply in self._flush_waiters:
                reply.set(None)
            self._flush_waiters.clear()
        if self._drain_waiters and not self._in_flight():
            waiters, self._drain_waiters = self._drain_waiters, []
            report = await self._drain()
            for reply in waiters:
                reply.set(report)

    def _in_flight(self) -> bool:
        return bool(self._writes or self._write_backlog or self._uploads or self._upload_backlog
                    or self._loads or self._prefetches)

    def bookkeeping(self) -> dict[str, int]:
        """Sizes of every table that grows with requests or ops: all 0 after a drain."""
        return {
            "requests": len(self._requests), "writes": len(self._writes),
            "loads": len(self._loads), "uploads": len(self._uploads),
            "prefetches": len(self._prefetches), "prefetch_by_rid": len(self._prefetch_by_rid),
            "write_backlog": len(self._write_backlog),
            "upload_backlog": len(self._upload_backlog),
            "arrived_writes": len(self._arrived_writes),
            "arrived_loads": len(self._arrived_loads),
            "arrived_uploads": len(self._arrived_uploads),
            "prefetch_reports": len(self._prefetch_reports),
            "timers_fired": len(self._timers_fired), "flush_waiters": len(self._flush_waiters),
        }

    # ------------------------------------------------------------------ match
    async def _match_batch(self, items) -> tuple[MatchOutcome, ...]:
        self._check_rids([item.rid for item in items], "match")
        keys = [self._check_tokens(item.tokens) for item in items]  # all, before any lock moves
        return tuple(self._match(item.rid, key) for item, key in zip(items, keys))

    def _match(self, rid: RequestId, tokens) -> MatchOutcome:
        result = self._tree.match(tokens, now=self._now())
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = RequestState()
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len
        state.tokens = tokens
        state.failed_load = False
        state.loaded_back = False
        self.counters.device_hit_tokens += len(result.device_slots)
        state.loads = self._loads_under(result.last_node) if self._loads else []
        pending = tuple(self._loads[op].handle for op in state.loads)
        self.log.info(
            "tree.match", rid=rid, tokens=len(tokens), device_hit=len(result.device_slots),
            host_hit=result.host_len,
        )
        return MatchOutcome(
            rid=rid, device_slots=result.device_slots, host_len=result.host_len, pending=pending
        )

    def _loads_under(self, node: NodeId) -> list[OpId]:
        """The loads still landing on the path root..node (wait before reading). A load fills
        the nodes between its anchor and its lock, however a match or insert split them since
        (a split keeps the lower piece's id), so walk that stretch, not the plan's node ids."""
        if not self._loads:
            return []
        path = set()
        while node is not None:
            path.add(node)
            node = self._tree.parent(node)
        pending = []
        for op_id, op in self._loads.items():
            x = op.lock
            while x != op.anchor:
                if x in path:
                    pending.append(op_id)
                    break
                x = self._tree.parent(x)
        return pending

    def _rematch(self, state: RequestState) -> None:
        """Refresh a request's view from the tree: its prefix may have grown since its match
        (a prefetch landed, another request loaded or cached part of it)."""
        result = self._tree.match(state.tokens, now=self._now())
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len
        state.loads = self._loads_under(result.last_node)

    def _relock(self, state: RequestState, node: NodeId | None) -> None:
        if node is not None:
            self._tree.lock(node)
        if state.lock is not None:
            self._tree.unlock(state.lock)
        state.lock = node

    def _state(self, rid: RequestId, action: str) -> RequestState:
        try:
            return self._requests[rid]
        except KeyError:
            raise UnknownRequest(rid, action) from None

    # ------------------------------------------------------------------ load back (L2 -> L1)
    async def _load_back_batch(self, rids) -> tuple[LoadBackOutcome, ...]:
        self._check_rids(rids, "load_back")
        for rid in rids:
            self._state(rid, "load_back")
        return tuple([await self._load_back(rid) for rid in rids])

    async def _load_back(self, rid: RequestId) -> LoadBackOutcome:
        state = self._state(rid, "load_back")
        if state.failed_load:  # its prefix is not in L1 any more: release or match again
            return self._loaded(rid, state, 0)
        if state.host_len and not state.loaded_back and not state.owned:
            # What the match saw of its L2-only stretch may be stale: another request may have
            # loaded or cached part of it since. Take the prefix as the tree has it now.
            self._rematch(state)
        state.loaded_back = True
        if state.host_len < max(1, self._cfg.load_back_threshold) or state.last_node is None:
            return self._loaded(rid, state, 0)
        if self._load_credits == 0:
            self.counters.skipped_loads += 1
            self.log.warning("tree.load_deferred", rid=rid, tokens=state.host_len)
            return self._loaded(rid, state, 0)
        plan = self._tree.plan_load_back(state.last_node)
        device_slots = await self._alloc_device(plan.num_tokens)
        if device_slots is None:
            self.log.warning("tree.load_skipped", rid=rid, tokens=plan.num_tokens, reason="capacity")
            return self._loaded(rid, state, 0)
        anchor = self._tree.parent(plan.nodes[0])
        self._tree.commit_load_back(plan, device_slots)
        # The load holds its own lock on its nodes (and so on their device slots) until it
        # has landed or failed: whatever its request does meanwhile (release, match again),
        # no eviction can hand those slots to another request under a copy still landing.
        self._tree.lock(plan.nodes[-1])
        op = self._op()
        self._load_credits -= 1
        handle = await self.kernel.request(
            self._loader,
            lambda reply: Load(op=op, host_slots=plan.host_slots, device_slots=device_slots,
                               reply=reply),
        )
        self._loads[op] = LoadOp(plan=plan, handle=handle, lock=plan.nodes[-1], anchor=anchor)
        state.loads.append(op)
        state.prefix_slots = np.concatenate([state.prefix_slots, device_slots])
        state.host_len = 0
        self.counters.host_hit_tokens += plan.num_tokens
        self.counters.h2d_bytes += plan.num_tokens * self._bpt
        self.log.info("tree.load_started", rid=rid, op=op, tokens=plan.num_tokens)
        return self._loaded(rid, state, plan.num_tokens)

    def _loaded(self, rid: RequestId, state: RequestState, tokens: int) -> LoadBackOutcome:
        """A load_back's answer: the prefix, and one handle over every load still landing on
        it (its own and others')."""
        handles = [self._loads[op].handle for op in state.loads if op in self._loads]
        handle = None if not handles else handles[0] if len(handles) == 1 else AllLoads(handles)
        return LoadBackOutcome(rid=rid, device_slots=state.prefix_slots, loaded_tokens=tokens,
                               handle=handle)

    async def _finish_load(self, op_id: OpId, ok: bool, error: str) -> None:
        op = self._loads.pop(op_id)
        self._load_credits += 1
        self._tree.unlock(op.lock)
        if not ok:
            freed, kept = self._tree.revert_load_back(op.plan)
            self._free("device", freed)
            # Requests that counted on this load may not cache what they hold: their prefix
            # slots were freed (their handle raised; they must release or match again).
            for state in self._requests.values():
                if op_id in state.loads:
                    state.failed_load = True
            self.log.error("tree.load_failed", op=op_id, error=error or None, tokens=len(freed),
                           kept_nodes=list(kept))
        elif self._cfg.exclusive:
            freed = self._tree.drop_host(op.plan)
            self._free("host", freed)

    # ------------------------------------------------------------------ allocation
    async def _alloc_batch(self, sizes) -> tuple[np.ndarray, ...]:
        """Slots for every request of the step, or none: on a CapacityError the requests
        allocated before the failing one get their slots back, as if the call never was."""
        self._check_rids([rid for rid, _ in sizes], "allocate")
        for rid, n in sizes:
            self._state(rid, "allocate")
            if n < 0:
                raise InvalidRequest(f"cannot allocate {n} tokens for {rid!r}")
        out, undo = [], []
        page = self._cfg.page_size
        # One allocation (evicting as needed) for the whole step; request by request only when
        # the step does not fit, to find which request does not.
        wanted = [-(-max(0, n - len(self._requests[rid].padding)) // page) * page
                  for rid, n in sizes]
        pooled = await self._alloc_device(sum(wanted)) if sum(wanted) else None
        offset = 0
        for (rid, n), want in zip(sizes, wanted):
            state = self._requests[rid]
            before = state.padding
            # Fill the request's partial last page first, so every page stays one device page.
            reuse = before[:n]
            rest = n - len(reuse)
            fresh = EMPTY_SLOTS
            if rest and pooled is not None:
                fresh, offset = pooled[offset:offset + want], offset + want
            elif rest:
                fresh = await self._alloc_device(want)
                if fresh is None:
                    for st, padding, new in reversed(undo):
                        st.owned.pop()
                        st.padding = padding
                        self._free("device", new)
                    ledger = self.ledgers()
                    raise CapacityError("device", n, ledger["device"]["available"], rid=rid)
            state.padding = np.concatenate([before[n:], fresh[rest:]]) if rest else before[n:]
            slots = np.concatenate([reuse, fresh[:rest]])
            state.owned.append(slots)
            undo.append((state, before, fresh))
            out.append(slots)
        return tuple(out)

    async def on_start(self) -> None:
        """Lease every slot of both tiers from the allocator, once: from then on the tree
        allocates and frees on its own ledgers, with no round trip per step (the allocator
        keeps the record of what is leased and takes it back at close)."""
        page = self._cfg.page_size
        for tier, size in (("device", self._cfg.device_tokens), ("host", self._cfg.host_capacity)):
            lease = await self.kernel.request(
                self._allocator, lambda r, t=tier, n=size: Alloc(tier=t, num_tokens=n, reply=r))
            if lease is None or not np.array_equal(lease, np.arange(size)):
                raise RuntimeError(f"the allocator did not lease the whole {tier} tier")
            self._slots[tier] = SlotLedger(size=size, page_size=page, tier=tier)

    def _alloc(self, tier: str, n: int) -> np.ndarray | None:
        return self._slots[tier].alloc(n)

    def _free(self, tier: str, slots: np.ndarray) -> None:
        if len(slots):
            self._slots[tier].free(slots)

    def ledgers(self) -> dict:
        """Each tier's size, used and available tokens (the tree's own ledgers)."""
        return {tier: {"size": led.size, "used": led.used, "available": led.available}
                for tier, led in self._slots.items()}

    async def _return_lease(self) -> dict:
        """Close: give the allocator back every slot the tree's ledgers hold free; what is
        still held (a leak) stays leased and shows as used in the allocator's report."""
        if not self._lease_returned:
            self._lease_returned = True
            for tier, led in self._slots.items():
                await self._allocator.send(Free(tier=tier, slots=led.free_slots()))
        return await self.kernel.request(self._allocator, lambda r: LedgerStats(reply=r))

    async def _alloc_device(self, n: int) -> np.ndarray | None:
        """Device slots for n tokens: evict L1 (backing up first where the policy says so),
        and while backups in flight pin the only evictable pages, wait for them. None when
        everything left is locked by running requests."""
        if n == 0:
            return EMPTY_SLOTS
        while True:
            slots = self._alloc("device", n)
            if slots is not None:
                return slots
            # Evict what is missing, less what eviction backups in flight will free: asking for
            # all of n each time round would back up (and keep in both tiers) more leaves.
            short = n - self._slots["device"].available - sum(
                len(op.host_slots) for op in self._writes.values() if op.evicting)
            if short > 0 and await self._evict_device(short):
                continue
            if not self._writes:
                return None
            await self._await_write(next(iter(self._writes)))

    async def _evict_device(self, n: int) -> bool:
        """Evict about n tokens from L1; start the backups the policy wants first. Returns
        whether any device slot was freed."""
        ev = self._tree.evict_device(n, now=self._now(), require_host_copy=self._cfg.exclusive)
        self._free("device", ev.freed)
        self._free("host", ev.freed_host)
        if len(ev.freed):
            self.counters.device_evictions += len(ev.freed)
            self.log.info("tree.evict_device", tokens=len(ev.freed), demoted=len(ev.demoted),
                          removed=len(ev.removed))
        freed = len(ev.freed)
        for node in ev.needs_backup:  # write_back / exclusive: copy to L2, then evict
            if self._cfg.exclusive and not self._tree.outranks_host(node):
                # Older than everything L2 could give up: drop it rather than displace hotter
                # pages, so the two tiers together evict like one LRU of their total size.
                gone = self._tree.discard_device(node)
                self._free("device", gone.freed)
                self._free("host", gone.freed_host)
                self.counters.device_evictions += len(gone.freed)
                self.log.info("tree.evict_device", tokens=len(gone.freed), demoted=0,
                              removed=len(gone.removed), reason="older_than_l2")
                freed += len(gone.freed)
                continue
            await self._start_backup(node, evicting=True)
        return freed > 0

    async def _alloc_host(self, n: int) -> np.ndarray | None:
        """Host slots for n tokens, evicting L2; waits for uploads that pin the only candidates."""
        while True:
            slots = self._alloc("host", n)
            if slots is not None:
                return slots
            ev = self._tree.evict_host(n - self._slots["host"].available,  # the shortfall
                                       by_pages=self._cfg.exclusive)
            if len(ev.freed):
                self.counters.host_evictions += len(ev.freed)
                self.log.info("tree.evict_host", tokens=len(ev.freed), removed=len(ev.removed))
                self._free("host", ev.freed)
                continue
            # Wait for an upload that pins the candidates, never for one past its deadline.
            waiting = next((op for op, job in self._uploads.items() if not job.timed_out), None)
            if waiting is None:
                return None
            await self._await_upload(waiting)

    # ------------------------------------------------------------------ insert
    async def _cache_batch(self, items) -> tuple[CacheOutcome, ...]:
        self._check_rids([item.rid for item in items], "cache")
        checked = [self._check_cache(item) for item in items]  # the whole batch, before any change
        candidates: list[NodeId] = []
        try:
            return tuple([await self._cache(item, tokens, slots, candidates)
                          for item, (tokens, slots) in zip(items, checked)])
        finally:  # what was inserted is backed up at once for the whole step
            await self._start_backups(candidates)

    def _check_cache(self, item) -> tuple[object, np.ndarray]:
        """A cache_* item's mistakes, found before anything changes; returns its tokens (in
        the tree's encoding) and slots."""
        state = self._state(item.rid, "cache")
        tokens = self._check_tokens(item.tokens)
        slots = np.asarray(item.device_slots, dtype=np.int64)
        rid = item.rid
        if len(slots) != len(tokens):
            raise InvalidRequest(f"request {rid!r}: {len(tokens)} tokens but {len(slots)} device slots")
        if state.failed_load:
            raise InvalidRequest(f"request {rid!r}: a load its prefix depends on failed; "
                                 "release it (or match it again) instead of caching it")
        own = len(state.prefix_slots)
        # The prefix's KV belongs to the tokens it was matched for: caching it under other
        # tokens would serve one request's KV to another. One comparison of the prefix.
        if len(tokens) < own or not np.array_equal(np.asarray(tokens[:own]),
                                                    np.asarray(state.tokens[:own])):
            raise InvalidRequest(f"request {rid!r}: the first {own} tokens differ from the "
                                 "tokens its prefix was matched for")
        # The slots must be the request's prefix, then exactly the slots allocated to it: any
        # other slot would hand the tree pages it does not own.
        if not np.array_equal(slots[:own], state.prefix_slots):
            raise InvalidRequest(f"request {rid!r}: the first {own} device slots must be the "
                                 "prefix slots the cache gave it (match / load_back / cache_unfinished)")
        allocated = np.concatenate(state.owned) if state.owned else EMPTY_SLOTS
        if not np.array_equal(slots[own:], allocated):
            raise InvalidRequest(f"request {rid!r}: after its {own}-token prefix, the device slots "
                                 f"must be the {len(allocated)} slots allocated to it, in order; got "
                                 f"{len(slots) - own}")
        return tokens, slots

    async def _cache(self, item, tokens, slots: np.ndarray,
                     candidates: list[NodeId]) -> CacheOutcome:
        state = self._requests[item.rid]
        page = self._cfg.page_size
        aligned = len(tokens) // page * page
        own = len(state.prefix_slots)
        result = self._tree.insert(
            tokens[:aligned], slots[:aligned], now=self._now(), chunked=not item.finished
        )
        # The request's own prefix slots are the tree's; passed slots for tokens someone else
        # cached meanwhile are duplicates and go back to the ledger.
        self._free("device", slots[own:max(own, result.prefix_len)])
        new_tokens = aligned - max(own, result.prefix_len)
        candidates.extend(result.backup_candidates)  # backed up for the whole step at once
        pending: tuple = ()
        if item.finished:
            self._free("device", np.concatenate([slots[aligned:], state.padding]))
            self._relock(state, None)
            del self._requests[item.rid]
            prefix = slots[:aligned]
            if result.prefix_len > own:  # some of its slots were duplicates: the tree's own
                prefix = self._tree.match(tokens[:aligned], now=self._now()).device_slots
        else:
            again = self._tree.match(tokens[:aligned], now=self._now())
            self._relock(state, again.last_node)
            state.last_node = again.last_node
            state.prefix_slots = again.device_slots
            state.host_len = 0
            state.tokens = tokens
            state.owned = [slots[aligned:]] if len(tokens) > aligned else []
            prefix = again.device_slots
            # Tokens the tree already held may still be landing (another request's load):
            # the request must wait for those before reading its prefix.
            state.loads = self._loads_under(again.last_node)
            pending = tuple(self._loads[op].handle for op in state.loads)
        self.log.info(
            "tree.insert", rid=item.rid, tokens=aligned, new=new_tokens,
            finished=item.finished, backups=len(result.backup_candidates),
        )
        return CacheOutcome(rid=item.rid, device_slots=prefix, new_tokens=new_tokens,
                            pending=pending)

    async def _release_batch(self, rids) -> None:
        self._check_rids(rids, "release")
        for rid in rids:
            self._state(rid, "release")
        for rid in rids:
            state = self._requests.pop(rid)
            self._relock(state, None)
            self._free("device", np.concatenate([*state.owned, state.padding]))

    # ------------------------------------------------------------------ stats and close
    async def _stats(self) -> CacheStats:
        ledgers = self.ledgers()
        c = self.counters
        dev, host = ledgers["device"], ledgers["host"]
        return CacheStats(
            device=TierStats(size=dev["size"], used=dev["used"],
                             cached_tokens=self._tree.cached_tokens("device"),
                             evictable_tokens=self._tree.evictable_device_tokens(),
                             evictions=c.device_evictions, hit_tokens=c.device_hit_tokens),
            host=TierStats(size=host["size"], used=host["used"],
                           cached_tokens=self._tree.cached_tokens("host"),
                           evictable_tokens=self._tree.evictable_host_tokens(),
                           evictions=c.host_evictions, hit_tokens=c.host_hit_tokens),
            storage_hit_tokens=c.storage_hit_tokens,
            bytes={"d2h": c.d2h_bytes, "h2d": c.h2d_bytes},
            inflight={"writes": len(self._writes), "loads": len(self._loads),
                      "uploads": len(self._uploads), "prefetches": len(self._prefetches),
                      "requests": len(self._requests)},
        )

    async def _drain(self) -> tuple[dict, dict[str, int]]:
        """Release every request and free every slot the tree holds; report the ledgers and
        the bookkeeping tables (every one must be empty now)."""
        await self._release_batch(tuple(self._requests))
        freed = self._tree.clear()
        self._free("device", freed.device)
        self._free("host", freed.host)
        ledgers = await self._return_lease()
        return ledgers, self.bookkeeping()

    async def _abandon_in_flight(self) -> None:
        """Close's last resort past its deadline: end every op still in flight as if it had
        failed, so its slots go back. Its worker may still be inside a storage call; the
        kernel stops right after, and nothing reuses the slots."""
        counts = {"writes": len(self._writes), "loads": len(self._loads),
                  "uploads": len(self._uploads) + len(self._upload_backlog),
                  "prefetches": len(self._prefetches)}
        self._write_backlog.clear()
        self._upload_backlog.clear()
        for op_id in list(self._writes):
            self._arrived_writes.pop(op_id, None)
            await self._finish_write(op_id, False, "abandoned at close")
        for op_id in list(self._loads):
            self._arrived_loads.pop(op_id, None)
            await self._finish_load(op_id, False, "abandoned at close")
        self._upload_backlog.clear()  # finished writes may have queued more
        for op_id in list(self._uploads):
            self._arrived_uploads.pop(op_id, None)
            await self._finish_upload(op_id)
        for op_id, op in list(self._prefetches.items()):
            if op.state == "running":
                await self._settle_prefetch(op_id, revoked=True)
            await self._end_prefetch(op_id)
        self.counters.abandoned_ops += sum(counts.values())
        self.log.warning("tree.abandoned", **counts)
