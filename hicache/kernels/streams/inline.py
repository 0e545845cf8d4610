"""Copies that are complete when the call returns (and, for inline streams' backups, copies
queued on a copy thread: `backup_later`): how virtual and inline streams move bytes.

Virtual streams model *when* a transfer lands; the bytes themselves move at submit, with the
engine a real stream of the pools' device uses: the CPU row copier for host pools, the CUDA
engine on a stream of its own for GPU pools (streams/cuda.py, `CudaInlineCopies`), waited for
before the call returns. So a test on virtual time runs the same on a CPU and on a GPU machine,
and no path hands device memory to the CPU copier (which would dereference device pointers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from hicache.kernels.engines import CpuEngine
from hicache.kernels.indices import PagePlan
from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.native.copier import PageCopier, PendingCopy
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.rows import UnreachableMemory
from hicache.kernels.transfer import run_backup, run_load_all, run_load_layer


class InlineCopies(Protocol):
    """Synchronous whole-transfer copies between one device pool and one host pool."""

    kind: str  # the engine's kind: "cpu" or "cuda"

    def load_all(self, plan: PagePlan) -> None:
        """Every layer of the planned pages host->device; bytes in place on return."""
        ...

    def load_layer(self, plan: PagePlan, layer: int) -> None:
        """One layer of the planned pages host->device; bytes in place on return."""
        ...

    def backup(self, plan: PagePlan) -> None:
        """Every layer of the planned pages device->host; bytes in place on return."""
        ...

    def backup_later(self, plan: PagePlan) -> Landing | None:
        """`backup`, its copies queued beside the caller where they can be: what is still
        landing, or None when the bytes are in place on return."""
        ...

    def close(self) -> None: ...


class Landing:
    """The copies of one transfer still running on a copy thread."""

    __slots__ = ("_jobs",)

    def __init__(self, jobs: list[PendingCopy]) -> None:
        self._jobs = jobs

    def landed(self) -> bool:
        return all(job.done() for job in self._jobs)

    def error(self) -> IndexError | None:
        """Once landed: the first copy's error, if any failed."""
        return next((e for e in (job.error() for job in self._jobs) if e is not None), None)


class CpuInlineCopies:
    """Inline copies for a device pool in host memory: the CPU engine on the calling thread;
    backups through the compiled page loop may instead run on a copy thread of their own
    (`backup_later`, started on first use)."""

    kind = "cpu"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, io: str) -> None:
        self.device_pool, self.host_pool, self.io = device_pool, host_pool, io
        self._engine = CpuEngine()
        self._copier: PageCopier | None = None
        self._no_thread = False  # the copy thread could not be started: back up here

    def load_all(self, plan: PagePlan) -> None:
        run_load_all(plan, self.host_pool, self.device_pool, self.io, self._engine)

    def load_layer(self, plan: PagePlan, layer: int) -> None:
        run_load_layer(plan, self.host_pool, self.device_pool, layer, self.io, self._engine)

    def backup(self, plan: PagePlan) -> None:
        run_backup(plan, self.device_pool, self.host_pool, self.io, self._engine)

    def backup_later(self, plan: PagePlan) -> Landing | None:
        copier = self._copier
        native = self._engine.native
        if copier is None and native is not None and not self._no_thread:
            try:
                copier = self._copier = PageCopier(native)
            except OSError:  # no thread to be had: copy here, and do not ask again
                self._no_thread = True
        if copier is None:
            self.backup(plan)
            return None
        with self._engine.deferring(copier) as jobs:
            run_backup(plan, self.device_pool, self.host_pool, self.io, self._engine)
        return Landing(jobs) if jobs else None

    def close(self) -> None:
        """Run the backups still queued on the copy thread, then stop it (a backup after this
        is copied here). Idempotent."""
        if self._copier is not None:
            self._copier.stop()


Maker = Callable[[DevicePool, HostPool, str, int], InlineCopies]
"""Inline copies for a device type: (device pool, host pool, io, transfer_sms)."""


def _cpu_copies(device_pool: DevicePool, host_pool: HostPool, io: str, sms: int) -> InlineCopies:
    return CpuInlineCopies(device_pool, host_pool, io)  # no SMs to budget on a CPU


def _cuda_copies(device_pool: DevicePool, host_pool: HostPool, io: str, sms: int) -> InlineCopies:
    from hicache.kernels.streams.cuda import CudaInlineCopies  # needs cuda-python and a driver

    return CudaInlineCopies(device_pool, host_pool, io, transfer_sms=sms)


MAKERS: Mapping[str, Maker] = {"cpu": _cpu_copies, "cuda": _cuda_copies}
"""The inline copies of each device type a device pool can live on."""


def inline_copies(
    device_pool: DevicePool,
    host_pool: HostPool,
    io: str,
    *,
    transfer_sms: int = DEFAULT_TRANSFER_SMS,
    makers: Mapping[str, Maker] = MAKERS,
) -> InlineCopies:
    """The inline copies that fit where `device_pool` lives (`makers` by device type; tests
    pass stand-ins; `transfer_sms`: the SMs a CUDA copy kernel may occupy). Raises
    `UnreachableMemory` for a device type no engine moves."""
    kind = device_pool.device.type
    maker = makers.get(kind)
    if maker is None:
        raise UnreachableMemory(
            f"no copy engine moves a device pool on {device_pool.device}; "
            f"pools live on one of {sorted(makers)}"
        )
    return maker(device_pool, host_pool, io, transfer_sms)
