"""Failover benchmark: a steady open-loop load on a cluster of two groups and two routers, and
one of them killed mid-run.

    python -m benchmarks.failover              # both cases
    python -m benchmarks.failover --quick      # a smaller trace (smoke)
    python -m benchmarks.failover --case drain_kv [--model default]   # drain with KV only
    python -m benchmarks.failover --case load_move    # moves for load, on vs off
    python -m benchmarks.failover --case death_disk   # a group's death, resumed from its disk

The cluster is the one a deployment runs (README, "A cluster"), on a multi-node Ray cluster on
loopback (ray.cluster_utils: a head and two nodes with one group slot each), a real
redis-server, `pagefleet groups start --groups 2` (the built-in model) and two
`pagefleet serve --role router` processes. The load is the research-assistant trace
(benchmarks/workloads.py), Poisson arrivals, half the requests greedy and half seeded
(temperature 1), through clients that know both routers (half of them list the first router
first, half the second).

Runs, in order:
- `undisturbed`: the trace, nothing killed: every request's tokens are the reference, and its
  inter-token gaps the peer of the stalls below.
- `group_killed`: the same trace; at `--kill-at` seconds, SIGKILL of the rank process of the
  group with the most streams in flight. Its streams resume on the other group (the router
  resends the prompt and the tokens so far); the supervisor replaces the group.
- `router_killed`: the same trace; at `--kill-at` seconds, SIGKILL of the first router. Its
  streams continue through the second one (the client resends what they had delivered).

- `drain_kv` (alone, with `--case drain_kv`): two groups in this process (LocalGroup, the
  built-in model unless `--model`), `--streams` streams of a `--prompt-len`-token prompt each
  placed on g0; once each has `--drain-after` tokens g0 drains and the router moves them to g1,
  once with their KV pulled from g0 (the full committed blocks of prompt and output) and once
  recomputing it (`Router.move_pull = False`), same run. Per mode: the moved streams' stall
  (their longest gap between two tokens) p50/p99, the tokens g1 recomputed at the resumes and
  the blocks it pulled, streams whose tokens differ from an undisturbed run's (goal: 0); and
  the stall ratio pull / recompute.
- `load_move` (alone, with `--case load_move`): two groups in this process, the same streams
  running on g0 alone; once each has `--drain-after` tokens g1 joins the router (a group added,
  or back from a restart), once with moves for load (`Router.move_for_load`: streams move to g1
  with their KV while the cost model says they finish sooner there) and once without, same run.
  Per mode: streams moved and blocks pulled, the streams' end-to-end time (a stream's start to
  its last token) p50/p99 and time per output token (after its first) p50, streams whose tokens
  differ from an undisturbed run's (goal: 0); and the ratios on / off.
- `death_disk` (alone, with `--case death_disk`): two groups in this process sharing a
  --kv-disk-dir, d0 and d1; d0 has read every stream's prompt once and stopped (its blocks
  written down to its subdirectory), then came back under its id, so that its disk holds the
  prompts; the streams run on d0, whose device fails once each has `--drain-after` tokens;
  the router resumes them on d1, which first reads the blocks d0's disk tier left
  (`Router.read_dead_disk`), and, same run, recomputes them instead. Per mode: the blocks read,
  the tokens d1 computed, the streams' stall at the resume (their longest gap between two
  tokens) p50/p99, streams whose tokens differ from an undisturbed run's (goal: 0); and the
  stall ratio read / recompute.

One JSON line per run: requests sent / completed / failed (goal: 0 failed); streams whose tokens
differ from the undisturbed run's, with the tokens repeated and missing against it (goal: 0);
the resumed streams' stall p50/p99 (the longest gap between two of a stream's responses,
around the kill) and, as its peer, the same figure over the undisturbed run's streams; the time
from the kill to a replacement group serving (group_killed) or to the killed router's streams
all having moved (router_killed); end-to-end p50/p99 and its ratio to the undisturbed run's.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.serving import pct
from benchmarks.workloads import ResearchWorkload, research_requests
from pagefleet.client import AsyncClient
from tests.redis_server import RedisServer, free_port
from tests.serve_process import start_serve

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "failover"
SLOT = "pf_group"


@dataclass
class Stream:
    """One request as its client saw it."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival of each response with tokens
    group: str = ""
    resumes: int = 0
    error: str | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def stall(self) -> float:
        """The longest gap between two of its responses (0 for fewer than two)."""
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


