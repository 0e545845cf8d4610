"""What a replay counts as it goes (`hicache replay`, plain and `--hybrid`): its own module
so both replays fill it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Tally"]


@dataclass(slots=True)
class Tally:
    requests: int = 0
    input_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    rejected: int = 0
    verified_pages: int = 0
    corrupt_pages: int = 0
    loaded: int = 0  # tokens loaded back so far (the live hit rate; host_hit is the cache's)
    control_s: float = 0.0
    control_by_call: dict[str, float] = field(default_factory=dict)  # of it, by cache call
    extra: dict[str, Any] = field(default_factory=dict)
    # with --salts: salt -> [input tokens, hit tokens (L1 at match + loaded back)]
    per_salt: dict[str, list[int]] = field(default_factory=dict)
    # with --pin-first-block: first blocks pinned, refused at the cap (by block id)
    pinned: set[tuple[str | None, int]] = field(default_factory=set)
    pins_refused: int = 0
