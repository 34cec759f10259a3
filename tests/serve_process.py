"""`pagefleet serve` as a subprocess, started the way a user starts it, for tests that probe a
running server from outside."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc

from pagefleet.client import Client

ROOT = Path(__file__).resolve().parents[1]


def start_serve(
    flags: list[str],
    port: int,
    log: Path,
    ready_within_s: float,
    env: dict | None = None,
    **security,
) -> tuple[subprocess.Popen, Client]:
    """`python -m pagefleet serve --port PORT *flags`, its output in `log`, once its health
    says SERVING (fails at once if it exits first). No HTTP door unless `flags` ask for one
    (`--http-port`); `security`: the client's (pagefleet.client.Security's fields)."""
    if not any(f.startswith("--http-port") for f in flags):
        flags = [*flags, "--no-http"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet", "serve", "--port", str(port), *flags],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = Client(f"127.0.0.1:{port}", timeout=120, **security)
    deadline = time.monotonic() + ready_within_s
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if client.health(timeout=2) == "SERVING":
                    return proc, client
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"not SERVING after {ready_within_s} s"
            time.sleep(0.2)
    except BaseException:
        client.close()
        proc.kill()
        proc.wait(30)
        raise


def builtin_model_flags() -> list[str]:
    """`--model DIR` of the tiny random built-in model (made once, then cached), so that a test
    server starts in seconds whatever the default model is."""
    from worker.builtin_model import builtin_model_path

    return ["--model", str(builtin_model_path())]
