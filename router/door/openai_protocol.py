"""The OpenAI API's request bodies (pydantic models) and its error body, as the HTTP door reads
and writes them.

Requests are validated strictly (a string is not a number, `1.5` is not an integer) and an
unknown field is refused rather than silently ignored, so that a typo (`max_token`) is a 400
naming it, as OpenAI's API answers. Fields OpenAI defines that pagefleet does not do (tools,
`logit_bias`, `echo`, `best_of` > 1, `suffix`) are refused by name. pagefleet's extensions
take vLLM's names (`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`include_stop_str_in_output`, `cache_salt`, `priority`, `return_token_ids`), for clients that
send them through the SDK's `extra_body`.

Errors are `{"error": {"message", "type", "param", "code"}}` with the status a client of
OpenAI's API expects: the door's gRPC status vocabulary (router/door/serving.py) maps to HTTP
in `HTTP_STATUS`.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

INT64 = Field(ge=-(2**63), le=2**63 - 1)
INT32 = Field(ge=-(2**31), le=2**31 - 1)
MAX_CHOICES = 64  # n x prompts of one request: each choice is a request of its own

# The door's statuses as HTTP: (status, OpenAI error type, code).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "context_length_exceeded"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "requests", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "client_closed_request"),
    grpc.StatusCode.INTERNAL: (500, "server_error", None),
}
# What a field of several forms accepts, for a 400 that says so once instead of per form.
FORMS = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of "
    "token ids",
    "stop": "a string or an array of strings",
    "content": "a string or an array of text parts",
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> dict:
    """OpenAI's error body for a door status."""
    _, kind, error_code = HTTP_STATUS.get(code, HTTP_STATUS[grpc.StatusCode.INTERNAL])
    return {"error": {"message": message, "type": kind, "param": param, "code": error_code}}


def validation_message(error: dict) -> tuple[str, str | None]:
    """(message, param) for one of pydantic's errors on a request body; `param` is the
    field's path as a client wrote it (`messages[1].content`)."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error')})", None
    if not loc:
        return "the request body must be a JSON object", None
    # Up to the first union member's type tag (`prompt.list[int].3` is about `prompt`).
    names = list(itertools.takewhile(lambda p: isinstance(p, int) or _is_field_name(p), loc))
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in names).lstrip(".")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"{param} is required", param
    if len(names) < len(loc) and isinstance(names[-1], str) and names[-1] in FORMS:
        return f"{param} must be {FORMS[names[-1]]}", param
    return f"{param}: {error.get('msg', 'invalid value')}", param


def _is_field_name(p: Any) -> bool:
    """Whether a loc entry names a field (not a union member's type tag like `list[int]`)."""
    return isinstance(p, str) and p.isidentifier() and not p[:1].isupper() and p not in _TAGS


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, INT64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: str | None = None  # accepted and unused, as OpenAI's "end-user id"
    # extensions, by vLLM's names
    top_k: Annotated[int, INT32] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Annotated[int, INT64]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: Annotated[int, INT32] = 0
    return_token_ids: bool = False  # each choice's token ids, as `token_ids`


class CompletionRequest(_Generation):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[Annotated[int, INT64]] | list[list[Annotated[int, INT64]]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # refused when true
    best_of: int | None = None  # refused above 1
    suffix: str | None = None  # refused


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart]
    name: str | None = None  # accepted and unused


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None  # refused unless empty
    response_format: dict | None = None  # refused unless {"type": "text"}


class TokenizeRequest(_Body):
    """`POST /tokenize` (vLLM's shape): a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[Annotated[int, INT64]]
