"""Fixtures for the tensor-parallel tests: a tiny Qwen3 with a single KV head (fewer KV heads than ranks)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_qwen3_1kv(tmp_path_factory, smollm2_tokenizer) -> str:
    import transformers as tf
    tok = smollm2_tokenizer
    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, max_position_embeddings=512, initializer_range=0.3,
                         rms_norm_eps=1e-5, vocab_size=len(tok), bos_token_id=tok.bos_token_id or 0,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(1234)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    d = str(tmp_path_factory.mktemp("tiny-qwen3-1kv"))
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d
