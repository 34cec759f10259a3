"""Tool calls read back from a model's output, as it streams: text outside `<tool_call>` blocks
is content; each block is a call (Hermes' and Qwen's format, worker/tools.py), or a list of
calls in one block (SmolLM2's: `<tool_call>[{"name": ..., "arguments": ...}]</tool_call>`).

One parser serves a stream and a whole response alike (a whole response is the stream fed at
once), so that both give the same content and calls. A call written as worker/tools.py writes
it (`{"name": ..., "arguments": {...}}`, the name first, the arguments an object) streams as it
comes: its name once the name is complete, then its arguments' text piece by piece, exactly as
the model wrote it. A block of another shape (the arguments first, a list, the arguments as a
string) is read whole at its end tag. A block that is not JSON of calls stays in the content as
written. Whitespace beside calls is dropped (a newline between two blocks is not content).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from worker.tools import TOOL_CALL_BEGIN, TOOL_CALL_END

_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":")  # None: the name, a JSON string
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN_STRING = re.compile(r'"(?:[^"\\]|\\.)*\\?')
_SPACE = re.compile(r"\s*")
_TEXT, _HEAD_STATE, _ARGS, _TAIL, _RAW = range(5)


@dataclass
class CallDelta:
    """A piece of call `index`: its name on its first piece, then its arguments' next text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class Parsed:
    """What a piece of output says: content, and pieces of calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    """One whole call: the function's name and its arguments' JSON text."""

    name: str
    arguments: str


class ToolCallParser:
    """Feed it the output's text as it comes (`feed`), then `finish`; `calls` counts the calls
    begun."""

    def __init__(self) -> None:
        self.calls = 0
        self._state = _TEXT
        self._buf = ""  # text not yet handed out
        self._space = ""  # whitespace held back: content unless a call follows
        self._depth = 0  # the arguments' nesting, while they stream
        self._in_string = False
        self._escaped = False
        self._after_call = False  # no content since the last call
        self._space_before = ""  # the whitespace held before the open block

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """What is left once the output has ended (a block cut short stays content unless its
        name was out already)."""
        out = Parsed()
        if self._state == _TEXT:
            self._content(out, self._buf)
        elif self._state in (_HEAD_STATE, _RAW):
            self._block(out, self._buf)
        self._buf = ""
        if self.calls == 0:
            out.content += self._space
        self._space = ""
        return out

    # ---- states ---------------------------------------------------------------------------
    def _step(self, out: Parsed) -> bool:
        """Consume what the state can of the buffer; False when it needs more text."""
        return (self._text, self._head, self._args, self._tail, self._raw)[self._state](out)

    def _text(self, out: Parsed) -> bool:
        i = self._buf.find(TOOL_CALL_BEGIN)
        if i >= 0:
            self._content(out, self._buf[:i])
            self._space_before, self._space = self._space, ""
            self._buf = self._buf[i + len(TOOL_CALL_BEGIN) :]
            self._state = _HEAD_STATE
            return True
        keep = _partial_suffix(self._buf, TOOL_CALL_BEGIN)
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _head(self, out: Parsed) -> bool:
        status, name, end = _read_head(self._buf)
        if status == "maybe":
            return False
        if status == "no" or self._buf[end] != "{":  # another shape: read it whole
            self._state = _RAW
            return True
        out.calls.append(CallDelta(self.calls, name=name))
        self.calls += 1
        self._buf = self._buf[end:]
        self._state, self._depth, self._in_string, self._escaped = _ARGS, 0, False, False
        return True

    def _args(self, out: Parsed) -> bool:
        """The arguments' text up to where their object closes (or an end tag cuts it)."""
        buf, i = self._buf, 0
        while i < len(buf):
            c = buf[i]
            if self._in_string:
                self._in_string = self._escaped or c != '"'
                self._escaped = not self._escaped and c == "\\"
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._emit_args(out, buf[: i + 1])
                    self._buf, self._state = buf[i + 1 :], _TAIL
                    return True
            elif c == "<" and TOOL_CALL_END.startswith(buf[i : i + len(TOOL_CALL_END)]):
                self._emit_args(out, buf[:i])
                self._buf, self._state = buf[i:], _TAIL
                return True
            i += 1
        self._emit_args(out, buf)
        self._buf = ""
        return False

    def _tail(self, out: Parsed) -> bool:
        """After the arguments: skip to the end tag."""
        i = self._buf.find(TOOL_CALL_END)
        if i < 0:
            self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, TOOL_CALL_END) :]
            return False
        self._buf, self._state, self._after_call = self._buf[i + len(TOOL_CALL_END) :], _TEXT, True
        return True

    def _raw(self, out: Parsed) -> bool:
        i = self._buf.find(TOOL_CALL_END)
        if i < 0:
            return False
        self._block(out, self._buf[:i], closed=True)
        self._buf, self._state = self._buf[i + len(TOOL_CALL_END) :], _TEXT
        return True

    # ---- parts ----------------------------------------------------------------------------
    def _emit_args(self, out: Parsed, text: str) -> None:
        if not text:
            return
        if out.calls and out.calls[-1].index == self.calls - 1:
            out.calls[-1].arguments += text
        else:
            out.calls.append(CallDelta(self.calls - 1, arguments=text))

    def _block(self, out: Parsed, body: str, closed: bool = False) -> None:
        """A whole block's calls; a block that is not calls is content, as written."""
        calls = _calls_of(body)
        if calls is None:
            self._space = self._space_before
            self._content(out, TOOL_CALL_BEGIN + body + (TOOL_CALL_END if closed else ""))
            return
        self._after_call = True
        for call in calls:
            out.calls.append(CallDelta(self.calls, name=call.name, arguments=call.arguments))
            self.calls += 1

    def _content(self, out: Parsed, text: str) -> None:
        """Content, its trailing whitespace held back (dropped if a call comes next), its
        leading whitespace dropped right after a call."""
        text = self._space + text
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            out.content += body
            self._after_call = False


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (as a stream of it would give them)."""
    parser = ToolCallParser()
    parts = [parser.feed(text), parser.finish()]
    content = "".join(p.content for p in parts)
    calls: list[ToolCall] = []
    for delta in (d for p in parts for d in p.calls):
        if delta.name is not None:
            calls.append(ToolCall(delta.name, ""))
        calls[delta.index].arguments += delta.arguments
    return content, calls


def _read_head(buf: str) -> tuple[str, str | None, int]:
    """("match", name, where the arguments' value starts) when `buf` starts with a call's head
    as worker/tools.py writes it (any whitespace between its parts); ("maybe", ...) while it
    could still become one; ("no", ...) once it cannot."""
    i, name = 0, None
    for part in _HEAD:
        i = _SPACE.match(buf, i).end()
        if i == len(buf):
            return "maybe", None, i
        if part is None:
            m = _STRING.match(buf, i)
            if m is None:
                return ("maybe" if _OPEN_STRING.fullmatch(buf, i) else "no"), None, i
            name, i = json.loads(m.group()), m.end()
            continue
        piece = buf[i : i + len(part)]
        if not part.startswith(piece):
            return "no", None, i
        if len(piece) < len(part):
            return "maybe", None, i
        i += len(part)
    i = _SPACE.match(buf, i).end()
    return ("match" if i < len(buf) else "maybe"), name, i


def _calls_of(body: str) -> list[ToolCall] | None:
    """A block's calls: an object or a list of objects, each with a string "name" and
    "arguments" (or "parameters") an object or its JSON text; None for anything else."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and could become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
