"""The `hicache` command given bad input, as a user runs it: each case in its own process, and
each must end with exactly one line on stderr (no traceback, no usage block) naming what was
wrong, and exit code 2. A case that would pass silently, or print a traceback, fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "mooncake_trace_400.jsonl"
SMALL = ["--trace", str(TRACE), "--limit", "3", "--kv", "mha:1:1:8:float16", "--quiet"]


def hicache(
    args: list[str], tmp_path: Path, *, pythonpath: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    if args[:1] == ["replay"] and "--tmp-dir" not in args:  # never touch the real /dev/shm
        args = [*args, "--tmp-dir", str(tmp_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join((*pythonpath, str(REPO)))
    return subprocess.run(
        [sys.executable, "-m", "hicache.cli.main", *args],
        cwd=tmp_path,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _empty(tmp: Path) -> str:
    path = tmp / "empty.jsonl"
    path.write_text("")
    return str(path)


def _binary(tmp: Path) -> str:
    path = tmp / "binary.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


# (id, argv built from the test's tmp dir, words the one stderr line must hold)
CASES = [
    ("empty trace", lambda t: ["replay", "--trace", _empty(t)], ["--trace", "no requests"]),
    ("check-log empty file", lambda t: ["check-log", _empty(t)], ["no events"]),
    ("check-log binary file", lambda t: ["check-log", _binary(t)], ["not a UTF-8 event log"]),
    ("limit -5", lambda t: ["replay", "--limit", "-5"], ["--limit", "'-5'", ">= 1"]),
    ("limit 0", lambda t: ["replay", "--limit", "0"], ["--limit", "'0'", ">= 1"]),
    ("batch 0", lambda t: ["replay", "--batch", "0"], ["--batch", "'0'", ">= 1"]),
    ("sweep batch -3", lambda t: ["sweep", "--batch", "-3"], ["--batch", "'-3'", ">= 1"]),
    ("salts -1", lambda t: ["replay", "--salts", "-1"], ["--salts", "'-1'", ">= 0"]),
    ("limit not a number", lambda t: ["replay", "--limit", "ten"], ["--limit", "'ten'"]),
    (
        "device tokens below a page",
        lambda t: ["replay", *SMALL, "--device-tokens", "10", "--storage", "none"],
        ["--device-tokens 10", "at least one page"],
    ),
    (
        "device tokens not a count",
        lambda t: ["replay", "--device-tokens", "lots"],
        ["--device-tokens", "'lots'", "token count"],
    ),
    ("metrics port out of range", lambda t: ["replay", "--metrics-port", "70000"], ["65535"]),
    (
        "check-log device tokens 0",
        lambda t: ["check-log", "x.jsonl", "--device-tokens", "0"],
        ["--device-tokens", ">= 1"],
    ),
    ("unknown flag", lambda t: ["sweep", "--nosuchflag"], ["--nosuchflag"]),
    ("bad choice", lambda t: ["replay", "--eviction", "oldest"], ["--eviction", "oldest"]),
    (
        "storage module that does not exist",
        lambda t: ["replay", *SMALL, "--storage", "nosuchmod:Cls"],
        ["nosuchmod"],
    ),
    (
        "deterministic with redis",
        lambda t: ["replay", *SMALL, "--deterministic", "--storage", "redis://127.0.0.1:1"],
        ["deterministic", "redis://127.0.0.1:1"],
    ),
    (
        "mooncake without a server",
        lambda t: ["replay", *SMALL, "--storage", "mooncake://127.0.0.1:1"],
        ["Mooncake master 127.0.0.1:1"],
    ),
    (
        "tmp-dir that does not exist",
        lambda t: ["replay", *SMALL, "--tmp-dir", str(t / "nowhere")],
        ["--tmp-dir", "not a directory"],
    ),
    (
        "pools larger than the machine",
        lambda t: [
            "replay",
            *SMALL,
            "--kv",
            "mha:64:64:128:float32",
            "--device-tokens",
            "10M",
            "--host-tokens",
            "20M",
        ],
        ["do not fit", "L2", "available"],
    ),
    (
        "a cap for a store that caps itself",
        lambda t: [
            "replay",
            *SMALL,
            "--storage",
            "redis://127.0.0.1:1",
            "--storage-max-bytes",
            "256MB",
        ],
        ["--storage-max-bytes", "'redis'", "maxmemory"],
    ),
]


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, argv, words):
    done = hicache(argv(tmp_path), tmp_path)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "error:" in lines[0] and "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_metrics_port_without_prometheus_client_is_one_line(tmp_path):
    stub = tmp_path / "stub" / "prometheus_client"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("No module named prometheus_client")\n')
    done = hicache(
        ["replay", *SMALL, "--storage", "none", "--metrics-port", "0"],
        tmp_path,
        pythonpath=(str(tmp_path / "stub"),),
    )
    assert done.returncode == 2, done.stderr
    expected = (
        "hicache replay: error: hicache metrics need prometheus_client: "
        "pip install 'hicache[metrics]'"
    )
    assert done.stderr.splitlines() == [expected]


def test_replay_and_sweep_round_sizes_to_whole_pages_alike(tmp_path):
    """One rule for both commands: a size that is not a multiple of the page is rounded down."""
    out = tmp_path / "s.json"
    done = hicache(
        ["replay", *SMALL, "--storage", "none", "--device-tokens", "100000", "--json", str(out)],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["config"]["device_tokens"] == 100_000 // 64 * 64
    from hicache.cli.sweep.grid import grid

    assert grid("100000", "2x", "0", page_size=64)[0].device_tokens == 100_000 // 64 * 64


def test_replay_help_shows_the_defaults(tmp_path):
    done = hicache(["replay", "--help", "--tmp-dir", "."], tmp_path)
    # each option's entry: from its line ("  --flag ...") to the next option's
    entries = {
        m.group(1): " ".join(m.group(0).split())
        for m in re.finditer(r"^  (--[\w-]+).*?(?=^  -|\Z)", done.stdout, re.MULTILINE | re.DOTALL)
    }
    for flag, default in (
        ("--page-size", "64"),
        ("--device-tokens", "200000"),
        ("--host-tokens", "400000"),
        ("--eviction", "lru"),
        ("--write-policy", "write_through"),
        ("--prefetch-policy", "wait_complete"),
        ("--batch", "8"),
    ):
        assert f"(default: {default})" in entries[flag], entries[flag]


def test_summary_shows_rejections_storage_problems_and_what_its_terms_mean(tmp_path, capsys):
    from hicache.cli.main import main
    from hicache.cli.replay.report import storage_problems

    out = tmp_path / "s.json"
    argv = ["replay", *SMALL, "--limit", "50", "--device-tokens", "6400", "--host-tokens"]
    argv += ["12800", "--storage", "memory", "--json", str(out), "--tmp-dir", str(tmp_path)]
    assert main(argv) == 0
    s = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert s["rejected_requests"] > 0
    assert f"50  ({s['rejected_requests']} rejected: L1 too small)" in table
    assert s["storage_problems"] == {"errors": 0, "corrupt_values": 0}
    assert "L3 errors / corrupt values" in table and "L3 bytes stored / peak / cap" in table
    assert "cold-start bound: the hit rate of an unbounded cache that starts empty" in table
    assert "time in cache calls: wall time inside" in table
    mooncake_like = {"errors": 2, "unreachable": 3, "corrupt": 1}
    assert storage_problems(mooncake_like) == {"errors": 5, "corrupt_values": 1}


def test_storage_max_bytes_caps_a_memory_store(tmp_path):
    out = tmp_path / "summary.json"
    done = hicache(
        ["replay", *SMALL, "--storage", "memory", "--storage-max-bytes", "3MB", "--json", str(out)],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(out.read_text())["storage_stats"]
    assert stats["max_bytes"] == 3_000_000 and stats["stored_bytes"] <= 3_000_000
