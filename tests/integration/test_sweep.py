"""`hicache sweep`: the tree controller with instant workers against the full replay, and the CSV
and PNG it writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from hicache.backends.framing import header_size
from hicache.cli.coremodel import replay_trace
from hicache.cli.main import main
from hicache.cli.replay.command import replay
from hicache.cli.sweep.grid import grid, parse_tokens
from hicache.cli.sweep.points import storage_cap_bytes
from hicache.cli.sweep.table import CSV_FIELDS, read_csv
from hicache.cli.trace import bound_hit_rate, read_trace
from hicache.config import CacheConfig
from hicache.policies.storage import STORE_POLICIES
from hicache.testing.instant import framed_page_bytes

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"
LIMIT = "200"


def replay_json(tmp_path: Path, row: dict, storage: str) -> dict:
    out = tmp_path / f"replay-{row['device_tokens']}-{row['host_tokens']}-{storage}.json"
    assert (
        main(
            [
                "replay",
                "--trace",
                str(TRACE),
                "--limit",
                LIMIT,
                "--kv",
                "mha:1:1:8:float16",
                "--device-tokens",
                str(row["device_tokens"]),
                "--host-tokens",
                str(row["host_tokens"]),
                "--storage",
                storage,
                "--write-policy",
                row["write_policy"],
                "--no-verify",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sweep")
    assert (
        main(
            [
                "sweep",
                "--trace",
                str(TRACE),
                "--limit",
                LIMIT,
                "--device",
                "32768,65536,131072",
                "--host",
                "2x,4x",
                "--storage",
                "0,inf",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    return out, read_csv(out / "sweep.csv")


def test_sweep_equals_the_replay_where_l3_is_on(sweep, tmp_path):
    """With L3 on, every step waits for each request's prefetch before it loads or allocates,
    and by then the replay's backups and uploads of the step before have landed: the sweep's
    order of events (every completion applied before the next call) is the replay's, and so
    are the numbers, to the token."""
    _, rows = sweep
    for row in rows:
        if row["storage"] != "inf" or row["host_tokens"] != 2 * row["device_tokens"]:
            continue
        s = replay_json(tmp_path, row, "memory")
        assert (row["requests"], row["input_tokens"]) == (s["requests"], s["input_tokens"])
        assert {t: row[f"{t}_hit_tokens"] for t in ("device", "host", "storage")} == s["hit_tokens"]
        assert row["hit_rate"] == pytest.approx(s["hit_rate"], abs=1e-6)
        assert row["bound_hit_rate"] == pytest.approx(s["bound_hit_rate"], abs=1e-6)
        assert (row["device_evicted_tokens"], row["host_evicted_tokens"]) == (
            s["evictions"]["device"],
            s["evictions"]["host"],
        )
        assert row["rejected_requests"] == s["rejected_requests"]


def test_sweep_is_close_to_the_replay_without_l3(sweep, tmp_path):
    """Without L3 a step's backups may still be landing when the next step evicts (two calls
    later): the replay can then evict other pages than the sweep. Close, not always equal."""
    _, rows = sweep
    for row in rows:
        if row["storage"] != "0" or row["device_tokens"] != 65536:
            continue
        s = replay_json(tmp_path, row, "none")
        assert row["requests"] == s["requests"]
        assert row["hit_rate"] == pytest.approx(s["hit_rate"], abs=0.002)


def test_sweep_writes_a_csv_and_a_png(sweep):
    out, rows = sweep
    assert len(rows) == 12
    assert list(rows[0]) == list(CSV_FIELDS)
    for row in rows:
        assert row["hit_rate"] == pytest.approx(
            row["device_hit_rate"] + row["host_hit_rate"] + row["storage_hit_rate"], abs=1e-5
        )
        assert row["hit_rate"] <= row["bound_hit_rate"] + 1e-9
        if row["storage"] == "0":
            assert row["storage_hit_tokens"] == 0
    by_point = {(r["device_tokens"], r["host_tokens"], r["storage"]): r for r in rows}
    for (dev, host, store), r in by_point.items():  # L3 only adds hits
        if store == "0":
            assert by_point[(dev, host, "inf")]["hit_rate"] >= r["hit_rate"]
    pytest.importorskip("matplotlib")
    png = (out / "sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_grid_and_sizes():
    assert parse_tokens("200k") == 200_000 and parse_tokens("1.5M") == 1_500_000
    points = grid("100k,1M", "2x,3000000", "0,inf", page_size=64)
    assert [(p.device_tokens, p.host_tokens, p.storage) for p in points[:4]] == [
        (99968, 199936, False),
        (99968, 199936, True),
        (99968, 3_000_000, False),
        (99968, 3_000_000, True),
    ]
    assert len(points) == 8
    for device, host, storage, message in [
        ("10", "2x", "0", "one page"),
        ("100k", "0.5x", "0", "larger than L1"),
        ("100k", "2x", "5 pages", r"0 \(none\), inf \(unbounded\), a token count"),
        ("100k", "2x", "10", "at least one page"),
        ("100k", "2x", "12XB", "not a byte size"),
        ("lots", "2x", "0", "not a token count"),
    ]:
        with pytest.raises(ValueError, match=message):
            grid(device, host, storage, page_size=64)


def test_a_capped_l3_is_tokens_or_bytes():
    points = grid("100k", "2x", "0,140k,36MB,2GiB,inf", page_size=64)
    assert [(p.storage, p.storage_tokens, p.storage_bytes) for p in points] == [
        (False, None, None),
        (True, 139_968, None),  # whole pages
        (True, None, 36_000_000),
        (True, None, 2 << 30),
        (True, None, None),
    ]
    assert [p.storage_label for p in points] == ["0", "140k", "36MB", "2GiB", "inf"]
    cfg = CacheConfig(
        kv="mha:2:1:32:float16", page_size=64, device_tokens=65536, host_tokens=131072
    )
    page = framed_page_bytes(cfg)
    assert page == 2 * 2 * 1 * 32 * 2 * 64 + header_size("hicache:" + "0" * 20 + ":" + "0" * 64)
    assert storage_cap_bytes(points[1], cfg) == 139_968 // 64 * page
    assert storage_cap_bytes(points[2], cfg) == 36_000_000
    assert storage_cap_bytes(points[4], cfg) is None
    with pytest.raises(ValueError, match=r"--storage 16kB: smaller than one page \(16501 bytes"):
        storage_cap_bytes(grid("100k", "2x", "16kB", page_size=64)[0], cfg)


SHIPPED = TRACE.parent / "mooncake_synthetic_trace.jsonl"
CAP_PAGES = 12_000  # about a fifth of the 54,131 pages L3 holds after these 300 requests unbounded


@pytest.mark.parametrize("policy", sorted(STORE_POLICIES))
def test_sweep_at_a_capped_l3_equals_the_replay_with_that_cap(policy):
    """The sweep's capped L3 is a StoreBook run as the memory store runs it under the
    replay's storage workers: at a cap that evicts (and, for the admission policies,
    refuses), the hits per tier, the pages evicted and refused, and the bytes held are the
    replay's with a memory store of that capacity and policy, to the token."""
    requests = read_trace(SHIPPED, limit=300, block_tokens=512)
    cfg = CacheConfig(
        kv="mha:2:1:32:float16",
        page_size=64,
        device_tokens=200_000,
        host_tokens=400_000,
        prefetch_policy="wait_complete",
        model_id="sweep",
    )
    cap = CAP_PAGES * framed_page_bytes(cfg)
    model = replay_trace(cfg, requests, storage=True, storage_capacity=cap, store_policy=policy)
    real_cfg = replace(cfg, storage="memory", extra={"capacity_bytes": cap, "policy": policy})

    async def run_replay():
        return await replay(
            real_cfg,
            requests,
            block_tokens=512,
            batch=8,
            verify=False,
            log=None,
            progress=lambda done: None,
        )

    real, extra = anyio.run(run_replay)
    store = extra["backend"]
    s = model.summary()
    assert s["hit_tokens"] == {
        "device": real.device_hit,
        "host": real.host_hit - real.storage_hit,
        "storage": real.storage_hit,
    }
    assert s["storage"] == {
        "bytes": store["stored_bytes"],
        "pages": CAP_PAGES,
        "evictions": store["evictions"],
        "refused": store["refused"],
    }
    assert store["stored_bytes"] == cap and store["evictions"] > 0
    assert (store["refused"] > 0) == (policy in ("second-hit", "tinylfu"))
    unbounded = replay_trace(cfg, requests, storage=True)
    assert 0 < s["hit_tokens"]["storage"] != unbounded.storage_hit


