"""The handle of a load, as callers get it: made by the tree's controller when it decides on
the load (so the answers that name the load carry it from the start), bound to the stream's
own handle when the tree actor submits the load to the loader, which happens before any of
those answers is set."""

from __future__ import annotations

from hicache.kernels.streams.base import LoadHandle
from hicache.types import OpId


class LoadTicket:
    """A `LoadHandle` for load `op`, delegating to the loader's handle once bound."""

    __slots__ = ("_handle", "op")

    def __init__(self, op: OpId) -> None:
        self.op = op
        self._handle: LoadHandle | None = None

    def bind(self, handle: LoadHandle) -> None:
        if self._handle is not None:
            raise RuntimeError(f"load {self.op}: its handle is bound already")
        self._handle = handle

    @property
    def bound(self) -> bool:
        return self._handle is not None

    def _stream(self) -> LoadHandle:
        handle = self._handle
        if handle is None:  # answers are set only after the load was submitted
            raise RuntimeError(f"load {self.op}: waited on before it was submitted")
        return handle

    def wait(self, layer: int) -> None:
        self._stream().wait(layer)

    async def wait_async(self, layer: int) -> None:
        await self._stream().wait_async(layer)

    def done(self) -> bool:
        return self._stream().done()

    def layer_done(self, layer: int) -> bool:
        return self._stream().layer_done(layer)
