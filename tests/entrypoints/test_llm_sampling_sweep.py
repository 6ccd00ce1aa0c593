"""Per-request sampling semantics of the offline LLM against vLLM's SamplingParams, on the tiny random Llama with HF
transformers computing the reference logits (fp32, CPU).

Penalties: repetition over prompt + outputs, presence / frequency over outputs only, each request its own, through
chunked prefill and prefix-cache hits. min_tokens holds back every stop id and EOS (with ignore_eos too). Bad
values are ValueErrors naming the field, and the engine keeps serving."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because it"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def processed_llm(model_dir):
    """processed_logits report the logits the draw saw; a budget of 8 tokens splits every prompt into chunks."""
    return LLM(model_dir, max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=8,
               logprobs_mode="processed_logits", enable_prefix_caching=True, max_num_batched_tokens=8,
               enable_chunked_prefill=True)


def _last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def _penalized(logits: torch.Tensor, prompt: list[int], outputs: list[int], rep: float = 1.0,
               presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """vLLM's penalties by hand: repetition over tokens of prompt + outputs, presence / frequency over outputs."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.tensor(prompt + outputs)] = True
    rep_t = torch.where(seen, torch.tensor(rep), torch.tensor(1.0))
    out = torch.where(logits > 0, logits / rep_t, logits * rep_t)
    counts = torch.zeros_like(logits)
    for t in outputs:
        counts[t] += 1
    return out - frequency * counts - presence * (counts > 0).float()


PENALTIES = [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5),
             dict(repetition_penalty=0.7, frequency_penalty=-1.0, presence_penalty=-0.5), dict()]
# Over one 16-token block each, so that the second round finds them in the prefix cache.
PEN_PROMPTS = ["a b a b a b a b " * 3, PROMPT + " the dog and the fox jumps over the lazy dog the dog",
               "hello hello hello " * 6, "x y z x y z " * 3]


def test_penalties_per_request_match_a_hand_computation(processed_llm, hf):
    """A batch of four requests with different penalties, chunked prefill, then again from the prefix cache: every
    step's argmax and processed logits equal HF's logits with vLLM's penalties applied by hand."""
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4, **p) for p in PENALTIES]
    for attempt in range(2):
        outs = processed_llm.generate(PEN_PROMPTS, params, use_tqdm=False)
        if attempt:
            assert sum(o.num_cached_tokens or 0 for o in outs) > 0
        for kw, out in zip(PENALTIES, outs):
            prompt, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
            for i, (tok, lps) in enumerate(zip(gen, out.outputs[0].logprobs)):
                ref = _penalized(_last_logits(hf, prompt + gen[:i]), prompt, gen[:i],
                                 kw.get("repetition_penalty", 1.0), kw.get("presence_penalty", 0.0),
                                 kw.get("frequency_penalty", 0.0))
                assert tok == int(ref.argmax()), (kw, i)
                for t, lp in lps.items():
                    assert abs(lp.logprob - ref[t].item()) < 1e-4, (kw, i, t)


def test_repetition_penalty_counts_prompt_tokens_presence_does_not(llm, hf):
    """A prompt token biased to the top: presence / frequency penalties (outputs only) leave it the greedy pick,
    the repetition penalty (prompt too) divides its biased logit; logit_bias comes before the penalties."""
    prompt = llm.get_tokenizer()(PROMPT).input_ids
    logits = _last_logits(hf, prompt)
    tok = prompt[-1]
    bias = {tok: logits.max().item() + 0.5 - logits[tok].item()}
    biased = logits.clone()
    biased[tok] += bias[tok]
    sp = dict(temperature=0, max_tokens=1, logit_bias=bias)

    def first(**kw):
        return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**sp, **kw),
                            use_tqdm=False)[0].outputs[0].token_ids[0]

    assert first() == tok and first(presence_penalty=2.0, frequency_penalty=2.0) == tok
    want = int(_penalized(biased, prompt, [], rep=2.0).argmax())
    assert want != tok and first(repetition_penalty=2.0) == want


