"""Deterministic transfer streams that move each layer's bytes when it lands
(`LateLandingStreams`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.kernels.faults import FaultPlan
from hicache.kernels.streams.base import FaultPoint, LoadHandle, OnDone

if TYPE_CHECKING:
    from hicache.cache import HiCache
    from hicache.kernels.indices import SlotArray
    from hicache.kernels.streams.virtual import VirtualLoadHandle, VirtualStreams


class LateLandingStreams:
    """Deterministic transfer streams whose bytes move when each layer *lands* (as real
    streams do: a copy runs some time after it was queued), not at submit like the default
    virtual streams. Timing and faults as `VirtualStreams`. Built unbound: `bind(cache)` once
    the cache is open (the pools and the actor system's timers exist only then)."""

    kind = "virtual"

    def __init__(self, *, bandwidth: float, fault: FaultPlan | None = None) -> None:
        self._bandwidth = bandwidth
        self._fault = fault
        self._inner: VirtualStreams | None = None

    def bind(self, cache: HiCache) -> None:
        from hicache.kernels.streams.virtual import VirtualStreams

        outer = self

        class _Late(VirtualStreams):
            def submit_load(
                self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
            ) -> VirtualLoadHandle:
                return outer._submit_load(self, host_slots, device_slots, on_done)

            def submit_backup(
                self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
            ) -> None:
                outer._submit_backup(self, device_slots, host_slots, on_done)

        self._inner = _Late(
            cache.device_pool,
            cache.host_pool,
            io=cache.config.io_backend,
            schedule=cache.system.call_later,
            bandwidth=self._bandwidth,
            fault=self._fault,
        )

    @staticmethod
    def _submit_load(
        s: VirtualStreams, host_slots: SlotArray, device_slots: SlotArray, on_done: OnDone
    ) -> VirtualLoadHandle:
        from hicache.kernels.indices import plan_transfer
        from hicache.kernels.streams.virtual import VirtualLoadHandle

        s._check_open()
        plan = plan_transfer(s.host_pool, s.device_pool, host_slots, device_slots)
        layers = s.device_pool.geometry.layers
        handle = VirtualLoadHandle(layers)
        job = s._load_jobs
        s._load_jobs += 1
        layer_bytes = plan.tokens * s.device_pool.geometry.bytes_per_token // layers

        def step(layer: int, fault: BaseException | None) -> Callable[[], bool]:
            def action() -> bool:
                error = fault
                if error is None:
                    try:
                        s.copies.load_layer(plan, layer)
                    except Exception as exc:  # noqa: BLE001 - reported like a stream would
                        error = exc
                if error is not None:
                    handle._fail(error)
                    on_done(error)
                    return True
                handle._land(layer)
                if layer == layers - 1:
                    on_done(None)
                return False

            return action

        steps: list[tuple[float, Callable[[], bool]]] = []
        for layer in range(layers):
            extra, fault = s._extra(FaultPoint("load", job, layer))
            steps.append((layer_bytes / s.bandwidth + extra, step(layer, fault)))
        s._loads.push(steps)
        return handle

    @staticmethod
    def _submit_backup(
        s: VirtualStreams, device_slots: SlotArray, host_slots: SlotArray, on_done: OnDone
    ) -> None:
        from hicache.kernels.indices import plan_transfer

        s._check_open()
        plan = plan_transfer(s.host_pool, s.device_pool, host_slots, device_slots)
        job = s._backup_jobs
        s._backup_jobs += 1
        extra, fault = s._extra(FaultPoint("backup", job, None))
        nbytes = plan.tokens * s.device_pool.geometry.bytes_per_token

        def action() -> bool:
            error = fault
            if error is None:
                try:
                    s.copies.backup(plan)
                except Exception as exc:  # noqa: BLE001
                    error = exc
            on_done(error)
            return True

        s._backups.push([(nbytes / s.bandwidth + extra, action)])

    def _bound(self) -> VirtualStreams:
        if self._inner is None:
            raise RuntimeError("LateLandingStreams used before bind(cache)")
        return self._inner

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> LoadHandle:
        return self._bound().submit_load(host_slots, device_slots, on_done=on_done)

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        self._bound().submit_backup(device_slots, host_slots, on_done=on_done)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
