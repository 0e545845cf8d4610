"""The `hicache` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hicache.config import EVICTION_POLICIES, PREFETCH_POLICIES, WRITE_POLICIES

_REPO_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description="hierarchical KV cache tools")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a Mooncake-format trace through L1+L2+L3",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--trace", default=str(_REPO_TRACE), help="JSONL trace (Mooncake format)")
    r.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    r.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    r.add_argument("--page-size", type=int, default=64)
    r.add_argument("--device-tokens", type=int, default=200_000)
    r.add_argument("--host-tokens", type=int, default=400_000)
    r.add_argument("--storage", default="file",
                   help="none | memory | file (a temporary directory) | file:DIR | SPEC")
    r.add_argument("--model-id", default="replay",
                   help="the model id in the L3 keys (replays of other traces or geometries "
                        "sharing one store should differ)")
    r.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru")
    r.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through")
    r.add_argument("--exclusive", action="store_true",
                   help="L2 as a victim tier of L1 (implies write_back)")
    r.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="wait_complete")
    r.add_argument("--kv", default="mha:2:1:32:float16",
                   help="mha:LAYERS:HEADS:DIM:DTYPE or mla:LAYERS:RANK:ROPE:DTYPE")
    r.add_argument("--layout", default="page_first")
    r.add_argument("--io", default="kernel", choices=("kernel", "direct"))
    r.add_argument("--cpu-transfers", default=None, choices=("thread", "inline"),
                   help="without CUDA: copies on worker threads or inline (default: the config's)")
    r.add_argument("--batch", type=int, default=8, help="requests per scheduler step")
    r.add_argument("--deterministic", action="store_true",
                   help="virtual time and simulated transfers: identical runs, identical logs")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--events", default=None, help="write the event log (JSON lines) here")
    r.add_argument("--json", default=None, help="write the summary as JSON here")
    r.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check every page that reaches L1 from a lower tier")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "replay":
        from hicache.cli.replay import run

        try:
            return run(args)
        except (ValueError, OSError) as exc:  # bad flags, trace or storage: say which, no trace
            print(f"hicache replay: error: {exc}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
