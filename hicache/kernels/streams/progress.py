"""Per-load layer progress for thread-driven streams (CPU and CUDA)."""

from __future__ import annotations

import threading

import anyio.to_thread

from hicache.kernels.streams.base import TransferFailed, check_layer


class LayerProgress:
    """Landed-layer counter shared by one worker thread (writer) and any waiters (readers).

    Invariant: layers land in order, so the state is one count plus an optional failure."""

    def __init__(self, layers: int):
        self.layers = layers
        self._landed = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def land(self, layer: int) -> None:
        """Mark `layer` (the next one) landed. Mutates; worker thread only."""
        with self._cond:
            assert layer == self._landed, (
                f"layer {layer} landed out of order (expected {self._landed})"
            )
            self._landed = layer + 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """No further layer will land. Mutates; worker thread only."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def landed(self, layer: int) -> bool:
        check_layer(self.layers, layer)
        return self._landed > layer

    def finished(self) -> bool:
        return self._landed == self.layers or self._error is not None

    def block_until(self, layer: int) -> None:
        """Block the calling thread until `layer` landed; TransferFailed if it never will."""
        check_layer(self.layers, layer)
        with self._cond:
            self._cond.wait_for(lambda: self._landed > layer or self._error is not None)
            if self._landed <= layer:
                raise TransferFailed(f"load failed before layer {layer} landed") from self._error

    async def wait_async(self, layer: int) -> None:
        if self.landed(layer):
            return
        await anyio.to_thread.run_sync(self.block_until, layer, abandon_on_cancel=True)


class CpuLoadHandle:
    """LoadHandle of the CPU streams: waiting blocks until the worker copied the layer."""

    def __init__(self, layers: int):
        self.progress = LayerProgress(layers)

    def wait(self, layer: int) -> None:
        self.progress.block_until(layer)

    async def wait_async(self, layer: int) -> None:
        await self.progress.wait_async(layer)

    def done(self) -> bool:
        return self.progress.layers > 0 and self.progress.landed(self.progress.layers - 1)

    def layer_done(self, layer: int) -> bool:
        return self.progress.landed(layer)
