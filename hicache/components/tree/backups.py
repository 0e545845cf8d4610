"""The tree actor's write flows: L1 -> L2 backups and the L2 -> L3 uploads they trigger.

A part of `TreeActor` (a mixin over its state, not a separate owner). Write-through backups
take a write credit or queue; an eviction that needs a backup waits for the oldest write
instead. A finished backup uploads every piece the node was split into meanwhile.
"""

from __future__ import annotations

import numpy as np

from hicache.backends.keys import chain_page_hashes
from hicache.components.tree.records import UploadOp, WriteOp
from hicache.messages import Backup, Upload
from hicache.types import EMPTY_SLOTS, NodeId, OpId


class BackupFlows:
    # ------------------------------------------------------------------ L1 -> L2
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
        length = self._tree.num_tokens(node)
        host = await self._alloc_host(length)
        if host is None or not self._tree.needs_backup(node):
            self._free("host", EMPTY_SLOTS if host is None else host)
            if host is None:
                self.log.warning("tree.backup_skipped", node=node, tokens=length,
                                 reason="host_full")
            return False
        await self._issue_backup(node, host, evicting=evicting)
        return True

    async def _start_backups(self, nodes) -> None:
        """Write-through backups for a whole step: one host allocation for all of them when
        credits and free slots allow, else one by one."""
        todo = [n for n in dict.fromkeys(nodes) if self._tree.needs_backup(n)]
        lengths = [self._tree.num_tokens(n) for n in todo]
        pooled = None
        if len(todo) > 1 and len(todo) <= self._write_credits:
            pooled = self._alloc("host", sum(lengths))
        if pooled is None:
            for node in todo:
                await self._start_backup(node, evicting=False)
            return
        offset = 0
        for node, length in zip(todo, lengths):
            await self._issue_backup(node, pooled[offset:offset + length])
            offset += length

    async def _issue_backup(self, node: NodeId, host, *, evicting: bool = False) -> None:
        self._tree.begin_backup(node, host)
        op = self._op()
        self._write_credits -= 1
        done = self.kernel.reply()
        self._writes[op] = WriteOp(node=node, host_slots=host, done=done, evicting=evicting)
        await self._writer.send(Backup(op=op, device_slots=self._tree.device_slots(node),
                                       host_slots=host, reply=done))
        self.counters.d2h_bytes += len(host) * self._bpt

    async def _await_write(self, op_id: OpId) -> None:
        """Wait until the write `op_id` is applied: writes complete in order, so wait for the
        oldest one locally, then meet the other ranks at a sync point, until it is in."""
        while op_id in self._writes:
            first = next(iter(self._writes))
            if first not in self._arrived_writes:
                ok = await self._writes[first].done.wait()
                self._arrived_writes.setdefault(first, (ok, ""))
            await self._sync_point()

    async def _finish_write(self, op_id: OpId, ok: bool, error: str) -> None:
        op = self._writes.pop(op_id)
        self._write_credits += 1
        pieces = self._tree.backup_pieces(op.node)  # the node may have been split meanwhile
        freed = self._tree.end_backup(op.node, ok=ok)
        self._free("host", freed)
        if not ok:
            self.log.error("tree.backup_failed", op=op_id, node=op.node, error=error or None)
        elif self._uploader is not None:
            await self._upload(pieces)
        while self._write_backlog and self._write_credits:
            await self._start_backup(self._write_backlog.popleft(), evicting=False)

    def _writes_pending(self) -> bool:
        """What a flush waits for: uploads past their deadline no longer count."""
        return bool(self._writes or self._write_backlog or self._upload_backlog
                    or any(not job.timed_out for job in self._uploads.values()))

    # ------------------------------------------------------------------ L2 -> L3
    async def _upload(self, pieces: tuple[NodeId, ...]) -> None:
        """Send a freshly backed-up node's pages (all its split pieces, root first) to storage;
        their host pages stay protected until the upload is done."""
        node = pieces[-1]  # the deepest: protecting it protects the path above it
        if not self._tree.has_host_copy(node):
            return
        if self._upload_credits == 0:
            if len(self._upload_backlog) >= self._cfg.max_upload_backlog:
                # Storage is slower than the writes: skip rather than queue without bound.
                self.counters.skipped_uploads += 1
                self.log.warning("tree.upload_skipped", node=node, reason="backlog_full",
                                 backlog=len(self._upload_backlog))
                return
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
        """Wait until the upload `op_id` is applied, or until its storage call passes its
        deadline (the uploader then answers -1; the op stays until the call returns)."""
        while op_id in self._uploads:
            job = self._uploads[op_id]
            if op_id not in self._arrived_uploads:
                stored = await job.done.wait()
                if stored < 0:
                    if not job.timed_out:
                        job.timed_out = True
                        self.counters.upload_timeouts += 1
                    return
                self._arrived_uploads.setdefault(op_id, stored)
            await self._sync_point()

    async def _finish_upload(self, op_id: OpId) -> None:
        job = self._uploads.pop(op_id)
        self._upload_credits += 1
        self._tree.release_host(job.node)
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
