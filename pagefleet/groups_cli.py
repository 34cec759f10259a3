"""`pagefleet groups`: the worker groups of a cluster as services on Ray, kept alive by a
detached supervisor that outlives this command (cluster/ray/supervisor.py). Routers join them
with `pagefleet serve --role router --cluster NAME`.

    pagefleet groups start  --cluster NAME --address HOST:PORT --redis URL [--groups N --tp T ...]
                            [--config SERVE_YAML] [--api-key-file KEYS]   (the tenants)
    pagefleet groups status --cluster NAME --address HOST:PORT [--json]
    pagefleet groups drain --cluster NAME --address HOST:PORT GROUP   (GROUP anywhere after drain)
    pagefleet groups stop   --cluster NAME --address HOST:PORT

This module is the command's flags (cheap to import: `pagefleet --help` builds them);
pagefleet/groups_run.py runs the actions on Ray.
"""

from __future__ import annotations

import argparse

from pagefleet.cli_flags import add_engine_flags, positive_int


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
    parser.add_argument(
        "--redis",
        metavar="URL",
        required=True,
        help="the shared prefix index: routers of other processes find the blocks there",
    )
    parser.add_argument("--model", help="a model directory, a .gguf file, 'builtin' or 'default'")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the routers' serve YAML: the groups take its tenants: (weights, KV quotas), its "
        "api_key_file's tenant fields and its engine: options (flags win)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="the routers' key file: the groups take the tenants' weights and KV quotas it gives",
    )
    parser.add_argument("--groups", type=positive_int, default=1, help="how many groups")
    parser.add_argument("--tp", type=positive_int, default=1, help="devices per group")
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
    add_engine_flags(parser, dtypes=False)
