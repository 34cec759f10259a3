"""`pagefleet serve`, `generate` and `demo` run the way a user runs them: as commands.

The server is `pagefleet serve` with no flags but its ports (free ones, so that tests never
collide with a server someone is running): the embedded default of one CPU group, the
in-process index and the built-in model. It must answer health within seconds of starting,
report SERVING within a bound, stream to the `generate` and `demo` commands, and drain an
in-flight request on SIGTERM before it exits cleanly.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagefleet.client import Client
from router.launch.build import build_cluster
from router.launch.config import ServeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
ANSWER_WITHIN_S = 15  # health answers (NOT_SERVING) this soon after the process starts
READY_WITHIN_S = 240  # and SERVING within this, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagefleet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagefleet", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_serve(log: Path, *args: str) -> subprocess.Popen:
    """`pagefleet serve ARGS` as a user starts it, its output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pagefleet", "serve", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


@contextlib.contextmanager
def serving_tenants(tmp: Path, tenants_yaml: str, keys: str, key: str, *args: str) -> Iterator[tuple[int, int, Path]]:
    """`pagefleet serve` on the built-in model with a `tenants:` config and an API key file,
    ready for `key`: (gRPC port, HTTP port, its log); killed at the end."""
    (tmp / "serve.yaml").write_text(tenants_yaml)
    (tmp / "keys").write_text(keys)
    port, http_port = free_port(), free_port()
    log = tmp / "serve.log"
    proc = start_serve(
        log,
        *("--model", "builtin", "--config", str(tmp / "serve.yaml"), "--api-key-file", str(tmp / "keys")),
        *("--port", str(port), "--http-port", str(http_port), "--no-metrics", *args),
    )
    try:
        probe = Client(f"127.0.0.1:{port}", timeout=60, api_key=key)
        try:
            probe.wait_ready(timeout=READY_WITHIN_S)
        finally:
            probe.close()
        yield port, http_port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    started = time.monotonic()
    args = ("--model", "builtin", "--port", str(port), "--metrics-port", str(metrics_port))
    proc = start_serve(log, *args, "--http-port", str(http_port))
    client = Client(f"127.0.0.1:{port}", timeout=60)
    timings = {}
    try:
        while "answered" not in timings and time.monotonic() - started < ANSWER_WITHIN_S:
            assert proc.poll() is None, log.read_text()
            try:
                client.health(timeout=1)
                timings["answered"] = time.monotonic() - started
            except grpc.RpcError:
                time.sleep(0.05)
        client.wait_ready(timeout=READY_WITHIN_S)
        timings["ready"] = time.monotonic() - started
        timings["http_port"] = http_port
        yield proc, client, metrics_port, timings, log
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_answers_within_a_bounded_time(served):
    _, client, metrics_port, timings, log = served
    assert timings.get("answered", 1e9) < ANSWER_WITHIN_S, log.read_text()
    assert timings["ready"] < READY_WITHIN_S
    info = client.model_info()
    assert info.model == "builtin-v1"
    (group,) = client.cluster_status()  # the embedded default: one TP=1 CPU group
    assert group.alive and group.tensor_parallel_size == 1 and list(group.devices) == ["cpu"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    assert "pagefleet:num_requests_running{" in text.read().decode()
    assert "ready: gRPC on 127.0.0.1:" in log.read_text()
    # the HTTP door of the embedded default answers on its port, over the same cluster
    health = urllib.request.urlopen(f"http://127.0.0.1:{timings['http_port']}/health", timeout=10)
    assert health.status == 200


def test_generate_command_streams_what_the_client_gets(served):
    _, client, _, _, _ = served
    server = client.target
    done = pagefleet("generate", "The baker starts work", "--server", server, "--max-tokens", "8")
    assert done.returncode == 0, done.stderr
    want = client.generate("The baker starts work", max_tokens=8, temperature=0.0)
    assert done.stdout == want.text + "\n"
    assert "8 generated" in done.stderr

    as_json = pagefleet("generate", "--tokens", "5,6,7", "--server", server, "--max-tokens", "4", "--json")
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["prompt_tokens"] == 3 and len(out["token_ids"]) == 4
    want = client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0)
    assert out["token_ids"] == want.token_ids


def test_generate_command_sends_chat_messages(served):
    _, client, _, _, _ = served
    done = pagefleet(
        "generate", "Who built the bridge?", "--chat", "--server", client.target, "--max-tokens", "4", "--json"
    )
    assert done.returncode == 0, done.stderr
    rendered = client.tokenize(messages=[("user", "Who built the bridge?")])
    assert json.loads(done.stdout)["prompt_tokens"] == len(rendered)


