"""Mooncake-format request traces: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (one id per block; equal ids mean equal prefixes
up to and including that block). Block id h stands for token ids h*B .. h*B+B-1.
"""

from __future__ import annotations

import gzip
import json
import lzma
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self, block_tokens: int) -> np.ndarray:
        """The request's token ids, cut to its input length."""
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        offsets = np.arange(block_tokens, dtype=np.int64)
        return (ids[:, None] * block_tokens + offsets[None, :]).reshape(-1)[: self.input_length]


def open_trace(path: str | Path) -> TextIO:
    """A trace file as text: plain, or compressed by name (`.xz`, `.gz`; the package ships
    its trace as `.xz`)."""
    name = str(path)
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(
    path: str | Path, *, limit: int | None = None, block_tokens: int = 512
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open_trace(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(
                    index=len(out),
                    timestamp_ms=float(obj.get("timestamp", 0)),
                    input_length=int(obj["input_length"]),
                    output_length=int(obj.get("output_length", 0)),
                    hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {type(exc).__name__}: {exc}") from None
            if req.input_length < 0 or any(h < 0 for h in req.hash_ids):
                raise TraceError(f"{path}:{lineno}: negative input_length or hash id")
            if req.input_length > len(req.hash_ids) * block_tokens:
                raise TraceError(
                    f"{path}:{lineno}: input_length {req.input_length} exceeds "
                    f"{len(req.hash_ids)} blocks of {block_tokens} tokens"
                )
            out.append(req)
    return out


def bound_hit_rate(requests: list[TraceRequest], *, block_tokens: int, page_size: int) -> float:
    """The token hit rate of an infinite cache that matches whole pages: for each request, the
    longest cached prefix among everything seen before it (then it is cached itself)."""
    seen: dict[int, int] = {}  # block id -> longest cached length of that block, in tokens
    hit = total = 0
    for req in requests:
        total += req.input_length
        matched = 0
        for i, h in enumerate(req.hash_ids):
            have = seen.get(h, 0)
            want = min(block_tokens, req.input_length - i * block_tokens)
            got = min(have, want)
            matched += got
            if got < want:
                break
        hit += matched // page_size * page_size
        for i, h in enumerate(req.hash_ids):
            length = min(block_tokens, req.input_length - i * block_tokens)
            length = min(length, (req.input_length // page_size * page_size) - i * block_tokens)
            if length <= 0:
                break
            seen[h] = max(seen.get(h, 0), length)
    return hit / total if total else 0.0


def scheduler_steps(
    requests: Iterable[TraceRequest], batch: int, *, budget: int
) -> Iterator[list[TraceRequest]]:
    """Scheduler steps: up to `batch` requests whose inputs together fit in `budget` tokens.
    A request that shares its first block with one already in the step starts the next step,
    as a prefix-aware scheduler would, so it can hit what the earlier one computes."""
    step: list[TraceRequest] = []
    tokens = 0
    firsts: set[int | None] = set()
    for req in requests:
        first = req.hash_ids[0] if req.hash_ids else None
        if step and (len(step) == batch or tokens + req.input_length > budget or first in firsts):
            yield step
            step, tokens, firsts = [], 0, set()
        step.append(req)
        tokens += req.input_length
        firsts.add(first)
    if step:
        yield step
