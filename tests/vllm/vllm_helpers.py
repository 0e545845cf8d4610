"""Shared by the vLLM tests (tests/vllm/test_vllm_*.py, fixtures in conftest.py): the
prompts, the driver run (a fresh process each: tests/vllm/vllm_driver.py) and the checks."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.backends.file.index import TMP_DIR, WRITERS_DIR

HERE = Path(__file__).parent
DRIVER = HERE / "vllm_driver.py"
BLOCK = 32
PREFIX = 100  # shared by every prompt: three whole pages and a bit
SUFFIXES = (20, 45, 70)


def vllm_installed() -> bool:
    # Not `find_spec("vllm") is None`: with tests/ on sys.path (pytest's rootdir imports),
    # tests/vllm itself is a namespace package named "vllm".
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm_installed(),
        reason="vLLM is not installed here (make vllm-env; .venv-vllm/bin/python -m pytest tests/vllm)",
    ),
    pytest.mark.timeout(900),
]


def value_files(store: Path) -> list[Path]:
    """The value files of a file store's directory: not writes in progress (`tmp/`), nor an
    instance's lock file (`writers/`, left empty by a process that exited without closing its
    store)."""
    skip = {TMP_DIR, WRITERS_DIR}
    return [
        p for p in store.rglob("*") if p.is_file() and not skip & set(p.relative_to(store).parts)
    ]


def prompts() -> list[list[int]]:
    r = random.Random(1)
    prefix = [r.randrange(3, 512) for _ in range(PREFIX)]
    return [prefix + [r.randrange(3, 512) for _ in range(n)] for n in SUFFIXES]


def full_pages(prompt: list[int]) -> int:
    """Tokens the connector can serve: whole pages, leaving vLLM one token to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def distinct_pages(batch: list[list[int]] | None = None) -> set[tuple[int, ...]]:
    """Every distinct whole page the connector can serve, named by its prefix."""
    batch = prompts() if batch is None else batch
    return {tuple(p[:k]) for p in batch for k in range(BLOCK, full_pages(p) + 1, BLOCK)}


def make_model(tmp: Path, *arch: str) -> Path:
    """A tiny random-weight model in `tmp/model` (vllm_driver.py make-model; `arch` names a
    hybrid one such as gemma3), built in a process of its own; returns `tmp`."""
    subprocess.run(
        [sys.executable, str(DRIVER), "make-model", str(tmp / "model"), *arch],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return tmp


def run(tmp: Path, name: str, spec: dict, logs: list[str] | None = None) -> list[list[dict]]:
    """One vLLM process running `spec` (vllm_driver.py's keys); its outputs per pass."""
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)  # flaky_store
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


def extra(tmp: Path, name: str) -> dict:
    """What the driver saw besides the outputs: the connector's counters after each pass
    (with log_stats) and the KV cache events vLLM published (with kv_events)."""
    return json.loads((tmp / f"{name}.out.json.extra.json").read_text())


def pass_delta(metrics: list[dict], n: int) -> dict:
    """What the counters counted during pass `n` alone."""
    before = metrics[n - 1] if n else {}
    return {k: v - before.get(k, 0) for k, v in metrics[n].items() if v != before.get(k, 0)}


def same(a: list[dict | None], b: list[dict | None]) -> None:
    """The same tokens and logprobs, bit for bit (None: a request aborted in `a` or `b`)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    assert [x["token_ids"] for x, _ in pairs] == [y["token_ids"] for _, y in pairs]
    assert [x["logprobs"] for x, _ in pairs] == [y["logprobs"] for _, y in pairs]


NEAR = 1e-5
"""How far `near` lets a logprob move: about 20 ulps of the tiny model's logprobs (~-5.6,
whose float32 ulp is 4.8e-7). vLLM 0.32's CPU decode is not batch-invariant: a request
decoded beside other requests than in another run (its load landed a step earlier or later)
may see one logprob move by an ulp. A page restored wrongly moves them by far more
(test_vllm_hybrid.py's negative control measures it)."""


def logprob_gap(a: list[dict | None], b: list[dict | None]) -> float:
    """The largest difference between the logprobs of the same tokens in `a` and `b` (None:
    an aborted request, skipped); infinite where the tokens differ."""
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            continue
        if x["token_ids"] != y["token_ids"]:
            return float("inf")
        for (t, u), (s, v) in zip(x["logprobs"], y["logprobs"], strict=True):
            if t != s:
                return float("inf")
            gap = max(gap, abs(u - v))
    return gap


def near(a: list[dict | None], b: list[dict | None]) -> None:
    """The same tokens; logprobs within `NEAR` of each other (None: an aborted request).
    For runs whose batches depend on when loads land, against vLLM alone."""
    gap = logprob_gap(a, b)
    assert gap <= NEAR, f"logprobs differ by {gap} (tokens differ if inf): {a} != {b}"
