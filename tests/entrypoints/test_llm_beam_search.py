"""LLM.beam_search against a beam search written directly over HF transformers (fp32, CPU), and its edge cases."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.beam_search import beam_score
from tokenmill.sampling_params import BeamSearchParams

PROMPTS = ["Hello, my name is", "深度学习的优势是什么？"]


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    import transformers as tf
    d = tiny_model_factory("llama")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=16)
    return hf, llm


def hf_beam_search(hf, prompt_ids, k, steps, eos, length_penalty, ignore_eos):
    """The same search, scoring every beam with a full HF forward: (tokens, cum_logprob) best first."""
    live, done = [(list(prompt_ids), 0.0)], []
    for _ in range(steps):
        cands = []
        for toks, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].float(), -1)
            vals, ids = lp.topk(2 * k)
            for v, t in zip(vals.tolist(), ids.tolist()):
                (done if t == eos and not ignore_eos else cands).append((toks + [t], cum + v))
        live = sorted(cands, key=lambda c: c[1], reverse=True)[:k]

    def score(c):
        n = len(c[0]) - (1 if c[0][-1] == eos else 0)
        return c[1] / n ** length_penalty
    return sorted(done + live, key=score, reverse=True)[:k]


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (3, 0.5)])
def test_beams_match_a_direct_hf_search(pair, k, length_penalty):
    hf, llm = pair
    tok = llm.get_tokenizer()
    eos = llm.llm_engine.processor.eos_token_id
    params = BeamSearchParams(beam_width=k, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        ref = hf_beam_search(hf, ids, k, 6, eos, length_penalty, ignore_eos=False)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, (_, cum) in zip(out.sequences, ref):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert s.tokens[:len(ids)] == ids and len(s.logprobs) == len(s.tokens) - len(ids)
            assert s.text == tok.decode(s.tokens) and s.finish_reason == "length"
        scores = [beam_score(s, eos, length_penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_width_one_without_eos_is_greedy(pair):
    _, llm = pair
    out = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for b, g in zip(out, greedy):
        assert b.sequences[0].tokens[len(g.prompt_token_ids):] == list(g.outputs[0].token_ids)


def test_token_prompts_and_bad_params(pair):
    _, llm = pair
    out = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(out[0].sequences) == 2 and all(s.tokens[:3] == [5, 6, 7] for s in out[0].sequences)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="maximum model length"):
        llm.beam_search([{"prompt_token_ids": [5] * 250}], BeamSearchParams(beam_width=2, max_tokens=10))
    with pytest.raises(ValueError, match="max_logprobs"):  # 2 * 11 logprobs per step > the default 20
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))


def test_best_of_keeps_the_most_likely_samples(pair):
    """SamplingParams(n=2, best_of=4): the two of the four seeded samples (those n=4 with the same seed draws)
    with the highest cumulative logprob, re-indexed 0..1, without the logprobs the ranking needed."""
    _, llm = pair
    kw = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    pool = llm.generate(PROMPTS, SamplingParams(n=4, logprobs=0, **kw), use_tqdm=False)
    best = llm.generate(PROMPTS, SamplingParams(n=2, best_of=4, **kw), use_tqdm=False)
    for p, b in zip(pool, best):
        ranked = sorted(p.outputs, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in ranked]
        assert [o.index for o in b.outputs] == [0, 1]
        assert all(o.logprobs is None and o.cumulative_logprob is None for o in b.outputs)
    with_lp = llm.generate(PROMPTS[0], SamplingParams(n=1, best_of=4, logprobs=1, **kw), use_tqdm=False)[0]
    top = max(pool[0].outputs, key=lambda o: o.cumulative_logprob)
    assert with_lp.outputs[0].cumulative_logprob == pytest.approx(top.cumulative_logprob, abs=1e-5)
    assert len(with_lp.outputs[0].logprobs) == 6
    same = llm.generate(PROMPTS[0], SamplingParams(n=2, best_of=2, **kw), use_tqdm=False)[0]
    assert [o.token_ids for o in same.outputs] == [o.token_ids for o in pool[0].outputs[:2]]


def test_concurrency_limit_searches_in_smaller_batches_with_the_same_results(pair):
    """vLLM's beam_search(..., concurrency_limit=k): at most k prompts per batch, same sequences."""
    _, llm = pair
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompts = PROMPTS + [{"prompt_token_ids": [5, 6, 7]}]
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_at_a_time] == [[s.tokens for s in o.sequences]
                                                                        for o in together]
    assert len(llm.beam_search(prompts, params, None, False, 2)) == 3  # vLLM's positional order
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit"):
            llm.beam_search(prompts, params, concurrency_limit=bad)
