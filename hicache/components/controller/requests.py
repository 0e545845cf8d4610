"""The controller's request table and the calls that name requests: match, load_back,
allocate, cache_* and release.

Each batch is checked whole before anything changes (a caller's mistake is a `CacheError` and
changes nothing). Answers carry the handles of the loads a request must wait for (each load's
`LoadTicket`, made when the load is decided on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from hicache.components.controller.allocation import Allocator
from hicache.components.controller.loads import LoadFlows
from hicache.components.controller.ops import Wait
from hicache.components.controller.pins import PinTable
from hicache.components.controller.rows import RequestState
from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.tiers import Tiers
from hicache.components.controller.writes import WriteFlows
from hicache.components.loader.ticket import LoadTicket
from hicache.kernels.native.addresses import flat, same_values
from hicache.kernels.native.rowcopy import native_rows
from hicache.kernels.streams.base import AllLoads
from hicache.messages import CacheItem, MatchItem
from hicache.radix.results import TreeError, concat
from hicache.radix.tree import Range
from hicache.results import (
    CacheOutcome,
    CapacityError,
    InvalidRequest,
    LoadBackOutcome,
    MatchOutcome,
    PrefetchOutcome,
    UnknownRequest,
)
from hicache.types import EMPTY_SLOTS, NodeId, OpId, RequestId


class Requests:
    def __init__(
        self,
        shared: Shared,
        tiers: Tiers,
        alloc: Allocator,
        writes: WriteFlows,
        loads: LoadFlows,
        pins: PinTable,
    ) -> None:
        self._shared = shared
        self._pins = pins
        self._tiers = tiers
        self._alloc = alloc
        self._writes = writes
        self._loads = loads
        self.table: dict[RequestId, RequestState] = {}

    # ------------------------------------------------------------------ the table
    def tables(self) -> dict[str, int]:
        return {"requests": len(self.table)}

    def get(self, rid: RequestId) -> RequestState | None:
        return self.table.get(rid)

    def state(self, rid: RequestId, action: str) -> RequestState:
        try:
            return self.table[rid]
        except KeyError:
            raise UnknownRequest(rid, action) from None

    @staticmethod
    def check_rids(rids: Iterable[Any], action: str) -> None:
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

    def check_tokens(self, tokens: Any) -> Any:
        """The tokens converted once to the tree's encoding where that is a plain uint32 array
        (so every later match or insert of them skips the conversion), else as given.
        InvalidRequest for a malformed key."""
        try:
            encoded = self._shared.tree.check_key(tokens)
        except TreeError as exc:
            raise InvalidRequest(str(exc)) from None
        return encoded if encoded.dtype == np.uint32 else tokens

    @staticmethod
    def _matched_tokens(given: Any, matched: Any) -> np.ndarray | None:
        """`matched` (the tokens as the match converted them) when `given` are the same ids
        as int64 (a cache call of a request's matched tokens): one comparison instead of a
        conversion. None otherwise."""
        native = native_rows()
        if (
            native is not None
            and flat(given, np.int64)
            and flat(matched, np.uint32)
            and matched.size == given.size
            and native.u32_same(given, matched)
        ):
            return matched
        return None

    def _relock(self, state: RequestState, node: NodeId | None) -> None:
        self._tiers.relock(node, state.lock)
        state.lock = node

    def _view(self, step: Step, state: RequestState, tokens: Any) -> None:
        """Point the request at the tree's current prefix for `tokens` (locked for it)."""
        result = self._tiers.match(step, tokens, state.salt)
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len
        state.loads = self._loads.under(result.last_node)

    def rematch(self, step: Step, state: RequestState) -> None:
        """Refresh a request's view from the tree: its prefix may have grown since its match
        (a prefetch landed, another request loaded or cached part of it)."""
        self._view(step, state, state.tokens)

    def release_all(self, step: Step) -> None:
        self.release_batch(step, tuple(self.table), reason="close")

    def prefetch_ended(self, rid: RequestId, outcome: PrefetchOutcome) -> None:
        """A prefetch of the request was skipped at its start: what a later wait or poll
        reports."""
        self.table[rid].prefetch = outcome

    def prefetch_settled(
        self, step: Step, rid: RequestId, outcome: PrefetchOutcome, *, landed: bool
    ) -> bool:
        """A prefetch of the request settled (`landed`: pages of it are in L2 now). Whether the
        request is still open. What arrived is locked for it unless it is past load_back (or
        allocated): then its prefix is fixed, and moving it would misalign what it holds."""
        state = self.table.get(rid)
        if state is None:
            return False
        state.prefetch = outcome
        if landed and not state.loaded_back and not state.owned:
            self.rematch(step, state)
        return True

    def load_failed(self, op: OpId) -> None:
        """Requests that counted on this load may not cache what they hold: their prefix slots
        were freed (their handle raised; they must release or match again)."""
        for state in self.table.values():
            if op in state.loads:
                state.failed_load = True

    # ------------------------------------------------------------------ match
    def match_batch(self, step: Step, items: Sequence[MatchItem]) -> tuple[MatchOutcome, ...]:
        self.check_rids([item.rid for item in items], "match")
        keys = [self.check_tokens(item.tokens) for item in items]  # all, before any lock moves
        outcomes = []
        for item, tokens in zip(items, keys, strict=True):
            rid = item.rid
            state = self.table.get(rid)
            if state is None:
                state = self.table[rid] = RequestState()
            state.salt = item.salt
            self._view(step, state, tokens)
            state.tokens = tokens
            state.retention = self._ranges(step, item.retention)
            if state.retention:  # the matched pages take the request's ranges now
                self._tiers.retain(step, tokens, state.retention, state.salt)
            state.failed_load = False
            state.loaded_back = False
            self._shared.counters.device_hit_tokens += len(state.prefix_slots)
            step.out.info(
                "tree.match",
                rid=rid,
                tokens=len(tokens),
                device_hit=len(state.prefix_slots),
                host_hit=state.host_len,
                salted=bool(state.salt),
            )
            outcomes.append(
                MatchOutcome(
                    rid=rid,
                    device_slots=state.prefix_slots,
                    host_len=state.host_len,
                    pending=self._loads.tickets(state.loads),
                )
            )
        return tuple(outcomes)

    def _split_pieces(self, candidates: Sequence[NodeId]) -> list[NodeId]:
        """A range or pin may have cut a backup candidate at a page boundary: its upper
        pieces (new nodes, device-only) are candidates too, root-most first."""
        tree, pieces = self._shared.tree, list[NodeId]()
        for node in candidates:
            above = []
            parent = tree.parent(node)
            while parent is not None and tree.needs_backup(parent):
                above.append(parent)
                parent = tree.parent(parent)
            pieces.extend(reversed(above))
        return pieces

    def _ranges(
        self, step: Step, retention: tuple[tuple[int, float, int, float], ...]
    ) -> tuple[Range, ...]:
        """A match's retention ranges with their ends on the cache clock."""
        now = step.now
        return tuple(
            (start, int(min(end, 2**62)), priority, now + duration)
            for start, end, priority, duration in retention
        )

    # ------------------------------------------------------------------ load back (L2 -> L1)
    def load_back_batch(
        self,
        step: Step,
        rids: Sequence[RequestId],
        done: list[LoadBackOutcome],
        threshold: int | None = None,
    ) -> Wait | None:
        """Load back each request in turn, appending to `done`; a `Wait` parks the batch,
        which goes on from where it stopped once retried. `threshold`: the batch's own
        `load_back_threshold` (None: the config's)."""
        if not done:
            self.check_rids(rids, "load_back")
            for rid in rids:
                self.state(rid, "load_back")
        for rid in rids[len(done) :]:
            state = self.state(rid, "load_back")
            loaded = 0
            if not state.failed_load:  # else: its prefix is not in L1 any more
                if state.host_len and not state.loaded_back and not state.owned:
                    # What the match saw of its L2-only stretch may be stale: another request
                    # may have loaded or cached part of it since. Take the tree's prefix now.
                    self.rematch(step, state)
                state.loaded_back = True
                planned = self._loads.plan(step, rid, state.last_node, state.host_len, threshold)
                if planned is not None:
                    grant = self._alloc.device(step, planned.tokens)
                    if grant.wait is not None:
                        return grant.wait
                    if grant.slots is None:
                        step.out.warning(
                            "tree.load_skipped", rid=rid, tokens=planned.tokens, reason="capacity"
                        )
                    else:  # its prefix grows by what lands; it waits on the load
                        got = self._loads.start(step, rid, planned, grant.slots)
                        state.loads.append(got.op)
                        state.prefix_slots = np.concatenate([state.prefix_slots, got.device_slots])
                        state.host_len = 0
                        loaded = got.tokens
            tickets = self._loads.tickets(state.loads)
            done.append(
                LoadBackOutcome(
                    rid=rid,
                    device_slots=state.prefix_slots,
                    loaded_tokens=loaded,
                    handle=None
                    if not tickets
                    else tickets[0]
                    if len(tickets) == 1
                    else AllLoads(tickets),
                )
            )
        return None

    # ------------------------------------------------------------------ allocation
    def alloc_batch(
        self, step: Step, sizes: Sequence[tuple[RequestId, int]], out: list[np.ndarray]
    ) -> Wait | None:
        """Slots for every request of the step, appended to `out`, or none (a CapacityError
        naming the first request that does not fit); a `Wait` parks the call, which is run
        again whole once retried."""
        self.check_rids([rid for rid, _ in sizes], "allocate")
        for rid, n in sizes:
            self.state(rid, "allocate")
            if n < 0:
                raise InvalidRequest(f"cannot allocate {n} tokens for {rid!r}")
        page = self._shared.cfg.page_size
        wanted = [-(-max(0, n - len(self.table[rid].padding)) // page) * page for rid, n in sizes]
        grant = self._alloc.device(step, sum(wanted))  # one allocation, evicting, for the step
        if grant.wait is not None:
            return grant.wait
        pooled = grant.slots
        if pooled is None:
            available = self._tiers.ledgers["device"].available
            total = 0
            for (rid, n), want in zip(sizes, wanted, strict=True):
                total += want
                if total > available:
                    raise CapacityError("device", n, available, rid=rid)
            raise AssertionError("the step fits, yet its allocation failed")
        offset = 0
        for (rid, n), want in zip(sizes, wanted, strict=True):
            state = self.table[rid]
            before = state.padding
            # Fill the request's partial last page first, so every page stays one device page.
            reuse = before[:n]
            rest = n - len(reuse)
            fresh = pooled[offset : offset + want] if rest else EMPTY_SLOTS
            offset += want
            # With rest > 0 the padding is used up; views of the step's (read-only) allocation
            # where nothing needs joining, not a copy per request.
            state.padding = fresh[rest:] if rest else before[n:]
            slots = fresh[:rest] if not len(reuse) else concat([reuse, fresh[:rest]])
            state.owned.append(slots)
            out.append(slots)
        return None

    # ------------------------------------------------------------------ insert
    def cache_batch(self, step: Step, items: Sequence[CacheItem]) -> tuple[CacheOutcome, ...]:
        self.check_rids([item.rid for item in items], "cache")
        checked = [self._check_cache(item) for item in items]  # the whole batch, first
        candidates: list[NodeId] = []
        outcomes = [
            self._cache(step, item, tokens, slots, candidates)
            for item, (tokens, slots) in zip(items, checked, strict=True)
        ]
        self._writes.start_backups(
            step, candidates
        )  # what was inserted, for the whole step at once
        return tuple(outcomes)

    def _check_cache(self, item: CacheItem) -> tuple[Any, np.ndarray]:
        """A cache_* item's mistakes, found before anything changes; returns its tokens (in
        the tree's encoding) and slots."""
        state = self.state(item.rid, "cache")
        tokens = self._matched_tokens(item.tokens, state.tokens)
        if tokens is None:
            tokens = self.check_tokens(item.tokens)
        slots = np.asarray(item.device_slots, dtype=np.int64)
        rid = item.rid
        if len(slots) != len(tokens):
            raise InvalidRequest(
                f"request {rid!r}: {len(tokens)} tokens but {len(slots)} device slots"
            )
        if item.salt != state.salt:
            raise InvalidRequest(
                f"request {rid!r}: cached under another salt than it was matched under"
            )
        if state.failed_load:
            raise InvalidRequest(
                f"request {rid!r}: a load its prefix depends on failed; "
                "release it (or match it again) instead of caching it"
            )
        own = len(state.prefix_slots)
        # The prefix's KV belongs to the tokens it was matched for: caching it under other
        # tokens would serve one request's KV to another. One comparison of the prefix.
        if len(tokens) < own or (
            tokens is not state.tokens
            and not same_values(np.asarray(tokens[:own]), np.asarray(state.tokens[:own]))
        ):
            raise InvalidRequest(
                f"request {rid!r}: the first {own} tokens differ from the "
                "tokens its prefix was matched for"
            )
        # The slots must be the request's prefix, then exactly the slots allocated to it: any
        # other slot would hand the tree pages it does not own.
        if not same_values(slots[:own], state.prefix_slots):
            raise InvalidRequest(
                f"request {rid!r}: the first {own} device slots must be the "
                "prefix slots the cache gave it (match / load_back / cache_unfinished)"
            )
        allocated = concat(state.owned)
        if not same_values(slots[own:], allocated):
            raise InvalidRequest(
                f"request {rid!r}: after its {own}-token prefix, the device slots "
                f"must be the {len(allocated)} slots allocated to it, in order; got "
                f"{len(slots) - own}"
            )
        # The same slots from the cache's own read-only arrays: the tree keeps them as they
        # are, where the caller's (writeable) array would be copied.
        return tokens, allocated if not own else concat([state.prefix_slots, allocated])

    def _cache(
        self, step: Step, item: CacheItem, tokens: Any, slots: np.ndarray, candidates: list[NodeId]
    ) -> CacheOutcome:
        shared = self._shared
        state = self.table[item.rid]
        aligned = len(tokens) // shared.cfg.page_size * shared.cfg.page_size
        own = len(state.prefix_slots)
        result = self._tiers.insert(
            step,
            tokens[:aligned],
            slots[:aligned],
            chunked=not item.finished,
            salt=state.salt,
            backup=item.backup,
        )
        if state.retention or self._pins.entries:
            if state.retention:
                self._tiers.retain(step, tokens[:aligned], state.retention, state.salt)
            self._pins.after_insert(step, tokens[:aligned], state.salt)
            candidates.extend(self._split_pieces(result.backup_candidates))
        # The request's own prefix slots are the tree's; passed slots for tokens someone else
        # cached meanwhile are duplicates and go back to the ledger.
        self._tiers.free(step, "device", slots[own : max(own, result.prefix_len)])
        new_tokens = aligned - max(own, result.prefix_len)
        candidates.extend(result.backup_candidates)
        pending: tuple[LoadTicket, ...] = ()
        if item.finished:
            self._tiers.free(step, "device", np.concatenate([slots[aligned:], state.padding]))
            self._relock(state, None)
            del self.table[item.rid]
            prefix = slots[:aligned]
            if result.prefix_len > own:  # some of its slots were duplicates: the tree's own
                prefix = self._tiers.match(step, tokens[:aligned], state.salt).device_slots
        else:
            self._view(step, state, tokens[:aligned])
            state.host_len = 0
            state.tokens = tokens
            state.owned = [slots[aligned:]] if len(tokens) > aligned else []
            prefix = state.prefix_slots
            # Tokens the tree already held may still be landing (another request's load):
            # the request must wait for those before reading its prefix.
            pending = self._loads.tickets(state.loads)
        step.out.info(
            "tree.insert",
            rid=item.rid,
            tokens=aligned,
            new=new_tokens,
            finished=item.finished,
            backups=len(result.backup_candidates),
        )
        return CacheOutcome(
            rid=item.rid, device_slots=prefix, new_tokens=new_tokens, pending=pending
        )

    def release_batch(self, step: Step, rids: Sequence[RequestId], reason: str = "caller") -> None:
        self.check_rids(rids, "release")
        for rid in rids:
            self.state(rid, "release")
        for rid in rids:
            state = self.table.pop(rid)
            self._relock(state, None)
            self._tiers.free(step, "device", np.concatenate([*state.owned, state.padding]))
            step.out.info("tree.release", rid=rid, reason=reason)
