"""`pagefleet:num_requests_loading`: the requests of a group waiting for their prefix's blocks
from the disk tier, as a served group's Prometheus metrics show them.

`pagefleet serve` runs the built-in model over a pool of 24 blocks of 8 tokens, a host tier of
12 blocks and a disk tier whose reads are slowed by `--kv-disk-read-delay-s` (each of a
document's 10 blocks takes 0.15 s more). A document is read, four others push it down to the
disk, and a question on it waits in the loading state while its blocks are read: the gauge is
1 meanwhile and 0 once the answer, restored from the disk, has come back.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_cli_serve import READY_WITHIN_S, free_port, start_serve
from test_kv_disk_restart import DOC_TOKENS, GREEDY, serve_args

from pagefleet.client import Client

READ_DELAY_S = 0.15


def loading(metrics_port: int) -> list[float]:
    """The values of the num_requests_loading series, one per group."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pagefleet:num_requests_loading"
    ]


def test_the_loading_gauge_counts_a_request_while_its_prefix_is_read_from_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_CLUSTER_SECRET", "loading-gauge-secret")
    rng = random.Random(5)
    docs = [[rng.randrange(3, 200) for _ in range(DOC_TOKENS)] for _ in range(5)]
    port, metrics_port = free_port(), free_port()
    args = [*serve_args(tmp_path / "kv-disk", port, metrics_port), "--kv-disk-read-delay-s", str(READ_DELAY_S)]
    log = tmp_path / "serve.log"
    proc = start_serve(log, *args)
    client = Client(f"127.0.0.1:{port}", timeout=60)
    try:
        try:
            client.wait_ready(timeout=READY_WITHIN_S)
        except Exception:
            raise AssertionError(log.read_text()) from None
        question = docs[0] + [7, 8, 9]
        answer = client.generate(token_ids=question, **GREEDY)
        for d in docs[1:]:  # the document goes down to the disk
            client.generate(token_ids=d + [5], **GREEDY)
        assert loading(metrics_port) == [0.0]

        restored: list = []
        asking = threading.Thread(target=lambda: restored.append(client.generate(token_ids=question, **GREEDY)))
        asking.start()
        seen: set[float] = set()
        while asking.is_alive():
            seen.update(loading(metrics_port))
            time.sleep(0.02)
        asking.join()
        assert 1.0 in seen, f"the gauge never counted the loading request: {seen}"
        (got,) = restored
        assert got.token_ids == answer.token_ids and got.cached_tokens == DOC_TOKENS
        deadline = time.monotonic() + 10
        while loading(metrics_port) != [0.0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loading(metrics_port) == [0.0]
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
