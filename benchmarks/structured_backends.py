"""xgrammar, the engine's grammar engine (worker/engine/grammar.py), against llguidance on the
same JSON Schemas and the same model's tokenizer: the measurement behind the choice.

    python -m benchmarks.structured_backends            # the default model's tokenizer
    python -m benchmarks.structured --backends          # as a case of the structured benchmark

For every schema of tests/structured_schemas.py: compile time (xgrammar: `compile_grammar` of the
schema's grammar as the engine writes it; llguidance: its matcher built, which is where it
compiles lazily, with the engine's separators, `, ` and `: `), then one output's tokens, drawn at
random under xgrammar's mask (seeded), fed to both matchers of all schemas at once, batch 32:
the time to fill one step's 32 bitmask rows, per engine, on one thread. `agreed` counts the
outputs llguidance also accepted token by token. llguidance is the `bench` extra, not a runtime
dependency.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tests.structured_schemas import SCHEMAS
from worker.engine.grammar import json_strings

BATCH = 32
MAX_TOKENS = 120


def _xgrammar(tokenizer, vocab: int, stops: list[int]):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stops)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(schema: dict):
        text = json.dumps(schema)
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        return compiler.compile_grammar(json_strings(str(grammar)))

    return xgr, compile_


def _llguidance(tokenizer, vocab: int, stops: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=stops)
    defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def matcher(schema: dict):
        return llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults))

    return llguidance, matcher


def _walk(xgr, compiled, vocab: int, seed: int) -> list[int]:
    """One output's tokens: a random allowed token each step, until the grammar ends."""
    rng, matcher = random.Random(seed), xgr.GrammarMatcher(compiled)
    bitmask, tokens = xgr.allocate_token_bitmask(1, vocab), []
    while not matcher.is_terminated() and len(tokens) < MAX_TOKENS:
        matcher.fill_next_token_bitmask(bitmask)
        bits = bitmask[0].numpy().view("uint32")
        allowed = [w * 32 + b for w in bits.nonzero()[0].tolist() for b in range(32) if int(bits[w]) >> b & 1]
        token = rng.choice([t for t in allowed if t < vocab])
        matcher.accept_token(token)
        tokens.append(token)
    return tokens


def _accepts(matcher, tokens: list[int], stops: list[int]) -> bool:
    """Whether llguidance's matcher takes the output's tokens and then may stop there (it
    treats the stop token as the end, not as a token it consumes)."""
    body = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    return matcher.try_consume_tokens(body) == len(body) and matcher.is_accepting()


def backends_case_from(tokenizer, vocab: int, stops: list[int]) -> dict:
    """The comparison over the schema suite, for one tokenizer."""
    xgr, xgr_compile = _xgrammar(tokenizer, vocab, stops)
    llg, llg_matcher = _llguidance(tokenizer, vocab, stops)
    import llguidance.torch as llg_torch

    xgr_ms, llg_ms, compiled, lmatchers = [], [], [], []
    for schema in SCHEMAS:
        t0 = time.perf_counter()
        compiled.append(xgr_compile(schema))
        t1 = time.perf_counter()
        lmatchers.append(llg_matcher(schema))
        t2 = time.perf_counter()
        xgr_ms.append(1e3 * (t1 - t0))
        llg_ms.append(1e3 * (t2 - t1))
    outputs = [_walk(xgr, c, vocab, seed) for seed, c in enumerate(compiled)]
    agreed = sum(_accepts(llg_matcher(s), o, stops) for s, o in zip(SCHEMAS, outputs, strict=True))
    x_steps, l_steps = [], []
    for first in range(0, len(SCHEMAS) - BATCH + 1, BATCH):  # batches of 32 schemas decoding together
        idx = list(range(first, first + BATCH))
        xm = [xgr.GrammarMatcher(compiled[i]) for i in idx]
        lm = [llg_matcher(SCHEMAS[i]) for i in idx]
        xb, lb = xgr.allocate_token_bitmask(BATCH, vocab), llg_torch.allocate_token_bitmask(BATCH, vocab)
        for step in range(max(len(outputs[i]) for i in idx)):
            live = [j for j, i in enumerate(idx) if step < len(outputs[i])]
            t0 = time.perf_counter()
            for j in live:
                xm[j].fill_next_token_bitmask(xb, j)
            t1 = time.perf_counter()
            for j in live:
                llg_torch.fill_next_token_bitmask(lm[j], lb, j)
            t2 = time.perf_counter()
            if len(live) == BATCH:  # a full batch's step
                x_steps.append(1e3 * (t1 - t0))
                l_steps.append(1e3 * (t2 - t1))
            for j in live:
                token = outputs[idx[j]][step]
                xm[j].accept_token(token)
                lm[j].consume_token(token)
    xs, ls = statistics.median(x_steps), statistics.median(l_steps)
    return {
        "case": "backends",
        "schemas": len(SCHEMAS),
        "vocab": vocab,
        "xgrammar_compile_ms_median": round(statistics.median(xgr_ms), 3),
        "xgrammar_compile_ms_max": round(max(xgr_ms), 3),
        "llguidance_compile_ms_median": round(statistics.median(llg_ms), 3),
        "llguidance_compile_ms_max": round(max(llg_ms), 3),
        "batch": BATCH,
        "full_steps": len(x_steps),
        "xgrammar_mask_ms_per_step": round(xs, 3),
        "llguidance_mask_ms_per_step": round(ls, 3),
        "llguidance_vs_xgrammar_mask": round(ls / xs, 3),
        "agreed": agreed,  # outputs (of one per schema) llguidance accepts too
        "llguidance_version": llg.__version__,
    }


def backends_case(engine) -> dict:
    """The comparison on an engine's tokenizer and vocabulary."""
    return backends_case_from(engine.tokenizer, engine.model_config.vocab_size, list(engine.eos_token_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory, .gguf, 'builtin' (default: the default model)")
    args = ap.parse_args()
    from pagefleet.llm import engine_config
    from worker.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(engine_config(args.model, num_blocks=64, max_model_len=512))
    print(json.dumps(backends_case(engine)), flush=True)


if __name__ == "__main__":
    main()
