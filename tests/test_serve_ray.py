"""Ray-placed serving: a RayGroup feeds the prefix index, and `pagefleet serve` joins a real
`ray start --head` cluster with token authentication on (Ray's default where a token exists),
both from `ray job submit -- pagefleet serve --address auto` and run directly with `--address`.

The first tests run on the session's loopback Ray cluster (`ray_runtime`). The later tests
start their own head node in a subprocess, with its own temp dir and ports, and stops it (and only it)
by ending `ray start --block`, which takes the processes it started down with it: `ray stop`
would stop every Ray process on the machine, the session cluster included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from cluster.ray.group import RayGroup, RayGroupConfig
from pagefleet.client import Client
from pagefleet.llm import engine_config
from router.launch.config import ServeConfig
from router.launch.local import router_side
from router.router import Router, RouteRequest
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SECRET = "serve-ray-test-secret"
DOC = [(11 * i + 5) % 1000 for i in range(96)]  # 6 blocks of 16
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ray_and_local(ray_runtime):
    """A RayGroup and an in-process group publishing to one in-memory index."""
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=512, cluster_secret=SECRET)
    ray_group = RayGroup(config, RayGroupConfig(), group_id="ray-0", index=index)
    local = LocalGroup(config, index, group_id="local-0")
    hasher, tokenizer, info = router_side(config, "builtin")
    yield index, ray_group, local, hasher, info
    ray_group.shutdown()
    local.shutdown()


def test_a_ray_groups_blocks_are_in_the_index_when_its_request_finishes(ray_and_local):
    index, ray_group, local, hasher, info = ray_and_local
    chain = hasher.hash_prompt(DOC)

    async def direct():
        request = GenerationRequest(DOC + [7, 7], PARAMS, request_id="direct")
        return [out async for out in ray_group.generate(request)][-1]

    out = asyncio.run(direct())
    assert out.finished and out.num_cached_tokens == 0
    # No wait: the events travel ahead of the outputs and are published before they are routed.
    matches = index.match(chain)
    assert matches["ray-0"].blocks == len(chain) and matches["local-0"].blocks == 0

    # Both groups are idle and equal; only the index says where the document is. (A group
    # reports idle a moment after its request finishes: a 6-block document is worth less to
    # the policy than a neighbour it would slow down.)
    router = Router([local, ray_group], index, hasher, info, policy="prefix_aware")
    for question in (8, 9):
        wait_until(lambda: ray_group.status().running == 0, 10, "the Ray group to report idle")
        request = RouteRequest(prompt_token_ids=DOC + [question] * 3, params=PARAMS)

        async def routed(request=request):
            return [o async for o in router.generate(request)][-1]

        out = asyncio.run(routed())
        record = router.records[out.request_id]
        assert record.group_id == "ray-0"
        assert record.predicted_cached_tokens == record.actual_cached_tokens == len(DOC)
        assert out.num_cached_tokens == len(DOC)


def test_a_ray_group_republishes_its_inventory_after_losing_its_registration(ray_and_local):
    index, ray_group, _, hasher, _ = ray_and_local
    chain = hasher.hash_prompt(DOC)
    assert index.match(chain)["ray-0"].blocks == len(chain)  # (the test above ran first)
    index.deregister("ray-0", ray_group.publisher.epoch)  # as when its heartbeat lapses
    assert "ray-0" not in index.match(chain) or index.match(chain)["ray-0"].blocks == 0
    # The next load report is refused; the publisher registers again and sends its inventory,
    # fetched from rank 0's block manager.
    wait_until(
        lambda: index.match(chain).get("ray-0") and index.match(chain)["ray-0"].blocks == 6,
        10,
        "the inventory to be republished",
    )


def test_a_stopped_ray_group_leaves_the_index(ray_and_local):
    index, ray_group, _, hasher, _ = ray_and_local
    chain = hasher.hash_prompt(DOC)
    assert index.match(chain)["ray-0"].blocks == len(chain)
    ray_group.shutdown()
    assert "ray-0" not in index.match(chain)


def test_ray_placement_follows_the_serve_options():
    assert not ServeConfig().cluster.uses_ray  # the embedded default: one in-process group
    for options in ({"ray": True}, {"tp": 2}, {"groups": 2}, {"address": "auto"}):
        assert ServeConfig.from_mapping(options).cluster.uses_ray, options


# ---- `ray job submit -- pagefleet serve --address auto` against `ray start --head` ----------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ray_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def _env(home: str) -> dict:
    """The environment of the test's Ray processes and commands: their own HOME, so that the
    token authentication Ray turns on by default (its token in ~/.ray/auth_token) uses the
    test's own token and never the user's."""
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=str(REPO),
        HOME=home,
    )
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)  # (the session cluster's, if any)
    return env


def _processes_under(temp_dir: str) -> list[int]:
    """Pids of processes whose command line names `temp_dir` (the head node's processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if temp_dir.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@dataclass(frozen=True)
class RayHead:
    dashboard: str  # the jobs API's URL
    gcs_address: str  # what `pagefleet serve --address` joins
    home: str  # HOME holding the cluster's token (~/.ray/auth_token)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` with Ray's defaults, token authentication included (a token
    in its HOME, as on any machine where Ray has run), plus the dashboard (job submission
    needs it). Ends the head and every process under its temp dir, even on failure."""
    gcs, dash, agent, agent_grpc, client, metrics, env_agent = free_ports(7)
    temp_dir = tempfile.mkdtemp(prefix="pf-ray-")
    home = str(tmp_path_factory.mktemp("ray-home"))
    token = subprocess.run(
        ray_cli("get-auth-token", "--generate"),
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert token.returncode == 0 and (Path(home) / ".ray" / "auth_token").exists(), token.stderr
    head = subprocess.Popen(
        ray_cli(
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--ray-client-server-port={client}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={env_agent}",
            f"--object-store-memory={100 << 20}",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ),
        # No drain on SIGTERM: nothing here needs it, and it would hold the teardown 30 s.
        env={**_env(home), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        wait_until(lambda: _jobs_api_up(url) or head.poll() is not None, 60, "the dashboard")
        assert head.poll() is None, f"ray start exited:\n{head.stdout.read()}"
        yield RayHead(url, f"127.0.0.1:{gcs}", home)
    finally:
        head.send_signal(signal.SIGTERM)  # --block: ray start stops what it started
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in _processes_under(temp_dir):  # stragglers of this head only
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _jobs_api_up(url: str) -> bool:
    """The dashboard answers HTTP (any status: it is up)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _cli_env(head: RayHead) -> dict:
    """Ray's job CLI sends the token only in token mode (it does not turn it on by itself)."""
    return {**_env(head.home), "RAY_AUTH_MODE": "token"}


