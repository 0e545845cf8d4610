"""The controller's load flow (L2 -> L1): what starting and finishing a load means (its ops
are rows of the op table, `ops.py`).

A load holds its own lock on the nodes it fills (and so on their device slots) from issue
until it has landed or failed: whatever its request does meanwhile (release, match again), no
eviction can hand those slots to another request under a copy still landing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hicache.components.controller.effects import SubmitLoad
from hicache.components.controller.ops import OpTable, Wait
from hicache.components.controller.rows import LoadOp
from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.tiers import Tiers
from hicache.components.loader.ticket import LoadTicket
from hicache.radix.results import LoadPlan
from hicache.types import NodeId, OpId, RequestId


@dataclass(frozen=True, slots=True)
class LoadStarted:
    """A load-back issued for a request: the request table (`requests.py`) appends the slots
    to the request's prefix and notes the load it now waits on."""

    op: OpId
    device_slots: np.ndarray
    tokens: int


@dataclass(frozen=True, slots=True)
class LoadPlanned:
    """A load-back worth starting once it has device slots for its `plan`."""

    plan: LoadPlan
    anchor: NodeId  # the deepest node above the plan (the root if none)

    @property
    def tokens(self) -> int:
        return self.plan.num_tokens


class LoadFlows:
    def __init__(self, shared: Shared, tiers: Tiers, ops: OpTable) -> None:
        self._shared = shared
        self._tiers = tiers
        self._ops = ops  # loads in flight are rows of the op table

    def tables(self) -> dict[str, int]:
        return {
            "loads": len(self._ops.of("load")),
            "arrived_loads": self._ops.arrived_count("load"),
        }

    def in_flight(self) -> dict[str, int]:
        return {"loads": len(self._ops.of("load"))}

    def tickets(self, ops: list[OpId]) -> tuple[LoadTicket, ...]:
        """The handles of those of `ops` still in flight, for an answer to carry."""
        if not ops:
            return ()
        loads = self._ops.of("load")
        return tuple(loads[op].ticket for op in ops if op in loads)

    def oldest(self) -> Wait | None:
        """A wait for the load in flight started first (its lock is the next to go)."""
        return self._ops.oldest("load")

    def abandon(self, step: Step) -> list[OpId]:
        """End every load as failed (close past its deadline); the ops ended."""
        ops = list(self._ops.of("load"))
        for op in ops:
            self.finish(step, op, False, "abandoned at close")
        return ops

    def under(self, node: NodeId | None) -> list[OpId]:
        """The loads still landing on the path root..node (wait before reading). A load fills
        the nodes between its anchor and its lock, however a match or insert split them since
        (a split keeps the lower piece's id), so walk that stretch, not the plan's node ids."""
        loads = self._ops.of("load")
        if not loads or node is None:
            return []
        tree = self._shared.tree
        path = set()
        x: NodeId | None = node
        while x is not None:
            path.add(x)
            x = tree.parent(x)
        pending = []
        for op_id, op in loads.items():
            y: NodeId | None = op.lock
            while y is not None and y != op.anchor:
                if y in path:
                    pending.append(op_id)
                    break
                y = tree.parent(y)
        return pending

    def plan(
        self,
        step: Step,
        rid: RequestId,
        last_node: NodeId | None,
        host_len: int,
        threshold: int | None = None,
    ) -> LoadPlanned | None:
        """Whether loading the L2-only stretch of a request (`host_len` tokens down to
        `last_node`) into L1 is worth it: None when below the threshold, out of credits or
        below a load still landing. `threshold`: the caller's own in place of
        `load_back_threshold`."""
        shared, tree = self._shared, self._shared.tree
        least = shared.cfg.load_back_threshold if threshold is None else threshold
        if host_len < max(1, least) or last_node is None:
            return None
        if self._ops.credit("load") == 0:
            step.out.warning("tree.load_deferred", rid=rid, tokens=host_len)
            return None
        plan = tree.plan_load_back(last_node)
        anchor = tree.parent(plan.nodes[0])
        if self.under(anchor):
            # The pages above are still landing: if that load failed, pages loaded below them
            # would keep its nodes on L1 with KV that never arrived. The request computes the
            # rest itself (or loads it on a later match, once the load above has ended).
            step.out.warning(
                "tree.load_skipped", rid=rid, tokens=plan.num_tokens, reason="above_loading"
            )
            return None
        assert anchor is not None
        return LoadPlanned(plan, anchor)

    def start(
        self, step: Step, rid: RequestId, planned: LoadPlanned, device_slots: np.ndarray
    ) -> LoadStarted:
        """Start a planned load into the device slots allocated for it."""
        shared, plan, anchor = self._shared, planned.plan, planned.anchor
        self._tiers.start_load_back(plan, device_slots)
        op = shared.op()
        ticket = LoadTicket(op)
        step.out.add(SubmitLoad(ticket, plan.host_slots, device_slots))
        self._ops.start(
            "load", op, LoadOp(ticket=ticket, plan=plan, lock=plan.nodes[-1], anchor=anchor)
        )
        shared.counters.host_hit_tokens += plan.num_tokens
        shared.counters.h2d_bytes += plan.num_tokens * shared.bytes_per_token
        step.out.info("tree.load_started", rid=rid, op=op, tokens=plan.num_tokens)
        return LoadStarted(op, device_slots, plan.num_tokens)

    def _filled(self, op: LoadOp) -> tuple[NodeId, ...]:
        """The nodes between the load's anchor and its lock, root first."""
        tree, nodes = self._shared.tree, []
        y: NodeId | None = op.lock
        while y is not None and y != op.anchor:
            nodes.append(y)
            y = tree.parent(y)
        return tuple(reversed(nodes))

    def finish(self, step: Step, op_id: OpId, ok: bool, error: str) -> None:
        """The load landed or failed. On failure its nodes go back to L2 only (the caller marks
        the requests that counted on it)."""
        op: LoadOp = self._ops.finish("load", op_id)
        # The nodes it filled now: a match or insert may have split them since the plan (a
        # split's upper piece is a new node), and every piece must go back or give up its copy.
        filled = replace(op.plan, nodes=self._filled(op))
        freed, kept = self._tiers.finish_load_back(step, op.lock, filled, ok=ok)
        if not ok:
            step.out.error(
                "tree.load_failed",
                op=op_id,
                error=error or None,
                tokens=freed,
                kept_nodes=list(kept),
            )
