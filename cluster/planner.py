"""Capacity planning for the paged KV cache (seed 000, sections 02-06).

The model, per token and per device:

    bytes_per_token = 2 x layers x kv_heads x head_dim x bytes_per_element      # K and V

A request of T cached tokens holds T x bytes_per_token. A contiguous cache reserves
`max_len` tokens per request up front; a paged cache allocates blocks of `block_size` tokens
on demand, so a request holds ceil(T / block_size) blocks and wastes only its tail block's
empty slots. The pool is what remains of a device after weights, workspace and reserve
(`device_memory - reserved`); it holds `pool_bytes // block_bytes` blocks. Requests that share
a computed prefix hold it once.

KV dtypes and their scales:

- float32 (4 bytes), bfloat16 and float16 (2 bytes): no scales.
- fp8 (1 byte, e4m3 or e5m2): one float32 scale per layer for K and one for V, per tensor.
  They do not grow with tokens, so they are not in `bytes_per_token`; they take
  2 x layers x 4 bytes of every device's pool (`pool_scale_bytes`). The engine serves e4m3.
- int8 (1 byte): a float16 scale per token per KV head, for K and for V, held beside the
  codes, so bytes_per_token = 2 x layers x kv_heads x (head_dim x 1 + 2).

Tensor parallelism: each device holds only its KV heads. With kv_heads >= tp, kv_heads must
be divisible by tp and each device holds kv_heads / tp of them. With fewer KV heads than
devices, heads are replicated: tp must be a multiple of kv_heads and each device holds one.
All devices share one block table, so a block is the same number of tokens everywhere and
per-device figures use the local head count.

Tiers: the device pool, a host-memory tier of `kv_host_bytes` and a disk tier of `kv_disk_bytes`
under it, each per device, hold whole blocks of the device's shard (the engine sizes them as
`bytes // per_device_block_bytes`, worker/exec/host_tier.py); a tier's capacity in tokens is its
blocks x block_size, and in documents of D tokens, its blocks over the blocks of one (a document
held whole, its tail block included). A group's tiers hold the same tokens on every device.

Pure Python (no torch). The engine's pool (worker/exec/kv_pool.py) counts the same bytes from its
tensors' dtypes, and tests hold the two equal byte for byte for every KV dtype. Block-table
bookkeeping is not counted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from worker.config import parse_size  # noqa: F401  (re-exported: the planner's sizes)
from worker.model_source import is_gguf

# Canonical KV dtype name -> bytes per stored element.
_KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
_KV_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}
# Per-token, per-KV-head scale bytes for K (and again for V): int8's float16 scale.
_TOKEN_SCALE_BYTES = {"int8": 2}
# Per-layer, per-tensor scale bytes for K (and again for V): fp8's float32 scale.
_TENSOR_SCALE_BYTES = {"fp8": 4}


def kv_dtype_name(name: str) -> str:
    """The canonical KV dtype name for `name` (aliases such as "bf16", "torch.float16")."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _KV_DTYPE_ALIASES.get(key, key)
    if key not in _KV_DTYPE_BYTES:
        known = ", ".join(_KV_DTYPE_BYTES)
        raise ValueError(f"kv_dtype: unknown KV cache dtype {name!r} (known: {known})")
    return key


