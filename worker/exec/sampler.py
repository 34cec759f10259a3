"""The sampler: one step's logits in, one token per sampled request out.

Pipeline per step, in the order Hugging Face `generate` applies the same processors:

    structured outputs: the tokens a row's grammar forbids at -inf (its token bitmask)
    -> penalties (repetition over prompt + output; presence and frequency over output)
    -> greedy rows: argmax
    -> random rows: temperature -> top-k -> top-p -> min-p -> sample

Sampling inverts each row's cumulative distribution at one uniform draw. A seeded request's
draw is a function of its seed and the token's position alone (`seeded_uniform`), so its tokens
do not depend on which requests share its batch, nor on where it runs: a request resumed on
another group after its first one died draws what it would have drawn. Unseeded rows draw from
the global torch RNG. One number per row, not one per vocabulary entry as in the exponential
race, keeps the CPU path cheap.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from worker.outputs import TokenLogprobs
from worker.sampling_params import SamplingParams

LogprobsMode = Literal["raw", "processed"]


class RowGrammar(Protocol):
    """A constrained row's matcher, as the sampler reads it (worker/engine/grammar.py's
    `RequestGrammar`)."""

    mask_words: int  # int32 words of a bitmask row: ceil(vocab / 32)

    def fill(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write row `index` of the (n, mask_words) int32 bitmask of allowed tokens; False
        when the row is unconstrained this step (the row left untouched)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance over the token sampled for the row (the model runner calls it once the
        step's tokens are taken)."""
        ...


@dataclass
class SamplingRow:
    """One request that samples this step; built by the model runner."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, before this step
    # Ids that must not be sampled this step: EOS and stop tokens before params.min_tokens.
    suppressed: tuple[int, ...] = ()
    grammar: RowGrammar | None = None  # what the output must match (structured outputs)
    # output tokens before this step, the position of a seeded draw: kept by the model runner,
    # which advances it with each step it samples (a forward run ahead samples before the
    # engine has appended the last token to output_token_ids); None: len(output_token_ids)
    position: int | None = None


@dataclass
class RowKinds:
    """What a batch of rows needs beyond an argmax."""

    penalized: bool  # some row has a penalty
    suppressing: bool  # some row suppresses ids (min_tokens)
    random: list[int]  # rows that draw (temperature > 0)
    logprobs: list[int]  # rows that report logprobs
    constrained: list[int] = field(default_factory=list)  # rows under a grammar

    @property
    def argmax_only(self) -> bool:
        return not (self.penalized or self.suppressing or self.random or self.logprobs or self.constrained)


def kinds_of(rows: Sequence[SamplingRow]) -> RowKinds:
    """Which rows need what: worked out once for rows that serve several steps."""
    return RowKinds(
        penalized=any(r.params.has_penalties for r in rows),
        suppressing=any(r.suppressed for r in rows),
        random=[i for i, r in enumerate(rows) if not r.params.greedy],
        logprobs=[i for i, r in enumerate(rows) if r.params.logprobs is not None],
        constrained=[i for i, r in enumerate(rows) if r.grammar is not None],
    )


@dataclass
class Masks:
    """The constrained rows' allowed tokens for one step, filled from their grammars before
    the step's logits exist (the model runner fills them while the forward runs)."""

    bitmask: torch.Tensor  # (n, ceil(vocab / 32)) int32 on the CPU; -1 (all allowed) in other rows
    filled: list[int]  # rows whose grammar wrote its row
    seconds: float  # the time filling took


@dataclass
class SampleResult:
    """What one sampler call returns, one entry per row."""

    ids: torch.Tensor  # (n,) int32 on the CPU: the sampled token ids (made so on the device)
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
    _token_ids: list[int] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """`ids` as a list (made when first asked: off the path between two forwards)."""
        if self._token_ids is None:
            self._token_ids = self.ids.tolist()
        return self._token_ids


