"""Virtual transfer streams for deterministic mode.

Bytes are copied inline at submit, by the engine that fits the pools' device (streams/inline.py:
the CPU row copier for host pools, the CUDA engine on its own stream, waited for, for GPU pools);
completion is *reported* at virtual times from a bandwidth model: within one direction jobs are serial, and layer `i` of a load lands
`bytes_per_layer / bandwidth` after layer `i-1` (a backup lands once, after all its bytes).
Timing goes through `schedule(delay_seconds, callback)`, supplied by the runtime; callbacks run
on the event loop, so `on_done` is called on the loop (from a scheduled callback, never from
inside `submit_*`).

With `defer_backups` (inline streams, no modelled time) a backup's bytes move on a copy thread
beside the loop where the copier can take them (streams/inline.py, `backup_later`): its
completion is then reported once they have landed, looked for every `POLL_S` seconds."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import anyio

from hicache.kernels.indices import SlotArray, plan_transfer
from hicache.kernels.names import DEFAULT_TRANSFER_SMS
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.streams.base import (
    FaultHook,
    FaultPoint,
    LayerNotReady,
    OnDone,
    Schedule,
    TransferFailed,
    check_layer,
)
from hicache.kernels.streams.inline import InlineCopies, Landing, inline_copies
from hicache.kernels.transfer import check_io

Step = tuple[float, Callable[[], bool | float]]
"""(delay, action): an action returns True when the rest of its job is to be skipped, or a
float: not yet, run me again after that many seconds."""

POLL_S = 20e-6
"""How often a deferred backup's completion looks whether its bytes have landed."""


