"""The router's outputs as OpenAI's responses: completions and chat completions, whole or as
stream chunks, with logprobs and usage where OpenAI puts them.

Prompt tokens served from the prefix cache are `usage.prompt_tokens_details.cached_tokens`, as
OpenAI reports them, and by the tier they came from (device, host, disk, pull) in the extra
field `cached_tokens_by_tier` beside it. pagefleet's own facts go in the extension field `pagefleet`: per choice,
the group that served it, why it was placed there, the cached tokens the router predicted and
those the group reported (each also by tier), the group's time to first token (`choices`), and the placement on the
first chunk of each choice when streaming.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.door.openai_tools import ToolCalls
from worker.outputs import CachedTiers

if TYPE_CHECKING:
    from router.router import RouteRecord
    from worker.outputs import RequestOutput


@dataclass
class Choice:
    """One choice's state while its stream runs."""

    index: int
    prompt_index: int
    record: RouteRecord | None = None
    last: RequestOutput | None = None
    text_length: int = 0  # characters sent so far (completions' logprobs.text_offset)
    sent_role: bool = False  # chat: the first delta carries the role
    tools: ToolCalls | None = None  # its tool calls, read as its output streams


@dataclass
class Formatter:
    """Builds one request's responses; `chat` picks the chat completion shapes."""

    chat: bool
    request_id: str
    model: str
    token_text: Callable[[int], str]  # one token's text, for logprobs
    return_token_ids: bool = False
    tool_calls: bool = False  # chat: read tool calls from the outputs (router/door/openai_tools.py)
    created: int = field(default_factory=lambda: int(time.time()))

    # ---- whole responses ------------------------------------------------------------------
    def response(self, choices: Sequence[Choice], num_prompts: Sequence[int]) -> dict:
        """The non-streamed response, once every choice has finished."""
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._whole_choice(c) for c in choices]
        body["usage"] = self.usage(choices, num_prompts)
        body["pagefleet"] = extension(choices)
        return body

    def _whole_choice(self, c: Choice) -> dict:
        out = c.last
        lps = self._logprobs(out.logprobs, out.token_ids, 0) if out.logprobs is not None else None
        choice = {"index": c.index}
        finish = out.finish_reason
        if self.tool_calls:
            c.tools = ToolCalls()
            content, calls = c.tools.whole(out.text)
            choice["message"] = {"role": "assistant", "content": (content or None) if calls else content}
            if calls:
                choice["message"]["tool_calls"] = calls
            finish = c.tools.finish_reason(finish)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice |= {"logprobs": lps, "finish_reason": finish, "stop_reason": out.stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        return choice

    # ---- stream chunks --------------------------------------------------------------------
    def chunk(self, c: Choice, out: RequestOutput, record: RouteRecord | None) -> dict:
        """One stream chunk: this step's delta of choice `c`."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        new_ids = out.new_token_ids
        lps = None
        if out.new_logprobs is not None:  # this step's (the whole list grows on)
            lps = self._logprobs(out.new_logprobs, new_ids, c.text_length)
        choice = {"index": c.index}
        finish = out.finish_reason if out.finished else None
        if self.chat:
            delta = {"content": out.new_text}
            if self.tool_calls:
                delta, finish = self._tool_delta(c, out, finish)
            if not c.sent_role:
                delta = {"role": "assistant", **delta}
                c.sent_role = True
            choice["delta"] = delta
        else:
            choice["text"] = out.new_text
        choice |= {"logprobs": lps, "finish_reason": finish}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = list(new_ids)
        c.text_length += len(out.new_text)
        body["choices"] = [choice]
        if record is not None:
            body["pagefleet"] = {"choices": [{"index": c.index, **placement(record)}]}
        return body

    def _tool_delta(self, c: Choice, out: RequestOutput, finish: str | None) -> tuple[dict, str | None]:
        """A chunk's delta with its tool calls' pieces, and its finish reason."""
        if c.tools is None:
            c.tools = ToolCalls()
        content, calls = c.tools.delta(out.new_text, out.finished)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, c.tools.finish_reason(finish)

    def usage_chunk(self, choices: Sequence[Choice], num_prompts: Sequence[int]) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body |= {"choices": [], "usage": self.usage(choices, num_prompts), "pagefleet": extension(choices)}
        return body

    # ---- parts ----------------------------------------------------------------------------
    def usage(self, choices: Sequence[Choice], num_prompts: Sequence[int]) -> dict:
        """Each prompt counted once; its cached tokens are its first choice's."""
        prompt = sum(num_prompts)
        completion = sum(len(c.last.token_ids) for c in choices if c.last is not None)
        firsts = {}
        for c in choices:
            firsts.setdefault(c.prompt_index, c)
        lasts = [c.last for c in firsts.values() if c.last is not None]
        details = {"cached_tokens": sum(out.num_cached_tokens for out in lasts)}
        tiers = [out.cached_tiers for out in lasts if out.cached_tiers is not None]
        if tiers:  # (an extra field: the `openai` client keeps it, as `model_extra`)
            details["cached_tokens_by_tier"] = CachedTiers(*map(sum, zip(*tiers, strict=True))).as_dict()
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }

    def _envelope(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries, token_ids: Sequence[int], offset: int) -> dict:
        """OpenAI's logprobs of `token_ids` (`entries`: worker.outputs.TokenLogprobs each)."""
        text = self.token_text
        if self.chat:
            return {"content": [_chat_logprob(text, lp) for lp in entries]}
        tokens = [text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = [{text(t): v for t, v in [(lp.token_id, lp.logprob), *lp.top]} for lp in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _chat_logprob(text: Callable[[int], str], lp) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def placement(record: RouteRecord) -> dict:
    return {
        "group_id": record.group_id,
        "reason": record.reason,
        "predicted_cached_tokens": record.predicted_cached_tokens,
        "predicted_cached_tiers": record.predicted_tiers.as_dict(),
        "resumes": record.resumes,
    }


def extension(choices: Sequence[Choice]) -> dict:
    """The `pagefleet` field of a whole response or a usage chunk."""
    rows = []
    for c in choices:
        row = {"index": c.index}
        if c.record is not None:
            row |= placement(c.record)
        if c.last is not None:
            ttft = c.last.metrics.ttft  # the group's: its receipt of the request to 1st token
            row |= {"cached_tokens": c.last.num_cached_tokens, "ttft_seconds": ttft}
            if c.last.cached_tiers is not None:
                row["cached_tiers"] = c.last.cached_tiers.as_dict()
        rows.append(row)
    return {"choices": rows}
