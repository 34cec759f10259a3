"""The engine with each KV cache dtype at one KV byte budget: what `benchmarks/engine.py
--kv-cache-dtype int8,fp8_e4m3` adds beside the 16-bit cache's run.

- throughput: the research-assistant trace with the pool sized by bytes (`--kv-tokens` tokens
  of the 16-bit cache), so that the 16-bit run fills its cache and queues or preempts while an
  8-bit one holds about twice the tokens: tokens/s, the most sequences running in one step,
  preemptions, and the tokens identical to the 16-bit run's.
- capacity: sequences of `--capacity-len` (8k) tokens (the prompt and `--capacity-out`
  generated tokens) admitted at once in the running engine, at the budget of
  `--capacity-seqs` such sequences in the 16-bit cache, against what the planner
  (`pagefleet plan`) says fits.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from benchmarks.workloads import BenchRequest

CAPACITY_MODEL = dict(  # a random llama with SmolLM2-135M's head geometry, one thin layer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=8448,
)


@dataclass
class KVRun:
    """One KV dtype's run of the trace."""

    kv_cache_dtype: str
    tokens: list[list[int]]
    ttft: list[float]
    wall_s: float
    max_running: int  # most requests running in one step
    stats: dict = field(default_factory=dict)


def budget_bytes(model_dir: str, kv_tokens: int, block_size: int, baseline: str) -> int:
    """KV bytes per device of `kv_tokens` tokens of the `baseline` (16-bit) cache."""
    from cluster.planner import KVShape

    return kv_tokens * KVShape.from_hf_config(model_dir, baseline, block_size).bytes_per_token()


def run_engine(model_dir: str, reqs: list[BenchRequest], dtype: str, budget: int, args) -> KVRun:
    """The trace on an engine whose pool is `budget` bytes of `dtype`, step by step."""
    from pagefleet.llm import LLM
    from worker.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        kv_cache_dtype=dtype,
        kv_cache_memory=budget,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(r.prompt_len + r.max_tokens for r in reqs),
    )
    engine = llm.engine
    llm.generate([list(reqs[0].prompt[:64])], SamplingParams(temperature=0, max_tokens=4))
    before = engine.stats()
    t0 = time.perf_counter()
    ids = [
        engine.add_request(list(r.prompt), SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
        for r in reqs
    ]
    done, max_running = {}, 0
    while engine.has_unfinished():
        outs = engine.step()
        max_running = max(max_running, len(outs))
        done.update((o.request_id, o) for o in outs if o.finished)
    wall = time.perf_counter() - t0
    after = engine.stats()
    outs = [done[i] for i in ids]
    stats = {
        "preemptions": after["preemptions"] - before["preemptions"],
        "blocks_total": after["blocks_total"],
        "kv_pool_bytes": after["kv_pool_bytes"],
        "kv_bytes_per_token": after["kv_bytes_per_token"],
    }
    return KVRun(dtype, [o.token_ids for o in outs], [o.metrics.ttft for o in outs], wall, max_running, stats)


def admitted_at_once(llm, num_requests: int, prompt_len: int, max_tokens: int) -> dict:
    """Queue `num_requests` distinct prompts of `prompt_len` random tokens and run them to the
    end (`max_tokens` each, EOS ignored). Returns the most sequences that held the blocks of
    their whole length (prompt + output) at once, and the preemptions."""
    from worker.sampling_params import SamplingParams

    engine = llm.engine
    bm, rng = engine.scheduler.bm, random.Random(0)
    vocab = engine.model_config.vocab_size
    need = -(-(prompt_len + max_tokens) // bm.block_size)  # blocks of one whole sequence
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(1, vocab) for _ in range(prompt_len)], params)
    before, peak = engine.stats()["preemptions"], 0
    while engine.has_unfinished():
        engine.step()
        held = sum(len(bm.block_ids(r.request_id)) >= need for r in engine.scheduler.running)
        peak = max(peak, held)
    return {"admitted_at_once": peak, "preemptions": engine.stats()["preemptions"] - before}


