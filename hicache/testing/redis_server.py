"""Throwaway `redis-server` processes (and a three-master cluster) for tests and benchmarks.

Each server runs in its own directory with persistence off, bound to loopback on a free port (or
a unix socket only). Readiness is the server's own "Ready to accept connections" log line, read
from its stdout by a drain thread, so nothing polls on a timer. A `RedisServer` owns its process;
`stop()` is idempotent and always reaps it, so no process outlives its owner's teardown.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from typing_extensions import Self

READY_TIMEOUT_S = 20.0


def redis_server_binary() -> str | None:
    """Path of redis-server (or valkey-server), or None where neither is installed."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too; so at most 55535."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55536)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process. `port` is 0 for a unix-socket-only server."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = 0 if unix_socket else (port or free_port())
        self.socket_path = str(self.directory / "redis.sock") if unix_socket else None
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: list[str] = []

    @property
    def url(self) -> str:
        if self.socket_path:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> Self:
        """Start the process and return once it accepts connections (same port on restart)."""
        if self._process is not None:
            raise RuntimeError("redis-server already running")
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.directory), "--logfile", "",
            "--daemonize", "no", "--protected-mode", "no",
        ]  # fmt: skip
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        args += list(self.extra_args)
        ready = threading.Event()
        self._log = []
        process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self._process = process

        def drain() -> None:  # keeps the pipe from filling; marks readiness
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.decode(errors="replace").rstrip()
                self._log.append(line)
                if "ready to accept connections" in line.lower():
                    ready.set()
            ready.set()  # process ended: unblock the waiter, which checks poll()

        threading.Thread(target=drain, daemon=True, name=f"redis-log-{self.port}").start()
        if not ready.wait(READY_TIMEOUT_S) or process.poll() is not None:
            log = "\n".join(self._log[-20:])
            self.stop()
            raise RuntimeError(f"redis-server did not start: {' '.join(args)}\n{log}")
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, every connection reset."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open but answers nothing."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start again, empty (persistence is off), on the same port or socket."""
        self.kill()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.start()

    def stop(self) -> None:
        """Terminate and reap; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """Three masters, no replicas, every slot covered; owns the three RedisServer processes."""

    def __init__(self, directory: Path, *, masters: int = 3, node_timeout_ms: int = 2000) -> None:
        self.nodes = [
            RedisServer(
                Path(directory) / f"node{i}",
                port=free_cluster_port(),
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                ],
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> Self:
        try:
            for node in self.nodes:
                node.start()
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
            # redis-cli waits until every node agrees on the slot map before it returns.
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            done = subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                timeout=60,
                check=False,  # the return code and output are checked below
            )
            if done.returncode != 0 or b"All 16384 slots covered" not in done.stdout:
                raise RuntimeError(
                    f"cluster create failed:\n{done.stdout.decode()}{done.stderr.decode()}"
                )
            self._wait_until_ok(cli)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ok(self, cli: str) -> None:
        """Each master keeps its cluster state "fail" for up to 2 s after it started
        (CLUSTER_WRITABLE_DELAY), whatever the slot map says: poll, as the server offers no
        notification. This is setup readiness, not a timing assertion."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(self.nodes)
        while pending:
            node = pending[0]
            info = subprocess.run(
                [cli, "-p", str(node.port), "cluster", "info"],
                capture_output=True,
                timeout=10,
                check=False,  # polled until ok
            ).stdout
            if b"cluster_state:ok" in info:
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {node.port} not ok:\n{info.decode()}")
            else:
                time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
