"""The whole cache, end to end over L1 and L2, on virtual time (deterministic mode)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import CacheConfig, HiCache
from hicache.observability import EventLog
from hicache.results import CapacityError, UnknownRequest
from hicache.testing import (
    FaultPlan,
    ScriptedScheduler,
    bad_prefix_pages,
    fill_kv,
    kv_seeds,
    run_virtual,
    synthetic_compute,
    virtual_config,
)

PAGE = 4


def seeds_for(tokens: np.ndarray) -> np.ndarray:
    return kv_seeds(tokens, PAGE)


compute_into = synthetic_compute
check_prefix = bad_prefix_pages


def conversation(turn: int, base: int) -> np.ndarray:
    """Turn t of a conversation: the previous turns' tokens plus 12 new ones."""
    return np.arange(base, base + 12 * (turn + 1), dtype=np.int64)


def test_multi_turn_pages_go_to_l2_and_come_back_intact():
    log = EventLog(capture=True)

    async def main():
        cfg = virtual_config(device_tokens=48, host_tokens=256, write_policy="write_through")
        async with HiCache(cfg, log=log) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            # Three conversations take turns; L1 holds 48 tokens, so a conversation's earlier
            # turns are pushed to L2 by the others and must come back for its next turn.
            script = [
                [(f"c{c}t{t}", conversation(t, 1000 * c))] for t in range(3) for c in range(3)
            ]
            records = await sched.run(script)
            loaded = [r for r in records if r.loaded]
            assert loaded, "no turn loaded its prefix back from L2"
            for r in records:
                assert r.device_hit + r.loaded + r.computed == r.tokens
            # The last turn of each conversation reused all but its 12 new tokens.
            last = [r for r in records if r.rid.endswith("t2")]
            assert all(r.device_hit + r.loaded >= r.tokens - 12 - PAGE for r in last)
            # Every page that came back holds exactly the bytes computed for it.
            for c in range(3):
                tokens = conversation(2, 1000 * c)
                m = await cache.match(f"check{c}", tokens)
                lb = await cache.load_back(f"check{c}")
                if lb.handle is not None:
                    await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
                assert len(lb.device_slots) == m.device_len + lb.loaded_tokens
                assert check_prefix(cache, tokens, lb.device_slots) == 0
                await cache.release(f"check{c}")
            stats = await cache.stats()
            assert stats.host.hit_tokens > 0 and stats.device.evictions > 0
        return cache.close_report

    report = run_virtual(main)
    assert report["device"]["used"] == 0 and report["host"]["used"] == 0
    names = {e["event"] for e in log.events}
    for event in (
        "tree.match",
        "tree.insert",
        "writer.backup_done",
        "tree.evict_device",
        "tree.load_started",
        "loader.load_done",
        "kernel.stopped",
    ):
        assert event in names, event


def test_running_request_pages_are_never_evicted():
    async def main():
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_through")
        async with HiCache(cfg) as cache:
            held = np.arange(16, dtype=np.int64)
            await cache.match("held", held)
            slots = await cache.allocate("held", 16)
            fill_kv(cache.device_pool, slots, seeds_for(held), page_size=PAGE, first=0)
            out = await cache.cache_unfinished("held", held, slots)  # stays locked: running
            # Others fill L1 over and over; the running request's pages must stay put.
            for i in range(6):
                other = np.arange(100 * (i + 1), 100 * (i + 1) + 16, dtype=np.int64)
                await cache.match(f"o{i}", other)
                new = await cache.allocate(f"o{i}", 16)
                await cache.cache_finished(f"o{i}", other, new)
            assert check_prefix(cache, held, out.device_slots) == 0
            m = await cache.match("held", held)
            assert np.array_equal(m.device_slots, out.device_slots)
            # With everything left locked, an allocation fails with a typed error.
            await cache.match("big", np.arange(5000, 5032))
            with pytest.raises(CapacityError) as info:
                await cache.allocate("big", 32)
            assert info.value.tier == "device"
            await cache.release("big")
            await cache.cache_finished("held", held, out.device_slots)

    run_virtual(main)


@pytest.mark.parametrize(
    "policy, backed_after_first, backed_after_second",
    [
        ("write_through", True, True),
        ("write_through_selective", False, True),
        ("write_back", False, False),
    ],
)
def test_write_policies_back_up_when_specified(policy, backed_after_first, backed_after_second):
    async def main():
        cfg = virtual_config(device_tokens=64, host_tokens=256, write_policy=policy)
        async with HiCache(cfg) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            tokens = np.arange(32, dtype=np.int64)
            await sched.run([[("a", tokens)]])
            await cache.flush()
            first = (await cache.stats()).host.cached_tokens
            await sched.run([[("b", tokens)]])
            await cache.flush()
            second = (await cache.stats()).host.cached_tokens
            return first, second

    first, second = run_virtual(main)
    assert (first > 0) == backed_after_first
    assert (second > 0) == backed_after_second


