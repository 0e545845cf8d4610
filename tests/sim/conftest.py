"""The simulation's CI summary: after the run, one block says how many seeds ran, which
configurations and faults they covered, and how many violations there were."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

_RESULTS = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def sim_results(request) -> dict:
    """{"reports": [SimReport, ...], "violations": ["seed N: ...", ...]} for the summary."""
    return request.config.stash.setdefault(_RESULTS, {"reports": [], "violations": []})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(_RESULTS, None)
    if not results:
        return
    REPORTS, VIOLATIONS = results["reports"], results["violations"]
    if not REPORTS and not VIOLATIONS:
        return
    tr = terminalreporter
    modes = Counter(r.mode for r in REPORTS)
    counts = Counter()
    faults = Counter()
    features: dict[str, Counter] = defaultdict(Counter)
    for r in REPORTS:
        counts.update(r.counts)
        faults.update(r.faults)
        for k, v in r.features.items():
            features[k][v] += 1
    wall = sum(r.wall_seconds for r in REPORTS)
    tr.section("hicache simulation")
    runs = ", ".join(f"{n} {m}" for m, n in sorted(modes.items()))
    tr.write_line(
        f"seeds: {len(REPORTS) + len(VIOLATIONS)} ({runs}, {len(VIOLATIONS)} failed) "
        f"in {wall:.1f} s; violations: {len(VIOLATIONS)}"
    )
    tr.write_line(
        f"cache calls {counts['steps']:,}, requests {counts['requests']:,}, pages "
        f"verified {counts['pages_verified']:,}, tokens computed "
        f"{counts['tokens_computed']:,}"
    )
    tr.write_line(
        f"hits: L1 {counts['hit_l1_tokens']:,} / L2 {counts['hit_l2_tokens']:,} / L3 "
        f"{counts['l3_hit_tokens']:,} tokens; loads {counts['loads']:,} "
        f"({counts['released_mid_load']:,} released mid-load); prefetches "
        f"{counts['prefetch_running']:,} started "
        f"({counts['released_mid_prefetch']:,} released mid-prefetch); capacity "
        f"errors {counts['capacity_errors']:,}; abandoned {counts['abandoned']:,}"
    )
    tr.write_line(
        f"backups an L1 eviction waited for {counts['evict_backups']:,}; prefetch anchors "
        f"backed up on demand {counts['anchor_backups']:,} nodes"
    )
    tr.write_line(
        f"retention ranges {counts['retained']:,}; pins {counts['pins']:,} "
        f"({counts['pins_refused']:,} refused at the cap); unpins {counts['unpinned']:,}"
    )
    for name in sorted(features):
        values = ", ".join(f"{v}:{n}" for v, n in sorted(features[name].items(), key=str))
        tr.write_line(f"  {name:<16} {values}")
    tr.write_line(
        "faults injected: " + (", ".join(f"{k}={v:,}" for k, v in sorted(faults.items())) or "none")
    )
    for line in VIOLATIONS:
        tr.write_line("VIOLATION " + line)
