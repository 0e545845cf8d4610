"""What a seed that passed did (`SimReport`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SimReport:
    """What one seed did: counts of calls, requests, verified pages, faults injected (by
    kind), request outcomes, and the config it ran."""

    seed: int
    mode: str
    config: str
    features: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    virtual_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return self.counts["steps"]

    @property
    def requests(self) -> int:
        return self.counts["requests"]

    @property
    def pages_verified(self) -> int:
        return self.counts["pages_verified"]

    def line(self) -> str:
        faults = ",".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"seed {self.seed}: {self.steps} steps, {self.requests} requests, "
            f"{self.pages_verified} pages verified, faults {faults}"
        )
