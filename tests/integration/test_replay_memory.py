"""A long replay keeps its memory flat: the process's resident set after a warm-up and at the
end of thousands more requests differ by little, and the cache's bookkeeping tables and
ledgers are empty at close. Something kept per request (a table entry, a request's tokens, an
event) would grow with the count; what the tiers hold is bounded by their sizes, reached during
the warm-up.

The replay loop is `hicache replay`'s own (`hicache.cli.replay.command.replay`), in this
process, with a small geometry, no verification, and the trace cycled to the count needed."""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

import hicache.cli.replay.command as replay_command
from hicache.backends.memory import MemoryStore
from hicache.cache import HiCache
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest, read_trace
from hicache.config import CacheConfig

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_TOKENS = 512
GROWTH_BYTES = 30 << 20  # the most the resident set may grow after the warm-up

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc"
)


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cycled(requests: list[TraceRequest], count: int) -> list[TraceRequest]:
    """`count` requests: the trace over and over, each with an index (request id) of its own."""
    return [dataclasses.replace(requests[i % len(requests)], index=i) for i in range(count)]


class RecordingCache(HiCache):
    """A `HiCache` that remembers itself, so its tables can be read after the replay closed it."""

    opened: list[HiCache] = []  # noqa: RUF012 - reset by each test

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        RecordingCache.opened.append(self)


def long_replay(
    monkeypatch: pytest.MonkeyPatch, cfg: CacheConfig, count: int, warmup: int
) -> tuple[Tally, int, int]:
    """Replay `count` requests; the resident set once `warmup` are done and at the end (after
    the cache closed), each after a full garbage collection."""
    monkeypatch.setattr(replay_command, "HiCache", RecordingCache)
    RecordingCache.opened = []
    requests = cycled(read_trace(TRACE, block_tokens=BLOCK_TOKENS), count)
    warm: list[int] = []
    frozen: list[int] = []

    def on_step(tally: Tally) -> None:
        frozen.append(gc.get_freeze_count())
        if not warm and tally.requests >= warmup:
            gc.collect()
            warm.append(rss_bytes())

    async def main() -> Tally:
        tally, _ = await replay_command.replay(
            cfg,
            requests,
            block_tokens=BLOCK_TOKENS,
            batch=8,
            verify=False,
            log=None,
            progress=lambda done: None,
            on_step=on_step,
        )
        return tally

    tally = anyio.run(main)
    # What existed at the start is out of the collector's reach while the run lasts (full
    # collections stay cheap), and given back to it at the end: nothing stays frozen.
    assert min(frozen) > 0 and gc.get_freeze_count() == 0
    gc.collect()
    end = rss_bytes()
    (cache,) = RecordingCache.opened
    assert cache.close_tables is not None and cache.close_report is not None  # it closed
    assert {name: n for name, n in cache.close_tables.items() if n} == {}
    assert {tier: v["used"] for tier, v in cache.close_report.items() if v["used"]} == {}
    assert tally.requests == count
    return tally, warm[0], end


def config(**overrides: Any) -> CacheConfig:
    base: dict[str, Any] = dict(
        kv="mha:1:1:8:float16",
        page_size=64,
        device_tokens=65536,
        host_tokens=131072,
        model_id="replay",
    )
    return CacheConfig(**{**base, **overrides})


@pytest.mark.slow
@pytest.mark.timeout(600)  # 12k requests: over two minutes on a busy 2-core machine
def test_rss_is_flat_over_twelve_thousand_requests_without_storage(monkeypatch):
    tally, warm, end = long_replay(monkeypatch, config(), count=12_000, warmup=2_000)
    assert tally.device_hit > 0 and tally.host_hit > 0  # the tiers were used, and evicted
    assert end - warm < GROWTH_BYTES, f"{warm >> 20} MiB after the warm-up, {end >> 20} MiB at end"


@pytest.mark.slow
def test_rss_is_flat_with_a_full_memory_store(monkeypatch):
    # 16 MiB of 2 KiB pages: full within the first hundred requests, evicting from then on
    store = MemoryStore(capacity_bytes=16 << 20)
    cfg = config(storage="memory", extra={"store": store})
    tally, warm, end = long_replay(monkeypatch, cfg, count=2_000, warmup=500)
    assert tally.storage_hit > 0
    assert store.evictions > 0 and store.nbytes <= 16 << 20
    assert end - warm < GROWTH_BYTES, f"{warm >> 20} MiB after the warm-up, {end >> 20} MiB at end"
