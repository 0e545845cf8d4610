"""A store that goes away on cue (storage spec `flaky_backend:FlakyBackend`): hicache's
`memory` store until a test sets `mode` on the instance (`FlakyBackend.opened[-1]`):

- `raise`: every call raises (an error hicache's backends never raise: KeyError);
- `hang`: reads and probes never come back until cancelled; writes work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from hicache.backends.memory import MemoryBackend


class FlakyBackend:
    opened: ClassVar[list[FlakyBackend]] = []

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.mode = ""
        self.cancelled = 0  # hung calls that were cancelled (each returned nothing)

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Any, emit: Any = None, **options: Any
    ) -> FlakyBackend:
        backend = cls(MemoryBackend.from_spec("memory", namespace=namespace, emit=emit, **options))
        cls.opened.append(backend)
        return backend

    async def _gate(self) -> None:
        if self.mode == "raise":
            raise KeyError("the store went away")
        if self.mode == "hang":
            try:
                await asyncio.Event().wait()  # never set: the caller's deadline cancels it
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    async def exists(self, keys: Sequence[str]) -> int:
        await self._gate()
        return int(await self.inner.exists(keys))

    async def get_into(self, keys: Sequence[str], targets: Sequence[Any]) -> int:
        await self._gate()
        return int(await self.inner.get_into(keys, targets))

    async def set_from(self, keys: Sequence[str], sources: Sequence[Any]) -> int:
        if self.mode == "raise":
            raise KeyError("the store went away")
        return int(await self.inner.set_from(keys, sources))

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def clear(self) -> None:
        await self._gate()
        await self.inner.clear()

    def stats(self) -> Mapping[str, int | float]:
        return dict(self.inner.stats())

    async def aclose(self) -> None:
        await self.inner.aclose()
