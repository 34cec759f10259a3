"""A rank's disk tier under its host tier: one file per block, named by the block's hash.

A block the host tier evicts is demoted here (written from its host slot); a prefix found
here is fetched back into host slots, then loaded into the pool as a host hit. Every file
carries the block's hash, its length and a CRC32 of its bytes, and is written to a temporary
name, then renamed, so that a reader sees a whole file or none; a file that is missing, short,
of another hash or whose checksum fails is a miss (and is removed), never KV. A write that
fails (the disk full) leaves no file: a later fetch of that block is a miss, with one warning.

Fetches run on a reader thread of each rank (`DeviceWorker.fetch_start`), off the step's
path, while the request whose prefix they hold waits in a loading state; a tensor-parallel
group agrees on the leading blocks that every rank read whole (the smallest count over the
ranks) before rank 0 lets any request use them (`DeviceWorker.fetch_wait`). With
`kv_disk_async` False they are made between two steps, the engine's thread waiting.

The directory survives its owner. It is `<kv_disk_dir>/<group>/<digest>/rank<r>` (a group
given no id: `<kv_disk_dir>/<digest>/rank<r>`), the digest keyed by the cluster secret over the
model's fingerprint and the group's size: a block's name (its hash) means the same K/V exactly
under that secret and fingerprint, so a group restarted with both under its id finds its blocks
where it left them, and another group of the node with both can read (never write nor remove)
the blocks a group that is gone left in its directory (`read_shard`). At open the owner locks
it (`flock`), removes torn temporary files, and lists the block files whose header is whole (name, size, magic, version,
hash: no payload read; the checksum is checked when a block is read) as its `inventory`,
oldest first; the block manager then adopts what every rank holds, up to the tier's capacity
(`adopt`). Blocks in sibling directories (another secret or fingerprint, whose owner is gone)
can never be named again and are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.config import CacheConfig
from worker.exec.host_tier import HostTier
from worker.exec.kv_pool import KVLayout

log = logging.getLogger(__name__)

_MAGIC = b"PFKV"
_HEADER = struct.Struct("<4sI16sQI")  # magic, version, block hash, payload bytes, crc32
_VERSION = 1
_BLOCK_FILE = re.compile(r"[0-9a-f]{32}\.kv")  # a 16-byte hash in hex
_TIER_DIR = re.compile(r"[0-9a-f]{16}")  # a digest of `disk_directory`
LOCK_WAIT_S = 5.0  # locked this long: another owner (a predecessor still exiting, or a cleaner, holds it briefly)


class DiskDirectoryInUse(RuntimeError):
    """Another process owns the tier's directory."""


def disk_directory(root: str | os.PathLike, fingerprint: bytes, key: bytes, rank: int, group: str = "") -> Path:
    """This rank's directory under `root` (and the group's own subdirectory, `group`, where
    one is given): one per model fingerprint (model, dtypes, block size, group size) and
    cluster secret `key`, whose digest names it (keyed: it tells nothing of the secret)."""
    digest = hashlib.blake2b(b"kv-disk\x00" + fingerprint, key=key[:64], digest_size=8).hexdigest()
    return Path(root) / group / digest / f"rank{rank}"


