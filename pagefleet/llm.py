"""`pagefleet.LLM`: offline generation on one engine."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from worker.async_engine import GenerationRequest
from worker.config import CacheConfig, SchedulerConfig
from worker.engine import EngineConfig, LLMEngine, load_tokenizer
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams

_CACHE_KEYS = {f for f in CacheConfig.__dataclass_fields__}
_SCHED_KEYS = {f for f in SchedulerConfig.__dataclass_fields__} - {"max_model_len"}
_ENGINE_KEYS = {f for f in EngineConfig.__dataclass_fields__} - {"model", "cache", "scheduler"}


def engine_config(model: str | None = None, **options) -> EngineConfig:
    """Flat keyword options (block_size, num_blocks, max_num_seqs, ...) -> EngineConfig.
    `model=None` is the built-in small model."""
    unknown = set(options) - _CACHE_KEYS - _SCHED_KEYS - _ENGINE_KEYS
    if unknown:
        known = sorted(_CACHE_KEYS | _SCHED_KEYS | _ENGINE_KEYS)
        raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: {known}")
    if model is None:
        from worker.builtin_model import builtin_model_path

        model = str(builtin_model_path())
    return EngineConfig(
        model=str(model),
        cache=CacheConfig(**{k: v for k, v in options.items() if k in _CACHE_KEYS}),
        scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in _SCHED_KEYS}),
        **{k: v for k, v in options.items() if k in _ENGINE_KEYS},
    )


class LLM:
    """Generate from a Hugging Face model directory (or the built-in model) in this process.

    >>> llm = LLM()  # the built-in small model
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))

    `tensor_parallel_size > 1` places a Ray worker group (cluster/ray/group.py) on the Ray
    runtime, starting a local one if none is connected; the output is the same.
    """

    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1, **options) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size!r}")
        config = engine_config(model, **options)
        self.engine: LLMEngine | None = None
        self.group = None
        if tensor_parallel_size > 1:
            from cluster.ray.group import RayGroup, RayGroupConfig

            self.group = RayGroup(config, RayGroupConfig(tensor_parallel_size=tensor_parallel_size))
            self._tokenizer = load_tokenizer(config.model)
        else:
            self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self._tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        if self.group is not None:
            return asyncio.run(self._generate_on_group(prompts, params, cache_salt))
        ids = [
            self.engine.add_request(p, sp or SamplingParams(), cache_salt=cache_salt)
            for p, sp in zip(prompts, params, strict=True)
        ]
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids), use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]

    async def _generate_on_group(self, prompts, params, cache_salt) -> list[RequestOutput]:
        async def one(prompt, sp) -> RequestOutput:
            request = GenerationRequest(prompt, sp or SamplingParams(), cache_salt=cache_salt)
            async for out in self.group.generate(request):
                last = out
            return last

        return list(await asyncio.gather(*map(one, prompts, params)))

    def stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else self.group.engine_stats()

    def shutdown(self) -> None:
        """Release the Ray group of a tensor-parallel LLM (nothing to do in-process)."""
        if self.group is not None:
            self.group.shutdown()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
