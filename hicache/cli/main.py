"""The `hicache` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from hicache.config import EVICTION_POLICIES, WRITE_POLICIES
from hicache.data import default_trace
from hicache.policies.prefetch import PREFETCH_POLICIES
from hicache.policies.storage import DEFAULT_STORE_POLICY, STORE_POLICIES
from hicache.secrets import redact_text

_REPO_TRACE = default_trace()  # a clone's data/, else the copy shipped in the package


_HYBRID_HELP = (
    "a hybrid model's layer groups in model order, comma-separated: full:N, "
    "sliding:N:WINDOW, sliding:N:WINDOW:GRID (only the window kept, in a snapshot every GRID "
    "tokens), recurrent:N:STATE_BYTES:GRID (STATE_BYTES: one snapshot of the N layers, e.g. "
    "64KiB; GRID: tokens between snapshots, a multiple of the page); e.g. "
    "full:1,sliding:3:1024. Requests run one by one through HybridCache; the --kv layer "
    "count is replaced by the layers kept as pages (full, and sliding without a grid), its "
    "heads, dim and dtype kept"
)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: what was wrong, and where to read more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]; the error names the value and rule."""
    rule = (
        f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    parse.__name__ = rule  # argparse names the type in some messages
    return parse


def _token_count(text: str) -> int:
    """An argparse type: a token count (65536, 100k, 1.5M) >= 1, as the sweep reads them;
    rounded down to whole pages once the page size is known (`cli/replay/args.py`'s `cache_config`).
    """
    from hicache.cli.sweep.grid import parse_tokens

    try:
        value = parse_tokens(text)
    except ValueError:
        value = -1.0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count >= 1 (e.g. 65536, 200k, 1.5M)"
        )
    return int(value)


