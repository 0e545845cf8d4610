"""The `hicache` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("replay", help="replay a request trace through L1+L2+L3")
    args = parser.parse_args(argv)
    if args.command == "replay":
        print("hicache replay: not built yet", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
