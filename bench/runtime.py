"""Runtime throughput: one-hop messages and request/reply round trips, as ratios to a direct await.

Run: python bench/runtime.py [--n 100000] [--repeats 3]

For each backend, the reference is `await handle(msg)` of an async function doing the same trivial
work, measured in the same process. "ratio" is (runtime rate) / (direct-await rate): 1.0 would be
free; 0.25 means the runtime path costs four direct awaits.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache.runtime import Actor, ActorSystem, Reply, run_deterministic


@dataclass(frozen=True, slots=True)
class Add:
    amount: int


@dataclass(frozen=True, slots=True)
class Get:
    amount: int
    reply: Reply[int]


class Sum(Actor[Add | Get]):
    def __init__(self, capacity: int) -> None:
        super().__init__("sum", capacity=capacity)
        self.total = 0
        self.until = 0
        self.reached: anyio.Event | None = None

    async def handle(self, msg: Add | Get) -> None:
        match msg:
            case Add(amount=amount):
                self.total += amount
                if self.total >= self.until and self.reached is not None:
                    self.reached.set()
            case Get(amount=amount, reply=reply):
                self.total += amount
                reply.set(self.total)


class Direct:
    def __init__(self) -> None:
        self.total = 0

    async def add(self, amount: int) -> int:
        self.total += amount
        return self.total


async def direct_rate(n: int) -> float:
    target = Direct()
    start = time.perf_counter()
    for _ in range(n):
        await target.add(1)
    return n / (time.perf_counter() - start)


async def hop_rate(n: int, capacity: int) -> float:
    actor = Sum(capacity)
    system = ActorSystem()
    system.add(actor)
    async with system:
        actor.until = n
        actor.reached = anyio.Event()
        inbox = actor.inbox
        start = time.perf_counter()
        for _ in range(n):
            await inbox.send(Add(1))
        await actor.reached.wait()
        elapsed = time.perf_counter() - start
    return n / elapsed


async def round_trip_rate(n: int) -> float:
    actor = Sum(16)
    system = ActorSystem()
    system.add(actor)
    async with system:
        inbox = actor.inbox
        start = time.perf_counter()
        for _ in range(n):
            await system.request(inbox, lambda r: Get(1, r))
        elapsed = time.perf_counter() - start
    return n / elapsed


def best(fn, repeats: int) -> float:
    return max(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, repeats = args.n, args.repeats
    print(
        f"python {sys.version.split()[0]}, anyio {version('anyio')}, trio {version('trio')}, n={n}, best of {repeats}"
    )
    print(f"{'backend':<14} {'path':<26} {'ops/s':>12} {'direct ops/s':>13} {'ratio':>7}")
    runs = [
        ("asyncio", lambda f: anyio.run(f, backend="asyncio")),
        ("trio", lambda f: anyio.run(f, backend="trio")),
    ]
    for backend, runner in runs:
        direct = best(lambda: runner(lambda: direct_rate(n)), repeats)
        for label, fn in (
            ("one hop (capacity 1024)", lambda: hop_rate(n, 1024)),
            ("one hop (capacity 16)", lambda: hop_rate(n, 16)),
            ("request/reply", lambda: round_trip_rate(n // 4)),
        ):
            rate = best(lambda: runner(fn), repeats)
            print(
                f"{backend:<14} {label:<26} {rate:>12,.0f} {direct:>13,.0f} {rate / direct:>7.4f}"
            )
    # Deterministic mode pays for its sequencer; shown for scale, not a production path.
    m = max(n // 50, 100)
    direct = best(lambda: run_deterministic(lambda: direct_rate(m)), repeats)
    rate = best(lambda: run_deterministic(lambda: round_trip_rate(m)), repeats)
    print(
        f"{'deterministic':<14} {'request/reply':<26} {rate:>12,.0f} {direct:>13,.0f} {rate / direct:>7.4f}"
    )


if __name__ == "__main__":
    main()
