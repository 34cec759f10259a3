"""KV tiers on the real engine (CPU): a document evicted from the pool, restored or recomputed.

    python -m benchmarks.kv_tiers --model builtin --doc-tokens 2048
    python -m benchmarks.kv_tiers --model default --doc-tokens 2048

One engine per case, the same document and question: the document is read once, evicted from
the device pool by two others of its size, then asked about again. Cases: `recompute` (no
tier: the question recomputes the document), `host` (a host tier: restored), `disk` (a host
tier of one document over a disk tier: restored from files, synchronously, the other
document's blocks demoted to make room in the same wait), `restart` (as `disk`, but the
engine is shut down once the document is on the disk and the question goes to a new engine on
the same directory and secret: its host tier is empty, the disk inventory reopened; its peer,
`restart_recompute_ttft_s`, a new engine with no tier asked the same first question: both
pay a fresh engine's first steps), and
`device` (a pool that holds all three documents: the device hit every restore is measured
against). One JSON line per case:
the question's TTFT, the prompt tokens the engine computed for it, the tokens restored by
tier, and the same-run ratios against `recompute` and `device`; then a line with the restore
copy alone (`HostTier.apply` over the document's blocks) per block against the recompute per
block; then `write_back`: output tokens/s of a workload with no reuse on a pool it overflows,
with and without a host tier (each eviction is then a save), and their ratio.

    python -m benchmarks.kv_tiers --model default --cases revisits

`revisits` is the library workload instead: documents totalling 4x the device pool, each
visited in several rounds by a burst of questions sent together, every other document read in
between (so each revisit finds its document evicted from the pool). Three engines on the same
trace: no tier, a host tier of 4x the pool, and a host tier of 1x over a disk tier of 8x. One
line per engine: prompt tokens computed, tokens restored per tier, TTFT p50/p99, output
tokens/s; the tiered lines carry their ratios against the untiered one.

    python -m benchmarks.kv_tiers --model builtin --cases disk_async

`disk_async`: a request decodes while another's document is read from a slow disk tier, once
with the reads between steps (sync) and once off the step (async): the decode's step times
(its longest is the stall a read puts on it) and the loading request's TTFT, with the ratios.

    python -m benchmarks.kv_tiers --model default --cases restore_bandwidth --device cuda

`restore_bandwidth`: the host tier's restore into the pool against a plain pinned host-to-device
copy of the same bytes (scripts/gpu_check.sh runs it on a CUDA device).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from pagefleet.llm import LLM
from worker.sampling_params import SamplingParams
from worker.step import KVMoves

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def documents(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def question_ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(TTFT in seconds, tokens the engine computed for it, its output) of one request."""
    engine = llm.engine
    before = engine.stats()["tokens_computed"]
    out = llm.generate([prompt], GREEDY)[0]
    m = out.metrics
    return m.first_token_time - m.arrival_time, engine.stats()["tokens_computed"] - before, out.outputs[0].token_ids


def run_case(model: str, case: str, docs, question, blocks: int, block_bytes: int, repeats: int) -> dict:
    """The document, two others, then the question on the document again (`repeats` times,
    each after evicting it again); the median TTFT."""
    options = dict(block_size=16, num_blocks=blocks, max_model_len=len(docs[0]) + 64, watermark=0.0)
    tmp = None
    if case == "device":
        options["num_blocks"] = 4 * blocks
    elif case == "host":
        options["kv_host_bytes"] = 8 * blocks * block_bytes
    elif case == "disk":
        tmp = tempfile.TemporaryDirectory()
        # a host tier of one document: the next one's blocks push it down to the disk
        options.update(kv_host_bytes=blocks * block_bytes, kv_disk_bytes=8 * blocks * block_bytes, kv_disk_dir=tmp.name)
    llm = LLM(model, **options)
    ttfts, computed, out = [], [], None
    for r in range(repeats):
        for d in docs:  # the document, then two that evict it from the pool (not with `device`)
            llm.generate([d + [r + 3]], GREEDY)
        t, c, out = question_ttft(llm, docs[0] + question)
        ttfts.append(t)
        computed.append(c)
    stats = llm.engine.stats()
    llm.engine.executor.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return {
        "case": case,
        "doc_tokens": len(docs[0]),
        "ttft_s": round(statistics.median(ttfts), 4),
        "question_tokens_computed": int(statistics.median(computed)),
        "restored_tokens_host": stats["kv_host_hits"],
        "restored_tokens_disk": stats["kv_disk_hits"],
        "output": out,
    }


