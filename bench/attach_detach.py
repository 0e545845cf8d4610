"""L3 detached and attached again during a replay: the hit rate per phase, against the same
replay with L3 attached throughout, in one run.

Replays the trace twice with the `hicache replay` defaults (file store in a fresh directory,
every page verified), in deterministic mode (virtual time: both runs are the same until the
detach, whatever else the machine runs): once plain, once detaching L3 after `--detach-at` requests and attaching
the same store again after `--attach-at`. Prints, per phase (before the detach, while
detached, after the attach), the live hit rate ((L1 hits at match + tokens loaded back) /
input tokens) of each run, and the corrupt pages (must be 0).

Run: python bench/attach_detach.py [--detach-at 1300] [--attach-at 2600] [--limit N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache.cli.main import _REPO_TRACE
from hicache.cli.replay.command import replay
from hicache.cli.tally import Tally
from hicache.cli.trace import read_trace
from hicache.config import CacheConfig
from hicache.runtime import run_deterministic


def run(cfg: CacheConfig, requests, marks: tuple[int, ...], **switch) -> tuple[list, Tally]:
    """The replay's running counts at each mark (requests done), and its final tally."""
    seen: list[tuple[int, int, int]] = []

    def on_step(t: Tally) -> None:
        if len(seen) < len(marks) and t.requests >= marks[len(seen)]:
            seen.append((t.requests, t.device_hit + t.loaded, t.input_tokens))

    async def main():
        return await replay(
            cfg,
            requests,
            block_tokens=512,
            batch=8,
            verify=True,
            log=None,
            progress=lambda done: None,
            on_step=on_step,
            **switch,
        )

    tally, _ = run_deterministic(main, seed=0)
    seen.append((tally.requests, tally.device_hit + tally.loaded, tally.input_tokens))
    return seen, tally


def phases(seen: list[tuple[int, int, int]]) -> list[float]:
    out, prev = [], (0, 0, 0)
    for cur in seen:
        out.append((cur[1] - prev[1]) / max(1, cur[2] - prev[2]))
        prev = cur
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detach-at", type=int, default=1300)
    ap.add_argument("--attach-at", type=int, default=2600)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    requests = read_trace(_REPO_TRACE, limit=args.limit, block_tokens=512)
    marks = (args.detach_at, args.attach_at)
    rows = {}
    for name, switch in (
        ("L3 throughout", {}),
        ("detached, attached", {"detach_at": args.detach_at, "attach_at": args.attach_at}),
    ):
        with tempfile.TemporaryDirectory(prefix="hicache-attach-") as tmp:
            cfg = replace(
                CacheConfig(
                    device_tokens=200_000,
                    host_tokens=400_000,
                    kv="mha:2:1:32:float16",
                    write_policy="write_through",
                    prefetch_policy="wait_complete",
                    model_id="replay",
                    deterministic=True,
                ),
                storage=f"file:{tmp}/store",
            )
            seen, tally = run(cfg, requests, marks, **switch)
        rows[name] = (phases(seen), tally)
    print(f"phases: [0, {args.detach_at}) | [{args.detach_at}, {args.attach_at}) | rest")
    for name, (rates, tally) in rows.items():
        cells = " | ".join(f"{r:.4f}" for r in rates)
        print(f"{name:<20} {cells}   corrupt pages {tally.corrupt_pages}, verified "
              f"{tally.verified_pages}")  # fmt: skip
    return 1 if any(t.corrupt_pages for _, t in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
