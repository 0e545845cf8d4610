"""Connectors that restore a hybrid model's KV wrongly on purpose, loaded by module path in
tests/vllm/test_vllm_hybrid.py's negative controls: they show that the tests' bit-for-bit
comparison catches a group that is not restored as the rule says."""

from __future__ import annotations

from typing import Any

from hicache.integrations.vllm import HiCacheConnector
from hicache.integrations.vllm.groups import Row


class SkipSlidingConnector(HiCacheConnector):
    """Loads the full attention group's blocks and leaves the sliding window group's as vLLM
    allocated them (never written): the window before the hit point is missing."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.worker
        assert worker is not None
        sliding = [g for g, p in enumerate(worker.geometry.parts) if p.kind == "sliding"]
        assert sliding, "SkipSlidingConnector needs a model with a sliding window group"
        real = worker.copy_in

        def copy_in(pairs: list[tuple[Row, int]], source: Any) -> None:
            blank = [
                (tuple(0 if g in sliding else b for g, b in enumerate(row)), r) for row, r in pairs
            ]
            real(blank, source)

        worker.copy_in = copy_in  # type: ignore[method-assign]
