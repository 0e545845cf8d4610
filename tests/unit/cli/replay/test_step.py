"""One replay step (hicache/cli/replay/step.py): without L3 it loads back only the requests
whose match left tokens in L2, as a scheduler does, and what it loads is still verified."""

from __future__ import annotations

from hicache import HiCache
from hicache.cli.replay.step import Timer, run_step
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest
from hicache.testing import run_virtual, virtual_config

BLOCK = 8  # tokens per trace block: two 4-token pages


def request(index: int, blocks: range) -> TraceRequest:
    return TraceRequest(
        index=index,
        timestamp_ms=0.0,
        input_length=len(blocks) * BLOCK,
        output_length=1,
        hash_ids=tuple(blocks),
    )


def test_load_back_is_asked_only_for_requests_with_l2_tokens():
    asked: list[tuple[str, ...]] = []
    tally = Tally()

    async def main() -> None:
        cfg = virtual_config(device_tokens=64, host_tokens=256, write_policy="write_through")
        async with HiCache(cfg) as cache:
            load_back_many = cache.load_back_many

            async def spy(rids, **kw):
                rids = tuple(rids)
                asked.append(rids)
                return await load_back_many(rids, **kw)

            cache.load_back_many = spy  # type: ignore[method-assign]
            timer = Timer(tally)

            async def step(*requests: TraceRequest) -> None:
                await run_step(cache, list(requests), tally, timer, BLOCK, True, False)
                await cache.flush()  # the backups land: L2 holds a copy of what was cached

            await step(request(0, range(3)))  # cold: nothing in L2, nothing asked
            assert asked == []
            await step(request(1, range(10, 18)))  # fills L1: request 0 lives on in L2 only
            await step(request(2, range(3)), request(3, range(20, 22)))
            # request 2 finds its prefix in L2 and is loaded back; request 3 has none there

    run_virtual(main)
    assert asked == [("r2",)]
    assert tally.loaded > 0 and tally.verified_pages == tally.loaded // 4
    assert tally.corrupt_pages == 0
    assert tally.requests == 4
