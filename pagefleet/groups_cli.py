"""`pagefleet groups`: the worker groups of a cluster as services on Ray, kept alive by a
detached supervisor that outlives this command (cluster/ray/supervisor.py). Routers join them
with `pagefleet serve --role router --cluster NAME`.

    pagefleet groups start  --cluster NAME --address HOST:PORT --redis URL [--groups N --tp T ...]
    pagefleet groups status --cluster NAME --address HOST:PORT [--json]
    pagefleet groups drain --cluster NAME --address HOST:PORT GROUP   (GROUP anywhere after drain)
    pagefleet groups stop   --cluster NAME --address HOST:PORT
"""

from __future__ import annotations

import argparse
import json
import sys


def add_groups_arguments(parser: argparse.ArgumentParser) -> None:
    """One subparser per action, each with the flags it reads, so that a drain's GROUP parses
    before, between or after the options (one parser with an optional GROUP positional after
    ACTION took both positionals at ACTION, and a GROUP after the options was left over).
    --cluster and --address parse before the action too: they are on this parser as well,
    and the actions' copies only overwrite them when given (their default is SUPPRESS)."""
    _add_cluster_arguments(parser, on_action=False)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = _action(actions, "start", "place the groups and leave a supervisor keeping them")
    _add_start_arguments(start)
    _add_output_arguments(_action(actions, "status", "show the groups"), timeout=False)
    drain = _action(actions, "drain", "finish a group's streams and retire it")
    drain.add_argument("group", help="the group to drain (e.g. group-0)")
    _add_output_arguments(drain, timeout=True)
    _action(actions, "stop", "stop every group and the supervisor")


def _action(actions, name: str, help: str) -> argparse.ArgumentParser:
    parser = actions.add_parser(name, help=help, description=help)
    _add_cluster_arguments(parser, on_action=True)
    parser.set_defaults(_parser=parser)  # (a ValueError's usage line is this action's)
    return parser


def _add_cluster_arguments(parser: argparse.ArgumentParser, on_action: bool) -> None:
    # (an action's flag, not given, leaves what the groups parser took: SUPPRESS adds nothing)
    cluster, address = (argparse.SUPPRESS,) * 2 if on_action else ("pagefleet", None)
    parser.add_argument("--cluster", default=cluster, help="the cluster's name (default pagefleet)")
    parser.add_argument("--address", default=address, help="the Ray cluster's address (HOST:PORT or auto); required")


def _add_output_arguments(parser: argparse.ArgumentParser, timeout: bool) -> None:
    if timeout:
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    parser.add_argument("--json", action="store_true", help="print the groups as JSON")


def _add_start_arguments(parser: argparse.ArgumentParser) -> None:
    from pagefleet.cli import _ENGINE_FLAGS, _positive_int, add_tier_arguments

    parser.add_argument(
        "--redis",
        metavar="URL",
        required=True,
        help="the shared prefix index: routers of other processes find the blocks there",
    )
    parser.add_argument("--model", help="a model directory, a .gguf file, 'builtin' or 'default'")
    parser.add_argument("--groups", type=_positive_int, default=1, help="how many groups")
    parser.add_argument("--tp", type=_positive_int, default=1, help="devices per group")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--group-resource",
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="a custom Ray resource every rank's bundle takes (repeatable), e.g. "
        "pf_group=1 on nodes that declare one each to place one group per node",
    )
    _add_output_arguments(parser, timeout=True)
    engine = parser.add_argument_group("engine of each group")
    for name in _ENGINE_FLAGS:
        engine.add_argument(f"--{name.replace('_', '-')}", type=_positive_int)
    add_tier_arguments(engine)


def run_groups(args: argparse.Namespace) -> int:
    """Start, show, drain or stop the cluster's groups."""
    if not args.address:
        raise ValueError(f"groups {args.action} needs --address: the Ray cluster's (HOST:PORT or auto)")
    # Ray's driver prints the cluster's events (a node marked dead, ...) to stdout from a thread
    # of its own, at any moment: they go to stderr, and stdout carries only this command's
    # output (`--json` stays one JSON document for a script to read).
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        return _run(args, out)
    finally:
        from cluster.ray.runtime import ray

        ray.shutdown()  # (its printing thread stops here)
        sys.stdout = out


def _run(args: argparse.Namespace, out) -> int:
    from cluster.ray.runtime import RayStartError, cluster_namespace, ensure_ray
    from cluster.ray.supervisor import start_groups, stop_groups, the_supervisor

    try:
        ensure_ray(args.address, namespace=cluster_namespace(args.cluster))
    except RayStartError as e:
        print(f"pagefleet groups: error: {e}", file=sys.stderr)
        return 1
    import ray

    try:
        if args.action == "start":
            infos = start_groups(_spec(args), args.timeout)
        elif args.action == "stop":
            stop_groups()
            print(f"pagefleet groups: stopped the groups of {args.cluster}", file=out)
            return 0
        elif args.action == "drain":
            info = ray.get(the_supervisor().drain.remote(args.group, args.timeout))
            infos = [info]
        else:
            infos = ray.get(the_supervisor().groups.remote(), timeout=30)
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        # (a task's error, a supervisor being restarted or gone: one line, not a traceback)
        cause = getattr(e, "cause", None) or e
        print(f"pagefleet groups: error: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 1
    _print(infos, args.json, out)
    return 0


def _spec(args: argparse.Namespace):
    from cluster.ray.config import RayGroupConfig
    from cluster.ray.supervisor import GroupsSpec
    from pagefleet.cli import _ENGINE_FLAGS, _ENGINE_SIZES
    from pagefleet.llm import engine_config
    from router.serve import model_name, take_cluster_secret

    keys = (*_ENGINE_FLAGS, *_ENGINE_SIZES, "kv_disk_dir")
    options = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    config = engine_config(args.model, device=args.device, cluster_secret=take_cluster_secret(), **options)
    resources = {}
    for item in args.group_resource:
        name, _, amount = item.partition("=")
        try:
            resources[name] = float(amount)
        except ValueError:
            raise ValueError(f"--group-resource {item!r}: give NAME=AMOUNT, e.g. pf_group=1") from None
    group_config = RayGroupConfig(tensor_parallel_size=args.tp, bundle_resources=resources)
    return GroupsSpec(config, group_config, args.groups, args.cluster, model_name(config.model), args.redis)


def _print(infos, as_json: bool, out) -> None:
    rows = [
        {
            "group": i.group_id,
            "state": i.state,
            "generation": i.generation,
            "restarts": i.restarts,
            "nodes": [r.get("node_id", "") for r in i.ranks],
            "pids": [r.get("pid") for r in i.ranks],
            "error": i.error,
        }
        for i in infos
    ]
    if as_json:
        print(json.dumps(rows), file=out)
        return
    for r in rows:
        error = f"  ({r['error']})" if r["error"] else ""
        nodes = ",".join(sorted({n[:8] for n in r["nodes"]}))
        print(
            f"{r['group']}: {r['state']}, generation {r['generation']}, {r['restarts']} restart(s), nodes {nodes}{error}",
            file=out,
        )