def test_ray_job_submit_pagefleet_serve(ray_head):
    port, metrics_port = free_ports(2)
    job_id = f"pagefleet-serve-{uuid.uuid4().hex[:8]}"
    submitted = subprocess.run(
        ray_cli(
            "job",
            "submit",
            f"--address={ray_head.dashboard}",
            "--no-wait",
            f"--submission-id={job_id}",
            f"--runtime-env-json={json.dumps({'env_vars': {'PYTHONPATH': str(REPO)}})}",
            "--",
            sys.executable,
            "-m",
            "pagefleet",
            "serve",
            "--model",
            "builtin",
            "--address",
            "auto",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ),
        env=_cli_env(ray_head),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            wait_serving(client, ray_head, job_id, timeout_s=150)
            done = client.generate(token_ids=[5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert done.finish_reason == "length" and len(done.token_ids) == 4
            (group,) = client.cluster_status()
            assert group.alive and group.tensor_parallel_size == 1 and done.group_id == "group-0"
    except BaseException:
        logs = subprocess.run(
            ray_cli("job", "logs", f"--address={ray_head.dashboard}", job_id),
            env=_cli_env(ray_head),
            capture_output=True,
            text=True,
            timeout=30,
        )
        print(logs.stdout[-4000:], logs.stderr[-2000:])
        raise
    finally:
        subprocess.run(
            ray_cli("job", "stop", f"--address={ray_head.dashboard}", job_id),
            env=_cli_env(ray_head),
            capture_output=True,
            text=True,
            timeout=60,
        )
    wait_until(lambda: not _listening(port), 30, "the stopped job's server to close its port")


def serve_joining(head: RayHead, env: dict, port: int) -> subprocess.Popen:
    """`pagefleet serve --address` of `head`, run as a user runs it, outside any Ray job."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagefleet",
            "serve",
            "--model",
            "builtin",
            "--address",
            head.gcs_address,
            "--port",
            str(port),
            "--no-metrics",
            "--grace",
            "2",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_serve_joins_a_token_authenticated_cluster_with_the_token_in_its_home(ray_head):
    (port,) = free_ports(1)
    proc = serve_joining(ray_head, _env(ray_head.home), port)
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 150
            while True:
                assert proc.poll() is None, proc.stdout.read()
                with contextlib.suppress(grpc.RpcError):
                    if client.health(timeout=2) == "SERVING":
                        break
                assert time.monotonic() < deadline, "not SERVING after 150 s"
                time.sleep(0.5)
            done = client.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0.0)
            assert len(done.token_ids) == 2
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_without_the_clusters_token_says_what_to_provide(ray_head, tmp_path):
    (port,) = free_ports(1)
    proc = serve_joining(ray_head, _env(str(tmp_path)), port)  # a HOME with no token
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "RAY_AUTH_TOKEN" in out and "token authentication" in out, out
    assert "Traceback" not in out, out


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_serving(client: Client, head: RayHead, job_id: str, timeout_s: float) -> None:
    """Until the job's server reports SERVING; fails at once if the job ends first."""
    import urllib.request

    token = (Path(head.home) / ".ray" / "auth_token").read_text().strip()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            if client.health(timeout=2) == "SERVING":
                return
        request = urllib.request.Request(
            f"{head.dashboard}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            status = json.load(r)["status"]
        assert status in ("PENDING", "RUNNING"), f"job {job_id} is {status} before serving"
        time.sleep(0.5)
    raise AssertionError(f"the job's server was not SERVING after {timeout_s} s")


LATE_RAYLET = """
import sys
import psutil
import ray._private.node as node
from cluster.ray.runtime import ensure_ray, ray

first_attempt: set[int] = set()
start_ray_processes = node.Node.start_ray_processes

def late_once(self):
    start_ray_processes(self)
    if not first_attempt:  # the first start's raylet never registers, as seen on a busy host
        first_attempt.update(c.pid for c in psutil.Process().children(recursive=True))
        raise ERROR

node.Node.start_ray_processes = late_once
ERROR = {"raylet": Exception("The current node timed out during startup. This could ..."),
         "gcs": RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")}[sys.argv[1]]
ensure_ray(num_cpus=1)
assert ray.get(ray.remote(lambda: 7).remote()) == 7
alive = [p for p in first_attempt if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
print("first attempt", len(first_attempt), "alive", alive)
assert first_attempt and not alive
ray.shutdown()
"""


@pytest.mark.parametrize("late", ["raylet", "gcs"])
def test_a_local_ray_start_that_times_out_is_tried_again_without_its_processes(tmp_path, late):
    """Ray's raylet has 30 s to register with the GCS, and the GCS 30 s to write its port file;
    when a start misses either (Ray's error raised here once, after the first start's
    processes are up), ensure_ray kills what that start left and starts again."""
    env = _env(str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", LATE_RAYLET, late],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "did not come up" in done.stderr and "attempt 2 of 3" in done.stderr, done.stderr