class Sampler:
    """Samples one token per row from a step's logits.

    `logprobs_mode` says which distribution the reported logprobs come from:
      - "raw" (default, as vLLM): `log_softmax` of the model's logits, before any penalty,
        temperature or filtering.
      - "processed": `log_softmax` after penalties and temperature (greedy rows: after
        penalties only), before top-k / top-p / min-p filtering.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        # time spent filling and applying grammars' masks, in all (updated on the sampling
        # thread only); the filling's share, which may have run beside the forward
        self.mask_seconds = 0.0
        self.mask_fill_seconds = 0.0

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        kinds: RowKinds | None = None,
        masks: Masks | None = None,
    ) -> SampleResult:
        """Sample one token per row. logits: (n, vocab) float, row i belongs to rows[i];
        `kinds`: `kinds_of(rows)`, when the caller keeps it for rows it hands again; `masks`:
        `fill_masks(rows, kinds.constrained)`, when the caller filled them ahead."""
        _check_inputs(logits, rows)
        if not rows:
            return SampleResult(ids=torch.zeros(0, dtype=torch.int32), logprobs=[])
        kinds = kinds or kinds_of(rows)
        if kinds.argmax_only:  # the common all-greedy batch: one argmax
            ids = logits.argmax(dim=-1).to(torch.int32).cpu()
            return SampleResult(ids=ids, logprobs=[None] * len(rows))
        logits = logits.float()
        if kinds.constrained:  # before everything: logprobs report the masked distribution
            logits = self.apply_masks(logits, masks or self.fill_masks(rows, kinds.constrained))
        penalized = logits
        if kinds.penalized:
            penalized = apply_penalties(logits, rows)
        if kinds.suppressing:
            penalized = suppress(penalized, rows)
        # The common all-greedy batch is this one argmax.
        token_ids = penalized.argmax(dim=-1)  # (n,)
        if kinds.random:
            token_ids[kinds.random] = self._sample_random(penalized, rows, kinds.random)
        logprobs = [None] * len(rows)
        if kinds.logprobs:
            logprobs = self._logprobs(logits, penalized, rows, token_ids, kinds.logprobs)
        return SampleResult(ids=token_ids.to(torch.int32).cpu(), logprobs=logprobs)

    def filtered_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits whose softmax each row samples from, (n, vocab).

        Greedy rows: penalized logits (their argmax is the token). Random rows: after
        penalties, temperature, top-k, top-p and min-p, with removed tokens at -inf.
        """
        _check_inputs(logits, rows)
        logits = logits.float()
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            logits = self.mask(logits.clone(), rows, constrained)
        out = suppress(apply_penalties(logits, rows), rows)
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_idx:
            out = out.clone()
            out[random_idx] = _warp(out[random_idx], [rows[i].params for i in random_idx])
        return out

    def mask(self, logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> torch.Tensor:
        """The rows `idx`' forbidden tokens at -inf, in place: logits (n, vocab) float32."""
        return self.apply_masks(logits, self.fill_masks(rows, idx))

    @staticmethod
    def fill_masks(rows: Sequence[SamplingRow], idx: list[int]) -> Masks:
        """The bitmask of the rows `idx` (constrained): each row's grammar fills its row on the
        CPU (microseconds a row). Reads only the rows' matchers, so that it may run on another
        thread while the step's forward runs (the matchers stand still until the step ends)."""
        t0 = time.perf_counter()
        bitmask = torch.full((len(rows), rows[idx[0]].grammar.mask_words), -1, dtype=torch.int32)  # (n, words)
        filled = [i for i in idx if rows[i].grammar.fill(bitmask, i)]
        return Masks(bitmask, filled, time.perf_counter() - t0)

    def apply_masks(self, logits: torch.Tensor, masks: Masks) -> torch.Tensor:
        """The forbidden tokens of `masks` at -inf, in place: logits (n, vocab) float32
        (xgrammar's kernel applies the bitmask)."""
        import xgrammar as xgr

        t0 = time.perf_counter()
        if masks.filled:
            xgr.apply_token_bitmask_inplace(logits, masks.bitmask.to(logits.device), indices=masks.filled)
        self.mask_fill_seconds += masks.seconds
        self.mask_seconds += masks.seconds + time.perf_counter() - t0
        return logits

    def _sample_random(self, penalized: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> torch.Tensor:
        warped = _warp(penalized[idx], [rows[i].params for i in idx])  # (r, vocab)
        uniforms = torch.rand(len(idx), dtype=torch.float64)  # (r,): the unseeded rows'
        for j, i in enumerate(idx):
            row = rows[i]
            if row.params.seed is not None:  # the draw of this request at this position, wherever it runs
                position = len(row.output_token_ids) if row.position is None else row.position
                uniforms[j] = seeded_uniform(row.params.seed, position)
        return draw(warped.softmax(dim=-1), uniforms.to(warped.device))

    def _logprobs(
        self,
        raw: torch.Tensor,
        penalized: torch.Tensor,
        rows: Sequence[SamplingRow],
        token_ids: torch.Tensor,
        idx: list[int],
    ) -> list[TokenLogprobs | None]:
        """TokenLogprobs of the rows `idx` (those that asked), None for the others."""
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if self.logprobs_mode == "raw":
            source = raw[idx]
        else:
            temps = [1.0 if rows[i].params.greedy else rows[i].params.temperature for i in idx]
            source = penalized[idx] / torch.tensor(temps, device=raw.device).unsqueeze(1)
        logp = torch.log_softmax(source, dim=-1)  # (m, vocab)
        chosen = token_ids[idx]  # (m,)
        chosen_lp = logp.gather(1, chosen.unsqueeze(1))  # (m, 1)
        ranks = (logp > chosen_lp).sum(dim=-1) + 1  # (m,)
        n_max = max(rows[i].params.logprobs for i in idx)
        top_lp, top_ids = logp.topk(min(n_max, logp.shape[1]), dim=-1)  # (m, n_max), descending
        for j, i in enumerate(idx):
            n = rows[i].params.logprobs
            out[i] = TokenLogprobs(
                token_id=int(chosen[j]),
                logprob=float(chosen_lp[j, 0]),
                rank=int(ranks[j]),
                top=list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist(), strict=True)),
            )
        return out


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of a seeded request's output token at `position` (0: its
    first): BLAKE2b of the two, as 53 bits. A counter-based stream, not a stateful generator, so
    that a continuation (a request resumed elsewhere, or recomputed after preemption) draws
    what the original would have."""
    digest = hashlib.blake2b(_SEED_AT.pack(seed % 2**64, position), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


_SEED_AT = struct.Struct("<QQ")


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties; returns new logits (n, vocab).

    Repetition (Hugging Face / vLLM): over prompt + output tokens, positive logits are divided
    by the penalty and negative ones multiplied. Presence and frequency (OpenAI): over output
    tokens, logit -= frequency * count + presence * (count > 0). The work is a gather and a
    scatter over the rows' token ids, not a pass over the vocabulary per penalty.
    """
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    out = logits.clone()
    params = [rows[i].params for i in idx]
    row_of = torch.tensor(idx, device=logits.device)  # (p,) batch row of each penalized request
    if any(p.repetition_penalty != 1.0 for p in params):
        seqs = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in idx]
        owner, tokens = _flat_ids(seqs, logits.device)  # (t,), (t,)
        rep = _per_token([p.repetition_penalty for p in params], owner, logits)  # (t,)
        vals = out[row_of[owner], tokens]
        # Repeated ids write the same value, computed from the unpenalized logit, once.
        out[row_of[owner], tokens] = torch.where(vals < 0, vals * rep, vals / rep)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        owner, tokens = _flat_ids([rows[i].output_token_ids for i in idx], logits.device)
        key, order = (owner * logits.shape[1] + tokens).sort()  # equal (row, id) adjacent
        owner, tokens = owner[order], tokens[order]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]  # first occurrence of each (row, id)
        freq = _per_token([p.frequency_penalty for p in params], owner, logits)  # (t,)
        pres = _per_token([p.presence_penalty for p in params], owner, logits)
        # Every occurrence pays the frequency penalty; the first also pays the presence one.
        penalty = freq + pres * first.to(out.dtype)
        out.index_put_((row_of[owner], tokens), -penalty, accumulate=True)
    return out


