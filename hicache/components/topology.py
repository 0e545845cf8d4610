"""Every channel of the cache and its bound, in one place: `Topology.edges()`.

Commands flow down (frontend -> tree -> workers) with blocking sends; completions flow up with
non-blocking sends into the receiver's *reserve*, room that ordinary traffic cannot take. A
sender never has more commands in flight than its credits, and every receiver's reserve is at
least the completions those credits can produce, so a completion always finds room and no
cycle of full channels can form (docs/architecture.md has the argument).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Bounds(NamedTuple):
    capacity: int  # ordinary (blocking) sends
    reserve: int  # room only completions (`send_nowait`) may take


@dataclass(frozen=True, slots=True)
class Topology:
    capacity: int  # ordinary bound of every inbox (frontend requests into the tree, commands)
    credits: int  # commands in flight per worker kind: writes, loads, uploads, prefetches

    @classmethod
    def for_capacity(cls, capacity: int) -> Topology:
        return cls(capacity=capacity, credits=max(1, capacity // 8))

    # tree: every completion of every worker, an upload's timeout notice, a prefetch's probe
    # and stop reports and its timer
    @property
    def tree_reserve(self) -> int:
        writes = loads = uploads = upload_timeouts = self.credits
        prefetch_reports = 3 * self.credits  # probe, stop, end
        prefetch_timers = self.credits  # cancelled when the op ends: at most one per op
        return writes + loads + uploads + upload_timeouts + prefetch_reports + prefetch_timers

    # writer / loader: one stream completion per command in flight
    @property
    def stream_worker_reserve(self) -> int:
        return self.credits

    # uploader and prefetcher, per op in flight: its storage call's completion and deadline,
    # and a stale deadline of the previous call that fired just before that call returned
    @property
    def uploader_reserve(self) -> int:
        return 3 * self.credits

    # prefetcher: commands are a start, a read and at most one stop per op; one I/O report
    @property
    def prefetcher_capacity(self) -> int:
        return 3 * self.credits

    @property
    def prefetcher_reserve(self) -> int:
        return 3 * self.credits

    def edges(self) -> dict[str, Bounds]:
        """Every actor's inbox by name -> its bounds. The cache builds each actor with these
        (the uploader and prefetcher only with storage on); tests/unit/components/test_topology.py checks
        that every inbox it builds has them."""
        return {
            "tree": Bounds(self.capacity, self.tree_reserve),
            "allocator": Bounds(self.capacity, 0),
            "writer": Bounds(self.credits, self.stream_worker_reserve),
            "loader": Bounds(self.credits, self.stream_worker_reserve),
            "uploader": Bounds(self.credits, self.uploader_reserve),
            "prefetcher": Bounds(self.prefetcher_capacity, self.prefetcher_reserve),
        }