def test_write_back_eviction_waits_for_its_backup_and_keeps_the_pages():
    async def main():
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_back")
        async with HiCache(cfg) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            first = np.arange(32, dtype=np.int64)
            await sched.run([[("a", first)], [("b", np.arange(500, 532))]])
            # "a" was evicted from L1 by "b": under write_back it went to L2 first.
            m = await cache.match("again", first)
            assert m.device_len == 0 and m.host_len == 32
            lb = await cache.load_back("again")
            await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
            assert check_prefix(cache, first, lb.device_slots) == 0
            await cache.release("again")

    run_virtual(main)


def test_exclusive_mode_gives_up_the_l2_copy_on_load_back():
    async def main():
        cfg = virtual_config(device_tokens=32, host_tokens=128, exclusive=True)
        async with HiCache(cfg) as cache:
            assert cache.config.write_policy == "write_back"
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            first = np.arange(32, dtype=np.int64)
            await sched.run([[("a", first)], [("b", np.arange(500, 532))]])
            before = (await cache.stats()).host.cached_tokens
            await sched.run([[("a2", first)]])
            after = await cache.stats()
            assert before >= 32
            assert after.host.hit_tokens == 32
            # The loaded pages left L2 (what L2 holds now is "b", demoted to make room).
            dump = await cache.dump()
            both = [n for n in dump if n["state"] == "both"]
            assert not both, both

    run_virtual(main)


def test_failed_load_is_retried_by_recompute_never_served():
    faults = FaultPlan()

    async def main():
        cfg = virtual_config(device_tokens=32, host_tokens=128, write_policy="write_through")
        async with HiCache(cfg, transfer_faults=faults) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            first = np.arange(32, dtype=np.int64)
            await sched.run([[("a", first)], [("b", np.arange(500, 532))]])
            faults.fail[("load", 0, 1)] = OSError("injected: bus error on layer 1")
            m = await cache.match("again", first)
            assert m.host_len == 32
            lb = await cache.load_back("again")
            with pytest.raises(Exception, match="load failed"):
                await lb.handle.wait_async(1)
            await cache.release("again")
            # After the failure the tree no longer claims those pages are on the device.
            m2 = await cache.match("third", first)
            assert m2.device_len == 0 and m2.host_len == 32
            lb2 = await cache.load_back("third")
            await lb2.handle.wait_async(cache.device_pool.geometry.layers - 1)
            assert check_prefix(cache, first, lb2.device_slots) == 0
            await cache.release("third")

    run_virtual(main)


def test_bad_input_is_a_clear_error_and_changes_nothing():
    async def main():
        async with HiCache(virtual_config()) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            tokens = np.arange(16, dtype=np.int64)
            await sched.run([[("a", tokens)]])
            before = await cache.dump()
            with pytest.raises(UnknownRequest, match="'ghost'"):
                await cache.allocate("ghost", 4)
            await cache.match("x", tokens)
            with pytest.raises(ValueError, match="tokens but"):
                await cache.cache_finished("x", tokens, np.arange(3))
            with pytest.raises(ValueError, match="cannot allocate -1"):
                await cache.allocate("x", -1)
            await cache.release("x")
            assert await cache.dump() == before

    run_virtual(main)


def test_same_seed_same_event_log_other_seed_same_state():
    def run(seed: int):
        log = EventLog(capture=True)

        async def main():
            cfg = virtual_config(
                device_tokens=112, host_tokens=512, write_policy="write_through", seed=seed
            )
            async with HiCache(cfg, log=log) as cache:
                sched = ScriptedScheduler(cache, compute=compute_into(cache))
                script = [
                    [(f"c{c}t{t}", conversation(t, 1000 * c)) for c in range(3)] for t in range(3)
                ]
                await sched.run(script)
                return [(r.rid, r.device_hit, r.loaded) for r in sched.records]

        records = run_virtual(main, seed=seed)
        return records, [dict(e) for e in log.events]

    a, log_a = run(1)
    b, log_b = run(1)
    assert log_a == log_b and a == b
    c, _log_c = run(2)
    assert c == a  # the same requests find the same prefixes


def test_config_rejects_unsound_combinations():
    from hicache.config import ConfigError

    with pytest.raises(ConfigError, match="host_tokens"):
        CacheConfig(device_tokens=64, host_tokens=64).resolve()
    with pytest.raises(ConfigError, match="page_head"):
        CacheConfig(kv="mla:2:64:16:bfloat16", layout="page_head").resolve()
    cfg, rewrites = CacheConfig(io_backend="direct", layout="page_first").resolve()
    assert cfg.layout == "page_first_direct" and rewrites[0].field == "layout"


