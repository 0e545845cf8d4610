"""`hicache.testing.chat`: the multi-turn chat trace is a pure function of its arguments, each
turn extends an earlier turn of its conversation, conversations share system prompts, and the
file it writes is what `hicache replay --trace` reads."""

from __future__ import annotations

import pytest

from hicache.cli.trace import read_trace
from hicache.testing.chat import ChatShape, multi_turn_chat, write_trace

SHAPE = ChatShape(active=5, system_prompts=2, system_blocks=3, turns=(2, 4), turn_blocks=(1, 2))


def test_the_same_arguments_give_the_same_trace_and_another_seed_another():
    a = multi_turn_chat(60, shape=SHAPE, seed=1)
    assert a == multi_turn_chat(60, shape=SHAPE, seed=1)
    assert a != multi_turn_chat(60, shape=SHAPE, seed=2)


def test_turns_extend_their_conversation_below_a_shared_system_prompt():
    records = multi_turn_chat(200, shape=SHAPE, block_tokens=16)
    prompts = {tuple(r["hash_ids"][:3]) for r in records}
    assert prompts == {(0, 1, 2), (3, 4, 5)}  # every request starts with one of the two
    extended = 0
    for i, r in enumerate(records):
        ids = r["hash_ids"]
        assert r["input_length"] == 16 * len(ids)
        earlier = [p["hash_ids"] for p in records[:i] if p["hash_ids"][3:4] == ids[3:4]]
        if earlier:  # a later turn: its conversation's last turn is a proper prefix of it
            last = earlier[-1]
            assert ids[: len(last)] == last and len(ids) > len(last)
            extended += 1
    # conversations of 2-4 turns: at least half the requests are later turns
    assert extended >= len(records) // 2
    # 5 conversations at once, each turn of a round in a shuffled order: another conversation
    # runs between two turns of one, most of the time
    gaps = [
        j - i
        for i, r in enumerate(records)
        for j in range(i + 1, len(records))
        if records[j]["hash_ids"][: len(r["hash_ids"])] == r["hash_ids"]
        and len(records[j]["hash_ids"]) > len(r["hash_ids"])
    ]
    assert sum(g > 1 for g in gaps) > 0.5 * len(gaps)


def test_write_trace_writes_what_the_replay_reads(tmp_path):
    records = multi_turn_chat(30, shape=SHAPE, block_tokens=8)
    write_trace(tmp_path / "t.jsonl", records)
    back = read_trace(tmp_path / "t.jsonl", block_tokens=8)
    assert [list(r.hash_ids) for r in back] == [r["hash_ids"] for r in records]
    assert [r.input_length for r in back] == [r["input_length"] for r in records]


@pytest.mark.parametrize(
    "bad", [dict(active=0), dict(turns=(3, 2)), dict(turn_blocks=(0, 1)), dict(system_blocks=0)]
)
def test_a_bad_shape_is_named(bad):
    with pytest.raises(ValueError, match=f"ChatShape.{next(iter(bad))}"):
        ChatShape(**bad)
