"""Streams for pools of 0 layers: pages with no K/V (a model that keeps everything it resumes
from elsewhere, such as a pure state-space model's snapshots, docs/hybrid.md). A load or a
backup moves nothing; it completes on the next turn of the loop, as inline copies do, so the
tree sees the same order of events as with bytes to move."""

from __future__ import annotations

from hicache.kernels.indices import SlotArray, plan_transfer
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams.base import OnDone, Schedule


class NoLayersLoaded:
    """The LoadHandle of a load with no layers: landed at once. The only layer a caller can
    name is the pool's last, `layers - 1` = -1 (what "every layer landed" is asked as)."""

    __slots__ = ()

    @staticmethod
    def _check(layer: int) -> None:
        if isinstance(layer, bool) or layer != -1:
            raise ValueError(f"layer {layer!r}: the pool has no layers (wait on -1, its last)")

    def wait(self, layer: int) -> None:
        self._check(layer)

    async def wait_async(self, layer: int) -> None:
        self._check(layer)

    def done(self) -> bool:
        return True

    def layer_done(self, layer: int) -> bool:
        self._check(layer)
        return True


class NoKVStreams:
    """TransferStreams between pools of 0 layers: slots are checked as for any transfer
    (bad input raises before anything is queued), no byte moves, completions are reported
    through `schedule` (the runtime's timer) after no time."""

    kind = "none"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, schedule: Schedule):
        if device_pool.geometry.layers or host_pool.geometry.layers:
            raise ValueError("NoKVStreams are for pools of 0 layers")
        self.device_pool, self.host_pool = device_pool, host_pool
        self._schedule = schedule
        self._closed = False

    def _done(self, on_done: OnDone) -> None:
        if self._closed:
            raise RuntimeError("transfer streams are closed")
        self._schedule(0.0, lambda: on_done(None))

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> NoLayersLoaded:
        plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        self._done(on_done)
        return NoLayersLoaded()

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        self._done(on_done)

    def close(self) -> None:
        self._closed = True
