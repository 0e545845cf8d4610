"""The connector's asynchronous loads and its policies, against a real vLLM (see
test_vllm_connector.py for the setup): loads from L3 run while vLLM keeps the request waiting
(WAITING_FOR_REMOTE_KVS); a store that never answers is given up on at the prefetch policy's
deadline and recomputed; a request aborted while it waits frees its blocks; `best_effort`
never makes a request wait and prefetches into L2 for the next one; `write_back` stores a
request's pages when vLLM frees it. Outputs stay those of vLLM alone, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

from vllm_helpers import (
    VLLM_MARKS,
    distinct_pages,
    extra,
    full_pages,
    near,
    pass_delta,
    prompts,
    run,
    same,
)

pytestmark = VLLM_MARKS


def _flaky(work: Path, store: Path, name: str) -> tuple[str, str]:
    """A copy of the first run's store behind flaky_store; (spec, its mode file)."""
    copy = work / name
    shutil.copytree(store, copy)
    return f"flaky_store:FlakyStore?{copy}", f"{copy}.mode"


def test_a_store_that_hangs_aborts_while_waiting_and_the_timeout_policy(
    work, spec, baseline, first, store
):
    """Pass 0: the store's reads never come back. Every request waits for its load; the odd
    ones are aborted two steps in, while they wait (their loads dropped, their blocks freed,
    nothing stored); the `timeout` policy ends the others' loads after 2 s and vLLM
    recomputes them. Pass 1, the store healthy again (L2 emptied): every prefix from L3.
    Outputs those of vLLM alone: the same tokens, logprobs within `NEAR` (an ulp may move:
    which step a request runs in depends on when its deadline or its load ends, and vLLM's
    CPU decode is not batch-invariant)."""
    storage, mode = _flaky(work, store, "hang-store")
    connector = {
        "storage": storage,
        "prefetch_policy": "timeout",
        "prefetch_timeout_base": 2.0,
        "prefetch_timeout_per_ki_token": 0,
        "storage_timeout": 60,  # the policy's deadline, not the storage's, ends the wait
    }
    runs = run(
        work,
        "hang",
        dict(
            spec,
            passes=2,
            connector=connector,
            reset_connector=True,
            store_mode={"0": [mode, "hang"], "1": [mode, ""]},
            abort_passes=[0],
            abort_after_steps=2,
            log_stats=True,
        ),
    )
    aborted, healthy = runs
    assert [o is None for o in aborted] == [i % 2 == 1 for i in range(len(aborted))]
    near(baseline, aborted)
    near(baseline, healthy)
    p0, p1 = (pass_delta(extra(work, "hang")["metrics"], n) for n in range(2))
    assert p0["async_loads"] >= 2 and p0["aborted_loads"] >= 1, p0
    assert p0["load_timeouts"] >= 1 and p0["load_errors"] >= 1, p0
    assert p0.get("l3_read_pages", 0) == 0, p0
    assert p1["l3_read_pages"] == len(distinct_pages()) and p1.get("load_timeouts", 0) == 0, p1
    assert [x["num_cached_tokens"] for x in healthy] == [full_pages(p) for p in prompts()]


def test_best_effort_never_waits_and_prefetches_for_the_next_request(
    work, spec, baseline, first, store
):
    """Pass 0: nothing is promised from L3 (no request waits), every page L3 holds is read
    into L2 in the background. Pass 1 (vLLM's cache reset, L2 kept): every prefix from L2."""
    copy = work / "best-effort-store"
    shutil.copytree(store, copy)
    connector = {"storage": f"file:{copy}", "prefetch_policy": "best_effort"}
    runs = run(work, "best-effort", dict(spec, passes=2, connector=connector, log_stats=True))
    for out in runs:
        same(baseline, out)
    p0, p1 = (pass_delta(extra(work, "best-effort")["metrics"], n) for n in range(2))
    assert p0.get("hit_l3_pages", 0) == p0.get("async_loads", 0) == 0, p0
    assert p0["prefetch_pages"] == p0["l3_read_pages"] == len(distinct_pages()), p0
    assert [x["num_cached_tokens"] for x in runs[1]] == [full_pages(p) for p in prompts()]
    assert p1["hit_l2_pages"] >= 1 and p1.get("hit_l3_pages", 0) == 0, p1


def test_write_back_stores_when_vllm_frees_the_request(work, spec, baseline):
    """Nothing is stored while a request runs; when it finishes vLLM keeps its blocks until
    the store ran, then frees them. Pass 1 (vLLM's cache reset) is served from L2, and a
    second process reads the same pages from L3 (write-back to L2, then on to L3)."""
    wb = work / "write-back-store"
    connector = {"storage": f"file:{wb}", "write_policy": "write_back"}
    runs = run(work, "write-back", dict(spec, passes=2, connector=connector, log_stats=True))
    for out in runs:
        same(baseline, out)
    metrics = extra(work, "write-back")["metrics"]
    p0, p1 = (pass_delta(metrics, n) for n in range(2))
    assert p0["write_back_requests"] == len(prompts()), p0
    # The stores run in the engine step after the requests finish, which vLLM's engine core
    # takes on its own after `generate` returned: they may be counted in the next pass.
    assert metrics[-1]["l2_store_pages"] >= len(distinct_pages()), metrics
    assert [x["num_cached_tokens"] for x in runs[1]] == [full_pages(p) for p in prompts()]
    # Pass 1 computes the same pages again: L2 has them all, no blocks are kept.
    assert p1["hit_l2_pages"] >= 1 and p1.get("write_back_requests", 0) == 0, p1
    again = run(work, "write-back-l3", dict(spec, passes=1, connector={"storage": f"file:{wb}"}))
    near(baseline, again[0])  # asynchronous loads: when each lands sets the batches (NEAR)
    assert [x["num_cached_tokens"] for x in again[0]] == [full_pages(p) for p in prompts()]
