"""hicache's vLLM connector against a real vLLM (the CPU build, in .venv-vllm: `make vllm-env`,
then `.venv-vllm/bin/python -m pytest tests/vllm`). Skipped where vLLM is not installed.

Every vLLM run is a fresh process (tests/vllm/vllm_driver.py: vLLM spawns its engine core)
over a random-weight tiny Llama built here. Greedy decoding with logprobs must give the same
token ids and the same logprobs, bit for bit, with and without the connector; runs after
`reset_prefix_cache()` (vLLM's own cache emptied) must report the connector's tokens as cached;
a second process sharing the file store must get its prefixes from L3; corrupted stored values
must be recomputed, not served.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _vllm_installed() -> bool:
    # Not `find_spec("vllm") is None`: with tests/ on sys.path (pytest's rootdir imports),
    # this very directory is a namespace package named "vllm".
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not _vllm_installed(),
        reason="vLLM is not installed here (make vllm-env; .venv-vllm/bin/python -m pytest tests/vllm)",
    ),
    pytest.mark.timeout(900),
]

DRIVER = Path(__file__).with_name("vllm_driver.py")
BLOCK = 32
PREFIX = 100  # shared by every prompt: three whole pages and a bit
SUFFIXES = (20, 45, 70)


def _prompts() -> list[list[int]]:
    r = random.Random(1)
    prefix = [r.randrange(3, 512) for _ in range(PREFIX)]
    return [prefix + [r.randrange(3, 512) for _ in range(n)] for n in SUFFIXES]


def _full_pages(prompt: list[int]) -> int:
    """Tokens the connector can serve: whole pages, leaving vLLM one token to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _run(tmp: Path, name: str, spec: dict, logs: list[str] | None = None) -> list[list[dict]]:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(spec_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
        env=env,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"vLLM run {name!r} failed (rc {proc.returncode}):\n{tail}")
    if logs is not None:
        logs.append(proc.stdout + proc.stderr)
    return json.loads(out_path.read_text())


def _same(a: list[dict], b: list[dict]) -> None:
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert [x["logprobs"] for x in a] == [x["logprobs"] for x in b]  # bit for bit


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("vllm")
    subprocess.run(
        [sys.executable, str(DRIVER), "make-model", str(tmp / "model")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return tmp


@pytest.fixture(scope="module")
def spec(work: Path) -> dict:
    return {"model": str(work / "model"), "prompts": _prompts(), "max_tokens": 8}


@pytest.fixture(scope="module")
def baseline(work: Path, spec: dict) -> list[dict]:
    """vLLM alone, one pass."""
    return _run(work, "baseline", dict(spec, connector=None, passes=1))[0]


@pytest.fixture(scope="module")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="module")
def first(work: Path, spec: dict, store: Path) -> list[list[dict]]:
    """With the connector and a file store: four passes, vLLM's prefix cache reset before
    each; passes 2 and 3 under a cache_salt."""
    extra = {"storage": f"file:{store}", "host_gib": 0.25}
    return _run(
        work,
        "first",
        dict(spec, connector=extra, passes=4, salts=[None, None, "tenant-a", "tenant-a"]),
    )


def test_exact_with_connector_and_served_from_l2(baseline, first):
    for run in first:
        _same(baseline, run)
    # After reset_prefix_cache() vLLM's own cache is empty: every whole page of every prompt
    # (the first one's included, which vLLM alone never has) comes from the connector.
    assert [x["num_cached_tokens"] for x in first[1]] == [_full_pages(p) for p in _prompts()]
    assert baseline[0]["num_cached_tokens"] == 0


def test_empty_extra_config_works(work, spec, baseline):
    """Defaults only (L2 sized from the machine's memory, no L3)."""
    runs = _run(work, "defaults", dict(spec, connector={}, passes=2))
    for run in runs:
        _same(baseline, run)
    assert [x["num_cached_tokens"] for x in runs[1]] == [_full_pages(p) for p in _prompts()]


def test_salts_separate_requests(baseline, first):
    # Pass 2 runs under a new salt: nothing of the unsalted passes may be found, so the first
    # prompt (whose prefix no earlier prompt of the batch computed) has no cached token.
    assert first[2][0]["num_cached_tokens"] == 0
    # Pass 3, same salt again after a reset: the salted pages come back from the connector.
    assert [x["num_cached_tokens"] for x in first[3]] == [_full_pages(p) for p in _prompts()]


def test_second_process_reads_the_prefixes_from_l3(work, spec, baseline, first, store):
    runs = _run(work, "second", dict(spec, connector={"storage": f"file:{store}"}, passes=1))
    _same(baseline, runs[0])
    assert [x["num_cached_tokens"] for x in runs[0]] == [_full_pages(p) for p in _prompts()]


def test_corrupt_stored_values_are_recomputed(work, spec, baseline, first, store):
    bad = work / "store-corrupt"
    shutil.copytree(store, bad)
    values = [p for p in bad.rglob("*") if p.is_file() and "tmp" not in p.relative_to(bad).parts]
    assert values, "the first run stored nothing in L3"
    for path in values:  # flip the last payload byte: the CRC-32 no longer matches
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    logs: list[str] = []
    spec = dict(spec, connector={"storage": f"file:{bad}"}, passes=1)
    runs = _run(work, "corrupt", spec, logs)
    # Every checksum failed (the connector logs each storage.corrupt event) ...
    pages = {tuple(p[:k]) for p in _prompts() for k in range(BLOCK, _full_pages(p) + 1, BLOCK)}
    assert logs[0].count("storage.corrupt") == len(pages)
    assert "'reason': 'checksum'" in logs[0]
    # ... and vLLM recomputed those blocks: the same tokens and logprobs. (vLLM still counts
    # the tokens it planned to load in num_cached_tokens: it decides that when scheduling.)
    _same(baseline, runs[0])
