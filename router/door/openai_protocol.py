"""The OpenAI API's request bodies (pydantic models) and its error body, as the HTTP door reads
and writes them.

Requests are validated strictly (a string is not a number, `1.5` is not an integer) and an
unknown field is refused rather than silently ignored, so that a typo (`max_token`) is a 400
naming it, as OpenAI's API answers. Fields OpenAI defines that pagefleet does not do
(`logit_bias`, `echo`, `best_of` > 1, `suffix`) are refused by name. pagefleet's extensions
take vLLM's names (`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`include_stop_str_in_output`, `cache_salt`, `priority`, `return_token_ids`, and
`structured_outputs`: {json, regex, grammar, choice, json_object, structural_tag}), for clients that send
them through the SDK's `extra_body`.

`parse_body` reads a body in one pass of pydantic's JSON parser: token ids arrive as numpy
arrays, a union's members are told apart without validating a long list once per member, and a
string that is not valid Unicode (a lone surrogate, which JSON's `\ud800` can carry) is a 400
naming its field rather than a tokenizer's TypeError later.

Errors are `{"error": {"message", "type", "param", "code"}}` with the status a client of
OpenAI's API expects: the door's gRPC status vocabulary (router/door/serving.py) maps to HTTP
in `HTTP_STATUS`.
"""

from __future__ import annotations

import itertools
import json
from typing import Annotated, Any, Literal, TypeVar

import grpc
import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

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
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of token ids",
    "stop": "a string or an array of strings",
    "content": "a string or an array of text parts",
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> dict:
    """OpenAI's error body for a door status."""
    _, kind, error_code = HTTP_STATUS.get(code, HTTP_STATUS[grpc.StatusCode.INTERNAL])
    return {"error": {"message": message, "type": kind, "param": param, "code": error_code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors on a request body, told by the first (or, for a
    field of several forms, the one a check of ours raised: `prompt` is a string but not valid
    Unicode); `param` is the field's path as a client wrote it (`messages[1].content`)."""
    error = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [p for p in error.get("loc", ()) if p != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error')})", None
    if kind == "string_unicode":  # (pydantic's own check, of a field's name)
        return "a field name of the request body is not valid Unicode (a lone surrogate)", None
    if not loc:
        return "the request body must be a JSON object", None
    # Up to the first union member's type tag (`prompt.list[int].3` is about `prompt`).
    names = list(itertools.takewhile(lambda p: isinstance(p, int) or _is_field_name(p), loc))
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in names).lstrip(".")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"{param} is required", param
    if kind == "value_error":
        return f"{param} {error.get('ctx', {}).get('error', 'is not valid')}", param
    if len(names) < len(loc) and isinstance(names[-1], str) and names[-1] in FORMS:
        return f"{param} must be {FORMS[names[-1]]}", param
    return f"{param}: {error.get('msg', 'invalid value')}", param


def _is_field_name(p: Any) -> bool:
    """Whether a loc entry names a field (not a union member's type tag like `list[int]`)."""
    return isinstance(p, str) and p.isidentifier() and not p[:1].isupper() and p not in _TAGS


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """`raw` as a `model`; pydantic's ValidationError for what does not fit it. A body whose
    JSON escapes a lone surrogate, which pydantic's parser refuses without naming the field, is
    read again by Python's (which keeps it) so that the field's own check can name it."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] != "json_invalid" or "hex escape" not in first["msg"]:
            raise
        refused = e
    try:
        value = json.loads(raw)
    except ValueError:
        raise refused from None
    return model.model_validate(value)


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


def _token_array(ids: list[int]) -> np.ndarray:
    return np.array(ids, dtype=np.int64)  # (n,); each id is in int64's range (INT64)


# A string of a body: valid Unicode (encodable as UTF-8), as the tokenizer and every reply need.
Text = Annotated[str, AfterValidator(_unicode)]
# Token ids: a numpy array, built while the body is parsed (off the event loop when it is large).
# fail_fast: a long list that is not of ids fails at its first item, once per union member.
TokenIds = Annotated[list[Annotated[int, INT64]], Field(fail_fast=True), AfterValidator(_token_array)]
Texts = Annotated[list[Text], Field(fail_fast=True)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: exactly one of these (worker/structured_outputs.py)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict | Text | None = Field(default=None, alias="json")  # (`json` is a BaseModel method)
    regex: Text | None = None
    grammar: Text | None = None
    choice: Texts | None = None
    json_object: bool | None = None
    structural_tag: dict | Text | None = None  # an xgrammar structural tag (as vLLM takes it)


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Text
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # (`schema` is a BaseModel method)
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Generation(_Body):
    """What completions and chat completions share."""

    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | Texts | None = None
    seed: Annotated[int, INT64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: Text | None = None  # accepted and unused, as OpenAI's "end-user id"
    # extensions, by vLLM's names
    top_k: Annotated[int, INT32] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Annotated[int, INT64]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: Text | None = None
    priority: Annotated[int, INT32] = 0
    return_token_ids: bool = False  # each choice's token ids, as `token_ids`
    structured_outputs: StructuredOutputsBody | None = None


class CompletionRequest(_Generation):
    """`POST /v1/completions`."""

    prompt: Text | Texts | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # refused when true
    best_of: int | None = None  # refused above 1
    suffix: Text | None = None  # refused


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class CalledFunction(_Body):
    name: Text
    arguments: Text  # the arguments' JSON text, as the model wrote it


class ToolCallBody(_Body):
    """An assistant's call of a tool, sent back in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Text
    content: Text | list[TextPart] | None = None  # None: an assistant's message of tool calls
    name: Text | None = None  # accepted and unused
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    refusal: Text | None = None  # accepted (a message sent back as the SDK read it) and unused


class FunctionDefinition(_Body):
    name: Text
    description: Text | None = None
    parameters: dict | None = None  # the arguments' JSON Schema (an object); None: no arguments
    strict: bool | None = None  # accepted: a forced call's arguments always follow the schema


class ToolDefinition(_Body):
    """OpenAI's `tools[i]`: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this one."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None
    # tool calling (router/door/openai_routes.py: chat_tools)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """`POST /tokenize` (vLLM's shape): a prompt or chat messages."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    model: Text | None = None
    tokens: TokenIds