def restart_case(model: str, docs, question, blocks: int, block_bytes: int, repeats: int) -> dict:
    """The document pushed down to the disk by an engine that then stops (the documents after
    it push it out of the pool, then out of the host tier, whose content a stop loses), and the
    question asked of a new engine on the same directory (`repeats` times, a fresh pair each);
    the median TTFT of the new engine's first question."""
    tmp = tempfile.TemporaryDirectory()
    options = dict(
        block_size=16,
        num_blocks=blocks,
        max_model_len=len(docs[0]) + 64,
        watermark=0.0,
        kv_host_bytes=blocks * block_bytes,  # one document: the next pushes it to the disk
        kv_disk_bytes=8 * blocks * block_bytes,
        kv_disk_dir=tmp.name,
        cluster_secret="kv-tiers-benchmark",  # (the same names after the restart)
    )
    no_tiers = {k: v for k, v in options.items() if not k.startswith("kv_")}
    ttfts, cold, computed, restored, out = [], [], [], [], None
    for r in range(repeats):
        first = LLM(model, **options)
        for d in docs:
            first.generate([d + [r + 3]], GREEDY)
        first.engine.executor.shutdown()  # (the directory's lock goes with it)
        again = LLM(model, **options)
        t, c, out = question_ttft(again, docs[0] + question)
        ttfts.append(t)
        computed.append(c)
        restored.append(again.engine.stats()["kv_disk_hits"])
        again.engine.executor.shutdown()
        # the peer: a new engine with no tier, whose first question recomputes the document
        cold.append(question_ttft(LLM(model, **no_tiers), docs[0] + question)[0])
    tmp.cleanup()
    return {
        "case": "restart",
        "doc_tokens": len(docs[0]),
        "ttft_s": round(statistics.median(ttfts), 4),
        "question_tokens_computed": int(statistics.median(computed)),
        "restored_tokens_host": 0,
        "restored_tokens_disk": int(statistics.median(restored)),
        "restart_recompute_ttft_s": round(statistics.median(cold), 4),
        "ttft_over_restart_recompute": round(statistics.median(ttfts) / statistics.median(cold), 4),
        "output": out,
    }


def restore_copy(model: str, blocks: int, doc_blocks: int, bb: int, block_size: int = 16) -> tuple[float, int]:
    """Seconds of one HostTier.apply restoring `doc_blocks` blocks (the median of 5), and a
    block's bytes; `bb`: at least a block's bytes (sizes the host tier)."""
    llm = LLM(
        model,
        block_size=block_size,
        num_blocks=blocks,
        max_model_len=blocks * block_size,
        kv_host_bytes=doc_blocks * bb,
    )
    tier = llm.engine.executor.worker.host_tier
    moves = KVMoves(loads=[(i, i) for i in range(doc_blocks)])
    tier.apply(moves)  # warm
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        tier.apply(moves)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tier.block_bytes


def write_back(model: str, blocks: int, block_bytes: int, prompt_tokens: int, n: int) -> dict:
    """Output tokens/s of `n` distinct prompts (no reuse) on a pool they overflow, without
    and with a host tier (which saves every block the pool evicts)."""
    prompts = documents(n, prompt_tokens, 200, seed=99)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rates = {}
    for name, extra in (("off", {}), ("on", {"kv_host_bytes": 8 * blocks * block_bytes})):
        llm = LLM(model, block_size=16, num_blocks=blocks, max_model_len=prompt_tokens + 64, **extra)
        llm.generate(prompts[:2], params)  # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        saves = llm.engine.stats()["kv_host_saves"]
    return {
        "case": "write_back",
        "prompt_tokens": prompt_tokens,
        "requests": n,
        "tokens_per_s_off": round(rates["off"], 1),
        "tokens_per_s_on": round(rates["on"], 1),
        "on_over_off": round(rates["on"] / rates["off"], 3),
        "blocks_saved": saves,
    }


