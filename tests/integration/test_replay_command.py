"""The `hicache replay` command end to end on a slice of the shipped trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli.main import main

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"
SMALL = [
    "--trace",
    str(TRACE),
    "--limit",
    "60",
    "--kv",
    "mha:1:1:8:float16",
    "--device-tokens",
    "65536",
    "--host-tokens",
    "131072",
    "--quiet",
]


def test_deterministic_replays_write_identical_event_logs(tmp_path):
    runs = []
    for i in range(2):
        events, summary = tmp_path / f"events{i}.jsonl", tmp_path / f"summary{i}.json"
        assert (
            main(
                [
                    "replay",
                    *SMALL,
                    "--storage",
                    "memory",
                    "--deterministic",
                    "--seed",
                    "3",
                    "--events",
                    str(events),
                    "--json",
                    str(summary),
                ]
            )
            == 0
        )
        runs.append((events.read_bytes(), json.loads(summary.read_text())))
    (log_a, sum_a), (log_b, sum_b) = runs
    assert log_a == log_b and len(log_a.splitlines()) > 100
    for key in ("hit_tokens", "bytes", "evictions", "verified_pages"):
        assert sum_a[key] == sum_b[key]
    assert sum_a["corrupt_pages"] == 0 and sum_a["verified_pages"] > 0
    assert "link" not in sum_a  # virtual time: no link to measure


def test_summary_has_every_field_and_storage_hits(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    assert main(["replay", *SMALL, "--storage", "file", "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    for key in (
        "requests",
        "input_tokens",
        "hit_rate",
        "bound_hit_rate",
        "verified_pages",
        "corrupt_pages",
        "wall_s",
        "control_us_per_request",
    ):
        assert key in s
    assert set(s["hit_tokens"]) >= {"device", "host", "storage"}
    assert set(s["bytes"]) >= {"d2h", "h2d", "h2s", "s2h"}
    assert set(s["evictions"]) >= {"device", "host"}
    assert s["requests"] == 60 and s["hit_tokens"]["storage"] > 0 and s["corrupt_pages"] == 0
    assert s["hit_rate"] <= s["bound_hit_rate"] + 1e-9
    out = capsys.readouterr().out
    assert "hit rate" in out and "link utilization" in out
    link = s["link"]  # L1<->L2 bytes over the wall, against the copy measured at start
    assert 0 < link["run_s"] <= s["wall_s"]  # the run, not opening the pools
    moved = (s["bytes"]["d2h"] + s["bytes"]["h2d"]) / link["run_s"] / 1e9
    assert link["moved_gbps"] == pytest.approx(moved, rel=0.01, abs=1e-3)
    assert link["utilization"] == pytest.approx(
        link["moved_gbps"] / link["reference_gbps"], rel=0.01, abs=1e-3
    )
    assert link["reference_gbps"] > 0 and "copy" in link["reference"]


def test_storage_max_bytes_caps_the_file_store(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    argv = ["replay", *SMALL, "--storage-max-bytes", "1MiB", "--json", str(summary)]
    assert main(argv) == 0
    store = json.loads(summary.read_text())["storage_stats"]
    assert store["max_bytes"] == 1 << 20 and store["peak_stored_bytes"] <= 1 << 20
    assert store["evictions"] > 0
    assert "L3 bytes stored / peak / cap" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv", "mha:2:x:8:float16"], "heads"),
        (["--page-size", "0"], "--page-size"),
        (["--storage", "nosuch://x"], "nosuch"),
        (["--storage-max-bytes", "lots"], "--storage-max-bytes"),
    ],
)
def test_bad_flags_are_clear_errors(capsys, argv, message):
    assert main(["replay", *SMALL, *argv]) == 2
    # the last line: a store that a killed replay left behind is swept first, with a line of
    # its own, whatever else ran on this machine
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("hicache replay: error:") and message in err
