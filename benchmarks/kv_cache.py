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
        model_dir, kv_cache_dtype=dtype, kv_cache_memory=budget, block_size=args.block_size,
        max_num_batched_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max(r.prompt_len + r.max_tokens for r in reqs),
    )  # fmt: skip
    engine = llm.engine
    llm.generate([list(reqs[0].prompt[:64])], SamplingParams(temperature=0, max_tokens=4))
    before = engine.stats()
    t0 = time.perf_counter()
    ids = [
        engine.add_request(
            list(r.prompt), SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        )  # fmt: skip
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
    return KVRun(dtype, [o.token_ids for o in outs], [o.metrics.ttft for o in outs], wall, max_running, stats)  # fmt: skip


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
    name = {"fp8_e4m3": "fp8", "auto": "float32"}.get(dtype, dtype)
    shape = KVShape.from_hf_config(model_dir, name, args.block_size)
    planned = plan(shape, max_len=seq, device_memory=budget)
    # A step may prefill every queued sequence, so that only the memory limits admission.
    llm = LLM(
        model_dir, kv_cache_dtype=dtype, kv_cache_memory=budget, block_size=args.block_size,
        max_model_len=seq, watermark=0.0, max_num_batched_tokens=seq * (planned.max_sequences + 1),
    )  # fmt: skip
    t0 = time.perf_counter()
    got = admitted_at_once(llm, planned.max_sequences + 1, prompt, args.capacity_out)
    return {
        "case": "capacity", "kv_cache_dtype": dtype, "budget_bytes": budget,
        "sequence_tokens": seq, "planned_sequences": planned.max_sequences, **got,
        "blocks_total": llm.stats()["blocks_total"], "wall_s": round(time.perf_counter() - t0, 2),
    }  # fmt: skip