def revisits(model: str | None, doc_tokens: int, vocab: int, block_bytes: int, seed: int = 0) -> list[dict]:
    """The library workload of the module docstring; one line per tier configuration."""
    n_docs, rounds, burst = 8, 5, 3
    docs = documents(n_docs, doc_tokens, vocab, seed=seed)
    doc_blocks = doc_tokens // 16
    pool = n_docs * doc_blocks // 4 + burst + 1  # the documents are 4x the pool (+ a burst's questions)
    rng = random.Random(seed)
    order = []
    for _ in range(rounds):  # each round visits every document once, in a new order
        visit = list(range(n_docs))
        rng.shuffle(visit)
        if order and visit[0] == order[-1]:  # never the same document twice in a row
            visit.append(visit.pop(0))
        order += visit
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    configs = {
        "none": {},
        "host": {"kv_host_bytes": 4 * pool * block_bytes},
    }
    tmp = tempfile.TemporaryDirectory()
    configs["host_disk"] = {
        "kv_host_bytes": pool * block_bytes,
        "kv_disk_bytes": 8 * pool * block_bytes,
        "kv_disk_dir": tmp.name,
    }
    lines, outputs = [], {}
    for name, extra in configs.items():
        llm = LLM(model, block_size=16, num_blocks=pool, max_model_len=doc_tokens + 64, watermark=0.0, **extra)
        llm.generate([[5, 6, 7]], params)  # warm
        ttfts, computed, tokens, outs = [], 0, 0, []
        t0 = time.perf_counter()
        for visit, d in enumerate(order):
            prompts = [docs[d] + [11 + q, 12 + visit % 50] for q in range(burst)]
            for o in llm.generate(prompts, params):
                m = o.metrics
                ttfts.append(m.first_token_time - m.arrival_time)
                computed += len(o.prompt_token_ids) - o.num_cached_tokens
                tokens += len(o.outputs[0].token_ids)
                outs.append(tuple(o.outputs[0].token_ids))
        wall = time.perf_counter() - t0
        stats = llm.engine.stats()
        llm.engine.executor.shutdown()
        ttfts.sort()
        outputs[name] = outs
        lines.append(
            {
                "case": "revisits",
                "tiers": name,
                "documents": n_docs,
                "doc_tokens": doc_tokens,
                "docs_over_pool": round(n_docs * doc_blocks / pool, 2),
                "requests": len(ttfts),
                "prompt_tokens_computed": computed,
                "restored_tokens_host": stats["kv_host_hits"],
                "restored_tokens_disk": stats["kv_disk_hits"],
                "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
                "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
                "output_tok_s": round(tokens / wall, 1),
            }
        )
    tmp.cleanup()
    base = lines[0]
    for line in lines:
        line["same_output_as_none"] = outputs[line["tiers"]] == outputs["none"]
        if line is not base:
            line["computed_fall"] = round(1 - line["prompt_tokens_computed"] / base["prompt_tokens_computed"], 4)
            line["ttft_p50_speedup"] = round(base["ttft_p50_s"] / line["ttft_p50_s"], 2)
            line["output_tok_s_ratio"] = round(line["output_tok_s"] / base["output_tok_s"], 3)
    return lines


