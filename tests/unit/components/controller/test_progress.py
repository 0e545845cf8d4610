"""The layout of the vectors TP ranks agree on: each flow's rows come back as its rows."""

import pytest

from hicache.components.controller.progress import Progress, Section
from hicache.types import OpId


def _progress() -> Progress:
    return Progress.of(
        Section.of([(OpId(1), (1, 1), ()), (OpId(2), (0, 1), ())], 2),
        Section.of([(OpId(3), (1, 0), ())], 2),
        Section.of([], 1),
        Section.of([(OpId(5), (-1, 0, 0, 0), (0,)), (OpId(6), (4, 2, 1, 0), (1,))], 4, 1),
    )


def test_flat_vectors_follow_the_sections_in_apply_order() -> None:
    seen = _progress()
    assert seen.mins == [1, 1, 0, 1, 1, 0, -1, 0, 0, 0, 4, 2, 1, 0]
    assert seen.maxes == [0, 1]
    assert seen.agreed(seen.mins, seen.maxes) is seen  # one rank agrees with itself


def test_agreed_values_come_back_as_each_flows_rows() -> None:
    seen = _progress()
    mins = [v - 1 for v in seen.mins]  # what another rank's MIN could give
    agreed = seen.agreed(mins, [1, 1])
    assert list(agreed.backups.rows()) == [(1, (0, 0), ()), (2, (-1, 0), ())]
    assert list(agreed.loads.rows()) == [(3, (0, -1), ())]
    assert list(agreed.uploads.rows()) == []
    assert list(agreed.prefetches.rows()) == [(5, (-2, -1, -1, -1), (1,)), (6, (3, 1, 0, -1), (1,))]


def test_vectors_of_another_layout_are_refused() -> None:
    seen = _progress()
    with pytest.raises(AssertionError, match="another layout"):
        seen.agreed([*seen.mins, 0], seen.maxes)
