"""Several `hicache replay` processes on one file store (`file:DIR`), as several engines on one
host share a directory: three replays writing it at once and a fourth reading it afterwards,
uncapped and at a cap all three evict at, and writers killed with SIGKILL mid-run before a
reader. Every page a replay loads is verified against the KV it must hold (`corrupt_pages`),
and every value the store reads is checked (`storage_problems`).

Each replay keeps its scratch directory under the test's own (`--tmp-dir`), and every wait is
bounded and polls something observable: a line from the process, values in the store."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from hicache.backends.file import FileBackend
from hicache.cli.main import _parser
from hicache.cli.replay.args import cache_config
from tests.integration.storage_helpers import namespace_of

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "mooncake_trace_400.jsonl"
WAIT_S = 120.0  # the most any wait here lasts (the machine may be busy)
KV = "mha:1:1:8:float16"  # with 256-token pages, 8 KiB values: about 6,000 for 120 requests
REPLAY = [
    "--trace",
    str(TRACE),
    "--limit",
    "120",
    "--page-size",
    "256",
    "--kv",
    KV,
    "--device-tokens",
    "65536",
    "--host-tokens",
    "131072",
    "--quiet",
]
NO_PROBLEMS = {"errors": 0, "corrupt_values": 0}


def replay_config(store: Path, tmp_path: Path) -> Any:
    """The `CacheConfig` the replays here run with (the namespace their values are under)."""
    args = _parser().parse_args(["replay", *REPLAY, "--storage", f"file:{store}"])
    return cache_config(args, kv=KV, tmp=str(tmp_path))


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def run_replays(
    tmp_path: Path,
    name: str,
    count: int,
    store: Path,
    *extra: str,
    watch: Callable[[], object] = lambda: None,
) -> list[Any]:
    """Run `count` replays on `store` at once (all start once every one has finished its
    imports) and return their `--json` summaries. Each must exit 0. `watch()` is called
    again and again while any of them runs."""
    procs: list[subprocess.Popen[str]] = []
    summaries: list[dict[str, Any]] = []
    start, go = os.pipe()  # each child starts replaying once `go` is closed
    try:
        procs.extend(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration.replay_process",
                    str(start),
                    *REPLAY,
                    "--storage",
                    f"file:{store}",
                    "--tmp-dir",
                    str(tmp_path),
                    "--json",
                    str(tmp_path / f"{name}{i}.json"),
                    *extra,
                ],
                cwd=REPO,
                env=child_env(),
                pass_fds=(start,),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(count)
        )
        deadline = time.monotonic() + WAIT_S
        for proc in procs:
            assert proc.stdout is not None
            ready, _, _ = select.select(
                [proc.stdout], [], [], max(0.0, deadline - time.monotonic())
            )
            line = proc.stdout.readline() if ready else ""
            assert line.strip() == "ready", f"{name}: not ready within {WAIT_S} s: {line!r}"
        os.close(go)
        go = -1
        deadline = time.monotonic() + WAIT_S
        for proc in procs:
            while proc.poll() is None and time.monotonic() < deadline:
                watch()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)  # between looks; returns at once if it exits
        for i, proc in enumerate(procs):
            _out, err = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, f"{name}{i} exited {proc.returncode}:\n{err[-3000:]}"
            summaries.append(json.loads((tmp_path / f"{name}{i}.json").read_text()))
    finally:
        os.close(start)
        if go >= 0:
            os.close(go)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return summaries


def values(store: Path) -> dict[str, os.stat_result]:
    """Every value file in the store, temporary files excluded, with its stat."""
    out: dict[str, os.stat_result] = {}
    for path, dirs, files in os.walk(store):
        dirs[:] = [d for d in dirs if d != "tmp"]
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # evicted since the walk listed it
                out[os.path.join(path, f)] = os.stat(os.path.join(path, f))
    return out


def on_disk(st: os.stat_result, block: int) -> int:
    """A value's bytes as the store counts them: whole filesystem blocks."""
    return -(-st.st_size // block) * block


def block_of(store: Path) -> int:
    return os.statvfs(store.parent).f_frsize  # the store may not exist yet


def stored_bytes(store: Path) -> int:
    block = block_of(store)
    return sum(on_disk(st, block) for st in values(store).values())


def walked_bytes(store: Path) -> tuple[int, int]:
    """One walk of the store: the bytes of every value it met, and of those the store held as
    the walk began, at most. A walk is not atomic, so the first figure may count values written
    during it (a directory seen filled is filled) and the second leaves them out (their mtime
    is set just before they are renamed in), with a margin for a writer's pause between the two
    (a directory seen under a bound was under it). Values read during the walk (a read moves
    the mtime too) are left out of the second as well, which only makes it smaller."""
    began = time.time_ns() - 50_000_000
    block = block_of(store)
    seen = values(store).values()
    return (
        sum(on_disk(st, block) for st in seen),
        sum(on_disk(st, block) for st in seen if st.st_mtime_ns < began),
    )


def temp_files(store: Path) -> list[Path]:
    return sorted(p for p in store.glob("*/tmp/*") if p.is_file())


def check_clean(summary: dict[str, Any]) -> None:
    assert summary["corrupt_pages"] == 0 and summary["verified_pages"] > 0
    assert summary["storage_problems"] == NO_PROBLEMS, summary["storage_stats"]


# ---------------------------------------------------------------- three writers, then a reader


@pytest.mark.slow
# capped: each writer alone would store about 48 MiB, so all three evict; the reader then finds
# the later requests' pages still stored
@pytest.mark.parametrize("cap", [None, 24 << 20], ids=["uncapped", "capped"])
def test_three_replays_write_one_store_at_once_and_a_fourth_reads_it(tmp_path, cap):
    store = tmp_path / "store"
    extra = [] if cap is None else ["--storage-max-bytes", str(cap)]
    sampled: list[tuple[int, int]] = []  # the directory, walked again and again while they run
    writers = run_replays(
        tmp_path,
        "writer",
        3,
        store,
        *extra,
        watch=lambda: sampled.append(walked_bytes(store)),
    )
    for s in writers:
        check_clean(s)
        assert s["storage_stats"]["set_ok"] > 0
    written = values(store)
    (reader,) = run_replays(tmp_path, "reader", 1, store, *extra)
    check_clean(reader)
    assert reader["hit_tokens"]["storage"] > 0  # read back what the writers left
    assert reader["storage_stats"]["get_hits"] > 0
    if cap is None:
        return
    # docs/backends.md: P writers with the same cap keep the directory within
    # cap + (P - 1) x (0.1 x cap + one batch); a batch is up to storage_batch_pages values.
    batch = replay_config(store, tmp_path).storage_batch_pages * max(
        on_disk(st, block_of(store)) for st in written.values()
    )
    bound = cap + 2 * (0.1 * cap + batch)
    stats = [s["storage_stats"] for s in writers]
    assert all(st["max_bytes"] == cap and st["evictions"] > 0 for st in stats), stats
    # The directory itself, not each writer's `peak_stored_bytes`: that is the writer's index,
    # which keeps counting values the others evicted until its next scan (it can pass the
    # bound while the directory stays under the cap).
    # seen filled, and never over (walked_bytes says why the two figures of a walk differ)
    filled, held = max(seen for seen, _ in sampled), max(held for _, held in sampled)
    assert cap // 3 < filled and held <= bound, (filled, held, bound)
    assert sum(on_disk(st, block_of(store)) for st in written.values()) <= bound
    assert stored_bytes(store) <= bound  # the reader's writes too


# ---------------------------------------------------------------- writers killed mid-run


def wait_for_new_values(
    store: Path, before: dict[str, os.stat_result], proc: subprocess.Popen[str], want: int
) -> None:
    """Until `want` values in the store are new or rewritten since `before` (the process is
    storing pages): bounded."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the writer ended before storing {want} values"
        now = values(store)
        if (
            sum(
                1
                for path, st in now.items()
                if path not in before or before[path].st_ino != st.st_ino
            )
            >= want
        ):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)  # between looks at the store; returns at once if it exits
    pytest.fail(f"the writer stored fewer than {want} values within {WAIT_S} s")


@pytest.mark.slow
def test_writers_killed_mid_run_leave_no_corrupt_value(tmp_path):
    store = tmp_path / "store"
    for _ in range(3):
        before = values(store)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hicache.cli.main",
                "replay",
                *REPLAY,
                "--storage",
                f"file:{store}",
                "--tmp-dir",
                str(tmp_path),
            ],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for_new_values(store, before, proc, want=64)
        finally:
            proc.kill()  # SIGKILL: no handler runs, whatever it was writing stays
            proc.wait(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL
    ns = namespace_of(replay_config(store, tmp_path))
    assert [p.name for p in store.iterdir()] == [ns.digest]
    # What a write cut short leaves: part of a value in the temporary directory. The kills
    # here usually leave a few (one per writer thread in the middle of a batch); one more is
    # made as a killed writer's would look, so the sweep below always has one to remove.
    (value, _) = min(values(store).items())
    cut = store / ns.digest / "tmp" / f"{Path(value).name}.4000000.0.0.tmp"
    cut.write_bytes(Path(value).read_bytes()[:100])
    left = temp_files(store)
    (reader,) = run_replays(tmp_path, "reader", 1, store)
    check_clean(reader)
    assert reader["hit_tokens"]["storage"] > 0
    # A young temporary file may be a live writer's: an open with the default stale_temp_s
    # (600 s) keeps it ...
    assert set(left) <= set(temp_files(store))

    async def open_and_close() -> None:
        backend = FileBackend(store, namespace=ns, stale_temp_s=0)
        await backend.aclose()

    anyio.run(open_and_close)
    assert temp_files(store) == []  # ... one with stale_temp_s=0 removes every one
    assert values(store)  # and no value with them
