"""Two tensor-parallel ranks in two processes (gloo on CPU) keep identical trees."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import tp_rank_worker


def run_ranks(tmp_path, kv: str, seed: int):
    ctx = mp.get_context("spawn")
    init = tmp_path / "init"
    procs = [
        ctx.Process(target=tp_rank_worker.main, args=(rank, 2, str(init), str(tmp_path), kv, seed))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung")
        assert p.exitcode == 0, f"a rank failed with exit code {p.exitcode}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_mha_ranks_apply_the_same_tree_changes_after_every_step(tmp_path, seed):
    r0, r1 = run_ranks(tmp_path, "mha:2:2:8:float16", seed)
    assert len(r0["dumps"]) == len(r1["dumps"]) == 25
    for step, (a, b) in enumerate(zip(r0["dumps"], r1["dumps"])):
        assert a == b, f"trees differ after step {step}"
    states = {n["state"] for n in r0["dumps"][-1]}
    assert {"both", "host_only"} & states  # the workload did reach L2
    assert r0["sets"] > 0 and r1["sets"] > 0  # MHA: every rank stores its own shard


@pytest.mark.slow
def test_mla_pages_are_written_once_by_rank_zero(tmp_path):
    r0, r1 = run_ranks(tmp_path, "mla:2:32:8:float16", 0)
    for a, b in zip(r0["dumps"], r1["dumps"]):
        assert a == b
    assert r0["sets"] > 0 and r1["sets"] == 0
