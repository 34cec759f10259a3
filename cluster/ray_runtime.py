"""Starting or joining the Ray runtime, and asking it what is still alive.

Import Ray through this module: it sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER before Ray loads,
so that a local runtime stays on loopback. `ensure_ray()` with no address always starts a new
local runtime (127.0.0.1, no dashboard, a small object store on CPU); it never joins some
other runtime that happens to run on the machine. With an address it joins that cluster.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402  (after the environment above)

LOCAL_OBJECT_STORE_BYTES = 200 << 20  # outputs are small; a CPU host needs its memory
LOOPBACK = "127.0.0.1"


def ensure_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
) -> str:
    """Join the Ray cluster at `address`, or (None) start a local runtime on loopback with
    `num_cpus` CPUs declared. Returns the cluster's GCS address. A no-op when connected."""
    if not ray.is_initialized():
        if address is not None:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                resources=resources,
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                _node_ip_address=LOOPBACK,
                log_to_driver=False,
            )
    return ray.get_runtime_context().gcs_address


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def live_actors() -> list[dict]:
    """Actors of this cluster that are not dead, from the GCS (works without the dashboard,
    which the state API needs)."""
    from ray._private import state  # the GCS tables behind ray.util.state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]


def live_placement_groups() -> list[dict]:
    """Placement groups that were not removed."""
    table = ray.util.placement_group_table()
    return [pg for pg in table.values() if pg.get("state") != "REMOVED"]


__all__ = ["ensure_ray", "live_actors", "live_placement_groups", "ray", "shutdown_ray"]
