"""A router's view of the groups a supervisor keeps alive (cluster/ray/supervisor.py).

`GroupDirectory` reads the supervisor's `groups()` about once a second and keeps one
`RayGroup` handle (cluster/ray/group.py) per running group generation, so that a router follows
groups coming, going, draining and being replaced without a restart; each change is handed to
`on_change` with the new list of handles. A router notices a group's death on its own handle
first (its output stream fails, its streams resume elsewhere); the directory then drops the
handle and, once the supervisor has a replacement serving, attaches to it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence

from cluster.group import GroupHandle
from cluster.index import IndexWriter
from cluster.ray.group import RayGroup
from cluster.ray.runtime import ray
from cluster.ray.supervisor import GroupInfo, GroupsSpec

log = logging.getLogger(__name__)

RUNNING = ("serving", "draining")


def new_subscriber() -> str:
    """A name for this router's output streams, unique across routers and restarts."""
    return f"router-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class GroupDirectory:
    """The supervisor's running groups as this router's handles; see the module docstring."""

    def __init__(
        self,
        supervisor,
        spec: GroupsSpec,
        on_change: Callable[[list[GroupHandle]], None],
        subscriber: str | None = None,
        index: IndexWriter | Sequence[IndexWriter] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        """`index`: where the groups that stream their KV events to this router (`events_to`)
        have them published (an embedded server's own index)."""
        self.supervisor, self.spec = supervisor, spec
        self.subscriber = subscriber or new_subscriber()
        self.index, self.poll_s, self.on_change = index, poll_s, on_change
        self.infos: list[GroupInfo] = []
        self._handles: dict[tuple[str, int], RayGroup] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def handles(self) -> list[RayGroup]:
        return list(self._handles.values())

    def refresh(self, timeout_s: float = 10.0) -> bool:
        """Read the supervisor once and follow it; whether the handles changed."""
        infos = ray.get(self.supervisor.groups.remote(), timeout=timeout_s)
        self.infos = infos
        running = {(i.group_id, i.generation): i for i in infos if i.state in RUNNING and i.rank0}
        changed = False
        for key in [k for k in self._handles if k not in running]:
            self._handles.pop(key).shutdown()  # its streams, if any, resume elsewhere
            changed = True
        for key, info in running.items():
            if key in self._handles:
                continue
            try:
                self._handles[key] = self._attach(info)
            except Exception as e:  # noqa: BLE001  (gone again: the next read retries)
                log.warning("directory: cannot attach to %s: %s", info.group_id, e)
                continue
            changed = True
        if changed:
            self.on_change(self.handles)
        return changed

    def _attach(self, info: GroupInfo) -> RayGroup:
        streams_here = info.events_to is not None and info.events_to == self.subscriber
        handle = RayGroup.attach(
            info.group_id,
            info.rank0,
            self.spec.group_config,
            info.ranks,
            self.subscriber,
            index=self.index if streams_here else None,
        )
        handle.generation, handle.restarts = info.generation, info.restarts
        return handle

    def start(self) -> None:
        """Follow the supervisor on a thread from now on."""
        self._thread = threading.Thread(target=self._follow, name="group-directory", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001  (a supervisor being restarted: keep going)
                log.warning("directory: the supervisor does not answer (%s)", e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for handle in self._handles.values():
            handle.shutdown()
        self._handles.clear()
