"""`hicache check-log`'s checks of runs, requests and L1 (the reading is `read.py`;
the ops, `ops.py`):

- runs: a `kernel.started` opens a run and its `kernel.stopped` closes it, with reason
  `exit`; every actor it started reports `actor.stopped` once, before it, having handled
  every message delivered to it;
- requests: a `tree.insert`, a load-back or prefetch (started or skipped) follows a
  `tree.match` of its request (since its last finished insert);
- locks: every matched request ends (a finished `tree.insert` or a `tree.release`, the
  drain's included) once, and none is open at `cache.closed`;
- slots: from `tree.slots` (written whenever the log records), no slot of either tier is
  handed out while it is still out, none is taken back that is not out, and none is still
  out at `cache.closed` (`hicache/cli/checklog/slots.py`);
- L1: the device tokens the tree holds, re-derived (inserted `new` + loaded - evicted - freed
  by failed loads), never go below 0 or below a match's device hit, and with
  `--device-tokens N` (the L1 size the log was written with) never above N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache.cli.checklog.read import LogReader, Report, rid_of
from hicache.cli.checklog.slots import SlotOwnership

__all__ = ["RunChecks"]


@dataclass
class _Run:
    actors: list[str]
    stopped: set[str] = field(default_factory=set)


class RunChecks(LogReader):
    """Runs, requests and their locks, slots and L1, checked as the events come."""

    def __init__(self, *, device_tokens: int | None = None) -> None:
        self.device_capacity = device_tokens
        self._run: _Run | None = None
        super().__init__()

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        self._open_matches: dict[object, int] = {}  # rid -> L2 tokens it may still load
        self._device = 0  # tokens the tree holds in L1, re-derived
        self._abandoned = False
        self._slots = SlotOwnership()  # every slot the tree's ledgers have out, re-derived

    # ------------------------------------------------------------ actor system
    def _on_kernel_started(self, e: dict[str, Any]) -> None:
        if self._run is not None:
            self._fail(
                "an actor system started while another run in this log had not stopped"
                " (one cache per log)"
            )
        actors = e.get("actors")
        if not isinstance(actors, list):
            self._fail("kernel.started without its list of actors")
        self._run = _Run(actors=list(actors))
        self._reset_run_state()
        self.report.runs += 1

    def _on_actor_stopped(self, e: dict[str, Any]) -> None:
        run = self._need_run()
        actor = e["component"]
        if actor not in run.actors:
            self._fail(f"actor {actor!r} stopped but the actor system did not start it")
        if actor in run.stopped:
            self._fail(f"actor {actor!r} stopped twice")
        run.stopped.add(actor)
        if e.get("handled") != e.get("delivered"):
            self._fail(
                f"actor {actor!r} stopped having handled {e.get('handled')} of the "
                f"{e.get('delivered')} messages delivered to it"
            )

    def _on_kernel_stopped(self, e: dict[str, Any]) -> None:
        run = self._need_run()
        reason = e.get("reason")
        if reason != "exit":
            self._fail(f"the actor system stopped with reason {reason!r}, not 'exit'")
        missing = [a for a in run.actors if a not in run.stopped]
        if missing:
            self._fail(
                f"the actor system stopped but actors {missing} never reported actor.stopped"
            )
        self._end_of_run()
        self._run = None

    def _on_tree_slots(self, e: dict[str, Any]) -> None:
        self._need_run()
        self.report.slot_events += 1
        broken = self._slots.apply(e)
        if broken is not None:
            self._fail(broken)

    def _on_cache_closed(self, e: dict[str, Any]) -> None:
        used = {tier: n for tier, n in (e.get("used") or {}).items() if n}
        if used:
            self._fail(f"the ledgers do not balance at close: {used} slots still held")
        held = self._slots.held()
        if held and not self._abandoned:
            self._fail(f"slots handed out and never taken back by close: {held}")
        if self._open_matches and not self._abandoned:
            open_rids = sorted(map(repr, self._open_matches))[:8]
            self._fail(f"requests still holding their locks at close: {open_rids}")
        if e.get("tables_left"):
            self._fail(f"bookkeeping tables not empty at close: {e['tables_left']}")

    def _on_kernel_actor_failed(self, e: dict[str, Any]) -> None:
        self._fail(f"actor {e.get('actor')!r} failed: {e.get('error')}: {e.get('message')}")

    def _need_run(self) -> _Run:
        if self._run is None:
            self._fail("an event of a run outside kernel.started .. kernel.stopped")
        return self._run

    def _end_of_run(self) -> None:
        """Every op begun in the run ended (the op checks say what that means)."""

    # ------------------------------------------------------------------ tree: requests
    def _on_tree_match(self, e: dict[str, Any]) -> None:
        self._need_run()
        tokens = self._count(e, "tokens")
        dev, host = self._count(e, "device_hit"), self._count(e, "host_hit")
        if dev + host > tokens:
            self._fail(f"a match of {tokens} tokens found {dev} in L1 and {host} in L2")
        if dev > self._device:
            self._fail(
                f"a match found {dev} tokens in L1, which holds {self._device}: an "
                "insert or load is missing before it"
            )
        self._open_matches[rid_of(e)] = host
        self.report.matches += 1

    def _on_tree_insert(self, e: dict[str, Any]) -> None:
        self._need_run()
        rid = rid_of(e)
        if rid not in self._open_matches:
            self._fail(f"request {rid!r} inserted without a match before it")
        tokens, new = self._count(e, "tokens"), self._count(e, "new")
        if new > tokens:
            self._fail(f"insert of {tokens} tokens with {new} new")
        if e.get("finished", True):
            del self._open_matches[rid]
        else:
            self._open_matches[rid] = 0  # re-matched by the insert: its L2 part is in L1 now
        self._add_device(new, "insert")
        self.report.inserts += 1

    def _on_tree_release(self, e: dict[str, Any]) -> None:
        self._need_run()
        rid = rid_of(e)
        if self._open_matches.pop(rid, None) is None:
            self._fail(f"request {rid!r} released but it was not open (no match since its end)")

    def _needs_match(self, e: dict[str, Any]) -> None:
        self._need_run()
        if rid_of(e) not in self._open_matches:
            self._fail(f"{e['event']} for request {rid_of(e)!r}, which has no match open")

    _on_tree_prefetch_skipped = _needs_match
    _on_tree_load_deferred = _needs_match
    _on_tree_load_skipped = _needs_match

    # ------------------------------------------------------------------ tree: L1
    def _add_device(self, delta: int, why: str) -> None:
        self._device += delta
        if self._device < 0:
            self._fail(
                f"{why}: the tree would hold {self._device} device tokens (< 0): an "
                "insert or load is missing, or tokens left L1 twice"
            )
        cap = self.device_capacity
        if cap is not None and self._device > cap:
            self._fail(
                f"{why}: the tree would hold {self._device} device tokens, more than "
                f"L1's {cap}: an eviction is missing"
            )
        self.report.max_device_tokens = max(self.report.max_device_tokens, self._device)

    def _on_tree_evict_device(self, e: dict[str, Any]) -> None:
        self._need_run()
        self._add_device(-self._count(e, "tokens"), "L1 eviction")

    # ------------------------------------------------------------------ close
    def _on_tree_abandoned(self, e: dict[str, Any]) -> None:
        self._need_run()
        self._abandoned = True

    def finish(self) -> Report:
        self._event = None
        if self._run is not None:
            self._fail("the log ends inside a run: no kernel.stopped")
        return super().finish()
