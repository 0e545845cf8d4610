"""A real Mooncake Store on loopback for tests and benchmarks: `mooncake_master` (serving
metadata over HTTP itself) on free ports, and a separate storage process that contributes the
memory segment. Needs the optional `mooncake` package; nothing here runs at import."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SEGMENT = 256 << 20


def import_error() -> str | None:
    """Why `mooncake.store` cannot be imported here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # absent, or present without its system libraries (libibverbs1)
        return f"mooncake-transfer-engine-non-cuda not importable: {exc}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_listening(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
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
    master: subprocess.Popen[bytes]
    storage: subprocess.Popen[str]
    rpc_port: int
    http_port: int
    log_dir: Path

    @property
    def spec(self) -> str:
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}"
            "&protocol=tcp&host=127.0.0.1&probe_timeout=5&retry=30"
        )

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


def start_store(log_dir: Path, *, lease_ms: int = 5000, segment: int = SEGMENT) -> Store:
    """Start a master and a storage process; the caller must `stop()` the result."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    with open(log_dir / "master.log", "w") as log:  # the child keeps its own descriptor
        master = subprocess.Popen(
            [
                str(binary),
                f"--rpc_port={rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
                f"--default_kv_lease_ttl={lease_ms}",
                "--rpc_thread_num=2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 20
    try:
        _wait_listening(rpc, master, deadline)
        _wait_listening(http, master, deadline)
    except RuntimeError:
        master.kill()
        master.wait()
        raise
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONPATH": path}
    with open(log_dir / "storage.log", "w") as log:
        storage = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hicache.testing.mooncake_storage_server",
                f"127.0.0.1:{rpc}",
                f"http://127.0.0.1:{http}/metadata",
                str(segment),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    store = Store(master, storage, rpc, http, log_dir)
    line = storage.stdout.readline().strip() if storage.stdout else ""
    if line != "ready":
        store.stop()
        raise RuntimeError(f"storage process did not start: {line!r} (see {log_dir})")
    return store