def suppress(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's `suppressed` ids at -inf (min_tokens: no EOS or stop token before then);
    returns new logits (n, vocab), or the same tensor when no row suppresses anything."""
    idx = [(i, t) for i, r in enumerate(rows) for t in r.suppressed if t < logits.shape[1]]
    if not idx:
        return logits
    out = logits.clone()
    rows_idx, ids = zip(*idx, strict=True)
    out[list(rows_idx), list(ids)] = -float("inf")
    return out


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (r, vocab), uniforms (r,) in [0, 1) -> token ids (r,).

    Each token's share of the float32 cumulative sum is its probability to within one ulp of
    the running total (about 6e-8), which is far below anything a sampling test can see.
    """
    cdf = probs.cumsum(dim=-1)  # (r, vocab)
    target = (uniforms * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(1)  # (r, 1)
    ids = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)  # (r, 1)
    # Rounding can put target at (or past) the total: step back to the last token with mass.
    empty = probs.gather(1, ids).squeeze(1) == 0  # (r,)
    if bool(empty.any()):
        last = probs.shape[1] - 1 - (probs[empty] > 0).flip(-1).int().argmax(dim=-1)
        ids[empty, 0] = last
    return ids.squeeze(1)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits (r, vocab) / temperature (r,), all temperatures > 0."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering; removed tokens become -inf.

    logits (r, vocab); top_k (r,) int, values <= 0 mean disabled; top_p (r,) float, 1 disables.
    Semantics match Hugging Face's `TopKLogitsWarper` (ties at the k-th value are kept) and
    `TopPLogitsWarper` (drop the ascending-sorted tokens whose cumulative probability is
    <= 1 - top_p, always keep the most likely one).
    """
    vocab = logits.shape[1]
    if bool((top_k > 0).all()):
        # Every row has a k: filter within the top max(k) instead of sorting the vocabulary.
        k = top_k.clamp(max=vocab)
        vals, ids = logits.topk(int(k.max()), dim=-1)  # (r, k_max), descending
        kth = vals.gather(1, (k - 1).unsqueeze(1))  # (r, 1)
        # Ties with the k-th value outside the slice would also be kept; sort fully then.
        if not bool(((logits >= kth).sum(dim=-1) > k).any()):
            kept = _filter_sorted(vals.flip(-1), top_k, top_p)  # ascending, as below
            return torch.full_like(logits, float("-inf")).scatter_(1, ids.flip(-1), kept)
    sorted_l, sorted_idx = logits.sort(dim=-1, descending=False)  # (r, vocab), ascending
    return torch.empty_like(logits).scatter_(1, sorted_idx, _filter_sorted(sorted_l, top_k, top_p))


def _filter_sorted(sorted_l: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k and top-p on ascending-sorted logits (r, width); the largest value is last."""
    width = sorted_l.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)  # (r,)
    kth = sorted_l.gather(1, (width - k).unsqueeze(1))  # (r, 1) the k-th largest value
    sorted_l = sorted_l.masked_fill(sorted_l < kth, float("-inf"))
    cum = sorted_l.softmax(dim=-1).cumsum(dim=-1)  # (r, width)
    drop = (cum <= (1 - top_p).unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    return sorted_l.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p (r,) times the top probability."""
    probs = logits.softmax(dim=-1)  # (r, vocab)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values  # (r, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for random rows; logits (r, vocab)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = apply_temperature(logits, temps)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        logits = apply_min_p(logits, min_p)
    return logits


def _flat_ids(seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of every sequence: (index of its sequence, token id), each (total,) long."""
    lengths = torch.tensor([len(s) for s in seqs])
    owner = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return owner.to(device), tokens.to(device)


def _per_token(values: list[float], owner: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-request value broadcast to each of that request's tokens, (total,)."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[owner]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _check_inputs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be (len(rows), vocab) = ({len(rows)}, vocab), got {tuple(logits.shape)}")
