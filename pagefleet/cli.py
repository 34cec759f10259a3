"""The `pagefleet` command: one argparse subcommand per entry of `COMMANDS`.

A command is a name, a one-line help, a function that adds its arguments to its parser and a
function that runs it and returns the exit code. To add one, write those two functions and
append a `Command` to `COMMANDS`. A `ValueError` from a command's run is bad user input: it is
reported argparse style (``pagefleet NAME: error: ...``) with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.planner import KVShape, Plan, format_bytes, parse_size, plan


@dataclass(frozen=True)
class Command:
    """One `pagefleet` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- plan --------------------------------------------------------------------------------


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagefleet plan`: a KV shape (flags or --model) and a workload."""
    shape = parser.add_argument_group("KV shape (give these, or --model)")
    shape.add_argument("--model", metavar="DIR", help="Hugging Face model dir (its config.json)")
    shape.add_argument("--layers", type=_positive_int, help="decoder layers")
    shape.add_argument("--kv-heads", type=_positive_int, help="KV heads (GQA groups)")
    shape.add_argument("--head-dim", type=_positive_int, help="dimension of one head")
    shape.add_argument(
        "--dtype",
        help="KV cache element type: float32, bfloat16, float16, fp8, int8 "
        "(default: the model's dtype with --model, else bfloat16)",
    )
    shape.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    load = parser.add_argument_group("workload and device")
    load.add_argument(
        "--lengths", type=_int_list, default=(), help="cached tokens per request: 8192,4096,2048"
    )
    load.add_argument(
        "--max-len", type=_positive_int, help="longest sequence (default: the longest length)"
    )
    load.add_argument(
        "--shared-prefix", type=_non_negative_int, default=0, help="tokens of a shared prefix"
    )
    load.add_argument("--device-memory", type=_size, help="memory of one device, e.g. 24GiB")
    load.add_argument(
        "--reserved", type=_size, default=0, help="weights + workspace + reserve, e.g. 17GiB"
    )
    load.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel devices")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args: argparse.Namespace) -> int:
    """Print the capacity plan as a table or, with --json, one JSON object."""
    result = plan(
        _plan_shape(args),
        args.lengths,
        max_len=args.max_len,
        shared_prefix=args.shared_prefix,
        device_memory=args.device_memory,
        reserved=args.reserved,
        tp=args.tp,
    )
    print(result.to_json() if args.json else render_plan(result))
    return 0


def _plan_shape(args: argparse.Namespace) -> KVShape:
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model is not None:
        given = [name for name, value in flags.items() if value is not None]
        if given:
            raise ValueError(f"give either --model or {', '.join(given)}, not both")
        return KVShape.from_hf_config(args.model, args.dtype, args.block_size)
    missing = [name for name, value in flags.items() if value is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --model DIR)")
    return KVShape(
        args.layers, args.kv_heads, args.head_dim, args.dtype or "bfloat16", args.block_size
    )


def render_plan(p: Plan) -> str:
    """A plan as a readable table."""
    s = p.shape
    lines = [
        f"KV shape     {s.layers} layers x {s.kv_heads} KV heads x head dim {s.head_dim}, "
        f"{s.kv_dtype}, block size {s.block_size}",
        f"per token    {_b(p.bytes_per_token)}    per block  {_b(p.block_bytes)}",
    ]
    if p.tp > 1:
        lines.append(
            f"per device   tp={p.tp}, {p.local_kv_heads} KV heads: "
            f"{_b(p.per_device_bytes_per_token)} per token, {_b(p.per_device_block_bytes)} per block"
        )
    if p.requests:
        lines += [
            "",
            f"{'request':>8} {'tokens':>10} {'bytes':>12} {'blocks':>8} {'tail waste':>12}",
        ]
        for i, r in enumerate(p.requests):
            lines.append(
                f"{i:>8} {r.tokens:>10,} {format_bytes(r.bytes):>12} {r.blocks:>8,} "
                f"{format_bytes(r.tail_waste_bytes):>12}"
            )
        lines.append(
            f"{'total':>8} {p.total_tokens:>10,} {format_bytes(p.total_bytes):>12} "
            f"{sum(r.blocks for r in p.requests):>8,} {format_bytes(p.tail_waste_bytes):>12}"
        )
        lines.append(
            f"contiguous reservation at {p.max_len:,} tokens: {_b(p.contiguous_reserved_bytes)}"
        )
    if p.shared_prefix:
        lines.append(
            f"shared prefix of {p.shared_prefix:,} tokens saves {_b(p.shared_prefix_savings_bytes)}"
            f": {_b(p.total_bytes)} -> {_b(p.total_with_shared_prefix_bytes)}"
        )
    if p.pool_bytes is not None:
        lines += [
            "",
            f"pool         {_b(p.device_memory)} - {_b(p.reserved)} reserved = {_b(p.pool_bytes)}"
            f" per device: {p.pool_blocks:,} blocks",
            f"fits         {p.max_sequences:,} sequences of {p.max_len:,} tokens"
            f" ({p.blocks_per_sequence:,} blocks each)",
        ]
    return "\n".join(lines)


def _b(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n:,} B)"


# ---- argument types (argparse turns their errors into exit code 2) -----------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    return tuple(_positive_int(part.strip()) for part in parts)


# ---- the command -------------------------------------------------------------------------

COMMANDS: list[Command] = [
    Command("plan", "KV-cache capacity plan (seed 000)", add_plan_arguments, run_plan),
]


def build_parser() -> argparse.ArgumentParser:
    """The `pagefleet` parser with one subparser per entry of `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="pagefleet", description="A KV-cache-aware LLM serving cluster."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_command=command, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pagefleet` with `argv` (default: sys.argv[1:]); returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or bad flags (2): argparse has printed why
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    try:
        return args._command.run(args)
    except ValueError as err:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {err}", file=sys.stderr)
        return 2
