"""Config variants of the Llama family, Gemma 2 and Gemma 3 against HF transformers (tiny random fp32 models, CPU).

Each variant combines settings the other parity tests leave at their defaults: RoPE scaling types and their optional
keys, MLP activations, biases (and bias keys the architecture ignores), head layouts, sliding windows. Biases and
norm weights are randomised (HF starts them at 0 and 1, where a dropped bias or a misplaced norm would not show).
Prompts of mixed lengths span several KV blocks and the outputs cross 2-3 more; the oracle is teacher forcing (HF's
argmax at every generated position, logprobs within 1e-4).
"""
from __future__ import annotations

import gc

import pytest
import torch

from tests.models.oracle import assert_greedy_matches_hf
from tokenmill import LLM, SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5)
# 44 + 16 output tokens stay within the LongRoPE variants' pretraining length (64): HF's forward over prompt +
# output then uses the short factors, as tokenmill does for a prompt within it; 90 is past it (long factors).
PROMPT_LENS = (3, 17, 44, 90)
MAX_TOKENS = 16
BLOCK = 8

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [1.5 + 0.2 * i for i in range(8)]}
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12, pad_token_id=0)

VARIANTS = {
    # Activations other than SiLU (HF applies ACT2FN[hidden_act]; tokenmill refused them).
    "llama_gelu_bias_mqa": ("LlamaConfig", dict(hidden_act="gelu", attention_bias=True, mlp_bias=True,
                                                num_key_value_heads=1)),
    "gemma2_gelu": ("Gemma2Config", dict(_GEMMA, hidden_activation="gelu")),
    # ... with bias keys the architecture's HF code ignores (tokenmill built biases the checkpoint lacks, and
    # refused it).
    "qwen3_gelu_tanh_mlp_bias_key": ("Qwen3Config", dict(hidden_act="gelu_pytorch_tanh", head_dim=24, mlp_bias=True,
                                                         attention_bias=True)),
    "phi3_gelu_new_bias_keys": ("Phi3Config", dict(hidden_act="gelu_new", attention_bias=True, mlp_bias=True,
                                                   pad_token_id=0)),
    "mistral_relu2_bias_keys": ("MistralConfig", dict(hidden_act="relu2", attention_bias=True, mlp_bias=True,
                                                      sliding_window=None)),
    "qwen2_mlp_bias_key": ("Qwen2Config", dict(mlp_bias=True, attention_bias=False)),
    # RoPE types and their optional keys.
    "llama3_short_original": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "llama_yarn_factors": ("LlamaConfig", dict(num_key_value_heads=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2})),
    "qwen2_yarn_mscale": ("Qwen2Config", dict(rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 0.5,
        "truncate": False}, rope_theta=1e6, tie_word_embeddings=False)),
    "llama_longrope": ("LlamaConfig", dict(rope_parameters=dict(_LONGROPE, original_max_position_embeddings=64))),
    "phi3_longrope_partial": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                                 pad_token_id=0, rope_parameters=dict(
                                                     _LONGROPE, short_factor=_LONGROPE["short_factor"][:4],
                                                     long_factor=_LONGROPE["long_factor"][:4], attention_factor=1.3))),
    "mistral_llama3_head_dim": ("MistralConfig", dict(head_dim=24, sliding_window=None, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 32})),
    "gemma3_yarn_global": ("Gemma3TextConfig", dict(_GEMMA, sliding_window_pattern=2, num_hidden_layers=3,
                                                    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                           "original_max_position_embeddings": 64}})),
    # Head layouts and sliding windows.
    "llama_head_dim_20_eps": ("LlamaConfig", dict(head_dim=20, rms_norm_eps=1e-2, tie_word_embeddings=True)),
    "phi3_head_dim_24_partial": ("Phi3Config", dict(head_dim=24, partial_rotary_factor=0.75, pad_token_id=0,
                                                    sliding_window=20)),
    "mistral_window_block_multiple": ("MistralConfig", dict(sliding_window=2 * BLOCK, head_dim=24,
                                                            num_key_value_heads=1)),
    "qwen2_window_layer_types": ("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=10,
                                                     layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"])),
    # HF's Llama attends in full whatever `sliding_window` says (tokenmill slid its window over every layer). HF's
    # generate does drop cached keys past it (a DynamicSlidingWindowLayer): only its forward is self-consistent.
    "llama_window_key_ignored": ("LlamaConfig", dict(sliding_window=12)),
    "qwen3_window_all_layers": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=9, max_window_layers=0,
                                                    num_attention_heads=6, head_dim=40)),
}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    gen = torch.Generator().manual_seed(11)
    vocab = len(smollm2_tokenizer)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _build(name: str, tok, root) -> tuple[str, torch.nn.Module]:
    import transformers as tf
    cls_name, kwargs = VARIANTS[name]
    cfg = getattr(tf, cls_name)(**dict(TINY, **kwargs, vocab_size=len(tok), bos_token_id=tok.bos_token_id or 0,
                                       eos_token_id=tok.eos_token_id))
    torch.manual_seed(2024)
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in pname:
                p.normal_(1.0, 0.3)
    d = str(root / name)
    hf.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d, hf.eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(name, prompts, smollm2_tokenizer, tmp_path_factory):
    d, hf = _build(name, smollm2_tokenizer, tmp_path_factory.mktemp("variant"))
    llm = LLM(d, dtype="float32", max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=128)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_TOKENS] * len(prompts)
    assert_greedy_matches_hf(hf, outs)
    del llm
    gc.collect()


def test_learned_activation_is_refused():
    """A parametrised activation (PReLU) would need weights the models do not load: refused, naming the key."""
    from tokenmill.layers.activation import gated_activation
    with pytest.raises(ValueError, match="hidden_act 'prelu'"):
        gated_activation("prelu")
    with pytest.raises(ValueError, match="hidden_act 'nope'"):
        gated_activation("nope")


def test_sliding_window_only_where_hf_applies_it():
    import transformers as tf

    from tokenmill.core.kv_cache_spec import layer_sliding_windows
    from tokenmill.transformers_utils.config import config_sliding_window
    small = dict(TINY, vocab_size=100)
    assert config_sliding_window(tf.LlamaConfig(**small, sliding_window=12)) is None
    assert layer_sliding_windows(tf.LlamaConfig(**small, sliding_window=12)) == [None, None]
    assert config_sliding_window(tf.Qwen2Config(**small, sliding_window=12)) is None  # no use_sliding_window
    assert layer_sliding_windows(tf.MistralConfig(**small, sliding_window=12)) == [12, 12]
    assert layer_sliding_windows(tf.Phi3Config(**small, sliding_window=12, pad_token_id=0)) == [12, 12]