def disk_blocks(cache: CacheConfig, layout: KVLayout) -> int:
    """Blocks the disk tier holds: `kv_disk_bytes` over one block's bytes on this rank (every
    rank of a group has the same layout, hence the same count); 0 without a disk tier."""
    return max(1, cache.kv_disk_bytes // layout.block_bytes) if cache.kv_disk_bytes else 0


class DiskTier:
    """Block files in one locked directory, read into and written from a host tier's slots."""

    def __init__(self, directory: Path, host: HostTier, capacity: int, read_delay_s: float = 0.0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.host = host
        self.capacity = capacity  # blocks the tier may hold (`disk_blocks`)
        self._lock = _lock(directory / "lock", LOCK_WAIT_S)
        if self._lock is None:
            raise DiskDirectoryInUse(
                f"KV disk directory {directory} is in use by another process: give each group its own --kv-disk-dir"
            )
        _remove_orphans(directory)
        self.inventory = self._scan()  # whole block files, oldest first
        self.bytes_written = 0
        self.bytes_read = 0
        self.failed_reads = 0
        self.failed_writes = 0
        self.reads = 0  # block files read (whole or not)
        self._counts = threading.Lock()  # (a sibling's files are read on a thread: `read_shard`)
        self.read_delay_s = read_delay_s  # added to each read (`kv_disk_read_delay_s`)

    def _scan(self) -> list[bytes]:
        """The hashes of the block files whose header is whole, by modification time; torn
        (temporary) and invalid files are removed."""
        found = []
        want = _HEADER.size + self.host.block_bytes
        for f in self.directory.iterdir():
            if f.name == "lock":
                continue
            block_hash = bytes.fromhex(f.name[:32]) if _BLOCK_FILE.fullmatch(f.name) else None
            try:
                st = f.stat()
                if block_hash is not None and st.st_size == want and self._header_ok(f, block_hash):
                    found.append((st.st_mtime_ns, block_hash))
                    continue
                f.unlink()
            except OSError:
                continue
        return [h for _, h in sorted(found)]

    def _header_ok(self, f: Path, block_hash: bytes) -> bool:
        with open(f, "rb") as fh:
            head = fh.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return False
        magic, version, stored, length, _ = _HEADER.unpack(head)
        return magic == _MAGIC and version == _VERSION and stored == block_hash and length == self.host.block_bytes

    def adopt(self, agreed: list[bytes]) -> list[bytes]:
        """Keep `agreed` (hashes of the inventory that every rank holds, oldest first), the
        newest `capacity` of them, and remove every other block file; returns those kept."""
        kept = agreed[-self.capacity :] if self.capacity else []
        self.remove(set(self.inventory) - set(kept))
        self.inventory = kept
        return kept

    def path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"

    # ---- demote: host slot -> file ------------------------------------------------------
    def write(self, slot: int, block_hash: bytes) -> bool:
        """The host slot's bytes as the file of `block_hash`, atomically; False on failure."""
        payload = b"".join(t[slot].numpy().tobytes() for t in self.host.host_tensors)
        header = _HEADER.pack(_MAGIC, _VERSION, block_hash, len(payload), zlib.crc32(payload))
        path = self.path(block_hash)
        tmp = path.with_suffix(".kv.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            if not self.failed_writes:
                log.warning("KV disk tier %s: a block could not be written (%s); serving from the host only", path, e)
            self.failed_writes += 1
            return False
        self.bytes_written += len(header) + len(payload)
        return True

    # ---- fetch: file -> host slot -------------------------------------------------------
    def read(self, block_hash: bytes, slot: int) -> bool:
        """Fill the host slot from the file of `block_hash`; False (and the file removed)
        when it is missing, torn, of another block or corrupt."""
        path = self.path(block_hash)
        with self._counts:
            self.reads += 1
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        payload = read_payload(path, block_hash, self.host.block_bytes)
        if payload is None:
            _remove(path)
            self.failed_reads += 1
            return False
        for t, row in self._rows(payload):
            t[slot].copy_(row)
        with self._counts:
            self.bytes_read += _HEADER.size + len(payload)
        return True

    def _rows(self, payload: memoryview) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(host tensor, its row of the block) for each tensor of the host tier, the rows cut
        from a block file's payload (uint8, each of the tensor's row shape)."""
        at = 0
        for t in self.host.host_tensors:
            n = t[0].numel()
            yield t, torch.frombuffer(bytearray(payload[at : at + n]), dtype=torch.uint8).view(t.shape[1:])
            at += n

    def read_shard(self, directory: Path, block_hashes) -> list[torch.Tensor]:
        """The leading blocks of the chain `block_hashes` whose files in `directory` (another
        group's tier of this node, left when it stopped: read only, unlocked, nothing removed)
        are whole, as a pulled shard is (worker/exec/kv_transfer.py): per host tensor, the
        blocks' rows (n, ...) uint8, n possibly 0."""
        payloads = []
        for block_hash in block_hashes:
            if self.read_delay_s:
                time.sleep(self.read_delay_s)
            payload = read_payload(directory / f"{block_hash.hex()}.kv", block_hash, self.host.block_bytes)
            if payload is None:
                break
            payloads.append(payload)
        with self._counts:  # (this may run on a thread beside the step loop's reads)
            self.reads += len(payloads)
            self.bytes_read += len(payloads) * (_HEADER.size + self.host.block_bytes)
        shard = [torch.empty((len(payloads), *t.shape[1:]), dtype=torch.uint8) for t in self.host.host_tensors]
        for i, payload in enumerate(payloads):
            for rows, (_, row) in zip(shard, self._rows(payload), strict=True):
                rows[i].copy_(row)  # (blocks, ...) per host tensor
        return shard

    def fetch(self, fetches: list[tuple[bytes, int]]) -> int:
        """Read a chain's blocks in order into their host slots; the count read whole
        before the first that is not."""
        for i, (block_hash, slot) in enumerate(fetches):
            if not self.read(block_hash, slot):
                return i
        return len(fetches)

    def remove(self, hashes) -> None:
        """Forget blocks: the tier evicted them, or they follow a block that failed."""
        for h in hashes:
            _remove(self.path(h))

    def close(self) -> None:
        self._lock.close()


def read_payload(path: Path, block_hash: bytes, block_bytes: int) -> memoryview | None:
    """The payload of the block file `path` when it is whole: its header's magic, version,
    hash (`block_hash`) and length (`block_bytes`) as expected and its checksum right; None
    when it is missing, torn, of another block or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, version, stored, length, crc = _HEADER.unpack_from(data, 0)
    payload = memoryview(data)[_HEADER.size :]
    if (
        magic == _MAGIC
        and version == _VERSION
        and stored == block_hash
        and length == len(payload) == block_bytes
        and zlib.crc32(payload) == crc
    ):
        return payload
    return None


def _lock(path: Path, wait_s: float):
    """`path` opened and locked (exclusive, `flock`), waiting up to `wait_s`; None when another
    process holds it."""
    f = open(path, "a+b")  # noqa: SIM115  (held for the tier's life)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                return None
            time.sleep(0.05)


def _remove_orphans(directory: Path) -> None:
    """Remove the block files of the sibling tier directories (`<root>/<other digest>/rank*`)
    that no process holds: another secret or fingerprint named them, so no group can read
    them again. Each is locked while its files go (its lock files stay: removing a lock file
    lets two processes lock different files of one name)."""
    mine = directory.parent
    for tier in mine.parent.iterdir():
        if tier == mine or not _TIER_DIR.fullmatch(tier.name) or not tier.is_dir():
            continue
        for rank in tier.glob("rank*"):
            held = _lock(rank / "lock", 0.0) if rank.is_dir() else None
            if held is None:
                continue
            with held:
                files = list(rank.glob("*.kv*"))
                for f in files:
                    f.unlink(missing_ok=True)
            if files:
                log.info("KV disk tier: removed %d blocks of %s (another secret or model)", len(files), rank)


def _remove(path: Path) -> None:
    """Remove a block file if it is there; a disk that refuses (failing, gone, read-only) leaves
    it, as it leaves what it could not write: a miss when read, never wrong KV."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
