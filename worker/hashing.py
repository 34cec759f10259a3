"""Block hashes: one keyed chain over every earlier token and everything that changes K/V.

Block i's hash is BLAKE2b-128, keyed with the cluster secret, over block i-1's hash and block i's
token ids. The chain's root covers the model fingerprint (model id and revision, dtype, KV-cache
dtype, block size, weight dtype), the adapter and the tenant's cache salt, so a block's name
depends on all of them. The router and every group call this same code with the same secret, so they agree across
processes; without the secret nobody can craft colliding prompts. Python's `hash()` is never used.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DIGEST_SIZE = 16  # 128-bit block hashes
_MAX_KEY = 64  # BLAKE2b key limit
_TOKEN_TYPECODE = "I"  # uint32: any vocabulary fits
assert array(_TOKEN_TYPECODE).itemsize == 4


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything about the model and the cache layout that changes the K/V values of a block."""

    model_id: str
    revision: str = ""
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    weight_dtype: str = "float"  # float, int8 or int4: quantized weights give other K/V

    def encode(self) -> bytes:
        fields = (
            self.model_id,
            self.revision,
            self.dtype,
            self.kv_cache_dtype,
            str(self.block_size),
            self.weight_dtype,
        )
        return _encode_fields("model", *fields)


def cache_namespace(cache_salt: str | None = None, tenant: str | None = None) -> str | None:
    """The salt a request's blocks are keyed by, from a client's raw `cache_salt` or a
    `tenant` (at most one): each kind in its own namespace ("salt\x00..." and "tenant\x00..."),
    so that no salt a client writes can name a tenant's blocks, whatever the two values are.
    None when neither is given (the shared namespace)."""
    if cache_salt and tenant:
        raise ValueError("give cache_salt or tenant, not both")
    if tenant:
        return f"tenant\x00{tenant}"
    if cache_salt:
        return f"salt\x00{cache_salt}"
    return None


class BlockHasher:
    """Computes the hash chains of one model under one cluster secret."""

    def __init__(self, secret: bytes, fingerprint: ModelFingerprint) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("cluster secret must be non-empty bytes")
        # Longer secrets are folded to the BLAKE2b key size.
        self._key = secret if len(secret) <= _MAX_KEY else hashlib.blake2b(secret).digest()
        self.fingerprint = fingerprint
        self.block_size = fingerprint.block_size
        self._model_key = fingerprint.encode()
        self._keyed = hashlib.blake2b(key=self._key, digest_size=DIGEST_SIZE)

    def root(self, adapter_id: str | None = None, cache_salt: str | None = None) -> bytes:
        """The chain's seed: the parent of block 0 for this model, adapter and tenant."""
        data = self._model_key + _encode_fields("extra", adapter_id or "", cache_salt or "")
        return hashlib.blake2b(data, key=self._key, digest_size=DIGEST_SIZE).digest()

    def hash_blocks(self, token_ids: Sequence[int], parent: bytes, start_block: int = 0) -> list[bytes]:
        """Hashes of the full blocks of `token_ids` from `start_block` on.

        `parent` is the hash of block `start_block - 1`, or `root(...)` when starting at 0.
        A trailing partial block is not hashed.
        """
        bs = self.block_size
        end_block = len(token_ids) // bs
        if end_block <= start_block:
            return []
        try:
            raw = memoryview(array(_TOKEN_TYPECODE, token_ids[start_block * bs : end_block * bs]))
        except OverflowError as e:
            raise ValueError("token ids must be in [0, 2**32)") from e
        raw, step = raw.cast("B"), bs * 4
        keyed = self._keyed  # copying a keyed state skips the key's compression per block
        hashes = []
        for offset in range(0, len(raw), step):
            h = keyed.copy()
            h.update(parent)
            h.update(raw[offset : offset + step])
            parent = h.digest()
            hashes.append(parent)
        return hashes

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        adapter_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """The whole chain of a prompt's full blocks."""
        return self.hash_blocks(token_ids, self.root(adapter_id, cache_salt))


class HashChain(Sequence[bytes]):
    """A chain of block hashes held as one bytes object, `len(self) * DIGEST_SIZE` long.

    The router builds a 2048-block chain by joining its memoised segments (one 32 KiB copy)
    instead of a list of 2048 hash objects (one reference each: benchmarks/RESULTS.md), and it
    reads only ~100 of them (the probes); a hash is sliced out when read. Iterating, or reading
    a slice with a step, builds the list once and keeps it. Equal to any sequence of the same
    hashes; pickles as its bytes."""

    __slots__ = ("blob", "_list", "_at")

    def __init__(self, blob: bytes) -> None:
        if len(blob) % DIGEST_SIZE:
            raise ValueError(f"a hash chain's bytes must be a multiple of {DIGEST_SIZE} long")
        self.blob = blob
        self._list: list[bytes] | None = None
        self._at: tuple[tuple[int, ...], tuple[bytes, ...]] | None = None  # the last `at`

    def __len__(self) -> int:
        return len(self.blob) // DIGEST_SIZE

    def __getitem__(self, i):
        blob, w = self.blob, DIGEST_SIZE
        if isinstance(i, slice):
            start, stop, step = i.indices(len(blob) // w)
            if step != 1:
                return self.as_list()[i]
            return [blob[j : j + w] for j in range(start * w, stop * w, w)]
        n = len(blob) // w
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("hash chain index out of range")
        return blob[i * w : i * w + w]

    def __iter__(self):
        return iter(self.as_list())

    def as_list(self) -> list[bytes]:
        """Every hash, oldest first (built once)."""
        if self._list is None:
            blob, w = self.blob, DIGEST_SIZE
            self._list = [blob[j : j + w] for j in range(0, len(blob), w)]
        return self._list

    def at(self, positions: tuple[int, ...]) -> tuple[bytes, ...]:
        """The hashes at `positions`, without building the list; the answer for the last
        `positions` asked is kept (a router reads a chain's probes several times)."""
        if self._at is not None and self._at[0] == positions:  # (the same tuple, mostly)
            return self._at[1]
        got = _slicer(positions)(self.blob) if positions else ()
        if len(positions) == 1:
            got = (got,)
        self._at = (positions, got)
        return got

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashChain):
            return self.blob == other.blob
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and self.as_list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __reduce__(self):
        return HashChain, (self.blob,)

    def __repr__(self) -> str:
        return f"HashChain({len(self)} blocks)"


@functools.lru_cache(maxsize=1024)
def _slicer(positions: tuple[int, ...]) -> Callable[[bytes], tuple[bytes, ...] | bytes]:
    """One C call that slices the hashes at `positions` out of a chain's bytes."""
    w = DIGEST_SIZE
    return operator.itemgetter(*(slice(p * w, p * w + w) for p in positions))


def _encode_fields(tag: str, *fields: str) -> bytes:
    # Length-prefixed so that ("ab", "c") and ("a", "bc") never encode alike.
    out = bytearray(tag.encode())
    for f in fields:
        b = f.encode()
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)
