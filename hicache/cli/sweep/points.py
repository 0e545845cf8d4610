"""Running `hicache sweep`'s points: each one a replay of the trace, as a CSV row."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import numpy as np

from hicache.cli.coremodel import replay_trace
from hicache.cli.replay.command import replay
from hicache.cli.sweep.grid import Point
from hicache.cli.sweep.table import HYBRID_FIELDS, csv_row
from hicache.cli.trace import TraceRequest
from hicache.config import CacheConfig
from hicache.hybrid import HybridModel
from hicache.policies.storage import DEFAULT_STORE_POLICY
from hicache.testing.instant import framed_page_bytes

__all__ = ["run_hybrid_point", "run_point", "storage_cap_bytes"]


def run_point(
    point: Point,
    requests: list[TraceRequest],
    *,
    page_size: int,
    block_tokens: int,
    batch: int,
    write_policy: str,
    eviction: str,
    exclusive: bool,
    bound: float,
    tokens_of: Callable[[TraceRequest], np.ndarray] | None = None,
    kv: str = "mha:2:1:32:float16",
    store_policy: str = DEFAULT_STORE_POLICY,
) -> dict[str, Any]:
    """One point through the control plane alone (`coremodel.replay_trace`): its CSV row.
    `kv` sizes a page as a store holds it (a capped L3's cap counts those bytes)."""
    cfg = CacheConfig(
        kv=kv,
        page_size=page_size,
        device_tokens=point.device_tokens,
        host_tokens=point.host_tokens,
        write_policy=write_policy,
        eviction=eviction,
        exclusive=exclusive,
        prefetch_policy="wait_complete",
    )
    cap = storage_cap_bytes(point, cfg)
    t0 = time.perf_counter()
    tally = replay_trace(
        cfg,
        requests,
        storage=point.storage,
        storage_capacity=cap,
        store_policy=store_policy,
        block_tokens=block_tokens,
        batch=batch,
        tokens_of=tokens_of,
    )
    seconds = time.perf_counter() - t0
    s = tally.summary()
    hits = s["hit_tokens"]
    resolved, _ = cfg.resolve()
    return csv_row(
        point,
        write_policy=resolved.write_policy,
        eviction=eviction,
        exclusive=exclusive,
        page_size=page_size,
        requests=s["requests"],
        input_tokens=s["input_tokens"],
        hits=(hits["device"], hits["host"], hits["storage"]),
        bound=bound,
        evictions=(s["evictions"]["device"], s["evictions"]["host"]),
        rejected=s["rejected_requests"],
        seconds=seconds,
        store=(cap, store_policy, s["storage"]),
    )


def storage_cap_bytes(point: Point, cfg: CacheConfig) -> int | None:
    """A point's L3 cap in the framed bytes a store counts (None: unbounded or no L3)."""
    page = framed_page_bytes(cfg)
    if point.storage_bytes is not None:
        if point.storage_bytes < page:
            raise ValueError(
                f"--storage {point.storage_label}: smaller than one page ({page} bytes framed "
                f"with --kv {cfg.kv} and --page-size {cfg.page_size})"
            )
        return point.storage_bytes
    if point.storage_tokens is not None:
        return point.storage_tokens // cfg.page_size * page
    return None


def run_hybrid_point(
    point: Point,
    requests: list[TraceRequest],
    model: HybridModel,
    *,
    spec: str,
    kv: str,
    block_tokens: int,
    batch: int,
    write_policy: str,
    eviction: str,
    exclusive: bool,
    bound: float,
    state_snapshots: tuple[int | None, int | None] | None = None,
    store_policy: str = DEFAULT_STORE_POLICY,
) -> dict[str, Any]:
    """One point as `hicache replay --hybrid` (verified, in-memory L3, capped as the point
    says): the row's fields. `state_snapshots` as replay's (a states cache; (None, None):
    sized for each point)."""
    cfg = CacheConfig(
        kv=kv,
        page_size=model.page_size,
        device_tokens=point.device_tokens,
        host_tokens=point.host_tokens,
        write_policy=write_policy,
        eviction=eviction,
        exclusive=exclusive,
        storage="memory" if point.storage else None,
        model_id="sweep",
        prefetch_policy="wait_complete",
    )
    cap = storage_cap_bytes(point, cfg)
    if point.storage:
        cfg = replace(cfg, extra={"capacity_bytes": cap, "policy": store_policy})
    t0 = time.perf_counter()

    async def main() -> tuple[Any, dict[str, Any]]:
        return await replay(
            cfg,
            requests,
            block_tokens=block_tokens,
            batch=batch,
            verify=True,
            log=None,
            progress=lambda done: None,
            hybrid=model,
            state_snapshots=state_snapshots,
        )

    tally, extra = anyio.run(main)
    hy = extra["hybrid"]
    resolved, _ = cfg.resolve()
    row = csv_row(
        point,
        write_policy=resolved.write_policy,
        eviction=eviction,
        exclusive=exclusive,
        page_size=model.page_size,
        requests=tally.requests,
        input_tokens=tally.input_tokens,
        hits=(tally.device_hit, tally.host_hit - tally.storage_hit, tally.storage_hit),
        bound=bound,
        evictions=(extra["evictions"]["device"], extra["evictions"]["host"]),
        rejected=tally.rejected,
        seconds=time.perf_counter() - t0,
        store=(cap, store_policy, None),
    )
    more = {
        **hy,
        "hybrid": spec,
        "kv": kv,
        "verified_pages": tally.verified_pages,
        "corrupt_pages": tally.corrupt_pages,
    }
    return {**row, **{k: more.get(k, 0) for k in HYBRID_FIELDS}}
