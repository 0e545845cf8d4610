"""Replay the Mooncake trace through the tree core alone, next to a plain-Python reference radix cache.

Each request: match its tokens, lock the matched prefix, allocate slots for the rest (evicting L1 as
needed), insert, free duplicates, lock the new path for "compute", unlock. Block id ``h`` stands for
tokens ``h*512 .. h*512+511``; a request's tokens are cut to its ``input_length``. Only the tree calls
are timed (key building, allocation and freeing are not).

    python bench/tree.py [--trace PATH] [--limit N] [--page-sizes 1 64] [--capacities 200000 1000000]

Prints, per page size and capacity: µs per match / insert / evict (mean, p50, p99), token hit rate
next to the trace's infinite-capacity bound, Python memory per cached page (tracemalloc, in a second
replay; the reference's only with --reference-memory), and the reference's times divided by the core's (> 1: the core is faster).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_radix import ReferenceRadixCache

from hicache.components.controller.ledger import SlotLedger
from hicache.policies.eviction import LRU
from hicache.policies.write import WRITE_THROUGH_SELECTIVE
from hicache.radix.tree import RadixTree

BLOCK = 512
INFINITE_CAPACITY_HIT_RATE = 0.651  # of this trace, from the issue
REPO_TRACE = Path(__file__).resolve().parent.parent / "data" / "mooncake_synthetic_trace.jsonl"
SHARED_TRACE = Path("/work/shared/data/mooncake_synthetic_trace.jsonl")
_OFFSETS = np.arange(BLOCK, dtype=np.uint32)


def load_trace(path: Path, limit: int | None) -> list[tuple[int, list[int]]]:
    out = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append((int(row["input_length"]), list(row["hash_ids"])))
    return out


def tokens(length: int, blocks: list[int]) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.uint32)[:, None] * BLOCK + _OFFSETS
    return ids.reshape(-1)[:length]


class Timings:
    def __init__(self) -> None:
        self.match: list[int] = []
        self.insert: list[int] = []
        self.evict: list[int] = []
        self.hit = 0
        self.total = 0

    @staticmethod
    def stats(ns: list[int]) -> tuple[float, float, float]:
        if not ns:
            return (0.0, 0.0, 0.0)
        a = np.asarray(ns) / 1000
        return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def replay_core(trace, page_size: int, capacity: int) -> tuple[Timings, object, SlotLedger]:
    ledger = SlotLedger(size=capacity, page_size=page_size, tier="device")
    tree = RadixTree(page_size=page_size, eviction=LRU(), write_policy=WRITE_THROUGH_SELECTIVE)
    t = Timings()
    clock = time.perf_counter_ns
    for i, (length, blocks) in enumerate(trace):
        key = tokens(length, blocks)
        n = length - length % page_size
        t0 = clock()
        m = tree.match(key, now=float(i))
        t1 = clock()
        t.match.append(t1 - t0)
        hit = m.device_slots.size
        t.hit += hit
        t.total += length
        tree.lock(m.last_node)
        new = ledger.alloc(n - hit)
        if new is None:
            t0 = clock()
            ev = tree.evict_device(n - hit - ledger.available, now=float(i))
            t.evict.append(clock() - t0)
            ledger.free(ev.freed)
            new = ledger.alloc(n - hit)
        slots = np.concatenate([m.device_slots, new])
        slots.flags.writeable = False
        t0 = clock()
        r = tree.insert(key[:n], slots, now=float(i))
        t.insert.append(clock() - t0)
        ledger.free(r.duplicate_slots[hit:])  # the first `hit` were the tree's own
        tree.lock(r.last_node)
        tree.unlock(m.last_node)
        tree.unlock(r.last_node)  # "compute" done
    return t, tree, ledger


def replay_reference(trace, page_size: int, capacity: int) -> tuple[Timings, object, SlotLedger]:
    ledger = SlotLedger(size=capacity, page_size=page_size, tier="device")
    cache = ReferenceRadixCache(page_size)
    t = Timings()
    clock = time.perf_counter_ns
    for i, (length, blocks) in enumerate(trace):
        key = tokens(length, blocks).tolist()
        n = length - length % page_size
        t0 = clock()
        value, last = cache.match(key, float(i))
        t1 = clock()
        t.match.append(t1 - t0)
        hit = len(value)
        t.hit += hit
        t.total += length
        cache.lock(last)
        new = ledger.alloc(n - hit)
        if new is None:
            t0 = clock()
            freed = cache.evict(n - hit - ledger.available)
            t.evict.append(clock() - t0)
            ledger.free(np.concatenate(freed))
            new = ledger.alloc(n - hit)
        slots = np.concatenate([value, new])
        t0 = clock()
        prefix = cache.insert(key[:n], slots, float(i))
        t.insert.append(clock() - t0)
        ledger.free(slots[hit:prefix])
        cache.unlock(last)
    return t, cache, ledger


def fmt(stats: tuple[float, float, float]) -> str:
    return "{:8.1f} {:8.1f} {:9.1f}".format(*stats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = REPO_TRACE if REPO_TRACE.exists() else SHARED_TRACE
    ap.add_argument("--trace", type=Path, default=default)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--capacities", type=int, nargs="+", default=[200_000, 1_000_000])
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc replays")
    ap.add_argument(
        "--reference-memory", action="store_true", help="also measure the reference's memory (slow)"
    )
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, args.limit)
    print(f"trace {args.trace} ({len(trace)} requests); times in µs; ratio = reference / core")
    for ps in args.page_sizes:
        for requested in args.capacities:
            cap = requested - requested % ps
            print(f"\npage_size={ps} capacity={cap} tokens")
            print(
                f"  {'':10} {'match mean':>10} {'p50':>8} {'p99':>9} | {'insert mean':>11} {'p50':>8} {'p99':>9} "
                f"| {'evict mean':>10} | hit rate (bound {INFINITE_CAPACITY_HIT_RATE}) | bytes/page"
            )
            rows = {}
            for name, replay in (("core", replay_core), ("reference", replay_reference)):
                gc.collect()
                t, structure, ledger = replay(trace, ps, cap)
                pages = ledger.used // ps
                del structure
                mem = ""
                if not args.no_memory and (name == "core" or args.reference_memory):
                    gc.collect()
                    tracemalloc.start()
                    base = tracemalloc.get_traced_memory()[0]
                    _, structure2, ledger2 = replay(trace, ps, cap)
                    ledger_bytes = ledger2._free_pages.nbytes + ledger2._held.nbytes
                    used = tracemalloc.get_traced_memory()[0] - base - ledger_bytes
                    tracemalloc.stop()
                    mem = f"{used / max(1, ledger2.used // ps):10.0f}"
                    del structure2
                rows[name] = t
                print(
                    f"  {name:10} {fmt(t.stats(t.match))} | {' ' * 3}{fmt(t.stats(t.insert))} "
                    f"| {t.stats(t.evict)[0]:10.1f} | {t.hit / max(1, t.total):6.3f} ({pages} pages cached)"
                    f"{' ' * 4}| {mem}"
                )
            c, r = rows["core"], rows["reference"]
            ratio = lambda a, b: b / a if a else float("nan")  # noqa: E731
            cm, rm = c.stats(c.match), r.stats(r.match)
            ci, ri = c.stats(c.insert), r.stats(r.insert)
            print(
                f"  ratio      match mean x{ratio(cm[0], rm[0]):.1f} p50 x{ratio(cm[1], rm[1]):.1f} "
                f"p99 x{ratio(cm[2], rm[2]):.1f} | insert mean x{ratio(ci[0], ri[0]):.1f} "
                f"p50 x{ratio(ci[1], ri[1]):.1f} p99 x{ratio(ci[2], ri[2]):.1f} "
                f"| evict mean x{ratio(c.stats(c.evict)[0], r.stats(r.evict)[0]):.1f}"
            )


if __name__ == "__main__":
    main()
