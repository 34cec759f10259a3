"""The worker groups of a router whose groups live on Ray, kept by a supervisor
(cluster/ray/supervisor.py) and followed through a directory (cluster/ray/directory.py).

Two ways to have them: `RayGroups.embedded` starts a supervisor for this server's own groups (a
one-process `pagefleet serve --groups N`: the supervisor and its groups end with the process);
`RayGroups.join` follows the groups of a cluster whose supervisor `pagefleet groups start`
started (a router process, `pagefleet serve --role router`), which outlive any router.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.group import GroupHandle, GroupStatus
from cluster.index import IndexWriter
from cluster.ray.directory import GroupDirectory, new_subscriber
from cluster.ray.runtime import GCS_PING_S, RuntimeLostError, get_unless_lost, local_runtime_lost, ray
from cluster.ray.supervisor import (
    SUPERVISOR_NAME,
    GroupInfo,
    GroupsSpec,
    start_supervisor,
)

log = logging.getLogger(__name__)


class GroupsFailedError(RuntimeError):
    """The groups did not start; the message says why."""


@dataclass
class RayGroups:
    """A supervisor's groups as this router's handles."""

    supervisor: object  # the Supervisor actor
    spec: GroupsSpec
    directory: GroupDirectory
    owned: bool  # this process started the supervisor: it stops it

    @classmethod
    def embedded(cls, spec: GroupsSpec, index: Sequence[IndexWriter], timeout_s: float) -> RayGroups:
        """Start this server's own groups (`spec`; without Redis their KV events stream to
        this router, for `index`) and wait until every one serves."""
        subscriber = new_subscriber()
        if spec.redis_url is None or index:
            from dataclasses import replace

            spec = replace(spec, events_to=subscriber)
        name = f"{SUPERVISOR_NAME}-{uuid.uuid4().hex[:8]}"  # this server's own
        supervisor = start_supervisor(spec, detached=False, name=name)
        directory = GroupDirectory(supervisor, spec, lambda handles: None, subscriber, index)
        groups = cls(supervisor, spec, directory, owned=True)
        try:
            groups.wait_serving(timeout_s)
        except BaseException:
            groups.shutdown()
            raise
        return groups

    @classmethod
    def join(cls, timeout_s: float = 60.0) -> RayGroups:
        """Follow the groups of the cluster this process joined (its Ray namespace is the
        cluster's), once at least one serves."""
        try:
            supervisor = ray.get_actor(SUPERVISOR_NAME)
        except ValueError:
            raise GroupsFailedError(
                f"no supervisor ({SUPERVISOR_NAME}) in Ray namespace "
                f"{ray.get_runtime_context().namespace!r}: start the groups first "
                "(`pagefleet groups start --cluster NAME ...`)"
            ) from None
        spec = ray.get(supervisor.spec_of.remote(), timeout=30)
        directory = GroupDirectory(supervisor, spec, lambda handles: None)
        groups = cls(supervisor, spec, directory, owned=False)
        groups.wait_serving(timeout_s, every=False)
        return groups

    @property
    def handles(self) -> list[GroupHandle]:
        return self.directory.handles

    def wait_serving(self, timeout_s: float, every: bool = True) -> None:
        """Until every declared group serves (`every`) or at least one does; a group that
        fails to start (before any serves, or any with `every`) raises GroupsFailedError."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.directory.refresh()
            infos = self.directory.infos
            serving = [i for i in infos if i.state == "serving"]
            broken = [i for i in infos if i.state in ("restarting", "failed") and i.error]
            if (every and len(serving) == len(infos)) or (not every and serving):
                return
            if broken and (every or not serving):
                raise GroupsFailedError(f"group {broken[0].group_id} did not start: {broken[0].error}")
            if time.monotonic() > deadline:
                states = {i.group_id: i.state for i in infos}
                raise GroupsFailedError(f"the groups did not all serve within {timeout_s} s: {states}")
            time.sleep(0.2)

    def model_facts(self, timeout_s: float = 60.0):
        """The served model as a router needs it, from a serving group's rank 0
        (worker/protocol.py: ModelFacts)."""
        serving = [i for i in self.directory.infos if i.state == "serving" and i.rank0 is not None]
        if not serving:
            raise GroupsFailedError("no group serves: cannot read the model's facts")
        return ray.get(serving[0].rank0.model_facts.remote(), timeout=timeout_s)

    def follow(self, router, loop: asyncio.AbstractEventLoop) -> None:
        """From now on hand the router every change of the groups, on its event loop."""
        self.directory.on_change = lambda handles: loop.call_soon_threadsafe(router.set_groups, handles)
        router.absent_statuses = self.absent_statuses
        self.directory.start()

    def absent_statuses(self) -> list[GroupStatus]:
        """The declared groups that have no running generation (restarting, failed or
        retired), as dead statuses for the cluster's status."""
        return [_status(i) for i in self.directory.infos if i.state not in ("serving", "draining")]

    def shutdown(self) -> None:
        """Stop following the groups, and stop the supervisor this process started (with its
        groups). When the local runtime is lost (a signal to the whole process group reached
        its head processes too), what ran on it goes down with it: nothing is waited for
        (cluster/ray/runtime.py, `local_runtime_lost`)."""
        lost = local_runtime_lost(GCS_PING_S)
        self.directory.close()  # (its thread and handles stop without waiting on the GCS)
        if lost:
            log.warning("the local Ray runtime is shutting down (its GCS does not answer): its groups go with it")
            return
        if self.owned:
            try:
                get_unless_lost(self.supervisor.stop.remote(), 60)
            except RuntimeLostError:
                log.warning("the local Ray runtime went away while its groups were stopping")
                return
            except Exception as e:  # noqa: BLE001  (stopping anyway)
                log.warning("stopping the supervisor: %s", e)
            ray.kill(self.supervisor, no_restart=True)


def _status(info: GroupInfo) -> GroupStatus:
    return GroupStatus(
        group_id=info.group_id,
        alive=False,
        tensor_parallel_size=0,
        devices=(),
        blocks_total=0,
        blocks_free=0,
        blocks_cached=0,
        running=0,
        waiting=0,
        pending_prefill_tokens=0,
        error=info.error,
        state=info.state,
        generation=info.generation,
        restarts=info.restarts,
    )
