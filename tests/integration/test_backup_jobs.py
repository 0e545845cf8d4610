"""A step's backups travel as one message and one stream job (a hop per step, not per
backup), and each still ends as its own op: one `writer.backup_done` per op, and a failed
job fails every op in it (never a host copy claimed that was not written)."""

from __future__ import annotations

import numpy as np

from hicache import HiCache
from hicache.observability import EventLog
from hicache.testing import (
    FaultPlan,
    ScriptedScheduler,
    bad_prefix_pages,
    run_virtual,
    synthetic_compute,
    virtual_config,
)


def step_of(base: int, requests: int) -> list[tuple[str, np.ndarray]]:
    """`requests` unrelated 16-token requests: each inserts its own node, so its own backup."""
    return [
        (f"r{base + i}", np.arange(16, dtype=np.int64) + 1000 * (base + i)) for i in range(requests)
    ]


def run_steps(faults: FaultPlan) -> tuple[list[dict], list[tuple[str, np.ndarray]]]:
    log = EventLog(capture=True)
    loaded: list[int] = []
    first, second, filler = step_of(0, 3), step_of(3, 3), step_of(10, 8)

    async def main() -> None:
        cfg = virtual_config(device_tokens=128, host_tokens=512, write_policy="write_through")
        async with HiCache(cfg, log=log, transfer_faults=faults) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache))
            await sched.run([first, second])
            await cache.flush()
            await sched.run([filler])  # fills L1: the first steps' pages live on in L2 only
            await cache.flush()
            # Whatever comes back holds exactly what was computed for it.
            for rid, tokens in first + second:
                m = await cache.match(f"check-{rid}", tokens)
                lb = await cache.load_back(f"check-{rid}")
                if lb.handle is not None:
                    await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
                assert len(lb.device_slots) == m.device_len + lb.loaded_tokens
                loaded.append(lb.loaded_tokens)
                assert bad_prefix_pages(cache, tokens, lb.device_slots) == 0
                await cache.release(f"check-{rid}")

    run_virtual(main)
    assert sum(loaded) > 0, "nothing came back from L2: the check checked nothing"
    return log.events, first + second + filler


def test_one_stream_job_per_step_and_one_event_per_backup():
    faults = FaultPlan()
    events, requests = run_steps(faults)
    done = [e for e in events if e["event"] == "writer.backup_done"]
    assert len(done) == len(requests)  # one per op
    assert len({e["op"] for e in done}) == len(requests)
    assert all(e["ok"] for e in done)
    jobs = [p for p in faults.consulted if p.direction == "backup"]
    assert len(jobs) == 3  # three steps of several backups each: three stream jobs


def test_a_failed_job_fails_each_of_its_ops_and_nothing_else():
    faults = FaultPlan()
    faults.fail[("backup", 0, None)] = OSError("injected: d2h copy failed")
    events, requests = run_steps(faults)
    done = {e["op"]: e for e in events if e["event"] == "writer.backup_done"}
    failed = [e for e in events if e["event"] == "tree.backup_failed"]
    assert len(done) == len(requests)
    assert sorted(op for op, e in done.items() if not e["ok"]) == sorted(e["op"] for e in failed)
    assert len(failed) == 3  # the first step's job: all three of its ops, none of the second's
    assert all("injected" in e["error"] for e in failed)
