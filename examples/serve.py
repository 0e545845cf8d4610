"""Serve a multi-turn chat workload with the example engine and print a short summary.

    python examples/serve.py                   # asyncio, production mode (CPU streams)
    python examples/serve.py --deterministic   # trio on virtual time, virtual streams

Every conversation shares a system prompt; each turn's prompt is the whole history plus a new
user message, so later turns reuse earlier prefixes. The device pool is small: while one
conversation "thinks", the others push its pages out of L1, and its next turn loads them
back from L2.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np
import torch

from examples.engine import Completion, Engine, EngineStats
from examples.tiny_decoder import DecoderConfig, TinyDecoder
from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.results import CacheStats


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    system_tokens: int = 48  # shared by every conversation
    user_tokens: tuple[int, int] = (16, 40)  # length range of a user message
    new_tokens: int = 12  # generated per turn
    think_time: float = (
        0.05  # seconds between a reply and the next turn (virtual when deterministic)
    )
    seed: int = 0


@dataclass(slots=True)
class Report:
    completions: list[Completion] = field(default_factory=list)
    engine: EngineStats | None = None
    cache: CacheStats | None = None
    close_report: dict | None = None
    seconds: float = 0.0


def cache_config(model: DecoderConfig, **overrides) -> CacheConfig:
    """The example's cache: L1 holds about three conversations, L2 eight times as much."""
    base = dict(
        kv=model.kv_spec,
        page_size=16,
        device_tokens=512,
        host_tokens=4096,
        write_policy="write_through",
        device="cpu",
    )
    return CacheConfig(**{**base, **overrides})


async def conversation(
    engine: Engine, workload: Workload, index: int, out: list[Completion]
) -> None:
    """One user: a turn, a pause, the next turn with the whole history as its prompt."""
    rng = np.random.default_rng([workload.seed, index])
    vocab = engine.model.config.vocab
    history = (
        np.random.default_rng(workload.seed).integers(0, vocab, workload.system_tokens).tolist()
    )
    # Seeded, distinct pauses: no two arrivals share a virtual instant, so the order in which
    # the engine sees requests does not depend on how the event loop orders ready tasks.
    await anyio.sleep(workload.think_time * rng.random())
    for turn in range(workload.turns):
        user = rng.integers(0, vocab, int(rng.integers(*workload.user_tokens, endpoint=True)))
        done = await engine.generate(
            history + user.tolist(), workload.new_tokens, rid=f"c{index}-t{turn}"
        )
        out.append(done)
        history = list(done.tokens)
        await anyio.sleep(workload.think_time * (0.5 + rng.random()))


async def serve(
    config: CacheConfig,
    workload: Workload = Workload(),
    *,
    model: TinyDecoder | None = None,
    keep_logits: bool = False,
    **engine_options,
) -> Report:
    """Run the workload through a fresh cache and engine; return what happened."""
    model = model or TinyDecoder(DecoderConfig(seed=workload.seed))
    report = Report()
    started = time.perf_counter()
    async with HiCache(config) as cache:
        engine = Engine(cache, model, keep_logits=keep_logits, **engine_options)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            async with anyio.create_task_group() as users:
                for i in range(workload.conversations):
                    users.start_soon(conversation, engine, workload, i, report.completions)
            engine.close()
        await cache.flush()
        report.cache = await cache.stats()
    report.close_report = cache.close_report  # ledgers after close (checked to balance)
    report.engine = engine.stats
    report.seconds = time.perf_counter() - started
    return report


def summary(report: Report) -> str:
    e, c = report.engine, report.cache
    assert e is not None and c is not None
    return "\n".join(
        [
            f"requests     {e.requests} ({e.aborted} aborted, {e.preemptions} preemptions) in {e.steps} steps",
            (
                f"prompt       {e.prompt_tokens} tokens: {e.device_hit_tokens} hit in L1, "
                f"{e.loaded_tokens} loaded back from L2, {e.prefill_tokens} computed"
            ),
            (
                f"cache        L1 {c.device.cached_tokens}/{c.device.size} tokens, {c.device.evictions} evicted; "
                f"L2 {c.host.cached_tokens}/{c.host.size} tokens, {c.host.evictions} evicted"
            ),
            (
                f"throughput   {(e.prefill_tokens + e.decode_tokens) / report.seconds:,.0f} tokens/s computed, "
                f"{e.generated_tokens / report.seconds:,.0f} generated/s ({report.seconds:.2f} s wall)"
            ),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deterministic", action="store_true", help="trio on virtual time")
    parser.add_argument("--conversations", type=int, default=Workload().conversations)
    parser.add_argument("--turns", type=int, default=Workload().turns)
    parser.add_argument("--device-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--write-policy", default="write_through")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the model's per-token matmuls are tiny: threads only add overhead
    model_config = DecoderConfig(seed=args.seed)
    config = cache_config(
        model_config,
        device_tokens=args.device_tokens,
        page_size=args.page_size,
        host_tokens=8 * args.device_tokens,
        write_policy=args.write_policy,
        deterministic=args.deterministic,
        seed=args.seed,
    )
    workload = Workload(conversations=args.conversations, turns=args.turns, seed=args.seed)

    async def run() -> Report:
        return await serve(config, workload, model=TinyDecoder(model_config))

    if args.deterministic:
        from hicache.runtime import run_deterministic

        report = run_deterministic(run, seed=args.seed)
    else:
        report = anyio.run(run)
    print(summary(report))


if __name__ == "__main__":
    main()
