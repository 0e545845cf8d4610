"""CPU transfer streams: a worker thread per direction running copy jobs in order.

`on_done` is called on the worker thread of that direction (pass a thread-safe callable,
e.g. one that hands the result to the event loop)."""

from __future__ import annotations

from hicache.kernels.engines import CpuEngine
from hicache.kernels.indices import SlotArray, plan_transfer
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams.base import FaultHook, FaultPoint, OnDone
from hicache.kernels.streams.progress import CpuLoadHandle
from hicache.kernels.streams.worker import OrderedWorker
from hicache.kernels.transfer import check_io, run_backup, run_load_layer


class CpuStreams:
    """TransferStreams over host memory. Each direction has its own engine (scratch memory)
    touched only by that direction's worker thread."""

    kind = "cpu"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        io: str,
        fault: FaultHook | None = None,
    ) -> None:
        check_io(io)
        if device_pool.device.type != "cpu":
            raise ValueError(f"CPU streams need a CPU device pool, got one on {device_pool.device}")
        self.device_pool, self.host_pool, self.io = device_pool, host_pool, io
        self._fault = fault
        self._load_engine, self._backup_engine = CpuEngine(), CpuEngine()
        self._loads = OrderedWorker("hicache-load")
        self._backups = OrderedWorker("hicache-backup")
        self._load_jobs = 0
        self._backup_jobs = 0

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> CpuLoadHandle:
        """Queue a load of all layers; raises on bad input before queueing."""
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        handle = CpuLoadHandle(self.device_pool.geometry.layers)
        job_index = self._load_jobs
        self._load_jobs += 1

        def job() -> None:
            try:
                for layer in range(self.device_pool.geometry.layers):
                    if self._fault is not None:
                        self._fault(FaultPoint("load", job_index, layer))
                    run_load_layer(
                        plan, self.host_pool, self.device_pool, layer, self.io, self._load_engine
                    )
                    handle.progress.land(layer)
            except Exception as exc:  # noqa: BLE001 - a failed copy is reported through on_done
                handle.progress.fail(exc)
                on_done(exc)
                return
            on_done(None)

        self._loads.submit(job)
        return handle

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        """Queue a backup of all layers; raises on bad input before queueing."""
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        job_index = self._backup_jobs
        self._backup_jobs += 1

        def job() -> None:
            try:
                if self._fault is not None:
                    self._fault(FaultPoint("backup", job_index, None))
                run_backup(plan, self.device_pool, self.host_pool, self.io, self._backup_engine)
            except Exception as exc:  # noqa: BLE001 - a failed copy is reported through on_done
                on_done(exc)
                return
            on_done(None)

        self._backups.submit(job)

    def close(self) -> None:
        self._loads.close()
        self._backups.close()
