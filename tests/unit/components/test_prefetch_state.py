"""The prefetch lifecycle's transition table: the paths the tree and the prefetcher take are
legal, every other move is a `PrefetchStateError` naming both phases."""

import pytest

from hicache.components.prefetch_state import (
    RUNNING,
    TRANSITIONS,
    Phase,
    PrefetchStateError,
    advance,
    caller_state,
)

# Every path an op takes, from its start to its end on either side.
PATHS = [
    # tree: probed, read, finished
    [Phase.PROBING, Phase.WAITING_HOST, Phase.READING, Phase.DONE, Phase.ENDED],
    # tree: stopped while reading (a best_effort wait, a timeout, a detach)
    [Phase.PROBING, Phase.WAITING_HOST, Phase.READING, Phase.STOPPING, Phase.DONE, Phase.ENDED],
    # tree: the hit is below the threshold
    [Phase.PROBING, Phase.STOPPING, Phase.REVOKED, Phase.ENDED],
    # tree: no host room for the hit pages
    [Phase.PROBING, Phase.WAITING_HOST, Phase.STOPPING, Phase.REVOKED, Phase.ENDED],
    # tree: the probe found nothing worth waiting for, settled at once
    [Phase.PROBING, Phase.DONE, Phase.ENDED],
    # tree: abandoned at close
    [Phase.PROBING, Phase.REVOKED, Phase.ENDED],
    # prefetcher: probe, reads, end
    [Phase.PROBING, Phase.WAITING_HOST, Phase.READING, Phase.DONE],
    # prefetcher: stopped while waiting for its ReadPrefetch (nothing in flight: ends at once)
    [Phase.PROBING, Phase.WAITING_HOST, Phase.DONE],
    # prefetcher: stopped during the probe
    [Phase.PROBING, Phase.STOPPING, Phase.DONE],
]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(x.name for x in p))
def test_every_path_the_flows_take_is_legal(path: list[Phase]) -> None:
    phase = path[0]
    for wanted in path[1:]:
        phase = advance(7, phase, wanted)
    assert phase is path[-1]


ILLEGAL = [
    (current, wanted) for current in Phase for wanted in Phase if wanted not in TRANSITIONS[current]
]


@pytest.mark.parametrize("current, wanted", ILLEGAL, ids=lambda p: p.name)
def test_every_other_transition_is_the_specific_error(current: Phase, wanted: Phase) -> None:
    with pytest.raises(PrefetchStateError) as err:
        advance(7, current, wanted)
    assert (err.value.op, err.value.current, err.value.wanted) == (7, current, wanted)
    assert current.name in str(err.value) and wanted.name in str(err.value)


def test_the_table_is_a_lifecycle() -> None:
    # No phase goes back to where an op starts, nothing leaves ENDED, no phase loops on itself.
    assert all(Phase.PROBING not in targets for targets in TRANSITIONS.values())
    assert TRANSITIONS[Phase.ENDED] == frozenset()
    assert all(phase not in TRANSITIONS[phase] for phase in Phase)
    # Settled phases only end; every running phase can be settled.
    for phase in RUNNING:
        assert {Phase.DONE, Phase.REVOKED} <= TRANSITIONS[phase]
    assert TRANSITIONS[Phase.DONE] == TRANSITIONS[Phase.REVOKED] == {Phase.ENDED}


def test_what_a_caller_sees() -> None:
    assert {caller_state(p) for p in RUNNING} == {"running"}
    assert caller_state(Phase.DONE) == "done"
    assert caller_state(Phase.REVOKED) == "revoked"
