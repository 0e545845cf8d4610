"""The tree actor: the one owner of the radix tree, the per-request table and the tier policy.

It turns frontend requests into core calls and the core's results into commands for the
allocator (request/response: a leaf), the writer and loader (commands bounded by credits,
completions back as fire-and-forget messages), and events. Nothing it owns is shared.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from typing_extensions import assert_never

from hicache.backends.keys import chain_page_hashes
from hicache.components.tree.core import RadixTree
from hicache.config import CacheConfig
from hicache.messages import (
    Alloc, AllocBatch, Backup, CacheBatch, ClearStorage, Drain, DumpTree, Flush, Free, GetStats,
    LedgerStats, Load, LoadBackBatch, LoadDone, MatchBatch, PrefetchBatch, PrefetchPoll,
    PrefetchProgress, PrefetchWait, ReadPrefetch, ReleaseBatch, StartPrefetch, StopPrefetch,
    TimerFired,
    TreeInbox, Upload, UploadDone, WriteDone,
)
from hicache.results import (
    CacheError,
    CacheOutcome, CacheStats, CapacityError, LoadBackOutcome, MatchOutcome, PrefetchOutcome,
    TierStats, UnknownRequest,
)
from hicache.runtime import Actor, Mailbox
from hicache.types import NodeId, OpId, RequestId

EMPTY = np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class RequestState:
    """What the tree knows of one running request. Owned by the tree actor."""

    lock: NodeId | None = None  # the node whose path is locked for this request
    last_node: NodeId | None = None  # deepest matched node (device or host)
    prefix_slots: np.ndarray = field(default_factory=lambda: EMPTY)  # tree slots it reads
    host_len: int = 0  # L2-only tokens after prefix_slots, as of the last match
    owned: list[np.ndarray] = field(default_factory=list)  # slots allocated, not yet in the tree
    padding: np.ndarray = field(default_factory=lambda: EMPTY)  # rest of its last page, unused
    tokens: object = None  # the tokens of the last match, for re-matching after a prefetch
    prefetch: object = None  # the last prefetch's outcome once it ended


@dataclass(slots=True)
class WriteOp:
    node: NodeId
    host_slots: np.ndarray
    done: object  # Reply[bool] the writer answers; an eviction may wait on it


@dataclass(slots=True)
class LoadOp:
    plan: object  # the core's LoadPlan
    handle: object


@dataclass(slots=True)
class PrefetchOp:
    rid: RequestId
    anchor: NodeId  # deepest matched node with a host copy; new nodes go below it
    tokens: object  # the page-aligned tokens to fetch, after the anchor
    hashes: tuple
    host_slots: np.ndarray
    deadline: float | None
    hit_pages: int = -1  # unknown until the prefetcher's probe reports
    done_pages: int = 0
    stopping: bool = False
    state: str = "running"  # running | done | revoked
    waiters: list = field(default_factory=list)


@dataclass(slots=True)
class UploadOp:
    node: NodeId
    pages: int
    done: object  # Reply[int] the uploader answers; a host allocation may wait on it


@dataclass(slots=True)
class Counters:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    skipped_loads: int = 0


class TreeActor(Actor[TreeInbox]):
    def __init__(
        self,
        *,
        config: CacheConfig,
        tree: RadixTree,
        allocator: Mailbox,
        bytes_per_token: int,
        topology,
    ) -> None:
        super().__init__("tree", capacity=topology.capacity, reserve=topology.tree_reserve)
        write_credits = load_credits = topology.credits
        self._cfg = config
        self._tree = tree
        self._allocator = allocator
        self._writer: Mailbox | None = None  # set by connect()
        self._loader: Mailbox | None = None
        self._bpt = bytes_per_token
        self._requests: dict[RequestId, RequestState] = {}
        self._writes: dict[OpId, WriteOp] = {}
        self._write_credits = write_credits
        self._write_backlog: deque[NodeId] = deque()
        self._loads: dict[OpId, LoadOp] = {}
        self._load_credits = load_credits
        self._uploader: Mailbox | None = None
        self._prefetcher: Mailbox | None = None
        self._namespace = None
        self._uploads: dict[OpId, UploadOp] = {}
        self._upload_backlog: deque[tuple[NodeId, ...]] = deque()  # waiting for a credit
        self._upload_credits = write_credits
        self._prefetches: dict[OpId, PrefetchOp] = {}
        self._prefetch_by_rid: dict[RequestId, OpId] = {}
        self._prefetch_credits = load_credits
        self._prefetch_tokens = 0  # in flight, for the rate limit
        self._clear_storage = None  # the backend's clear, when storage is on
        self._flush_waiters: list = []  # answered when no write is pending
        self._drain_waiters: list = []  # answered when nothing at all is in flight
        self._next_op = 0
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
        await self._dispatch(msg)
        await self._settle()

    async def _dispatch(self, msg: TreeInbox) -> None:
        match msg:
            case MatchBatch(items=items, reply=reply):
                reply.set(tuple(self._match(item.rid, item.tokens) for item in items))
            case LoadBackBatch(rids=rids, reply=reply):
                await self._answer(reply, self._load_back_batch(rids))
            case AllocBatch(sizes=sizes, reply=reply):
                await self._answer(reply, self._alloc_batch(sizes))
            case CacheBatch(items=items, reply=reply):
                await self._answer(reply, self._cache_batch(items))
            case ReleaseBatch(rids=rids, reply=reply):
                await self._answer(reply, self._release_batch(rids))
            case Flush(reply=reply):
                if self._writes_pending():
                    self._flush_waiters.append(reply)
                else:
                    reply.set(None)
            case GetStats(reply=reply):
                await self._answer(reply, self._stats())
            case DumpTree(reply=reply):
                reply.set(self._tree.dump())
            case Drain(reply=reply):
                self._drain_waiters.append(reply)
                for op_id, op in list(self._prefetches.items()):
                    if op.state == "running":
                        self._stop_prefetch(op_id)
            case WriteDone():
                await self._write_done(msg)
            case LoadDone():
                await self._load_done(msg)
            case PrefetchBatch(items=items, reply=reply):
                await self._answer(reply, self._prefetch_batch(items))
            case PrefetchWait(rid=rid, reply=reply):
                self._prefetch_wait(rid, reply)
            case PrefetchPoll(rid=rid, reply=reply):
                reply.set(self._prefetch_outcome(rid, self._prefetch_by_rid.get(rid)))
            case ClearStorage(reply=reply):
                if self._clear_storage is None:
                    reply.set(False)
                else:
                    await self._clear_storage()
                    self.log.info("tree.storage_cleared")
                    reply.set(True)
            case UploadDone(op=op):
                if op in self._uploads:
                    self._finish_upload(op)
                await self._drain_upload_backlog()
            case PrefetchProgress():
                await self._prefetch_progress(msg)
            case TimerFired(op=op):
                await self._prefetch_timer(op)
            case _:
                assert_never(msg)

    @staticmethod
    async def _answer(reply, coro) -> None:
        """Run a request's work and answer it; a caller's mistake fails only that request."""
        try:
            value = await coro
        except (CacheError, ValueError, LookupError) as exc:  # the caller's, typed
            reply.fail(exc)
        else:
            reply.set(value)

    def _op(self) -> OpId:
        self._next_op += 1
        return OpId(self._next_op)

    def _now(self) -> float:
        return self.kernel.now()

    # ------------------------------------------------------------------ match
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
        self.counters.device_hit_tokens += len(result.device_slots)
        pending = tuple(op.handle for op in self._loads.values()) if self._loads else ()
        self.log.info(
            "tree.match", rid=rid, tokens=len(tokens), device_hit=len(result.device_slots),
            host_hit=result.host_len,
        )
        return MatchOutcome(
            rid=rid, device_slots=result.device_slots, host_len=result.host_len, pending=pending
        )

    def _rematch(self, state: RequestState) -> None:
        """Refresh a request's view after its prefix grew in the tree (a prefetch landed)."""
        result = self._tree.match(state.tokens, now=self._now())
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len

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
        return tuple([await self._load_back(rid) for rid in rids])

    async def _load_back(self, rid: RequestId) -> LoadBackOutcome:
        state = self._state(rid, "load_back")
        if state.host_len < max(1, self._cfg.load_back_threshold) or state.last_node is None:
            return LoadBackOutcome(rid=rid, device_slots=state.prefix_slots, loaded_tokens=0)
        if self._load_credits == 0:
            self.counters.skipped_loads += 1
            self.log.warning("tree.load_deferred", rid=rid, tokens=state.host_len)
            return LoadBackOutcome(rid=rid, device_slots=state.prefix_slots, loaded_tokens=0)
        plan = self._tree.plan_load_back(state.last_node)
        device_slots = await self._alloc_device(plan.num_tokens)
        if device_slots is None:
            self.log.warning("tree.load_skipped", rid=rid, tokens=plan.num_tokens, reason="capacity")
            return LoadBackOutcome(rid=rid, device_slots=state.prefix_slots, loaded_tokens=0)
        self._tree.commit_load_back(plan, device_slots)
        op = self._op()
        self._load_credits -= 1
        handle = await self.kernel.request(
            self._loader,
            lambda reply: Load(op=op, host_slots=plan.host_slots, device_slots=device_slots,
                               reply=reply),
        )
        self._loads[op] = LoadOp(plan=plan, handle=handle)
        state.prefix_slots = np.concatenate([state.prefix_slots, device_slots])
        state.host_len = 0
        self.counters.host_hit_tokens += plan.num_tokens
        self.counters.h2d_bytes += plan.num_tokens * self._bpt
        self.log.info("tree.load_started", rid=rid, op=op, tokens=plan.num_tokens)
        return LoadBackOutcome(
            rid=rid, device_slots=state.prefix_slots, loaded_tokens=plan.num_tokens, handle=handle
        )

    async def _load_done(self, msg: LoadDone) -> None:
        op = self._loads.pop(msg.op)
        self._load_credits += 1
        if not msg.ok:
            freed, kept = self._tree.revert_load_back(op.plan)
            await self._free("device", freed)
            self.log.error("tree.load_failed", op=msg.op, error=msg.error, tokens=len(freed),
                           kept_nodes=list(kept))
        elif self._cfg.exclusive:
            freed = self._tree.drop_host(op.plan)
            await self._free("host", freed)

    # ------------------------------------------------------------------ allocation
    async def _alloc_batch(self, sizes) -> tuple[np.ndarray, ...]:
        out = []
        page = self._cfg.page_size
        for rid, n in sizes:
            state = self._state(rid, "allocate")
            if n < 0:
                raise ValueError(f"cannot allocate {n} tokens for {rid!r}")
            # Fill the request's partial last page first, so every page stays one device page.
            reuse, state.padding = state.padding[:n], state.padding[n:]
            rest = n - len(reuse)
            fresh = EMPTY
            if rest:
                fresh = await self._alloc_device(-(-rest // page) * page)
                if fresh is None:
                    state.padding = np.concatenate([reuse, state.padding])
                    ledger = await self.kernel.request(self._allocator,
                                                       lambda r: LedgerStats(reply=r))
                    raise CapacityError("device", n, ledger["device"]["available"])
                state.padding = fresh[rest:]
            slots = np.concatenate([reuse, fresh[:rest]])
            state.owned.append(slots)
            out.append(slots)
        return tuple(out)

    async def _alloc(self, tier: str, n: int) -> np.ndarray | None:
        return await self.kernel.request(
            self._allocator, lambda reply: Alloc(tier=tier, num_tokens=n, reply=reply)
        )

    async def _free(self, tier: str, slots: np.ndarray) -> None:
        if len(slots):
            await self._allocator.send(Free(tier=tier, slots=slots))

    async def _alloc_device(self, n: int) -> np.ndarray | None:
        """Device slots for n tokens: evict L1 (backing up first where the policy says so),
        and while backups in flight pin the only evictable pages, wait for them. None when
        everything left is locked by running requests."""
        if n == 0:
            return EMPTY
        while True:
            slots = await self._alloc("device", n)
            if slots is not None:
                return slots
            if await self._evict_device(n):
                continue
            if not self._writes:
                return None
            await self._await_write(next(iter(self._writes)))

    async def _evict_device(self, n: int) -> bool:
        """Evict about n tokens from L1; start the backups the policy wants first. Returns
        whether any device slot was freed."""
        ev = self._tree.evict_device(n, now=self._now(), require_host_copy=self._cfg.exclusive)
        await self._free("device", ev.freed)
        await self._free("host", ev.freed_host)
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
                await self._free("device", gone.freed)
                await self._free("host", gone.freed_host)
                self.counters.device_evictions += len(gone.freed)
                freed += len(gone.freed)
                continue
            await self._start_backup(node, evicting=True)
        return freed > 0

    async def _alloc_host(self, n: int) -> np.ndarray | None:
        """Host slots for n tokens, evicting L2; waits for uploads that pin the only candidates."""
        while True:
            slots = await self._alloc("host", n)
            if slots is not None:
                return slots
            ev = self._tree.evict_host(n)
            if len(ev.freed):
                self.counters.host_evictions += len(ev.freed)
                self.log.info("tree.evict_host", tokens=len(ev.freed), removed=len(ev.removed))
                await self._free("host", ev.freed)
                continue
            if not self._uploads:
                return None
            await self._await_upload(next(iter(self._uploads)))

    # ------------------------------------------------------------------ insert
    async def _cache_batch(self, items) -> tuple[CacheOutcome, ...]:
        return tuple([await self._cache(item) for item in items])

    async def _cache(self, item) -> CacheOutcome:
        state = self._state(item.rid, "cache")
        tokens, slots = item.tokens, np.asarray(item.device_slots, dtype=np.int64)
        if len(slots) != len(tokens):
            raise ValueError(
                f"request {item.rid!r}: {len(tokens)} tokens but {len(slots)} device slots"
            )
        page = self._cfg.page_size
        aligned = len(tokens) // page * page
        own = len(state.prefix_slots)
        result = self._tree.insert(
            tokens[:aligned], slots[:aligned], now=self._now(), chunked=not item.finished
        )
        # The request's own prefix slots are the tree's; passed slots for tokens someone else
        # cached meanwhile are duplicates and go back to the ledger.
        await self._free("device", slots[own:max(own, result.prefix_len)])
        new_tokens = aligned - max(own, result.prefix_len)
        for node in result.backup_candidates:
            await self._schedule_backup(node)
        if item.finished:
            await self._free("device", np.concatenate([slots[aligned:], state.padding]))
            self._relock(state, None)
            del self._requests[item.rid]
            prefix = slots[:aligned]
        else:
            again = self._tree.match(tokens[:aligned], now=self._now())
            self._relock(state, again.last_node)
            state.last_node = again.last_node
            state.prefix_slots = again.device_slots
            state.host_len = 0
            state.owned = [slots[aligned:]] if len(tokens) > aligned else []
            prefix = again.device_slots
        self.log.info(
            "tree.insert", rid=item.rid, tokens=aligned, new=new_tokens,
            finished=item.finished, backups=len(result.backup_candidates),
        )
        return CacheOutcome(rid=item.rid, device_slots=prefix, new_tokens=new_tokens)

    async def _release_batch(self, rids) -> None:
        for rid in rids:
            state = self._state(rid, "release")
            self._relock(state, None)
            await self._free("device", np.concatenate([*state.owned, state.padding]))
            del self._requests[rid]

    # ------------------------------------------------------------------ backups (L1 -> L2)
    async def _schedule_backup(self, node: NodeId) -> None:
        await self._start_backup(node, evicting=False)

    async def _start_backup(self, node: NodeId, *, evicting: bool) -> bool:
        """Copy a device-only node to L2. Write-through backups queue for a credit; an eviction
        waits for the oldest write instead (it cannot go on without the copy)."""
        while self._write_credits == 0:
            if not evicting:
                self._write_backlog.append(node)
                return False
            await self._await_write(next(iter(self._writes)))
        if not self._tree.needs_backup(node):
            return False
        length = self._tree.device_len(node)
        host = await self._alloc_host(length)
        if host is None or not self._tree.needs_backup(node):
            await self._free("host", EMPTY if host is None else host)
            self.log.warning("tree.backup_skipped", node=node, tokens=length, reason="host full")
            return False
        self._tree.begin_backup(node, host)
        op = self._op()
        self._write_credits -= 1
        done = self.kernel.reply()
        self._writes[op] = WriteOp(node=node, host_slots=host, done=done)
        await self._writer.send(Backup(op=op, device_slots=self._tree.device_slots(node),
                                       host_slots=host, reply=done))
        self.counters.d2h_bytes += length * self._bpt
        return True

    async def _await_write(self, op_id: OpId) -> None:
        ok = await self._writes[op_id].done.wait()
        if op_id in self._writes:
            await self._finish_write(op_id, ok, "")

    async def _write_done(self, msg: WriteDone) -> None:
        if msg.op in self._writes:  # else already finished by a waiting eviction
            await self._finish_write(msg.op, msg.ok, msg.error)

    async def _finish_write(self, op_id: OpId, ok: bool, error: str) -> None:
        op = self._writes.pop(op_id)
        self._write_credits += 1
        pieces = self._tree.backup_pieces(op.node)  # the node may have been split meanwhile
        freed = self._tree.end_backup(op.node, ok=ok)
        await self._free("host", freed)
        if not ok:
            self.log.error("tree.backup_failed", op=op_id, node=op.node, error=error or None)
        elif self._uploader is not None:
            await self._upload(pieces)
        while self._write_backlog and self._write_credits:
            await self._start_backup(self._write_backlog.popleft(), evicting=False)

    async def _settle(self) -> None:
        """Answer flushes once no write is pending, and drains once nothing is in flight."""
        if not self._writes_pending():
            for reply in self._flush_waiters:
                reply.set(None)
            self._flush_waiters.clear()
        if (self._drain_waiters and not self._writes_pending() and not self._loads
                and not self._prefetches):
            waiters, self._drain_waiters = self._drain_waiters, []
            report = await self._drain()
            for reply in waiters:
                reply.set(report)

    def _writes_pending(self) -> bool:
        return bool(self._writes or self._write_backlog or self._uploads or self._upload_backlog)

    # ------------------------------------------------------------------ upload (L2 -> L3)
    async def _upload(self, pieces: tuple[NodeId, ...]) -> None:
        """Send a freshly backed-up node's pages (all its split pieces, root first) to storage;
        their host pages stay protected until the upload is done."""
        if self._namespace is not None and not self._namespace.writes:
            return  # MLA on a rank other than 0: rank 0 writes the shared keys
        node = pieces[-1]  # the deepest: protecting it protects the path above it
        if not self._tree.has_host_copy(node):
            return
        if self._upload_credits == 0:
            self._upload_backlog.append(pieces)
            return
        hashes = [h for p in pieces for h in self._node_hashes(p)]
        host_slots = np.concatenate([self._tree.host_slots(p) for p in pieces])
        op = self._op()
        self._upload_credits -= 1
        self._tree.protect_host(node)
        done = self.kernel.reply()
        self._uploads[op] = UploadOp(node=node, pages=len(hashes), done=done)
        await self._uploader.send(Upload(op=op, hashes=tuple(hashes), host_slots=host_slots,
                                         reply=done))

    async def _await_upload(self, op_id: OpId) -> None:
        await self._uploads[op_id].done.wait()
        if op_id in self._uploads:
            self._finish_upload(op_id)

    def _finish_upload(self, op_id: OpId) -> None:
        job = self._uploads.pop(op_id)
        self._upload_credits += 1
        self._tree.release_host(job.node)

    async def _drain_upload_backlog(self) -> None:
        while self._upload_backlog and self._upload_credits:
            pieces = self._upload_backlog.popleft()
            if all(self._tree.state(p).name in ("BOTH", "HOST_ONLY") for p in pieces):
                await self._upload(pieces)

    def _node_hashes(self, node: NodeId) -> list:
        """The node's chained page hashes, computed on first use from its parent's last one."""
        hashes = self._tree.page_hashes(node)
        if hashes is None:
            parent = self._tree.parent(node)
            prior = None if parent == self._tree.root else self._node_hashes(parent)[-1]
            hashes = chain_page_hashes(self._tree.key(node), self._cfg.page_size, prior=prior)
            self._tree.set_page_hashes(node, hashes)
        return list(hashes)

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    async def _prefetch_batch(self, items) -> tuple[PrefetchOutcome, ...]:
        return tuple([await self._start_prefetch(item.rid, item.tokens) for item in items])

    async def _start_prefetch(self, rid: RequestId, tokens) -> PrefetchOutcome:
        state = self._state(rid, "prefetch")
        if not self.storage_on or rid in self._prefetch_by_rid:
            return self._prefetch_outcome(rid, self._prefetch_by_rid.get(rid))
        page = self._cfg.page_size
        matched = len(state.prefix_slots) + state.host_len
        end = len(tokens) // page * page
        length = end - matched
        anchor = state.last_node
        reason = None
        if anchor is None or not self._tree.has_host_copy(anchor):
            reason = "anchor_without_host_copy"
        elif length < self._cfg.effective_prefetch_threshold:
            reason = "below_threshold"
        elif self._prefetch_tokens + length > self._rate_limit() or self._prefetch_credits == 0:
            reason = "rate_limited"
        if reason is not None:
            self.log.info("tree.prefetch_skipped", rid=rid, tokens=max(length, 0), reason=reason)
            state.prefetch = PrefetchOutcome(rid=rid, state="skipped", reason=reason)
            return state.prefetch  # what a later wait or poll reports too
        prior = None if anchor == self._tree.root else self._node_hashes(anchor)[-1]
        new_tokens = tokens[matched:end]
        hashes = tuple(chain_page_hashes(new_tokens, page, prior=prior))
        op_id = self._op()
        deadline = None
        if self._cfg.prefetch_policy == "timeout":
            deadline = self._now() + self._cfg.prefetch_timeout(length)
            deliver = self.inbox.send_nowait  # a reserved slot per op: never blocks
            self.kernel.call_later(self._cfg.prefetch_timeout(length),
                                   lambda op=op_id: deliver(TimerFired(op=op)))
        self._tree.protect_host(anchor)
        op = PrefetchOp(rid=rid, anchor=anchor, tokens=new_tokens, hashes=hashes,
                        host_slots=EMPTY, deadline=deadline)
        self._prefetches[op_id] = op
        self._prefetch_by_rid[rid] = op_id
        self._prefetch_credits -= 1
        self._prefetch_tokens += length
        await self._prefetcher.send(StartPrefetch(op=op_id, hashes=hashes))
        self.log.info("tree.prefetch_started", rid=rid, op=op_id, tokens=length)
        return self._prefetch_outcome(rid, op_id)

    def _rate_limit(self) -> int:
        spare = self._cfg.host_capacity - self._cfg.device_tokens
        return int(self._cfg.prefetch_rate_fraction * spare)

    def _prefetch_outcome(self, rid: RequestId, op_id: OpId | None) -> PrefetchOutcome:
        if op_id is None:
            state = self._requests.get(rid)
            if state is not None and state.prefetch is not None:
                return state.prefetch
            return PrefetchOutcome(rid=rid, state="none")
        op = self._prefetches[op_id]
        page = self._cfg.page_size
        return PrefetchOutcome(
            rid=rid, state=op.state, hit_tokens=max(op.hit_pages, 0) * page,
            done_tokens=op.done_pages * page, wanted_tokens=len(op.hashes) * page,
        )

    def _prefetch_wait(self, rid: RequestId, reply) -> None:
        op_id = self._prefetch_by_rid.get(rid)
        if op_id is None or self._prefetches[op_id].state != "running":
            reply.set(self._prefetch_outcome(rid, op_id))
            return
        op = self._prefetches[op_id]
        op.waiters.append(reply)
        if self._cfg.prefetch_policy == "best_effort":
            self._stop_prefetch(op_id)  # take what has arrived; the end report answers

    def _stop_prefetch(self, op_id: OpId) -> None:
        op = self._prefetches[op_id]
        if not op.stopping:
            op.stopping = True
            self._prefetcher.send_nowait(StopPrefetch(op=op_id))

    async def _prefetch_timer(self, op_id: OpId) -> None:
        op = self._prefetches.get(op_id)
        if op is not None and op.state == "running":
            self.log.info("tree.prefetch_timeout", rid=op.rid, op=op_id)
            self._stop_prefetch(op_id)

    async def _prefetch_progress(self, msg: PrefetchProgress) -> None:
        """A report from the prefetcher: after the probe, when stopped, at the end. The request's
        part ends (settles) at the first report that may end it by the policy; the op itself
        ends at the end report, once no I/O writes into its host slots any more."""
        op = self._prefetches[msg.op]
        if op.state == "running":
            probed = op.hit_pages < 0 <= msg.hit_pages
            op.hit_pages, op.done_pages = msg.hit_pages, msg.done_pages
            known = msg.hit_pages >= 0
            if known and msg.hit_pages * self._cfg.page_size < self._cfg.effective_prefetch_threshold:
                self._stop_prefetch(msg.op)  # not worth it: revoke
                await self._settle_prefetch(msg.op, revoked=True)
            elif msg.finished or op.stopping:
                await self._settle_prefetch(msg.op, revoked=False)
            elif probed:
                await self._read_prefetch(msg.op)
        if msg.finished:
            await self._end_prefetch(msg.op)

    async def _read_prefetch(self, op_id: OpId) -> None:
        """After the probe: host slots for exactly the pages storage has, then the reads."""
        op = self._prefetches[op_id]
        host = await self._alloc_host(op.hit_pages * self._cfg.page_size)
        if host is None or op.state != "running" or op.stopping:
            await self._free("host", EMPTY if host is None else host)
            if op.state == "running":
                self.log.info("tree.prefetch_skipped", rid=op.rid, reason="host_full",
                              tokens=op.hit_pages * self._cfg.page_size)
                self._stop_prefetch(op_id)
                await self._settle_prefetch(op_id, revoked=True)
            return
        op.host_slots = host
        await self._prefetcher.send(ReadPrefetch(op=op_id, host_slots=host))

    async def _settle_prefetch(self, op_id: OpId, *, revoked: bool) -> None:
        """Hand the request what has arrived: insert it as host-only nodes below the anchor,
        answer the waiters. The slots of those pages become the tree's; the rest stay the op's
        until its end report."""
        op = self._prefetches[op_id]
        page = self._cfg.page_size
        done = 0 if revoked else op.done_pages
        op.done_pages = done
        used_tokens = done * page
        if done:
            inserted = self._tree.insert_host(
                op.anchor, op.tokens[:used_tokens], op.host_slots[:used_tokens],
                op.hashes[:done], now=self._now(),
            )
            await self._free("host", inserted.duplicate_slots)
        self._tree.release_host(op.anchor)
        op.state = "revoked" if revoked else "done"
        self.log.info("tree.prefetch_done", rid=op.rid, op=op_id, state=op.state,
                      hit=max(op.hit_pages, 0) * page, read=used_tokens)
        outcome = self._prefetch_outcome(op.rid, op_id)
        state = self._requests.get(op.rid)
        if state is not None:
            state.prefetch = outcome
            if done:
                self.counters.storage_hit_tokens += used_tokens
                self._rematch(state)
        for reply in op.waiters:
            reply.set(outcome)
        op.waiters.clear()
        del self._prefetch_by_rid[op.rid]

    async def _end_prefetch(self, op_id: OpId) -> None:
        """The prefetcher is done with the op: free the slots the tree did not take."""
        op = self._prefetches.pop(op_id)
        page = self._cfg.page_size
        await self._free("host", op.host_slots[op.done_pages * page:])
        self._prefetch_tokens -= len(op.hashes) * page
        self._prefetch_credits += 1

    # ------------------------------------------------------------------ stats and close
    async def _stats(self) -> CacheStats:
        ledgers = await self.kernel.request(self._allocator, lambda r: LedgerStats(reply=r))
        c = self.counters
        dev, host = ledgers["device"], ledgers["host"]
        return CacheStats(
            device=TierStats(size=dev["size"], used=dev["used"],
                             cached_tokens=self._tree.cached_tokens("device"),
                             evictions=c.device_evictions, hit_tokens=c.device_hit_tokens),
            host=TierStats(size=host["size"], used=host["used"],
                           cached_tokens=self._tree.cached_tokens("host"),
                           evictions=c.host_evictions, hit_tokens=c.host_hit_tokens),
            storage_hit_tokens=c.storage_hit_tokens,
            bytes={"d2h": c.d2h_bytes, "h2d": c.h2d_bytes},
            inflight={"writes": len(self._writes), "loads": len(self._loads),
                      "requests": len(self._requests)},
        )

    async def _drain(self) -> dict:
        """Release every request and free every slot the tree holds; report the ledgers."""
        await self._release_batch(tuple(self._requests))
        freed = self._tree.clear()
        await self._free("device", freed.device)
        await self._free("host", freed.host)
        return await self.kernel.request(self._allocator, lambda r: LedgerStats(reply=r))
