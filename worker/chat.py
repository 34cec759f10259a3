"""Chat messages to prompt ids through the model's chat template: one function for the router
and for `pagefleet.LLM.chat`, so that both send the engine the same ids for the same messages.

Messages are OpenAI's: a role and text content; an assistant's may carry `tool_calls` instead
of content, and a `tool` message answers one of them (`tool_call_id`). Tools (worker/tools.py)
go through transformers' `apply_chat_template(tools=...)` when the model's template renders
them. A template that does not (the default model's and the built-in model's render only role
and content) gets them in Qwen2.5's words instead: the tools listed at the end of the system
message (one is added first when there is none), the assistant's calls written as the
`<tool_call>` blocks it is asked for, and a tool's answer as a user message in
`<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from worker.tools import Tool, format_call, tools_prompt

_PROBE_TOOL = Tool("pagefleet_probe_function", "probe", {"type": "object", "properties": {}})
_RENDERS_TOOLS: dict[str, bool] = {}  # chat template -> whether it renders a request's tools


def check_messages(messages: Sequence[Any]) -> list[dict]:
    """The messages as dicts with a string 'role' and string 'content' (an assistant's with
    tool calls may have none: it becomes ""), an assistant's `tool_calls` with each call's
    arguments as an object where their text is one; a ValueError naming the first bad one."""
    return [_checked(i, m) for i, m in enumerate(messages)]


def _checked(i: int, m: Any) -> dict:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
    calls = m.get("tool_calls")
    content = m.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
    out = {**m, "content": content}
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, Sequence):
            raise ValueError(f"messages[{i}].tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def _call(where: str, call: Any) -> dict:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def message_chars(messages: Sequence[Mapping]) -> int:
    """The characters of checked messages' text (their calls' arguments included)."""
    total = 0
    for m in messages:
        total += len(m["role"]) + len(m["content"])
        for call in m.get("tool_calls") or ():
            total += len(call["function"]["name"]) + len(json.dumps(call["function"]["arguments"]))
    return total


def render_chat(
    tokenizer: Any, messages: Sequence[Any], checked: bool = False, tools: Sequence[Tool] | None = None
) -> list[int]:
    """The prompt ids of `messages` (and `tools`) under the tokenizer's chat template, with the
    assistant's turn opened (add_generation_prompt); `checked`: `check_messages` passed them
    already."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer (so no chat template): send token ids")
    conversation, kwargs = _template_inputs(tokenizer, messages if checked else check_messages(messages), tools)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(ids, Mapping):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def render_chat_text(tokenizer: Any, messages: Sequence[Any], tools: Sequence[Tool] | None = None) -> str:
    """The same prompt as text (what `render_chat` tokenizes)."""
    conversation, kwargs = _template_inputs(tokenizer, check_messages(messages), tools)
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the tools it is given (found once per
    template, by rendering a probe tool)."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    if template not in _RENDERS_TOOLS:
        probe = [{"role": "user", "content": "hello"}]
        try:
            text = tokenizer.apply_chat_template(
                probe, tools=[_PROBE_TOOL.as_openai()], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # a template that fails on tools does not render them
            text = ""
        _RENDERS_TOOLS[template] = _PROBE_TOOL.name in text
    return _RENDERS_TOOLS[template]


def _template_inputs(tokenizer: Any, messages: list[dict], tools: Sequence[Tool] | None) -> tuple[list[dict], dict]:
    """(messages, apply_chat_template's extra arguments) for this template."""
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, {}
    if renders_tools(tokenizer):
        return messages, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    return plain_messages(messages, tools), {}


def plain_messages(messages: Sequence[dict], tools: Sequence[Tool] | None) -> list[dict]:
    """Tools, calls and tools' answers as role-and-content messages (module docstring)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            blocks = [_written(c["function"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m["role"], "content": content})
    if tools:
        listed = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listed}"}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def _written(function: Mapping) -> str:
    arguments = function["arguments"]
    text = json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else arguments
    return format_call(function["name"], text)
