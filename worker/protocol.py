"""What crosses a worker group's boundary, free of torch: the request a group receives
(`GenerationRequest`, with `Resume` for a request continued after its group died), the errors
it answers with, and what a router of another process needs to know of its model
(`ModelFacts`: the block hasher's fingerprint, the limits, the tokenizer's files). What it streams back is worker/outputs.py (`RequestOutput`); its
sampling options worker/sampling_params.py. A router imports these, never the engine.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.hashing import ModelFingerprint
from worker.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    """A request as a group receives it (from the router or a local caller)."""

    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    block_hashes: Sequence[bytes] | None = None  # the router's hashes of the prompt, if any
    resume: Resume | None = None  # continuing a request whose first group died
    tenant: str = ""  # whose fair share of the group it counts against ("": the only one)
    pin: Pin | None = None  # keep the prompt's blocks pinned once prefilled (a document)


@dataclass(frozen=True)
class Pin:
    """A document the group keeps warm: once the request that carries it is prefilled, the
    prompt's full blocks stay pinned under `document_id` until `expires_at` (time.time(), so
    that it means the same on every node) or an unpin. `tier` "device": held in the device
    pool (never evicted); "host": free to leave the device as any block does, but kept in the
    host tier once there (never evicted from it), so that a question restores it rather than
    recomputing, without holding device blocks."""

    document_id: str
    expires_at: float
    tier: str = "device"


@dataclass(frozen=True)
class Resume:
    """A request continued on this group after its group died mid-stream: the tokens it had
    generated (and streamed), how many characters of their text were shown, and their logprobs
    (when asked). The group computes the prompt and those tokens again (or finds them in its
    prefix cache) and streams only what follows; a seeded request draws what it would have
    drawn (worker/exec/sampler.py: seeded_uniform), so the output equals an undisturbed run's."""

    token_ids: tuple[int, ...]
    text_sent: int = 0
    logprobs: tuple = ()  # TokenLogprobs per token, when asked


class EngineDeadError(RuntimeError):
    """The engine loop stopped; in-flight requests fail with this."""


class PinRefusedError(RuntimeError):
    """A pin the group cannot hold: its pinned blocks would pass their share of the pool."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


@dataclass(frozen=True)
class ModelFacts:
    """A group's model as a router sees it: the fingerprint its blocks are hashed with, its
    context, vocabulary and end-of-sequence ids, and its tokenizer as the files
    `save_pretrained` writes (None: token-id prompts only). A router of another process builds
    its hasher and tokenizer from these, never from the weights: it loads no torch, and it
    names blocks exactly as the group does."""

    fingerprint: ModelFingerprint
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_files: dict[str, bytes] | None

    @staticmethod
    def tokenizer_files_of(tokenizer) -> dict[str, bytes] | None:
        """A tokenizer's files (tokenizer.json, its config, the chat template)."""
        if tokenizer is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    def tokenizer(self):
        """The tokenizer from its files, as transformers' fast tokenizer: the same ids and
        chat template as the group's (tests/test_structure.py), without the model classes
        (which load torch)."""
        if self.tokenizer_files is None:
            return None
        from transformers import PreTrainedTokenizerFast

        with tempfile.TemporaryDirectory() as tmp:
            for name, data in self.tokenizer_files.items():
                (Path(tmp) / Path(name).name).write_bytes(data)
            return PreTrainedTokenizerFast.from_pretrained(tmp)