async def one(client: AsyncClient, req, i: int, t0: float, streams: dict, salt: str) -> Stream:
    s = streams[i] = Stream(start=time.perf_counter() - t0)
    options = dict(max_tokens=req.max_tokens, ignore_eos=True, cache_salt=salt)
    options.update(temperature=0.0) if i % 2 == 0 else options.update(temperature=1.0, seed=i)
    try:
        async for r in client.generate_stream(token_ids=list(req.prompt), **options):
            if r.HasField("placement"):
                s.group = r.placement.group_id
            if r.token_ids:
                s.tokens += r.token_ids
                s.times.append(time.perf_counter() - t0)
            if r.finished:
                s.resumes = r.usage.resumes
    except Exception as e:  # noqa: BLE001  (a failed request is a figure here)
        details = e.details() if hasattr(e, "details") else str(e)
        s.error = f"{type(e).__name__}: {details}"
    s.end = time.perf_counter() - t0
    return s


async def run_trace(targets: list[str], trace, rate: float, seed: int, at: float | None, kill, salt: str):
    """The trace at `rate` requests/s (Poisson) through two clients (each router first in
    one); `kill(streams)` at `at` seconds, in a thread. `salt`: the run's cache salt (each run
    starts with none of the trace's documents cached). Returns (streams, kill's result)."""
    import random

    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in trace]
    clients = [AsyncClient(targets, timeout=300), AsyncClient(targets[::-1], timeout=300)]
    streams: dict[int, Stream] = {}
    t0 = time.perf_counter()

    async def send(i: int, req, when: float) -> Stream:
        await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
        return await one(clients[i % 2], req, i, t0, streams, salt)

    async def killer():
        await asyncio.sleep(at)
        return await asyncio.to_thread(kill, streams, time.perf_counter() - t0)

    when, tasks = 0.0, []
    for i, (req, gap) in enumerate(zip(trace, gaps, strict=True)):
        when += gap
        tasks.append(asyncio.ensure_future(send(i, req, when)))
    killed = asyncio.ensure_future(killer()) if kill is not None else None
    done = await asyncio.gather(*tasks)
    result = await killed if killed is not None else None
    for c in clients:
        await c.close()
    return done, result


def compare(streams: list[Stream], reference: list[Stream]) -> dict:
    """Streams whose tokens differ from the reference, and the tokens repeated (extra) and
    missing against it."""
    differ = repeated = missing = 0
    for s, ref in zip(streams, reference, strict=True):
        if s.error is not None or s.tokens == ref.tokens:
            continue
        differ += 1
        for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=ref.tokens, b=s.tokens).get_opcodes():
            if op in ("insert", "replace"):
                repeated += b1 - b0
            if op in ("delete", "replace"):
                missing += a1 - a0
    return {"streams_differ": differ, "tokens_repeated": repeated, "tokens_missing": missing}


def line(case: str, streams: list[Stream], reference: list[Stream] | None, extra: dict) -> dict:
    ok = [s for s in streams if s.error is None]
    out = {
        "bench": "failover",
        "case": case,
        "sent": len(streams),
        "completed": len(ok),
        "failed": len(streams) - len(ok),
    }
    if reference is not None:
        out.update(compare(streams, reference))
    resumed = [s.stall for s in ok if s.resumes]
    out["resumed"] = len(resumed)
    out["stall_ms_p50"], out["stall_ms_p99"] = pct(resumed, 0.5), pct(resumed, 0.99)
    e2e = [s.end - s.start for s in ok]
    out["e2e_ms_p50"], out["e2e_ms_p99"] = pct(e2e, 0.5), pct(e2e, 0.99)
    out.update(extra)
    errors = sorted({s.error for s in streams if s.error})
    if errors:
        out["errors"] = errors[:3]
    return out


