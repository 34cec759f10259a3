"""Request traces for the benchmarks, deterministic from a seed.

The research-assistant trace: a few long documents, several different questions about each
(prompt = the whole document + the question, so questions on one document share its prefix),
and some unrelated short chats. Every request asks for an exact number of output tokens, drawn
uniformly from `output_len`; the systems under test run with EOS ignored, so each generates
exactly that many. Prompts are random token ids: a random-weight model reads them as well as
text, and no tokenizer is needed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ResearchWorkload:
    """Shape of the research-assistant trace; lengths are inclusive [low, high] in tokens."""

    num_docs: int = 4
    doc_len: tuple[int, int] = (1000, 1500)
    questions_per_doc: int = 4
    question_len: tuple[int, int] = (16, 48)
    num_chats: int = 8
    chat_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 128)
    vocab_size: int = 2048
    seed: int = 0
    shuffle: bool = True  # interleave questions and chats, as they would arrive

    def __post_init__(self) -> None:
        for name in ("num_docs", "questions_per_doc", "num_chats"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("doc_len", "question_len", "chat_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.num_docs * self.questions_per_doc + self.num_chats == 0:
            raise ValueError("the workload has no requests: raise num_docs/questions_per_doc or num_chats")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a trace."""

    kind: str  # "question" (about a document) or "chat"
    doc: int  # index of the document asked about; -1 for chats
    prompt: tuple[int, ...]  # token ids
    max_tokens: int  # exact number of tokens to generate

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def research_requests(w: ResearchWorkload) -> list[BenchRequest]:
    """The trace of `w`: the same list for the same config, in arrival order."""
    rng = random.Random(w.seed)
    # Token 0 is left out of prompts: the static-batch baseline pads with it.
    tokens = lambda n: tuple(rng.randrange(1, w.vocab_size) for _ in range(n))  # noqa: E731
    length = lambda span: rng.randint(*span)  # noqa: E731
    reqs: list[BenchRequest] = []
    for d in range(w.num_docs):
        doc = tokens(length(w.doc_len))
        for _ in range(w.questions_per_doc):
            question = tokens(length(w.question_len))
            reqs.append(BenchRequest("question", d, doc + question, length(w.output_len)))
    for _ in range(w.num_chats):
        reqs.append(BenchRequest("chat", -1, tokens(length(w.chat_len)), length(w.output_len)))
    if w.shuffle:
        rng.shuffle(reqs)
    return reqs


def describe(reqs: list[BenchRequest]) -> dict:
    """Counts that a report states next to its measurements."""
    docs = {r.doc for r in reqs if r.doc >= 0}
    return {
        "requests": len(reqs),
        "documents": len(docs),
        "questions": sum(r.kind == "question" for r in reqs),
        "chats": sum(r.kind == "chat" for r in reqs),
        "prompt_tokens": sum(r.prompt_len for r in reqs),
        "output_tokens": sum(r.max_tokens for r in reqs),
    }
