"""`hicache replay --hybrid` and `hicache sweep --hybrid` on a slice of the shipped trace:
every hit's K/V pages and recurrent snapshot are checked, and the hit rates keep the relations
the groups' rule implies (docs/hybrid.md)."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hicache.cli.main import main
from hicache.cli.replay.hybrid import hybrid_kv, parse_hybrid, prefix_states
from hicache.hybrid import FullAttention, HybridCache, Recurrent, SlidingWindow

BLOCK = 256


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """12 conversations of 5 turns, interleaved turn by turn: every request starts with the
    same 3-block system prompt (768 tokens, between two grid points of RECURRENT), then its
    conversation so far, 2 blocks more each turn; each input ends 20 tokens into a page."""
    path = tmp_path_factory.mktemp("trace") / "chats.jsonl"
    lines = []
    for turn in range(5):
        for chat in range(12):
            ids = [0, 1, 2, *(1000 + 100 * chat + j for j in range(2 * turn + 2))]
            n = len(ids) * BLOCK - 20
            lines.append({"timestamp": len(lines), "input_length": n, "hash_ids": ids})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def small(trace: Path) -> list[str]:
    """L1 and L2 far below the 150k tokens of the conversations, so every tier serves hits."""
    return [
        "--trace",
        str(trace),
        "--block-tokens",
        str(BLOCK),
        "--kv",
        "mha:1:1:8:float16",
        "--device-tokens",
        "8192",
        "--host-tokens",
        "16384",
        "--quiet",
    ]


FULL = "full:4"
SLIDING = "full:1,sliding:3:1024"
# A 2 KiB page (one pool layer of 64 tokens); a snapshot of 4 KiB takes 3 pages with its header.
RECURRENT = "full:1,recurrent:3:4KiB:512"


def replay(trace: Path, tmp_path: Path, spec: str, storage: str, *more: str) -> dict:
    out = tmp_path / f"{spec.replace(':', '_').replace(',', '-')}-{storage}.json"
    argv = ["replay", *small(trace), "--hybrid", spec, "--storage", storage, "--json", str(out)]
    argv += more
    assert main(argv) == 0
    return json.loads(out.read_text())


def hit_tokens(s: dict) -> int:
    return sum(s["hit_tokens"].values())


@pytest.mark.parametrize("storage", ["none", "memory"])
def test_sliding_layers_hit_exactly_what_full_attention_does(chats, tmp_path, storage):
    """Every attention page is kept whole, so sliding + full layers resume wherever full
    attention alone would, tier by tier (deterministic runs: the same calls, the same time)."""
    full = replay(chats, tmp_path, FULL, storage, "--deterministic")
    sliding = replay(chats, tmp_path, SLIDING, storage, "--deterministic")
    assert sliding["hit_tokens"] == full["hit_tokens"] and hit_tokens(full) > 0
    assert sliding["verified_pages"] == full["verified_pages"] > 0
    assert sliding["corrupt_pages"] == full["corrupt_pages"] == 0
    assert sliding["config"]["kv"] == full["config"]["kv"] == "mha:4:1:8:float16"
    assert sliding["hybrid"]["spec"] == SLIDING and sliding["hybrid"]["snapshots_kept"] == 0
    assert full["hit_tokens"]["device"] > 0 and full["hit_tokens"]["host"] > 0
    if storage == "memory":  # every prefix comes back from some tier
        assert full["hit_tokens"]["storage"] > 0
        assert full["hit_rate"] == pytest.approx(full["bound_hit_rate"], abs=1e-9)
    else:
        assert full["hit_rate"] < full["bound_hit_rate"]


@pytest.mark.parametrize("storage", ["none", "memory"])
def test_recurrent_layers_hit_at_most_what_full_attention_does(chats, tmp_path, storage):
    """A recurrent model resumes only at a kept snapshot (a grid point or a request's end),
    and its snapshots take pool pages: its hit rate is at most the full-attention model's,
    the system prompt's last 256 tokens are cut (768 is no grid point), and every snapshot
    it resumes from is the state after exactly its prefix."""
    full = replay(chats, tmp_path, FULL, storage)
    rec = replay(chats, tmp_path, RECURRENT, storage)
    hy = rec["hybrid"]
    assert rec["config"]["kv"] == "mha:1:1:8:float16" and hy["pages_per_snapshot"] == 3
    assert 0 < rec["hit_rate"] <= full["hit_rate"]
    assert hy["snapshots_kept"] > 0 and hy["snapshot_probes"] >= hy["snapshot_hits"] > 0
    assert hy["verified_states"] == hy["snapshot_hits"] and hy["corrupt_states"] == 0
    assert rec["verified_pages"] > 0 and rec["corrupt_pages"] == 0
    assert hy["cut_tokens"] > 0
    assert hy["snapshot_hits"] == 59  # every request but the first resumes from one
    if storage == "memory":
        assert rec["hit_tokens"]["storage"] > 0
    else:
        assert rec["hit_tokens"]["storage"] == 0


@pytest.mark.parametrize("storage", ["none", "memory"])
def test_a_states_cache_gives_the_pools_back_to_kv(chats, tmp_path, storage):
    """`--state-snapshots`: the snapshots live in a states cache of their own; every request
    but the first still resumes from its own snapshot, the K/V pools hold no snapshot page
    (K/V moves fewer bytes) and the hit rate is at least the in-pool run's."""
    pool = replay(chats, tmp_path, RECURRENT, storage)
    own = replay(chats, tmp_path, RECURRENT, storage, "--state-snapshots", "64:256")
    hy = own["hybrid"]
    assert hy["pages_per_snapshot"] == 0
    assert (hy["states_cache"]["device_snapshots"], hy["states_cache"]["host_snapshots"]) == (
        64,
        256,
    )
    assert hy["snapshot_hits"] == pool["hybrid"]["snapshot_hits"] == 59
    assert hy["verified_states"] == 59 and hy["corrupt_states"] == 0 == own["corrupt_pages"]
    assert own["bytes"]["d2h"] < pool["bytes"]["d2h"]
    assert own["hit_rate"] >= pool["hit_rate"]
    if storage == "memory":
        assert hy["states_cache"]["h2s"] > 0 and own["bytes"]["h2s"] < pool["bytes"]["h2s"]


@pytest.mark.parametrize(
    "value, message",
    [
        ("64", "expected L1:L2"),
        ("64:x", "a snapshot count must be a positive integer"),
        ("64:32", "host_snapshots=32 must be larger than device_snapshots=64"),
    ],
)
def test_bad_state_snapshots_are_clear_errors(chats, capsys, value, message):
    argv = ["replay", *small(chats), "--hybrid", RECURRENT, "--state-snapshots", value]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert main(["replay", *small(chats), "--hybrid", FULL, "--state-snapshots", "auto"]) == 2
    assert "needs --hybrid with a recurrent or windowed sliding group" in capsys.readouterr().err


WINDOWED = "full:1,sliding:3:512:512"  # only the window kept: 511 tokens x 3 layers a snapshot


@pytest.mark.parametrize("states", [None, "64:256"], ids=["in-pool", "own-cache"])
def test_windowed_sliding_layers_keep_only_windows(chats, tmp_path, states):
    """`sliding:N:WINDOW:GRID`: the sliding layers leave the pool (its K/V spec has the full
    layer alone), a hit ends at a kept snapshot (grid point or a request's end), every window
    handed back is the one taken after exactly the hit's prefix, and the hit rate is at most
    the pages-kept model's."""
    pages = replay(chats, tmp_path, SLIDING, "memory")
    more = ("--state-snapshots", states) if states else ()
    win = replay(chats, tmp_path, WINDOWED, "memory", *more)
    hy = win["hybrid"]
    assert win["config"]["kv"] == "mha:1:1:8:float16" and hy["state_bytes"] == 511 * 3 * 32
    assert hy["snapshot_hits"] == 59 and hy["corrupt_states"] == 0 == win["corrupt_pages"]
    assert hy["cut_tokens"] > 0 and 0 < win["hit_rate"] <= pages["hit_rate"]


@pytest.mark.parametrize("spec", ["recurrent:3:4KiB:512", "sliding:3:512:512"])
def test_a_model_with_no_layer_kept_as_pages_replays_from_its_snapshots(chats, tmp_path, spec):
    """A pure recurrent model and an all-sliding windowed one: the pool has 0 layers (pages of
    tokens alone, no byte moved to L2 or L3 for them), every request but the first resumes
    from its own snapshot, found in the states cache, and the hit rate is what the same
    snapshots give beside a full layer."""
    alone = replay(chats, tmp_path, spec, "memory", "--state-snapshots", "64:256")
    beside = replay(chats, tmp_path, f"full:1,{spec}", "memory", "--state-snapshots", "64:256")
    hy = alone["hybrid"]
    assert alone["config"]["kv"] == "mha:0:1:8:float16"
    assert alone["bytes"]["d2h"] == alone["bytes"]["h2s"] == 0 < beside["bytes"]["d2h"]
    assert hy["snapshot_hits"] == 59 and hy["corrupt_states"] == 0 == alone["corrupt_pages"]
    assert hy["verified_states"] == 59 and hy["states_cache"]["h2s"] > 0
    assert alone["hit_tokens"] == beside["hit_tokens"] and alone["hit_rate"] > 0


def test_a_wrong_snapshot_is_counted_and_fails_the_run(chats, tmp_path, monkeypatch, capsys):
    """The negative control: a state handed back for another prefix is a corrupt state."""
    match = HybridCache.match

    async def wrong_state(self, rid, tokens, *, salt=None):
        hit = await match(self, rid, tokens, salt=salt)
        if hit.state is None:
            return hit
        return dataclasses.replace(hit, state=bytes(reversed(hit.state)))

    monkeypatch.setattr(HybridCache, "match", wrong_state)
    out = tmp_path / "s.json"
    argv = ["replay", *small(chats), "--hybrid", RECURRENT, "--storage", "none"]
    argv += ["--json", str(out)]
    assert main(argv) == 1
    hy = json.loads(out.read_text())["hybrid"]
    assert hy["corrupt_states"] == hy["snapshot_hits"] > 0
    assert "verified / corrupt states" in capsys.readouterr().out


def test_specs_parse_in_model_order():
    model = parse_hybrid("full:2,sliding:6:4096", 64)
    assert model.groups == (FullAttention((0, 1)), SlidingWindow(tuple(range(2, 8)), 4096))
    assert hybrid_kv("mha:2:1:32:float16", model) == "mha:8:1:32:float16"
    model = parse_hybrid("full:1,sliding:2:1024:2048", 64, "mha:9:2:64:bfloat16")
    assert model.groups[1] == SlidingWindow((1, 2), 1024, state_bytes=1023 * 2 * 512, grid=2048)
    assert model.pool_layers == (0,)
    model = parse_hybrid("full:1, recurrent:3:64KiB:1024", 64)
    assert model.groups == (FullAttention((0,)), Recurrent((1, 2, 3), 65536, 1024))
    assert hybrid_kv("mla:61:512:64:bfloat16", model) == "mla:1:512:64:bfloat16"
    tokens = np.arange(300)
    states = prefix_states(tokens, [128, 256], 100)
    assert states[128] == prefix_states(tokens[:128], [128], 100)[128] != states[256]
    assert len(states[256]) == 100


@pytest.mark.parametrize(
    "spec, message",
    [
        ("full:0", "'full:0': the layer count must be a positive integer"),
        ("sliding:2", "'sliding:2': expected full:N, sliding:N:WINDOW[:GRID] or recurrent:N"),
        ("attention:2", "'attention:2': expected"),
        ("full:1,sliding:2:0", "the window must be a positive integer"),
        ("full:1,recurrent:2:lots:512", "the state size must be a byte size"),
        ("full:1,recurrent:2:4KiB:100", "grid 100 must be a positive multiple of the page size"),
        ("recurrent:3:4KiB:512", "no layer kept as pages needs --state-snapshots"),
        ("full:1,", "'': expected"),
        ("full:1,sliding:2:8:100", "grid 100 must be a positive multiple of the page size"),
        ("full:1,sliding:2:8:512:9", "expected full:N, sliding:N:WINDOW[:GRID]"),
    ],
)
def test_bad_specs_are_clear_errors(chats, capsys, spec, message):
    assert main(["replay", *small(chats), "--hybrid", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache replay: error: --hybrid") and message in err


def test_pins_are_refused_with_a_hybrid_model(chats, capsys):
    assert main(["replay", *small(chats), "--hybrid", FULL, "--pin-first-block"]) == 2
    assert "--pin-first-block is not supported with --hybrid" in capsys.readouterr().err


def test_sweep_replays_every_point_with_the_hybrid_model(chats, tmp_path, capsys):
    argv = ["sweep", "--trace", str(chats), "--block-tokens", str(BLOCK), "--device", "8192"]
    argv += ["--host", "2x", "--storage", "0,inf", "--hybrid", RECURRENT]
    argv += ["--kv", "mha:2:1:8:float16", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    with open(tmp_path / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["storage"] for r in rows] == ["0", "inf"]
    for r in rows:
        assert r["hybrid"] == RECURRENT and r["kv"] == "mha:1:1:8:float16"
        assert int(r["verified_pages"]) > 0 and int(r["corrupt_pages"]) == 0
        assert int(r["snapshots_kept"]) > 0 and int(r["corrupt_states"]) == 0
        assert 0 < float(r["hit_rate"]) <= float(r["bound_hit_rate"]) + 1e-9
    no_l3, l3 = rows
    assert int(no_l3["storage_hit_tokens"]) == 0 < int(l3["storage_hit_tokens"])
    own = tmp_path / "own"
    assert main([*argv[:-3], "--state-snapshots", "auto", "--out", str(own), "--quiet"]) == 0
    with open(own / "sweep.csv", newline="") as f:
        own_rows = list(csv.DictReader(f))
    for r, o in zip(rows, own_rows, strict=True):  # none lost for want of pool room
        assert int(o["snapshots_kept"]) >= int(r["snapshots_kept"]) and int(o["snapshot_hits"]) > 0
        assert int(o["corrupt_states"]) == 0 and int(o["verified_states"]) > 0
    assert main([*argv[:-3], "--hybrid", "full:0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("hicache sweep: error: --hybrid")