def test_bad_sweep_flags_are_clear_errors(capsys, tmp_path):
    assert (
        main(
            [
                "sweep",
                "--trace",
                str(TRACE),
                "--limit",
                "5",
                "--storage",
                "1T",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("hicache sweep: error:")


@pytest.mark.parametrize(
    "write_policy, exclusive, storage",
    [("write_back", False, True), ("write_through", True, True), ("write_back", True, False)],
)
def test_the_sweep_replays_calls_that_wait(write_policy, exclusive, storage):
    """write_back and exclusive L1 evictions back pages up first: an allocation parks on
    those writes (and uploads), and the instant workers answer until it goes on. Every slot
    and every table entry comes back at the end (replay_trace checks)."""
    requests = read_trace(TRACE, limit=60, block_tokens=512)
    cfg = CacheConfig(
        page_size=64,
        device_tokens=32768,
        host_tokens=65536,
        write_policy=write_policy,
        exclusive=exclusive,
        prefetch_policy="wait_complete",
    )
    tally = replay_trace(cfg, requests, storage=storage)
    s = tally.summary()
    assert s["requests"] == 60 and tally.device_evictions > 0
    assert 0 < s["hit_rate"] <= bound_hit_rate(requests, block_tokens=512, page_size=64)
    assert (tally.storage_hit > 0) == storage


def test_a_capped_sweep_writes_its_cap_policy_and_what_l3_did(tmp_path):
    assert (
        main(
            [
                "sweep",
                "--trace",
                str(SHIPPED),
                "--limit",
                "100",
                "--device",
                "100k",
                "--host",
                "2x",
                "--storage",
                "0,300k,100MB,inf",
                "--store-policy",
                "second-hit",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    rows = read_csv(tmp_path / "sweep.csv")
    assert [r["storage"] for r in rows] == ["0", "300k", "100MB", "inf"]
    page = 16_501  # framed, under the sweep's default --kv
    assert [r["storage_cap_bytes"] for r in rows] == [0, 299_968 // 64 * page, 100_000_000, 0]
    assert [r["store_policy"] for r in rows] == ["", "second-hit", "second-hit", ""]
    none, small, large, unbounded = rows
    assert none["storage_hit_tokens"] == 0
    assert small["storage_refused_pages"] > 0 and small["storage_evicted_pages"] > 0
    assert unbounded["storage_evicted_pages"] == unbounded["storage_refused_pages"] == 0
    assert small["storage_hit_tokens"] < unbounded["storage_hit_tokens"]
    assert small["storage_hit_tokens"] <= large["storage_hit_tokens"]
