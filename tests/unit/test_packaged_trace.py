"""The trace the package ships (hicache/data, xz-compressed) is the repository's data/ trace,
byte for byte, and the trace reader takes it as it is (compressed by name)."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

from hicache.cli.main import _REPO_TRACE
from hicache.cli.trace import read_trace
from hicache.data import TRACE_NAME, default_trace, shipped_trace

REPO_DATA = Path(__file__).resolve().parents[2] / "data" / TRACE_NAME


def test_the_shipped_trace_is_the_repositorys_byte_for_byte() -> None:
    assert shipped_trace().name == TRACE_NAME + ".xz"
    assert lzma.decompress(shipped_trace().read_bytes()) == REPO_DATA.read_bytes()


def test_a_clone_replays_its_data_copy_by_default() -> None:
    assert default_trace() == REPO_DATA
    assert _REPO_TRACE == REPO_DATA


def test_compressed_traces_read_as_the_plain_one(tmp_path: Path) -> None:
    plain = read_trace(REPO_DATA, limit=300)
    assert len(plain) == 300
    assert read_trace(shipped_trace(), limit=300) == plain
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(REPO_DATA.read_bytes()))
    assert read_trace(gz, limit=300) == plain
