"""hicache's connector inside vLLM with a hybrid model: a random-weight tiny Gemma 3 (layers
sliding, full, sliding, full; a window of 48 tokens, block size 32), which vLLM's hybrid KV
cache manager runs as two KV cache groups (a sliding window group whose blocks older than the
window vLLM drops, and a full attention group). Skipped where vLLM is not installed.

The same checks as test_vllm_connector.py: token ids and logprobs bit for bit those of vLLM
alone (with the same two groups), every whole page from L2 after `reset_prefix_cache()`, from
L3 in a second process; and the negative controls: a store whose values are all corrupt is
recomputed per request (identical outputs), and a connector that leaves the sliding window
group's blocks unrestored changes the outputs (so these comparisons would catch it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_helpers import (
    BLOCK,
    NEAR,
    VLLM_MARKS,
    distinct_pages,
    extra,
    full_pages,
    logprob_gap,
    make_model,
    near,
    pass_delta,
    prompts,
    run,
    same,
    value_files,
)

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-hybrid"), "gemma3")


@pytest.fixture(scope="module")
def hspec(hybrid: Path) -> dict:
    return {"model": str(hybrid / "model"), "prompts": prompts(), "max_tokens": 8}


@pytest.fixture(scope="module")
def hbaseline(hybrid: Path, hspec: dict) -> list[dict]:
    """vLLM alone (its hybrid KV cache manager on: two groups), one pass."""
    return run(hybrid, "baseline", dict(hspec, connector=None, passes=1))[0]


@pytest.fixture(scope="module")
def hfirst(hybrid: Path, hspec: dict) -> list[list[dict]]:
    """With the connector and a file store: two passes, vLLM's prefix cache reset between."""
    connector = {"storage": f"file:{hybrid / 'store'}", "host_gib": 0.25}
    return run(hybrid, "first", dict(hspec, connector=connector, passes=2, log_stats=True))


def test_hybrid_exact_and_served_from_l2(hybrid, hbaseline, hfirst):
    same(hbaseline, hfirst[0])  # pass 0 loads nothing: bit for bit
    near(hbaseline, hfirst[1])  # asynchronous loads: when each lands sets the batches (NEAR)
    # After the reset every whole page of every prompt comes from the connector: vLLM
    # allocated the full group's blocks and the sliding group's window, and the load filled
    # both.
    assert [x["num_cached_tokens"] for x in hfirst[1]] == [full_pages(p) for p in prompts()]
    m = extra(hybrid, "first")["metrics"]
    p0, p1 = pass_delta(m, 0), pass_delta(m, 1)
    pages = len(distinct_pages())
    assert p0["l2_store_pages"] == pages, p0  # every distinct whole page, both groups' blocks
    # Every load is asynchronous (a hybrid model's failed load is reported per request). vLLM
    # shares no block of a load in flight, but a request scheduled after another's load has
    # landed reuses those blocks: how many pages load depends on the scheduler's steps, between
    # every distinct page once and every request loading all of its own.
    loaded = sum(full_pages(p) for p in prompts()) // BLOCK
    assert pages <= p1["hit_l2_pages"] == p1["l2_load_pages"] <= loaded, p1
    assert 1 <= p1["async_loads"] <= len(prompts()) and p1.get("load_errors", 0) == 0, p1


def test_hybrid_second_process_reads_the_prefixes_from_l3(hybrid, hspec, hbaseline, hfirst):
    store = hybrid / "store"
    runs = run(
        hybrid,
        "second",
        dict(hspec, connector={"storage": f"file:{store}"}, passes=1, log_stats=True),
    )
    near(hbaseline, runs[0])  # asynchronous loads: when each lands sets the batches (NEAR)
    assert [x["num_cached_tokens"] for x in runs[0]] == [full_pages(p) for p in prompts()]
    m = extra(hybrid, "second")["metrics"][0]
    pages = len(distinct_pages())
    assert m["hit_l3_pages"] == m["l3_read_pages"] == pages, m
    assert m["l3_read_failures"] == m.get("load_errors", 0) == 0, m


def test_hybrid_corrupt_store_is_recomputed_per_request(hybrid, hspec, hbaseline, hfirst):
    bad = hybrid / "store-corrupt"
    shutil.copytree(hybrid / "store", bad)
    values = value_files(bad)
    assert values, "the first run stored nothing in L3"
    for path in values:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    runs = run(
        hybrid,
        "corrupt",
        dict(hspec, connector={"storage": f"file:{bad}"}, passes=1, log_stats=True),
    )
    near(hbaseline, runs[0])  # recomputed where a load failed; when each failed sets batches
    m = extra(hybrid, "corrupt")["metrics"][0]
    assert m["hit_l3_pages"] == m["l3_read_failures"] == len(distinct_pages()), m
    assert m.get("l3_read_pages", 0) == 0 and m["load_errors"] >= m["hit_l3_pages"], m


def test_a_sliding_group_left_unrestored_changes_the_outputs(hybrid, hspec, hbaseline):
    """Negative control: the same run with a connector that restores the full attention
    group only (tests/vllm/sabotage.py). Pass 1 then runs on a sliding window vLLM
    allocated but nobody wrote, and its outputs differ from vLLM alone's."""
    connector = {"host_gib": 0.25}
    runs = run(
        hybrid,
        "sabotage",
        dict(
            hspec,
            connector=connector,
            connector_class="SkipSlidingConnector",
            connector_module="sabotage",
            passes=2,
        ),
    )
    same(hbaseline, runs[0])  # pass 0 loads nothing
    assert [x["num_cached_tokens"] for x in runs[1]] == [full_pages(p) for p in prompts()]
    # The outputs differ from vLLM alone's by far more than the ulps `near` allows.
    gap = logprob_gap(hbaseline, runs[1])
    assert gap > 100 * NEAR, gap
