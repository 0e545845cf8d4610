"""Fixtures that run a real Mooncake Store on loopback: `mooncake_master` (with its built-in
HTTP metadata server) and a separate storage process that contributes the memory segment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SEGMENT = 256 << 20


def _import_error() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # absent, or present without its system libraries (libibverbs1)
        return f"mooncake-transfer-engine-non-cuda not importable: {exc}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}") from None
            time.sleep(0.05)  # readiness poll, not a timing assertion


@dataclass
class Store:
    master: subprocess.Popen
    storage: subprocess.Popen
    rpc_port: int
    http_port: int
    log_dir: Path

    @property
    def spec(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}"
                "&protocol=tcp&host=127.0.0.1&probe_timeout=5&retry=30")

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def stop(self) -> None:
        for proc in (self.storage, self.master):
            if proc.poll() is None:
                if proc.stdin:
                    proc.stdin.close()
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_store(log_dir: Path, *, lease_ms: int = 100) -> Store:
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    master = subprocess.Popen(
        [str(binary), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", f"--default_kv_lease_ttl={lease_ms}",
         "--rpc_thread_num=2"],
        stdout=open(log_dir / "master.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    try:
        _wait_listening(rpc, master, deadline)
        _wait_listening(http, master, deadline)
    except RuntimeError:
        master.kill()
        master.wait()
        raise
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    storage = subprocess.Popen(
        [sys.executable, str(HERE / "storage_server.py"), f"127.0.0.1:{rpc}",
         f"http://127.0.0.1:{http}/metadata", str(SEGMENT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log_dir / "storage.log", "w"),
        text=True, env=env)
    store = Store(master, storage, rpc, http, log_dir)
    line = storage.stdout.readline().strip() if storage.stdout else ""
    if line != "ready":
        store.stop()
        raise RuntimeError(f"storage process did not start: {line!r} (see {log_dir})")
    return store


@pytest.fixture(scope="session")
def mooncake_ready() -> None:
    reason = _import_error()
    if reason:
        pytest.skip(reason)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture(scope="module")
def store(mooncake_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = start_store(tmp_path_factory.mktemp("mooncake"))
    yield s
    s.stop()


@pytest.fixture
def private_store(mooncake_ready: None, tmp_path: Path) -> Iterator[Store]:
    """A store of the test's own, for tests that kill parts of it."""
    s = start_store(tmp_path)
    yield s
    s.stop()
