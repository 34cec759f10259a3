"""Research-assistant traces for the routing benchmark, and their reader.

A trace is JSON lines. A request line is
    {"id", "arrival_s", "prompt_token_ids" | "prompt", "max_tokens", "tenant"?}
and, to keep 100k-request traces small, a request may instead name a document defined earlier
in the file and give only what follows it:
    {"doc": "d3", "doc_token_ids": [...]}                           (a document line)
    {"id", "arrival_s", "doc": "d3", "suffix_token_ids": [...], "max_tokens", "tenant"?}
whose prompt is the document's tokens followed by the suffix.

The generated workload: documents that together fit across the groups' KV pools but not in one
(`--fill 0.6`; the tight variant `--fill 2` does not fit at all), each asked several questions
in a burst; document popularity is Zipf-skewed, so the first document is hot; a share of the
requests are unrelated short chats.

    python -m benchmarks.traces --out trace.jsonl --groups 16 --blocks 2048 --requests 100000
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceConfig:
    """The workload's shape; token counts are in tokens, pools in blocks."""

    groups: int = 16
    blocks_per_group: int = 2048
    block_size: int = 16
    fill: float = 0.6  # distinct document tokens / all groups' pool tokens
    docs: int = 0  # 0: documents until they make `fill`; N: exactly N (fill is then unused)
    doc_min_frac: float = 0.05  # document size as a fraction of one group's pool
    doc_max_frac: float = 0.25
    questions_min: int = 2  # per burst
    questions_max: int = 6
    question_tokens: int = 64
    burst_gap_s: float = 0.2  # mean gap between questions of one burst
    zipf_s: float = 1.1  # document popularity ~ 1 / rank**s: rank 1 is the hot document
    chat_share: float = 0.2  # requests that are unrelated short chats
    chat_tokens: int = 200
    max_tokens: int = 32
    tenants: int = 4
    requests: int = 2000
    rate: float = 50.0  # requests per second, Poisson bursts
    vocab: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "blocks_per_group", "block_size", "requests", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.docs < 0:
            raise ValueError(f"docs must be >= 0, got {self.docs}")
        if not 0 < self.doc_min_frac <= self.doc_max_frac <= 1:
            raise ValueError(f"doc_max_frac must be in [doc_min_frac, 1], got {self.doc_max_frac}")
        if not 1 <= self.questions_min <= self.questions_max:
            raise ValueError(f"questions_max must be >= questions_min >= 1, got {self.questions_max}")
        if not 0 <= self.chat_share < 1:
            raise ValueError(f"chat_share must be in [0, 1), got {self.chat_share}")
        if not self.fill > 0 or not self.rate > 0:
            raise ValueError(f"fill and rate must be > 0, got {self.fill}, {self.rate}")


def generate(cfg: TraceConfig) -> Iterator[dict]:
    """Trace lines in arrival order: each document's line just before its first question."""
    rng = random.Random(cfg.seed)
    docs = _documents(cfg, rng)
    weights = [1 / (i + 1) ** cfg.zipf_s for i in range(len(docs))]
    tenant_of = [f"t{i % cfg.tenants}" for i in range(len(docs))]
    defined: set[int] = set()
    pending: list[dict] = []  # questions of open bursts, by arrival
    t, made = 0.0, 0
    ids = itertools.count()
    while made < cfg.requests:
        t += rng.expovariate(cfg.rate)
        if rng.random() < cfg.chat_share:
            n = rng.randint(cfg.chat_tokens // 2, cfg.chat_tokens * 3 // 2)
            pending.append({"arrival_s": t, "prompt_token_ids": _rand(rng, n, cfg.vocab)})
            made += 1
        else:
            d = rng.choices(range(len(docs)), weights)[0]
            at = t
            for _ in range(min(rng.randint(cfg.questions_min, cfg.questions_max), cfg.requests - made)):
                q = _rand(rng, rng.randint(cfg.question_tokens // 2, cfg.question_tokens * 3 // 2), cfg.vocab)
                pending.append({"arrival_s": at, "doc": f"d{d}", "suffix_token_ids": q, "tenant": tenant_of[d]})
                at += rng.expovariate(1 / cfg.burst_gap_s)
                made += 1
        pending.sort(key=lambda r: r["arrival_s"])
        while pending and (pending[0]["arrival_s"] <= t or made >= cfg.requests):
            yield from _emit(pending.pop(0), docs, defined, rng, cfg, ids)


def _documents(cfg: TraceConfig, rng: random.Random) -> list[list[int]]:
    """Documents' tokens: `docs` of them, or as many as make `fill` of the pools."""
    pool_tokens, docs, total = cfg.blocks_per_group * cfg.block_size, [], 0
    while len(docs) < cfg.docs if cfg.docs else total < cfg.fill * cfg.groups * pool_tokens:
        n = rng.randint(int(cfg.doc_min_frac * pool_tokens), int(cfg.doc_max_frac * pool_tokens))
        docs.append(_rand(rng, n, cfg.vocab))
        total += n
    return docs


def _emit(line: dict, docs, defined: set[int], rng: random.Random, cfg: TraceConfig, ids):
    if "doc" in line:
        d = int(line["doc"][1:])
        if d not in defined:
            defined.add(d)
            yield {"doc": line["doc"], "doc_token_ids": docs[d]}
    line["id"] = f"r{next(ids)}"
    line["max_tokens"] = rng.randint(max(1, cfg.max_tokens // 2), cfg.max_tokens * 3 // 2)
    yield line


def _rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, resolved to token ids (or text when the line gave `prompt`)."""

    id: str
    arrival_s: float
    prompt_token_ids: list[int] | None
    prompt: str | None
    max_tokens: int
    tenant: str | None
    doc: str | None  # the named document, if the line referenced one
    doc_tokens: int  # its length: the prompt's leading tokens that are the document


def read(path: str) -> Iterator[TraceRequest]:
    """Requests of a trace file, in file order (which must be arrival order)."""
    docs: dict[str, list[int]] = {}
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            line = json.loads(text)
            if "doc_token_ids" in line:
                docs[line["doc"]] = line["doc_token_ids"]
                continue
            doc = line.get("doc")
            if doc is not None:
                if doc not in docs:
                    raise ValueError(f"{path}:{lineno}: document {doc!r} is not defined above")
                ids, prompt = docs[doc] + line["suffix_token_ids"], None
            else:
                ids, prompt = line.get("prompt_token_ids"), line.get("prompt")
            if (ids is None) == (prompt is None):
                raise ValueError(f"{path}:{lineno}: give prompt_token_ids or prompt")
            yield TraceRequest(
                str(line["id"]),
                float(line["arrival_s"]),
                ids,
                prompt,
                int(line["max_tokens"]),
                line.get("tenant"),
                doc,
                len(docs[doc]) if doc else 0,
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    for name, f in TraceConfig.__dataclass_fields__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    with open(out, "w") as f:
        for line in generate(TraceConfig(**args)):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
