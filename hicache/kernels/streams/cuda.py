"""CUDA transfer streams through cuda-python: a non-blocking stream per direction, an event per
layer for loads, torch ops enqueued on those streams via `torch.cuda.ExternalStream`.

Two worker threads per direction: one enqueues the copies (so submit never blocks the loop),
the other waits for them on the host (cudaEventSynchronize) and calls `on_done`, in submission
order. Job N+1 is enqueued while job N's copies still run, so the stream never idles between
jobs for a thread hand-off and a Python launch.
`LoadHandle.wait(layer)` blocks only until the layer's copies are *enqueued* (microseconds),
then makes torch's current stream wait on the layer's event: no host sync on the copy."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hicache.kernels.engines import CudaEngine
from hicache.kernels.indices import PagePlan, SlotArray, plan_transfer
from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams.base import FaultHook, FaultPoint, OnDone, check_layer
from hicache.kernels.streams.progress import LayerProgress
from hicache.kernels.streams.worker import OrderedWorker
from hicache.kernels.transfer import check_io, run_backup, run_load_all, run_load_layer


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class _Cuda:
    """The few cuda-python runtime calls used here, with errors turned into exceptions."""

    def __init__(self) -> None:
        from cuda.bindings import runtime as cudart

        self.rt = cudart

    def stream(self) -> Any:
        return _check(
            self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags",
        )

    def event(self) -> Any:
        return _check(
            self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming),
            "cudaEventCreateWithFlags",
        )

    def _stream(self, stream: Any) -> Any:
        return self.rt.cudaStream_t(stream) if isinstance(stream, int) else stream

    def record(self, event: Any, stream: Any) -> None:
        _check(self.rt.cudaEventRecord(event, self._stream(stream)), "cudaEventRecord")

    def stream_wait(self, stream: Any, event: Any) -> None:
        _check(self.rt.cudaStreamWaitEvent(self._stream(stream), event, 0), "cudaStreamWaitEvent")

    def synchronize(self, event: Any) -> None:
        _check(self.rt.cudaEventSynchronize(event), "cudaEventSynchronize")

    def query(self, event: Any) -> bool:
        (err,) = self.rt.cudaEventQuery(event)
        return int(err) == 0

    def destroy_events(self, events: list[Any]) -> None:
        for event in events:
            self.rt.cudaEventDestroy(event)

    def destroy_stream(self, stream: Any) -> None:
        self.rt.cudaStreamDestroy(stream)


class CudaLoadHandle:
    """LoadHandle of the CUDA streams. `progress` counts layers whose copies are enqueued and
    recorded (the worker sets it); `landed` additionally needs the layer's event complete."""

    def __init__(self, cuda: _Cuda, layers: int, device: torch.device) -> None:
        self._cuda = cuda
        self.layers = layers
        self._device = device  # the pool's: its current stream is the one that reads the layers
        self.events = [cuda.event() for _ in range(layers)]
        self.enqueued = LayerProgress(layers)
        self.completed = LayerProgress(layers)
        weakref.finalize(self, cuda.destroy_events, list(self.events))

    def wait(self, layer: int) -> None:
        self.enqueued.block_until(layer)
        self._cuda.stream_wait(
            torch.cuda.current_stream(self._device).cuda_stream, self.events[layer]
        )

    async def wait_async(self, layer: int) -> None:
        await self.completed.wait_async(layer)

    def done(self) -> bool:
        return self.completed.landed(self.layers - 1)

    def layer_done(self, layer: int) -> bool:
        check_layer(self.layers, layer)
        if not self.enqueued.landed(layer):
            return False
        return self.completed.landed(layer) or self._cuda.query(self.events[layer])


