"""More architectures and config variants against HF transformers (fp32, CPU): greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = ["Once upon a time", "1, 2, 3, 4,", "The meaning of life is " * 12]


@pytest.mark.parametrize("arch", ["mistral", "llama_bias", "llama_linear", "llama_dynamic", "llama_yarn",
                                  "qwen2_untied", "phi3", "llama_partial"])
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


def _hf_greedy(hf, ids, n=8):
    with torch.no_grad():
        g = hf.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                        eos_token_id=None, pad_token_id=0)
    return g.sequences[0, ids.shape[1]:].tolist(), [torch.log_softmax(l[0].float(), -1) for l in g.logits]


def test_phi3_longrope_matches_hf(tiny_model_factory):
    """LongRoPE, pretraining length 64 here. HF uses the short factors for a sequence within that length and the long
    ones for a longer prompt; tokenmill keeps both tables and picks per request, in one batch, and a long prompt
    never reuses a short prompt's cached blocks (they were encoded with the other table)."""
    import transformers as tf
    d = tiny_model_factory("phi3_longrope")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_model_len=256, num_gpu_blocks_override=64, block_size=8)
    gen = torch.Generator().manual_seed(3)
    short = torch.randint(3, 1000, (1, 40), generator=gen)
    long = torch.cat([short, torch.randint(3, 1000, (1, 40), generator=gen)], dim=1)   # 80 > 64, same start
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = llm.generate([{"prompt_token_ids": short[0].tolist()}], sp, use_tqdm=False)
    both = llm.generate([{"prompt_token_ids": long[0].tolist()}, {"prompt_token_ids": short[0].tolist()}], sp,
                        use_tqdm=False)
    for out, ids in ((first[0], short), (both[0], long), (both[1], short)):
        ref_ids, ref_lps = _hf_greedy(hf, ids)
        c = out.outputs[0]
        assert c.token_ids == ref_ids, ids.shape
        for pos, tid in enumerate(c.token_ids):
            assert abs(c.logprobs[pos][tid].logprob - ref_lps[pos][tid].item()) < 1e-4


def test_dynamic_ntk_within_pretraining_length_matches_hf(tiny_model_factory):
    """Dynamic NTK scaling with max_model_len (256) past the pretraining length (64): HF runs plain RoPE for a
    sequence within 64 positions, so must tokenmill (it used the table stretched for 256 for every request). A
    prompt past 64 reads the stretched table (vLLM's; HF restretches per step) and never shares cached blocks with
    the short ones."""
    import transformers as tf
    d = tiny_model_factory("llama_dynamic_64")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, max_model_len=256, num_gpu_blocks_override=64, block_size=8)
    gen = torch.Generator().manual_seed(5)
    short = [torch.randint(3, 40000, (1, n), generator=gen) for n in (3, 30, 50)]
    long = torch.cat([short[2], torch.randint(3, 40000, (1, 40), generator=gen)], dim=1)  # 90 > 64, same start
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": ids[0].tolist()} for ids in (*short, long)], sp, use_tqdm=False)
    for out, ids in zip(outs, short):
        ref_ids, ref_lps = _hf_greedy(hf, ids)
        c = out.outputs[0]
        assert c.token_ids == ref_ids, ids.shape
        for pos, tid in enumerate(c.token_ids):
            assert abs(c.logprobs[pos][tid].logprob - ref_lps[pos][tid].item()) < 1e-4
    assert len(outs[3].outputs[0].token_ids) == 8


def test_partial_rotary_with_scaled_rope_is_refused_for_llama():
    """HF's Llama rotates whole heads; with a non-default RoPE its tables follow partial_rotary_factor and the
    shapes disagree (HF fails). tokenmill names the key instead of running something else."""
    import transformers as tf

    from tokenmill.layers.rotary import compute_inv_freq
    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        compute_inv_freq(cfg, 16, 256, partial_rotary=False)
    assert compute_inv_freq(cfg, 16, 256, partial_rotary=True)[2] == 8  # Phi-3 / Qwen3.5 honour it
