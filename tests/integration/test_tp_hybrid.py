"""Hybrid models under tensor parallelism: two ranks in two processes (gloo on CPU), each with
its own shard of K/V and of the recurrent state, make the same hybrid decisions (hit lengths,
snapshots found) and keep identical trees, with rank 1's storage slower than rank 0's; with
the snapshots in the K/V pools or in a states cache of their own."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import tp_hybrid_worker


@pytest.mark.slow
@pytest.mark.parametrize("own", [False, True], ids=["in-pool", "own-cache"])
def test_ranks_resume_from_the_same_point_each_with_its_own_state_shard(tmp_path, own):
    ctx = mp.get_context("spawn")
    init = tmp_path / "init"
    procs = [
        ctx.Process(target=tp_hybrid_worker.main, args=(rank, 2, str(init), str(tmp_path), 0, own))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung")
        assert p.exitcode == 0, f"a rank failed with exit code {p.exitcode}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["bad"] == r1["bad"] == 0  # K/V pages and each rank's own state shard
    assert r0["hits"] == r1["hits"]
    assert r0["dump"] == r1["dump"]
    assert r0["states"] == r1["states"] and (r0["states"] is not None) == own
    assert r0["read"] == r1["read"] >= 4  # resumed from L3 by fresh caches, each its own shard
    lengths = [h[0] for h in r0["hits"]]
    assert sum(1 for h in lengths if h) >= 10  # the workload does resume from snapshots
    assert any(h[0] < h[1] for h in r0["hits"])  # and K/V beyond a snapshot is cut off
