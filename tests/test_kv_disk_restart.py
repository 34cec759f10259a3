"""A served group killed and restarted on its disk tier's directory restores, not recomputes.

`pagefleet serve` runs as a user runs it (the built-in model, a pool of 24 blocks of 8 tokens,
a host tier of 12 blocks over a disk tier), under one cluster secret. It reads a document,
then four others that push the document down to the disk, and is killed (SIGKILL: nothing
is flushed or closed). Into its directory go what a process killed mid-write leaves (a torn
temporary file) and a short block file. Restarted on the same directory, the group reopens
its disk inventory (its tier usage says so before any request; the damaged files are gone),
and the first question on the document takes its 80 prompt tokens from the disk tier, as the
Prometheus metrics of the server show, with the greedy tokens of the first run.
"""

from __future__ import annotations

import random
import signal
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_cli_serve import READY_WITHIN_S, free_port, start_serve

from pagefleet.client import Client

BLOCK_BYTES = 8 * 4096  # a block of 8 tokens of the built-in model in float32
DOC_TOKENS = 80  # 10 full blocks
GREEDY = dict(temperature=0.0, max_tokens=6)


def serve_args(directory, port: int, metrics_port: int) -> list[str]:
    return [
        *("--model", "builtin", "--dtype", "float32", "--no-http"),
        *("--port", str(port), "--metrics-port", str(metrics_port)),
        *("--block-size", "8", "--num-blocks", "24", "--max-model-len", "128"),
        *("--kv-host-bytes", str(12 * BLOCK_BYTES), "--kv-disk-bytes", str(200 * BLOCK_BYTES)),
        *("--kv-disk-dir", str(directory)),
    ]


class Server:
    """One `pagefleet serve` on the disk directory, with its client and metrics port."""

    def __init__(self, directory, log) -> None:
        port, self.metrics_port = free_port(), free_port()
        self.log = log
        self.proc = start_serve(log, *serve_args(directory, port, self.metrics_port))
        self.client = Client(f"127.0.0.1:{port}", timeout=60)

    def __enter__(self) -> Server:
        try:
            self.client.wait_ready(timeout=READY_WITHIN_S)
        except Exception:
            self.__exit__()
            raise AssertionError(self.log.read_text()) from None
        return self

    def ask(self, prompt: list[int]):
        return self.client.generate(token_ids=prompt, **GREEDY)

    def metrics(self) -> dict[tuple, float]:
        """(sample name, its tier or direction) -> value, of the kv_tier_* series."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("pagefleet:kv_tier_"):
                    key = s.labels.get("tier") or s.labels.get("direction")
                    out[(s.name.removeprefix("pagefleet:"), key, s.labels.get("le"))] = s.value
        return out

    def __exit__(self, *exc) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def test_a_killed_server_restarted_on_its_directory_restores_from_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_CLUSTER_SECRET", "restart-test-secret")  # (the servers inherit it)
    rng = random.Random(3)
    docs = [[rng.randrange(3, 200) for _ in range(DOC_TOKENS)] for _ in range(5)]
    question = docs[0] + [7, 8, 9]
    directory = tmp_path / "kv-disk"
    with Server(directory, tmp_path / "first.log") as first:
        answer = first.ask(question)
        assert answer.cached_tokens == 0
        for d in docs[1:]:  # the document goes down to the disk
            first.ask(d + [5])
        m = first.metrics()
        assert m[("kv_tier_moved_bytes_total", "device_to_host", None)] > 0
        assert m[("kv_tier_moved_bytes_total", "host_to_disk", None)] > 0
        on_disk = m[("kv_tier_blocks_used", "disk", None)]
        assert on_disk >= 10 and m[("kv_tier_blocks_capacity", "disk", None)] == 200
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
    (rank_dir,) = directory.glob("group-0/*/rank0")  # the group's own subdirectory, then the digest
    files = sorted(rank_dir.glob("*.kv"))
    assert len(files) == on_disk
    torn = rank_dir / f"{'ab' * 16}.kv.tmp"  # a write the kill interrupted
    torn.write_bytes(files[0].read_bytes()[:1000])
    short = rank_dir / f"{'cd' * 16}.kv"  # a block file cut short
    short.write_bytes(files[0].read_bytes()[:-100])

    with Server(directory, tmp_path / "second.log") as again:
        m = again.metrics()
        assert m[("kv_tier_blocks_used", "disk", None)] == on_disk  # reopened, before any request
        assert m[("kv_tier_blocks_used", "host", None)] == 0
        assert not torn.exists() and not short.exists()

        restored = again.ask(question)
        assert restored.token_ids == answer.token_ids
        assert restored.cached_tokens == DOC_TOKENS
        m = again.metrics()
        assert m[("kv_tier_hit_tokens_total", "disk", None)] == DOC_TOKENS
        assert m[("kv_tier_hit_tokens_total", "device", None)] == 0
        assert m[("kv_tier_moved_bytes_total", "disk_to_host", None)] == 10 * files[0].stat().st_size
        assert m[("kv_tier_moved_bytes_total", "host_to_device", None)] == 10 * BLOCK_BYTES
        assert m[("kv_tier_load_seconds_count", "disk", None)] == 1  # one fetch: the document's
        assert m[("kv_tier_load_seconds_count", "host", None)] == 1  # one step's loads
        assert m[("kv_tier_load_seconds_bucket", "disk", "+Inf")] == 1
        assert m[("kv_tier_load_failures_total", "disk", None)] == 0


def test_a_server_stopped_with_sigterm_writes_its_tiers_down_and_restores_from_the_disk(tmp_path, monkeypatch):
    """Three documents stay on the device and the host (nothing reaches the disk while the
    server runs); SIGTERM writes them down before the group exits, so the restarted server's
    first question on document 0 takes its 80 prompt tokens from the disk tier."""
    monkeypatch.setenv("PAGEFLEET_CLUSTER_SECRET", "restart-test-secret")
    rng = random.Random(4)
    docs = [[rng.randrange(3, 200) for _ in range(DOC_TOKENS)] for _ in range(3)]
    question = docs[0] + [7, 8, 9]
    directory = tmp_path / "kv-disk"
    with Server(directory, tmp_path / "first.log") as first:
        answer = first.ask(question)
        for d in docs[1:]:  # document 0 partly on the host, partly on the device
            first.ask(d + [5])
        m = first.metrics()
        assert m[("kv_tier_moved_bytes_total", "device_to_host", None)] > 0
        assert m[("kv_tier_blocks_used", "disk", None)] == 0
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
    log = (tmp_path / "first.log").read_text()
    assert "to the disk tier at shutdown" in log, log
    (rank_dir,) = directory.glob("group-0/*/rank0")  # the group's own subdirectory, then the digest
    on_disk = len(list(rank_dir.glob("*.kv")))
    assert on_disk >= 30  # the three documents' full blocks

    with Server(directory, tmp_path / "second.log") as again:
        m = again.metrics()
        assert m[("kv_tier_blocks_used", "disk", None)] == on_disk
        restored = again.ask(question)
        assert restored.token_ids == answer.token_ids
        assert restored.cached_tokens == DOC_TOKENS
        m = again.metrics()
        assert m[("kv_tier_hit_tokens_total", "disk", None)] == DOC_TOKENS
        assert m[("kv_tier_hit_tokens_total", "device", None)] == 0
