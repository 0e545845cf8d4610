"""Choosing a TransferStreams implementation, with the reason reported as data."""

from __future__ import annotations

from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams.base import FaultHook, Schedule, StreamSelection, TransferStreams

PREFERENCES = ("auto", "cuda", "cpu", "inline", "virtual")


def cuda_driver_status() -> tuple[bool, str]:
    """(usable, why): asks the CUDA runtime through cuda-python how many devices it sees.
    Never raises: a missing package, library or driver is a `False` with the reason."""
    try:
        from cuda.bindings import runtime as cudart
    except Exception as exc:  # noqa: BLE001 - the package or its native library is absent
        return False, f"cuda-python unavailable: {exc}"
    try:
        err, count = cudart.cudaGetDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any driver failure means: no CUDA here
        return False, f"cudaGetDeviceCount raised: {exc}"
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        return False, f"cudaGetDeviceCount failed: {name}"
    if not count:
        return False, "cudaGetDeviceCount found no device"
    return True, f"cudaGetDeviceCount found {count} device(s)"


def make_streams(
    device_pool: DevicePool,
    host_pool: HostPool,
    *,
    io: str,
    prefer: str = "auto",
    schedule: Schedule | None = None,
    bandwidth: float | None = None,
    fault: FaultHook | None = None,
    transfer_sms: int = DEFAULT_TRANSFER_SMS,
) -> tuple[TransferStreams, StreamSelection]:
    """Build transfer streams for these pools.

    prefer: "virtual" (needs `schedule` and `bandwidth`; deterministic mode), "inline" (loads
    copied on the event loop at submit, backups on a copy thread beside it where the compiled
    copier runs: the virtual streams' machinery with no modelled time; needs `schedule`); both
    move bytes with the engine of the device pool's device (streams/inline.py). "cuda" or "auto"
    (CUDA when the device pool is on a CUDA device and the driver answers, else CPU with the
    reason), "cpu". `transfer_sms`: the SMs a CUDA stream's copy kernel may occupy. Raises
    ValueError for an unknown preference or missing virtual arguments."""
    if prefer not in PREFERENCES:
        raise ValueError(
            f"unknown stream preference {prefer!r}; expected one of {list(PREFERENCES)}"
        )
    if prefer == "inline":
        if schedule is None:
            raise ValueError("inline streams need schedule=(delay, callback)")
        from hicache.kernels.streams.virtual import VirtualStreams

        streams = VirtualStreams(
            device_pool,
            host_pool,
            io=io,
            schedule=schedule,
            bandwidth=float("inf"),
            fault=fault,
            transfer_sms=transfer_sms,
            defer_backups=True,
        )
        return streams, StreamSelection(
            "inline",
            prefer,
            f"{streams.copies.kind.upper()} copies on the event loop at submit, backups "
            "on a copy thread beside it where the compiled copier runs (cpu_transfers='inline')",
        )
    if prefer == "virtual":
        if schedule is None or bandwidth is None:
            raise ValueError(
                "virtual streams need schedule=(delay, callback) and bandwidth=bytes/s"
            )
        from hicache.kernels.streams.virtual import VirtualStreams

        streams = VirtualStreams(
            device_pool,
            host_pool,
            io=io,
            schedule=schedule,
            bandwidth=bandwidth,
            fault=fault,
            transfer_sms=transfer_sms,
        )
        return streams, StreamSelection(
            "virtual",
            prefer,
            "virtual time requested (deterministic mode); bytes move at submit with the "
            f"{streams.copies.kind.upper()} engine of the device pool's {device_pool.device}",
        )
    from hicache.kernels.streams.cpu import CpuStreams

    if prefer == "cpu":
        return CpuStreams(device_pool, host_pool, io=io, fault=fault), StreamSelection(
            "cpu", prefer, "CPU streams requested"
        )
    usable, why = cuda_driver_status()
    if device_pool.device.type == "cuda":
        if not usable:
            raise RuntimeError(
                f"device pool is on {device_pool.device} but CUDA is unusable: {why}"
            )
        from hicache.kernels.streams.cuda import CudaStreams

        cuda = CudaStreams(device_pool, host_pool, io=io, fault=fault, transfer_sms=transfer_sms)
        return cuda, StreamSelection("cuda", prefer, why)
    reason = f"device pool is on {device_pool.device}; {why}; using CPU streams"
    return CpuStreams(device_pool, host_pool, io=io, fault=fault), StreamSelection(
        "cpu", prefer, reason
    )
