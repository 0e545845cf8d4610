"""The example serving engine with the cache embedded: exact logits after an L2 round trip, and
a multi-turn workload that hits both tiers and closes with balanced ledgers.

Each scenario runs twice: deterministic (trio on virtual time, virtual streams) and production
(asyncio, CPU streams with a worker thread)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from examples.engine import Completion, Engine
from examples.serve import Workload, cache_config, serve
from examples.tiny_decoder import DecoderConfig, TinyDecoder
from hicache.cache import HiCache
from hicache.runtime import run_deterministic

MODEL = DecoderConfig(layers=2, heads=4, head_dim=16, vocab=256, seed=3)
MODES = ["deterministic", "production"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The engine's per-token matmuls are tiny; more threads only contend on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(mode: str, main):
    if mode == "deterministic":
        return run_deterministic(main, seed=1)
    return anyio.run(main, backend="asyncio")


def assert_exact(model: TinyDecoder, done: Completion) -> None:
    """The logits the engine computed for `done` equal a from-scratch run, bit for bit."""
    assert done.logits is not None and not done.aborted
    computed = len(done.tokens) - 1  # the last generated token is never fed back
    assert done.logits.shape == (computed - done.prefix_len, MODEL.vocab)
    reference = anyio.run(model.reference_logits, list(done.tokens[:-1]))
    assert torch.equal(done.logits, reference[done.prefix_len :])
    # greedy decoding: each generated token is the argmax at the position before it
    assert done.generated == tuple(reference[done.prompt_len - 1 :].argmax(dim=-1).tolist())


@pytest.mark.parametrize("mode", MODES)
def test_logits_with_prefix_loaded_back_from_l2_equal_from_scratch(mode):
    model = TinyDecoder(MODEL)
    rng = np.random.default_rng(7)
    config = cache_config(
        MODEL,
        page_size=16,
        device_tokens=256,
        host_tokens=1024,
        write_policy="write_through",
        deterministic=mode == "deterministic",
    )

    async def main():
        async with HiCache(config) as cache:
            engine = Engine(cache, model, max_running=2, chunk_tokens=32, keep_logits=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.run)
                first = await engine.generate(rng.integers(0, 256, 100), 4, rid="first")
                await cache.flush()  # its write-through backup is in L2
                fillers = [
                    await engine.generate(rng.integers(0, 256, 120), 2, rid=f"fill-{i}")
                    for i in range(3)
                ]  # 3 x 120 tokens push `first` out of a 256-token L1
                follow_up = list(first.tokens) + rng.integers(0, 256, 20).tolist()
                again = await engine.generate(follow_up, 6, rid="again")
                engine.close()
            stats = await cache.stats()
        return first, fillers, again, stats

    first, fillers, again, stats = run(mode, main)
    assert first.prefix_len == 0 and stats.device.evictions > 0
    # `first`'s 96 page-aligned tokens came back from L2, none were left in L1
    assert again.device_hit == 0
    assert again.host_hit == 96 and again.loaded == 96 and again.prefix_len == 96
    for done in (first, *fillers, again):
        assert_exact(model, done)


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_workload_hits_both_tiers_and_closes_balanced(mode):
    model = TinyDecoder(MODEL)
    deterministic = mode == "deterministic"
    workload = Workload(
        conversations=6, turns=3, new_tokens=6, think_time=0.05 if deterministic else 0.0, seed=5
    )
    config = cache_config(
        MODEL,
        page_size=16,
        device_tokens=512,
        host_tokens=4096,
        write_policy="write_through",
        deterministic=deterministic,
    )

    async def main():
        return await serve(config, workload, model=model, keep_logits=True, max_running=4)

    report = run(mode, main)
    e, c = report.engine, report.cache
    assert e.requests == len(report.completions) == 18 and e.aborted == 0
    assert e.device_hit_tokens > 0 and e.loaded_tokens > 0  # both tiers served prefixes
    assert any(d.loaded for d in report.completions)
    assert c.device.evictions > 0
    for done in report.completions:
        assert done.prefix_len == done.device_hit + done.loaded
    computed = sum(d.prompt_len - d.prefix_len for d in report.completions)
    # a preempted request computes part of its prompt twice
    assert computed == e.prefill_tokens if not e.preemptions else computed <= e.prefill_tokens
    # after close every ledger balances (HiCache raises otherwise) and nothing is held
    assert report.close_report and all(t["used"] == 0 for t in report.close_report.values())
    for done in report.completions:
        assert_exact(model, done)


class AbortAtStep(Engine):
    """Aborts one request when the scheduler reaches a given step (mid chunked prefill)."""

    def __init__(self, *args, victim: str, at_step: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.at_step = victim, at_step

    async def step(self) -> None:
        if self.stats.steps == self.at_step:
            self.abort(self.victim)
        await super().step()


def test_aborted_and_oversized_requests_give_back_their_slots():
    model = TinyDecoder(MODEL)
    rng = np.random.default_rng(11)
    config = cache_config(
        MODEL, page_size=16, device_tokens=256, host_tokens=1024, deterministic=True
    )
    long_prompt = rng.integers(0, 256, 200)

    async def main():
        async with HiCache(config) as cache:
            engine = AbortAtStep(
                cache,
                model,
                chunk_tokens=16,
                step_tokens=32,
                keep_logits=True,
                victim="long",
                at_step=4,
            )
            out = {}

            async def client(rid, prompt, new):
                out[rid] = await engine.generate(prompt, new, rid=rid)

            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.run)
                async with anyio.create_task_group() as clients:
                    clients.start_soon(client, "long", long_prompt, 4)
                    clients.start_soon(client, "short", rng.integers(0, 256, 40), 3)
                out["retry"] = await engine.generate(long_prompt, 4, rid="retry")
                out["oversized"] = await engine.generate(
                    rng.integers(0, 256, 300), 2, rid="oversized"
                )
                engine.close()
            stats = await cache.stats()
        return out, stats, cache.close_report

    out, stats, close_report = run_deterministic(main, seed=2)
    assert out["long"].aborted and not out["long"].generated
    assert out["oversized"].aborted  # 300 tokens never fit a 256-token pool
    # the aborted request's chunked-prefill progress stayed in the tree for the retry
    assert out["retry"].device_hit >= 32
    for rid in ("short", "retry"):
        assert_exact(model, out[rid])
    assert stats.inflight["requests"] == 0
    assert all(t["used"] == 0 for t in close_report.values())


def test_deterministic_runs_replay_exactly():
    """Same config, seed and workload: the same requests hit the same tiers, token for token."""
    workload = Workload(conversations=4, turns=3, new_tokens=4, seed=9)
    config = cache_config(MODEL, device_tokens=256, host_tokens=2048, deterministic=True)

    def once():
        report = run_deterministic(
            lambda: serve(config, workload, model=TinyDecoder(MODEL)), seed=3
        )
        done = sorted(report.completions, key=lambda d: d.rid)
        return report.engine, [(d.rid, d.tokens, d.device_hit, d.host_hit, d.loaded) for d in done]

    first, second = once(), once()
    assert first == second
    assert first[0].loaded_tokens > 0
