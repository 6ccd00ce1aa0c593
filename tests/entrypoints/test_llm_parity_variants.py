"""More architectures and config variants against HF transformers (fp32, CPU): greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = ["Once upon a time", "1, 2, 3, 4,", "The meaning of life is " * 12]


@pytest.mark.parametrize("arch", ["mistral", "llama_bias", "llama_linear", "llama_dynamic", "llama_yarn",
                                  "qwen2_untied", "phi3"])
def test_variant_matches_hf(tiny_model_factory, arch):
    import transformers as tf
    d = tiny_model_factory(arch)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(d)
    llm = LLM(d, max_model_len=256, num_gpu_blocks_override=64, block_size=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            g = hf.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
                            eos_token_id=None, pad_token_id=0)
        c = o.outputs[0]
        assert c.token_ids == g.sequences[0, ids.shape[1]:].tolist(), (arch, p)
        for pos, tid in enumerate(c.token_ids):
            ref = torch.log_softmax(g.logits[pos][0].float(), -1)[tid].item()
            assert abs(c.logprobs[pos][tid].logprob - ref) < 1e-4


@pytest.mark.parametrize("max_model_len,prompt_len", [(64, 20), (256, 80)])
def test_phi3_longrope_matches_hf(tiny_model_factory, max_model_len, prompt_len):
    """LongRoPE (pretraining length 64 here): within it the short factors, as HF; past it the long factors, which HF
    uses for a sequence whose prompt is already longer."""
    import transformers as tf
    d = tiny_model_factory("phi3_longrope")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_model_len=max_model_len, num_gpu_blocks_override=64, block_size=8)
    ids = torch.randint(3, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    out = llm.generate({"prompt_token_ids": ids[0].tolist()},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1), use_tqdm=False)[0]
    with torch.no_grad():
        g = hf.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
                        eos_token_id=None, pad_token_id=0)
    c = out.outputs[0]
    assert c.token_ids == g.sequences[0, prompt_len:].tolist()
    for pos, tid in enumerate(c.token_ids):
        ref = torch.log_softmax(g.logits[pos][0].float(), -1)[tid].item()
        assert abs(c.logprobs[pos][tid].logprob - ref) < 1e-4
