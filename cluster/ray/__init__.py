"""Worker groups placed on Ray: the runtime (start or join), a group's configuration, its
driver-side handle (`RayGroup`), the actor that hosts each rank, and the output deltas that
cross Ray. Import Ray through `cluster.ray.runtime` (it keeps a local runtime on loopback)."""