def disk_async(model: str | None, doc_tokens: int, vocab: int, block_bytes: int, delay_s: float = 0.002) -> list[dict]:
    """A decoding request's TPOT while another request's document is read from the disk tier
    (each block read `delay_s` slower, a slow disk), with the reads off the step (async) and
    between steps (sync), the same engine settings otherwise; and the loading request's TTFT."""
    docs = documents(3, doc_tokens, vocab, seed=7)
    blocks = doc_tokens // 16 + 8
    lines = []
    for mode in ("sync", "async"):
        tmp = tempfile.TemporaryDirectory()
        llm = LLM(
            model,
            block_size=16,
            num_blocks=blocks + 32,
            max_model_len=doc_tokens + 64,
            watermark=0.0,
            kv_host_bytes=blocks * block_bytes,  # one document: the next pushes it to the disk
            kv_disk_bytes=8 * blocks * block_bytes,
            kv_disk_dir=tmp.name,
            kv_disk_async=mode == "async",
            kv_disk_read_delay_s=delay_s,
        )
        for d in docs:  # document 0 goes down to the disk
            llm.generate([d + [3]], GREEDY)
        engine = llm.engine
        long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        engine.add_request([9, 8, 7, 6, 5], long, request_id="decode")
        engine.step()
        times, ttft, t_add = [], None, None
        n = 0
        while engine.has_unfinished():
            if n == 4:
                t_add = time.perf_counter()
                engine.add_request(docs[0] + [7, 8, 9], GREEDY, request_id="revisit")
            n += 1
            t0 = time.perf_counter()
            for o in engine.step():
                if o.request_id == "decode":
                    times.append(time.perf_counter() - t0)
                elif ttft is None and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t_add
        stats = engine.stats()
        engine.executor.shutdown()
        tmp.cleanup()
        gaps = sorted(times)
        lines.append(
            {
                "case": "disk_async",
                "mode": mode,
                "doc_tokens": doc_tokens,
                "read_delay_s_per_block": delay_s,
                "restored_tokens_disk": stats["kv_disk_hits"],
                "decode_step_ms_p50": round(1e3 * gaps[len(gaps) // 2], 2),
                "decode_step_ms_max": round(1e3 * gaps[-1], 2),
                "loading_ttft_s": round(ttft, 4),
            }
        )
    sync, async_ = lines
    async_["decode_step_max_over_sync"] = round(async_["decode_step_ms_max"] / sync["decode_step_ms_max"], 3)
    async_["loading_ttft_over_sync"] = round(async_["loading_ttft_s"] / sync["loading_ttft_s"], 3)
    return lines


def restore_bandwidth(model: str | None, device: str, blocks: int = 256) -> dict:
    """Host -> device restore bandwidth: `HostTier.apply` loading `blocks` blocks (the restore
    path itself: an indexed read of the host slots, the copy, an indexed write into the pool),
    slots and blocks in the same order (one run) and `scattered` (none), against a plain copy
    of the same bytes from pinned host memory (pageable on a CPU device) to the device, the
    copy engine's own rate, and against `plain`, the byte-wise indexed copies through pageable
    memory that the restore once made; the median of 15 each."""
    import torch

    probe = LLM(model, device=device, block_size=16, num_blocks=8, max_model_len=64)
    bb = probe.engine.stats()["kv_block_bytes"]
    probe.engine.executor.shutdown()
    llm = LLM(
        model, device=device, block_size=16, num_blocks=blocks, max_model_len=blocks * 16, kv_host_bytes=blocks * bb
    )
    tier = llm.engine.executor.worker.host_tier
    moves = KVMoves(loads=[(i, i) for i in range(blocks)])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    # the blocks in another order than the slots: no run of consecutive slots and blocks
    scattered = KVMoves(loads=list(zip(range(blocks), random.Random(0).sample(range(blocks), blocks), strict=True)))

    def plain(m: KVMoves) -> None:  # the indexed copies on bytes that HostTier.apply once made
        slots, ids = (torch.tensor([p[i] for p in m.loads]) for i in (0, 1))
        for d, h in zip(tier.device_tensors, tier.host_tensors, strict=True):
            d.index_copy_(0, ids.to(device), h.index_select(0, slots).to(device))

    restore_s = timed(lambda: tier.apply(moves))
    scattered_s = timed(lambda: tier.apply(scattered))
    plain_s, plain_scattered_s = timed(lambda: plain(moves)), timed(lambda: plain(scattered))
    nbytes = blocks * tier.block_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    memcpy_s = timed(lambda: dst.copy_(src, non_blocking=True))
    llm.engine.executor.shutdown()
    return {
        "case": "restore_bandwidth",
        "device": device,
        "blocks": blocks,
        "block_bytes": tier.block_bytes,
        "restore_gb_s": round(nbytes / restore_s / 1e9, 2),
        "memcpy_gb_s": round(nbytes / memcpy_s / 1e9, 2),
        "restore_over_memcpy": round(memcpy_s / restore_s, 3),
        "scattered_over_memcpy": round(memcpy_s / scattered_s, 3),
        "plain_over_memcpy": round(memcpy_s / plain_s, 3),
        "plain_scattered_over_memcpy": round(memcpy_s / plain_scattered_s, 3),
        "restore_over_plain": round(plain_s / restore_s, 2),
        "scattered_over_plain": round(plain_scattered_s / scattered_s, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin", help="builtin, default, or a model directory")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--cases",
        default="recompute,host,disk,device,restart",
        help="the TTFT cases to run (recompute and device always: the peers); restore_copy and "
        "write_back run with all of them; `revisits`, `disk_async` or `restore_bandwidth` alone "
        "runs that case",
    )
    p.add_argument("--device", default="cpu", help="with --cases restore_bandwidth: cpu or cuda")
    args = p.parse_args(argv)
    model = None if args.model == "default" else args.model
    if args.cases == "restore_bandwidth":
        print(json.dumps(restore_bandwidth(model, args.device)), flush=True)
        return
    probe = LLM(model, block_size=16, num_blocks=8, max_model_len=64)
    stats, vocab = probe.engine.stats(), probe.engine.model_config.vocab_size
    block_bytes = stats["kv_bytes_per_token"] * 16
    del probe
    if args.cases in ("revisits", "disk_async"):
        run = revisits if args.cases == "revisits" else disk_async
        for line in run(model, args.doc_tokens, vocab, block_bytes):
            print(json.dumps(line), flush=True)
        return
    cases = ["recompute", *(c for c in ("host", "disk") if c in args.cases), "device"]
    doc_blocks = args.doc_tokens // 16
    blocks = doc_blocks + 8  # one document and its question at a time
    docs = documents(3, args.doc_tokens, vocab)
    question = [7, 8, 9, 10]
    results = {}
    for case in cases:
        results[case] = run_case(model, case, docs, question, blocks, block_bytes, args.repeats)
    if "restart" in args.cases:  # two more documents: the first one's head leaves the host too
        pushed = docs + documents(2, args.doc_tokens, vocab, seed=1)
        results["restart"] = restart_case(model, pushed, question, blocks, block_bytes, args.repeats)
    same = len({tuple(r.pop("output")) for r in results.values()}) == 1
    for r in results.values():
        r["same_output_as_others"] = same
        r["ttft_over_recompute"] = round(r["ttft_s"] / results["recompute"]["ttft_s"], 4)
        r["ttft_over_device_hit"] = round(r["ttft_s"] / results["device"]["ttft_s"], 3)
        print(json.dumps(r), flush=True)
    if len(results) < 5:
        return
    copy_s, bb = restore_copy(model, blocks, doc_blocks, block_bytes)
    recompute = results["recompute"]
    per_block_recompute = (recompute["ttft_s"] - results["device"]["ttft_s"]) / doc_blocks
    line = {
        "case": "restore_copy",
        "blocks": doc_blocks,
        "block_bytes": bb,
        "restore_s_per_block": round(copy_s / doc_blocks, 8),
        "restore_gb_s": round(doc_blocks * bb / copy_s / 1e9, 2),
        "recompute_s_per_block": round(per_block_recompute, 6),
        "restore_over_recompute": round(copy_s / doc_blocks / per_block_recompute, 5),
    }
    print(json.dumps(line), flush=True)
    print(json.dumps(write_back(model, blocks, block_bytes, 256, 3 * blocks * 16 // 256)), flush=True)


if __name__ == "__main__":
    main()
