"""`pagefleet serve` as a subprocess, started the way a user starts it, for tests that probe a
running server from outside, and what those tests share (waiting, the blocks' state, fuzzing)."""

from __future__ import annotations

import random
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
    new_session: bool = False,
    **security,
) -> tuple[subprocess.Popen, Client]:
    """`python -m pagefleet serve --port PORT *flags`, its output in `log`, once its health
    says SERVING (fails at once if it exits first). No HTTP door unless `flags` ask for one
    (`--http-port`); `security`: the client's (pagefleet.client.Security's fields);
    `new_session`: in a session and process group of its own (as a shell or a process manager
    starts it), which a signal to the group reaches whole."""
    if not any(f.startswith("--http-port") for f in flags):
        flags = [*flags, "--no-http"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet", "serve", "--port", str(port), *flags],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
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
    from worker.model.builtin_model import builtin_model_path

    return ["--model", str(builtin_model_path())]


def all_blocks_free(client: Client) -> bool:
    """Whether every group of the server has all its blocks free and nothing running or
    waiting."""
    return all(g.blocks_free == g.blocks_total and g.running == 0 and g.waiting == 0 for g in client.cluster_status())


def wait_for(predicate, timeout: float = 15.0) -> bool:
    """Whether `predicate()` becomes true within `timeout` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def mutated(rng: random.Random, data: bytes) -> bytes:
    """`data` after one to three byte-level mutations (a bit flipped, the tail cut, random
    bytes inserted, its head repeated inside), as a fuzzing client sends."""
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op, at = rng.randrange(4), rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del out[at:]
        elif op == 2:
            out[at:at] = rng.randbytes(rng.randrange(1, 6))
        else:
            out[at:at] = out[: rng.randrange(1, 12)]
    return bytes(out)
