"""A rank whose node's raylet dies ends itself, and its group keeps one registration in Redis.

On the session's loopback Ray cluster, a supervisor keeps one group (Redis index) on a node of
its own; a second node with a group slot waits for the replacement. The first node's raylet is
SIGKILLed (a zombie until its parent reaps it, as in tests/test_cluster_services.py). The old
rank once went on running for minutes, and took the group's registration back from its
replacement 20-39 times a second; its rows outlived `groups stop`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from cluster.ray.config import RayGroupConfig
from cluster.ray.supervisor import GroupsSpec, RestartPolicy, start_supervisor
from pagefleet.llm import engine_config
from tests.process_tree import process_state

SLOT = "pf_fate"  # a node with one of these takes the group
CLUSTER = "fate"
# The rank's node watch checks its raylet every second; Ray needs a moment to start the process
# check. Before the fix the rank lived on past 120 s.
RANK_GONE_WITHIN_S = 10.0


def add_node(cluster):
    return cluster.add_node(num_cpus=2, resources={SLOT: 1}, object_store_memory=80 << 20, node_ip_address="127.0.0.1")


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.fixture
def supervised(ray_runtime, redis_server):
    """A supervisor and its one group on a node of its own; yields (supervisor, that node)."""
    import ray

    cluster = ray_runtime.cluster
    first = add_node(cluster)
    cluster.wait_for_nodes()
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="fate")
    gc = RayGroupConfig(bundle_resources={SLOT: 1}, status_timeout_s=2.0, start_timeout_s=300)
    spec = GroupsSpec(
        config,
        gc,
        groups=1,
        cluster=CLUSTER,
        redis_url=redis_server.url,
        restart=RestartPolicy(initial_s=0.2),
    )
    supervisor = start_supervisor(spec, detached=False, name="fate-supervisor")
    nodes = [first]
    try:
        yield supervisor, nodes, cluster
    finally:
        ray.get(supervisor.stop.remote(), timeout=120)
        ray.kill(supervisor, no_restart=True)
        for node in nodes:
            if node in cluster.worker_nodes:
                cluster.remove_node(node, allow_graceful=False)


def serving(supervisor, generation: int):
    import ray

    (info,) = ray.get(supervisor.groups.remote(), timeout=30)
    return info if info.state == "serving" and info.generation == generation else None


def test_the_rank_of_a_dead_node_ends_itself_and_the_group_keeps_one_registration(supervised, redis_server):
    supervisor, nodes, cluster = supervised
    info = wait_for(lambda: serving(supervisor, 1), 300, "the group to serve")
    (rank,) = info.ranks
    assert rank["node_id"] == nodes[0].node_id
    nodes.append(add_node(cluster))  # where the replacement goes
    cluster.wait_for_nodes()
    admin = redis.Redis.from_url(redis_server.url)
    prefix = f"pf:{CLUSTER}:model:"
    assert int(admin.hget(prefix + "groups", "group-0")) == 1

    os.kill(nodes[0].all_processes["raylet"][0].process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: process_state(rank["pid"]) in (None, "Z"), 120, "the old rank to end")
    gone_after_s = time.monotonic() - killed_at
    print(f"old rank gone {gone_after_s:.1f} s after its raylet was killed")
    assert gone_after_s < RANK_GONE_WITHIN_S

    replaced = wait_for(lambda: serving(supervisor, 2), 300, "the replacement to serve")
    assert replaced.ranks[0]["node_id"] == nodes[1].node_id
    epoch = int(admin.hget(prefix + "epochs", "group-0"))
    time.sleep(3.0)  # the old rank, were it alive, would take the group back many times by now
    assert int(admin.hget(prefix + "epochs", "group-0")) == epoch  # no new registration
    assert int(admin.hget(prefix + "groups", "group-0")) == epoch
    assert admin.get(prefix + "hb:group-0").startswith(f"group-0\t{epoch}\t".encode())

    import ray

    ray.get(supervisor.stop.remote(), timeout=120)
    time.sleep(2.0)  # (an old rank re-registered within a step)
    rows = [k for k in admin.scan_iter(match=prefix + "*") if b":hb:" in k or b":inv:" in k]
    assert rows == []
