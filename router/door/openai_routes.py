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
from router.door.openai_tools import tool_use
from router.door.serving import check_message_count, checked_request, invalid, request_salt, tokenize
from router.router import CheckedRequest
from worker.sampling_params import SamplingParams
from worker.structured_outputs import StructuredOutputs
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
    constraint_field: str | None = None  # the body's field that set a structured output
    tool_calls: bool = False  # read tool calls from the outputs (router/door/openai_tools.py)

    def named(self, message: str, param: str | None) -> tuple[str, str | None]:
        """An error's message and param with a group's name for the constraint
        (`StructuredOutputs.json`) replaced by the body's field that set it."""
        if self.constraint_field is None or "StructuredOutputs" not in message:
            return message, param
        return _as_field(message, self.constraint_field), self.constraint_field


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
    constraint, where = structured_outputs(body)
    params = sampling_params(body, limit, "max_tokens", body.logprobs, "logprobs", constraint)
    prompts = []
    for i, prompt in enumerate(batch):
        where_p = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        prompts.append(await _prompt_ids(prompt, router, where_p))
    return _routes(body, prompts, params, "max_tokens", router, request_id, tenant, where)


async def chat_routes(body: ChatCompletionRequest, router: Router, request_id: str, tenant: str | None) -> Routes:
    """`/v1/chat/completions`: the messages (and tools) rendered with the model's chat template."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    limit_field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    limit = body.max_tokens or body.max_completion_tokens  # None: up to the context
    top = (body.top_logprobs or 0) if body.logprobs else None
    constraint, where = structured_outputs(body)
    tools = tool_use(body)
    if tools.constraint is not None:
        if constraint is not None:
            raise invalid(f"tool_choice cannot force a call with {where.split('.')[0]} given too", "tool_choice")
        constraint, where = tools.constraint, tools.constraint_field
    params = sampling_params(body, limit, limit_field, top, "top_logprobs", constraint)
    messages = chat_messages(body.messages, router.model_info.max_model_len)
    ids = await tokenize(router, messages=messages, tools=tools.tools)
    routes = _routes(body, [ids], params, limit_field, router, request_id, tenant, where)
    routes.tool_calls = tools.parse
    return routes


def structured_outputs(body) -> tuple[StructuredOutputs | None, str | None]:
    """The body's constraint on its output, from OpenAI's `response_format` (chat) or vLLM's
    `structured_outputs`, and the field that set it (errors name it); 400 for a bad one."""
    fmt = getattr(body, "response_format", None)
    given = body.structured_outputs
    if fmt is not None and fmt.type != "text" and given is not None:
        raise invalid("give response_format or structured_outputs, not both", "structured_outputs")
    if given is not None:
        fields = given.model_dump(exclude_none=True, by_alias=True)
        where = "structured_outputs" if len(fields) != 1 else f"structured_outputs.{next(iter(fields))}"
        return _constraint(where, **fields), where
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise invalid("response_format.json_schema needs type json_schema", "response_format.json_schema")
        return None, None
    if fmt.type == "json_object":
        return _constraint("response_format", json_object=True), "response_format"
    where = "response_format.json_schema.schema"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise invalid(f"{where} is required with type json_schema", where)
    return _constraint(where, json=fmt.json_schema.schema_), where


def _constraint(where: str, **fields) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as e:
        raise invalid(_as_field(str(e), where), where) from None


def _as_field(message: str, where: str) -> str:
    """A constraint's error with the body's field for the constraint's own name."""
    named = re.sub(r"StructuredOutputs\.\w+", where, message)
    return named.replace("StructuredOutputs", where)


def chat_messages(messages: list[ChatMessage], context: int) -> list[dict]:
    """The router's {"role", "content"} dicts (an assistant's with its `tool_calls`, a tool's
    with its `tool_call_id`, which must answer an earlier call); text parts are joined by
    newlines. More messages than the `context` has tokens are refused before any is built."""
    check_message_count(len(messages), context)
    out, calls = [], set()
    for i, m in enumerate(messages):
        if not m.role.strip():
            raise invalid(f"messages[{i}].role must not be empty", f"messages[{i}].role")
        if m.tool_calls is not None and m.role != "assistant":
            where = f"messages[{i}].tool_calls"
            raise invalid(f"{where} is only allowed on an assistant message", where)
        message = {"role": m.role, "content": _content(i, m)}
        if m.tool_calls is not None:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            calls.update(c.id for c in m.tool_calls)
        if (m.role == "tool") != (m.tool_call_id is not None):
            what = "is required on a tool message" if m.role == "tool" else "is only allowed on a tool message"
            raise invalid(f"messages[{i}].tool_call_id {what}", f"messages[{i}].tool_call_id")
        if m.tool_call_id is not None:
            if m.tool_call_id not in calls:
                raise invalid(
                    f"messages[{i}].tool_call_id {m.tool_call_id[:64]!r} answers no earlier assistant message's tool call",
                    f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    if not out:
        raise invalid("messages must not be empty", "messages")
    return out


def _content(i: int, m: ChatMessage) -> str:
    if m.content is None:
        if m.role == "assistant" and m.tool_calls:
            return ""
        raise invalid(f"messages[{i}].content is required", f"messages[{i}].content")
    return m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)


def sampling_params(
    body,
    max_tokens: int | None,
    max_field: str,
    logprobs,
    logprobs_field: str,
    constraint: StructuredOutputs | None = None,
):
    """`SamplingParams` of the body; its ValueError becomes a 400 naming the body's field."""
    if body.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    values = {k: getattr(body, k) for k in _SAME_NAMES if getattr(body, k) is not None}
    values |= {"max_tokens": max_tokens, "logprobs": logprobs, "structured_outputs": constraint}
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


def _routes(body, prompts, params: SamplingParams, limit_field, router, request_id, tenant, where=None) -> Routes:

    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    salt = request_salt(tenant, cache_salt=body.cache_salt)
    routes = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            seeded = params if params.seed is None else replace(params, seed=params.seed + j)
            rid = f"{request_id}-{p * body.n + j}"
            routes.append(checked_request(router, ids, seeded, rid, body.priority, salt, None, limit_field, tenant))
    return Routes(routes, prompts, body.n, where)


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
