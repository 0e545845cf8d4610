"""Hit rates and device->host bytes per write policy with L3 (or without), against
write_through in the same run, on the shipped trace or on a multi-turn chat trace.

Each row is `hicache replay --limit N --storage memory --model-id m [--no-verify]
--write-policy P --prefetch-policy Q` (the replay's other defaults: page 64, L1 200k, L2 400k
tokens), in real time: write_through, write_back and write_through_selective with the
replay's wait_complete prefetch, and "defaults" (`CacheConfig`'s own write and prefetch
policies: write_through_selective, timeout). `--chat` replays `hicache.testing.chat`'s
multi-turn chat trace (written to a temporary file) instead of the shipped one;
`--without-l3` replays the same rows with `--storage none`; `--rows` picks rows, among them
write_through_selective with `evict_to_storage=False` and the `best_effort` prefetch policy. Prints each row's hit rate (and
x write_through's), where the hits came from, the trace's bound, d2h bytes (and x write_through's)
and, with verification, the corrupt pages (must be 0).

Run: python bench/write_policies.py [--chat] [--limit 3000] [--no-verify] [--without-l3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anyio

from hicache.cli.main import _REPO_TRACE
from hicache.cli.replay.command import replay
from hicache.cli.trace import bound_hit_rate, read_trace
from hicache.config import CacheConfig
from hicache.testing.chat import multi_turn_chat, write_trace

ROWS = {  # row -> CacheConfig fields (the replay's prefetch policy unless named)
    "write_through": {"write_policy": "write_through", "prefetch_policy": "wait_complete"},
    "write_back": {"write_policy": "write_back", "prefetch_policy": "wait_complete"},
    "write_through_selective": {
        "write_policy": "write_through_selective",
        "prefetch_policy": "wait_complete",
    },
    "defaults": {},
    "write_through_selective (evict_to_storage off)": {
        "write_policy": "write_through_selective",
        "prefetch_policy": "wait_complete",
        "evict_to_storage": False,
    },
    "write_through (best_effort)": {
        "write_policy": "write_through",
        "prefetch_policy": "best_effort",
    },
    "defaults (best_effort)": {"prefetch_policy": "best_effort"},
}


def run(cfg: CacheConfig, requests, verify: bool) -> dict[str, float]:
    tally, extra = anyio.run(
        lambda: replay(
            cfg,
            requests,
            block_tokens=512,
            batch=8,
            verify=verify,
            log=None,
            progress=lambda n: None,
        )
    )
    tokens = tally.input_tokens
    return {
        "hit": (tally.device_hit + tally.host_hit) / tokens,
        "l1": tally.device_hit / tokens,
        "l2": (tally.host_hit - tally.storage_hit) / tokens,
        "l3": tally.storage_hit / tokens,
        "d2h": extra["bytes"]["d2h"],
        "corrupt": tally.corrupt_pages,
        "verified": tally.verified_pages,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chat", action="store_true", help="the multi-turn chat trace")
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--without-l3", action="store_true", help="--storage none")
    ap.add_argument(
        "--rows",
        default=",".join(list(ROWS)[:4]),
        help="rows to run, comma-separated, among: " + "; ".join(ROWS) + " (write_through "
        "runs first whatever is asked: the ratios are to it)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = str(_REPO_TRACE)
        if args.chat:
            trace = os.path.join(tmp, "chat.jsonl")
            write_trace(trace, multi_turn_chat(args.limit))
        requests = read_trace(trace, limit=args.limit, block_tokens=512)
    bound = bound_hit_rate(requests, block_tokens=512, page_size=64)
    base = dict(
        kv="mha:2:1:32:float16",
        page_size=64,
        device_tokens=200_000,
        host_tokens=400_000,
        storage=None if args.without_l3 else "memory",
        model_id="m",
    )
    name = "chat" if args.chat else "shipped"
    print(f"{name} trace, {len(requests)} requests, L3 {'off' if args.without_l3 else 'memory'}")
    print(f"bound {bound:.4f}")
    print(
        "| policy | hit rate | x write_through | from L1 | from L2 | from L3 | d2h bytes "
        "| x write_through | verified / corrupt pages |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ref: dict[str, float] | None = None
    bad = 0
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; known: {list(ROWS)}")
    for row in dict.fromkeys(["write_through", *wanted]):
        r = run(CacheConfig(**base, **ROWS[row]), requests, args.verify)
        ref = ref or r
        bad += int(r["corrupt"])
        print(
            f"| {row} | {r['hit']:.4f} | {r['hit'] / ref['hit']:.3f} | {r['l1']:.4f} | "
            f"{r['l2']:.4f} | {r['l3']:.4f} | {int(r['d2h']):,} | "
            f"{r['d2h'] / max(ref['d2h'], 1):.3f} | {int(r['verified']):,} / {int(r['corrupt'])} |",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
