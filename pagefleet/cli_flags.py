"""What the `pagefleet` commands' flags share: argument types (argparse turns their errors into
exit code 2) and the engine's flags, which `serve` and `groups start` both take."""

from __future__ import annotations

import argparse
from typing import Any

from cluster.planner import parse_size
from worker.config import KV_CACHE_DTYPES, WEIGHT_DTYPES

# engine options given as positive integers, each as --NAME with dashes
ENGINE_FLAGS = ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_waiting")
# the KV tiers under each device's pool: byte sizes (24GiB, 512MB, 4096), a directory, whether
# disk reads run off the step's path, and a delay added to each disk read (a slower disk emulated)
TIER_FLAGS = ("kv_host_bytes", "kv_disk_bytes", "kv_disk_dir", "kv_disk_async", "kv_disk_read_delay_s")
DTYPE_FLAGS = ("dtype", "weight_dtype", "kv_cache_dtype")


def add_engine_flags(parser: argparse.ArgumentParser, dtypes: bool) -> None:
    """The engine's flags in a group of their own, the KV tiers' among them; with `dtypes`,
    --dtype, --weight-dtype and --kv-cache-dtype."""
    engine = parser.add_argument_group("engine of each group")
    for name in ENGINE_FLAGS:
        engine.add_argument(f"--{name.replace('_', '-')}", type=positive_int)
    engine.add_argument(
        "--kv-host-bytes",
        type=size,
        help="host memory per device for KV blocks the pool evicts, restored instead of recomputed, e.g. 16GiB",
    )
    engine.add_argument(
        "--kv-disk-bytes",
        type=size,
        help="disk per device under the host tier for blocks it evicts (needs --kv-host-bytes and --kv-disk-dir)",
    )
    engine.add_argument("--kv-disk-dir", metavar="DIR", help="the disk tier's directory (local NVMe), one per group")
    engine.add_argument(
        "--kv-disk-async",
        action=argparse.BooleanOptionalAction,
        help="read the disk tier off the step's path, a request waiting in a loading state meanwhile "
        "(the default); --no-kv-disk-async reads between two steps",
    )
    engine.add_argument(
        "--kv-disk-read-delay-s",
        type=non_negative_float,
        metavar="SECONDS",
        help="seconds added to each block read from the disk tier: a slower disk emulated (tests, benchmarks)",
    )
    if not dtypes:
        return
    engine.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations: auto (the default: bfloat16 on a CPU with bf16 units, "
        "else float32 on CPU, else the checkpoint's dtype), or a float type",
    )
    engine.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        help="linear layers' weights: auto (the default: kept in 4 or 8 bits for a quantized GGUF "
        "file on CPU, else float), float (the --dtype), int8 or int4 (CPU)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="KV cache: auto (the model's dtype), a float type, or 8 bits with scales: int8, "
        "fp8 (fp8_e4m3); about twice the sequences per device",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the command line gave (those `add_engine_flags` added)."""
    names = (*ENGINE_FLAGS, *TIER_FLAGS, *DTYPE_FLAGS)
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def int_list(text: str) -> tuple[int, ...]:
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    return tuple(positive_int(part.strip()) for part in parts)
