"""`hicache check-log`'s checks of the ops the tree hands its workers (the runs and requests
they belong to: `runs.py`):

- op ids: one id names one op of one kind (write, load, upload, prefetch); writes and loads
  complete in issue order (their `*_done` op ids increase);
- loads: every `tree.load_started` has exactly one `loader.load_done` after it (or, past
  `tree.abandoned`, a `tree.load_failed`); a failed copy is followed by `tree.load_failed`;
  no `loader.load_done` without its start; a load-back never loads more tokens than the
  request's last match found in L2 plus what its prefetches since brought (no load from a
  tier that does not hold the page);
- backups: one `writer.backup_done` per op; a failed one is followed by `tree.backup_failed`;
- uploads: an op that was retried or timed out ends with `uploader.stored` or
  `uploader.failed`, once, and nothing of it follows that end;
- prefetches: every `tree.prefetch_started` has exactly one `tree.prefetch_done` after it,
  with `read <= hit <= tokens` and nothing read when revoked; a timeout or a
  `prefetcher.done` falls between the two ends of its op.
"""

from __future__ import annotations

from typing import Any

from hicache.cli.checklog.read import rid_of
from hicache.cli.checklog.runs import RunChecks

__all__ = ["OpChecks"]


class OpChecks(RunChecks):
    """Loads, backups, uploads and prefetches, by op id, on top of the run checks."""

    def _reset_run_state(self) -> None:
        super()._reset_run_state()
        self._kind: dict[int, str] = {}  # op id -> write | load | upload | prefetch
        self._loads: dict[int, str] = {}  # op -> started | done | failed_copy
        self._last_load_done = 0
        self._last_backup_done = 0
        # op -> ok (False: awaiting tree.backup_failed; None: reported)
        self._backups: dict[int, bool | None] = {}
        self._uploads: dict[int, str] = {}  # op -> open | ended
        self._prefetches: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ op ids
    def _op_kind(self, op: object, kind: str) -> int:
        if not isinstance(op, int) or isinstance(op, bool) or op < 1:
            self._fail(f"op {op!r} is not an op id")
        seen = self._kind.setdefault(op, kind)
        if seen != kind:
            self._fail(f"op {op} is a {kind} here but was a {seen} before")
        return op

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

    # ------------------------------------------------------------------ loads
    def _on_tree_load_started(self, e: dict[str, Any]) -> None:
        self._need_run()
        op = self._op_kind(e.get("op"), "load")
        if op in self._loads:
            self._fail(f"load op {op} started twice")
        rid = rid_of(e)
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
        rid = rid_of(e)
        if rid not in self._open_matches:
            self._fail(f"prefetch for request {rid!r}, which has no match open")
        self._prefetches[op] = {"rid": rid, "tokens": self._count(e, "tokens"), "done": False}
        self.report.prefetches += 1

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
