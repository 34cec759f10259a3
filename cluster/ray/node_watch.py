"""A rank ends its own process once its node is gone.

When a node's raylet dies, Ray cannot kill the actors it hosted: the old rank of a group went on
running (for minutes, with its model and KV pool in memory) next to the replacement the
supervisor placed elsewhere. Ray's own fate-sharing asks whether the raylet's pid still exists,
which a dead raylet that its parent has not reaped (a zombie) passes. So every rank watches:

- its raylet, every `interval_s`: the process named by `RAY_RAYLET_PID` is gone or a zombie;
- the GCS, every `gcs_every` checks: it has declared this node dead (a raylet cut off from it).

Either ends the rank (`on_gone`, which exits the process). A GCS out of reach is not a verdict:
only its answer that the node is dead is.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from cluster.ray.runtime import ray

log = logging.getLogger(__name__)


def process_gone(pid: int) -> bool:
    """True when `pid` has exited: no such process, or a zombie waiting to be reaped (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X")


def node_declared_dead(node_id: str) -> bool:
    """True when the GCS lists `node_id` as dead; False while alive, unknown or unreachable."""
    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001  (no answer is no verdict)
        return False
    return any(n.get("NodeID") == node_id and not n.get("Alive", True) for n in nodes)


class NodeWatch:
    """A daemon thread that calls `on_gone(reason)` once this process's node is gone."""

    def __init__(
        self,
        node_id: str,
        on_gone: Callable[[str], None],
        interval_s: float = 1.0,
        gcs_every: int = 5,
    ) -> None:
        """`interval_s`: between raylet checks; the GCS is asked every `gcs_every` of them
        (one call per rank every few seconds, whatever the cluster's size)."""
        if not interval_s > 0 or gcs_every < 1:
            raise ValueError(f"need interval_s > 0 and gcs_every >= 1, got {interval_s}, {gcs_every}")
        self.node_id, self.on_gone = node_id, on_gone
        self.interval_s, self.gcs_every = interval_s, gcs_every
        raylet = os.environ.get("RAY_RAYLET_PID")
        self.raylet_pid = int(raylet) if raylet else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagefleet-node-watch", daemon=True)
        self._thread.start()

    def check(self, ask_gcs: bool) -> str | None:
        """Why this node is gone, or None while it is not."""
        if self.raylet_pid is not None and process_gone(self.raylet_pid):
            return f"its raylet (pid {self.raylet_pid}) died"
        if ask_gcs and node_declared_dead(self.node_id):
            return f"the GCS declared node {self.node_id} dead"
        return None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        checks = 0
        while not self._stop.wait(self.interval_s):
            checks += 1
            reason = self.check(ask_gcs=checks % self.gcs_every == 0)
            if reason is not None:
                log.error("rank on node %s: %s; ending this process", self.node_id, reason)
                self.on_gone(reason)
                return
