"""The three systems that benchmarks/engine.py puts side by side, each a function that runs the
whole trace on one model directory and returns a `SystemRun`: pagefleet's `LLM`, transformers'
continuous batching (driven as `generate_batch` drives it) and transformers' static `generate`.
How each number is measured is in benchmarks/engine.py's docstring.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.flops import StepClock
from benchmarks.workloads import BenchRequest


@dataclass
class SystemRun:
    """What one system produced on the trace, in request order."""

    name: str
    tokens: list[list[int]]  # generated token ids per request (only the requested ones)
    ttft: list[float]  # seconds per request, from t=0
    wall_s: float
    peak_rss_bytes: int
    prefix_hit_rate: float | None
    config: dict = field(default_factory=dict)
    error: str | None = None
    cached_tokens: list[int] | None = None  # prompt tokens served from a prefix cache, per request
    figures: dict = field(default_factory=dict)  # a system's own extra figures (its JSON line)


# ---- measurement helpers ------------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak RSS rise over the block: VmHWM after, minus VmRSS before (HWM reset at entry)."""

    def __enter__(self) -> PeakRss:
        self.reset = True
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.reset = False  # then the peak is the process's, since it started
        self.before = _status_kb("VmRSS")
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = max(0, _status_kb("VmHWM") - self.before) * 1024


# ---- shared by the runners ----------------------------------------------------------------
def load_hf(model_dir: str, args):
    """transformers' model from a model directory or a GGUF file (dequantized), in the run's
    dtype on its device."""
    from transformers import AutoModelForCausalLM

    from worker.model_source import is_gguf

    path = Path(model_dir)
    where = dict(gguf_file=path.name) if is_gguf(path) else {}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent if is_gguf(path) else path,
        dtype=getattr(torch, args.dtype),
        attn_implementation="sdpa",
        **where,
    )
    return model.to(args.device).eval()


def _warmup_prompt(vocab_size: int) -> list[int]:
    g = torch.Generator().manual_seed(12345)
    return torch.randint(1, vocab_size, (64,), generator=g).tolist()


# ---- pagefleet ----------------------------------------------------------------------------
def run_pagefleet(model_dir: str, reqs: list[BenchRequest], args, vocab: int) -> SystemRun:
    from pagefleet.llm import LLM
    from worker.sampling_params import SamplingParams

    options = dict(
        block_size=args.block_size,
        num_blocks=args.kv_tokens // args.block_size,
        max_num_batched_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.kv_tokens,  # at most the pool (the engine caps it at the model's)
        device=args.device,
        dtype=args.dtype,
        weight_dtype=getattr(args, "weight_dtype", "auto"),
    )
    with PeakRss() as mem:
        llm = LLM(model_dir, **options)
        llm.generate([_warmup_prompt(vocab)], SamplingParams(temperature=0, max_tokens=4))
        before = llm.stats()
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        prompts = [list(r.prompt) for r in reqs]
        clock = StepClock(args.model_flops)
        clock.wrap(llm.engine.executor)
        profiler = cProfile.Profile() if args.profile else None
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        outs = llm.generate(prompts, params)
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - t0
        after = llm.stats()
    if profiler:
        print_profile(profiler, wall)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return SystemRun(
        "pagefleet",
        [list(o.token_ids) for o in outs],
        [o.metrics.ttft for o in outs],
        wall,
        mem.bytes,
        hits / queries if queries else None,
        {
            **options,
            "max_model_len": llm.engine.max_model_len,
            "attention_backend": "triton" if args.device.startswith("cuda") else "torch",
            "preemptions": after["preemptions"],
            "kv_pool_mb": round(after["kv_pool_bytes"] / 2**20, 1),
            "profiled": bool(profiler),
        },
        cached_tokens=[o.num_cached_tokens for o in outs],
        figures=clock.prefill_figures(),
    )


# ---- the profile --------------------------------------------------------------------------
BREAKDOWN = {  # label -> (file name, function name) whose cumulative time it is
    "engine.step (all)": ("llm_engine.py", "step"),
    "scheduler.schedule": ("scheduler.py", "schedule"),
    "scheduler.update_from_output": ("scheduler.py", "update_from_output"),
    "model_runner.prepare (inputs)": ("model_runner.py", "prepare"),
    "model forward (all)": ("llama.py", "forward"),
    "  attention (torch_sdpa.py)": ("torch_sdpa.py", "paged_attention_sdpa"),
    "    its decode batch": ("torch_sdpa.py", "_decode"),
    "    its prefill chunks": ("torch_sdpa.py", "_prefill"),
    "  attention (torch_ref.py)": ("torch_ref.py", "paged_attention_torch"),
    "  write_kv_torch": ("torch_ref.py", "write_kv_torch"),
    "  torch linear (matmuls)": ("~", "<built-in method torch._C._nn.linear>"),
    "compute_logits": ("llama.py", "compute_logits"),
    "sampler": ("sampler.py", "__call__"),
    "engine._progress (outputs)": ("llm_engine.py", "_progress"),
}


def print_profile(profiler: cProfile.Profile, wall: float) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for key in ("cumulative", "tottime"):
        out.write(f"\n==== pagefleet under cProfile: top 25 by {key} ====\n")
        stats.sort_stats(key).print_stats(25)
    out.write(f"\n==== breakdown: cumulative seconds, share of the profiled {wall:.2f} s ====\n")
    for label, secs in profile_breakdown(stats).items():
        out.write(f"{label:34s} {secs:8.3f} s  {100 * secs / wall:5.1f} %\n")
    print(out.getvalue(), file=sys.stderr)


