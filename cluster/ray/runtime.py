"""Starting or joining the Ray runtime, and asking it what is still alive.

Import Ray through this module: it sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER before Ray loads,
so that a local runtime stays on loopback. `ensure_ray()` with no address always starts a new
local runtime (127.0.0.1, no dashboard, a small object store on CPU); it never joins some
other runtime that happens to run on the machine. With an address it joins that cluster.

A local runtime must be started on the main thread. Ray starts its head processes (gcs_server,
raylet, monitors) with PR_SET_PDEATHSIG=SIGKILL, and Linux sends that signal when the *thread*
that forked them exits, not the process: a runtime started on a short-lived thread dies a few
seconds after that thread ends, while the driver goes on as if nothing happened until it next
needs the object store or the GCS. `ensure_ray` refuses to start one anywhere else.

A local start that times out (Ray gives its raylet 30 s to register with the GCS, a limit it
does not let anyone change, and the GCS 30 s to write its port file; a loaded two-core host
was seen to miss each) is tried again, up to LOCAL_START_ATTEMPTS times, after the processes
the failed attempt started are killed.

Joining a cluster that uses token authentication (what `ray start --head` does wherever a token
exists): when the cluster refuses this process for want of a token, token mode is turned on and
the join tried again, with the token read as Ray documents it, from RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; without one, the error says what to provide.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A Ray call made before `ensure_ray` or after `shutdown_ray` raises instead of starting a
# runtime of its own (with a dashboard, on another thread than the main one).
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import ray  # noqa: E402  (after the environment above)

LOCAL_OBJECT_STORE_BYTES = 200 << 20  # outputs are small; a CPU host needs its memory
LOOPBACK = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
LOCAL_START_ATTEMPTS = 3
# the words of Ray's errors when a head process is late: its raylet registering with the GCS,
# or a process writing the port file Ray waits for (the GCS's, 30 s by default)
START_TIMED_OUT = ("timed out during startup", "Timed out waiting for file")
LOST_POLL_S = 0.25  # how often a graceful stop checks that the local runtime is still there
GCS_PING_S = 1.0  # a live GCS answers a ping at once

logger = logging.getLogger(__name__)


class RayStartError(RuntimeError):
    """The Ray runtime could not be started or joined; the message says what to change."""


def ensure_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    namespace: str | None = None,
) -> str:
    """Join the Ray cluster at `address`, or (None) start a local runtime on loopback with
    `num_cpus` CPUs declared, in `namespace` (where named actors are found: a pagefleet
    cluster's supervisor and groups). Returns the cluster's GCS address. A no-op when
    connected."""
    if not ray.is_initialized():
        if address is not None:
            _join(address, namespace)
        else:
            _start_local(num_cpus, resources, namespace)
    return ray.get_runtime_context().gcs_address


def cluster_namespace(cluster: str) -> str:
    """The Ray namespace of a pagefleet cluster's supervisor, groups and routers."""
    return f"pagefleet-{cluster}"


def _start_local(num_cpus: int | None, resources: dict[str, float] | None, namespace: str | None) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RayStartError(
            "a local Ray runtime must be started on the main thread (Ray's head processes are "
            "killed when the thread that started them exits); call ensure_ray() from the main "
            "thread before starting work on other threads"
        )
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = _child_pids()
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                resources=resources,
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                _node_ip_address=LOOPBACK,
                log_to_driver=False,
                namespace=namespace,
            )
            return
        except Exception as e:
            if not any(m in str(e) for m in START_TIMED_OUT) or attempt == LOCAL_START_ATTEMPTS:
                raise
            killed = _kill_children_except(before)
            logger.warning(
                "the local Ray runtime did not come up (%s); killed the %d processes it "
                "started and trying again (attempt %d of %d)",
                e,
                killed,
                attempt + 1,
                LOCAL_START_ATTEMPTS,
            )


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def _kill_children_except(keep: set[int]) -> int:
    """SIGKILL this process's descendants not in `keep` (what a failed ray.init left: its GCS,
    raylet and their helpers, which would otherwise live on beside the next attempt's), and
    wait for them; returns how many there were."""
    import psutil

    procs = [c for c in psutil.Process().children(recursive=True) if c.pid not in keep]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def _join(address: str, namespace: str | None) -> None:
    """Join as Ray would by default, but in token mode when the cluster's GCS asks for a token
    (Ray turns token mode on by itself only for a local cluster found automatically, never for
    an explicit address, and a cluster without tokens must not be joined in token mode)."""
    token = os.environ.get(AUTH_MODE_ENV, "").lower() == "token"
    if AUTH_MODE_ENV not in os.environ and _gcs_wants_token(address):
        token = _enable_token_if_available()
        if not token:
            raise RayStartError(
                f"the Ray cluster at {address} uses token authentication and this process "
                "has no token: set RAY_AUTH_TOKEN to the cluster's token, RAY_AUTH_TOKEN_PATH "
                "to a file holding it, or copy it to ~/.ray/auth_token (`ray get-auth-token` "
                "on the head prints it)"
            )
    try:
        ray.init(address=address, log_to_driver=False, namespace=namespace)
    except Exception as e:
        if not _caused_by_authentication(e):
            raise
        ray.shutdown()
        mode = "its token was refused" if token else f"{AUTH_MODE_ENV} is not 'token'"
        raise RayStartError(
            f"the Ray cluster at {address} refused this process ({mode}); give the cluster's "
            "own token (`ray get-auth-token` on its head prints it) in RAY_AUTH_TOKEN or "
            f"RAY_AUTH_TOKEN_PATH and leave {AUTH_MODE_ENV} unset or 'token'"
        ) from None


