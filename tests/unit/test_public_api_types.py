"""hicache ships its annotations (PEP 561) and they say what the public API takes and gives, so
an engine author's own type checker understands the cache: the README's embedding example,
results built in an engine's tests and the test kit's scheduler type-check strictly
(`tests/typing/engine_code.py`): the results' fields, `LoadBackOutcome.handle`'s methods,
`HiCache.backend`, and the `py.typed` marker that tells checkers to read any of it."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_CODE = ROOT / "tests" / "typing" / "engine_code.py"


def test_the_package_ships_its_py_typed_marker():
    assert importlib.resources.files("hicache").joinpath("py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["hicache"]  # and the wheel carries it


@pytest.mark.slow
def test_an_engine_authors_code_type_checks_strictly(tmp_path):
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file=", "--strict", "--warn-unreachable",
         "--follow-imports=silent", "--python-version=3.10", f"--cache-dir={tmp_path}",
         str(ENGINE_CODE)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