def profile_breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds per BREAKDOWN entry; of same-named functions in one file, the
    largest (e.g. the outermost `forward` of llama.py is the whole model)."""
    result = {}
    for label, (file, func) in BREAKDOWN.items():
        result[label] = max(
            (cum for (f, _, fn), (_, _, _, cum, _) in stats.stats.items() if fn == func and Path(f).name == file),
            default=0.0,
        )
    return result


# ---- transformers continuous batching -----------------------------------------------------
class _PrefixMatchCounter:
    """Wraps PagedAttentionCache.search_prefix_match to record the tokens matched per request
    (it may be called again while a request waits; a request's hit is its largest match)."""

    def __enter__(self) -> _PrefixMatchCounter:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        self.cls, self.orig, self.matched = PagedAttentionCache, None, {}
        self.orig = PagedAttentionCache.search_prefix_match
        orig, matched = self.orig, self.matched

        def counted(cache, request_id, prompt_ids):
            n = orig(cache, request_id, prompt_ids)
            matched[request_id] = max(n, matched.get(request_id, 0))
            return n

        PagedAttentionCache.search_prefix_match = counted
        return self

    def __exit__(self, *exc) -> None:
        self.cls.search_prefix_match = self.orig


def run_generate_batch(model_dir: str, reqs: list[BenchRequest], args, vocab: int) -> SystemRun:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page = args.hf_page_size or args.block_size
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=args.kv_tokens // page,  # the same KV capacity, in tokens, as pagefleet's
        max_batch_tokens=args.max_batch_tokens,  # the same token budget per step
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=True,  # its prefix cache
        auto_switch_to_flash=False,  # no flash attention on CPU: keep sdpa
    )
    gen_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in reqs),
        eos_token_id=-1,
        pad_token_id=0,
    )
    # generate_batch takes one max_new_tokens for all requests; the trace needs one per
    # request, so this drives the same manager the way generate_batch does (its context
    # manager, its workload hints, its prefix-friendly submission order), with per-request
    # max_new_tokens through add_request.
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in reqs),
        max_generated_length=gen_config.max_new_tokens,
        num_requests=len(reqs),
    )
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].prompt, reverse=True)
    with PeakRss() as mem, _PrefixMatchCounter() as prefix:
        model = load_hf(model_dir, args)
        model.generate_batch([_warmup_prompt(vocab)], gen_config, cb_config, max_new_tokens=4)
        prefix.matched.clear()
        results = {}
        with (
            torch.no_grad(),
            model.continuous_batching_context_manager(
                generation_config=gen_config,
                continuous_batching_config=cb_config,
                block=True,
                timeout=60,
                workload_hints=hints,
            ) as manager,
        ):
            t0 = time.perf_counter()
            for i in order:
                manager.add_request(
                    list(reqs[i].prompt),
                    request_id=f"r{i}",
                    max_new_tokens=reqs[i].max_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            while len(results) < len(reqs):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    results[res.request_id] = res
                elif res is None and not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped early")
            wall = time.perf_counter() - t0
            resolved = manager.continuous_batching_config
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]}")
    outs = [results[f"r{i}"] for i in range(len(reqs))]
    prompt_tokens = sum(r.prompt_len for r in reqs)
    return SystemRun(
        "generate_batch",
        [list(o.generated_tokens) for o in outs],
        [o.timestamps[0] - t0 for o in outs],
        wall,
        mem.bytes,
        sum(prefix.matched.values()) / prompt_tokens,
        {
            "attn_implementation": model.config._attn_implementation,
            "page_size": page,
            "num_blocks": resolved.num_blocks,
            "max_batch_tokens": resolved.max_batch_tokens,
            "max_requests_per_batch": resolved.max_requests_per_batch,
            "api": "continuous_batching_context_manager + add_request(max_new_tokens=n)",
        },
        cached_tokens=[prefix.matched.get(f"r{i}", 0) for i in range(len(reqs))],
    )


# ---- transformers static generate ---------------------------------------------------------
class _FirstTokenClock:
    """A streamer: `generate` puts the prompt first, then each step's new tokens."""

    def __init__(self) -> None:
        self.calls, self.first_token = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token is None:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        pass


def run_generate(model_dir: str, reqs: list[BenchRequest], args, vocab: int) -> SystemRun:
    # Static batches of --hf-batch-size, grouped by output length (longest first) so that a
    # batch wastes few steps; each batch generates its longest request's count and only each
    # request's own first max_tokens tokens are kept and counted.
    order = sorted(range(len(reqs)), key=lambda i: -reqs[i].max_tokens)
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    tokens: list[list[int]] = [[] for _ in reqs]
    ttft = [0.0] * len(reqs)
    with PeakRss() as mem, torch.no_grad():
        model = load_hf(model_dir, args)
        warm = torch.tensor([_warmup_prompt(vocab)], device=args.device)
        model.generate(warm, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        for batch in batches:
            ids, mask = (t.to(args.device) for t in _left_pad([list(reqs[i].prompt) for i in batch]))
            n = max(reqs[i].max_tokens for i in batch)
            clock = _FirstTokenClock()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
                streamer=clock,
            )
            for row, i in enumerate(batch):
                tokens[i] = out[row, ids.shape[1] : ids.shape[1] + reqs[i].max_tokens].tolist()
                ttft[i] = clock.first_token - t0
        wall = time.perf_counter() - t0
    return SystemRun(
        "generate",
        tokens,
        ttft,
        wall,
        mem.bytes,
        None,
        {
            "attn_implementation": model.config._attn_implementation,
            "batch_size": args.hf_batch_size,
            "batching": "static, grouped by output length, left padding",
        },
        cached_tokens=[0] * len(reqs),  # no prefix cache
    )


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)  # (B, L), pad id 0
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask
