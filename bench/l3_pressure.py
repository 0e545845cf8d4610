"""L3 under pressure: the time in cache calls and the hit rate with a store uncapped, at its
cap, small, and on a full filesystem, each against the uncapped store of the same run.

Rows (`hicache replay`, the replay's defaults otherwise, each a subprocess writing `--json`):
- `--limit N`, a file store in a fresh RAM directory, uncapped: the reference, and the working
  set (the bytes it ends up holding);
- the same, capped at 1/10 of that working set (a store at its cap from early on);
- `--limit M` uncapped: the reference for the two small rows;
- `--limit M` capped at 36 MB;
- `--limit M` on a full filesystem: a 40 MB tmpfs mounted for the run (needs root and
  `mount`; the row says so where it cannot mount one).
The rows run in rounds (`--rounds`), alternating, so the machine's drift falls on all of
them alike; the table shows each row's median time in cache calls and its ratio to its
reference, its hit rate (and from L3), the pages dropped on the way to L3 and the store's
errors. Where `hicache sweep` models a capped L3, the 1/10 row is also set beside the sweep's
LRU hit rate at that size.

Run: python bench/l3_pressure.py [--limit 1000] [--small-limit 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HICACHE = [sys.executable, "-m", "hicache.cli.main"]
SMALL_CAP = 36_000_000
FULL_FS = "40m"


def replay(limit: int, storage: str, *extra: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            *HICACHE,
            "replay",
            "--limit",
            str(limit),
            "--storage",
            storage,
            "--quiet",
            "--json",
            out.name,
            *extra,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        with open(out.name) as f:
            summary: dict[str, Any] = json.load(f)
        summary["stderr"] = done.stderr
        return summary


def mount_tmpfs(path: str) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={FULL_FS}", "tmpfs", path],
            capture_output=True,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0


def unmount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--small-limit", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    base = tempfile.mkdtemp(
        prefix="l3-pressure-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    fs = os.path.join(base, "full-fs")
    mounted = mount_tmpfs(fs)
    try:

        def fresh(name: str) -> str:
            path = os.path.join(base, name)
            shutil.rmtree(path, ignore_errors=True)
            return f"file:{path}"

        probe_store = fresh("probe")
        probe = replay(args.limit, probe_store)
        working_set = int(probe["storage_stats"]["stored_bytes"])
        tenth = max(1, working_set // 10)
        values = sum(len(files) for _, _, files in os.walk(probe_store.removeprefix("file:")))
        page_on_disk = working_set // max(values, 1)  # whole blocks, as the store counts them
        rows: list[tuple[str, str, int, str, tuple[str, ...]]] = [
            ("uncapped", "ref-big", args.limit, "uncapped", ()),
            (
                "capped at 1/10 of the working set",
                "ref-big",
                args.limit,
                "tenth",
                ("--storage-max-bytes", str(tenth)),
            ),
            ("uncapped", "ref-small", args.small_limit, "uncapped", ()),
            (
                "capped at 36 MB",
                "ref-small",
                args.small_limit,
                "small",
                ("--storage-max-bytes", str(SMALL_CAP)),
            ),
        ]
        if mounted:
            rows.append(
                ("a full filesystem (40 MB tmpfs)", "ref-small", args.small_limit, "full", ())
            )
        results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(rows))}
        for _ in range(args.rounds):
            for i, (_, _, limit, kind, extra) in enumerate(rows):
                if kind == "full":
                    shutil.rmtree(os.path.join(fs, "store"), ignore_errors=True)
                    storage = f"file:{fs}/store"
                else:
                    storage = fresh(f"row{i}")
                results[i].append(replay(limit, storage, *extra))
        refs = {"ref-big": 0, "ref-small": 2}
        med = {
            i: statistics.median(r["control_us_per_request"] for r in runs)
            for i, runs in results.items()
        }
        print(f"working set of --limit {args.limit}: {working_set:,} bytes; 1/10: {tenth:,}")
        head = f"{'L3':<36} {'limit':>5} {'us/request':>11} {'x ref':>6} {'hit':>7} {'from L3':>8} {'dropped':>9} {'errors':>6}"
        print(head)
        for i, (label, ref, limit, _kind, _extra) in enumerate(rows):
            last = results[i][-1]
            toks = last["input_tokens"] or 1
            dropped = sum(last.get("storage_dropped_pages", {}).values())
            errors = last.get("storage_problems", {}).get("errors", 0)
            print(
                f"{label:<36} {limit:>5} {med[i]:>11,.0f} {med[i] / med[refs[ref]]:>6.2f} "
                f"{last['hit_rate']:>7.4f} {last['hit_tokens']['storage'] / toks:>8.4f} "
                f"{dropped:>9,} {errors:>6}"
            )
        if not mounted:
            print("a full filesystem: not measured (no tmpfs could be mounted here: needs root)")
        # the sweep counts pages, not blocks: an LRU store holding as many pages
        sweep = sweep_lru(args.limit, tenth // page_on_disk * 64)
        if sweep is not None:
            got = results[1][-1]["hit_tokens"]["storage"] / (results[1][-1]["input_tokens"] or 1)
            print(f"1/10 cap: L3 hit rate {got:.4f} replayed, {sweep:.4f} in the sweep's LRU model")
        return 0
    finally:
        if mounted:
            unmount(fs)
        shutil.rmtree(base, ignore_errors=True)


def sweep_lru(limit: int, cap_tokens: int) -> float | None:
    """The sweep's L3 hit rate for an LRU store of `cap_tokens` tokens' pages at the replay's
    defaults (64-token pages), where the sweep models a capped L3 (None where it does not)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            *HICACHE,
            "sweep",
            "--limit",
            str(limit),
            "--device",
            "200k",
            "--host",
            "2x",
            "--storage",
            str(cap_tokens),
            "--store-policy",
            "lru",
            "--out",
            out,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return None
        import csv

        with open(os.path.join(out, "sweep.csv")) as f:
            rows = list(csv.DictReader(f))
        return float(rows[0]["storage_hit_rate"]) if rows else None


if __name__ == "__main__":
    raise SystemExit(main())