def test_min_tokens_holds_back_eos_and_stop_ids(llm):
    eos = llm.get_tokenizer().eos_token_id
    sp = dict(temperature=0, max_tokens=8)
    out = llm.generate(PROMPT, SamplingParams(**sp, min_tokens=3, logit_bias={eos: 100.0}), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids[3:] == [eos] and eos not in c.token_ids[:3]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    c = llm.generate(PROMPT, SamplingParams(**sp, min_tokens=2, logit_bias={77: 100.0}, stop_token_ids=[77]),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 3 and c.token_ids[-1] == 77 and (c.finish_reason, c.stop_reason) == ("stop", 77)


def test_min_tokens_masks_eos_with_ignore_eos_too(llm):
    """vLLM's min_tokens masks every id of all_stop_token_ids, which holds EOS whatever ignore_eos says; ignore_eos
    only keeps EOS from ending the request."""
    eos = llm.get_tokenizer().eos_token_id
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert eos not in c.token_ids[:3] and c.token_ids[3:] == [eos] * 3
    assert c.finish_reason == "length"
    # EOS among stop_token_ids still ends it under ignore_eos, once min_tokens are out (stop_reason: the id).
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=2, ignore_eos=True, stop_token_ids=[eos],
                        logit_bias={eos: 100.0})
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 3 and (c.finish_reason, c.stop_reason) == ("stop", eos)


def test_logit_bias_allowed_token_ids_and_multi_token_bad_words(llm):
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate(PROMPT, SamplingParams(**greedy, logit_bias={42: 100.0}),
                        use_tqdm=False)[0].outputs[0].token_ids == [42] * 8
    for t in (0, 1.0):
        ids = llm.generate(PROMPT, SamplingParams(**dict(greedy, temperature=t), seed=1, allowed_token_ids=[5, 6, 7]),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert set(ids) <= {5, 6, 7}
    base = llm.generate(PROMPT, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    word = tok.decode(base[2:4])
    assert tok.encode(word, add_special_tokens=False) == base[2:4]  # a two-token word of the greedy output
    got = llm.generate(PROMPT, SamplingParams(**greedy, bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    # The first token of the word may still come; its completion may not.
    assert got[:3] == base[:3] and got[3] != base[3]


def test_stop_strings_across_token_boundaries(llm):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate(PROMPT, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    stop = base.text[3:9]   # starts and ends inside tokens
    for include in (False, True):
        c = llm.generate(PROMPT, SamplingParams(**greedy, stop=[stop], include_stop_str_in_output=include),
                         use_tqdm=False)[0].outputs[0]
        assert c.text == base.text[:9 if include else 3]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        assert base.token_ids[:len(c.token_ids)] == c.token_ids and len(c.token_ids) < len(base.token_ids)


def test_n_with_seed_is_reproducible_and_distinct(llm):
    sp = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    a, b = (llm.generate(PROMPT, sp, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4 and [c.index for c in a.outputs] == [0, 1, 2, 3]


def test_edge_filter_values_and_greedy_next_to_sampled(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    sampled = dict(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    plain = llm.generate(PROMPT, SamplingParams(**sampled), use_tqdm=False)[0].outputs[0].token_ids
    for off in (dict(top_k=-1), dict(top_k=0), dict(top_p=1.0), dict(min_p=0.0)):  # all mean "no filter"
        assert llm.generate(PROMPT, SamplingParams(**sampled, **off), use_tqdm=False)[0].outputs[0].token_ids == plain
    for one in (dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)):   # keep only the most likely token
        assert llm.generate(PROMPT, SamplingParams(**sampled, **one), use_tqdm=False)[0].outputs[0].token_ids == greedy
    outs = llm.generate([PROMPT] * 3, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                       SamplingParams(**sampled),
                                       SamplingParams(**dict(sampled, temperature=1.5), top_k=5, top_p=0.9, min_p=0.1)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == greedy and outs[1].outputs[0].token_ids == plain


def test_logprobs_and_prompt_logprobs_match_hf(llm, hf):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out.outputs[0].token_ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        for t, lp in out.prompt_logprobs[p].items():
            assert abs(lp.logprob - ref[p - 1, t].item()) < 1e-4
    for i, (t, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert lps[t].rank == 1 and len(lps) == 2
        for tid, lp in lps.items():
            assert abs(lp.logprob - ref[len(ids) - 1 + i, tid].item()) < 1e-4


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=2.5), "temperature"),             # vLLM: [0, 2]
    (dict(temperature=-0.1), "temperature"),
    (dict(n=2, temperature=0), r"n must be 1 when using greedy"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={10 ** 7: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[10 ** 7]), "allowed_token_ids"),
    (dict(stop_token_ids=[10 ** 7]), "stop_token_ids"),
    (dict(logprobs=10 ** 6), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=10 ** 6), "truncate_prompt_tokens"),
    (dict(extra_args=5), "extra_args"),
])
def test_bad_values_are_value_errors_naming_the_field_and_the_engine_serves_on(llm, kw, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, SamplingParams(**{"max_tokens": 2, **kw}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
