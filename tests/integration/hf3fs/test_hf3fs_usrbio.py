"""The hf3fs backend over the real usrbio client (`hf3fs_fuse.io`) on a 3FS mount: the
conformance kit. Needs `hf3fs-py-usrbio` (built against 3FS) and HICACHE_HF3FS_DIR, a directory
on a mounted 3FS; skipped with the reason otherwise. Where 3FS is absent the backend's logic is
tested over a stand-in of the API (tests/unit/backends/test_hf3fs.py)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from hicache.backends.hf3fs import Hf3fsBackend, usrbio_missing
from hicache.backends.keys import Namespace
from hicache.testing.conformance import BackendConformance
from tests.unit.backends.harness import ValueFileHarness

pytestmark = pytest.mark.hf3fs
if usrbio_missing() is not None:  # one line in the summary, not one per test
    pytest.skip(str(usrbio_missing()), allow_module_level=True)
if not os.environ.get("HICACHE_HF3FS_DIR"):
    pytest.skip(
        "HICACHE_HF3FS_DIR is not set (a directory on a 3FS mount)", allow_module_level=True
    )


class RealHf3fsHarness(ValueFileHarness):
    def __init__(self, root: Path) -> None:
        self.root = root

    def open(self, ns: Namespace, emit: Any) -> Hf3fsBackend:
        return Hf3fsBackend.from_spec(f"hf3fs:{self.root}", namespace=ns, emit=emit)


class TestHf3fsUsrbioConformance(BackendConformance):
    @pytest.fixture
    def harness(self) -> RealHf3fsHarness:
        base = Path(os.environ["HICACHE_HF3FS_DIR"])
        return RealHf3fsHarness(base / f"hicache-test-{uuid.uuid4().hex[:8]}")