def _gcs_wants_token(address: str) -> bool:
    """Whether the GCS at host:port refuses a client without a token (one quick connection;
    other addresses, such as "auto" or ray://, are left to Ray)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return False
    try:
        from ray._raylet import GcsClient

        GcsClient(address=address)
    except Exception as e:
        return _caused_by_authentication(e)
    return False


def _caused_by_authentication(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, is Ray's AuthenticationError (ray.init
    wraps it in a ConnectionError)."""
    while e is not None:
        if isinstance(e, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _enable_token_if_available() -> bool:
    """Turn on Ray's token mode for this process (and the processes it starts) when a token
    can be found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); returns whether it
    did."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def shutdown_ray() -> None:
    """Disconnect from the runtime, and stop the local one this process started. A lost local
    runtime's head processes (`local_runtime_lost`) are killed first: asked to stop, they would
    each be waited for (they are shutting down already, or hung)."""
    if not ray.is_initialized():
        return
    node = _own_node()
    if node is not None and local_runtime_lost(GCS_PING_S):
        for infos in node.all_processes.values():
            for info in infos:
                if info.process.poll() is None:
                    info.process.kill()
    ray.shutdown()


_lost: object | None = None  # the local runtime (its head node) found lost by local_runtime_lost


class RuntimeLostError(RuntimeError):
    """The local Ray runtime's head processes exited while a call waited on it."""


def get_unless_lost(ref: ray.ObjectRef, timeout_s: float) -> object:
    """`ray.get(ref, timeout=timeout_s)`, given up with RuntimeLostError as soon as the local
    runtime is lost (`local_runtime_lost`) rather than after the timeout: it waits in slices
    of LOST_POLL_S, each of which the owner answers without the GCS."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(LOST_POLL_S, left)))
        if ready:
            return ray.get(ready[0])
        if local_runtime_lost():
            raise RuntimeLostError("the local Ray runtime's GCS or raylet exited")
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"not ready in {timeout_s:g} s")


def local_runtime_lost(ping_s: float = 0.0) -> bool:
    """Whether this process started a local Ray runtime that is going away: its GCS or raylet
    has exited, or (with `ping_s`) the GCS does not answer within `ping_s` seconds. A signal
    sent to the whole process group (`kill -- -PGID`, a process manager stopping the group)
    reaches the runtime's head processes too: the GCS stops answering at once, and it and the
    raylet exit later. A call into the runtime would then wait 60 s for the GCS to
    come back, and end the process. Callers skip the graceful stop: what ran on the runtime
    goes down with it. Once lost, the runtime stays lost (no second ping)."""
    global _lost
    node = _own_node()
    if node is None:  # (joined a cluster, or none: not ours to judge)
        return False
    if _lost is node:
        return True
    dead = any(kind in ("gcs_server", "raylet") for kind, _ in node.dead_processes())
    if dead or (ping_s > 0 and not _gcs_answers(ping_s)):
        _lost = node
    return _lost is node


def _own_node():
    """The head node of the local runtime this process started, or None."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node if node is not None and getattr(node, "head", False) else None


def _gcs_answers(timeout_s: float) -> bool:
    try:
        ray._private.worker.global_worker.gcs_client.internal_kv_get(b"ping", b"pagefleet", timeout=timeout_s)
    except Exception:  # noqa: BLE001  (any failure to answer: an RpcError, a timeout, no client)
        return False
    return True


def live_actors() -> list[dict]:
    """Actors of this cluster that are not dead, from the GCS (works without the dashboard,
    which the state API needs)."""
    from ray._private import state  # the GCS tables behind ray.util.state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]


def live_placement_groups() -> list[dict]:
    """Placement groups that were not removed."""
    table = ray.util.placement_group_table()
    return [pg for pg in table.values() if pg.get("state") != "REMOVED"]


__all__ = [
    "RayStartError",
    "RuntimeLostError",
    "cluster_namespace",
    "ensure_ray",
    "get_unless_lost",
    "live_actors",
    "live_placement_groups",
    "local_runtime_lost",
    "ray",
    "shutdown_ray",
]