def kv_dtype_bytes(name: str) -> int:
    """Bytes of one stored K or V element of KV dtype `name` (scales not included)."""
    return _KV_DTYPE_BYTES[kv_dtype_name(name)]


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads held by each device of a `tp`-way group (1 when heads are replicated)."""
    _check_positive("kv_heads", kv_heads)
    _check_positive("tp", tp)
    if kv_heads >= tp:
        if kv_heads % tp:
            raise ValueError(f"kv_heads={kv_heads} is not divisible by tp={tp}")
        return kv_heads // tp
    if tp % kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of kv_heads={kv_heads} (needed to replicate KV heads)")
    return 1


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str, tp: int = 1) -> int:
    """K and V bytes of one token over all layers; per device when tp > 1 (int8 scales included)."""
    _check_positive("layers", layers)
    _check_positive("head_dim", head_dim)
    heads = local_kv_heads(kv_heads, tp)
    dtype = kv_dtype_name(kv_dtype)
    per_head = head_dim * _KV_DTYPE_BYTES[dtype] + _TOKEN_SCALE_BYTES.get(dtype, 0)
    return 2 * layers * heads * per_head


def block_bytes(layers: int, kv_heads: int, head_dim: int, kv_dtype: str, block_size: int, tp: int = 1) -> int:
    """Bytes of one block of `block_size` tokens; per device when tp > 1."""
    _check_positive("block_size", block_size)
    return block_size * bytes_per_token(layers, kv_heads, head_dim, kv_dtype, tp)


def blocks_for_tokens(n: int, block_size: int) -> int:
    """Blocks needed to hold `n` tokens: ceil(n / block_size)."""
    _check_non_negative("n", n)
    _check_positive("block_size", block_size)
    return -(-n // block_size)


def tail_slots(n: int, block_size: int) -> int:
    """Unused token slots in the last block of a request of `n` tokens."""
    return blocks_for_tokens(n, block_size) * block_size - n


def pool_scale_bytes(layers: int, kv_dtype: str) -> int:
    """Per-tensor scale bytes every device keeps outside the blocks (fp8: K and V per layer)."""
    _check_positive("layers", layers)
    return 2 * layers * _TENSOR_SCALE_BYTES.get(kv_dtype_name(kv_dtype), 0)


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1: "1.375 MiB", "7 GiB"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class KVShape:
    """The shape of a model's KV cache: what the planner and the engine's pool are sized by."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str = "bfloat16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            _check_positive(name, getattr(self, name))
        # Canonical name, so equal shapes compare equal whatever alias they were given.
        object.__setattr__(self, "kv_dtype", kv_dtype_name(self.kv_dtype))

    def local_kv_heads(self, tp: int = 1) -> int:
        """KV heads on each device of a `tp`-way group."""
        return local_kv_heads(self.kv_heads, tp)

    def bytes_per_token(self, tp: int = 1) -> int:
        """Bytes of one token's K and V over all layers, on one device of a `tp`-way group."""
        return bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.kv_dtype, tp)

    def block_bytes(self, tp: int = 1) -> int:
        """Bytes of one block on one device of a `tp`-way group."""
        return self.block_size * self.bytes_per_token(tp)

    def pool_scale_bytes(self) -> int:
        """Per-tensor scale bytes each device keeps outside its blocks."""
        return pool_scale_bytes(self.layers, self.kv_dtype)

    def num_blocks(self, pool_bytes: int, tp: int = 1) -> int:
        """Blocks that fit in `pool_bytes` of one device, after the per-tensor scales."""
        _check_non_negative("pool_bytes", pool_bytes)
        return max(pool_bytes - self.pool_scale_bytes(), 0) // self.block_bytes(tp)

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping | str | Path,
        kv_dtype: str | None = None,
        block_size: int = 16,
    ) -> KVShape:
        """The KV shape of a Hugging Face config (a dict, a config.json, or a model directory),
        or of a .gguf file's metadata, read as the engine reads it.

        `kv_dtype` defaults to the config's `torch_dtype` (or `dtype`), else float32 as in
        transformers (and as the engine runs a dequantized GGUF file).
        """
        if not isinstance(config, Mapping) and is_gguf(config):
            from worker.model.model_loader import read_model_config  # torch: only for a .gguf file

            mc = read_model_config(config)
            dtype = kv_dtype or mc.dtype
            return cls(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, block_size)
        cfg = _load_config(config)
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            cfg = cfg["text_config"]  # multimodal wrappers keep the language model inside
        layers = _require(cfg, "num_hidden_layers")
        heads = _require(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or _require(cfg, "hidden_size") // heads
        dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(layers, kv_heads, head_dim, dtype, block_size)


@dataclass(frozen=True)
class RequestPlan:
    """One request of `tokens` cached tokens under paged allocation."""

    tokens: int
    bytes: int  # tokens x bytes_per_token: the live K/V state
    blocks: int  # ceil(tokens / block_size)
    allocated_bytes: int  # blocks x block_bytes
    tail_slots: int  # empty token slots in the last block
    tail_waste_bytes: int  # tail_slots x bytes_per_token


@dataclass(frozen=True)
class TierPlan:
    """What one tier of a group holds (per device: each device holds its shard of every block)."""

    medium: str  # "device", "host" or "disk" (worker/kv_events.py)
    bytes: int  # the tier's bytes on one device (the device's: its pool)
    blocks: int
    tokens: int  # blocks x block_size
    documents: int  # documents of `Plan.document_tokens` tokens held whole


@dataclass(frozen=True)
class Plan:
    """A capacity plan. Request and total figures are whole-model (all KV heads, tp=1);
    `per_device_*`, the pool and `max_sequences` are for one device of the tp group."""

    shape: KVShape
    tp: int
    local_kv_heads: int
    bytes_per_token: int
    block_bytes: int
    per_device_bytes_per_token: int
    per_device_block_bytes: int
    requests: tuple[RequestPlan, ...]
    total_tokens: int
    total_bytes: int
    total_allocated_bytes: int
    tail_waste_bytes: int
    max_len: int
    contiguous_reserved_bytes: int  # len(requests) x max_len x bytes_per_token
    shared_prefix: int
    shared_prefix_savings_bytes: int
    total_with_shared_prefix_bytes: int
    device_memory: int | None  # None: no device given, so no pool figures
    reserved: int
    pool_bytes: int | None  # device_memory - reserved
    pool_scale_bytes: int
    pool_blocks: int | None
    blocks_per_sequence: int  # blocks of one max_len sequence
    max_sequences: int | None  # max_len sequences that fit in one device's pool
    document_tokens: int  # the document length `tiers` counts in (default: max_len)
    blocks_per_document: int
    # the device pool (when device_memory is given), then the host and disk tiers (when given)
    tiers: tuple[TierPlan, ...] = ()

    def to_dict(self) -> dict:
        """Plain, JSON-ready fields."""
        return asdict(self)

    def to_json(self) -> str:
        """One JSON object."""
        return json.dumps(self.to_dict(), sort_keys=False)


def plan(
    shape: KVShape,
    lengths: Sequence[int] = (),
    *,
    max_len: int | None = None,
    shared_prefix: int = 0,
    device_memory: int | str | None = None,
    reserved: int | str = 0,
    tp: int = 1,
    kv_host_bytes: int | str | None = None,
    kv_disk_bytes: int | str | None = None,
    document_tokens: int | None = None,
) -> Plan:
    """Plan `lengths` (cached tokens per request) on `shape` for a `tp`-way group.

    `max_len` (default: the longest length) sizes the contiguous reservation and the
    sequences counted by `max_sequences`. A `shared_prefix` of P tokens is held once by the
    requests at least P tokens long. `device_memory` and `reserved` are per device, as are
    the host and disk tiers' `kv_host_bytes` and `kv_disk_bytes`; `tiers` counts each tier's
    capacity in tokens and in documents of `document_tokens` (default: max_len).
    """
    lengths = tuple(lengths)
    for n in lengths:
        _check_positive("lengths", n)
    max_len = _resolve_max_len(lengths, max_len)
    _check_non_negative("shared_prefix", shared_prefix)
    if shared_prefix > max_len:
        raise ValueError(f"shared_prefix={shared_prefix} exceeds max_len={max_len}")
    bpt = shape.bytes_per_token()
    requests = tuple(_request(n, shape.block_size, bpt) for n in lengths)
    sharers = sum(1 for n in lengths if n >= shared_prefix) if shared_prefix else 0
    savings = max(sharers - 1, 0) * shared_prefix * bpt
    total = sum(r.bytes for r in requests)
    pool = _pool_bytes(device_memory, reserved)
    seq_blocks = blocks_for_tokens(max_len, shape.block_size)
    pool_blocks = None if pool is None else shape.num_blocks(pool, tp)
    doc = max_len if document_tokens is None else document_tokens
    _check_positive("document_tokens", doc)
    tiers = _tiers(shape, tp, pool, pool_blocks, kv_host_bytes, kv_disk_bytes, blocks_for_tokens(doc, shape.block_size))
    return Plan(
        shape=shape,
        tp=tp,
        local_kv_heads=shape.local_kv_heads(tp),
        bytes_per_token=bpt,
        block_bytes=shape.block_bytes(),
        per_device_bytes_per_token=shape.bytes_per_token(tp),
        per_device_block_bytes=shape.block_bytes(tp),
        requests=requests,
        total_tokens=sum(lengths),
        total_bytes=total,
        total_allocated_bytes=sum(r.allocated_bytes for r in requests),
        tail_waste_bytes=sum(r.tail_waste_bytes for r in requests),
        max_len=max_len,
        contiguous_reserved_bytes=len(lengths) * max_len * bpt,
        shared_prefix=shared_prefix,
        shared_prefix_savings_bytes=savings,
        total_with_shared_prefix_bytes=total - savings,
        device_memory=None if device_memory is None else parse_size(device_memory),
        reserved=parse_size(reserved),
        pool_bytes=pool,
        pool_scale_bytes=shape.pool_scale_bytes(),
        pool_blocks=pool_blocks,
        blocks_per_sequence=seq_blocks,
        max_sequences=None if pool_blocks is None else pool_blocks // seq_blocks,
        document_tokens=doc,
        blocks_per_document=blocks_for_tokens(doc, shape.block_size),
        tiers=tiers,
    )


def _tiers(
    shape: KVShape,
    tp: int,
    pool: int | None,
    pool_blocks: int | None,
    kv_host_bytes: int | str | None,
    kv_disk_bytes: int | str | None,
    doc_blocks: int,
) -> tuple[TierPlan, ...]:
    """The device pool's, the host's and the disk's capacity, for those given."""
    if kv_disk_bytes is not None and kv_host_bytes is None:
        raise ValueError("kv_disk_bytes: a disk tier sits under a host tier: give kv_host_bytes too")
    block, bs = shape.block_bytes(tp), shape.block_size
    sized = [] if pool is None else [("device", pool, pool_blocks)]
    for medium, given in (("host", kv_host_bytes), ("disk", kv_disk_bytes)):
        if given is not None:
            n = parse_size(given)
            if n < block:
                raise ValueError(f"kv_{medium}_bytes={n} holds no block of {block} bytes")
            sized.append((medium, n, n // block))
    return tuple(TierPlan(m, n, blocks, blocks * bs, blocks // doc_blocks) for m, n, blocks in sized)


def _request(tokens: int, block_size: int, bpt: int) -> RequestPlan:
    blocks = blocks_for_tokens(tokens, block_size)
    slots = tail_slots(tokens, block_size)
    return RequestPlan(
        tokens=tokens,
        bytes=tokens * bpt,
        blocks=blocks,
        allocated_bytes=blocks * block_size * bpt,
        tail_slots=slots,
        tail_waste_bytes=slots * bpt,
    )


def _resolve_max_len(lengths: tuple[int, ...], max_len: int | None) -> int:
    if max_len is None:
        if not lengths:
            raise ValueError("max_len: give max_len or at least one length")
        return max(lengths)
    _check_positive("max_len", max_len)
    if lengths and max_len < max(lengths):
        raise ValueError(f"max_len={max_len} is shorter than the longest length {max(lengths)}")
    return max_len


def _pool_bytes(device_memory: int | str | None, reserved: int | str) -> int | None:
    reserved = parse_size(reserved)
    if device_memory is None:
        return None
    device_memory = parse_size(device_memory)
    if reserved > device_memory:
        raise ValueError(f"reserved={reserved} bytes exceeds device_memory={device_memory} bytes")
    return device_memory - reserved


def _load_config(config: Mapping | str | Path) -> Mapping:
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config: no Hugging Face config.json at {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"config: cannot read {str(path)!r}: {err}") from err
    if not isinstance(data, Mapping):
        raise ValueError(f"config: {str(path)!r} is not a JSON object")
    return data


def _require(cfg: Mapping, key: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"config: missing {key!r}")
    return cfg[key]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