def test_allocate_many_is_all_or_nothing_and_names_the_request():
    async def main():
        cfg = virtual_config(device_tokens=64, host_tokens=256)
        async with HiCache(cfg) as cache:
            for rid in ("a", "b", "c"):
                await cache.match(rid, np.arange(100 * ord(rid), 100 * ord(rid) + 8))
            before = await cache.stats()
            with pytest.raises(CapacityError) as info:
                await cache.allocate_many([("a", 30), ("b", 30), ("c", 30)])
            assert info.value.rid == "c" and "'c'" in str(info.value)
            after = await cache.stats()
            assert after.device.used == before.device.used  # a and b gave theirs back
            # The same requests fit one by one; the partial last page is reused in order.
            a1 = await cache.allocate("a", 30)
            a2 = await cache.allocate("a", 2)
            assert len(a1) == 30 and len(a2) == 2
            assert a2[0] == a1[-1] + 1  # the 31st and 32nd token share a1's last page
            await cache.release_many(["a", "b", "c"])
            assert (await cache.stats()).device.used == 0

    run_virtual(main)


def test_a_bad_key_or_foreign_slots_fail_only_that_call():
    async def main():
        async with HiCache(virtual_config()) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            tokens = np.arange(16, dtype=np.int64)
            await sched.run([[("a", tokens)]])
            before = await cache.dump()
            with pytest.raises(ValueError, match="token id -1"):
                await cache.match("bad", np.array([1, 2, -1, 4]))
            await cache.match("x", np.arange(50, 66))
            mine = await cache.allocate("x", 16)
            with pytest.raises(ValueError, match="slots allocated to it"):
                await cache.cache_finished("x", np.arange(50, 66), mine[::-1])  # not in order
            with pytest.raises(ValueError, match="slots allocated to it"):
                await cache.cache_unfinished("x", np.arange(50, 58), mine[:8])  # too few
            await cache.release("x")
            assert await cache.dump() == before  # the cache still works, nothing changed
            await sched.run([[("b", tokens)]])
        return cache.close_report

    report = run_virtual(main)
    assert report["device"]["used"] == 0


def test_close_reports_leaked_slots():
    from hicache.cache import LedgerImbalance

    async def main():
        async with HiCache(virtual_config()) as cache:
            # Slots taken from the ledger behind the tree's back are never given back.
            await cache.stats()  # the tree has leased its slots
            taken = cache.system.actors["tree"].controller.tiers.ledgers["device"].alloc(8)
            assert len(taken) == 8

    with pytest.raises(LedgerImbalance, match="device"):
        run_virtual(main)


@pytest.mark.parametrize("cpu_transfers", ["thread", "inline"])
def test_production_mode_round_trip_through_l2(cpu_transfers):
    import anyio

    async def main():
        cfg = virtual_config(
            deterministic=False,
            device_tokens=48,
            host_tokens=256,
            write_policy="write_through",
            cpu_transfers=cpu_transfers,
        )
        async with HiCache(cfg) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            script = [
                [(f"c{c}t{t}", conversation(t, 1000 * c))] for t in range(3) for c in range(3)
            ]
            records = await sched.run(script)
            assert any(r.loaded for r in records)
            tokens = conversation(2, 0)
            await cache.match("check", tokens)
            lb = await cache.load_back("check")
            assert lb.handle is not None
            for layer in range(cache.device_pool.geometry.layers):
                lb.handle.wait(layer)  # the engine's synchronous per-layer wait, both modes
            assert check_prefix(cache, tokens, lb.device_slots) == 0
            await cache.release("check")

    anyio.run(main, backend="asyncio")


_SELECTION_PROBE = """
import anyio, json, sys
from hicache import CacheConfig, HiCache
from hicache.observability import EventLog
log = EventLog(capture=True)
async def main():
    cfg = CacheConfig(device_tokens=64, host_tokens=128, page_size=4, device=sys.argv[1])
    async with HiCache(cfg, log=log):
        pass
anyio.run(main)
print(json.dumps([e for e in log.events if e["event"] == "streams.selected"]))
"""


def _selected_streams(device: str, tmp_path, native: str = "1") -> dict:
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SELECTION_PROBE, device],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HICACHE_NATIVE": native, "HICACHE_CACHE_DIR": str(tmp_path)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (selected,) = json.loads(done.stdout.strip().splitlines()[-1])
    return selected


@pytest.mark.parametrize("native", ["1", "0"])
def test_streams_selected_names_the_cpu_row_copier(native, tmp_path):
    from hicache.kernels.native.rowcopy import native_rows

    selected = _selected_streams("cpu", tmp_path, native)  # host pools on any machine
    assert selected["kind"] == "inline"  # CPU copies on the loop, not "virtual" time
    assert "deterministic" not in selected["reason"]
    if native == "0":
        assert selected["copier"] == "numpy" and "HICACHE_NATIVE" in selected["copier_reason"]
    elif native_rows() is None:
        pytest.skip("no compiled row copier here")
    else:
        assert selected["copier"] == "compiled" and "copier_reason" not in selected


def test_auto_device_selects_cuda_streams_where_cuda_is(tmp_path):
    from hicache.kernels.streams import cuda_driver_status

    usable, why = cuda_driver_status()
    selected = _selected_streams("auto", tmp_path)
    if usable:  # the pools went to the GPU: its streams, no CPU row copier named
        assert selected["kind"] == "cuda" and "copier" not in selected, selected
    else:
        assert selected["kind"] == "inline" and "copier" in selected, (why, selected)
