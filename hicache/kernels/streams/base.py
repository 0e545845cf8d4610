"""The transfer-stream interface shared by the CUDA, CPU and virtual implementations.

A stream set owns two ordered queues, one per direction (loads host->device, backups
device->host). Jobs in one direction run in submission order; the two directions run
independently. Bad input raises from `submit_*` before anything is queued; a copy that fails
later is reported through `on_done(exc)` exactly once, and waiters on its layers get
`TransferFailed` instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hicache.kernels.indices import SlotArray

OnDone = Callable[[BaseException | None], None]
"""Completion callback: None on success, the exception on failure; called exactly once per job."""

Schedule = Callable[[float, Callable[[], None]], object]
"""`schedule(delay_seconds, callback)`: the runtime's timer, which virtual streams report on
(what it returns, e.g. a timer handle, is not used)."""


class TransferFailed(RuntimeError):
    """A waited-on layer will never land because its load failed (the cause is chained)."""


class LayerNotReady(RuntimeError):
    """Virtual streams only: `wait(layer)` was called before that layer's virtual landing time."""


@dataclass(frozen=True, slots=True)
class StreamSelection:
    """Which implementation `make_streams` chose and why (the caller turns it into an event)."""

    kind: Literal["cuda", "cpu", "inline", "virtual"]
    requested: str
    reason: str


@dataclass(frozen=True, slots=True)
class FaultPoint:
    """Where a fault hook is consulted: before `layer` of the `job`-th job (0-based, per
    direction) is copied; `layer` is None for a backup (all layers at once)."""

    direction: Literal["load", "backup"]
    job: int
    layer: int | None


FaultHook = Callable[[FaultPoint], "float | None"]
"""Test hook: raise to make that step fail (reported via on_done). Thread-based streams call it
on their worker thread, so it may also block there (e.g. on a threading.Event) to stall a
layer; virtual streams add a returned float to that step's virtual duration (seconds)."""


@runtime_checkable
class LoadHandle(Protocol):
    """Progress of one submitted load (all layers, in order)."""

    def wait(self, layer: int) -> None:
        """Make `layer` usable by compute: CUDA: the current stream waits on its event (no host
        sync); CPU: blocks until copied; virtual: returns if landed, else raises LayerNotReady.
        Raises TransferFailed if the load failed before `layer` landed."""
        ...

    async def wait_async(self, layer: int) -> None:
        """Return once `layer` has landed (virtual: at its virtual time). TransferFailed as above."""
        ...

    def done(self) -> bool:
        """Every layer has landed (False after a failure)."""
        ...

    def layer_done(self, layer: int) -> bool: ...


@runtime_checkable
class TransferStreams(Protocol):
    kind: str

    def submit_load(
        self, host_slots: SlotArray, device_slots: SlotArray, *, on_done: OnDone
    ) -> LoadHandle: ...

    def submit_backup(
        self, device_slots: SlotArray, host_slots: SlotArray, *, on_done: OnDone
    ) -> None: ...

    def close(self) -> None:
        """Finish queued jobs, then stop; idempotent. Later submits raise RuntimeError."""
        ...


def check_layer(layers: int, layer: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer {layer!r} out of range [0, {layers})")


class AllLoads:
    """A LoadHandle over several loads: a layer is usable once it has landed in every one
    (a request's prefix can span its own load and loads other requests started)."""

    __slots__ = ("handles",)

    def __init__(self, handles: Iterable[LoadHandle]) -> None:
        self.handles = tuple(handles)

    def wait(self, layer: int) -> None:
        for handle in self.handles:
            handle.wait(layer)

    async def wait_async(self, layer: int) -> None:
        for handle in self.handles:
            await handle.wait_async(layer)

    def done(self) -> bool:
        return all(handle.done() for handle in self.handles)

    def layer_done(self, layer: int) -> bool:
        return all(handle.layer_done(layer) for handle in self.handles)