class CudaStreams:
    """TransferStreams on a CUDA device (see module docstring)."""

    kind = "cuda"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        io: str,
        fault: FaultHook | None = None,
        transfer_sms: int = DEFAULT_TRANSFER_SMS,
    ) -> None:
        """`transfer_sms`: the SMs kernel io's copy kernel may occupy (cuda_engine.py)."""
        check_io(io)
        if device_pool.device.type != "cuda":
            raise ValueError(
                f"CUDA streams need a CUDA device pool, got one on {device_pool.device}"
            )
        self.device_pool, self.host_pool, self.io = device_pool, host_pool, io
        self._fault = fault
        self._cuda = _Cuda()
        with torch.cuda.device(device_pool.device):
            self._load_stream, self._backup_stream = self._cuda.stream(), self._cuda.stream()
        self._streams: tuple[Any, ...] = (self._load_stream, self._backup_stream)  # to destroy
        self._engines = {
            "load": CudaEngine(device_pool.device, self._load_stream, transfer_sms=transfer_sms),
            "backup": CudaEngine(
                device_pool.device, self._backup_stream, transfer_sms=transfer_sms
            ),
        }
        self._loads = OrderedWorker("hicache-cuda-load")
        self._backups = OrderedWorker("hicache-cuda-backup")
        # completions, in the order their jobs were enqueued (each direction is one stream)
        self._loads_done = OrderedWorker("hicache-cuda-load-done")
        self._backups_done = OrderedWorker("hicache-cuda-backup-done")
        self._jobs = {"load": 0, "backup": 0}
        self._lock = threading.Lock()

    def copy_paths(self) -> dict[str, str]:
        """How the copies run (the same for both directions): kernel io's `kernel_copies`
        ("triton" or "torch") and direct io's issuer (`direct_copies`: "batch", "batch-python",
        "loop" or "python"), each with its reason; for the `streams.selected` event."""
        engine = self._engines["load"]
        issuer = engine.direct_issuer
        return {
            "kernel_copies": engine.kernel_path,
            "kernel_copies_reason": engine.kernel_reason,
            "direct_copies": "python" if issuer is None else issuer.name,
            "direct_copies_reason": engine.issuer_reason,
        }

    def _after_compute(self) -> object:
        """An event on the submitter's current (compute) stream: copies start after it, so they
        see the engine's writes and do not overwrite slots the compute stream still reads."""
        event = self._cuda.event()
        self._cuda.record(event, torch.cuda.current_stream(self.device_pool.device).cuda_stream)
        return event

    def _next_job(self, direction: str) -> int:
        with self._lock:
            index = self._jobs[direction]
            self._jobs[direction] += 1
            return index

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> CudaLoadHandle:
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        layers = self.device_pool.geometry.layers
        handle = CudaLoadHandle(self._cuda, layers, self.device_pool.device)
        ready = self._after_compute()
        job_index = self._next_job("load")
        stream = self._load_stream
        engine = self._engines["load"]

        def complete(error: Exception | None, drained: Any) -> None:
            try:
                if error is None:
                    for layer in range(layers):
                        self._cuda.synchronize(handle.events[layer])
                        handle.completed.land(layer)
                else:
                    self._drain(drained)
            except Exception as exc:  # noqa: BLE001 - a failed copy is reported through on_done
                error = exc
            finally:
                self._cuda.destroy_events([e for e in (ready, drained) if e is not None])
            if error is not None:
                # layers already enqueued still complete on the GPU; the job as a whole failed
                handle.enqueued.fail(error)
                handle.completed.fail(error)
            on_done(error)

        def job() -> None:
            error: Exception | None = None
            drained = None
            try:
                self._cuda.stream_wait(stream, ready)
                with (
                    torch.cuda.device(self.device_pool.device),
                    torch.cuda.stream(
                        torch.cuda.ExternalStream(int(stream), device=self.device_pool.device)
                    ),
                ):
                    for layer in range(layers):
                        if self._fault is not None:
                            self._fault(FaultPoint("load", job_index, layer))
                        run_load_layer(
                            plan, self.host_pool, self.device_pool, layer, self.io, engine
                        )
                        self._cuda.record(handle.events[layer], stream)
                        handle.enqueued.land(layer)
            except Exception as exc:  # noqa: BLE001 - reported in order by the completion
                error = exc
                drained = self._after_enqueued(stream)
            self._loads_done.submit(lambda: complete(error, drained))

        try:
            self._loads.submit(job)
        except BaseException:  # closed: the job never runs to release its event
            self._cuda.destroy_events([ready])
            raise
        return handle

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        ready = self._after_compute()
        job_index = self._next_job("backup")
        stream = self._backup_stream
        engine = self._engines["backup"]

        def complete(done_event: Any, error: Exception | None) -> None:
            try:
                if error is None:
                    self._cuda.synchronize(done_event)
                else:
                    self._drain(done_event)
            except Exception as exc:  # noqa: BLE001 - a failed copy is reported through on_done
                error = exc
            finally:
                self._cuda.destroy_events([e for e in (ready, done_event) if e is not None])
            on_done(error)

        def job() -> None:
            done_event, error = None, None
            try:
                self._cuda.stream_wait(stream, ready)
                if self._fault is not None:
                    self._fault(FaultPoint("backup", job_index, None))
                with (
                    torch.cuda.device(self.device_pool.device),
                    torch.cuda.stream(
                        torch.cuda.ExternalStream(int(stream), device=self.device_pool.device)
                    ),
                ):
                    run_backup(plan, self.device_pool, self.host_pool, self.io, engine)
                done_event = self._cuda.event()
                self._cuda.record(done_event, stream)
            except Exception as exc:  # noqa: BLE001 - reported in order by the completion
                error = exc
                if done_event is not None:
                    self._cuda.destroy_events([done_event])
                done_event = self._after_enqueued(stream)
            self._backups_done.submit(lambda: complete(done_event, error))

        try:
            self._backups.submit(job)
        except BaseException:  # closed: the job never runs to release its event
            self._cuda.destroy_events([ready])
            raise

    def _after_enqueued(self, stream: Any) -> Any:
        """After a job failed: an event behind whatever copies it did enqueue, or None where
        the stream takes none (the device is lost: nothing on it runs on)."""
        try:
            event = self._cuda.event()
        except Exception:  # noqa: BLE001 - see the docstring
            return None
        try:
            self._cuda.record(event, stream)
        except Exception:  # noqa: BLE001 - see the docstring
            self._cuda.destroy_events([event])
            return None
        return event

    def _drain(self, event: Any) -> None:
        """Wait for the copies a failed job enqueued (`_after_enqueued`) before it is reported:
        the tree then frees and reuses its slots, which those copies must no longer write."""
        if event is None:
            return
        with contextlib.suppress(Exception):  # the job's own error is the one reported
            self._cuda.synchronize(event)

    def close(self) -> None:
        """Let the jobs queued finish and report, then release both streams. Idempotent."""
        # the enqueuers first: each hands its last completions over before it stops
        self._loads.close()
        self._backups.close()
        self._loads_done.close()
        self._backups_done.close()
        with self._lock:
            streams, self._streams = self._streams, ()
        for stream in streams:  # every copy on them was waited for by the completions
            self._cuda.destroy_stream(stream)