_COUNT = _int_at_least(1)
_PORT = _int_at_least(0, 65535)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache", description="hierarchical KV cache tools")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "replay",
        help="replay a Mooncake-format trace through L1+L2+L3",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--trace", default=str(_REPO_TRACE), help="JSONL trace (Mooncake format)")
    r.add_argument("--limit", type=_COUNT, default=None, help="replay only the first N requests")
    r.add_argument("--block-tokens", type=_COUNT, default=512, help="tokens per trace hash id")
    r.add_argument("--page-size", type=_COUNT, default=64, help="tokens per KV page")
    r.add_argument(
        "--device-tokens",
        type=_token_count,
        default=200_000,
        help="L1 (device) size in tokens (65536, 200k, 1.5M), rounded down to whole pages",
    )
    r.add_argument(
        "--host-tokens",
        type=_token_count,
        default=400_000,
        help="L2 (host) size in tokens, rounded down to whole pages",
    )
    r.add_argument(
        "--storage",
        default="file",
        help="none | memory (in this process, capped: see docs/backends.md) | file (a "
        "temporary directory under --tmp-dir, in RAM by default) | file:DIR | SPEC",
    )
    r.add_argument(
        "--tmp-dir",
        default=None,
        metavar="DIR",
        help="where `--storage file` makes its temporary store, removed at exit (default: "
        "/dev/shm, RAM, when writable; else the system's temporary directory)",
    )
    r.add_argument(
        "--storage-max-bytes",
        default=None,
        help="size cap of a file or memory store (64MiB, 10GB, bytes); default for a file "
        "store: what it holds at open plus 90%% of the filesystem's free space (a cap above "
        "what the filesystem can hold is lowered to that, with a warning); for memory: half "
        "the available memory",
    )
    r.add_argument(
        "--detach-at",
        type=_COUNT,
        default=None,
        metavar="N",
        help="detach L3 at run time once N requests are done (the replay goes on without it)",
    )
    r.add_argument(
        "--attach-at",
        type=_COUNT,
        default=None,
        metavar="M",
        help="attach the same --storage again once M requests are done (M > --detach-at)",
    )
    r.add_argument(
        "--model-id",
        default="replay",
        help="the model id in the L3 keys (replays of other traces or geometries "
        "sharing one store should differ)",
    )
    r.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru", help="eviction policy")
    r.add_argument(
        "--write-policy", choices=WRITE_POLICIES, default="write_through", help="L1 -> L2 -> L3"
    )
    r.add_argument(
        "--exclusive", action="store_true", help="L2 as a victim tier of L1 (implies write_back)"
    )
    r.add_argument(
        "--prefetch-policy",
        choices=PREFETCH_POLICIES,
        default="wait_complete",
        help="when a request stops waiting for L3 -> L2",
    )
    r.add_argument(
        "--kv",
        default="mha:2:1:32:float16",
        help="mha:LAYERS:HEADS:DIM:DTYPE or mla:LAYERS:RANK:ROPE:DTYPE",
    )
    r.add_argument("--hybrid", default=None, metavar="SPEC", help=_HYBRID_HELP)
    r.add_argument(
        "--state-snapshots",
        default=None,
        metavar="L1:L2",
        help="with a recurrent or windowed --hybrid: keep the snapshots in a states cache of their own "
        "with room for L1 and L2 snapshots (auto: one per grid point of L1 and of L2), not in "
        "the K/V pools",
    )
    r.add_argument("--layout", default="page_first", help="the pools' memory layout")
    r.add_argument(
        "--io", default="kernel", choices=("kernel", "direct"), help="how pages are copied"
    )
    r.add_argument(
        "--cpu-transfers",
        default=None,
        choices=("thread", "inline"),
        help="without CUDA: copies on worker threads or inline (default: the config's)",
    )
    r.add_argument("--batch", type=_COUNT, default=8, help="requests per scheduler step")
    r.add_argument(
        "--salts",
        type=_int_at_least(0),
        default=0,
        help="spread requests over N salts (tenants): request i runs under salt-{i %% N}",
    )
    r.add_argument(
        "--pin-first-block",
        nargs="?",
        const="device,host",
        default=None,
        metavar="TIERS",
        help="pin each request's first block (its system prompt) in TIERS "
        "(default device,host; or device, or host) once cached",
    )
    r.add_argument(
        "--deterministic",
        action="store_true",
        help="virtual time and simulated transfers: identical runs, identical logs",
    )
    r.add_argument("--seed", type=int, default=0, help="with --deterministic")
    r.add_argument("--events", default=None, help="write the event log (JSON lines) here")
    r.add_argument("--json", default=None, help="write the summary as JSON here")
    r.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write synthetic KV for every computed token and check every page "
        "that reaches L1 from a lower tier (--no-verify: neither; bytes still move)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument(
        "--secret-env", default=None, help="L3 secret from this environment variable (keyed L3)"
    )
    r.add_argument("--secret-file", default=None, help="L3 secret from this file (keyed L3)")
    r.add_argument(
        "--encrypt-at-rest",
        action="store_true",
        help="encrypt L3 values (AES-256-GCM; needs --secret-env or --secret-file)",
    )
    r.add_argument(
        "--metrics-port",
        type=_PORT,
        default=None,
        help="serve Prometheus metrics on this port (/metrics) while replaying",
    )

    s = sub.add_parser(
        "sweep",
        help="hit rate per tier against capacity, from the cores alone "
        "(no bytes, no actors): a CSV and a PNG",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--trace", default=str(_REPO_TRACE), help="JSONL trace (Mooncake format)")
    s.add_argument("--limit", type=_COUNT, default=None, help="replay only the first N requests")
    s.add_argument("--block-tokens", type=_COUNT, default=512, help="tokens per trace hash id")
    s.add_argument("--page-size", type=_COUNT, default=64, help="tokens per KV page")
    s.add_argument(
        "--device",
        default="100k,200k,400k,1M",
        help="L1 sizes in tokens (100k, 1.5M, 65536), rounded down to whole pages",
    )
    s.add_argument("--host", default="2x,4x", help="L2 sizes: multiples of L1 (2x) or tokens")
    s.add_argument(
        "--storage",
        default="0,inf",
        help="L3 sizes: 0 (none), inf (unbounded), tokens (140k: that many tokens' pages) or "
        "bytes (36MB, 2GiB: the framed bytes a store counts against its cap, pages sized by "
        "--kv)",
    )
    s.add_argument(
        "--store-policy",
        choices=sorted(STORE_POLICIES),
        default=DEFAULT_STORE_POLICY,
        help="admission and eviction of a capped L3 (docs/configuration.md)",
    )
    s.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru")
    s.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through")
    s.add_argument(
        "--exclusive", action="store_true", help="L2 as a victim tier of L1 (implies write_back)"
    )
    s.add_argument("--batch", type=_COUNT, default=8, help="requests per scheduler step")
    s.add_argument(
        "--hybrid",
        default=None,
        metavar="SPEC",
        help="as replay's --hybrid: every point replays through HybridCache with real bytes "
        "(the pool from --kv, L3 an in-memory store), not the control plane alone",
    )
    s.add_argument(
        "--kv",
        default="mha:2:1:32:float16",
        help="the KV geometry, which sizes a page in a capped L3; with --hybrid: the pool's "
        "heads, head dim and dtype (its layer count is the spec's layers kept as pages)",
    )
    s.add_argument(
        "--state-snapshots",
        default=None,
        metavar="L1:L2",
        help="as replay's: the snapshots in a states cache (auto: sized for each point)",
    )
    s.add_argument("--out", default=".", help="directory for sweep.csv and sweep.png")
    s.add_argument("--quiet", action="store_true", help="no line per point")

    c = sub.add_parser("check-log", help="check an event log (JSON lines) for broken invariants")
    c.add_argument("events", help="the event log, as written by --events or configure_logging")
    c.add_argument(
        "--device-tokens",
        type=_COUNT,
        default=None,
        help="the L1 size the log was written with: also check that the tree never "
        "holds more device tokens",
    )
    c.add_argument("--quiet", action="store_true", help="print nothing when the log holds")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # a bad flag (its one line is printed), or --help: the code
        return stop.code if isinstance(stop.code, int) else 2
    if args.command == "replay":
        from hicache.cli.replay.command import run

        try:
            return run(args)
        # bad flags, trace or storage, a missing optional dependency: say which, no traceback
        except (ValueError, OSError, ImportError) as exc:
            print(f"hicache replay: error: {_one_line(redact_text(str(exc)))}", file=sys.stderr)
            return 2
    if args.command == "sweep":
        from hicache.cli.sweep.command import run as run_sweep

        try:
            return run_sweep(args)
        except (ValueError, OSError, ImportError) as exc:
            print(f"hicache sweep: error: {_one_line(str(exc))}", file=sys.stderr)
            return 2
    if args.command == "check-log":
        from hicache.cli.checklog.command import run as run_check

        return run_check(args)
    return 2


def _one_line(message: str) -> str:
    """An error message on one line (a library message may span several)."""
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
