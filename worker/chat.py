"""Chat messages to prompt ids through the model's chat template: one function for the router
and for `pagefleet.LLM.chat`, so that both send the engine the same ids for the same messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def check_messages(messages: Sequence[Any]) -> list[dict]:
    """The messages as a list, each a dict with string 'role' and 'content' (a ValueError
    naming the first that is not)."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
    return list(messages)


def render_chat(tokenizer: Any, messages: Sequence[Any], checked: bool = False) -> list[int]:
    """The prompt ids of `messages` under the tokenizer's chat template, with the assistant's
    turn opened (add_generation_prompt); `checked`: `check_messages` passed them already."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer (so no chat template): send token ids")
    messages = messages if checked else check_messages(messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def render_chat_text(tokenizer: Any, messages: Sequence[Any]) -> str:
    """The same prompt as text (what `render_chat` tokenizes)."""
    return tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True, tokenize=False)
