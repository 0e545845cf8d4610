"""hicache's vLLM connector against a real vLLM (the CPU build, in .venv-vllm: `make vllm-env`,
then `.venv-vllm/bin/python -m pytest tests/vllm`). Skipped where vLLM is not installed.

Every vLLM run is a fresh process (tests/vllm/vllm_driver.py: vLLM spawns its engine core)
over a random-weight tiny Llama built here. Greedy decoding with logprobs must give the same
token ids and the same logprobs, bit for bit, with and without the connector; runs after
`reset_prefix_cache()` (vLLM's own cache emptied) must report the connector's tokens as cached;
a second process sharing the file store must get its prefixes from L3; corrupted stored values
must be recomputed, not served; the connector's counters and KV events must tell what happened.
"""

from __future__ import annotations

import shutil

from vllm_helpers import (
    BLOCK,
    VLLM_MARKS,
    distinct_pages,
    extra,
    full_pages,
    near,
    pass_delta,
    prompts,
    run,
    same,
    value_files,
)

pytestmark = VLLM_MARKS


def test_exact_with_connector_and_served_from_l2(baseline, first):
    for out in first:
        same(baseline, out)
    # After reset_prefix_cache() vLLM's own cache is empty: every whole page of every prompt
    # (the first one's included, which vLLM alone never has) comes from the connector.
    assert [x["num_cached_tokens"] for x in first[1]] == [full_pages(p) for p in prompts()]
    assert baseline[0]["num_cached_tokens"] == 0


def test_empty_extra_config_works(work, spec, baseline):
    """Defaults only (L2 sized from the machine's memory, no L3)."""
    runs = run(work, "defaults", dict(spec, connector={}, passes=2))
    for out in runs:
        same(baseline, out)
    assert [x["num_cached_tokens"] for x in runs[1]] == [full_pages(p) for p in prompts()]


def test_salts_separate_requests(baseline, first):
    # Pass 2 runs under a new salt: nothing of the unsalted passes may be found, so the first
    # prompt (whose prefix no earlier prompt of the batch computed) has no cached token.
    assert first[2][0]["num_cached_tokens"] == 0
    # Pass 3, same salt again after a reset: the salted pages come back from the connector.
    assert [x["num_cached_tokens"] for x in first[3]] == [full_pages(p) for p in prompts()]


def test_second_process_reads_the_prefixes_from_l3(work, spec, baseline, first, store):
    spec = dict(spec, connector={"storage": f"file:{store}"}, passes=1, log_stats=True)
    runs = run(work, "second", spec)
    near(baseline, runs[0])  # asynchronous loads: when each lands sets the batches (NEAR)
    assert [x["num_cached_tokens"] for x in runs[0]] == [full_pages(p) for p in prompts()]
    # Each distinct page read once from L3, checksums all good, through asynchronous loads
    # (vLLM kept the requests waiting). A request sharing pages that another's load is
    # still reading waits for that read and loads them too: vLLM shares no block of a load
    # in flight, so L2 -> vLLM copies are at least one per page.
    m = extra(work, "second")["metrics"][0]
    pages = len(distinct_pages())
    assert m["hit_l3_pages"] == m["l3_read_pages"] == pages, m
    assert m["l2_load_pages"] >= pages and m["async_loads"] >= 1, m
    assert m["l3_read_failures"] == m["load_errors"] == 0
    assert m.get("load_timeouts", 0) == 0


def test_corrupt_stored_values_are_recomputed(work, spec, baseline, first, store):
    bad = work / "store-corrupt"
    shutil.copytree(store, bad)
    values = value_files(bad)
    assert values, "the first run stored nothing in L3"
    for path in values:  # flip the last payload byte: the CRC-32 no longer matches
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    logs: list[str] = []
    spec = dict(spec, connector={"storage": f"file:{bad}"}, passes=1, log_stats=True)
    runs = run(work, "corrupt", spec, logs)
    # Every checksum failed (the connector logs each storage.corrupt event) ...
    assert logs[0].count("storage.corrupt") == len(distinct_pages())
    assert "'reason': 'checksum'" in logs[0]
    # ... and vLLM recomputed those blocks: the same tokens and logprobs. (vLLM still counts
    # the tokens it planned to load in num_cached_tokens: it decides that when scheduling.)
    near(baseline, runs[0])  # asynchronous loads: when each lands sets the batches (NEAR)
    # The counters say the same: every planned L3 page failed, none landed.
    m = extra(work, "corrupt")["metrics"][0]
    assert m["hit_l3_pages"] == m["l3_read_failures"] == len(distinct_pages()), m
    assert m["l3_read_pages"] == 0 and m["load_errors"] >= m["hit_l3_pages"]
    assert m["l2_forgotten"] == m["hit_l3_pages"]
    # A request scheduled after another one recomputed and stored shared pages loads those
    # from L2 (whether one is depends on timing): only pages this run computed and stored.
    # (One CI run: 6 pages stored, then loaded; others: none, the L2 hits planned on pages
    # still being read failing with them.)
    assert m.get("l2_load_pages", 0) == 0 or m["l2_store_pages"] > 0, m


def test_metrics_match_what_the_run_did(work, first):
    """vLLM's stat loggers receive the connector's counters (Prometheus: vllm:hicache_*):
    pass 1, after reset_prefix_cache(), loaded every whole page of every prompt from L2."""
    metrics = extra(work, "first")["metrics"]
    assert len(metrics) == 4
    # vLLM shares the prefix pages among the batch's prompts itself once one has them: the
    # connector serves each distinct whole page once (3 of the prefix, then 1 and 2 more).
    served = len(distinct_pages())
    p1 = pass_delta(metrics, 1)
    assert p1.get("hit_l2_pages") == served and p1.get("l2_load_pages") == served, p1
    assert p1.get("lookups", 0) >= len(prompts())
    total = metrics[-1]
    page_bytes = total["l2_store_bytes"] // total["l2_store_pages"]
    assert total["l2_load_bytes"] == total["l2_load_pages"] * page_bytes
    assert total.get("load_errors", 0) == 0 and total.get("l3_read_failures", 0) == 0
    # Pass 0 stored the distinct whole computed pages; the salted pass 2 stored its own.
    assert pass_delta(metrics, 0)["l2_store_pages"] > 0
    assert pass_delta(metrics, 2)["l2_store_pages"] > 0
    # Write-through: every write is confirmed or still in flight when the run ends.
    assert 0 < total["l3_write_pages"] <= total["l2_store_pages"]
    assert total.get("l3_write_failures", 0) == 0


def test_kv_events_name_vllms_blocks(work, first):
    """BlockStored (medium CPU) for every page entering L2, STORAGE once written to L3, with
    vLLM's own block hashes: each is a hash vLLM announced for its GPU blocks."""
    seen = extra(work, "first")
    events, total = seen["events"], seen["metrics"][-1]
    gpu = {h for e in events if e["medium"] == "GPU" for h in e["block_hashes"]}
    cpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    l3 = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
    assert len(cpu) == total["l2_store_pages"] + total.get("hit_l3_pages", 0)
    assert all(len(e["block_hashes"]) == 1 and len(e["token_ids"]) == BLOCK for e in cpu)
    assert {h for e in cpu for h in e["block_hashes"]} <= gpu
    assert 0 < len(l3) <= total["l3_write_pages"]
    assert {h for e in l3 for h in e["block_hashes"]} <= {h for e in cpu for h in e["block_hashes"]}
    assert not [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"]
