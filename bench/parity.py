"""Per-request hit parity between hicache and SGLang's HiCache, and between an exclusive
L1 + L2 and one LRU tier of the same total size (the two hit-rate targets).

Every side writes one JSON line per request ({"i", "len", "l1", "l2"}: input tokens, L1 hit
tokens, tokens loaded back from L2; with --batch > 1 one line per scheduler step):

    # SGLang 0.5.23 (the peer venv's interpreter): sglang_bench.py's Bench.step, per request;
    # --cache hicache (default: UnifiedRadixCache + init_hicache, Rust tree core unless
    # --python-core) or --cache radix (one tier, e.g. --capacity 600000)
    ~/.cache/hicache-peers/sglang/bin/python bench/parity.py sglang --out sg.jsonl
    ~/.cache/hicache-peers/sglang/bin/python bench/parity.py sglang --cache radix \
        --capacity 600000 --out lru600.jsonl

    # hicache: the replay (actors, inline copies), the tree controller driven synchronously
    # with instant workers (what `hicache sweep` runs), or one tier through the tree core alone
    .venv/bin/python bench/parity.py replay --out hc.jsonl [--exclusive] [--batch 8]
    .venv/bin/python bench/parity.py core --out core.jsonl [--exclusive]
    .venv/bin/python bench/parity.py single --capacity 600000 --out one.jsonl

    # the requests where two runs differ (--total: in hits, not in which tier served them)
    python bench/parity.py compare sg.jsonl hc.jsonl [--total]

    # policy experiments, patched into this process only (see _apply_variants)
    .venv/bin/python bench/parity.py replay --variant host-evict-shortfall --out v.jsonl

    # the minimal traces (TINY) where an exclusive L1 + L2 departs from one LRU
    python bench/parity.py tiny --dir /tmp/t
    .venv/bin/python bench/parity.py single --trace /tmp/t/tiny_leaf.jsonl --block-tokens 16 \
        --page-size 16 --capacity 192 --out one.jsonl
    .venv/bin/python bench/parity.py replay --trace /tmp/t/tiny_leaf.jsonl --block-tokens 16 \
        --page-size 16 --capacity 64 --host-tokens 128 --exclusive --out two.jsonl
    python bench/parity.py compare one.jsonl two.jsonl --total

Defaults: 200k L1, 400k L2 (SGLang: hicache_ratio 2.0, which its host pool rounds to 400,064;
one page more makes no difference here), page 64, write_through, LRU, the shipped trace, one
request per step.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
TRACE = ROOT / "data" / "mooncake_synthetic_trace.jsonl"


def _write(rows, out):
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tot = sum(r["len"] for r in rows) or 1
    l1 = sum(r["l1"] for r in rows)
    l2 = sum(r["l2"] for r in rows)
    print(f"{len(rows)} rows  L1 {l1 / tot:.4%}  L2 {l2 / tot:.4%}  total {(l1 + l2) / tot:.4%}")


# ----------------------------------------------------------------------------- SGLang side
def run_sglang(args) -> None:
    sys.path.insert(0, str(PEERS))
    import sglang_bench as sb  # imports sglang: needs the peer venv

    reqs = sb.load_trace(str(args.trace), args.limit)
    cap = (args.capacity + args.page_size - 1) // args.page_size * args.page_size
    b = sb.Bench(
        args.cache,
        cap,
        args.page_size,
        args.eviction,
        args.host_ratio,
        args.write_policy,
        "python" if args.python_core else "rust",
        False,
    )
    rows = []
    for i, (L, hids) in enumerate(reqs):
        h0, l20 = b.hit, b.l2_hit
        b.step(L, hids)
        l2 = b.l2_hit - l20
        rows.append({"i": i, "len": L, "l1": b.hit - h0 - l2, "l2": l2})
    if args.cache == "hicache":
        print(f"host pool: {b.host_size} tokens")
    _write(rows, args.out)


# ----------------------------------------------------------------------------- hicache sides
VARIANTS = (
    "split-stamp",
    "partial-device",
    "partial-host",
    "drop-host-all",
)


def _apply_variants(names) -> None:
    """Policy experiments, patched into the tree core for this process only (nothing under
    hicache/ changes).

    split-stamp: a match or insert that splits a node stamps the lower piece (the suffix
      that was not matched) with the call's `now` too, as SGLang does (UnifiedTreeCore.
      _split_node sets child.last_access_time; the legacy RadixCache stamps the child before
      splitting it). hicache keeps the suffix's old stamp.
    partial-device: exclusive mode: L1 eviction takes whole pages, not whole leaves: the last
      leaf it picks, when larger than what is still needed, is split and only its last pages
      (the ones needed, rounded up to a page) leave L1; the rest stays.
    partial-host: the same for L2 eviction (any mode).
    drop-host-all: exclusive mode: once a load has landed, every loaded node gives up its
      host copy, also one with host-only children (drop_host keeps those today).

    Evicting only the shortfall (L1 and L2) and counting eviction backups in flight, once
    variants here, are what the controller does now (`hicache/components/controller/tiers.py`,
    `allocation.py`).
    """
    from hicache.radix.tree import RadixTree

    if "split-stamp" in names:
        descend, split = RadixTree._descend, RadixTree._split

        def _descend(self, start, key, n, now):
            self._parity_now = now
            return descend(self, start, key, n, now)

        def _split(self, node, num_tokens):
            upper = split(self, node, num_tokens)
            node.last_access = self._parity_now  # the suffix keeps the id: stamp it
            return upper

        RadixTree._descend, RadixTree._split = _descend, _split
    if "partial-device" in names or "partial-host" in names:
        import hicache.radix.eviction as eviction_mod
        from hicache.policies.eviction import evict_in_order as whole_leaves

        state = {"tree": None}

        def by_pages(candidates, *, key, ident, evict, target):
            tree = state["tree"]
            if tree is None:
                return whole_leaves(candidates, key=key, ident=ident, evict=evict, target=target)
            import heapq

            heap = [(key(c), ident(c), c) for c in candidates]
            heapq.heapify(heap)
            freed, page = 0, tree.page_size
            while freed < target and heap:
                _, _, cand = heapq.heappop(heap)
                want = -(-(target - freed) // page) * page
                if cand.num_tokens > want:
                    tree._split(cand, cand.num_tokens - want)  # cand keeps the last `want`
                units, exposed = evict(cand)
                freed += units
                if exposed is not None:
                    heapq.heappush(heap, (key(exposed), ident(exposed), exposed))
            return freed

        eviction_mod.evict_in_order = by_pages
        evict_device, evict_host = RadixTree.evict_device, RadixTree.evict_host

        def partial_device(self, num_tokens, *, now, require_host_copy=False, **kw):
            state["tree"] = self if require_host_copy and "partial-device" in names else None
            try:
                return evict_device(
                    self, num_tokens, now=now, require_host_copy=require_host_copy, **kw
                )
            finally:
                state["tree"] = None

        def partial_host(self, num_tokens, **kw):
            state["tree"] = self if "partial-host" in names else None
            try:
                return evict_host(self, num_tokens, **kw)
            finally:
                state["tree"] = None

        RadixTree.evict_device, RadixTree.evict_host = partial_device, partial_host
    if "drop-host-all" in names:
        from hicache.radix.results import concat

        def drop_host(self, plan):
            freed = []
            for i in reversed(plan.nodes):
                x = self._nodes.get(i)
                if x is None or x.host is None or x.device is None or x.host_ref or x.backup:
                    continue
                self._untrack(x)
                freed.append(x.host)
                x.host = None
                self._track(x)
            return concat(freed)

        RadixTree.drop_host = drop_host


def _config(args):
    from hicache.config import CacheConfig

    return CacheConfig(
        kv="mha:1:1:8:float16",
        page_size=args.page_size,
        device_tokens=args.capacity,
        host_tokens=args.host_tokens,
        eviction=args.eviction,
        write_policy=args.write_policy,
        exclusive=args.exclusive,
        storage=None,
    )


def run_replay(args) -> None:
    import anyio

    _apply_variants(args.variant)
    from hicache.cli.replay.command import replay
    from hicache.cli.trace import read_trace

    requests = read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
    rows = []
    last = {"d": 0, "l": 0, "t": 0}

    def on_step(t):  # batch 1: one request per step
        rows.append(
            {
                "i": len(rows),
                "len": t.input_tokens - last["t"],
                "l1": t.device_hit - last["d"],
                "l2": t.loaded - last["l"],
            }
        )
        last.update(d=t.device_hit, l=t.loaded, t=t.input_tokens)

    async def main():
        return await replay(
            _config(args),
            requests,
            block_tokens=args.block_tokens,
            batch=args.batch,
            verify=False,
            log=None,
            progress=lambda done: None,
            on_step=on_step,
        )

    anyio.run(main)
    _write(rows, args.out)


def run_core(args) -> None:
    import numpy as np

    from hicache.cli import coremodel
    from hicache.cli.trace import read_trace

    _apply_variants(args.variant)
    requests = read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens)
    rows = []
    orig = coremodel._run_step

    def step(model, step_reqs, tally, tokens_of):
        counters = model.controller.counters  # the controller's (an InstantCache drives it)
        d0, h0, t0 = tally.device_hit, counters.host_hit_tokens, tally.input_tokens
        orig(model, step_reqs, tally, tokens_of)
        rows.append(
            {
                "i": len(rows),
                "len": tally.input_tokens - t0,
                "l1": tally.device_hit - d0,
                "l2": counters.host_hit_tokens - h0,
            }
        )

    coremodel._run_step = step
    try:
        coremodel.replay_trace(
            _config(args),
            requests,
            storage=False,
            batch=args.batch,
            block_tokens=args.block_tokens,
            tokens_of=lambda r: r.tokens(args.block_tokens).astype(np.uint32),
        )
    finally:
        coremodel._run_step = orig
    _write(rows, args.out)


def run_single(args) -> None:
    """One tier of --capacity tokens: the tree core and one ledger, as SGLang's bench drives
    its RadixCache (match, lock, evict the shortfall, allocate, insert, free duplicates,
    unlock)."""
    import numpy as np

    from hicache.cli.trace import read_trace
    from hicache.components.controller.ledger import SlotLedger
    from hicache.policies.eviction import make_strategy
    from hicache.policies.write import write_policy
    from hicache.radix.tree import RadixTree

    _apply_variants(args.variant)
    page = args.page_size
    tree = RadixTree(
        page_size=page,
        eviction=make_strategy(args.eviction),
        write_policy=write_policy("write_through"),
    )
    ledger = SlotLedger(size=args.capacity, page_size=page, tier="device")
    rows, clock = [], 0
    for r in read_trace(args.trace, limit=args.limit, block_tokens=args.block_tokens):
        toks = r.tokens(args.block_tokens).astype(np.uint32)
        aligned = len(toks) // page * page
        clock += 1
        m = tree.match(toks[:aligned], now=float(clock))
        tree.lock(m.last_node)
        need = aligned - len(m.device_slots)
        if need > ledger.available:
            ev = tree.evict_device(need - ledger.available, now=float(clock))
            if len(ev.freed):
                ledger.free(ev.freed)
        need = min(need, ledger.available)
        new = ledger.alloc(need) if need else np.empty(0, dtype=np.int64)
        end = len(m.device_slots) + need
        clock += 1
        res = tree.insert(toks[:end], np.concatenate([m.device_slots, new]), now=float(clock))
        dup = res.duplicate_slots[len(m.device_slots) :]
        if len(dup):
            ledger.free(dup)
        tree.unlock(m.last_node)
        rows.append({"i": r.index, "len": r.input_length, "l1": len(m.device_slots), "l2": 0})
    _write(rows, args.out)


# ----------------------------------------------------------------------------- tiny traces
# Minimal traces where an exclusive L1 + L2 departs from one LRU of the same total size.
# One hash id = one page (--block-tokens = --page-size = 16); L1 4 pages, L2 8 pages.
# fmt: off
TINY = {
    # A leaf moves between tiers whole: the 4-page leaf C fills L1, and a 1-page request D
    # pushes all of C into L2, which evicts 4 pages (a0..a3) where one LRU of 12 pages
    # evicts one (a0). The repeat of a1 hits in one LRU and misses in L1 + L2.
    "leaf": [[1], [2], [3], [4], [5], [6], [7], [8],  # a0..a7, one page each
             [20, 21, 22, 23],                        # C: 4 pages, fills L1
             [30],                                    # D: needs 1 page of L1
             [2]],                                    # a1 again
    # The eviction loop backs up more than it needs. After a0..a7 and x, L2 holds a0..a4 and
    # L1 holds a5, a6, a7, x. y needs 2 pages of L1: evict_device(2) lists a5 and a6, whose
    # backups start (L2: 7 of 8 pages). The loop waits for a5's write and asks for the whole
    # 2 pages again: a5 is demoted and, a6 being locked in flight, a7's backup starts (L2
    # full); one page was freed, so it goes round again and starts x's backup, which evicts
    # a0 from L2. a7 and x stay in L1 with L2 copies nobody needs. One LRU of 12 pages holds
    # all 11 pages and hits a0.
    "cascade": [[1], [2], [3], [4], [5], [6], [7], [8],  # a0..a7
                [10],                                    # x
                [11, 12],                                # y: 2 pages
                [1]],                                    # a0 again
    # Structural (no fix here): both tiers full, a0 in L2, L1 = b0..b3; the repeat of a7 is
    # an L2 hit. Its load needs an L1 page, so b0 goes to L2, and L2 has to evict a0 for it:
    # a7's L2 copy is only dropped once the load has landed. One LRU of 12 pages evicts
    # nothing. Without a spare page (or a load that swaps slots in place) a two-tier cache
    # evicts, at every L2 hit with both tiers full, what one LRU evicts a little later.
    "swap": [[1], [2], [3], [4], [5], [6], [7], [8],  # a0..a7 (L2: a0..a3, L1: a4..a7)
             [20], [21], [22], [23],                  # b0..b3: L1 = b0..b3, L2 = a0..a7
             [8],                                     # a7 again: L2 hit
             [1]],                                    # a0 again
}
# fmt: on


def write_tiny(args) -> None:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, reqs in TINY.items():
        lines = (
            json.dumps(
                {"timestamp": i, "input_length": 16 * len(ids), "output_length": 1, "hash_ids": ids}
            )
            + "\n"
            for i, ids in enumerate(reqs)
        )
        (out / f"tiny_{name}.jsonl").write_text("".join(lines))
        print(out / f"tiny_{name}.jsonl")


# ----------------------------------------------------------------------------- compare
def compare(args) -> None:
    a = [json.loads(x) for x in Path(args.a).read_text().splitlines()]
    b = [json.loads(x) for x in Path(args.b).read_text().splitlines()]
    n = min(len(a), len(b))
    shown = 0
    for i in range(n):
        key = (lambda r: r["l1"] + r["l2"]) if args.total else (lambda r: (r["l1"], r["l2"]))
        if key(a[i]) != key(b[i]):
            if shown < args.show:
                print(
                    f"request {i} (len {a[i]['len']}): {args.a}: L1 {a[i]['l1']} L2 {a[i]['l2']}"
                    f"  |  {args.b}: L1 {b[i]['l1']} L2 {b[i]['l2']}"
                )
            shown += 1
    print(f"{shown} of {n} requests differ")
    for name, rows in ((args.a, a[:n]), (args.b, b[:n])):
        tot = sum(r["len"] for r in rows) or 1
        l1, l2 = sum(r["l1"] for r in rows), sum(r["l2"] for r in rows)
        print(f"{name}: L1 {l1 / tot:.4%}  L2 {l2 / tot:.4%}  total {(l1 + l2) / tot:.4%}")


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` is fine
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="side", required=True)
    for name in ("sglang", "replay", "core", "single"):
        p = sub.add_parser(name)
        p.add_argument("--trace", type=Path, default=TRACE)
        p.add_argument("--limit", type=int, default=None)
        p.add_argument("--capacity", type=int, default=200_000, help="L1 tokens")
        p.add_argument("--page-size", type=int, default=64)
        p.add_argument("--eviction", default="lru")
        p.add_argument("--write-policy", default="write_through")
        p.add_argument("--out", required=True)
        if name != "sglang":
            p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id")
        if name == "sglang":
            p.add_argument("--cache", default="hicache", help="hicache | radix (one tier)")
            p.add_argument("--host-ratio", type=float, default=2.0)
            p.add_argument(
                "--python-core",
                action="store_true",
                help="SGLang's Python TreeCore instead of the Rust one",
            )
        elif name == "single":
            p.add_argument("--variant", action="append", default=[], choices=VARIANTS)
        else:
            p.add_argument("--host-tokens", type=int, default=400_000)
            p.add_argument("--exclusive", action="store_true")
            p.add_argument(
                "--batch",
                type=int,
                default=1,
                help="requests per scheduler step (per-request rows need 1)",
            )
            p.add_argument(
                "--variant",
                action="append",
                default=[],
                choices=VARIANTS,
                help="a policy experiment patched into the tree core (repeatable)",
            )
    p = sub.add_parser("tiny", help="write the minimal traces (TINY) as Mooncake JSONL")
    p.add_argument("--dir", default=".")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--show", type=int, default=10)
    p.add_argument(
        "--total",
        action="store_true",
        help="compare hits (L1 + L2) only, not which tier served them",
    )
    args = ap.parse_args()
    {
        "sglang": run_sglang,
        "replay": run_replay,
        "core": run_core,
        "single": run_single,
        "tiny": write_tiny,
        "compare": compare,
    }[args.side](args)


if __name__ == "__main__":
    main()
