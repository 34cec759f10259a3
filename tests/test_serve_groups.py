"""`pagefleet serve --groups 2` run the way the README runs it: a command that starts its own
local Ray runtime and places two Ray groups on it.

This is the path where the server once killed its own Ray head: Ray's head processes die with
the *thread* that started them, and the runtime was started on a short-lived loading thread.
The server then seemed fine over direct actor connections until a request needed the object
store (a payload over Ray's 100 KB inline limit) or until the driver gave up on the GCS (60 s).
So the server here must keep its head processes alive past that minute, serve a request whose
payload goes through the object store, and listen, with its Ray runtime and its rank actors,
on loopback only (a group's rendezvous once listened on every interface).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import pytest

from router.door.server import HEALTH_INTERVAL_S
from tests.process_tree import descendants, is_loopback, listening_sockets, process_state
from tests.redis_server import free_port
from tests.serve_process import start_serve
from worker.model.builtin_model import make_model_dir

READY_WITHIN_S = 300  # a local Ray runtime and two groups, on a busy 2-core machine
GCS_GIVE_UP_S = 60  # a driver that loses its GCS exits this long after (Ray's default)
LONG_PROMPT = 27_000  # token ids: ~108 KB as the uint32 array the router sends a group


@pytest.fixture(scope="module")
def groups_server(tmp_path_factory):
    """`pagefleet serve --groups 2` on a tiny model with a 32k context; yields (process,
    client, log path, the time it became ready). On SIGTERM it must exit 0 and leave no Ray
    process behind."""
    tmp = tmp_path_factory.mktemp("serve-groups")
    model = make_model_dir(tmp / "model", max_position_embeddings=32_768)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = tmp / "serve.log"
    flags = [
        "--groups",
        "2",
        "--model",
        str(model),
        "--no-metrics",
        "--num-blocks",
        "2048",
        "--max-model-len",
        "32768",
        "--grace",
        "5",
    ]
    proc, client = start_serve(flags, free_port(), log, READY_WITHIN_S, env)
    try:
        yield proc, client, log, time.monotonic()
    finally:
        client.close()
        tree = descendants(proc.pid)
        proc.terminate()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(30)
        assert code == 0, f"exit status {code} on SIGTERM:\n{log.read_text()[-3000:]}"
        deadline = time.monotonic() + 30
        while (left := [p for p in tree if process_state(p) not in (None, "Z")]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"the server's Ray processes outlived it: {[tree[p] for p in left]}"


def ray_head_processes(pid: int) -> dict[int, str]:
    """The Ray head processes the server started: pid -> name."""
    heads = ("gcs_server", "raylet")
    return {p: name for p, name in descendants(pid).items() if name in heads}


def test_the_servers_ray_head_is_alive_after_it_is_ready(groups_server):
    proc, client, log, _ = groups_server
    time.sleep(5)  # the head once died a few seconds after "ready"
    heads = ray_head_processes(proc.pid)
    assert sorted(heads.values()) == ["gcs_server", "raylet"], (heads, log.read_text())
    for pid, name in heads.items():
        assert process_state(pid) not in ("Z", "X", None), f"{name} ({pid}) is dead"
    assert [g.alive for g in client.cluster_status()] == [True, True]


def test_every_listening_socket_of_the_server_is_on_loopback(groups_server):
    proc, _, log, _ = groups_server
    pids = {proc.pid, *descendants(proc.pid)}
    sockets = listening_sockets(pids)
    assert sockets, "no listening socket found: the test cannot see the server's"
    exposed = [(pid, addr, port) for pid, addr, port in sockets if not is_loopback(addr)]
    names = descendants(proc.pid)
    assert not exposed, [(names.get(pid, "serve"), addr, port) for pid, addr, port in exposed]


def test_a_request_over_rays_inline_limit_is_served(groups_server):
    proc, client, log, _ = groups_server
    prompt = [(7 * i + 3) % 256 for i in range(LONG_PROMPT)]
    done = client.generate(token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    assert done.completion_tokens == 2 and done.prompt_tokens == LONG_PROMPT
    assert proc.poll() is None, log.read_text()
    # And again, on whichever group did not take the first one.
    done = client.generate(token_ids=prompt[:-16], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert done.completion_tokens == 2
    assert all(g.alive for g in client.cluster_status())


def test_the_server_outlives_the_drivers_gcs_timeout(groups_server):
    proc, client, log, ready_at = groups_server
    time.sleep(max(0.0, ready_at + GCS_GIVE_UP_S + 15 - time.monotonic()))
    assert proc.poll() is None, log.read_text()
    heads = ray_head_processes(proc.pid)
    assert len(heads) == 2 and all(process_state(p) not in ("Z", "X", None) for p in heads)
    done = client.generate(token_ids=[5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert done.completion_tokens == 3
    assert [g.alive for g in client.cluster_status()] == [True, True]


def test_killed_groups_are_replaced_and_health_follows(groups_server):
    """Last: it kills the server's groups. Health is NOT_SERVING while none lives; the
    supervisor replaces both (a new generation each) and the server serves again."""
    proc, client, log, _ = groups_server
    ranks = [p for p, name in descendants(proc.pid).items() if name.startswith("ray::RankActor")]
    assert len(ranks) == 2, descendants(proc.pid)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while client.health(timeout=5) != "NOT_SERVING":
        assert time.monotonic() < deadline, "still SERVING with every group dead"
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(token_ids=[5, 6], max_tokens=1, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 180
    while not all(g.alive for g in client.cluster_status()):
        assert time.monotonic() < deadline, f"not replaced: {client.cluster_status()}"
        time.sleep(0.5)
    # health follows the groups on its own poll (router/door/server.py: HEALTH_INTERVAL_S)
    deadline = time.monotonic() + 10 * HEALTH_INTERVAL_S
    while client.health(timeout=5) != "SERVING":
        assert time.monotonic() < deadline, "groups alive again, health still NOT_SERVING"
        time.sleep(0.1)
    groups = client.cluster_status()
    assert [(g.alive, g.generation, g.restarts) for g in groups] == [(True, 2, 1)] * 2, groups
    done = client.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert done.completion_tokens == 2
    assert proc.poll() is None, log.read_text()


def test_a_sigterm_to_the_whole_process_group_stops_the_server_without_the_gcs_wait(tmp_path):
    """A process manager that stops the server's process group (`kill -- -PGID`) signals the
    local Ray runtime's head processes too: the GCS stops answering at once. The server must
    not wait on it (Ray's driver gives up on a lost GCS after 60 s and ends the process with an
    error), nor start a second runtime from a thread that still calls Ray: it exits 0, soon,
    and leaves no Ray process behind."""
    model = make_model_dir(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = tmp_path / "serve.log"
    flags = ["--groups", "2", "--model", str(model), "--no-metrics", "--grace", "2"]
    proc, client = start_serve(flags, free_port(), log, READY_WITHIN_S, env, new_session=True)
    client.close()
    tree = descendants(proc.pid)
    assert sorted(n for n in tree.values() if n in ("gcs_server", "raylet")) == ["gcs_server", "raylet"]
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(GCS_GIVE_UP_S - 15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        pytest.fail(f"still running {GCS_GIVE_UP_S - 15} s after SIGTERM to its group:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code == 0, f"exit status {code}:\n{text[-3000:]}"
    assert "stopped" in text and "its groups go with it" in text, text[-3000:]
    assert text.count("Started a local Ray instance") == 1, text[-3000:]  # no second runtime
    deadline = time.monotonic() + 30
    while (left := [p for p in tree if process_state(p) not in (None, "Z")]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the server's Ray processes outlived it: {[tree[p] for p in left]}"
