"""The controller's prefetch flow (L3 -> L2).

Owns every prefetch in flight, its credits, the tokens in flight for the rate limit, and the
reports and timer firings not applied yet. Each op moves through the phases of
`components/prefetch_state.py`: admitted (threshold, rate limit) and PROBING; WAITING_HOST for
exactly the pages storage has (an upload may pin the only evictable ones), with an L2 copy for
an anchor path that had none; READING; settled as DONE (what arrived is inserted as host-only
nodes below the anchor, the request's waiters are answered) or REVOKED (below the threshold,
no L2 room); ENDED once the prefetcher no longer touches its host slots (the rest are freed,
the credit returns). Every step after the start is taken on agreed reports, so all TP ranks
take it alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.components.controller.allocation import Allocator
from hicache.components.controller.effects import CancelTimer, StartTimer
from hicache.components.controller.ops import OpTable
from hicache.components.controller.pins import PinTable
from hicache.components.controller.requests import Requests
from hicache.components.controller.rows import PrefetchOp, RequestState
from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.storage_switch import StorageSwitch
from hicache.components.controller.tiers import Tiers
from hicache.components.controller.writes import WriteFlows
from hicache.components.prefetch_state import RUNNING, Phase, caller_state
from hicache.messages import ReadPrefetch, StartPrefetch, StopPrefetch
from hicache.radix.hashes import chain_page_hashes, salt_seed
from hicache.results import PrefetchOutcome
from hicache.types import EMPTY_SLOTS, NodeId, OpId, RequestId


@dataclass(frozen=True, slots=True)
class Admission:
    """A prefetch call's answer; `skipped`: refused at its start, an outcome the request
    table keeps for later waits and polls (`Requests.prefetch_ended`)."""

    outcome: PrefetchOutcome
    skipped: bool


class PrefetchFlows:
    def __init__(
        self,
        shared: Shared,
        tiers: Tiers,
        alloc: Allocator,
        writes: WriteFlows,
        requests: Requests,
        pins: PinTable,
        storage: StorageSwitch,
        ops: OpTable,
    ) -> None:
        self._shared = shared
        self._storage = storage
        self._pins = pins
        self._tiers = tiers
        self._alloc = alloc
        self._writes = writes
        self._requests = requests
        self._ops = ops  # prefetches in flight are rows of the op table
        self.by_rid: dict[RequestId, OpId] = {}
        self.tokens = 0  # in flight, for the rate limit
        self.host_waiting: list[OpId] = []  # probed, waiting for host room to read into

    @property
    def ops(self) -> Mapping[OpId, PrefetchOp]:
        return self._ops.of("prefetch")

    def tables(self) -> dict[str, int]:
        return {
            "prefetches": len(self.ops),
            "prefetch_by_rid": len(self.by_rid),
            "prefetch_reports": self._ops.arrived_count("prefetch"),
            "timers_fired": self._ops.fired_count(),
            "prefetch_host_waiting": len(self.host_waiting),
        }

    def in_flight(self) -> dict[str, int]:
        return {"prefetches": len(self.ops)}

    def host_freed(self, step: Step) -> None:
        """An upload has ended, which may have made host room: retry the reads that waited."""
        if self.host_waiting:
            self.retry_reads(step)

    def start(
        self,
        step: Step,
        state: RequestState,
        rid: RequestId,
        tokens: Any,
        threshold: int | None = None,
    ) -> Admission:
        """Admit and start a prefetch of `tokens` past the request's match (`state`, read
        only). `threshold`: fewest tokens worth it for this request (None: the config's)."""
        shared, tree = self._shared, self._shared.tree
        cfg = shared.cfg
        if threshold is None:
            threshold = cfg.effective_prefetch_threshold
        if not self._storage.on or rid in self.by_rid:
            return Admission(self.outcome(rid, self.by_rid.get(rid)), False)
        page = cfg.page_size
        matched = len(state.prefix_slots) + state.host_len
        end = len(tokens) // page * page
        length = end - matched
        anchor = state.last_node
        assert anchor is not None  # a matched request's deepest node (the root if none)
        reason = None
        if length < threshold:
            reason = "below_threshold"
        elif self.tokens + length > self._rate_limit() or self._ops.credit("prefetch") == 0:
            reason = "rate_limited"
        if reason is not None:
            step.out.info("tree.prefetch_skipped", rid=rid, tokens=max(length, 0), reason=reason)
            # what a later wait or poll reports too (kept by the request table)
            return Admission(PrefetchOutcome(rid=rid, state="skipped", reason=reason), True)
        if anchor == tree.root:  # nothing matched: the salt's chain starts at its seed
            prior = salt_seed(state.salt) if state.salt else None
        else:
            prior = self._writes.node_hashes(anchor)[-1]
        new_tokens = tokens[matched:end]
        hashes = tuple(chain_page_hashes(new_tokens, page, prior=prior))
        op_id = shared.op()
        timed = cfg.prefetch_policy == "timeout"
        if timed:
            step.out.add(StartTimer(op_id, cfg.prefetch_timeout(length)))
        # The anchor stays in the tree until the op settles. Without an L2 copy (it is only on
        # L1: a hot prefix under write_back or selective) it gets one if storage has enough
        # below it (`_back_up_anchor`), so what lands outlives the anchor's stay in L1.
        self._tiers.protect_host(anchor, copy_complete=False)
        self._ops.start(
            "prefetch",
            op_id,
            PrefetchOp(
                rid=rid,
                anchor=anchor,
                tokens=new_tokens,
                prefix=tokens[:end],
                hashes=hashes,
                host_slots=EMPTY_SLOTS,
                salt=state.salt,
                timer=timed,
                threshold=threshold,
            ),
        )
        self.by_rid[rid] = op_id
        self.tokens += length
        step.out.send("prefetcher", StartPrefetch(op=op_id, hashes=hashes))
        step.out.info("tree.prefetch_started", rid=rid, op=op_id, tokens=length)
        return Admission(self.outcome(rid, op_id), False)

    def _rate_limit(self) -> int:
        cfg = self._shared.cfg
        return int(cfg.prefetch_rate_fraction * (cfg.host_capacity - cfg.device_tokens))

    def outcome(self, rid: RequestId, op_id: OpId | None) -> PrefetchOutcome:
        if op_id is None:
            state = self._requests.get(rid)
            if state is not None and state.prefetch is not None:
                return state.prefetch
            return PrefetchOutcome(rid=rid, state="none")
        op = self.ops[op_id]
        page = self._shared.cfg.page_size
        return PrefetchOutcome(
            rid=rid,
            state=caller_state(op.phase),
            hit_tokens=op.hit_pages * page,
            done_tokens=op.done_pages * page,
            wanted_tokens=len(op.hashes) * page,
        )

    def poll(self, rid: RequestId) -> PrefetchOutcome:
        """Where the request's prefetch stands now."""
        return self.outcome(rid, self.by_rid.get(rid))

    def wait(self, step: Step, rid: RequestId, reply: Any, *, poll: bool) -> None:
        """Answer now if the prefetch is over; else (best_effort) stop it and take what has
        arrived, or park the reply until the policy lets it end. With `poll` (TP ranks, which
        may only change state at sync points) the current outcome is answered at once."""
        op_id = self.by_rid.get(rid)
        if op_id is None or self.ops[op_id].phase not in RUNNING:
            step.out.answer(reply, self.outcome(rid, op_id))
            return
        if self._shared.cfg.prefetch_policy == "best_effort":
            self.stop(step, op_id)  # take what has arrived; the stop report answers
        if poll:
            step.out.answer(reply, self.outcome(rid, op_id))
        else:
            self.ops[op_id].waiters.append(reply)

    def stop(self, step: Step, op_id: OpId) -> None:
        op = self.ops[op_id]
        if op.phase is not Phase.STOPPING:
            op.to(op_id, Phase.STOPPING)
            step.out.send("prefetcher", StopPrefetch(op=op_id))

    def stop_all(self, step: Step) -> int:
        """Stop every running prefetch; how many were running."""
        running = 0
        for op_id, op in self.ops.items():
            if op.phase in RUNNING:
                running += 1
                self.stop(step, op_id)
        return running

    def agreed(
        self,
        step: Step,
        op_id: OpId,
        *,
        hit: int,
        done: int,
        finished: bool,
        stopped: bool,
        timed_out: bool,
    ) -> None:
        """Take the next steps of a prefetch on values every rank agreed on: `hit` pages in
        storage (-1: not probed everywhere yet), `done` pages read everywhere, `finished`
        everywhere, `stopped` acknowledged everywhere, `timed_out` somewhere."""
        shared = self._shared
        op = self.ops[op_id]
        if op.phase in RUNNING:
            if timed_out and op.phase is not Phase.STOPPING:
                step.out.info("tree.prefetch_timeout", rid=op.rid, op=op_id)
                self.stop(step, op_id)
            op.hit_pages, op.done_pages = max(hit, 0), done
            if hit >= 0 and hit * shared.cfg.page_size < op.threshold:
                self.stop(step, op_id)  # not worth it: revoke
                self._settle(step, op_id, revoked=True)
            elif finished or stopped:  # stopped: asked for, or its storage call timed out
                self._settle(step, op_id, revoked=False)
            elif hit >= 0 and op.phase is Phase.PROBING:
                op.to(op_id, Phase.WAITING_HOST)
                self._back_up_anchor(step, op)
                self._read(step, op_id)
        if finished:
            self.finish(step, op_id)

    def _back_up_anchor(self, step: Step, op: PrefetchOp) -> None:
        """Storage holds enough below an anchor whose path is only on L1: give it the L2 copy
        write_through would have made (what is not backed up yet, root first), so that the
        pages about to hang below it are not dropped with it when L1 evicts it. Not in
        exclusive mode (L2 takes what L1 drops: the anchor gets its copy when it leaves L1).
        The prefetch does not wait for it: until the copy lands, L1 eviction backs the anchor
        up first or removes it with what hangs below, as for any page (`evict_device`)."""
        shared, tree = self._shared, self._shared.tree
        if shared.cfg.exclusive or op.hit_pages <= 0:
            return
        path = []
        node: NodeId | None = op.anchor
        while node is not None and not tree.is_root(node):
            if tree.needs_backup(node):
                path.append(node)
            node = tree.parent(node)
        if path:
            tokens = sum(tree.num_tokens(n) for n in path)
            shared.counters.anchor_backups += len(path)
            step.out.info("tree.anchor_backup", rid=op.rid, nodes=len(path), tokens=tokens)
            self._writes.start_backups(step, reversed(path))

    def retry_reads(self, step: Step) -> None:
        """Probed ops that waited for host room: try again (an upload has ended)."""
        waiting, self.host_waiting = self.host_waiting, []
        for op_id in waiting:
            if op_id in self.ops:
                self._read(step, op_id)

    def _read(self, step: Step, op_id: OpId) -> None:
        """After the probe: host slots for exactly the pages storage has, then the reads."""
        shared = self._shared
        op = self.ops[op_id]
        if op.phase is not Phase.WAITING_HOST:
            return
        grant = self._alloc.host(step, op.hit_pages * shared.cfg.page_size)
        if grant.wait is not None:
            self.host_waiting.append(op_id)
            return
        host = grant.slots
        if host is None:
            step.out.info(
                "tree.prefetch_skipped",
                rid=op.rid,
                reason="host_full",
                tokens=op.hit_pages * shared.cfg.page_size,
            )
            self.stop(step, op_id)
            self._settle(step, op_id, revoked=True)
            return
        op.host_slots = host
        op.to(op_id, Phase.READING)
        step.out.send("prefetcher", ReadPrefetch(op=op_id, host_slots=host))

    def _settle(self, step: Step, op_id: OpId, *, revoked: bool) -> None:
        """Hand the request what has arrived: insert it as host-only nodes below the anchor,
        answer the waiters. The slots of those pages become the tree's; the rest stay the op's
        until it ends."""
        shared = self._shared
        op = self.ops[op_id]
        page = shared.cfg.page_size
        done = 0 if revoked else min(op.done_pages, len(op.host_slots) // page)
        op.done_pages = done
        used_tokens = done * page
        if done:
            self._tiers.insert_host(
                step,
                op.anchor,
                op.tokens[:used_tokens],
                op.host_slots[:used_tokens],
                op.hashes[:done],
                op.salt,
            )
            self._pins.after_insert(step, op.prefix, op.salt)  # pins hold for pages back from L3
        self._tiers.release_host(op.anchor)
        op.to(op_id, Phase.REVOKED if revoked else Phase.DONE)
        step.out.info(
            "tree.prefetch_done",
            rid=op.rid,
            op=op_id,
            state=caller_state(op.phase),
            hit=op.hit_pages * page,
            read=used_tokens,
        )
        outcome = self.outcome(op.rid, op_id)
        open_ = self._requests.prefetch_settled(step, op.rid, outcome, landed=bool(done))
        if open_ and done:
            shared.counters.storage_hit_tokens += used_tokens
        for reply in op.waiters:
            step.out.answer(reply, outcome)
        op.waiters.clear()
        del self.by_rid[op.rid]

    def finish(self, step: Step, op_id: OpId) -> None:
        """The prefetcher is done with the op: free the slots the tree did not take."""
        op: PrefetchOp = self._ops.finish("prefetch", op_id)
        op.to(op_id, Phase.ENDED)
        if op_id in self.host_waiting:
            self.host_waiting.remove(op_id)
        if op.timer:
            step.out.add(CancelTimer(op_id))
        page = self._shared.cfg.page_size
        self._tiers.free(step, "host", op.host_slots[op.done_pages * page :])
        self.tokens -= len(op.hashes) * page

    def abandon(self, step: Step) -> int:
        """End every prefetch (close past its deadline); how many."""
        ops = list(self.ops.items())
        for op_id, op in ops:
            if op.phase in RUNNING:
                self._settle(step, op_id, revoked=True)
            self.finish(step, op_id)
        return len(ops)
