"""`pagefleet groups`' actions on Ray (start, status, drain, stop), for the flags that
pagefleet/groups_cli.py parses; output on stdout, errors as one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from cluster.ray.config import RayGroupConfig
from cluster.ray.runtime import RayStartError, cluster_namespace, ensure_ray, ray  # (ray: its environment set first)
from cluster.ray.supervisor import GroupInfo, GroupsSpec, start_groups, stop_groups, the_supervisor
from pagefleet.cli_flags import engine_options
from router.launch.build import model_name
from router.launch.config import load_config
from worker.config import EngineConfig, take_cluster_secret


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
        ray.shutdown()  # (its printing thread stops here)
        sys.stdout = out


def _run(args: argparse.Namespace, out: TextIO) -> int:
    try:
        ensure_ray(args.address, namespace=cluster_namespace(args.cluster))
    except RayStartError as e:
        print(f"pagefleet groups: error: {e}", file=sys.stderr)
        return 1
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


def _spec(args: argparse.Namespace) -> GroupsSpec:
    """What the supervisor places: the engine's options from the flags over the serve YAML's
    `engine:`, with the tenants' weights and KV quotas as `pagefleet serve` gives its groups
    (router/launch/config.py: TenantsConfig.engine_options)."""
    secret = take_cluster_secret()
    served = load_config(args.config, {"api_key_file": args.api_key_file})
    options = {**served.engine.options, **engine_options(args), **served.tenants.engine_options()}
    model = args.model or served.engine.model
    config = EngineConfig.from_options(model, device=args.device, cluster_secret=secret, **options)
    resources = {}
    for item in args.group_resource:
        name, _, amount = item.partition("=")
        try:
            resources[name] = float(amount)
        except ValueError:
            raise ValueError(f"--group-resource {item!r}: give NAME=AMOUNT, e.g. pf_group=1") from None
    group_config = RayGroupConfig(tensor_parallel_size=args.tp, bundle_resources=resources)
    return GroupsSpec(config, group_config, args.groups, args.cluster, model_name(config.model), args.redis)


def _print(infos: list[GroupInfo], as_json: bool, out: TextIO) -> None:
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