class CudaInlineCopies:
    """Synchronous copies for virtual streams on a CUDA pool (streams/inline.py): the engine
    `CudaStreams` uses, on a non-blocking stream of its own. Each copy is ordered after the
    work already queued on the caller's current stream (the compute that wrote the slots a
    backup reads, or still reads the slots a load overwrites), as `CudaStreams` orders it, and
    is waited for on the host before the call returns."""

    kind = "cuda"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        io: str,
        *,
        transfer_sms: int = DEFAULT_TRANSFER_SMS,
    ) -> None:
        check_io(io)
        if device_pool.device.type != "cuda":
            raise ValueError(
                f"CUDA inline copies need a CUDA device pool, got one on {device_pool.device}"
            )
        self.device_pool, self.host_pool, self.io = device_pool, host_pool, io
        self._cuda = _Cuda()
        with torch.cuda.device(device_pool.device):
            self._stream: Any = self._cuda.stream()
        self._engine = CudaEngine(device_pool.device, self._stream, transfer_sms=transfer_sms)

    def _run(self, copy: Callable[[CudaEngine], object]) -> None:
        device = self.device_pool.device
        if self._stream is None:
            raise RuntimeError("CUDA inline copies are closed")
        ready, done = self._cuda.event(), self._cuda.event()
        try:
            self._cuda.record(ready, torch.cuda.current_stream(device).cuda_stream)
            self._cuda.stream_wait(self._stream, ready)
            try:
                with (
                    torch.cuda.device(device),
                    torch.cuda.stream(torch.cuda.ExternalStream(int(self._stream), device=device)),
                ):
                    copy(self._engine)
            except Exception:
                # what was enqueued before the failure runs before the caller hears of it (and
                # frees the slots); the copy's own error is the one raised
                with contextlib.suppress(Exception):
                    self._cuda.record(done, self._stream)
                    self._cuda.synchronize(done)
                raise
            self._cuda.record(done, self._stream)
            self._cuda.synchronize(done)
        finally:
            self._cuda.destroy_events([ready, done])

    def load_all(self, plan: PagePlan) -> None:
        self._run(
            lambda engine: run_load_all(plan, self.host_pool, self.device_pool, self.io, engine)
        )

    def load_layer(self, plan: PagePlan, layer: int) -> None:
        self._run(
            lambda engine: run_load_layer(
                plan, self.host_pool, self.device_pool, layer, self.io, engine
            )
        )

    def backup(self, plan: PagePlan) -> None:
        self._run(
            lambda engine: run_backup(plan, self.device_pool, self.host_pool, self.io, engine)
        )

    def backup_later(self, plan: PagePlan) -> None:
        """`backup`: a GPU's copies are waited for here (nothing lands later)."""
        self.backup(plan)

    def close(self) -> None:
        """Release the stream (every copy on it was waited for already). Idempotent."""
        if self._stream is not None:
            self._cuda.destroy_stream(self._stream)
            self._stream = None
