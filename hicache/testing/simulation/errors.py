"""How a run reports a finding: `SimViolation`, the exception that stops its clients, and the
short form of slot arrays its messages use."""

from __future__ import annotations

import numpy as np


class SimViolation(AssertionError):
    """A simulation found the cache misbehaving. `seed`, `what` (one line), `repro`."""

    def __init__(
        self, seed: int, what: str, *, config: str = "", repro: str = "", detail: str = ""
    ) -> None:
        self.seed, self.what, self.config, self.repro = seed, what, config, repro
        lines = [f"seed {seed}: {what}"]
        if config:
            lines.append(f"  config: {config}")
        if detail:
            lines.append(f"  {detail}")
        if repro:
            lines.append(f"  reproduce: {repro}")
        super().__init__("\n".join(lines))


class StopRun(Exception):
    """Ends a client after the run recorded a violation."""


def short_slots(slots: np.ndarray) -> str:
    s = list(map(int, slots))
    return str(s) if len(s) <= 24 else f"{s[:12]}...{s[-4:]} ({len(s)})"
