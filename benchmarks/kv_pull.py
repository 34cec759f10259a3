"""KV pulled between groups against recomputed: a question about a document that another group
computed, placed on a group that lacks it (CPU).

    python -m benchmarks.kv_pull --model builtin --doc-tokens 2000
    python -m benchmarks.kv_pull --model default --doc-tokens 2000

Two groups, g0 and g1, in one of two transports: `ray` (a two-node Ray cluster on loopback,
ray.cluster_utils, one group per node: each rank's shard crosses the object store between the
nodes) and `in_process` (two LocalGroups: the tensors pass directly). Per repeat, two fresh
documents are read on g0; then a question about the first goes to g1 as it is (`recompute`: g1
computes the whole document), and a question about the second goes to g1 after g1 pulled the
document's blocks from g0 (`pull`: `GroupHandle.pull_from`, then the request). TTFT is from
the moment the caller starts (the pull included) to the first token at the caller; medians
over the repeats, after one warm-up of each. One JSON line per transport and case, with the
pull's own seconds and bytes, the prompt tokens g1 computed for the question, whether its
tokens equal g0's for the same question, and the same-run ratio against `recompute`.

    python -m benchmarks.kv_pull --model builtin --doc-tokens 2000 --cold-burst

`--cold-burst`: 16 questions about one cold document sent at once through a router (default
policy) to two in-process groups, without the router's compute-once rule (`cold_burst_recompute`:
a question spilled to the second group recomputes the document) and with it (`cold_burst`: it
waits for the first group's commit and pulls); one line each with the copies of the document the
groups computed, the burst's TTFT p50 and p99 (medians over --repeats runs of each, alternating),
and the same-run ratios of the rule's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time

from pagefleet.llm import engine_config
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
QUESTION_TOKENS = 8
NODES = ("node_a", "node_b")


def documents(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def first_and_last(group, ids: list[int], rid: str, hasher) -> tuple[float, object]:
    """(seconds to the first output, the last output) of one request."""
    t0 = time.perf_counter()
    first, last = None, None
    request = GenerationRequest(ids, GREEDY, request_id=rid, block_hashes=hasher.hash_prompt(ids))
    async for out in group.generate(request):
        first, last = first or time.perf_counter() - t0, out
    return first, last


class Groups:
    """g0 and g1 of one transport; `close()` takes them (and a Ray cluster) down."""

    def __init__(self, transport: str, config) -> None:
        self.cluster = None
        if transport == "in_process":
            from cluster.local_group import LocalGroup

            self.g0, self.g1 = LocalGroup(config, group_id="g0"), LocalGroup(config, group_id="g1")
            self.stats = lambda g: g.engine.engine.stats()
            return
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        from ray.cluster_utils import Cluster

        from cluster.ray.group import RayGroup, RayGroupConfig
        from cluster.ray.runtime import ensure_ray

        node = dict(num_cpus=2, object_store_memory=1 << 30, node_ip_address="127.0.0.1")
        head = {**node, "resources": {NODES[0]: 1}, "include_dashboard": False}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.cluster.add_node(**node, resources={NODES[1]: 1})
        self.cluster.wait_for_nodes()
        ensure_ray(self.cluster.address)
        self.g0, self.g1 = (
            RayGroup(config, RayGroupConfig(bundle_resources={n: 1}, start_timeout_s=600), group_id=f"g{i}")
            for i, n in enumerate(NODES)
        )
        self.stats = lambda g: g.engine_stats()

    def close(self) -> None:
        self.g0.shutdown()
        self.g1.shutdown()
        if self.cluster is not None:
            from cluster.ray.runtime import shutdown_ray

            shutdown_ray()
            self.cluster.shutdown()


async def one_repeat(groups: Groups, docs: list[list[int]], question: list[int], hasher, tag: str) -> dict:
    g0, g1 = groups.g0, groups.g1
    for i, doc in enumerate(docs):
        await first_and_last(g0, doc + [1], f"{tag}-read-{i}", hasher)
    recompute_doc, pull_doc = docs
    before = groups.stats(g1)
    recompute_s, recomputed = await first_and_last(g1, recompute_doc + question, f"{tag}-recompute", hasher)
    middle = groups.stats(g1)
    t0 = time.perf_counter()
    blocks = await g1.pull_from(g0, hasher.hash_prompt(pull_doc + question), timeout_s=60)
    pull_s = time.perf_counter() - t0
    ask_s, pulled = await first_and_last(g1, pull_doc + question, f"{tag}-pull", hasher)
    after = groups.stats(g1)
    own = [(await first_and_last(g0, d + question, f"{tag}-own-{i}", hasher))[1] for i, d in enumerate(docs)]
    return {
        "recompute_ttft_s": recompute_s,
        "pull_ttft_s": pull_s + ask_s,
        "pull_s": pull_s,
        "blocks": blocks,
        "kv_bytes": blocks * after["block_size"] * after["kv_bytes_per_token"],
        "recompute_tokens": middle["tokens_computed"] - before["tokens_computed"],
        "pull_tokens": after["tokens_computed"] - middle["tokens_computed"],
        "same_output": recomputed.outputs[0].token_ids == own[0].outputs[0].token_ids
        and pulled.outputs[0].token_ids == own[1].outputs[0].token_ids,
        "cached_tokens": pulled.num_cached_tokens,
    }


def run(transport: str, args: argparse.Namespace) -> list[dict]:
    from router.launch.local import router_side

    model = None if args.model == "default" else args.model
    config = engine_config(
        model,
        num_blocks=4 * (args.doc_tokens // 16 + 2),
        max_model_len=args.doc_tokens + 64,
        kv_host_bytes=args.host_bytes,
        cluster_secret="kv-pull-benchmark",
    )
    hasher, _, _ = router_side(config, args.model)
    vocab = 1000
    groups = Groups(transport, config)
    try:
        rows = []
        for r in range(args.repeats + 1):  # the first is the warm-up
            docs = documents(2, args.doc_tokens, vocab, seed=r)
            question = [random.Random(100 + r).randrange(3, vocab) for _ in range(QUESTION_TOKENS)]
            row = asyncio.run(one_repeat(groups, docs, question, hasher, f"{transport}-{r}"))
            if r:
                rows.append(row)
    finally:
        groups.close()
    recompute = statistics.median(x["recompute_ttft_s"] for x in rows)
    pull = statistics.median(x["pull_ttft_s"] for x in rows)
    same = all(x["same_output"] for x in rows)
    common = {"transport": transport, "model": args.model, "doc_tokens": args.doc_tokens, "repeats": args.repeats}
    return [
        {
            **common,
            "case": "recompute",
            "ttft_s": round(recompute, 4),
            "question_tokens_computed": rows[-1]["recompute_tokens"],
            "same_output_as_holder": same,
            "ttft_over_recompute": 1.0,
        },
        {
            **common,
            "case": "pull",
            "ttft_s": round(pull, 4),
            "pull_s": round(statistics.median(x["pull_s"] for x in rows), 4),
            "blocks_pulled": rows[-1]["blocks"],
            "kv_mib_pulled": round(rows[-1]["kv_bytes"] / (1 << 20), 2),
            "question_tokens_computed": rows[-1]["pull_tokens"],
            "cached_tokens": rows[-1]["cached_tokens"],
            "same_output_as_holder": same,
            "ttft_over_recompute": round(pull / recompute, 4),
        },
    ]


def cold_burst(args: argparse.Namespace, questions: int = 16, once: bool = True) -> dict:
    """`questions` questions about one cold document sent at once through a router (the
    default policy, an in-process index) to two in-process groups: how many copies of the
    document the groups computed (their prefill counters, less the questions' own tokens),
    and the burst's TTFT. `once`: with the router's compute-once rule (a spilled question
    waits for the first group's commit and pulls, router/router.py COLD_WAIT_S), else
    without it (`cold_wait_s` 0: a spill recomputes, the peer)."""
    from cluster.index import InMemoryPrefixIndex
    from cluster.local_group import LocalGroup
    from router.launch.local import router_side
    from router.router import Router, RouteRequest

    model = None if args.model == "default" else args.model
    config = engine_config(
        model,
        num_blocks=4 * (args.doc_tokens // 16 + 2),
        max_model_len=args.doc_tokens + 64,
        kv_host_bytes=args.host_bytes,  # a pulled prefix lands in the puller's host tier
        cluster_secret="burst",
    )
    hasher, _, info = router_side(config, args.model)
    index = InMemoryPrefixIndex()
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(2)]
    doc = documents(1, args.doc_tokens, 1000, seed=7)[0]
    router = Router(groups, index, hasher, info)
    if not once:
        router.cold_wait_s = 0.0

    ttfts: list[float] = []

    async def burst() -> list:
        async def ask(q: int):
            request = RouteRequest(prompt_token_ids=doc + [q] * QUESTION_TOKENS, params=GREEDY)
            t0, out = time.perf_counter(), None
            async for o in router.generate(request):
                if out is None:
                    ttfts.append(time.perf_counter() - t0)
                out = o
            return out

        return await asyncio.gather(*(ask(3 + q) for q in range(questions)))

    try:
        t0 = time.perf_counter()
        outs = asyncio.run(burst())
        wall = time.perf_counter() - t0
        computed = [g.engine.engine.stats()["tokens_computed"] for g in groups]
    finally:
        for g in groups:
            g.shutdown()
    own = questions * (QUESTION_TOKENS + GREEDY.max_tokens - 1)  # the questions' and decodes' tokens
    records = [router.records[o.request_id] for o in outs]
    placed = [sum(r.group_id == g.group_id for r in records) for g in groups]
    return {
        "case": "cold_burst" if once else "cold_burst_recompute",
        "model": args.model,
        "doc_tokens": args.doc_tokens,
        "questions": questions,
        "placed_per_group": placed,
        "document_copies_computed": round((sum(computed) - own) / args.doc_tokens, 2),
        "cached_tokens": sorted(o.num_cached_tokens for o in outs),
        "pulled_per_group": [sum(r.pulled_blocks > 0 and r.group_id == g.group_id for r in records) for g in groups],
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "wall_s": round(wall, 3),
    }


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values`, nearest rank (of 16 values, p99 is the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def medians(rows: tuple[dict, ...], repeats: int) -> dict:
    """The median TTFT p50 and p99 of one case's runs, and how many runs."""
    keys = ("ttft_p50_s", "ttft_p99_s")
    return {"repeats": repeats, **{k: round(statistics.median(r[k] for r in rows), 3) for k in keys}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin", help="builtin, default, or a model directory")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-bytes", type=int, default=1 << 30, help="each group's host tier")
    p.add_argument("--transport", choices=("ray", "in_process", "both"), default="both")
    p.add_argument("--cold-burst", action="store_true", help="only the cold-document burst (in process)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.cold_burst:  # each case `repeats` times, alternating; the TTFTs are medians over them
        runs = [[cold_burst(args, once=False), cold_burst(args)] for _ in range(args.repeats)]
        peer, line = ({**r[-1], **medians(r, args.repeats)} for r in zip(*runs, strict=True))
        line["ttft_p50_over_recompute"] = round(line["ttft_p50_s"] / peer["ttft_p50_s"], 3)
        line["ttft_p99_over_recompute"] = round(line["ttft_p99_s"] / peer["ttft_p99_s"], 3)
        for x in (peer, line):
            print(json.dumps(x), flush=True)
        return [peer, line]
    transports = ("in_process", "ray") if args.transport == "both" else (args.transport,)
    lines = []
    for transport in transports:
        for line in run(transport, args):
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
