"""Layer-wise loads: a step's L2 -> L1 copies run layer by layer on a thread of their own, and
vLLM's forward waits for each attention layer's copy (`wait_for_layer_load`) just before that
layer runs, instead of for every layer before the first.

The one thing that could go wrong is a layer vLLM never waits for (a model whose attention
does not go through vLLM's connector hook): its blocks may be read before they land. After the
forward (`finish`, from `wait_for_save` and `get_finished`), a layer that was copied but never
waited for fails every block of the step's loads, so vLLM recomputes them and drops the step's
output for those requests (`kv_load_failure_policy="recompute"`), and copies are synchronous
from then on. Wrong KV is never used; the price is one recomputed step.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Protocol

from hicache.integrations.vllm.compat import log

if TYPE_CHECKING:
    import torch

    from hicache.integrations.vllm.groups import Row
    from hicache.integrations.vllm.layout import Geometry
    from hicache.integrations.vllm.metrics import Counters


class Planes(Protocol):
    """What layer-wise copies need of the worker half (worker.WorkerSide): vLLM's KV as byte
    planes, the layer of each, and its accounts."""

    geometry: Geometry
    planes: list[torch.Tensor]
    offsets: list[int]
    plane_layer: list[str]
    stats: Counters

    def fail_blocks(self, rows: list[Row], req_id: str | None = None) -> None: ...


WAIT_LIMIT_S = 60.0
"""A layer's copy is local memory; past this it counts as never landed (its blocks fail)."""


class LayerCopies:
    """The step's synchronous loads, copied one layer at a time in model order."""

    def __init__(self, worker: Planes) -> None:
        self.w = worker
        self.usable = True  # False after a layer was not waited for: copies become synchronous
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._job: concurrent.futures.Future[None] | None = None
        self._landed: dict[str, threading.Event] = {}
        self._waited: set[str] = set()
        self._blocks: list[Row] = []

    def start(self, pairs: list[tuple[Row, int]], host: torch.Tensor) -> None:
        """One KV cache group only (several: every load is asynchronous, none comes here)."""
        import torch

        w = self.w
        assert not w.geometry.hybrid, "layer-wise loads are for one KV cache group"
        bi = torch.tensor([b[0] for b, _ in pairs], dtype=torch.long)
        si = torch.tensor([s for _, s in pairs], dtype=torch.long)
        order: dict[str, list[int]] = {}
        for k, name in enumerate(w.plane_layer):
            order.setdefault(name, []).append(k)
        self._landed = {name: threading.Event() for name in order}
        self._waited = set()
        self._blocks = [b for b, _ in pairs]

        landed = self._landed

        def copy() -> None:
            try:
                for name, planes in order.items():
                    for k in planes:
                        plane, off = w.planes[k], w.offsets[k]
                        plane[bi] = host[si, off : off + plane.shape[1]]
                    landed[name].set()
            finally:  # never leave the forward waiting on a copy that failed
                for event in landed.values():
                    event.set()

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "hicache-layers")
        self._job = self._pool.submit(copy)
        w.stats.add("l2_load_pages", len(pairs))
        w.stats.add("l2_load_bytes", len(pairs) * w.geometry.page_bytes)

    def wait(self, layer_name: str) -> None:
        landed = self._landed.get(layer_name)
        if landed is None:
            return
        if landed.wait(WAIT_LIMIT_S):  # a failed copy sets every event too: finish() sees it
            self._waited.add(layer_name)

    def finish(self) -> None:
        """After the forward: the copies are done; any layer not waited for fails the step's
        loaded blocks (see the module's docstring)."""
        job, self._job = self._job, None
        if job is None:
            return
        failed = False
        try:
            job.result(WAIT_LIMIT_S)
        except Exception as exc:  # noqa: BLE001 - a failed copy is a load error, never wrong KV
            log.warning("hicache layer-wise load failed: %r", exc)
            failed = True
        missed = sorted(set(self._landed) - self._waited)
        if missed and not failed:
            log.warning(
                "hicache: vLLM ran layers %s without waiting for their loads; those blocks are "
                "recomputed and loads are synchronous from now on",
                missed[:4],
            )
            self.usable = False
        if failed or missed:
            self.w.fail_blocks(self._blocks)
        self._landed, self._waited, self._blocks = {}, set(), []

    def close(self) -> None:
        self.finish()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
