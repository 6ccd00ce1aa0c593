"""More architectures and config variants against HF transformers (fp32, CPU): greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = ["Once upon a time", "1, 2, 3, 4,", "The meaning of life is " * 12]


@pytest.mark.parametrize("arch", ["mistral", "llama_bias", "llama_linear", "llama_dynamic", "llama_yarn",
                                  "qwen2_untied"])
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
