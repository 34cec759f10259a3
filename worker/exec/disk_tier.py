"""A rank's disk tier under its host tier: one file per block, named by the block's hash.

A block the host tier evicts is demoted here (written from its host slot); a prefix found
here is fetched back into host slots, then loaded into the pool as a host hit. Every file
carries the block's hash, its length and a CRC32 of its bytes, and is written to a temporary
name, then renamed, so that a reader sees a whole file or none; a file that is missing, short,
of another hash or whose checksum fails is a miss (and is removed), never KV. A write that
fails (the disk full) leaves no file: a later fetch of that block is a miss, with one warning.

Fetches are synchronous in this version: the engine's thread waits for the reads before it
admits the request whose prefix they hold (between two steps), and a tensor-parallel group
agrees on the leading blocks that every rank read whole (the smallest count over the ranks).

The directory, `<kv_disk_dir>/<fingerprint digest>/rank<r>`, is locked by its owner
(`flock`); what an earlier owner left in it is removed at start-up.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import zlib
from pathlib import Path

import torch

from worker.exec.host_tier import HostTier

log = logging.getLogger(__name__)

_MAGIC = b"PFKV"
_HEADER = struct.Struct("<4sI16sQI")  # magic, version, block hash, payload bytes, crc32
_VERSION = 1


class DiskDirectoryInUse(RuntimeError):
    """Another process owns the tier's directory."""


def disk_directory(root: str | os.PathLike, fingerprint: bytes, rank: int) -> Path:
    """This rank's directory under `root`, one per model fingerprint (model, dtypes, block size)."""
    digest = hashlib.blake2b(fingerprint, digest_size=8).hexdigest()
    return Path(root) / digest / f"rank{rank}"


class DiskTier:
    """Block files in one locked directory, read into and written from a host tier's slots."""

    def __init__(self, directory: Path, host: HostTier) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.host = host
        self._lock = open(directory / "lock", "a+b")  # noqa: SIM115  (held for the tier's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DiskDirectoryInUse(f"KV disk directory {directory} is in use by another process") from None
        for stale in directory.glob("*.kv*"):  # an earlier owner's blocks (hashed under its key)
            stale.unlink(missing_ok=True)
        self.bytes_written = 0
        self.bytes_read = 0
        self.failed_reads = 0
        self.failed_writes = 0

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
            tmp.unlink(missing_ok=True)
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
        try:
            data = path.read_bytes()
        except OSError:
            self.failed_reads += 1
            return False
        if not self._valid(data, block_hash):
            path.unlink(missing_ok=True)
            self.failed_reads += 1
            return False
        at = _HEADER.size
        for t in self.host.host_tensors:
            row = t[slot]
            n = row.numel()
            row.copy_(torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8).view(row.shape))
            at += n
        self.bytes_read += len(data)
        return True

    def _valid(self, data: bytes, block_hash: bytes) -> bool:
        if len(data) < _HEADER.size:
            return False
        magic, version, stored, length, crc = _HEADER.unpack_from(data, 0)
        payload = memoryview(data)[_HEADER.size :]
        return (
            magic == _MAGIC
            and version == _VERSION
            and stored == block_hash
            and length == len(payload) == self.host.block_bytes
            and zlib.crc32(payload) == crc
        )

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
            self.path(h).unlink(missing_ok=True)

    def close(self) -> None:
        self._lock.close()
