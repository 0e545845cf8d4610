"""Fixtures of the vLLM tests, shared by their modules (session scope: each vLLM run once).
Nothing here starts vLLM unless a test that needs it runs (they skip without vLLM)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vllm_helpers import BLOCK, make_model, prompts, run


def chaos_prompts() -> list[list[int]]:
    """Six prompts sharing two pages, each 90-94 tokens: with 8 tokens generated each one
    crosses into a fourth block while decoding (tests/vllm/test_vllm_chaos.py)."""
    r = random.Random(2)
    prefix = [r.randrange(3, 512) for _ in range(2 * BLOCK)]
    return [prefix + [r.randrange(3, 512) for _ in range(26 + i % 5)] for i in range(6)]


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def spec(work: Path) -> dict:
    return {"model": str(work / "model"), "prompts": prompts(), "max_tokens": 8}


@pytest.fixture(scope="session")
def baseline(work: Path, spec: dict) -> list[dict]:
    """vLLM alone, one pass."""
    return run(work, "baseline", dict(spec, connector=None, passes=1))[0]


@pytest.fixture(scope="session")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="session")
def first(work: Path, spec: dict, store: Path) -> list[list[dict]]:
    """With the connector and a file store: four passes, vLLM's prefix cache reset before
    each; passes 2 and 3 under a cache_salt. vLLM's stats and KV events on. Layer-wise
    loads on (off by default): a layer vLLM ran without waiting would be a load error."""
    connector = {"storage": f"file:{store}", "host_gib": 0.25, "layerwise_loads": True}
    return run(
        work,
        "first",
        dict(
            spec,
            connector=connector,
            passes=4,
            salts=[None, None, "tenant-a", "tenant-a"],
            log_stats=True,
            kv_events=f"ipc://{work}/kv-events",
        ),
    )
