"""OpenAI's tool calling on `/v1/chat/completions`: the body's `tools`, `tool_choice` and
`parallel_tool_calls` checked and turned into what the request needs, and a choice's output
read back as `message.tool_calls` (whole) or `delta.tool_calls` (streamed).

`tool_choice` (default "auto" with tools, "none" without):
- "none": the tools are not rendered and the output is content;
- "auto": the tools are rendered into the prompt (worker/chat.py) and calls are read from what
  the model writes (`<tool_call>` blocks, worker/tool_parser.py); nothing constrains it;
- "required", or a named function: as "auto", and the output is constrained to calls (of any of
  the tools, or of the named one once) with arguments valid under the function's parameters
  (worker/tools.py: a structural tag), one call unless `parallel_tool_calls` (default true).
A choice that made calls finishes with "tool_calls" (unless cut by max_tokens: "length").
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from router.door.serving import invalid
from worker.structured_outputs import StructuredOutputs
from worker.tool_parser import Parsed, ToolCallParser
from worker.tools import Tool, check_tools, tool_call_constraint

_FIELD = re.compile(r"[\w.\[\]]+")


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools ask of its routes."""

    tools: list[Tool] | None = None  # rendered into the prompt
    constraint: StructuredOutputs | None = None  # a forced call's
    constraint_field: str | None = None  # the body's field a group's refusal of it names
    parse: bool = False  # read calls from the output


def tool_use(body) -> ToolUse:
    """The body's tool fields as a `ToolUse`; a 400 naming the field for a bad one."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        if body.parallel_tool_calls is not None:
            raise invalid("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
        return ToolUse()
    try:
        tools = check_tools([t.model_dump(exclude_none=True) for t in body.tools])
    except ValueError as e:
        raise invalid(str(e), _FIELD.match(str(e)).group()) from None
    choice = choice or "auto"
    if choice == "none":
        return ToolUse()
    if choice == "auto":
        return ToolUse(tools, parse=True)
    if choice == "required":
        return ToolUse(tools, _forced(tools, body.parallel_tool_calls is not False, "tools"), "tools", True)
    names = [t.name for t in tools]
    if choice.function.name not in names:
        raise invalid(
            f"tool_choice.function.name {choice.function.name!r} is not the name of one of the tools",
            "tool_choice.function.name",
        )
    i = names.index(choice.function.name)
    where = f"tools[{i}].function.parameters"
    return ToolUse(tools, _forced([tools[i]], False, where), where, True)


def _forced(tools: list[Tool], parallel: bool, where: str) -> StructuredOutputs:
    """The constraint of a forced call; a 400 naming `where` when it is too large."""
    try:
        return tool_call_constraint(tools, parallel)
    except ValueError as e:
        raise invalid(re.sub(r"StructuredOutputs\.\w+", where, str(e)), where) from None


@dataclass
class ToolCalls:
    """One choice's calls as its output streams: the parser, and each call's id."""

    parser: ToolCallParser = field(default_factory=ToolCallParser)
    ids: list[str] = field(default_factory=list)

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, OpenAI's `delta.tool_calls` entries) of the output's next `text`."""
        parts = [self.parser.feed(text)]
        if finished:
            parts.append(self.parser.finish())
        content = "".join(p.content for p in parts)
        return content, [self._delta(d) for p in parts for d in _merged(p)]

    def whole(self, text: str) -> tuple[str, list[dict]]:
        """(content, OpenAI's `message.tool_calls`) of a whole output."""
        content, deltas = self.delta(text, finished=True)
        calls: list[dict] = []
        for d in deltas:
            if "id" in d:
                calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        return content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.calls else reason

    def _delta(self, d) -> dict:
        if d.name is None:
            return {"index": d.index, "function": {"arguments": d.arguments}}
        self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        function = {"name": d.name, "arguments": d.arguments}
        return {"index": d.index, "id": self.ids[d.index], "type": "function", "function": function}


def _merged(parsed: Parsed) -> list:
    """A piece's call deltas, one per call (its name and its arguments so far together)."""
    out = []
    for d in parsed.calls:
        if out and out[-1].index == d.index and d.name is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out
