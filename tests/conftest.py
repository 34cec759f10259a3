"""Shared fixtures. `ray_runtime` starts one real Ray cluster for the whole session, on loopback:
two nodes (ray.cluster_utils.Cluster), told apart by a custom resource, so that multi-node
placement is tested on the same runtime as everything else. Only tests that ask for it start
Ray; at the end of the session no actor or placement group may be left alive. `redis_server`
is one real `redis-server` on a free loopback port per test module."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

# Triton picks interpreted or compiled kernels when it is first imported (transformers may
# import it during collection), so the interpreter must be chosen before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Per node: CPUs declared to Ray (rank actors are light: one thread drives each) and a label.
HEAD_NODE = ("node_a", 8)
OTHER_NODE = ("node_b", 4)
OBJECT_STORE_BYTES = 100 << 20


@dataclass(frozen=True)
class RayRuntime:
    address: str
    node_labels: tuple[str, ...]  # custom resources naming the nodes, e.g. {"node_a": 1}
    cluster: object  # the ray.cluster_utils.Cluster, for tests that add (and kill) nodes


@pytest.fixture(scope="module")
def redis_server():
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def ray_runtime():
    from cluster.ray.runtime import (
        LOOPBACK,
        ensure_ray,
        live_actors,
        live_placement_groups,
        shutdown_ray,
    )

    def node_args(label: str, cpus: int) -> dict:
        return dict(
            num_cpus=cpus,
            resources={label: 100},
            object_store_memory=OBJECT_STORE_BYTES,
            node_ip_address=LOOPBACK,
        )

    # Only after cluster.ray.runtime, which keeps Ray on loopback if it loads Ray first (a test
    # file run alone may import nothing else that does).
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**node_args(*HEAD_NODE), "include_dashboard": False})
    cluster.add_node(**node_args(*OTHER_NODE))
    address = ensure_ray(cluster.address)
    cluster.wait_for_nodes()
    try:
        yield RayRuntime(address, (HEAD_NODE[0], OTHER_NODE[0]), cluster)
        deadline = time.monotonic() + 30
        while (live_actors() or live_placement_groups()) and time.monotonic() < deadline:
            time.sleep(0.2)  # ray.kill and removal are asynchronous
        leaked = live_actors(), live_placement_groups()
        assert leaked == ([], []), f"leaked actors / placement groups: {leaked}"
    finally:
        shutdown_ray()
        cluster.shutdown()
