"""A ready-made FaultHook for tests (reused by hicache.testing): scripted failures, virtual
delays, and gates that stall a thread-based stream at a chosen step until released."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hicache.kernels.streams.base import FaultPoint

Key = tuple[str, int, "int | None"]
"""(direction, job, layer): layer None for backups."""


@dataclass
class FaultPlan:
    """Callable as a FaultHook. Keys are (direction, job, layer). Mutable test fixture: fill
    it before submitting; `consulted` records every point in the order the stream asked."""

    fail: dict[Key, BaseException] = field(default_factory=dict)
    delay: dict[Key, float] = field(default_factory=dict)
    gates: dict[Key, threading.Event] = field(default_factory=dict)
    consulted: list[FaultPoint] = field(default_factory=list)

    def gate(self, direction: str, job: int, layer: int | None) -> threading.Event:
        """Stall that step (thread-based streams) until the returned event is set."""
        event = self.gates.setdefault((direction, job, layer), threading.Event())
        return event

    def __call__(self, point: FaultPoint) -> float | None:
        key = (point.direction, point.job, point.layer)
        self.consulted.append(point)
        gate = self.gates.get(key)
        if gate is not None:
            gate.wait()
        if key in self.fail:
            raise self.fail[key]
        return self.delay.get(key)
