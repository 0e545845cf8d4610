"""`hicache replay` told to stop: SIGTERM, SIGHUP and SIGINT (a closed terminal, `timeout`, a CI
runner, Ctrl-C) close the cache, remove the temporary store, print a partial summary and the
JSON marked partial, and exit 128 + the signal's number, without a traceback. A replay killed
outright (SIGKILL) leaves its store, and the next replay's start removes it.

Every replay here makes its temporary store under the test's own directory (`--tmp-dir`), never
the real /dev/shm, and every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache.cli.replay.exit import PREFIX, owned_scratch, sweep_stale

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "mooncake_synthetic_trace.jsonl"
WAIT_S = 90.0  # the most any wait here lasts (the machine may be busy)


def start_replay(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hicache.cli.main",
            "replay",
            "--trace",
            str(TRACE),
            "--kv",
            "mha:1:1:8:float16",
            "--tmp-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "summary.json"),
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_stored_values(tmp_path: Path, proc: subprocess.Popen[str]) -> None:
    """Until the replay's file store holds a value (the cache is open and running): bounded."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for store in tmp_path.glob(f"{PREFIX}*/store"):
            values = (p for p in store.rglob("*") if "tmp" not in p.relative_to(store).parts)
            if any(p.is_file() for p in values):
                return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)  # between looks at the store; returns at once if it exits
    proc.kill()
    pytest.fail(f"the replay stored nothing within {WAIT_S} s")


def leftovers(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob(f"{PREFIX}*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name
)
def test_signal_stops_cleanly_and_removes_the_store(tmp_path, sig):
    proc = start_replay(tmp_path, "--quiet")
    wait_for_stored_values(tmp_path, proc)
    assert leftovers(tmp_path)  # the store exists while the replay runs
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + sig, err
    assert leftovers(tmp_path) == []
    assert "Traceback" not in err
    assert f"stopped by {sig.name} after" in out  # the partial summary's first row
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["partial"]["stopped_by"] == sig.name
    assert 0 < summary["requests"] < summary["partial"]["requests_in_trace"]
    assert summary["corrupt_pages"] == 0


@pytest.mark.slow
def test_killed_replays_store_is_swept_by_the_next_start(tmp_path):
    proc = start_replay(tmp_path, "--quiet")
    wait_for_stored_values(tmp_path, proc)
    proc.kill()  # SIGKILL: no handler runs, the store stays
    proc.wait(timeout=WAIT_S)
    (stale,) = leftovers(tmp_path)
    nxt = start_replay(tmp_path, "--quiet", "--limit", "2", "--storage", "none")
    _out, err = nxt.communicate(timeout=WAIT_S)
    assert nxt.returncode == 0, err
    assert f"removed {stale}" in err
    assert leftovers(tmp_path) == []


def test_sweep_removes_only_stores_no_process_owns(tmp_path):
    ended = tmp_path / f"{PREFIX}ended"
    (ended / "store").mkdir(parents=True)
    (ended / "store" / "value").write_bytes(b"x" * 100)
    (ended / ".owner").write_text("4000000\n")  # nobody holds its lock
    unowned = tmp_path / f"{PREFIX}starting"  # no owner file yet: may be being created
    unowned.mkdir()
    with owned_scratch(str(tmp_path)) as live:
        removed = sweep_stale(str(tmp_path))
        assert removed == [(str(ended), 100 + len("4000000\n"))]
        assert Path(live).is_dir() and unowned.is_dir() and not ended.exists()
    assert not Path(live).exists()  # the owner removes its own at exit


def test_a_sweep_while_a_replay_claims_its_store_leaves_it(tmp_path, monkeypatch):
    """The worst moment for a concurrent sweep: the new store's owner file is open but not yet
    locked. The sweep must not take that store for an ended replay's."""
    import hicache.cli.replay.exit as replay_exit

    real_flock, swept = replay_exit.fcntl.flock, []

    def sweep_then_lock(fd: int, op: int) -> None:
        if not swept:  # the claim's own lock: another replay sweeps just before it
            swept.append(None)  # the sweep's own locks go straight through
            swept[0] = sweep_stale(str(tmp_path))
        real_flock(fd, op)

    monkeypatch.setattr(replay_exit.fcntl, "flock", sweep_then_lock)
    with owned_scratch(str(tmp_path)) as live:
        assert swept == [[]]
        assert (Path(live) / ".owner").read_text() == f"{os.getpid()}\n"
    assert not Path(live).exists()
