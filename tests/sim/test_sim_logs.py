"""`hicache check-log` over the simulation's event logs: every invariant the checker derives
from a log holds on seeded whole-cache runs with injected faults (a log the checker rejects
is a bug in the cache's events or in the checker)."""

from __future__ import annotations

import pytest

from hicache.cli.checklog import check_events
from hicache.observability import EventLog
from hicache.testing.simulation import run_simulation

SEEDS = 50  # bounded by count; about 5 s here


@pytest.mark.parametrize("seed", range(SEEDS))
def test_the_simulations_event_log_passes_check_log(seed):
    log = EventLog(capture=True)
    run_simulation(seed, log=log)
    events = [dict(e) for e in log.events]
    assert events, "the simulation logged nothing"
    check_events(events)  # raises Violation naming the first broken invariant
