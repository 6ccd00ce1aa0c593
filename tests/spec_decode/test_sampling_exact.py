"""Sampling with ngram drafts: the output distribution is the non-speculative one for every sampling setting.

Verification keeps a draft exactly when the target's own draw at that position (the sampler's counter-based noise
at (seed, output index)) equals it, so with the same seeds the outputs are the plain engine's token for token; the
statistical test checks the distribution itself with independent seeds, against the plain engine's exact
probabilities of the first token and its empirical law of the first three tokens' cycle pattern.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.spec_decode.conftest import cycle_next, cycle_prompt, make_llm, write_cycle_model
from tests.spec_decode.test_greedy_exact import NGRAM, generate, ids, spec_counts
from tokenmill.layers.rejection_sampler import accept_fixed_rate, accept_matching, rejection_sample
from tokenmill.sampling_params import SamplingParams

SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=0.8, top_p=0.8),
            dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01)]
# Settings whose requests decode without drafts (the sampler applies them to one row per request per step).
UNDRAFTED = [dict(temperature=1.0, logit_bias={701: 2.0, 702: -1.0}),
             dict(temperature=0.8, allowed_token_ids=sorted(set(cycle_prompt(700, 7)) | {5, 99}))]


@pytest.fixture(scope="module")
def soft_model(tiny_llama, tmp_path_factory) -> str:
    """The cycle model with a flatter LM head: its next-cycle token has about half the mass, the rest spreads."""
    return write_cycle_model(tiny_llama, str(tmp_path_factory.mktemp("soft-cycle")), mix=0.05, head_scale=0.25)


@pytest.fixture(scope="module")
def engines(soft_model):
    return make_llm(soft_model, max_num_seqs=64), make_llm(soft_model, NGRAM, max_num_seqs=64)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(s))
def test_seeded_and_unseeded_outputs_equal_the_plain_engine(engines, setting):
    plain, spec = engines
    prompts = [cycle_prompt(700, 10), cycle_prompt(1400, 14), cycle_prompt(2100, 6), cycle_prompt(2800, 9)]
    d0, a0 = spec_counts(spec)
    # Unseeded requests take their seeds from the engine's seeded stream in arrival order; both engines of the
    # module see the same requests in the same order, so their streams stay in step.
    for seed in (None, 11):
        params = [SamplingParams(max_tokens=16, seed=None if seed is None else seed + i, **setting)
                  for i in range(len(prompts))]
        assert ids(generate(spec, params, prompts)) == ids(generate(plain, params, prompts))
    drafts, accepted = spec_counts(spec)
    assert drafts > d0 and accepted > a0


@pytest.mark.parametrize("setting", UNDRAFTED, ids=lambda s: ",".join(s))
def test_settings_applied_per_request_decode_without_drafts(soft_model, setting):
    prompts = [cycle_prompt(700, 10), cycle_prompt(1400, 14)]
    params = [SamplingParams(max_tokens=12, seed=3 + i, **setting) for i in range(len(prompts))]
    spec = make_llm(soft_model, NGRAM)
    assert ids(generate(spec, params, prompts)) == ids(generate(make_llm(soft_model), params, prompts))
    assert spec_counts(spec) == (0, 0)


def test_first_tokens_distribution(engines, soft_model):
    """Independent seeds: the first token's frequencies against the plain engine's exact probabilities (chi-square
    over the top tokens plus the rest), and the law of which of the first 3 tokens follow the cycle (the positions
    drafts are accepted at) against the plain engine's empirical law (two-sample chi-square)."""
    plain = engines[0]
    spec = make_llm(soft_model, NGRAM, max_num_seqs=64, seed=1)   # its own seed stream: independent draws
    prompt = cycle_prompt(700, 12)
    n = 400
    params = SamplingParams(temperature=1.0, max_tokens=3)
    exact = generate(plain, SamplingParams(temperature=1.0, max_tokens=1, logprobs=5), [prompt])[0].logprobs[0]
    top = {t: math.exp(lp.logprob) for t, lp in exact.items()}
    got = ids(generate(spec, params, [prompt] * n))
    want = ids(generate(plain, params, [prompt] * n))
    assert spec_counts(spec)[1] > 0

    firsts = [o[0] for o in got]
    observed = np.array([sum(f == t for f in firsts) for t in top] + [sum(f not in top for f in firsts)])
    expected = n * np.array(list(top.values()) + [1 - sum(top.values())])
    keep = expected >= 5
    chi2 = float((((observed - expected) ** 2) / expected)[keep].sum())
    assert chi2 < _chi2_crit(int(keep.sum()) - 1), (observed, expected)

    def pattern(o, last=prompt[-1]):
        bits, prev = 0, last
        for i, t in enumerate(o):
            bits |= (t == cycle_next(prev)) << i
            prev = t
        return bits
    a = np.bincount([pattern(o) for o in got], minlength=8)
    b = np.bincount([pattern(o) for o in want], minlength=8)
    keep = (a + b) >= 10
    a, b = a[keep], b[keep]
    chi2 = float((((a - b) ** 2) / (a + b)).sum())   # equal sample sizes
    assert chi2 < _chi2_crit(len(a) - 1), (a, b)


def _chi2_crit(df: int) -> float:
    """The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty), a false alarm in 1000."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_accept_matching_counts_the_leading_agreements():
    targets = np.array([5, 6, 9, 1, 2, 3, 4, 8])
    drafts = np.array([5, 6, 7, -1, 2, 3, 4, -1])
    assert accept_matching(targets, drafts, np.array([4, 1, 3])).tolist() == [3, 1, 3]


def test_fixed_rate_acceptance_has_the_rate():
    keep = accept_fixed_rate(np.full(20000, 5), 0.75, np.random.default_rng(0))
    accepted = keep - 1
    # The leading run of Bernoulli(0.75) over 4 drafts: mean 0.75 + 0.75^2 + 0.75^3 + 0.75^4.
    assert abs(accepted.mean() - sum(0.75 ** i for i in range(1, 5))) < 0.03
    assert accept_fixed_rate(np.full(10, 5), 0.0, np.random.default_rng(0)).tolist() == [1] * 10
    assert accept_fixed_rate(np.full(10, 5), 1.0, np.random.default_rng(0)).tolist() == [5] * 10


def test_rejection_sample_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    v, k, n = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(k, v, generator=g), -1)
    firsts = []
    for _ in range(n):
        d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
        toks, _ = rejection_sample(p, q, d, g)
        firsts.append(int(toks[0]))
    freq = np.bincount(firsts, minlength=v) / n
    assert np.abs(freq - p[0].numpy()).max() < 0.015
