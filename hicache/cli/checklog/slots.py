"""Slot ownership re-derived from a log's `tree.slots` events, for `hicache check-log`.

The tree emits one `tree.slots` event whenever its ledgers hand slots out (`op: alloc`) or take
them back (`op: free`), with the slots as runs `[[first, end), ...]`. Replaying them gives
which slots are out at every point: a slot handed out while still out, or taken back while
not out, is the bug class that serves one request's KV to another.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.observability.events import slot_runs


class SlotOwnership:
    """Per tier: every slot now handed out, and the event (seq) that handed it out."""

    def __init__(self) -> None:
        self._out: dict[str, dict[int, int]] = {}

    def reset(self) -> None:
        self._out.clear()

    def held(self) -> dict[str, int]:
        """Slots still out, per tier (only tiers with some)."""
        return {tier: len(out) for tier, out in self._out.items() if out}

    def apply(self, e: dict[str, Any]) -> str | None:
        """Take one `tree.slots` event; the violation it shows, if any."""
        tier, op, runs = e.get("tier"), e.get("op"), e.get("slots")
        if isinstance(runs, np.ndarray):  # a captured event, not yet rendered as JSON
            runs = slot_runs(runs)
        if not isinstance(tier, str) or op not in ("alloc", "free") or not isinstance(runs, list):
            return f"tree.slots needs tier, op alloc|free and slot runs, got {tier!r} {op!r}"
        out = self._out.setdefault(tier, {})
        seq = e.get("seq", 0)
        for run in runs:
            if not (isinstance(run, list) and len(run) == 2 and 0 <= run[0] < run[1]):
                return f"tree.slots: {run!r} is not a run [first, end)"
            for slot in range(run[0], run[1]):
                if op == "alloc":
                    since = out.get(slot)
                    if since is not None:
                        return (
                            f"{tier} slot {slot} handed out twice: it is out since the "
                            f"event of seq {since} and was never taken back"
                        )
                    out[slot] = seq
                elif out.pop(slot, None) is None:
                    return f"{tier} slot {slot} taken back but it was not handed out"
        return None
