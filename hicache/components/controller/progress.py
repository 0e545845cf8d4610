"""The vectors the TP ranks agree on at a sync point, as one layout: a section per kind of op,
a row per op in flight, the same columns in every row of a section. The op table (`ops.py`)
builds the sections from rows and reads the agreed values back by row; only `Progress.agreed`
knows the flat order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hicache.types import OpId


@dataclass(frozen=True, slots=True)
class Section:
    """One flow's part of the vectors: per op, `mins` (agreed by MIN) and `maxes` (by MAX),
    each row of the same width for every op of the section."""

    ops: tuple[OpId, ...]
    mins: tuple[tuple[int, ...], ...]
    maxes: tuple[tuple[int, ...], ...]
    min_width: int
    max_width: int

    @classmethod
    def of(
        cls,
        rows: Sequence[tuple[OpId, tuple[int, ...], tuple[int, ...]]],
        min_width: int,
        max_width: int = 0,
    ) -> Section:
        """A section from (op, min values, max values) rows, each `min_width` and
        `max_width` values long."""
        if not rows:
            return cls((), (), (), min_width, max_width)
        ops, mins, maxes = zip(*rows, strict=True)
        return cls(ops, mins, maxes, min_width, max_width)

    def rows(self) -> Iterator[tuple[OpId, tuple[int, ...], tuple[int, ...]]]:
        return zip(self.ops, self.mins, self.maxes, strict=True)


@dataclass(frozen=True, slots=True)
class Progress:
    """What this rank has seen of every op in flight: a section per kind, in apply order, and
    the flat vectors the ranks agree on (`of` builds them once)."""

    backups: Section
    loads: Section
    uploads: Section
    prefetches: Section
    mins: list[int]
    maxes: list[int]

    @classmethod
    def of(
        cls, backups: Section, loads: Section, uploads: Section, prefetches: Section
    ) -> Progress:
        sections = (backups, loads, uploads, prefetches)
        return cls(
            backups,
            loads,
            uploads,
            prefetches,
            [v for s in sections for row in s.mins for v in row],
            [v for s in sections for row in s.maxes for v in row],
        )

    def sections(self) -> tuple[Section, ...]:
        return (self.backups, self.loads, self.uploads, self.prefetches)

    def agreed(self, mins: Sequence[int], maxes: Sequence[int]) -> Progress:
        """The same layout holding the values the ranks agreed on (itself for its own
        vectors: one rank agrees with itself)."""
        if mins is self.mins and maxes is self.maxes:
            return self
        at_min = at_max = 0
        out = []
        for s in self.sections():
            n = len(s.ops)
            flat_min = mins[at_min : at_min + n * s.min_width]
            flat_max = maxes[at_max : at_max + n * s.max_width]
            at_min += n * s.min_width
            at_max += n * s.max_width
            out.append(
                Section(
                    s.ops,
                    tuple(_chunks(flat_min, s.min_width, n)),
                    tuple(_chunks(flat_max, s.max_width, n)),
                    s.min_width,
                    s.max_width,
                )
            )
        assert at_min == len(mins) and at_max == len(maxes), "vectors of another layout"
        return Progress.of(*out)


def _chunks(values: Sequence[int], width: int, n: int) -> Iterator[tuple[int, ...]]:
    for i in range(n):
        yield tuple(int(v) for v in values[i * width : (i + 1) * width])
