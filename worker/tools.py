"""Tools a chat request offers the model (OpenAI's `tools`), checked, and what follows from them:
the constraint that makes the model call them, and the system prompt that lists them for a chat
template that has no place for tools.

Torch-free and free of the grammar engine: the router builds these, a group compiles the
constraint (worker/engine/grammar.py). The call format is Hermes' (Qwen2.5's and Qwen3's chat
templates, and what worker/tool_parser.py reads back):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call forced by `tool_choice` ("required", or a named function) is enforced by an xgrammar
structural tag built from the tools' parameter schemas: one `<tool_call>` block per call, its
name one of the tools' (or the named one), its arguments valid under that tool's schema, calls
separated by a newline, nothing else around them; so a forced call parses on any model, a tiny
random one included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from worker.structured_outputs import StructuredOutputs

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters

# Qwen2.5's chat template's words for its tools, for a template that renders none (worker/chat.py).
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, what it does, and the JSON Schema (an object)
    of its arguments."""

    name: str
    description: str | None = None
    parameters: Mapping | None = None  # None: no arguments

    @property
    def schema(self) -> dict:
        """The arguments' JSON Schema."""
        return dict(self.parameters) if self.parameters is not None else dict(NO_PARAMETERS)

    def as_openai(self) -> dict:
        """The tool as OpenAI's API and transformers' chat templates take it."""
        function = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


def check_tools(tools: Sequence[Mapping]) -> list[Tool]:
    """OpenAI's `tools` (each `{"type": "function", "function": {name, description,
    parameters}}`) as `Tool`s; a ValueError whose message starts with the field at fault
    (`tools[1].function.name ...`)."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} allowed")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function must be an object")
        out.append(_tool(function, f"{where}.function"))
    seen: set[str] = set()
    for i, tool in enumerate(out):
        if tool.name in seen:
            raise ValueError(f"tools[{i}].function.name {tool.name!r} is given twice")
        seen.add(tool.name)
    return out


def _tool(function: Mapping, where: str) -> Tool:
    name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1-64 letters, digits, underscores or dashes")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.description must be a string")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.parameters must be a JSON Schema object")
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.parameters must be a JSON Schema of type 'object' (the arguments' object)")
        try:
            json.dumps(parameters, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}.parameters cannot be written as JSON: {e}") from None
    return Tool(name, description, parameters)


def call_begin(name: str) -> str:
    """What a call of `name` starts with, up to its arguments."""
    return f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '


def format_call(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments`: the arguments' JSON text."""
    return f"{call_begin(name)}{arguments}}}\n{TOOL_CALL_END}"


def tool_call_constraint(tools: Sequence[Tool], parallel: bool) -> StructuredOutputs:
    """The output is one or more calls of `tools` (one when not `parallel`), each a
    `<tool_call>` block with arguments valid under its tool's schema, and nothing else."""
    tags = [
        {
            "type": "tag",
            "begin": call_begin(t.name),
            "content": {"type": "json_schema", "json_schema": t.schema},
            "end": f"}}\n{TOOL_CALL_END}",
        }
        for t in tools
    ]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    calls["stop_after_first"] = not parallel
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": calls})


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The system prompt's part that lists `tools` and says how to call them."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return TOOLS_PROMPT.format(tools=listed)
