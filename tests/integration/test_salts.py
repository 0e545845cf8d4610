"""Per-request salts: identical prompts under two salts share no page in L1, L2 or L3, in
every write policy and in exclusive mode; the same salt on two instances over one store does.
On virtual time, with every page the requests read checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hicache import HiCache
from hicache.cli.main import main
from hicache.radix.hashes import chain_page_hashes, salt_seed
from hicache.results import InvalidRequest
from hicache.testing import bad_pages, run_virtual
from tests.integration.storage_helpers import PAGE, compute_into, config, seeds_for, tokens_from
from tests.integration.test_replay_command import SMALL
from tests.integration.test_storage_shared import value_files

TOKENS = tokens_from(0, 32)  # 8 pages


async def write(cache: HiCache, rid: str, tokens: np.ndarray, salt: str | None) -> None:
    """Compute the request's KV past what its salt has cached, and cache it under the salt."""
    await cache.match(rid, tokens, salt=salt)
    lb = await cache.load_back(rid)
    if lb.handle is not None:
        await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
    own = len(lb.device_slots)
    new = await cache.allocate(rid, len(tokens) - own)
    slots = np.concatenate([lb.device_slots, new])
    compute_into(cache)(rid, tokens, slots, own)
    await cache.cache_finished(rid, tokens, slots, salt=salt)


async def seen(cache: HiCache, rid: str, tokens: np.ndarray, salt: str | None) -> tuple[int, int]:
    """(device, host) tokens a match under `salt` finds; the request is released."""
    m = await cache.match(rid, tokens, salt=salt)
    await cache.release(rid)
    return m.device_len, m.host_len


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_two_salts_share_nothing_in_l1_and_l2(policy, exclusive):
    cfg = config(write_policy=policy, exclusive=exclusive, device_tokens=64, host_tokens=256)

    async def main():
        async with HiCache(cfg) as cache:
            for rep in range(3):  # hit more than once: selective policies back up on hits
                await write(cache, f"a{rep}", TOKENS, "tenant-a")
            in_l1 = [await seen(cache, "x", TOKENS, s) for s in ("tenant-b", None, "tenant-a")]
            # Other traffic pushes tenant a's pages out of L1 (into L2 where the policy keeps
            # a copy): its own salt still finds them, no other salt does.
            for k in range(4):
                await cache.system.sleep(1.0)  # virtual time: LRU order, not a tie
                await write(cache, f"c{k}", tokens_from(1000 * (k + 1), 32), "tenant-c")
            await cache.flush()
            in_l2 = [await seen(cache, "y", TOKENS, s) for s in ("tenant-b", None, "tenant-a")]
            cache.system.actors["tree"].controller.shared.tree.check_integrity()
            return in_l1, in_l2

    in_l1, in_l2 = run_virtual(main)
    assert in_l1[0] == (0, 0) and in_l1[1] == (0, 0)
    assert in_l1[2] == (32, 0)
    assert in_l2[0] == (0, 0) and in_l2[1] == (0, 0)
    device, host = in_l2[2]
    assert device == 0  # gone from L1 ...
    assert host == 32  # ... and kept in L2, for tenant a only


async def fetch(cache: HiCache, rid: str, tokens: np.ndarray, salt: str | None):
    """Match, prefetch from L3, load back, check every page the request would read."""
    m = await cache.match(rid, tokens, salt=salt)
    await cache.prefetch(rid, tokens, salt=salt)
    pf = await cache.prefetch_wait(rid)
    lb = await cache.load_back(rid)
    if lb.handle is not None:
        await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
    bad = bad_pages(cache.device_pool, lb.device_slots, seeds_for(tokens), page_size=PAGE, first=0)
    await cache.release(rid)
    return m.device_len, pf.done_tokens, len(lb.device_slots), bad


def test_l3_pages_are_found_only_under_their_salt(tmp_path):
    cfg = config(storage=f"file:{tmp_path}", prefetch_policy="wait_complete")

    async def main():
        async with HiCache(cfg) as first:
            await write(first, "w", TOKENS, "tenant-a")
            await first.flush()
        out = {}
        for salt in ("tenant-b", None, "tenant-a"):  # a new instance each: empty L1 and L2
            async with HiCache(cfg) as second:
                out[salt] = await fetch(second, "r", TOKENS, salt)
        return out

    out = run_virtual(main)
    assert out["tenant-b"] == (0, 0, 0, 0)
    assert out[None] == (0, 0, 0, 0)
    assert out["tenant-a"] == (0, 32, 32, 0)  # same salt, another instance, one store: shared
    # No value is stored under the unsalted chain: a store listing tells nothing of the prompt.
    plain = set(chain_page_hashes(TOKENS, PAGE))
    names = " ".join(value_files(tmp_path))
    assert len(value_files(tmp_path)) == 8
    assert not any(h in names for h in plain)


def test_salted_chain_starts_at_the_salts_seed():
    plain = chain_page_hashes(TOKENS, PAGE)
    salted = chain_page_hashes(TOKENS, PAGE, prior=salt_seed(b"tenant-a"))
    other = chain_page_hashes(TOKENS, PAGE, prior=salt_seed(b"tenant-b"))
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert salted == chain_page_hashes(TOKENS, PAGE, prior=salt_seed(b"tenant-a"))


def test_a_request_keeps_the_salt_it_was_matched_under():
    cfg = config(device_tokens=64, host_tokens=256)

    async def main():
        async with HiCache(cfg) as cache:
            await cache.match("r", TOKENS, salt="tenant-a")
            slots = await cache.allocate("r", 32)
            with pytest.raises(InvalidRequest, match="salt"):
                await cache.cache_finished("r", TOKENS, slots, salt="tenant-b")
            with pytest.raises(InvalidRequest, match="salt"):
                await cache.prefetch("r", TOKENS)
            with pytest.raises(InvalidRequest, match="salt must be"):
                await cache.match("q", TOKENS, salt=3)  # type: ignore[arg-type]
            # Nothing changed: the request still caches under its own salt.
            out = await cache.cache_finished("r", TOKENS, slots, salt="tenant-a")
            again = await seen(cache, "s", TOKENS, "tenant-a")
            return out.new_tokens, again

    new, again = run_virtual(main)
    assert new == 32 and again == (32, 0)


def test_salt_roots_go_with_their_last_page():
    cfg = config(device_tokens=64, host_tokens=128, write_policy="write_through")

    async def main():
        async with HiCache(cfg) as cache:
            tree = cache.system.actors["tree"].controller.shared.tree
            for k in range(6):  # six salts, each pushed out by the next ones
                await write(cache, f"w{k}", tokens_from(100 * k, 32), f"s{k}")
                await cache.flush()
            roots = tree.salts
            tree.check_integrity()
        return roots, tree.salts  # the second after close

    live, at_close = run_virtual(main)
    assert 0 < live < 6  # the oldest salts' roots went with their pages
    assert at_close == 0  # close empties the tree: no salt root is left behind


def test_replay_reports_a_hit_rate_per_salt(tmp_path):
    summary = tmp_path / "summary.json"
    assert main(["replay", *SMALL, "--salts", "3", "--json", str(summary)]) == 0
    out = json.loads(summary.read_text())
    assert set(out["hit_rate_per_salt"]) == {"salt-0", "salt-1", "salt-2"}
    assert out["corrupt_pages"] == 0