class Deployment:
    """The cluster of the module docstring; `close()` takes it all down."""

    def __init__(self, tmp: Path, ready_s: float = 600) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
        from ray.cluster_utils import Cluster

        from cluster.ray.runtime import ensure_ray
        from worker.model.builtin_model import builtin_model_path

        self.redis = RedisServer().__enter__()
        node = dict(num_cpus=2, object_store_memory=80 << 20, node_ip_address="127.0.0.1")
        self.cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(2):
            self.cluster.add_node(**node, resources={SLOT: 1})
        self.cluster.wait_for_nodes()
        self.address = ensure_ray(self.cluster.address)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        self.env.update(PYTHONPATH=str(ROOT), PAGEFLEET_CLUSTER_SECRET="failover-benchmark")
        started = self.pagefleet(
            "groups",
            "start",
            "--redis",
            self.redis.url,
            "--model",
            str(builtin_model_path()),
            "--groups",
            "2",
            "--group-resource",
            f"{SLOT}=1",
            "--num-blocks",
            "512",
            "--max-model-len",
            "2048",
            "--timeout",
            str(ready_s),
        )
        if started.returncode != 0:
            raise RuntimeError(started.stderr)
        self.routers = []
        for i in range(2):
            flags = [
                "--role",
                "router",
                "--cluster",
                CLUSTER,
                "--address",
                self.address,
                "--redis",
                self.redis.url,
                "--no-metrics",
                "--grace",
                "2",
            ]
            self.routers.append(start_serve(flags, free_port(), tmp / f"router{i}.log", ready_s, self.env))

    def pagefleet(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pagefleet", *args[:2], "--cluster", CLUSTER, "--address", self.address, *args[2:]],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
        )

    def groups(self) -> dict[str, dict]:
        from cluster.ray.runtime import ray
        from cluster.ray.supervisor import SUPERVISOR_NAME

        supervisor = ray.get_actor(SUPERVISOR_NAME, namespace=f"pagefleet-{CLUSTER}")
        return {i.group_id: i for i in ray.get(supervisor.groups.remote(), timeout=30)}

    @property
    def targets(self) -> list[str]:
        return [client.target for _, client in self.routers]

    def kill_group(self, streams: dict[int, Stream], now: float) -> dict:
        """SIGKILL rank 0 of the group with the most streams in flight; returns the seconds
        until its replacement serves and the routers see it."""
        in_flight = [s.group for s in streams.values() if s.group and not s.end]
        victim = max(sorted(set(in_flight)), key=in_flight.count)
        info = self.groups()[victim]
        t = time.perf_counter()
        os.kill(info.ranks[0]["pid"], signal.SIGKILL)
        while True:
            fresh = self.groups()[victim]
            if fresh.state == "serving" and fresh.generation != info.generation:
                _, client = self.routers[1]
                if sum(g.alive for g in client.cluster_status()) == 2:
                    break
            time.sleep(0.2)
        return {
            "killed_at_s": round(now, 2),
            "streams_on_group": in_flight.count(victim),
            "replacement_serving_s": round(time.perf_counter() - t, 2),
        }

    def kill_router(self, streams: dict[int, Stream], now: float) -> dict:
        """SIGKILL the first router; returns the streams in flight then."""
        proc, client = self.routers[0]
        in_flight = sum(1 for s in streams.values() if not s.end)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        client.close()
        return {"killed_at_s": round(now, 2), "streams_in_flight": in_flight}

    def close(self) -> None:
        from cluster.ray.runtime import shutdown_ray

        for proc, client in self.routers:
            client.close()
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        self.pagefleet("groups", "stop")
        shutdown_ray()
        self.cluster.shutdown()
        self.redis.__exit__(None, None, None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--kill-at", type=float, default=4.0, help="seconds into the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smaller trace (smoke)")
    choices = ("kill", "drain_kv", "load_move", "death_disk")
    p.add_argument("--case", choices=choices, default="kill", help="kill: the cluster cases above")
    p.add_argument("--model", default="builtin", help="drain_kv, load_move: the model (pagefleet.models)")
    p.add_argument("--dtype", default="float32", help="drain_kv, load_move: the model's dtype")
    p.add_argument("--streams", type=int, default=8, help="drain_kv, load_move: streams on g0")
    p.add_argument("--prompt-len", type=int, default=1000, help="drain_kv, load_move: each stream's prompt tokens")
    p.add_argument("--max-tokens", type=int, default=96, help="drain_kv, load_move: each stream's output tokens")
    p.add_argument(
        "--drain-after", type=int, default=48, help="tokens each stream has before g0 drains (load_move: g1 joins)"
    )
    return p.parse_args(argv)


def _stream_params(i: int, max_tokens: int):
    """Half the streams greedy, half seeded (temperature 1)."""
    from worker.sampling_params import SamplingParams

    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _drain_run(router, g0, g1, prompts: list[list[int]], args: argparse.Namespace) -> list:
    """Every stream placed on g0; once each has `drain_after` tokens g0 drains (g1 takes new
    placements): each stream's tokens and its responses' arrival times."""
    from router.router import RouteRequest

    g1.set_draining(True)  # (until every stream is on g0)
    ready = asyncio.Event()
    counts = [0] * len(prompts)

    async def one(i: int) -> tuple[list[int], float, int]:
        """The stream's tokens, its stall at the move (the gap before its first token from
        the new group) and how many tokens it had then."""
        tokens, last, stall, moved_at = [], 0.0, 0.0, 0
        request = RouteRequest(prompt_token_ids=prompts[i], params=_stream_params(i, args.max_tokens))
        async for out in router.generate(request):
            now = time.perf_counter()
            if not moved_at and router.records[out.request_id].resumes:
                stall, moved_at = now - last, len(tokens)
            last, tokens = now, list(out.outputs[0].token_ids)
            counts[i] = len(tokens)
            if min(counts) >= args.drain_after and not ready.is_set():
                ready.set()
                g1.set_draining(False)
                g0.set_draining(True)
        return tokens, stall, moved_at

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _two_groups(config, hasher, info, ids: tuple[str, str], switches: dict, run) -> tuple:
    """Two fresh groups of `config` named `ids` under one router (`switches`: its attributes
    to set), `run(router, first, second)` to its end: (the router, what the run returned, the
    tokens the second group computed meanwhile)."""
    from cluster.index import InMemoryPrefixIndex
    from cluster.local_group import LocalGroup
    from router.router import Router

    index = InMemoryPrefixIndex()
    first, second = (LocalGroup(config, index, group_id=gid) for gid in ids)
    try:
        router = Router([first, second], index, hasher, info)
        for name, value in switches.items():
            setattr(router, name, value)
        before = second.engine.engine.stats()["tokens_computed"]
        results = asyncio.run(run(router, first, second))
        computed = second.engine.engine.stats()["tokens_computed"] - before
    finally:
        first.shutdown()
        second.shutdown()
    return router, results, computed


def _drain_mode(config, hasher, info, args: argparse.Namespace, pull: bool, prompts, refs) -> dict:
    """One mode of the drain-with-KV case on two fresh groups: its JSON line."""
    drain = lambda router, g0, g1: _drain_run(router, g0, g1, prompts, args)  # noqa: E731
    router, results, delta = _two_groups(config, hasher, info, ("g0", "g1"), {"move_pull": pull}, drain)
    stalls = [stall for _, stall, _ in results]
    known = sum(args.prompt_len + moved_at for *_, moved_at in results)
    # g1 computes, per stream, what it recomputes at the resume, then a token per decode step:
    # the output left after the move, less the resume's own token
    left = sum(args.max_tokens - moved_at - 1 for *_, moved_at in results)
    records = list(router.records.values())
    return {
        "case": f"drain_kv_{'pull' if pull else 'recompute'}",
        "model": args.model,
        "dtype": args.dtype,
        "streams": len(prompts),
        "prompt_len": args.prompt_len,
        "moved": sum(r.resumes for r in records),
        "blocks_pulled": sum(r.pulled_blocks for r in records),
        "tokens_known_at_move": known,
        "tokens_recomputed": delta - left,
        "stall_ms_p50": pct(stalls, 0.5),
        "stall_ms_p99": pct(stalls, 0.99),
        "differing": [i for i, (r, ref) in enumerate(zip(results, refs, strict=True)) if r[0] != ref],
    }


def _moved_streams(args: argparse.Namespace, secret: str) -> tuple:
    """What the drain_kv and load_move cases share: the groups' config, the router's hasher and
    model info, the streams' prompts and their undisturbed tokens (on a group of their own)."""
    from cluster.local_group import LocalGroup
    from pagefleet.llm import engine_config
    from router.launch.local import router_side
    from worker.protocol import GenerationRequest

    # float32: bfloat16's rounding differs with each batch shape, which alone flips near-ties
    # between two runs of the same streams (benchmarks/RESULTS.md, "Identical tokens in bfloat16")
    options = dict(
        num_blocks=2048,
        max_model_len=4096,
        kv_host_bytes=1 << 28,
        cluster_secret=secret,
        dtype=args.dtype,
    )
    config = engine_config(args.model, **options)
    hasher, _, info = router_side(config, args.model)
    prompts = [[(31 * j + 7 * i + 3) % 1000 for j in range(args.prompt_len)] for i in range(args.streams)]
    reference = LocalGroup(config, group_id="ref")

    async def undisturbed(i: int) -> list[int]:
        request = GenerationRequest(prompts[i], _stream_params(i, args.max_tokens))
        return list([o async for o in reference.generate(request)][-1].outputs[0].token_ids)

    async def all_undisturbed() -> list[list[int]]:
        return await asyncio.gather(*(undisturbed(i) for i in range(args.streams)))

    try:
        refs = asyncio.run(all_undisturbed())
    finally:
        reference.shutdown()
    return config, hasher, info, prompts, refs


def _paired(args: argparse.Namespace, case: str, run_mode, ratios: dict[str, str]) -> list[dict]:
    """A case of two modes on the same streams (`run_mode(config, hasher, info, args, first,
    prompts, refs)`, first True then False, each on fresh groups): a line per mode, then
    `<case>_ratio` with each of `ratios` (name -> a key of the lines) first over second."""
    config, hasher, info, prompts, refs = _moved_streams(args, f"failover-{case}")
    lines = []
    for first in (True, False):
        lines.append(run_mode(config, hasher, info, args, first, prompts, refs))
        print(json.dumps(lines[-1]), flush=True)
    one, other = lines
    ratio = {"case": f"{case}_ratio", "model": args.model}
    ratio.update({name: round(one[key] / max(1e-9, other[key]), 3) for name, key in ratios.items()})
    print(json.dumps(ratio), flush=True)
    return [*lines, ratio]


def drain_kv(args: argparse.Namespace) -> list[dict]:
    """The drain-with-KV case (see the module docstring): one line per mode, then the ratio."""
    ratios = {
        "stall_p50_pull_vs_recompute": "stall_ms_p50",
        "stall_p99_pull_vs_recompute": "stall_ms_p99",
        "tokens_recomputed_pull_vs_recompute": "tokens_recomputed",
    }
    return _paired(args, "drain_kv", _drain_mode, ratios)


async def _load_run(router, g0, g1, prompts: list[list[int]], args: argparse.Namespace) -> list:
    """Every stream on g0 alone; once each has `drain_after` tokens g1 joins the router: each
    stream's tokens, its start, first token and end (seconds)."""
    from router.router import RouteRequest

    counts = [0] * len(prompts)

    async def one(i: int) -> tuple[list[int], float, float, float]:
        tokens, start, first = [], time.perf_counter(), 0.0
        request = RouteRequest(prompt_token_ids=prompts[i], params=_stream_params(i, args.max_tokens))
        async for out in router.generate(request):
            tokens = list(out.outputs[0].token_ids)
            first = first or time.perf_counter()
            counts[i] = len(tokens)
            if min(counts) >= args.drain_after and len(router.groups) == 1:
                router.set_groups([g0, g1])
        return tokens, start, first, time.perf_counter()

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _load_mode(config, hasher, info, args: argparse.Namespace, on: bool, prompts, refs) -> dict:
    """One mode of the load_move case on two fresh groups: its JSON line."""
    from cluster.index import InMemoryPrefixIndex
    from cluster.local_group import LocalGroup
    from router.router import Router

    index = InMemoryPrefixIndex()
    g0, g1 = LocalGroup(config, index, group_id="g0"), LocalGroup(config, index, group_id="g1")
    try:
        router = Router([g0], index, hasher, info)
        router.move_for_load = on
        results = asyncio.run(_load_run(router, g0, g1, prompts, args))
    finally:
        g0.shutdown()
        g1.shutdown()
    e2e = [end - start for _, start, _, end in results]
    tpot = [(end - first) / max(1, len(tokens) - 1) for tokens, _, first, end in results]
    records = list(router.records.values())
    return {
        "case": f"load_move_{'on' if on else 'off'}",
        "model": args.model,
        "dtype": args.dtype,
        "streams": len(prompts),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "joined_after": args.drain_after,
        "moved": sum(r.resumes for r in records),
        "blocks_pulled": sum(r.pulled_blocks for r in records),
        "e2e_ms_p50": pct(e2e, 0.5),
        "e2e_ms_p99": pct(e2e, 0.99),
        "tpot_ms_p50": pct(tpot, 0.5),
        "tokens_differing": sum(_differing(r[0], ref) for r, ref in zip(results, refs, strict=True)),
    }


def _differing(tokens: list[int], reference: list[int]) -> int:
    """Positions where a stream's tokens differ from the reference's (a missing or extra token
    counts)."""
    return sum(a != b for a, b in zip(tokens, reference, strict=False)) + abs(len(tokens) - len(reference))


def load_move(args: argparse.Namespace) -> list[dict]:
    """The load_move case (see the module docstring): one line per mode, then the ratios."""
    ratios = {"e2e_p50_on_vs_off": "e2e_ms_p50", "e2e_p99_on_vs_off": "e2e_ms_p99", "tpot_p50_on_vs_off": "tpot_ms_p50"}
    return _paired(args, "load_move", _load_mode, ratios)


async def _death_run(router, d0, d1, prompts: list[list[int]], args: argparse.Namespace) -> list:
    """Every stream placed on d0 (which holds their prompts; d1 takes no placement until each
    has a token); once each has `drain_after` tokens d0's device fails: each stream's tokens
    and its stall at the resume."""
    from router.router import RouteRequest

    d1.set_draining(True)
    counts = [0] * len(prompts)
    engine = d0.engine.engine
    execute = engine.executor.execute

    def fails(out):
        if min(counts) >= args.drain_after:
            raise RuntimeError("device lost")
        return execute(out)

    engine.executor.execute = fails

    async def one(i: int) -> tuple[list[int], float]:
        tokens, last, stall = [], 0.0, 0.0
        request = RouteRequest(prompt_token_ids=prompts[i], params=_stream_params(i, args.max_tokens))
        async for out in router.generate(request):
            now = time.perf_counter()
            if not stall and router.records[out.request_id].resumes:
                stall = now - last
            last, tokens = now, list(out.outputs[0].token_ids)
            counts[i] = len(tokens)
            if min(counts) and d1.draining:
                d1.set_draining(False)
        return tokens, stall

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _death_mode(config, hasher, info, args: argparse.Namespace, read: bool, prompts, refs) -> dict:
    """One mode of the death_disk case on a fresh directory and two fresh groups: its line."""
    from cluster.local_group import LocalGroup
    from worker.protocol import GenerationRequest
    from worker.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        cache = replace(config.cache, kv_disk_dir=tmp, kv_disk_bytes=1 << 30)
        config = replace(config, cache=cache)
        first = LocalGroup(config, group_id="d0")

        async def read_all() -> None:
            for i, ids in enumerate(prompts):
                request = GenerationRequest(ids, SamplingParams(max_tokens=1), request_id=f"read-{i}")
                [_ async for _ in first.generate(request)]

        try:
            asyncio.run(read_all())
        finally:
            first.shutdown()  # (its blocks written down to tmp/d0)
        die = lambda router, d0, d1: _death_run(router, d0, d1, prompts, args)  # noqa: E731
        router, results, computed = _two_groups(config, hasher, info, ("d0", "d1"), {"read_dead_disk": read}, die)
    stalls = [stall for _, stall in results]
    records = list(router.records.values())
    return {
        "case": f"death_disk_{'read' if read else 'recompute'}",
        "model": args.model,
        "dtype": args.dtype,
        "streams": len(prompts),
        "prompt_len": args.prompt_len,
        "resumed": sum(r.resumes for r in records),
        "on_d1": sum(r.group_id == "d1" for r in records),
        "blocks_read": sum(r.pulled_blocks for r in records),
        "tokens_computed_d1": computed,
        "stall_ms_p50": pct(stalls, 0.5),
        "stall_ms_p99": pct(stalls, 0.99),
        "differing": [i for i, (r, ref) in enumerate(zip(results, refs, strict=True)) if r[0] != ref],
    }


def death_disk(args: argparse.Namespace) -> list[dict]:
    """The death_disk case (see the module docstring): one line per mode, then the ratio."""
    ratios = {
        "stall_p50_read_vs_recompute": "stall_ms_p50",
        "stall_p99_read_vs_recompute": "stall_ms_p99",
        "tokens_computed_read_vs_recompute": "tokens_computed_d1",
    }
    return _paired(args, "death_disk", _death_mode, ratios)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.case == "death_disk":
        return death_disk(args)
    if args.case == "drain_kv":
        return drain_kv(args)
    if args.case == "load_move":
        return load_move(args)
    workload = ResearchWorkload(
        num_docs=3,
        doc_len=(300, 500),
        questions_per_doc=4 if args.quick else 8,
        num_chats=4 if args.quick else 8,
        output_len=(32, 96) if args.quick else (96, 192),
        vocab_size=1000,
        seed=args.seed,
    )
    trace = research_requests(workload)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Deployment(Path(tmp))
        try:

            def run(kill):
                run_id = f"run-{time.time_ns()}"
                return asyncio.run(run_trace(cluster.targets, trace, args.rate, args.seed, args.kill_at, kill, run_id))

            reference, _ = run(None)
            ok = [s for s in reference if s.error is None]
            peer = {
                "undisturbed_stall_ms_p50": pct([s.stall for s in ok], 0.5),
                "undisturbed_stall_ms_p99": pct([s.stall for s in ok], 0.99),
            }
            lines.append(line("undisturbed", reference, None, peer))
            print(json.dumps(lines[0]), flush=True)
            for case, kill in (("group_killed", cluster.kill_group), ("router_killed", cluster.kill_router)):
                streams, killed = run(kill)
                out = line(case, streams, reference, {**killed, **peer})
                if out["e2e_ms_p50"] and lines[0]["e2e_ms_p50"]:
                    out["e2e_p50_vs_undisturbed"] = round(out["e2e_ms_p50"] / lines[0]["e2e_ms_p50"], 3)
                lines.append(out)
                print(json.dumps(out), flush=True)
        finally:
            cluster.close()
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
