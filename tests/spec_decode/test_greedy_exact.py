"""Greedy decoding with ngram drafts gives the tokens of decoding without them, drafts are accepted (the tests
cannot pass vacuously), and what ends or interrupts a request inside an accepted run behaves as without drafts."""
from __future__ import annotations

import pytest

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tokenmill.sampling_params import SamplingParams

# Prompts that hold the model's cycle (drafts accepted), a plain ramp (jumps: drafts rejected), a long cycle.
PROMPTS = [cycle_prompt(700, 10), cycle_prompt(1403, 3), list(range(40, 70)), cycle_prompt(9, 40)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def generate(llm, params, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def ids(outs):
    return [list(o.token_ids) for o in outs]


def spec_counts(llm) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_draft_tokens"].value, m["vllm:spec_decode_num_accepted_tokens"].value


@pytest.fixture(scope="module")
def baseline(cycle_model):
    return make_llm(cycle_model)


@pytest.fixture(scope="module")
def ngram(cycle_model):
    return make_llm(cycle_model, NGRAM)


def test_greedy_tokens_identical_and_drafts_accepted(baseline, ngram):
    params = SamplingParams(temperature=0, max_tokens=48)
    d0, a0 = spec_counts(ngram)
    want = ids(generate(baseline, params))
    assert ids(generate(ngram, params)) == want
    drafts, accepted = spec_counts(ngram)
    drafts, accepted = drafts - d0, accepted - a0
    assert drafts > 0 and 0.3 * drafts < accepted < drafts, (drafts, accepted)  # accepted and rejected drafts


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_inside_an_accepted_run(baseline, ngram, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    got, want = generate(ngram, params), generate(baseline, params)
    assert ids(got) == ids(want)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in got)


def test_stop_token_inside_an_accepted_run(baseline, ngram):
    # Token 705 comes in the middle of the accepted run of the first prompt's continuation (703, 704, 705, ...).
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[705, 13])
    got, want = generate(ngram, params), generate(baseline, params)
    assert ids(got) == ids(want)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.stop_reason for o in got] == [o.stop_reason for o in want]
    assert got[0].token_ids[-1] == 705 and got[0].finish_reason == "stop"


def test_stop_string_inside_an_accepted_run(baseline, ngram):
    plain = generate(baseline, SamplingParams(temperature=0, max_tokens=30), PROMPTS[:1])[0]
    stop = plain.text[len(plain.text) // 2:][:3]   # text from the middle of the continuation
    assert stop.strip()
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=include)
        got, want = generate(ngram, params, PROMPTS[:1])[0], generate(baseline, params, PROMPTS[:1])[0]
        assert (got.text, list(got.token_ids), got.finish_reason, got.stop_reason) == \
            (want.text, list(want.token_ids), want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop" and len(got.token_ids) < 30


def test_logprobs_of_accepted_tokens_as_without_speculation(baseline, ngram):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    got, want = generate(ngram, params), generate(baseline, params)
    assert ids(got) == ids(want)
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(w.logprobs) == 16
        for pg, pw in zip(g.logprobs, w.logprobs):
            assert pg.keys() == pw.keys()
            for t in pg:
                assert pg[t].rank == pw[t].rank
                assert abs(pg[t].logprob - pw[t].logprob) < 1e-4


def test_max_model_len_inside_an_accepted_run(cycle_model):
    prompt = cycle_prompt(700, 20)
    params = SamplingParams(temperature=0, max_tokens=100)
    want = generate(make_llm(cycle_model, max_model_len=31), params, [prompt])[0]
    got = generate(make_llm(cycle_model, NGRAM, max_model_len=31), params, [prompt])[0]
    assert list(got.token_ids) == list(want.token_ids) and len(got.token_ids) == 11
    assert got.finish_reason == want.finish_reason == "length"
