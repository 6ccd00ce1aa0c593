"""The embedded SmolLM2-135M-Instruct (GGUF): loads with no arguments, answers sensibly, matches HF greedy."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="session")
def smollm2_llm():
    return LLM(max_model_len=1024, dtype="float32")  # the dense path, compared with HF below


def test_chat_answers_paris(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_greedy_matches_hf_on_gguf(smollm2_llm, smollm2_gguf):
    import transformers as tf
    d, f = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = smollm2_llm.get_tokenizer()
    prompts = ["The three primary colors are", "def fibonacci(n):", "机器学习是"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = smollm2_llm.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == ref, p


def test_batch_chat_with_template_kwargs(smollm2_llm):
    convs = [[{"role": "user", "content": "Say hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]]
    outs = smollm2_llm.chat(convs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(outs) == 2 and all(o.outputs[0].text for o in outs)
    with pytest.raises(ValueError):
        smollm2_llm.chat([{"content": "no role"}], use_tqdm=False)