class VirtualLoadHandle:
    """Layer progress on virtual time. Mutated only by scheduled callbacks (on the loop)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._landed = 0
        self._error: BaseException | None = None
        self._waiters: list[tuple[int, anyio.Event]] = []

    def _land(self, layer: int) -> None:
        assert layer == self._landed, f"layer {layer} landed out of order"
        self._landed = layer + 1
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        keep = []
        for layer, event in self._waiters:
            if self._landed > layer or self._error is not None:
                event.set()
            else:
                keep.append((layer, event))
        self._waiters = keep

    def _raise_if_failed(self, layer: int) -> None:
        if self._landed <= layer and self._error is not None:
            raise TransferFailed(f"load failed before layer {layer} landed") from self._error

    def wait(self, layer: int) -> None:
        """Returns if `layer` landed; raises LayerNotReady if not yet (use wait_async)."""
        check_layer(self.layers, layer)
        self._raise_if_failed(layer)
        if self._landed <= layer:
            raise LayerNotReady(
                f"layer {layer} has not landed yet (virtual stream); await wait_async"
            )

    async def wait_async(self, layer: int) -> None:
        check_layer(self.layers, layer)
        while self._landed <= layer:
            self._raise_if_failed(layer)
            event = anyio.Event()
            self._waiters.append((layer, event))
            await event.wait()

    def done(self) -> bool:
        return self._landed == self.layers

    def layer_done(self, layer: int) -> bool:
        check_layer(self.layers, layer)
        return self._landed > layer


class _Lane:
    """One direction: a FIFO of jobs whose steps are reported one after another."""

    def __init__(self, schedule: Schedule) -> None:
        self._schedule = schedule
        self._jobs: deque[Sequence[Step]] = deque()
        self._busy = False

    def push(self, steps: Sequence[Step]) -> None:
        self._jobs.append(steps)
        if not self._busy:
            self._next()

    def _next(self) -> None:
        if not self._jobs:
            self._busy = False
            return
        self._busy = True
        self._step(self._jobs.popleft(), 0)

    def _step(self, steps: Sequence[Step], index: int) -> None:
        delay, action = steps[index]

        def fire() -> None:
            stop = action()
            if type(stop) is float:  # not yet: the same step again
                self._schedule(stop, fire)
                return
            if stop or index + 1 == len(steps):
                self._next()
            else:
                self._step(steps, index + 1)

        self._schedule(delay, fire)


class VirtualStreams:
    """TransferStreams on virtual time (see module docstring). Single-threaded: use from the loop."""

    kind = "virtual"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        io: str,
        schedule: Schedule,
        bandwidth: float,
        fault: FaultHook | None = None,
        copies: InlineCopies | None = None,
        transfer_sms: int = DEFAULT_TRANSFER_SMS,
        defer_backups: bool = False,
    ) -> None:
        """`copies`: what moves the bytes (default: `inline_copies` for the device pool's
        device, its CUDA copy kernel on at most `transfer_sms` SMs; raises `UnreachableMemory`
        for a device no engine moves). `defer_backups`: backups' bytes move beside the loop
        where the copies can (module docstring); for streams without modelled time only."""
        check_io(io)
        if not bandwidth or bandwidth <= 0:
            raise ValueError(
                f"virtual streams need a positive bandwidth in bytes/s, got {bandwidth!r}"
            )
        self.device_pool, self.host_pool, self.io = device_pool, host_pool, io
        self.bandwidth = float(bandwidth)
        self._fault = fault
        self.copies = (
            copies
            if copies is not None
            else inline_copies(device_pool, host_pool, io, transfer_sms=transfer_sms)
        )
        self._loads, self._backups = _Lane(schedule), _Lane(schedule)
        self._defer_backups = defer_backups
        self._load_jobs = 0
        self._backup_jobs = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("transfer streams are closed")

    def _extra(self, point: FaultPoint) -> tuple[float, BaseException | None]:
        if self._fault is None:
            return 0.0, None
        try:
            return float(self._fault(point) or 0.0), None
        except Exception as exc:  # noqa: BLE001 - a fault hook's raise is the injected failure
            return 0.0, exc

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> VirtualLoadHandle:
        self._check_open()
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        layers = self.device_pool.geometry.layers
        handle = VirtualLoadHandle(layers)
        job = self._load_jobs
        self._load_jobs += 1
        copy_error: BaseException | None = None
        try:  # all layers in one move: they are all copied before any completion is reported
            self.copies.load_all(plan)
        except Exception as exc:  # noqa: BLE001 - reported through on_done, on the loop's turn
            copy_error = exc
        layer_bytes = plan.tokens * self.device_pool.geometry.bytes_per_token // layers
        steps: list[Step] = []
        clean = copy_error is None
        for layer in range(layers):
            extra, fault = self._extra(FaultPoint("load", job, layer))
            error = copy_error if layer == 0 and copy_error is not None else fault
            clean = clean and error is None and extra == 0
            steps.append(
                (
                    layer_bytes / self.bandwidth + extra,
                    self._load_step(handle, layer, error, on_done),
                )
            )
        if clean and math.isinf(self.bandwidth):
            # Inline copies with no modelled time: every layer has landed already, so a
            # synchronous wait(layer) returns at once; only the completion waits for the loop.
            for layer in range(layers):
                handle._land(layer)

            def done() -> bool:
                on_done(None)
                return True

            steps = [(0.0, done)]
        self._loads.push(steps)
        return handle

    @staticmethod
    def _load_step(
        handle: VirtualLoadHandle, layer: int, error: BaseException | None, on_done: OnDone
    ) -> Callable[[], bool]:
        def action() -> bool:
            if error is not None:
                handle._fail(error)
                on_done(error)
                return True  # the rest of this job is skipped
            handle._land(layer)
            if layer == handle.layers - 1:
                on_done(None)
            return False

        return action

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None:
        self._check_open()
        plan = plan_transfer(self.host_pool, self.device_pool, host_slots, device_slots)
        job = self._backup_jobs
        self._backup_jobs += 1
        extra, error = self._extra(FaultPoint("backup", job, None))
        landing: Landing | None = None
        if error is None:
            try:
                if self._defer_backups:
                    landing = self.copies.backup_later(plan)
                else:
                    self.copies.backup(plan)
            except Exception as exc:  # noqa: BLE001 - reported through on_done
                error = exc
        nbytes = plan.tokens * self.device_pool.geometry.bytes_per_token

        def action() -> bool | float:
            if landing is None:
                on_done(error)
            elif landing.landed():
                on_done(landing.error())
            else:
                return POLL_S
            return True

        self._backups.push([(nbytes / self.bandwidth + extra, action)])

    def close(self) -> None:
        """Refuse new jobs; already scheduled completions still fire (their bytes moved at
        submit). Idempotent."""
        if not self._closed:
            self.copies.close()
        self._closed = True