def test_generate_command_reports_bad_input_and_a_missing_server(served):
    _, client, _, _, _ = served
    bad = pagefleet("generate", "x", "--server", client.target, "--temperature", "-1")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    assert "sampling.temperature" in bad.stderr and "Traceback" not in bad.stderr
    gone = pagefleet("generate", "x", "--server", f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_demo_shows_cached_tokens_growing(served):
    _, client, _, _, _ = served
    done = pagefleet("demo", "--server", client.target, "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    usage = re.findall(r"(\d+) prompt tokens, (\d+) from the cache", done.stdout)
    cached = [int(c) for _, c in usage]
    document = int(re.search(r"document: (\d+) tokens", done.stdout).group(1))
    block = client.model_info().block_size
    assert len(cached) >= 3 and cached[0] == 0
    # every later question reuses the document's full blocks
    assert all(c >= document // block * block - block for c in cached[1:]), done.stdout


def test_sigterm_drains_in_flight_requests_then_exits(served):
    proc, client, _, _, log = served
    stream = client.generate_stream("The teacher writes a problem", max_tokens=40, temperature=0.0)
    ids = list(next(stream).token_ids)
    proc.send_signal(signal.SIGTERM)
    for chunk in stream:  # the request finishes although the server is stopping
        ids.extend(chunk.token_ids)
        last = chunk
    assert len(ids) == 40 and last.finish_reason == 2  # FINISH_REASON_LENGTH
    assert proc.wait(60) == 0, log.read_text()
    assert "stopped" in log.read_text()
    assert "leaked" not in log.read_text()  # no report of Triton's bindings after "stopped"
    with pytest.raises(grpc.RpcError) as err:
        client.generate("too late", max_tokens=1, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- configuration (no server) -------------------------------------------------------------


def test_yaml_config_takes_the_flag_names_and_flags_win(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("groups: 2\nmetrics-port: 9999\nredis: redis://127.0.0.1:6379\nengine:\n  num_blocks: 64\n")
    config = load_config(str(path), {"port": 50999, "groups": None})
    assert config == ServeConfig.from_mapping(
        {
            "groups": 2,
            "metrics_port": 9999,
            "redis": "redis://127.0.0.1:6379",
            "port": 50999,
            "engine": {"num_blocks": 64},
        }
    )
    assert (config.cluster.groups, config.doors.metrics_port, config.doors.port) == (2, 9999, 50999)


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("grups: 2\n", "grups"),
        ("port: 70000\n", "port"),
        ("tp: 0\n", "tp"),
        ("- a list\n", "mapping"),
        ("engine: 3\n", "engine"),
    ],
)
def test_bad_config_is_refused_naming_the_key(tmp_path, yaml_text, words):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=words):
        load_config(str(path), {})


def test_serve_refuses_a_bad_config_before_loading_anything():
    done = pagefleet("serve", "--config", "/nonexistent/serve.yaml", timeout=60)
    assert done.returncode == 2 and "--config /nonexistent/serve.yaml" in done.stderr
    done = pagefleet("serve", "--groups", "0", timeout=60)
    assert done.returncode == 2 and "--groups" in done.stderr


def test_policy_options_reach_the_policy_and_bad_ones_stop_before_groups_start():
    with pytest.raises(ValueError, match="load_slak"):
        build_cluster(ServeConfig.from_mapping({"model": "builtin", "policy_options": {"load_slak": 0.2}}))
    with pytest.raises(ValueError, match="takes no options"):
        build_cluster(
            ServeConfig.from_mapping({"model": "builtin", "policy": "round_robin", "policy_options": {"x": 1}})
        )
    options = {"load_slack": None, "cost": {"prefill_token_s": 1e-4}}
    config = ServeConfig.from_mapping(
        {"model": "builtin", "policy_options": options, "engine": {"num_blocks": 64, "max_model_len": 512}}
    )
    cluster = build_cluster(config)
    try:
        policy_config = cluster.router.policy.config
        assert policy_config.load_slack is None and policy_config.cost.prefill_token_s == 1e-4
    finally:
        cluster.shutdown()


def test_kv_cache_dtype_flag_and_yaml_reach_every_group(tmp_path):
    """`--kv-cache-dtype` over the YAML's `engine:` key; the router names the groups' cache
    (its hashes, and so its predictions, are theirs); a dtype the engine lacks exits 2."""
    from pagefleet.cli import build_parser, serve_config

    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  kv_cache_dtype: fp8\n  num_blocks: 64\n  max_model_len: 512\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--no-metrics"])
    assert serve_config(args).engine.options["kv_cache_dtype"] == "fp8"
    args = build_parser().parse_args(["serve", "--model", "builtin", "--config", str(path), "--kv-cache-dtype", "int8"])
    config = serve_config(args)
    assert config.engine.options == {"kv_cache_dtype": "int8", "num_blocks": 64, "max_model_len": 512}
    cluster = build_cluster(config)
    try:
        assert cluster.router.model_info.kv_cache_dtype == "int8"
        (group,) = cluster.groups
        assert str(group.engine.engine.layout.dtype) == "torch.int8"
        assert cluster.router.hasher.root() == group.hasher.root()
    finally:
        cluster.shutdown()
    done = pagefleet("serve", "--kv-cache-dtype", "fp8_e5m2", timeout=60)
    assert done.returncode == 2 and "--kv-cache-dtype" in done.stderr


def test_dtype_flag_reaches_the_groups_model_and_the_routers_hashes():
    """`--dtype` overrides "auto"; the router's block hashes name the dtype the groups run."""
    import torch

    from pagefleet.cli import build_parser, serve_config

    flags = ["serve", "--model", "builtin", "--dtype", "float32", "--num-blocks", "64"]
    config = serve_config(build_parser().parse_args([*flags, "--max-model-len", "512"]))
    assert config.engine.options["dtype"] == "float32"
    cluster = build_cluster(config)
    try:
        (group,) = cluster.groups
        assert group.engine.engine.executor.worker.model_dtype == torch.float32
        assert cluster.router.hasher.fingerprint.dtype == "float32"
        assert cluster.router.hasher.root() == group.hasher.root()
    finally:
        cluster.shutdown()
