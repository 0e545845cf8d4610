"""The faults of one seed: the kinds it may draw, what it drew (`SimFaults`), and the
transfer-stream `FaultPlan` that injects and counts them (`SimFaultPlan`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hicache.kernels.faults import FaultPlan
from hicache.kernels.streams.base import FaultPoint
from hicache.testing.faulty_backend import BackendFaults

FAULT_KINDS = (
    "load_fail",
    "backup_fail",
    "load_delay",
    "backup_delay",
    "latency",
    "slow_call",
    "outage",
    "fail_get",
    "fail_set",
    "fail_exists",
    "hang",
    "corrupt",
)
"""Fault kinds a seed may draw; `skip=` removes some (e.g. to narrow a failure down)."""


@dataclass
class SimFaults:
    """The faults of one seed: transfer-stream faults (`FaultPlan` keys) and storage faults
    (a `BackendFaults`, None without storage)."""

    load_fail: set[tuple[int, int]] = field(default_factory=set)  # (load job, layer)
    backup_fail: set[int] = field(default_factory=set)  # backup job
    load_delay: dict[tuple[int, int], float] = field(default_factory=dict)
    backup_delay: dict[int, float] = field(default_factory=dict)
    backend: BackendFaults | None = None

    def kinds(self) -> set[str]:
        out = set()
        for name in ("load_fail", "backup_fail", "load_delay", "backup_delay"):
            if getattr(self, name):
                out.add(name)
        b = self.backend
        if b is not None:
            for kind, on in (
                ("latency", b.latency),
                ("slow_call", b.delays),
                ("outage", b.outages or b.down),
                ("fail_get", b.fail_gets),
                ("fail_set", b.fail_sets),
                ("fail_exists", b.fail_exists),
                ("hang", b.hang or b.hang_gets or b.hang_sets or b.hang_exists),
                ("corrupt", b.corrupt_gets),
            ):
                if on:
                    out.add(kind)
        return out


def random_faults(
    rng: np.random.Generator, storage: bool, virtual: bool, skip: set[str]
) -> SimFaults:
    f = SimFaults()
    if rng.random() < 0.2:  # a clean run now and then
        return f
    on = {k: bool(rng.random() < 0.35) and k not in skip for k in FAULT_KINDS}
    scale = 1.0 if virtual else 0.02  # thread mode: real seconds, keep them short
    jobs = range(48)
    if on["load_fail"]:
        f.load_fail = {(j, int(rng.integers(0, 3))) for j in jobs if rng.random() < 0.12}
    if on["backup_fail"]:
        f.backup_fail = {j for j in jobs if rng.random() < 0.1}
    if on["load_delay"]:
        f.load_delay = {
            (j, int(rng.integers(0, 3))): float(rng.uniform(0.001, 0.2)) * scale
            for j in jobs
            if rng.random() < 0.3
        }
    if on["backup_delay"]:
        f.backup_delay = {
            j: float(rng.uniform(0.001, 0.2)) * scale for j in jobs if rng.random() < 0.3
        }
    if not storage:
        return f
    b = BackendFaults()
    calls = range(24)  # a seed makes a few dozen storage calls per method

    def some(p: float) -> set[int]:
        return {n for n in calls if rng.random() < p}

    if on["latency"]:
        b.latency = float(rng.uniform(0.0005, 0.05)) * scale
    if on["slow_call"]:
        b.delays = {
            (m, n): float(rng.uniform(0.01, 0.4)) * scale
            for m in ("exists", "get_into", "set_from")
            for n in calls
            if rng.random() < 0.15
        }
    if on["outage"]:
        windows = []
        for _ in range(int(rng.integers(1, 3))):
            start = float(rng.uniform(0.0, 0.3)) * scale
            windows.append((start, start + float(rng.uniform(0.005, 0.3)) * scale))
        b.outages = tuple(windows)
    if on["fail_get"]:
        b.fail_gets = some(0.3)
    if on["fail_set"]:
        b.fail_sets = some(0.2)
    if on["fail_exists"]:
        b.fail_exists = some(0.2)
    if on["hang"]:
        # a few calls that never return; thread mode pays storage_timeout in real time each
        hung = [
            (m, int(rng.integers(0, 6)))
            for m in ("exists", "get_into", "set_from")
            if rng.random() < 0.5
        ][: 3 if virtual else 1]
        b.hang_exists = {n for m, n in hung if m == "exists"}
        b.hang_gets = {n for m, n in hung if m == "get_into"}
        b.hang_sets = {n for m, n in hung if m == "set_from"}
    if on["corrupt"]:
        b.corrupt_gets = some(0.5)
    f.backend = b if b.is_set() else None
    return f


class SimFaultPlan(FaultPlan):
    """A `FaultPlan` that counts the faults it injected, and in thread mode sleeps its delays
    on the stream's worker thread (CPU streams ignore a returned delay)."""

    def __init__(self, faults: SimFaults, *, real_delays: bool) -> None:
        super().__init__()
        for job, layer in faults.load_fail:
            self.fail[("load", job, layer)] = OSError(f"injected: load {job} layer {layer}")
        for job in faults.backup_fail:
            self.fail[("backup", job, None)] = OSError(f"injected: backup {job}")
        for (job, layer), d in faults.load_delay.items():
            self.delay[("load", job, layer)] = d
        for job, d in faults.backup_delay.items():
            self.delay[("backup", job, None)] = d
        self.real_delays = real_delays
        self.injected: Counter[str] = Counter()

    def __call__(self, point: FaultPoint) -> float | None:
        key = (point.direction, point.job, point.layer)
        if key in self.fail:
            self.injected[f"{point.direction}_fail"] += 1
        elif key in self.delay:
            self.injected[f"{point.direction}_delay"] += 1
        delay = super().__call__(point)
        if delay and self.real_delays:
            time.sleep(delay)
            return None
        return delay
