"""Control-plane cost per request: the full actor path against the same cores driven directly.

Both sides replay the same trace over L1 + L2 (200k device, 400k host tokens by default) with
real bytes moved for every backup and load-back (a small KV geometry), in scheduler steps of
`--batch` requests:

- actors: `HiCache` with its batched calls (match, load back, allocate, insert), CPU streams;
- direct: one task calling `RadixTree`, two `SlotLedger`s and the transfer functions in a loop,
  the same policy (write_through, LRU), no messages.

It prints microseconds per request for both (best of `--repeat` alternating runs) and their
ratio (target <= 1.2), plus hit rates as a check that both did the same work.

    python bench/control_plane.py [--limit N] [--batch B] [--page-size P] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio
import numpy as np

from hicache import CacheConfig, HiCache
from hicache.cli.trace import read_trace
from hicache.components.controller.ledger import SlotLedger
from hicache.kernels import DevicePool, HostPool, parse_geometry, run_backup, run_load_layer
from hicache.kernels.engines import CpuEngine
from hicache.kernels.indices import plan_transfer
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree

# The clock the steps are timed with: wall time, or this process's CPU time (`--clock cpu`:
# on a machine shared with other jobs wall time mostly measures the neighbours).
CLOCK = [time.perf_counter]

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def steps(requests, batch: int, budget: int):
    step, tokens = [], 0
    for r in requests:
        if step and (len(step) == batch or tokens + r.input_length > budget):
            yield step
            step, tokens = [], 0
        step.append(r)
        tokens += r.input_length
    if step:
        yield step


async def actor_path(cfg: CacheConfig, requests, batch: int) -> tuple[float, int, int]:
    elapsed = 0.0
    async with HiCache(cfg) as cache:
        layers = cache.device_pool.geometry.layers
        for step in steps(requests, batch, cfg.device_tokens // 2):
            toks = [(f"r{r.index}", r.tokens(512)) for r in step]
            t0 = CLOCK[0]()
            await cache.match_many(toks)
            loads = await cache.load_back_many([rid for rid, _ in toks])
            for lb in loads:
                if lb.handle is not None:
                    await lb.handle.wait_async(layers - 1)
            news = await cache.allocate_many(
                (lb.rid, len(t) - len(lb.device_slots)) for (_, t), lb in zip(toks, loads)
            )
            await cache.cache_many(
                (lb.rid, t, np.concatenate([lb.device_slots, new]), True)
                for (_, t), lb, new in zip(toks, loads, news)
            )
            elapsed += CLOCK[0]() - t0
        t0 = CLOCK[0]()
        await cache.flush()
        stats = await cache.stats()
        elapsed += CLOCK[0]() - t0
    return elapsed, stats.device.hit_tokens, stats.host.hit_tokens


def direct_path(cfg: CacheConfig, requests, batch: int) -> tuple[float, int, int]:
    """The same work through the cores alone, in one task: what the actors cost on top."""
    geometry = parse_geometry(cfg.kv)
    device = DevicePool.allocate(geometry, cfg.device_tokens, cfg.page_size)
    host = HostPool(device, cfg.host_capacity, cfg.layout)
    tree = RadixTree(
        page_size=cfg.page_size,
        eviction=make_strategy(cfg.eviction),
        write_policy=write_policy(cfg.write_policy),
    )
    dled = SlotLedger(size=cfg.device_tokens, page_size=cfg.page_size, tier="device")
    hled = SlotLedger(size=cfg.host_capacity, page_size=cfg.page_size, tier="host")
    page = cfg.page_size
    engine = CpuEngine()
    device_hit = host_hit = 0
    now = 0.0

    def alloc_host(n):
        slots = hled.alloc(n)
        if slots is None:
            ev = tree.evict_host(n, now=now)
            if len(ev.freed):
                hled.free(ev.freed)
            slots = hled.alloc(n)
        return slots

    def alloc_device(n):
        if n == 0:
            return np.empty(0, dtype=np.int64)
        slots = dled.alloc(n)
        if slots is None:
            ev = tree.evict_device(n, now=now)
            if len(ev.freed):
                dled.free(ev.freed)
            if len(ev.freed_host):
                hled.free(ev.freed_host)
            slots = dled.alloc(n)
        return slots

    elapsed = 0.0
    for step in steps(requests, batch, cfg.device_tokens // 2):
        toks = [r.tokens(512) for r in step]
        t0 = CLOCK[0]()
        now += 1.0
        states = []
        for t in toks:
            m = tree.match(t, now=now)
            tree.lock(m.last_node)
            prefix = m.device_slots
            device_hit += len(prefix)
            if m.host_len >= cfg.load_back_threshold:
                plan = tree.plan_load_back(m.last_node)
                slots = alloc_device(plan.num_tokens)
                if slots is not None:
                    tree.commit_load_back(plan, slots)
                    xfer = plan_transfer(host, device, plan.host_slots, slots)
                    for layer in range(geometry.layers):
                        run_load_layer(xfer, host, device, layer, cfg.io_backend, engine)
                    prefix = np.concatenate([prefix, slots])
                    host_hit += plan.num_tokens
            states.append((m.last_node, prefix))
        for t, (node, prefix) in zip(toks, states):
            n = len(t) - len(prefix)
            new = alloc_device(-(-n // page) * page)
            slots = np.concatenate([prefix, new[:n]])
            aligned = len(t) // page * page
            res = tree.insert(t[:aligned], slots[:aligned], now=now)
            dup = slots[len(prefix) : max(len(prefix), res.prefix_len)]
            if len(dup):
                dled.free(dup)
            tail = np.concatenate([slots[aligned:], new[n:]])
            if len(tail):
                dled.free(tail)
            for cand in res.backup_candidates:
                if not tree.needs_backup(cand):
                    continue
                hs = alloc_host(tree.num_tokens(cand))
                if hs is None:
                    continue
                tree.begin_backup(cand, hs)
                xfer = plan_transfer(host, device, hs, tree.device_slots(cand))
                run_backup(xfer, device, host, cfg.io_backend, engine)
                tree.end_backup(cand, ok=True)
            tree.unlock(node)
        elapsed += CLOCK[0]() - t0
    return elapsed, device_hit, host_hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device-tokens", type=int, default=200_000)
    ap.add_argument("--host-tokens", type=int, default=400_000)
    ap.add_argument("--kv", default="mha:2:1:32:float16")
    ap.add_argument(
        "--cpu-transfers",
        choices=("thread", "inline"),
        default="inline",
        help="the cache's CPU copies: a worker thread per direction, or inline",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each path, alternating; the best of each is reported",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time the steps by wall clock, or by this process's CPU time (a shared machine)",
    )
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    requests = read_trace(args.trace, limit=args.limit)
    device_tokens = args.device_tokens // args.page_size * args.page_size
    host_tokens = args.host_tokens // args.page_size * args.page_size
    cfg = CacheConfig(
        kv=args.kv,
        page_size=args.page_size,
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        write_policy="write_through",
        eviction="lru",
        cpu_transfers=args.cpu_transfers,
    )
    direct_runs, actor_runs = [], []
    for _ in range(args.repeat):  # alternate, so drift on a shared machine hits both alike
        direct_runs.append(direct_path(cfg, requests, args.batch))
        actor_runs.append(anyio.run(actor_path, cfg, requests, args.batch))
    direct_s, d_dev, d_host = min(direct_runs)
    actor_s, a_dev, a_host = min(actor_runs)
    n = len(requests)
    tokens = sum(r.input_length for r in requests)
    print(
        f"trace {Path(args.trace).name}: {n} requests, batch {args.batch}, page {args.page_size}, "
        f"{device_tokens} device + {host_tokens} host tokens, kv {args.kv}, "
        f"cache CPU transfers: {args.cpu_transfers}, clock: {args.clock}"
    )
    print(f"{'path':<8} {'us/request':>11} {'L1 hit':>8} {'L2 hit':>8}")
    print(
        f"{'direct':<8} {direct_s / n * 1e6:>11.1f} {d_dev / tokens:>8.4f} {d_host / tokens:>8.4f}"
    )
    print(
        f"{'actors':<8} {actor_s / n * 1e6:>11.1f} {a_dev / tokens:>8.4f} {a_host / tokens:>8.4f}"
    )
    print(f"ratio actors/direct: {actor_s / direct_s:.2f}  (target <= 1.2)")


if __name__ == "__main__":
    main()
