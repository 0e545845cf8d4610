"""A multi-turn chat workload as Mooncake-format trace records (what `hicache replay --trace`
reads, one JSON object per line: `write_trace`).

Conversations share a few system prompts; each turn's input is its conversation so far (the
system prompt, then every earlier turn) plus the turn's new blocks, so each turn extends the
prefix of the one before. `active` conversations run at once, their turns interleaved round by
round in a shuffled order: between two turns of one conversation about `active - 1` turns of
the others run, which, with enough conversations, pushes its pages out of L1 and L2 before it
comes back (its next turn then hits only in L3, or under the shared system prompt). A
conversation that has had its turns is replaced by a new one.

Pure function of its arguments (the seed included): the same call gives the same trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ChatShape", "multi_turn_chat", "write_trace"]


@dataclass(frozen=True, slots=True)
class ChatShape:
    """The workload's shape, in trace blocks (`block_tokens` tokens each). Ranges are
    inclusive (low, high), drawn uniformly per conversation or per turn."""

    active: int = 400  # conversations running at once
    system_prompts: int = 4
    system_blocks: int = 4  # blocks of each system prompt
    turns: tuple[int, int] = (2, 8)  # turns per conversation
    turn_blocks: tuple[int, int] = (2, 6)  # new blocks per turn (the user's message and reply)
    output_tokens: tuple[int, int] = (64, 512)  # the trace's output_length (not replayed)
    interval_ms: float = 100.0  # between two requests

    def __post_init__(self) -> None:
        for name in ("active", "system_prompts", "system_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChatShape.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("turns", "turn_blocks", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high and not (name == "output_tokens" and 0 <= low <= high):
                raise ValueError(f"ChatShape.{name} must be a range low <= high, got {(low, high)}")


def multi_turn_chat(
    requests: int, *, shape: ChatShape | None = None, block_tokens: int = 512, seed: int = 0
) -> list[dict[str, Any]]:
    """`requests` turns of interleaved conversations (see the module's docstring), as trace
    records: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (block ids; block
    h stands for `block_tokens` tokens, as `hicache replay --block-tokens` reads them)."""
    if requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    shape = shape or ChatShape()
    rng = np.random.default_rng([seed, 28])
    prompts = [
        list(range(p * shape.system_blocks, (p + 1) * shape.system_blocks))
        for p in range(shape.system_prompts)
    ]
    next_block = shape.system_prompts * shape.system_blocks  # block ids not used yet

    def draw(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    def new_conversation() -> tuple[list[int], int]:
        return list(prompts[int(rng.integers(shape.system_prompts))]), draw(shape.turns)

    slots = [new_conversation() for _ in range(shape.active)]  # (blocks so far, turns left)
    out: list[dict[str, Any]] = []
    while len(out) < requests:
        for slot in rng.permutation(shape.active).tolist():
            if len(out) == requests:
                break
            blocks, left = slots[slot]
            added = draw(shape.turn_blocks)
            blocks = blocks + list(range(next_block, next_block + added))
            next_block += added
            out.append(
                {
                    "timestamp": len(out) * shape.interval_ms,
                    "input_length": len(blocks) * block_tokens,
                    "output_length": draw(shape.output_tokens),
                    "hash_ids": blocks,
                }
            )
            slots[slot] = new_conversation() if left == 1 else (blocks, left - 1)
    return out


def write_trace(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Write trace records as JSON lines (`hicache replay --trace PATH` reads them)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
