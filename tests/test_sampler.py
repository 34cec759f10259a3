"""The sampler against Hugging Face's logits processors and against the laws of sampling."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.exec.sampler import Sampler, SamplingRow, draw, seeded_uniform
from worker.sampling_params import SamplingParams

VOCAB = 64
# Chi-square critical value, 4 degrees of freedom, significance 0.001.
CHI2_DF4_P001 = 18.467


def make_rows(params_list, prompt_len=6, output_len=5, seed=0, vocab=VOCAB):
    """One row per params, with random prompt/output ids and per-request generators."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for params in params_list:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        output = torch.randint(0, vocab, (output_len,), generator=g).tolist()
        rows.append(SamplingRow(params, prompt, output))
    return rows


def random_logits(n, vocab=VOCAB, seed=0, scale=3.0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_warp(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The Hugging Face `generate` warper chain for one row, in its order."""
    scores = logits_row.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)  # the warpers ignore input ids
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


def assert_same_filtered(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite])


def test_repetition_penalty_matches_transformers():
    params = [SamplingParams(temperature=0, repetition_penalty=r) for r in (1.3, 0.7, 2.0, 1.0)]
    rows = make_rows(params)
    logits = random_logits(len(rows))
    ours = Sampler().filtered_logits(logits, rows)
    for i, row in enumerate(rows):
        input_ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)])
        proc = RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)
        ref = proc(input_ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref)
    assert not torch.equal(ours[0], logits[0])  # the penalty did something


def test_presence_and_frequency_penalties_follow_openai_formula():
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    rows = make_rows(params, output_len=30)  # repeats among 30 draws from 64 ids
    logits = random_logits(len(rows))
    ours = Sampler().filtered_logits(logits, rows)
    for i, row in enumerate(rows):
        # mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        ref = logits[i].clone()
        for tok in set(row.output_token_ids):
            c = list(row.output_token_ids).count(tok)
            ref[tok] -= c * row.params.frequency_penalty + row.params.presence_penalty
        torch.testing.assert_close(ours[i], ref)


WARP_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.6, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=-1, top_p=0.95),
    SamplingParams(temperature=2.0, top_k=VOCAB + 10),
]


def test_warpers_match_transformers_in_one_mixed_batch():
    rows = make_rows(WARP_CASES)
    logits = random_logits(len(rows), seed=1)
    ours = Sampler().filtered_logits(logits, rows)
    for i, row in enumerate(rows):
        assert_same_filtered(ours[i], hf_warp(logits[i], row.params))


def test_penalties_then_warpers_match_transformers():
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, repetition_penalty=1.5)
    rows = make_rows([p])
    logits = random_logits(1, seed=2)
    ids = torch.tensor([list(rows[0].prompt_token_ids) + list(rows[0].output_token_ids)])
    penalized = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())[0]
    assert_same_filtered(Sampler().filtered_logits(logits, rows)[0], hf_warp(penalized, p))


def test_greedy_picks_argmax_and_applies_penalties_first():
    rows = make_rows([SamplingParams(temperature=0)] * 8)
    logits = random_logits(8, seed=3)
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()

    # A strong repetition penalty on the argmax token must move the choice.
    top = int(logits[0].argmax())
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=100.0), [top], [])
    ids = torch.tensor([[top]])
    ref = RepetitionPenaltyLogitsProcessor(100.0)(ids, logits[:1].clone()).argmax(-1)
    chosen = Sampler()(logits[:1], [row]).token_ids
    assert chosen == ref.tolist() and chosen[0] != top


def test_top_k_one_equals_greedy():
    rows = make_rows([SamplingParams(temperature=1.0, top_k=1)] * 16)
    logits = random_logits(16, seed=4, scale=0.5)  # flat: sampling would usually disagree
    torch.manual_seed(0)
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def _run_steps(sampler, rows, steps, which):
    """Sample `steps` times with fresh per-step logits; return the tokens of row `which`."""
    out = []
    for step in range(steps):
        logits = random_logits(1, seed=100 + step).expand(len(rows), VOCAB).clone()
        sampled = sampler(logits, rows).token_ids
        for row, token in zip(rows, sampled, strict=True):
            row.output_token_ids.append(token)  # as the engine does between steps
        out.append(sampled[which])
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    other = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, seed=7)]
    sampler = Sampler()

    def fresh(p):
        return SamplingRow(p, [1, 2], [])

    alone = _run_steps(sampler, [fresh(seeded)], 20, 0)
    again = _run_steps(sampler, [fresh(seeded)], 20, 0)
    mixed = _run_steps(sampler, [fresh(other[0]), fresh(seeded), fresh(other[1])], 20, 1)
    reordered = _run_steps(sampler, [fresh(other[1]), fresh(other[0]), fresh(seeded)], 20, 2)
    assert alone == again == mixed == reordered
    different = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert _run_steps(sampler, [fresh(different)], 20, 0) != alone


def test_unseeded_rows_use_the_global_rng():
    rows = make_rows([SamplingParams(temperature=1.0)] * 32)
    logits = random_logits(32, seed=5, scale=0.5)
    torch.manual_seed(11)
    first = Sampler()(logits, rows).token_ids
    torch.manual_seed(11)
    assert Sampler()(logits, rows).token_ids == first


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


PROBS = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])


def test_frequencies_follow_the_distribution_global_rng():
    n = 2000
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range(n)]
    torch.manual_seed(0)
    tokens = Sampler()(PROBS.log().expand(n, 5).clone(), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    assert chi_square(counts, PROBS) < CHI2_DF4_P001


def test_frequencies_follow_the_filtered_distribution_seeded():
    # The seeded path, through temperature and top-p: 400 requests with their own seeds,
    # 5 decoding steps each, 2000 draws in all.
    params = [SamplingParams(temperature=0.8, top_p=0.8, seed=s) for s in range(400)]
    rows = [SamplingRow(p, [], []) for p in params]
    logits = PROBS.log().expand(len(rows), 5).clone()
    sampler = Sampler()
    tokens = []
    for _ in range(5):
        step = sampler(logits, rows).token_ids
        for row, token in zip(rows, step, strict=True):
            row.output_token_ids.append(token)
        tokens += step
    target = hf_warp(logits[0], params[0]).softmax(-1)
    kept = target > 0
    assert 1 < int(kept.sum()) < 5  # top-p removed something, and sampling is not trivial
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    assert counts[~kept].sum() == 0
    df = int(kept.sum()) - 1
    critical = {1: 10.828, 2: 13.816, 3: 16.266}[df]  # chi-square, significance 0.001
    assert chi_square(counts[kept], target[kept]) < critical


def test_raw_logprobs_are_log_softmax_and_top_n_sorted():
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    rows = make_rows(params)
    logits = random_logits(len(rows), seed=6)
    res = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert res.logprobs[2] is None
    for i in (0, 1, 3):
        lp = res.logprobs[i]
        tok = res.token_ids[i]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, float(ref[i, tok]), rel_tol=1e-6, abs_tol=1e-6)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        n = params[i].logprobs
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        ref_vals, ref_ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_vals)
    assert res.logprobs[0].rank == 1  # greedy chose the top token


def test_processed_logprobs_follow_penalties_and_temperature():
    p = SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.5)
    rows = make_rows([p])
    logits = random_logits(1, seed=7)
    res = Sampler(logprobs_mode="processed")(logits, rows)
    ids = torch.tensor([list(rows[0].prompt_token_ids) + list(rows[0].output_token_ids)])
    penalized = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    ref = torch.log_softmax(TemperatureLogitsWarper(0.5)(ids, penalized), dim=-1)[0]
    lp = res.logprobs[0]
    assert math.isclose(lp.logprob, float(ref[res.token_ids[0]]), rel_tol=1e-5, abs_tol=1e-5)
    torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), ref.topk(4).values)


def test_bad_shapes_and_modes_raise():
    rows = make_rows([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(random_logits(3), rows)
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="bogus")
    assert Sampler()(torch.empty(0, VOCAB), []).token_ids == []


def test_top_k_keeps_ties_like_transformers():
    # Quantized models tie often: the 3rd and 4th largest are equal here.
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0, 3.0, 0.5, 4.0, 3.0]])
    top_k_only = SamplingParams(top_k=3)
    ours = Sampler().filtered_logits(logits, [SamplingRow(top_k_only, [], [])])[0]
    assert_same_filtered(ours, hf_warp(logits[0], top_k_only))
    assert int(torch.isfinite(ours).sum()) == 5  # 5.0, 4.0 and the three 3.0s
    with_top_p = SamplingParams(top_k=3, top_p=0.9)
    ours = Sampler().filtered_logits(logits, [SamplingRow(with_top_p, [], [])])[0]
    assert_same_filtered(ours, hf_warp(logits[0], with_top_p))


def test_draw_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    for u in (0.0, 0.5, 1 - 2**-53):
        uniforms = torch.full((2,), u, dtype=torch.float64)
        ids = draw(probs, uniforms).tolist()
        assert probs[0, ids[0]] > 0 and ids[1] == 3


def test_a_seeded_draw_depends_on_the_seed_and_the_position_alone():
    """A request resumed elsewhere with its first k tokens already generated draws, at
    position k, what the undisturbed request drew there."""
    params = SamplingParams(temperature=1.0, seed=99)
    sampler = Sampler()
    whole = SamplingRow(params, [1, 2], [])
    tokens = []
    for step in range(12):
        logits = random_logits(1, seed=300 + step)
        tokens.append(sampler(logits, [whole]).token_ids[0])
        whole.output_token_ids.append(tokens[-1])
    resumed = SamplingRow(params, [1, 2], tokens[:7])  # a fresh row, seven tokens in
    for step in range(7, 12):
        token = sampler(random_logits(1, seed=300 + step), [resumed]).token_ids[0]
        assert token == tokens[step]
        resumed.output_token_ids.append(token)
    assert seeded_uniform(99, 3) == seeded_uniform(99, 3) != seeded_uniform(99, 4)
    assert 0.0 <= seeded_uniform(-5, 0) < 1.0
