"""The connector's worker half, in each vLLM worker: the host pool, the copies L1 <-> L2, the
L3 reads and writes, the counters of the work done."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hicache.integrations.vllm.compat import log
from hicache.integrations.vllm.groups import Row
from hicache.integrations.vllm.layers import LayerCopies
from hicache.integrations.vllm.layout import NULL_BLOCK, Geometry
from hicache.integrations.vllm.loads import Loads
from hicache.integrations.vllm.metrics import Counters
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.plan import HiCacheMetadata
from hicache.integrations.vllm.storage import Storage

if TYPE_CHECKING:
    import torch

WORKER_METRICS = (
    "l2_load_pages",
    "l2_load_bytes",
    "l2_store_pages",
    "l2_store_bytes",
    "l3_read_pages",
    "l3_read_bytes",
    "l3_read_failures",
    "l3_write_pages",
    "l3_write_bytes",
    "l3_write_failures",
    "load_errors",
    "load_timeouts",
    "aborted_loads",
)
"""The worker half's counters (hicache.integrations.vllm.metrics.METRICS says what each is)."""


class WorkerSide:
    """The connector's worker half: the host pool and every copy and L3 transfer."""

    def __init__(
        self,
        options: ConnectorOptions,
        geometry: Geometry,
        num_blocks: int,
        storage: Storage | None,
    ) -> None:
        self.options = options
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.storage = storage
        self.planes: list[torch.Tensor] = []  # (num_blocks, bytes) uint8 views of vLLM's KV
        self.offsets: list[int] = []
        self.plane_layer: list[str] = []  # the vLLM layer of each plane, in model order
        self.plane_group: list[int] = []  # the KV cache group of each plane
        self.host: torch.Tensor | None = None  # (slots, page_bytes) uint8
        self.valid: list[bool] = []
        self.errors: set[int] = set()
        self.failed: set[str] = set()  # hybrid: requests whose load failed (whole requests)
        self.bad: set[tuple[int, str]] = set()
        self.uploads: dict[int, concurrent.futures.Future[int]] = {}
        self.stats = Counters(WORKER_METRICS)
        self._acks_lock = threading.Lock()
        self._uploaded: list[str] = []  # L3 writes that landed, not yet reported
        self._upload_failed: list[str] = []
        self.slot_hash: list[str | None] = []  # the page each host slot's bytes are of
        self.loads = Loads(self)
        self.layers = LayerCopies(self)
        self._saved: set[str] = set()  # write-back requests whose stores ran this step

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Flat byte views of every layer's blocks: a block-major tensor (`[blocks, ...]`,
        kernel blocks of one vLLM block adjacent) or a K/V-outer one (`[2, blocks, ...]`).
        Several groups: each group's layers, in group order (their tensors may alias one
        another's: vLLM gives a block id to one group at a time)."""
        import torch

        named = [
            (name, g)
            for g, part in enumerate(self.geometry.parts)
            for name in part.layers
            if name in kv_caches
        ]
        if not named:
            named = [(name, 0) for name in sorted(kv_caches)]
        missing = sorted(set(self.geometry.layers) - set(kv_caches))
        if self.geometry.hybrid and missing:
            raise NotImplementedError(f"HiCacheConnector: vLLM gave no KV tensor for {missing}")
        planes: list[torch.Tensor] = []
        plane_layer: list[str] = []
        plane_group: list[int] = []
        for name, group in named:
            t = kv_caches[name]
            parts = [t]
            if t.shape[0] % self.num_blocks != 0 and t.shape[0] == 2:
                parts = [t[0], t[1]]
            for p in parts:
                if p.shape[0] % self.num_blocks != 0:
                    raise NotImplementedError(
                        f"HiCacheConnector: layer {name} KV shape {tuple(t.shape)} has no block "
                        f"dimension of {self.num_blocks} blocks first"
                    )
                try:
                    planes.append(p.view(self.num_blocks, -1).view(torch.uint8))
                    plane_layer.append(name)
                    plane_group.append(group)
                except RuntimeError as exc:
                    raise NotImplementedError(
                        f"HiCacheConnector: layer {name} KV (shape {tuple(t.shape)}, stride "
                        f"{t.stride()}) is not block-contiguous: {exc}"
                    ) from exc
        offsets, total = [], 0
        for p in planes:
            offsets.append(total)
            total += int(p.shape[1])
        if total != self.geometry.page_bytes:
            raise NotImplementedError(
                f"HiCacheConnector: vLLM's KV blocks hold {total} bytes per block over all "
                f"layers, the KV cache spec says {self.geometry.page_bytes}"
            )
        for g, part in enumerate(self.geometry.parts):
            got = sum(int(p.shape[1]) for p, pg in zip(planes, plane_group) if pg == g)
            if self.geometry.hybrid and got != part.page_bytes:
                raise NotImplementedError(
                    f"HiCacheConnector: group {g}'s blocks hold {got} bytes over its layers, "
                    f"its KV cache spec says {part.page_bytes}"
                )
        self.planes, self.offsets, self.plane_layer = planes, offsets, plane_layer
        self.plane_group = plane_group

    def _ensure_host(self, meta: HiCacheMetadata) -> torch.Tensor:
        import torch

        if meta.page_bytes != self.geometry.page_bytes:
            raise RuntimeError(
                f"HiCacheConnector: scheduler page of {meta.page_bytes} bytes, worker's "
                f"{self.geometry.page_bytes}"
            )
        if self.host is None:
            # Untouched pages cost nothing until written (the OS maps them on first touch).
            self.host = torch.empty((meta.host_slots, meta.page_bytes), dtype=torch.uint8)
            self.valid = [False] * meta.host_slots
            self.slot_hash = [None] * meta.host_slots
        return self.host

    def _page(self, slot: int) -> list[memoryview]:
        assert self.host is not None
        return [self.host[slot].numpy().data.cast("B")]

    def settle_upload(self, slot: int) -> None:
        """Before a host slot is overwritten, its upload to L3 must have read it."""
        fut = self.uploads.pop(slot, None)
        if fut is None:
            return
        try:
            fut.result(self.options.storage_timeout * 4)
        except Exception as exc:  # noqa: BLE001 - any storage failure is a miss (contract)
            log.warning("hicache upload failed (L3 misses it): %r", exc)

    def holds(self, slot: int, page_hash: str) -> bool:
        """Slot `slot` holds `page_hash`, landed (not being filled by a load in flight)."""
        return (
            0 <= slot < len(self.valid)
            and self.valid[slot]
            and self.slot_hash[slot] == page_hash
            and slot not in self.loads.filling
        )

    def fail_blocks(self, rows: list[Row], req_id: str | None = None) -> None:
        """These pages of a load did not land: vLLM recomputes them. One group: their blocks
        are reported (`get_block_ids_with_load_errors`); several: the whole request is
        (`failed_recving`: vLLM takes block errors of one group only)."""
        if self.geometry.hybrid:
            if req_id is not None and rows:
                self.failed.add(req_id)
        else:
            self.errors.update(row[0] for row in rows)
        self.stats.add("load_errors", len(rows))

    def _indices(self, pairs: list[tuple[Row, int]], group: int) -> tuple[Any, Any] | None:
        """(vLLM blocks, source rows) of `group`'s part of these pages, past null blocks."""
        import torch

        nullable = self.geometry.parts[group].nullable
        keep = [(row[group], r) for row, r in pairs if not (nullable and row[group] == NULL_BLOCK)]
        if not keep:
            return None
        bi = torch.tensor([b for b, _ in keep], dtype=torch.long)
        ri = torch.tensor([r for _, r in keep], dtype=torch.long)
        return bi, ri

    def copy_in(self, pairs: list[tuple[Row, int]], source: torch.Tensor) -> None:
        """Page (row of blocks, one per group) <- row r of `source` (host slots or a load's
        buffer), every layer of every group whose block vLLM gave."""
        picked = [self._indices(pairs, g) for g in range(len(self.geometry.parts))]
        for plane, off, g in zip(self.planes, self.offsets, self.plane_group):
            got = picked[g]
            if got is not None:
                plane[got[0]] = source[got[1], off : off + plane.shape[1]]
        self.stats.add("l2_load_pages", len(pairs))
        self.stats.add("l2_load_bytes", len(pairs) * self.geometry.page_bytes)

    def start_load(self, meta: HiCacheMetadata) -> None:
        """Start the step's loads: asynchronous ones and prefetches read from L3 in the
        background (`poll` lands them); synchronous ones land before the forward reads them
        (layer by layer with `layerwise_loads`: `wait_layer`)."""
        self._ensure_host(meta)
        deadline = self.options.prefetch_deadline
        for slot, page_hash in zip(meta.prefetch_slots, meta.prefetch_hashes):
            self.loads.begin(None, [], [slot], [page_hash], [True], self.options.storage_timeout)
        pairs: list[tuple[Row, int]] = []
        for p in meta.loads:
            if p.background or any(p.read):
                load = self.loads.begin(
                    p.req_id,
                    p.block_ids,
                    p.slots,
                    p.hashes,
                    p.read,
                    deadline(len(p.block_ids) * self.geometry.block_size),
                )
                if not p.background:  # a synchronous load that reads L3 (not planned so)
                    self.loads.wait(load)
                continue
            for i, (b, s) in enumerate(zip(p.block_ids, p.slots)):
                if not self.holds(s, p.hashes[i]):
                    # A prefix stays a prefix: vLLM recomputes from the first failed block.
                    self.fail_blocks(p.block_ids[i:], p.req_id)
                    break
                pairs.append((b, s))
        if pairs:
            assert self.host is not None
            if self.options.layerwise_loads and self.layers.usable:
                self.layers.start(pairs, self.host)
            else:
                self.copy_in(pairs, self.host)

    def wait_layer(self, layer_name: str) -> None:
        self.layers.wait(layer_name)

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """`get_finished`: (requests whose write-back stores ran this step, requests whose
        asynchronous loads ended: landed, partly landed or dropped after an abort)."""
        self.layers.finish()
        saved, self._saved = self._saved, set()
        return saved, self.loads.poll(finished_req_ids)

    def save(self, meta: HiCacheMetadata) -> None:
        """L1 -> L2 copies of the pages computed this step, then their L3 write-through."""
        import torch

        self.layers.finish()
        self._saved.update(meta.saving)
        if not meta.store_slots:
            return
        host = self._ensure_host(meta)
        for s in meta.store_slots:
            self.loads.take(s)
        si = torch.tensor(meta.store_slots, dtype=torch.long)
        blocks = [
            torch.tensor([row[g] for row in meta.store_blocks], dtype=torch.long)
            for g in range(len(self.geometry.parts))
        ]
        for plane, off, g in zip(self.planes, self.offsets, self.plane_group):
            host[si, off : off + plane.shape[1]] = plane[blocks[g]]
        for s, h in zip(meta.store_slots, meta.store_hashes):
            self.valid[s] = True
            self.slot_hash[s] = h
        self.stats.add("l2_store_pages", len(meta.store_slots))
        self.stats.add("l2_store_bytes", len(meta.store_slots) * self.geometry.page_bytes)
        if self.storage is not None and self.options.storage_write:
            if not self.storage.namespace.writes:
                return
            hashes = list(meta.store_hashes)
            fut = self.storage.set_from_async(hashes, [self._page(s) for s in meta.store_slots])
            fut.add_done_callback(lambda f: self._count_upload(f, hashes))
            for s in meta.store_slots:
                self.uploads[s] = fut

    def _count_upload(self, fut: concurrent.futures.Future[int], hashes: list[str]) -> None:
        """On the storage loop's thread: `set_from` wrote the first `n` pages (a prefix)."""
        n = 0
        if not fut.cancelled() and fut.exception() is None:
            n = max(0, min(len(hashes), int(fut.result())))
        self.stats.add("l3_write_pages", n)
        self.stats.add("l3_write_bytes", n * self.geometry.page_bytes)
        self.stats.add("l3_write_failures", len(hashes) - n)
        with self._acks_lock:
            self._uploaded.extend(hashes[:n])
            self._upload_failed.extend(hashes[n:])

    def take_uploads(self) -> tuple[list[str], list[str]]:
        """(L3 writes that landed, that failed) since the last call."""
        with self._acks_lock:
            done, self._uploaded = self._uploaded, []
            failed, self._upload_failed = self._upload_failed, []
        return done, failed

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call (several groups only)."""
        failed, self.failed = self.failed, set()
        return failed

    def take_bad(self) -> set[tuple[int, str]]:
        bad, self.bad = self.bad, set()
        return bad

    def shutdown(self) -> None:
        self.layers.close()
        self.loads.close()
        for slot in list(self.uploads):
            self.settle_upload(slot)
        if self.storage is not None:
            self.storage.close()
            self.storage = None
