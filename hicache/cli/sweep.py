"""`hicache sweep`: hit rate per tier against capacity, from the control plane alone.

Every point of the grid (L1 sizes x L2 sizes x L3 on/off) replays the trace through the tree
actor's own controller driven synchronously, with instant workers (`hicache/cli/coremodel.py`,
`hicache/testing/instant.py`: no bytes, no actors, no clock), in the scheduler steps of
`hicache replay`. It writes `sweep.csv` (one row per point) and, with matplotlib installed,
`sweep.png` (L1, L2 and L3 hit rates stacked against the L1 size, one panel per L2 size and
L3 setting, the trace's bound dashed).

Sizes: `100k`, `1.5M`, `262144` (tokens, rounded down to whole pages); L2 sizes may also be a
multiple of the L1 size (`2x`). L3: `0` (none) or `inf` (an unbounded store).

`--hybrid SPEC` (as `hicache replay --hybrid`): a hybrid model's hits depend on the snapshot
bytes kept in the pools, which the control plane alone does not have, so every point is then
`hicache replay --hybrid` itself (real bytes, the pool from `--kv`, L3 an in-memory store,
every page and state verified); the CSV gets the hybrid columns too.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from hicache.cli.coremodel import replay_trace
from hicache.cli.hybrid_replay import hybrid_kv, parse_hybrid
from hicache.cli.replay import replay
from hicache.cli.trace import TraceRequest, bound_hit_rate, read_trace
from hicache.config import CacheConfig
from hicache.hybrid import HybridModel

_SUFFIX = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000, "g": 10**9, "G": 10**9}

CSV_FIELDS = (
    "device_tokens",
    "host_tokens",
    "storage",
    "write_policy",
    "eviction",
    "exclusive",
    "page_size",
    "requests",
    "input_tokens",
    "hit_rate",
    "device_hit_rate",
    "host_hit_rate",
    "storage_hit_rate",
    "bound_hit_rate",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "device_evicted_tokens",
    "host_evicted_tokens",
    "rejected_requests",
    "seconds",
)
HYBRID_FIELDS = (
    "hybrid",
    "kv",
    "snapshots_kept",
    "snapshot_hits",
    "snapshot_probes",
    "cut_tokens",
    "verified_pages",
    "corrupt_pages",
    "verified_states",
    "corrupt_states",
)
"""Columns after CSV_FIELDS with --hybrid."""


def parse_tokens(text: str) -> float:
    """`100k`, `1.5M`, `262144` -> tokens; `inf` -> math.inf."""
    t = text.strip()
    if t.lower() in ("inf", "infinite", "unbounded"):
        return math.inf
    scale = 1
    if t and t[-1] in _SUFFIX:
        t, scale = t[:-1], _SUFFIX[t[-1]]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 200k, 1.5M, 262144)") from None
    if not value >= 0:
        raise ValueError(f"not a token count: {text!r}")
    return value


def _pages(tokens: float, page: int) -> int:
    return int(tokens) // page * page


@dataclass(frozen=True, slots=True)
class Point:
    device_tokens: int
    host_tokens: int
    storage: bool

    @property
    def storage_label(self) -> str:
        return "inf" if self.storage else "0"


def grid(device: str, host: str, storage: str, *, page_size: int) -> list[Point]:
    """The points of a sweep, from the comma-separated flags."""
    points: list[Point] = []
    stores = []
    for item in storage.split(","):
        s = item.strip().lower()
        if s in ("0", "none", "off"):
            stores.append(False)
        elif s in ("inf", "infinite", "unbounded", "on"):
            stores.append(True)
        else:
            raise ValueError(
                f"--storage {s!r}: the sweep models L3 as 0 (none) or inf (an unbounded store)"
            )
    for d in device.split(","):
        dev = _pages(parse_tokens(d), page_size)
        if dev <= 0 or math.isinf(parse_tokens(d)):
            raise ValueError(f"--device {d!r}: needs at least one page ({page_size} tokens)")
        for item in host.split(","):
            h = item.strip()
            if h.endswith(("x", "X")):
                try:
                    factor = float(h[:-1])
                except ValueError:
                    raise ValueError(f"--host {h!r}: e.g. 2x, 4x or 400k") from None
                hst = _pages(dev * factor, page_size)
            else:
                hst = _pages(parse_tokens(h), page_size)
            if hst <= dev:
                raise ValueError(
                    f"--host {h!r}: L2 ({hst} tokens) must be larger than L1 ({dev} tokens)"
                )
            points.extend(Point(dev, hst, st) for st in stores)
    return list(dict.fromkeys(points))


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
) -> dict[str, Any]:
    cfg = CacheConfig(
        page_size=page_size,
        device_tokens=point.device_tokens,
        host_tokens=point.host_tokens,
        write_policy=write_policy,
        eviction=eviction,
        exclusive=exclusive,
        prefetch_policy="wait_complete",
    )
    t0 = time.perf_counter()
    tally = replay_trace(
        cfg,
        requests,
        storage=point.storage,
        block_tokens=block_tokens,
        batch=batch,
        tokens_of=tokens_of,
    )
    seconds = time.perf_counter() - t0
    s = tally.summary()
    hits = s["hit_tokens"]
    resolved, _ = cfg.resolve()
    return _row(
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
    )


def _row(
    point: Point,
    *,
    write_policy: str,
    eviction: str,
    exclusive: bool,
    page_size: int,
    requests: int,
    input_tokens: int,
    hits: tuple[int, int, int],
    bound: float,
    evictions: tuple[int, int],
    rejected: int,
    seconds: float,
) -> dict[str, Any]:
    """One CSV row: a point's configuration and its hits (L1, L2, L3 tokens) per tier."""
    tokens = input_tokens or 1
    device, host, storage = hits
    return {
        "device_tokens": point.device_tokens,
        "host_tokens": point.host_tokens,
        "storage": point.storage_label,
        "write_policy": write_policy,
        "eviction": eviction,
        "exclusive": exclusive,
        "page_size": page_size,
        "requests": requests,
        "input_tokens": input_tokens,
        "hit_rate": (device + host + storage) / tokens,
        "device_hit_rate": device / tokens,
        "host_hit_rate": host / tokens,
        "storage_hit_rate": storage / tokens,
        "bound_hit_rate": bound,
        "device_hit_tokens": device,
        "host_hit_tokens": host,
        "storage_hit_tokens": storage,
        "device_evicted_tokens": evictions[0],
        "host_evicted_tokens": evictions[1],
        "rejected_requests": rejected,
        "seconds": round(seconds, 3),
    }


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
) -> dict[str, Any]:
    """One point as `hicache replay --hybrid` (verified, in-memory L3): the row's fields."""
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
        )

    tally, extra = anyio.run(main)
    hy = extra["hybrid"]
    resolved, _ = cfg.resolve()
    row = _row(
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
    )
    more = {
        **hy,
        "hybrid": spec,
        "kv": kv,
        "verified_pages": tally.verified_pages,
        "corrupt_pages": tally.corrupt_pages,
    }
    return {**row, **{k: more.get(k, 0) for k in HYBRID_FIELDS}}


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else CSV_FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a sweep CSV with numbers parsed back."""
    out: list[dict[str, Any]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for k, v in row.items():
                if k in ("storage", "write_policy", "eviction", "hybrid", "kv"):
                    parsed[k] = v
                elif k == "exclusive":
                    parsed[k] = v == "True"
                elif k.endswith("_rate") or k == "seconds":
                    parsed[k] = float(v)
                else:
                    parsed[k] = int(v)
            out.append(parsed)
    return out


def _fmt_tokens(n: float) -> str:
    """Three significant digits: 49984 -> 50.0k, 200000 -> 200k, 1000000 -> 1M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def plot(rows: list[dict[str, Any]], path: Path, *, title: str, by_ratio: bool = True) -> None:
    """Stacked L1/L2/L3 hit rates against the L1 size: one panel per (L2 size, L3); L2 sizes
    are multiples of L1 (`by_ratio`) or token counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    def host_key(row: dict[str, Any]) -> tuple[str, float]:
        if by_ratio:
            return ("x", round(row["host_tokens"] / row["device_tokens"], 2))
        return ("abs", row["host_tokens"])

    hosts = sorted({host_key(r) for r in rows}, key=lambda k: k[1])
    stores = sorted({r["storage"] for r in rows})
    bound = rows[0]["bound_hit_rate"]
    fig, axes = plt.subplots(
        len(stores),
        len(hosts),
        squeeze=False,
        sharex=True,
        sharey=True,
        figsize=(4.2 * len(hosts) + 0.8, 3.4 * len(stores) + 0.9),
    )
    colors = {"device": "#1f77b4", "host": "#ff7f0e", "storage": "#2ca02c"}
    labels = {
        "device": "from L1 (device)",
        "host": "from L2 (host)",
        "storage": "from L3 (storage)",
    }
    xs_all = sorted({r["device_tokens"] for r in rows})
    for i, store in enumerate(stores):
        for j, hk in enumerate(hosts):
            ax = axes[i][j]
            pts = sorted(
                (r for r in rows if r["storage"] == store and host_key(r) == hk),
                key=lambda r: r["device_tokens"],
            )
            if not pts:
                ax.set_visible(False)
                continue
            x = [r["device_tokens"] for r in pts]
            layers = [[r[f"{t}_hit_rate"] for r in pts] for t in ("device", "host", "storage")]
            ax.stackplot(
                x,
                *layers,
                colors=[colors[t] for t in colors],
                labels=[labels[t] for t in labels],
                alpha=0.75,
            )
            ax.plot(x, [r["hit_rate"] for r in pts], "k.-", lw=1, label="total hit rate")
            ax.axhline(
                bound, color="k", ls="--", lw=1, label=f"bound (unlimited capacity) {bound:.3f}"
            )
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(xs_all))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _fmt_tokens(v)))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.tick_params(axis="x", labelrotation=45)
            ax.set_ylim(0, max(1.05 * bound, 0.05))
            ax.grid(True, alpha=0.3)
            l2 = f"L2 = {hk[1]:g} x L1" if hk[0] == "x" else f"L2 = {_fmt_tokens(hk[1])} tokens"
            l3 = "L3 unbounded" if store == "inf" else "no L3"
            ax.set_title(f"{l2}, {l3}", fontsize=10)
            if i == len(stores) - 1:
                ax.set_xlabel("L1 (device) capacity, tokens")
            if j == 0:
                ax.set_ylabel("token hit rate")
    handles, names = next(
        ax for row in axes for ax in row if ax.get_visible()
    ).get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    model = parse_hybrid(spec, args.page_size) if spec is not None else None
    kv = hybrid_kv(args.kv, model) if model is not None else ""
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
            )
        rows.append(row)
        if show:
            print(
                f"[{n}/{len(points)}] L1 {_fmt_tokens(point.device_tokens):>6}  "
                f"L2 {_fmt_tokens(point.host_tokens):>6}  L3 {point.storage_label:>3}  "
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
