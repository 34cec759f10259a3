"""OpenAI request bodies to the router's requests: one `CheckedRequest` per choice.

A request with `n` choices (and, for completions, several prompts) becomes n x prompts router
requests, each its own stream, its own placement and its own blocks; with a seed, choice i
samples with seed + i (as vLLM and `pagefleet.LLM` do), so that n=2 gives two different
samples and the same request gives the same two again. Every check is the gRPC door's
(router/door/serving.py), with the field named as the OpenAI API names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.door.openai_protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from router.door.serving import check_message_count, checked_request, invalid, request_salt, tokenize
from router.router import CheckedRequest
from worker.sampling_params import SamplingParams
from worker.token_ids import CheckedIds, first_outside

if TYPE_CHECKING:
    import numpy as np

    from router.router import Router

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions (chat's: up to the context)
# SamplingParams' fields that a body sets under the same name.
_SAME_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
)


@dataclass
class Routes:
    """The router requests of one HTTP request, choice by choice: choice i is routes[i], its
    prompt is prompts[i // n] (OpenAI's index for prompt p, sample j is p * n + j)."""

    routes: list[CheckedRequest]
    prompts: list[CheckedIds]
    n: int


async def completion_routes(body: CompletionRequest, router: Router, request_id: str, tenant: str | None) -> Routes:
    """`/v1/completions`: a prompt (text or token ids) or a batch of them."""
    if body.echo:
        raise invalid("echo is not supported", "echo")
    if body.best_of not in (None, 1, body.n):
        raise invalid("best_of is not supported (other than equal to n)", "best_of")
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    batch = body.prompt if _is_batch(body.prompt) else [body.prompt]
    if not batch:
        raise invalid("prompt must not be empty", "prompt")
    if len(batch) * body.n > MAX_CHOICES:
        raise invalid(f"{len(batch)} prompts x n={body.n} is over {MAX_CHOICES} choices", "n")
    limit = body.max_tokens or COMPLETION_MAX_TOKENS
    params = sampling_params(body, limit, "max_tokens", body.logprobs, "logprobs")
    prompts = []
    for i, prompt in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        prompts.append(await _prompt_ids(prompt, router, where))
    return _routes(body, prompts, params, "max_tokens", router, request_id, tenant)


async def chat_routes(body: ChatCompletionRequest, router: Router, request_id: str, tenant: str | None) -> Routes:
    """`/v1/chat/completions`: the messages rendered with the model's chat template."""
    if body.tools:
        raise invalid("tools are not supported", "tools")
    if body.response_format not in (None, {"type": "text"}):
        raise invalid("response_format other than text is not supported", "response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    limit_field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    limit = body.max_tokens or body.max_completion_tokens  # None: up to the context
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, limit, limit_field, top, "top_logprobs")
    ids = await tokenize(router, messages=chat_messages(body.messages, router.model_info.max_model_len))
    return _routes(body, [ids], params, limit_field, router, request_id, tenant)


def chat_messages(messages: list[ChatMessage], context: int) -> list[dict]:
    """The router's {"role", "content"} dicts; text parts are joined by newlines. More
    messages than the `context` has tokens are refused before any is built."""
    check_message_count(len(messages), context)
    out = []
    for i, m in enumerate(messages):
        if not m.role.strip():
            raise invalid(f"messages[{i}].role must not be empty", f"messages[{i}].role")
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": m.role, "content": content})
    if not out:
        raise invalid("messages must not be empty", "messages")
    return out


def sampling_params(body, max_tokens: int | None, max_field: str, logprobs, logprobs_field: str):
    """`SamplingParams` of the body; its ValueError becomes a 400 naming the body's field."""
    if body.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    values = {k: getattr(body, k) for k in _SAME_NAMES if getattr(body, k) is not None}
    values |= {"max_tokens": max_tokens, "logprobs": logprobs}
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    names = {"max_tokens": max_field, "logprobs": logprobs_field}
    try:
        return SamplingParams(**values)
    except ValueError as e:
        message = str(e).removeprefix("SamplingParams.")
        field = re.match(r"\w*", message).group()
        theirs = names.get(field, field)
        raise invalid(theirs + message[len(field) :], theirs) from None


def _routes(body, prompts, params: SamplingParams, limit_field, router, request_id, tenant) -> Routes:

    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    salt = request_salt(tenant, cache_salt=body.cache_salt)
    routes = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            seeded = params if params.seed is None else replace(params, seed=params.seed + j)
            rid = f"{request_id}-{p * body.n + j}"
            routes.append(checked_request(router, ids, seeded, rid, body.priority, salt, None, limit_field, tenant))
    return Routes(routes, prompts, body.n)


def _is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


async def _prompt_ids(prompt: str | np.ndarray, router: Router, where: str) -> CheckedIds:
    """A prompt's checked token ids; token ids came as an int64 array (openai_protocol.py)."""
    if len(prompt) == 0:
        raise invalid(f"{where} is empty", where)
    if isinstance(prompt, str):
        return await tokenize(router, text=prompt)
    vocab = router.model_info.vocab_size
    if (i := first_outside(prompt, vocab)) is not None:
        raise invalid(f"{where}[{i}] = {prompt[i]} is outside the vocabulary [0, {vocab})", where)
    return CheckedIds.trusted(prompt, vocab)
