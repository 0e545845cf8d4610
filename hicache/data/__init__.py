"""Data shipped with the package: `mooncake_synthetic_trace.jsonl.xz`, the Mooncake synthetic
trace (data/README.md in the repository) compressed, the default trace of `hicache replay` and
`hicache sweep` where no clone's `data/` is beside the package."""

from __future__ import annotations

from pathlib import Path

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def shipped_trace() -> Path:
    """The packaged copy of the trace (xz-compressed; `hicache.cli.trace.read_trace` reads it)."""
    return Path(__file__).resolve().parent / f"{TRACE_NAME}.xz"


def default_trace() -> Path:
    """The trace `hicache replay` reads by default: a clone's `data/` copy where the package
    runs from a clone, else the packaged one (an installed wheel or sdist)."""
    clone = Path(__file__).resolve().parents[2] / "data" / TRACE_NAME
    return clone if clone.is_file() else shipped_trace()
