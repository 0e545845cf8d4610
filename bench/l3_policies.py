"""L3 admission and eviction policies on the shipped trace: the L3 hit rate of each policy
at caps of 1/10, 1/4 and 1/2 of the working set, from the sizing sweep's model.

The working set is what an unbounded L3 holds at the end of the trace (every page uploaded).
Each cell is one replay of the trace through the sweep's model (`hicache/cli/coremodel.py`:
the tree controller with instant workers, L3 a `StoreBook` counting each page at its framed
size), with `hicache replay`'s default geometry (L1 200k, L2 400k tokens, page 64, kv
mha:2:1:32:float16, write_through, batch 8). The model runs each policy as the memory store
does under the replay (tests/integration/test_sweep.py checks it equals the replay to the
token), so a cell is what a capped memory store with that policy would give. No bytes and
no clock: the figures are exact and the same on every machine.

With `--against-replay`, every capped cell is also replayed for real (`hicache replay`'s
pipeline with actors, a memory store of that capacity and policy, no verification) and the
cell shows both L3 hit rates, model / replay; use it with `--limit` (a full replay per cell).

Run: python bench/l3_policies.py [--limit N] [--policies lru,s3fifo] [--fractions 0.1,0.25]
     [--against-replay]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anyio
import numpy as np

from hicache.cli.coremodel import Tally, replay_trace
from hicache.cli.main import _REPO_TRACE
from hicache.cli.replay.command import replay
from hicache.cli.sweep.grid import fmt_tokens
from hicache.cli.tally import Tally as ReplayTally
from hicache.cli.trace import TraceRequest, read_trace
from hicache.config import CacheConfig
from hicache.policies.storage import DEFAULT_STORE_POLICY, STORE_POLICIES
from hicache.sizing import fmt_bytes
from hicache.testing.instant import framed_page_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(_REPO_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--policies", default=",".join(sorted(STORE_POLICIES)))
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="caps, of the working set")
    ap.add_argument("--against-replay", action="store_true", help="replay every cell too")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in policies if p not in STORE_POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {', '.join(sorted(STORE_POLICIES))}")
    fractions = [float(f) for f in args.fractions.split(",")]
    requests = read_trace(args.trace, limit=args.limit, block_tokens=512)
    cfg = CacheConfig(
        kv="mha:2:1:32:float16",
        page_size=64,
        device_tokens=200_000,
        host_tokens=400_000,
        write_policy="write_through",
        prefetch_policy="wait_complete",
        model_id="replay",
    )
    page = framed_page_bytes(cfg)
    tokens: dict[int, np.ndarray] = {}

    def tokens_of(r: TraceRequest) -> np.ndarray:
        t = tokens.get(r.index)
        if t is None:
            t = tokens[r.index] = r.tokens(512).astype(np.uint32)
        return t

    def run(cap: int | None, policy: str) -> Tally:
        return replay_trace(
            cfg,
            requests,
            storage=True,
            storage_capacity=cap,
            store_policy=policy,
            tokens_of=tokens_of,
        )

    def run_replay(cap: int, policy: str) -> int:
        """Tokens read from L3 in the real replay with a memory store capped at `cap` bytes."""
        real_cfg = replace(cfg, storage="memory", extra={"capacity_bytes": cap, "policy": policy})

        async def go() -> tuple[ReplayTally, dict[str, object]]:
            return await replay(
                real_cfg,
                requests,
                block_tokens=512,
                batch=8,
                verify=False,
                log=None,
                progress=lambda done: None,
            )

        real, _ = anyio.run(go)
        return real.storage_hit

    t0 = time.perf_counter()
    whole = run(None, DEFAULT_STORE_POLICY)
    working = whole.storage_pages
    inputs = whole.input_tokens

    def rate(t: Tally) -> str:
        return f"{t.storage_hit / inputs:.4f}"

    print(
        f"{len(requests)} requests, {inputs:,} input tokens; working set {working:,} pages "
        f"({fmt_tokens(working * cfg.page_size)} tokens, {fmt_bytes(working * page)}, "
        f"{page:,} bytes a page framed); unbounded L3 hit rate {rate(whole)} "
        f"(all tiers {(whole.device_hit + whole.host_hit) / inputs:.4f})"
    )
    caps = [max(1, round(working * f)) for f in fractions]
    header = " | ".join(
        f"1/{round(1 / f)} ({fmt_tokens(c * cfg.page_size)} tok)" for f, c in zip(fractions, caps)
    )
    print(f"\n| policy | {header} |")
    print("|---" * (len(caps) + 1) + "|")
    best: dict[int, tuple[int, str]] = {}
    for policy in policies:
        cells = []
        for cap in caps:
            t = run(cap * page, policy)
            best[cap] = max(best.get(cap, (-1, "")), (t.storage_hit, policy))
            if args.against_replay:
                cells.append(f"{rate(t)} / {run_replay(cap * page, policy) / inputs:.4f}")
                continue
            cells.append(
                f"{rate(t)} ({t.storage_evictions:,} evicted"
                + (f", {t.storage_refused:,} refused)" if t.storage_refused else ")")
            )
        print(f"| {policy} | " + " | ".join(cells) + " |")
    print(
        "\nL3 hit rate: tokens read from L3 / input tokens; best per cap: "
        + ", ".join(f"1/{round(1 / f)} {best[c][1]}" for f, c in zip(fractions, caps))
        + f"; {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
