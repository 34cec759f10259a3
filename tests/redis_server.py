"""A real `redis-server` on a free loopback port, for tests.

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        server.stop()   # Redis goes down...
        server.start()  # ...and comes back, empty, on the same port
        server.pause()  # SIGSTOP: hung, until server.resume()

No persistence (`--save '' --appendonly no`), so a restart loses every key, like a crash.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis on `port` answers PING with PONG (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One `redis-server` subprocess in its own temporary directory."""

    def __init__(self, port: int | None = None, executable: str = "redis-server") -> None:
        path = shutil.which(executable)
        if path is None:
            raise FileNotFoundError(f"{executable} is not on PATH")
        self.executable = path
        self.port = port or free_port()
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        if self.running:
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="pagefleet-redis-"))
        args = [self.executable, "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self._dir)]
        log = open(self._dir / "redis.log", "ab")  # noqa: SIM115  (the child keeps it)
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self._dir)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not answers_ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start; see {self._dir / 'redis.log'}")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until the port is closed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its port and connections but answers nothing (a hung
        Redis), until `resume`."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop and remove the temporary directory."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
