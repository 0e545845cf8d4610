"""`hicache sweep`: hit rate per tier against capacity, from the control plane alone.

Every point of the grid (L1 sizes x L2 sizes x L3 on/off) replays the trace through the tree
actor's own controller driven synchronously, with instant workers (`hicache/cli/coremodel.py`,
`hicache/testing/instant.py`: no bytes, no actors, no clock), in the scheduler steps of
`hicache replay`. It writes `sweep.csv` (one row per point) and, with matplotlib installed,
`sweep.png` (L1, L2 and L3 hit rates stacked against the L1 size, one panel per L2 size and
L3 setting, the trace's bound dashed).

Sizes: `100k`, `1.5M`, `262144` (tokens, rounded down to whole pages); L2 sizes may also be a
multiple of the L1 size (`2x`). L3: `0` (none), `inf` (an unbounded store), or a capped store:
tokens (`140k`) or bytes (`36MB`, `2GiB`, the framed bytes a store counts, each page sized by
`--kv`), running `--store-policy` as the memory store does (`hicache/policies/storage.py`).

`--hybrid SPEC` (as `hicache replay --hybrid`): a hybrid model's hits depend on the snapshot
bytes kept in the pools, which the control plane alone does not have, so every point is then
`hicache replay --hybrid` itself (real bytes, the pool from `--kv`, L3 an in-memory store,
every page and state verified); the CSV gets the hybrid columns too.

Here: the command. The grid, the points' runs, the CSV and the plot are `grid.py`,
`points.py`, `table.py` and `plot.py` beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from hicache.cli.replay.hybrid import hybrid_kv, parse_hybrid, parse_state_snapshots
from hicache.cli.sweep.grid import fmt_tokens, grid
from hicache.cli.sweep.plot import plot
from hicache.cli.sweep.points import run_hybrid_point, run_point
from hicache.cli.sweep.table import write_csv
from hicache.cli.trace import TraceRequest, bound_hit_rate, read_trace


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    points = grid(args.device, args.host, args.storage, page_size=args.page_size)
    requests = read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
    bound = bound_hit_rate(requests, block_tokens=args.block_tokens, page_size=args.page_size)
    tokens: dict[int, np.ndarray] = {}

    def tokens_of(r: TraceRequest) -> np.ndarray:
        t = tokens.get(r.index)
        if t is None:
            t = tokens[r.index] = r.tokens(args.block_tokens).astype(np.uint32)
        return t

    spec = getattr(args, "hybrid", None)
    model = parse_hybrid(spec, args.page_size, args.kv) if spec is not None else None
    kv = hybrid_kv(args.kv, model) if model is not None else ""
    state_sizes = parse_state_snapshots(getattr(args, "state_snapshots", None), model)
    rows = []
    show = not args.quiet
    for n, point in enumerate(points, 1):
        if model is not None:
            row = run_hybrid_point(
                point,
                requests,
                model,
                spec=spec or "",
                kv=kv,
                block_tokens=args.block_tokens,
                batch=args.batch,
                write_policy=args.write_policy,
                eviction=args.eviction,
                exclusive=args.exclusive,
                bound=bound,
                state_snapshots=state_sizes,
                store_policy=args.store_policy,
            )
        else:
            row = run_point(
                point,
                requests,
                page_size=args.page_size,
                block_tokens=args.block_tokens,
                batch=args.batch,
                write_policy=args.write_policy,
                eviction=args.eviction,
                exclusive=args.exclusive,
                bound=bound,
                tokens_of=tokens_of,
                kv=args.kv,
                store_policy=args.store_policy,
            )
        rows.append(row)
        if show:
            print(
                f"[{n}/{len(points)}] L1 {fmt_tokens(point.device_tokens):>6}  "
                f"L2 {fmt_tokens(point.host_tokens):>6}  L3 {point.storage_label:>5}  "
                f"hit rate {row['hit_rate']:.4f} (L1 {row['device_hit_rate']:.4f}, "
                f"L2 {row['host_hit_rate']:.4f}, L3 {row['storage_hit_rate']:.4f})  "
                f"{row['seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "sweep.csv")
    written = [out / "sweep.csv"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "hicache sweep: matplotlib is not installed (pip install 'hicache[plot]'); "
            "wrote the CSV only",
            file=sys.stderr,
        )
    else:
        title = (
            f"{Path(args.trace).name}: {len(requests)} requests, page {args.page_size}, "
            f"{rows[0]['write_policy']}{', exclusive L2' if args.exclusive else ''}, "
            f"{args.eviction}{f', hybrid {spec}' if spec else ''}"
        )
        by_ratio = all(h.strip().lower().endswith("x") for h in args.host.split(","))
        plot(rows, out / "sweep.png", title=title, by_ratio=by_ratio)
        written.append(out / "sweep.png")
    print(
        f"{len(points)} points in {time.perf_counter() - t_start:.1f} s; bound "
        f"{bound:.4f}; wrote {', '.join(str(p) for p in written)}"
    )
    corrupt = sum(row.get("corrupt_pages", 0) + row.get("corrupt_states", 0) for row in rows)
    return 1 if corrupt else 0
