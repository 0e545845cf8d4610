"""A file store that goes away on cue, for the chaos tests (tests/vllm/test_vllm_chaos.py).

Storage spec `flaky_store:FlakyStore?DIR` (the vLLM processes import it: the tests put this
directory on PYTHONPATH). It is hicache's `file:DIR` store until the file `DIR.mode` says
otherwise, checked on every call (vLLM's scheduler and worker are separate processes):

- `reads`: the data servers are gone, the index still answers: `exists` finds every page,
  reads and writes raise ConnectionResetError;
- `all`: every call raises an error hicache's backends never raise (KeyError);
- `hang`: `exists` finds every page, reads never come back (until cancelled), writes work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache.backends.file import FileBackend


class FlakyStore:
    def __init__(self, inner: Any, mode_file: Path) -> None:
        self.inner = inner
        self.mode_file = mode_file
        self.namespace = inner.namespace

    @classmethod
    def from_spec(cls, spec: str, *, namespace: Any, emit: Any = None, **options: Any) -> Any:
        directory = spec.split("?", 1)[1]
        inner = FileBackend.from_spec(
            f"file:{directory}", namespace=namespace, emit=emit, **options
        )
        return cls(inner, Path(directory + ".mode"))

    def _mode(self) -> str:
        try:
            return self.mode_file.read_text().strip()
        except FileNotFoundError:
            return ""

    def _check(self, data: bool) -> None:
        mode = self._mode()
        if mode == "all":
            raise KeyError("the store went away")
        if mode == "reads" and data:
            raise ConnectionResetError("the store's data servers went away")

    async def exists(self, keys: Sequence[str]) -> int:
        self._check(data=False)
        return int(await self.inner.exists(keys))

    async def get_into(self, keys: Sequence[str], targets: Sequence[Any]) -> int:
        if self._mode() == "hang":
            await asyncio.Event().wait()  # never set: the caller's timeout cancels it
        self._check(data=True)
        return int(await self.inner.get_into(keys, targets))

    async def set_from(self, keys: Sequence[str], sources: Sequence[Any], **kw: Any) -> int:
        self._check(data=True)
        return int(await self.inner.set_from(keys, sources, **kw))

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def clear(self) -> None:
        await self.inner.clear()

    def stats(self) -> Any:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()
