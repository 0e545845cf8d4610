"""The controller's write flows: L1 -> L2 backups and the L2 -> L3 uploads they lead to.

Their ops are rows of the op table (`ops.py`: issue order, credits, completions recorded);
this module owns the backlogs and what a start and a finish mean. A write-through backup that
finds no credit or no host room waits in the backlog, retried as writes and uploads end; an
eviction backup cannot go on without its copy, so its `BackupStart` carries the `Wait` its
caller parks on. A finished backup uploads every piece its node was split into meanwhile.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import numpy as np

from hicache.components.controller.ops import OpTable, Wait
from hicache.components.controller.rows import UploadOp, WriteOp
from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.storage_switch import StorageSwitch
from hicache.components.controller.tiers import Tiers
from hicache.messages import Backup, Upload
from hicache.radix.hashes import chain_page_hashes
from hicache.types import EMPTY_SLOTS, NodeId, OpId, PageHash

HELD_BY_UPLOADS: Final = "l2_held_by_uploads"
"""Why an eviction backup dropped its node: L2's only room is pages uploads are still
reading, and an L1 eviction does not wait for storage (`Tiers.discard`)."""


@dataclass(frozen=True, slots=True)
class BackupStart:
    """What starting a backup did: `started`; else, for an eviction's, the `wait` for a write
    credit, or the device tokens `dropped` with the node (None: not dropped)."""

    started: bool = False
    wait: Wait | None = None
    dropped: int | None = None


class WriteFlows:
    def __init__(self, shared: Shared, tiers: Tiers, storage: StorageSwitch, ops: OpTable) -> None:
        self._shared = shared
        self._tiers = tiers
        self._storage = storage
        self._ops = ops  # backups and uploads in flight are rows of the op table
        self.write_backlog: deque[NodeId] = deque()  # waiting for a write credit or host room
        # waiting for an upload credit: a node's pieces, and their pages (counted if dropped)
        self.upload_backlog: deque[tuple[tuple[NodeId, ...], int]] = deque()

    def tables(self) -> dict[str, int]:
        ops = self._ops
        return {
            "writes": len(ops.of("backup")),
            "uploads": len(ops.of("upload")),
            "write_backlog": len(self.write_backlog),
            "upload_backlog": len(self.upload_backlog),
            "arrived_writes": ops.arrived_count("backup"),
            "arrived_uploads": ops.arrived_count("upload"),
        }

    def in_flight(self) -> dict[str, int]:
        return {"writes": len(self._ops.of("backup")), "uploads": len(self._ops.of("upload"))}

    def busy(self) -> bool:
        """Anything in flight or waiting for a credit (a drain or clear waits for none)."""
        ops = self._ops
        return bool(
            ops.of("backup") or self.write_backlog or ops.of("upload") or self.upload_backlog
        )

    # ------------------------------------------------------------------ waits
    def oldest_write(self) -> Wait | None:
        """A wait for the backup in flight started first (the next to free what it copies)."""
        return self._ops.oldest("backup")

    def oldest_upload(self) -> Wait | None:
        """A wait for the oldest upload still waited for (never one past its deadline): its
        end unprotects host pages."""
        uploads = self._ops.of("upload")
        upload = next((op for op, job in uploads.items() if not job.timed_out), None)
        return self._ops.wait("upload", upload)

    def evicting_tokens(self) -> int:
        """Device tokens the eviction backups in flight will free once they land."""
        return sum(len(op.host_slots) for op in self._ops.of("backup").values() if op.evicting)

    def pending(self) -> bool:
        """What a flush waits for: uploads past their deadline no longer count."""
        ops = self._ops
        return bool(
            ops.of("backup")
            or self.write_backlog
            or self.upload_backlog
            or any(not job.timed_out for job in ops.of("upload").values())
        )

    # ------------------------------------------------------------------ L1 -> L2
    def start_backup(self, step: Step, node: NodeId, *, evicting: bool) -> BackupStart:
        """Copy a device-only node to L2. A write-through backup with no credit or no host
        room goes to the backlog; an eviction's waits for a write credit, and is dropped from
        L1 uncopied when only uploads hold the room it needs (an eviction never waits on
        storage)."""
        shared, tree = self._shared, self._shared.tree
        if self._ops.credit("backup") == 0:
            oldest = self.oldest_write()
            if evicting and oldest is not None:
                return BackupStart(wait=oldest)
            self.write_backlog.append(node)
            return BackupStart()
        if not tree.needs_backup(node):
            return BackupStart()
        length = tree.num_tokens(node)
        host = self._tiers.host(step, length)
        if host is None and self.oldest_upload() is not None:
            # only uploads hold what L2 could give up
            if evicting:
                # Waiting would tie this call to the store's pace: the node leaves L1
                # uncopied (counted).
                gone = self._tiers.discard(step, node, HELD_BY_UPLOADS)
                shared.counters.dropped(step, HELD_BY_UPLOADS, gone // shared.cfg.page_size)
                return BackupStart(dropped=gone)
            self.write_backlog.append(node)
            return BackupStart()
        if host is None or not tree.needs_backup(node):
            self._tiers.free(step, "host", EMPTY_SLOTS if host is None else host)
            if host is None:
                step.out.warning(
                    "tree.backup_skipped", node=node, tokens=length, reason="host_full"
                )
            return BackupStart()
        self._issue_backup(step, node, host, evicting=evicting)
        return BackupStart(started=True)

    def start_backups(self, step: Step, nodes: Iterable[NodeId]) -> None:
        """Write-through backups for a whole step: one host allocation for all of them when
        credits and free slots allow, else one by one."""
        tree = self._shared.tree
        todo = [n for n in dict.fromkeys(nodes) if tree.needs_backup(n)]
        lengths = [tree.num_tokens(n) for n in todo]
        pooled = None
        if 1 < len(todo) <= self._ops.credit("backup"):
            pooled = self._tiers.alloc(step, "host", sum(lengths))
        if pooled is None:
            for node in todo:
                self.start_backup(step, node, evicting=False)
            return
        offset = 0
        for node, length in zip(todo, lengths, strict=True):
            self._issue_backup(step, node, pooled[offset : offset + length])
            offset += length

    def _issue_backup(
        self, step: Step, node: NodeId, host: np.ndarray, *, evicting: bool = False
    ) -> None:
        shared = self._shared
        self._tiers.start_backup(node, host)
        op = shared.op()
        self._ops.start("backup", op, WriteOp(node=node, host_slots=host, evicting=evicting))
        device = shared.tree.device_slots(node)
        assert device is not None
        step.out.send("writer", Backup(op=op, device_slots=device, host_slots=host))
        shared.counters.d2h_bytes += len(host) * shared.bytes_per_token
        shared.counters.evict_backups += evicting

    def finish_backup(self, step: Step, op_id: OpId, ok: bool, error: str) -> None:
        shared = self._shared
        op: WriteOp = self._ops.finish("backup", op_id)
        pieces = shared.tree.backup_pieces(op.node)  # the node may have been split meanwhile
        self._tiers.finish_backup(step, op.node, ok=ok)
        if not ok:
            step.out.error("tree.backup_failed", op=op_id, node=op.node, error=error or None)
        elif self._storage.on:
            self.start_upload(step, pieces)
        self.retry_backlog(step)

    def retry_backlog(self, step: Step) -> None:
        """Start what the write backlog holds while credits last; stop at the first that
        still finds no host room (it goes back in front)."""
        while self.write_backlog and self._ops.credit("backup"):
            node = self.write_backlog.popleft()
            before = len(self.write_backlog)
            self.start_backup(step, node, evicting=False)
            if len(self.write_backlog) > before:  # requeued at the back: keep its place
                self.write_backlog.appendleft(self.write_backlog.pop())
                break

    # ------------------------------------------------------------------ L2 -> L3
    def start_upload(self, step: Step, pieces: tuple[NodeId, ...]) -> None:
        """Send a freshly backed-up node's pages (all its split pieces, root first) to storage;
        their host pages stay protected until the upload is done."""
        shared, tree = self._shared, self._shared.tree
        node = pieces[-1]  # the deepest: protecting it protects the path above it
        if not tree.has_host_copy(node):
            return
        if self._ops.credit("upload") == 0:
            if len(self.upload_backlog) >= shared.cfg.max_upload_backlog:
                # Storage is slower than the writes: skip rather than queue without bound.
                shared.counters.skipped_uploads += 1
                shared.counters.dropped(step, "backlog_full", self._pages(pieces))
                step.out.warning(
                    "tree.upload_skipped",
                    node=node,
                    reason="backlog_full",
                    backlog=len(self.upload_backlog),
                )
                return
            self.upload_backlog.append((pieces, self._pages(pieces)))
            return
        hashes = [h for p in pieces for h in self.node_hashes(p)]
        host_slots = np.concatenate([tree.host_slots(p) for p in pieces])
        op = shared.op()
        self._tiers.protect_host(node)
        self._ops.start("upload", op, UploadOp(node=node, pages=len(hashes)))
        ttl = tree.retained_for(pieces, now=step.now)  # a range's duration reaches storage
        step.out.send(
            "uploader", Upload(op=op, hashes=tuple(hashes), host_slots=host_slots, ttl=ttl)
        )

    def drop_upload_backlog(self, step: Step) -> int:
        """Storage is being detached: what waits for an upload credit is not uploaded (its
        pages were never protected for it). How many nodes were dropped (counted as skipped)."""
        dropped = len(self.upload_backlog)
        pages = sum(pages for _, pages in self.upload_backlog)
        self._shared.counters.dropped(step, "detached", pages)
        self.upload_backlog.clear()
        self._shared.counters.skipped_uploads += dropped
        return dropped

    def upload_timed_out(self, op_id: OpId) -> None:
        job = self._ops.of("upload").get(op_id)
        if job is not None and not job.timed_out:
            job.timed_out = True
            self._shared.counters.upload_timeouts += 1

    def finish_upload(
        self, step: Step, op_id: OpId, *, stored: int = 0, dropped: str = "abandoned"
    ) -> None:
        tree = self._shared.tree
        job: UploadOp = self._ops.finish("upload", op_id)
        self._tiers.release_host(job.node)
        if stored < job.pages:
            self._shared.counters.dropped(step, dropped or "failed", job.pages - stored)
        while self.upload_backlog and self._ops.credit("upload"):
            pieces, pages = self.upload_backlog.popleft()
            if all(tree.state(p).name in ("BOTH", "HOST_ONLY") for p in pieces):
                self.start_upload(step, pieces)
            else:  # L2 evicted it while it waited (a backlog does not protect): never stored
                self._shared.counters.skipped_uploads += 1
                self._shared.counters.dropped(step, "evicted", pages)
                step.out.warning(
                    "tree.upload_skipped",
                    node=pieces[-1],
                    reason="evicted",
                    backlog=len(self.upload_backlog),
                )
        self.retry_backlog(step)  # host pages may be evictable again

    def _pages(self, pieces: tuple[NodeId, ...]) -> int:
        """Whole pages of a node's pieces (what an upload of them would store)."""
        tree = self._shared.tree
        return sum(tree.num_tokens(p) for p in pieces) // self._shared.cfg.page_size

    def node_hashes(self, node: NodeId) -> tuple[PageHash, ...]:
        """The node's chained page hashes, computed on first use from its parent's last one."""
        tree = self._shared.tree
        hashes = tree.page_hashes(node)
        if hashes is None:
            parent = tree.parent(node)
            assert parent is not None
            prior = tree.seed(parent) if tree.is_root(parent) else self.node_hashes(parent)[-1]
            hashes = tuple(
                chain_page_hashes(tree.key(node), self._shared.cfg.page_size, prior=prior)
            )
            self._tiers.set_page_hashes(node, hashes)
        return hashes

    # ------------------------------------------------------------------ close
    def abandon(self, step: Step) -> dict[str, int]:
        """End every write and upload as failed (close past its deadline). With the backlogs
        emptied first, nothing ending here starts new work (a failed write uploads nothing).
        How many: writes, and uploads with those waiting for a credit."""
        counts = {
            "writes": len(self._ops.of("backup")),
            "uploads": len(self._ops.of("upload")) + len(self.upload_backlog),
        }
        self.write_backlog.clear()
        self.upload_backlog.clear()
        for op_id in list(self._ops.of("backup")):
            self.finish_backup(step, op_id, False, "abandoned at close")
        for op_id in list(self._ops.of("upload")):
            self.finish_upload(step, op_id)
        return counts