def capacity_case(model_dir: str, dtype: str, budget: int, args) -> dict:
    """8k-token sequences at once at `budget` bytes: the engine and the planner."""
    from cluster.planner import KVShape, plan
    from pagefleet.llm import LLM

    seq, prompt = args.capacity_len, args.capacity_len - args.capacity_out
    name = {"fp8_e4m3": "fp8", "auto": args.dtype}.get(dtype, dtype)
    shape = KVShape.from_hf_config(model_dir, name, args.block_size)
    planned = plan(shape, max_len=seq, device_memory=budget)
    # A step may prefill every queued sequence, so that only the memory limits admission.
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        kv_cache_dtype=dtype,
        kv_cache_memory=budget,
        block_size=args.block_size,
        max_model_len=seq,
        watermark=0.0,
        max_num_batched_tokens=seq * (planned.max_sequences + 1),
    )
    t0 = time.perf_counter()
    got = admitted_at_once(llm, planned.max_sequences + 1, prompt, args.capacity_out)
    return {
        "case": "capacity",
        "kv_cache_dtype": dtype,
        "budget_bytes": budget,
        "sequence_tokens": seq,
        "planned_sequences": planned.max_sequences,
        **got,
        "blocks_total": llm.stats()["blocks_total"],
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def throughput_line(run: KVRun, base: KVRun, reqs: list[BenchRequest]) -> dict:
    """One dtype's run against the 16-bit cache's."""
    generated = sum(map(len, run.tokens))
    tok_s = generated / run.wall_s
    base_tok_s = sum(map(len, base.tokens)) / base.wall_s
    same = sum(a == b for a, b in zip(run.tokens, base.tokens, strict=True)) / len(reqs)
    return {
        "case": "throughput",
        "kv_cache_dtype": run.kv_cache_dtype,
        "requests": len(reqs),
        "generated_tokens": generated,
        "wall_s": round(run.wall_s, 3),
        "gen_tok_s": round(tok_s, 2),
        "ratio_vs_16bit": round(tok_s / base_tok_s, 3),
        "max_running": run.max_running,
        "max_running_ratio_vs_16bit": round(run.max_running / base.max_running, 3),
        "identical_tokens_vs_16bit": round(same, 4),
        **run.stats,
    }


def kv_lines(model_dir: str, reqs: list[BenchRequest], args) -> list[dict]:
    """Every line of the KV-dtype comparison: throughput, capacity and accuracy per dtype."""
    from worker.model.builtin_model import make_model_dir

    dtypes = [args.kv_baseline, *args.kv_cache_dtype]
    budget = budget_bytes(model_dir, args.kv_tokens, args.block_size, args.kv_baseline)
    runs = {d: run_engine(model_dir, reqs, d, budget, args) for d in dtypes}
    lines = [throughput_line(runs[d], runs[args.kv_baseline], reqs) for d in dtypes]
    for line in lines:
        line["budget_bytes"] = budget
    capacity_dir = make_model_dir(
        args.tmp / "capacity",
        seed=args.seed,
        vocab_size=512,
        **{**CAPACITY_MODEL, "max_position_embeddings": args.capacity_len},
    )
    seq_bytes = budget_bytes(str(capacity_dir), args.capacity_len, args.block_size, args.kv_baseline)
    cap_budget = args.capacity_seqs * seq_bytes + seq_bytes // 2
    caps = [capacity_case(str(capacity_dir), d, cap_budget, args) for d in dtypes]
    for cap in caps:
        cap["ratio_vs_16bit"] = round(cap["admitted_at_once"] / caps[0]["admitted_at_once"], 3)
    if args.accuracy_tokens:
        accuracy = _accuracy(dtypes, args)
        for line in lines:
            line["accuracy"] = accuracy.get(line["kv_cache_dtype"])
    return lines + caps


def _accuracy(dtypes: list[str], args) -> dict[str, dict]:
    """kv_accuracy's engine cases on the real model (or --accuracy-model), by dtype."""
    from types import SimpleNamespace

    from benchmarks.kv_accuracy import real_model_dir, run_engine_cases
    from worker.model.builtin_model import builtin_model_path

    model, name = args.accuracy_model, args.accuracy_model
    if model is None:  # a smoke run uses the built-in model: it has a tokenizer, and no download
        model = str(builtin_model_path() if args.quick else real_model_dir())
        name = "built-in (random weights)" if args.quick else "SmolLM2-135M-Instruct"
    options = SimpleNamespace(tokens=args.accuracy_tokens, chunk=512)
    lines, _ = run_engine_cases(model, dtypes, options)
    keep = (
        "ppl_ratio",
        "kl_mean",
        "argmax_agreement",
        "greedy_prefix_fraction",
        "greedy_identical_prompts",
        "greedy_prompts",
    )
    return {
        line["kv_cache_dtype"]: {"model": name, "text_tokens": args.accuracy_tokens} | {k: line[k] for k in keep}
        for line in lines
    }
