"""The prefix index: which live worker group holds how long a prefix of a block-hash chain.

Groups write (`IndexWriter`, through an `IndexPublisher`), routers read (`IndexReader`). The
backends: `InMemoryPrefixIndex` (one process) and `RedisPrefixIndex` (a cluster); a router
reads Redis through `MirroredPrefixIndex` (a local copy fed by Redis's change log) behind a
`FailoverReader` (this process's own index while Redis is out of reach).
"""

from cluster.index.base import IndexReader, IndexWriter, PrefixIndex
from cluster.index.failover import FailoverReader
from cluster.index.group_publisher import GroupPublisher
from cluster.index.memory import InMemoryPrefixIndex
from cluster.index.mirror import MirroredPrefixIndex
from cluster.index.publish_thread import PublisherThread
from cluster.index.publisher import IndexPublisher, PublisherConfig, republish
from cluster.index.redis_index import RedisPrefixIndex
from cluster.index.types import (
    GroupMatch,
    IndexHealth,
    IndexUnavailableError,
    InventoryStats,
    Matches,
    PendingWrite,
    PrefixIndexConfig,
    PrefixIndexError,
    StaleEpochError,
    check_name,
    touched_ids,
)

__all__ = [
    "FailoverReader",
    "GroupMatch",
    "GroupPublisher",
    "IndexHealth",
    "IndexPublisher",
    "IndexReader",
    "IndexUnavailableError",
    "IndexWriter",
    "InMemoryPrefixIndex",
    "InventoryStats",
    "Matches",
    "MirroredPrefixIndex",
    "PendingWrite",
    "PrefixIndex",
    "PrefixIndexConfig",
    "PrefixIndexError",
    "PublisherConfig",
    "PublisherThread",
    "RedisPrefixIndex",
    "StaleEpochError",
    "check_name",
    "republish",
    "touched_ids",
]
