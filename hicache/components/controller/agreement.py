"""Agreement across tensor-parallel ranks, so that every rank's tree changes identically.

Each TP rank runs its own cache over its own head shard (MHA) or a copy of the latent (MLA).
Frontend calls reach every rank in the same order, but completions (a write landed, a prefetch
read N pages) arrive at each rank's own pace. The tree therefore applies completions only at
*sync points* (the start of each frontend call, and while an eviction waits for a backup), and
only as far as every rank has got: counts are agreed by MIN (completed writes, loads, uploads;
prefetch hit and read pages; whether a copy succeeded) and "may stop" by MAX (a prefetch timer
fired on some rank). One all-reduce per sync point; single-rank caches agree with themselves
for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class RankAgreement(Protocol):
    trivial: bool  # True when there is one rank: values come back unchanged, nothing is sent

    async def agree(self, mins: Sequence[int], maxes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Every rank calls this at the same sync point with vectors of the same lengths; each
        gets the element-wise MIN of `mins` and MAX of `maxes` over all ranks."""
        ...


class SingleRank:
    """One rank: nothing to agree with."""

    trivial = True

    async def agree(self, mins: Sequence[int], maxes: Sequence[int]) -> tuple[list[int], list[int]]:
        return list(mins), list(maxes)


class TorchDistributedAgreement:
    """Agreement over a `torch.distributed` process group (gloo on CPU). The collective runs in
    a worker thread so the rank's event loop (stream completions, storage I/O) keeps moving
    while it waits for its peers. Use a group of its own, apart from the model's NCCL group,
    as the seed design does for its background work."""

    trivial = False

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        self._dist = dist
        self._group = group
        self.calls = 0

    async def agree(self, mins: Sequence[int], maxes: Sequence[int]) -> tuple[list[int], list[int]]:
        import anyio
        import torch

        # MAX(x) = -MIN(-x): one MIN all-reduce carries both.
        values = torch.tensor([*mins, *(-v for v in maxes)], dtype=torch.int64)

        def reduce() -> None:
            if values.numel():
                self._dist.all_reduce(values, op=self._dist.ReduceOp.MIN, group=self._group)
            else:
                self._dist.barrier(group=self._group)

        self.calls += 1
        await anyio.to_thread.run_sync(reduce)
        out = values.tolist()
        return out[: len(mins)], [-v for v in out[len(mins) :]]
