"""How a Ray-placed group is placed and watched (`RayGroupConfig`), and the checks made before
anything is placed: a tensor-parallel size the model's heads split over, a CPU binding per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.planner import local_kv_heads


@dataclass(frozen=True)
class RayGroupConfig:
    """How a group is placed and watched; the engine's own options stay in EngineConfig."""

    tensor_parallel_size: int = 1
    cpus_per_rank: float = 1.0  # Ray CPUs reserved per rank (the driving thread is light)
    bundle_resources: dict[str, float] = field(default_factory=dict)  # e.g. a node's label
    collective_timeout_s: float = 60.0  # a rank silent this long is dead or hung
    heartbeat_s: float = 1.0  # idle groups exchange a heartbeat this often
    start_timeout_s: float = 600.0  # placement, process start, weights, pool
    status_timeout_s: float = 5.0  # rank 0 must answer a status call within this
    # CPU cores per rank, ranks separated by "|": "0|1", "0-15|16-31" (each rank's process and
    # threads are bound to its cores, so ranks do not steal each other's; like NUMA binding
    # of a GPU rank). None: the OS schedules them anywhere.
    cpu_binding: str | None = None
    # The address whose interface carries the group's collectives and step streams. The ranks
    # share a node (STRICT_PACK), so loopback serves; name another only where it must.
    rendezvous_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("cpus_per_rank", "collective_timeout_s", "heartbeat_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cpu_binding is not None:
            parse_cpu_binding(self.cpu_binding, self.tensor_parallel_size)
        if self.heartbeat_s >= self.collective_timeout_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be below collective_timeout_s "
                f"({self.collective_timeout_s}), or idle ranks would time out"
            )


def parse_cpu_binding(text: str, ranks: int) -> list[frozenset[int]]:
    """Each rank's cores from "0-3|4-7" (ranges and commas within a rank)."""
    parts = text.split("|")
    if len(parts) != ranks:
        raise ValueError(f"cpu_binding {text!r} names {len(parts)} rank(s); the group has {ranks}")
    out = []
    for part in parts:
        cores: set[int] = set()
        try:
            for item in part.split(","):
                lo, _, hi = item.strip().partition("-")
                cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"cpu_binding {text!r}: {part!r} is not a list of cores like 0-3,8") from None
        out.append(frozenset(cores))
    return out


def check_tensor_parallel(model_dir: str, tp: int) -> None:
    """Refuse, before placing anything, a tp that the model's heads cannot be split over."""
    from worker.model.model_loader import read_model_config  # (torch: not in a router's imports)

    mc = read_model_config(model_dir)
    if mc.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {mc.num_heads} attention "
            f"heads; choose a divisor of {mc.num_heads}"
        )
    try:
        local_kv_heads(mc.num_kv_heads, tp)
    except ValueError as e:
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split the model's {mc.num_kv_heads} KV heads: "
            f"{e} (tp must divide the KV heads, or be a multiple of them so that each rank "
            f"holds one replicated head)"
        ) from None
