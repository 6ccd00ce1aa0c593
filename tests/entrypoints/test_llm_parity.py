"""End-to-end parity with HF transformers on tiny random models (fp32, CPU): greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from tests.models.oracle import NEVER_STOP
from tokenmill import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog because it",
    "深度学习的优势是什么？",
    "a",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean. Then",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tiny_model_factory):
    import transformers as tf
    d = tiny_model_factory(request.param)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(d)
    llm = LLM(d, max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=16)
    return request.param, hf, tok, llm


def hf_greedy(hf, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=tok.eos_token_id, eos_token_id=None)
    gen = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
    return ids[0].tolist(), gen, logprobs


def test_greedy_tokens_and_logprobs_match_hf(pair):
    arch, hf, tok, llm = pair
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        prompt_ids, gen, hf_lps = hf_greedy(hf, tok, prompt, MAX_TOKENS)
        assert out.prompt_token_ids == prompt_ids
        c = out.outputs[0]
        assert c.token_ids == gen, f"{arch}: {prompt!r}"
        assert len(c.logprobs) == MAX_TOKENS
        for pos, (tid, lp_dict) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = hf_lps[pos]
            assert abs(lp_dict[tid].logprob - ref[tid].item()) < 1e-4
            assert lp_dict[tid].rank == 1
            top = torch.topk(ref, 3)
            for rank, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert i in lp_dict and abs(lp_dict[i].logprob - v) < 1e-4
        assert abs(c.cumulative_logprob - sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))) < 1e-3


def test_prompt_logprobs_match_hf(pair):
    arch, hf, tok, llm = pair
    prompt = PROMPTS[1]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == ids.shape[1]
    for p in range(1, ids.shape[1]):
        tid = ids[0, p].item()
        assert abs(plp[p][tid].logprob - ref[p - 1, tid].item()) < 1e-4


def test_batch_one_equals_batch_all(pair):
    arch, hf, tok, llm = pair
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_prompt_logprobs_under_preemption_and_one_token_prompt(tiny_model_factory):
    """A KV pool too small for the batch preempts requests after their prefill (outputs that may stop early);
    recomputing scores their prompts again, which must not repeat the prompt logprobs already reported. A one-token
    prompt reports [None]."""
    import transformers as tf
    d = tiny_model_factory("llama")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_model_len=128, num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (40, 33, 50, 17, 64, 1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2,
                                       stop=[NEVER_STOP]),
                        use_tqdm=False)
    assert llm.llm_engine.last_stats.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        if len(ids) > 1:
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            for p in range(1, len(ids)):
                assert abs(plp[p][ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-4
