"""`hicache check-log EVENTS.jsonl`: re-derive what the event log says happened and check the
invariants it lets one check. Exit 0 when the log holds, 1 naming the first violation, 2 when
the file cannot be read.

What is checked (docs/events.md, "Checking a log", lists what the events do not let it check
and the fields that would):

- framing: every line is a JSON object with `event`, `seq`, `t`, `component`, `level`;
  `seq` runs 1, 2, 3, ... without gaps; `t` never goes back; a worker's events carry its
  component;
- runs: a `kernel.started` opens a run and its `kernel.stopped` closes it, with reason
  `exit`; every actor it started reports `actor.stopped` once, before it, having handled
  every message delivered to it;
- op ids: one id names one op of one kind (write, load, upload, prefetch); writes and loads
  complete in issue order (their `*_done` op ids increase);
- loads: every `tree.load_started` has exactly one `loader.load_done` after it (or, past
  `tree.abandoned`, a `tree.load_failed`); a failed copy is followed by `tree.load_failed`;
  no `loader.load_done` without its start;
- backups: one `writer.backup_done` per op; a failed one is followed by `tree.backup_failed`;
- uploads: an op that was retried or timed out ends with `uploader.stored` or
  `uploader.failed`, once, and nothing of it follows that end;
- prefetches: every `tree.prefetch_started` has exactly one `tree.prefetch_done` after it,
  with `read <= hit <= tokens` and nothing read when revoked; a timeout or a
  `prefetcher.done` falls between the two ends of its op;
- requests: a `tree.insert`, a load-back or prefetch (started or skipped) follows a
  `tree.match` of its request (since its last finished insert); a load-back never loads more tokens than the request's last match found in L2
  plus what its prefetches since brought (no load from a tier that does not hold the page);
- locks: every matched request ends (a finished `tree.insert` or a `tree.release`, the
  drain's included) once, and none is open at `cache.closed`;
- slots: from `tree.slots` (written whenever the log records), no slot of either tier is
  handed out while it is still out, none is taken back that is not out, and none is still
  out at `cache.closed` (`hicache/cli/slotcheck.py`);
- L1: the device tokens the tree holds, re-derived (inserted `new` + loaded - evicted - freed
  by failed loads), never go below 0 or below a match's device hit, and with
  `--device-tokens N` (the L1 size the log was written with) never above N.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hicache.cli.slotcheck import SlotOwnership

_WORKERS = ("tree", "writer", "loader", "uploader", "prefetcher")


class Violation(Exception):
    """The first invariant the log breaks: where, and what."""

    def __init__(self, line: int, event: dict[str, Any] | None, message: str) -> None:
        where = f"line {line}"
        if event is not None:
            where += f" (seq {event.get('seq')}, {event.get('event')})"
        super().__init__(f"{where}: {message}")
        self.line, self.event, self.message = line, event, message


@dataclass
class _Run:
    actors: list[str]
    stopped: set[str] = field(default_factory=set)


@dataclass
class Report:
    """What a log that holds contained."""

    events: int = 0
    runs: int = 0
    loads: int = 0
    backups: int = 0
    uploads: int = 0
    prefetches: int = 0
    matches: int = 0
    inserts: int = 0
    max_device_tokens: int = 0
    slot_events: int = 0


class LogChecker:
    """Feed events in order (`feed`), then `finish()`. Raises `Violation` at the first break."""

    def __init__(self, *, device_tokens: int | None = None) -> None:
        self.device_capacity = device_tokens
        self.report = Report()
        self._line = 0
        self._event: dict[str, Any] | None = None
        self._seq = 0
        self._t = float("-inf")
        self._run: _Run | None = None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._kind: dict[int, str] = {}  # op id -> write | load | upload | prefetch
        self._loads: dict[int, str] = {}  # op -> started | done | failed_copy
        self._last_load_done = 0
        self._last_backup_done = 0
        self._backups: dict[
            int, bool | None
        ] = {}  # op -> ok (False: awaiting tree.backup_failed; None: reported)
        self._uploads: dict[int, str] = {}  # op -> open | ended
        self._prefetches: dict[int, dict[str, Any]] = {}
        self._open_matches: dict[object, int] = {}  # rid -> L2 tokens it may still load
        self._device = 0  # tokens the tree holds in L1, re-derived
        self._abandoned = False
        self._slots = SlotOwnership()  # every slot the tree's ledgers have out, re-derived

    # ------------------------------------------------------------------ helpers
    def _fail(self, message: str) -> NoReturn:
        raise Violation(self._line, self._event, message)

    def _op_kind(self, op: object, kind: str) -> int:
        if not isinstance(op, int) or isinstance(op, bool) or op < 1:
            self._fail(f"op {op!r} is not an op id")
        seen = self._kind.setdefault(op, kind)
        if seen != kind:
            self._fail(f"op {op} is a {kind} here but was a {seen} before")
        return op

    def _count(self, e: dict[str, Any], name: str) -> int:
        value = e.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self._fail(f"field {name!r} is {value!r}, not a count")
        return value

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

    # ------------------------------------------------------------------ feeding
    def feed_line(self, text: str) -> None:
        self._line += 1
        self._event = None
        if not text.strip():
            return
        try:
            event = json.loads(text)
        except json.JSONDecodeError as exc:
            self._fail(f"not JSON: {exc}")
        if not isinstance(event, dict):
            self._fail("not a JSON object")
        self.feed(event)

    def feed(self, e: dict[str, Any]) -> None:
        self._event = e
        for name in ("event", "seq", "t", "component", "level"):
            if name not in e:
                self._fail(f"no {name!r} field")
        self.report.events += 1
        seq, t = e["seq"], e["t"]
        if seq != self._seq + 1:
            self._fail(f"seq {seq} follows seq {self._seq}: events are missing or out of order")
        self._seq = seq
        if not isinstance(t, (int, float)) or t < self._t:
            self._fail(f"t {t!r} goes back from {self._t}")
        self._t = t
        name, component = e["event"], e["component"]
        prefix = name.split(".", 1)[0]
        if prefix in _WORKERS and component != prefix:
            self._fail(f"component {component!r} for a {prefix} event")
        handler = getattr(self, "_on_" + name.replace(".", "_"), None)
        if handler is not None:
            handler(e)

    # ------------------------------------------------------------------ kernel
    def _on_kernel_started(self, e: dict[str, Any]) -> None:
        if self._run is not None:
            self._fail(
                "a kernel started while another run in this log had not stopped (one cache per log)"
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
            self._fail(f"actor {actor!r} stopped but the kernel did not start it")
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
            self._fail(f"the kernel stopped with reason {reason!r}, not 'exit'")
        missing = [a for a in run.actors if a not in run.stopped]
        if missing:
            self._fail(f"the kernel stopped but actors {missing} never reported actor.stopped")
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
        """Every op begun in the run ended (ops abandoned at close excepted)."""
        for op, state in self._loads.items():
            if state == "started":
                self._fail(f"load op {op} started but no loader.load_done followed")
            if state == "failed_copy":
                self._fail(f"load op {op} failed its copy but no tree.load_failed followed")
        for op, ok in self._backups.items():
            if ok is False:
                self._fail(f"backup op {op} failed but no tree.backup_failed followed")
        for op, p in self._prefetches.items():
            if not p["done"]:
                self._fail(f"prefetch op {op} started but no tree.prefetch_done followed")
        if not self._abandoned:
            for op, state in self._uploads.items():
                if state == "open":
                    self._fail(
                        f"upload op {op} was retried or timed out but never ended "
                        "(uploader.stored or uploader.failed)"
                    )

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
        self._open_matches[_rid(e)] = host
        self.report.matches += 1

    def _on_tree_insert(self, e: dict[str, Any]) -> None:
        self._need_run()
        rid = _rid(e)
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
        rid = _rid(e)
        if self._open_matches.pop(rid, None) is None:
            self._fail(f"request {rid!r} released but it was not open (no match since its end)")

    # ------------------------------------------------------------------ tree: L1
    def _on_tree_evict_device(self, e: dict[str, Any]) -> None:
        self._need_run()
        self._add_device(-self._count(e, "tokens"), "L1 eviction")

    # ------------------------------------------------------------------ loads
    def _on_tree_load_started(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "load")
        if op in self._loads:
            self._fail(f"load op {op} started twice")
        rid = _rid(e)
        tokens = self._count(e, "tokens")
        if rid not in self._open_matches:
            self._fail(f"load-back for request {rid!r}, which has no match open")
        if tokens > self._open_matches[rid]:
            self._fail(
                f"request {rid!r} loads {tokens} tokens from L2, but its match found "
                f"{self._open_matches[rid]} there (prefetched pages included)"
            )
        self._open_matches[rid] -= tokens
        self._loads[op] = "started"
        self._add_device(tokens, "load-back")
        self.report.loads += 1

    def _on_loader_load_done(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "load")
        state = self._loads.get(op)
        if state is None:
            self._fail(f"load op {op} done but never started (tree.load_started)")
        if state == "failed" and self._abandoned:
            return  # abandoned at close, then its copy landed after all
        if state != "started":
            self._fail(f"load op {op} done twice")
        if op <= self._last_load_done:
            self._fail(
                f"load op {op} done after op {self._last_load_done}: loads complete in issue order"
            )
        self._last_load_done = op
        self._loads[op] = "done" if e.get("ok", True) else "failed_copy"

    def _on_tree_load_failed(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "load")
        state = self._loads.get(op)
        abandoned = self._abandoned and state == "started"
        if state != "failed_copy" and not abandoned:
            self._fail(f"tree.load_failed for load op {op}, whose copy did not fail")
        self._loads[op] = "failed"
        self._add_device(-self._count(e, "tokens"), "failed load")

    # ------------------------------------------------------------------ backups
    def _on_writer_backup_done(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "write")
        if op in self._backups:
            self._fail(f"backup op {op} done twice")
        if op <= self._last_backup_done:
            self._fail(
                f"backup op {op} done after op {self._last_backup_done}: writes complete "
                "in issue order"
            )
        self._last_backup_done = op
        self._backups[op] = bool(e.get("ok", True))
        self.report.backups += 1

    def _on_tree_backup_failed(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "write")
        if self._backups.get(op) is False:
            self._backups[op] = None  # reported
        elif not self._abandoned:
            self._fail(f"tree.backup_failed for backup op {op}, whose copy did not fail")

    # ------------------------------------------------------------------ uploads
    def _upload_event(self, e: dict[str, Any], *, end: bool) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "upload")
        if self._uploads.get(op) == "ended":
            self._fail(f"upload op {op}: {e['event']} after the op ended")
        if end:
            self._uploads[op] = "ended"
            self.report.uploads += 1
        else:
            self._uploads.setdefault(op, "open")

    def _on_uploader_stored(self, e: dict[str, Any]) -> None:
        self._upload_event(e, end=True)

    def _on_uploader_failed(self, e: dict[str, Any]) -> None:
        self._upload_event(e, end=True)

    def _on_uploader_retry(self, e: dict[str, Any]) -> None:
        self._upload_event(e, end=False)

    def _on_uploader_timeout(self, e: dict[str, Any]) -> None:
        self._upload_event(e, end=False)

    # ------------------------------------------------------------------ prefetches
    def _on_tree_prefetch_started(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "prefetch")
        if op in self._prefetches:
            self._fail(f"prefetch op {op} started twice")
        rid = _rid(e)
        if rid not in self._open_matches:
            self._fail(f"prefetch for request {rid!r}, which has no match open")
        self._prefetches[op] = {"rid": rid, "tokens": self._count(e, "tokens"), "done": False}
        self.report.prefetches += 1

    def _needs_match(self, e: dict[str, Any]) -> None:
        self._need_run()
        if _rid(e) not in self._open_matches:
            self._fail(f"{e['event']} for request {_rid(e)!r}, which has no match open")

    _on_tree_prefetch_skipped = _needs_match
    _on_tree_load_deferred = _needs_match
    _on_tree_load_skipped = _needs_match

    def _prefetch(self, e: dict[str, Any]) -> dict[str, Any]:
        op = self._op_kind(e.get("op"), "prefetch")
        p = self._prefetches.get(op)
        if p is None:
            self._fail(f"prefetch op {op}: {e['event']} but it never started")
        return p

    def _on_tree_prefetch_done(self, e: dict[str, Any]) -> None:
        self._need_run()
        p = self._prefetch(e)
        if p["done"]:
            self._fail(f"prefetch op {e['op']} settled twice")
        p["done"] = True
        hit, read = self._count(e, "hit"), self._count(e, "read")
        if not read <= hit <= p["tokens"]:
            self._fail(f"prefetch of {p['tokens']} tokens: hit {hit}, read {read}")
        if e.get("state") not in ("done", "revoked"):
            self._fail(f"prefetch settled in state {e.get('state')!r}")
        if e.get("state") == "revoked" and read:
            self._fail(f"a revoked prefetch inserted {read} tokens")
        rid = p["rid"]
        if rid in self._open_matches:  # what arrived may now be loaded back
            self._open_matches[rid] += read

    def _on_tree_prefetch_timeout(self, e: dict[str, Any]) -> None:
        self._need_run()
        if self._prefetch(e)["done"]:
            self._fail(f"prefetch op {e['op']} timed out after it settled")

    def _on_prefetcher_done(self, e: dict[str, Any]) -> None:
        self._need_run()
        p = self._prefetch(e)
        if p.get("ended"):
            self._fail(f"prefetch op {e['op']} ended twice in the prefetcher")
        p["ended"] = True

    # ------------------------------------------------------------------ close
    def _on_tree_abandoned(self, e: dict[str, Any]) -> None:
        self._need_run()
        self._abandoned = True

    def finish(self) -> Report:
        self._event = None
        if self._run is not None:
            self._fail("the log ends inside a run: no kernel.stopped")
        return self.report


def _rid(e: dict[str, Any]) -> Any:
    rid = e.get("rid")
    return tuple(rid) if isinstance(rid, list) else rid


def check_events(events: Iterable[dict[str, Any]], *, device_tokens: int | None = None) -> Report:
    """Check a sequence of event dicts (e.g. `EventLog(capture=True).events`)."""
    checker = LogChecker(device_tokens=device_tokens)
    for i, e in enumerate(events, 1):
        checker._line = i
        checker.feed(e)
    return checker.finish()


def check_file(path: str | Path, *, device_tokens: int | None = None) -> Report:
    checker = LogChecker(device_tokens=device_tokens)
    with open(path, encoding="utf-8") as f:
        for text in f:
            checker.feed_line(text)
    return checker.finish()


def run(args: argparse.Namespace) -> int:
    try:
        report = check_file(args.events, device_tokens=args.device_tokens)
    except Violation as v:
        print(f"hicache check-log: {args.events}: {v}", file=sys.stdout)
        return 1
    except OSError as exc:
        print(f"hicache check-log: error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        r = report
        print(
            f"{args.events}: ok: {r.events} events, {r.runs} run(s); {r.matches} matches, "
            f"{r.inserts} inserts, {r.loads} loads, {r.backups} backups, {r.uploads} "
            f"uploads, {r.prefetches} prefetches; L1 held at most {r.max_device_tokens} "
            "tokens"
        )
    return 0
