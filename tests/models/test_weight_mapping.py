"""Checkpoint-name mapping as data: stacked slots, renamed prefixes, skipped tensors, unknown names, and the refusal
of a quantized checkpoint whose method is not registered."""
from __future__ import annotations

import types

import pytest
import torch
import transformers as tf

from tokenmill.attention.backends.torch_ref import TorchRefBackend
from tokenmill.layers.quantization import get_quant_config
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights


def tiny():
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg)
    return cfg, {n: t.detach().clone() for n, t in hf.state_dict().items()}


def test_target_matches_whole_components_only():
    m = WeightMapping(stacked=LLAMA_STACKED)
    assert m.target("model.layers.0.self_attn.k_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "k")
    assert m.target("model.layers.0.mlp.up_proj.bias") == ("model.layers.0.mlp.gate_up_proj.bias", 1)
    # A scale of a quantized projection lands on the stacked parameter's scale, in the same slot.
    assert m.target("model.layers.0.mlp.gate_proj.weight_scale") == ("model.layers.0.mlp.gate_up_proj.weight_scale", 0)
    assert m.target("model.layers.0.self_attn.o_proj.weight") == ("model.layers.0.self_attn.o_proj.weight", None)
    assert m.target("model.layers.0.self_attn.xq_proj.weight")[1] is None


def test_renamed_and_skipped_names_load_like_the_plain_checkpoint():
    cfg, sd = tiny()
    plain = LlamaForCausalLM(cfg, 32, TorchRefBackend)
    plain.load_weights(sd.items())
    nested = {("language_model." + n if n.startswith("model.") else n): t for n, t in sd.items()}
    nested["vision_tower.blocks.0.weight"] = torch.zeros(3)
    nested["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    mapping = WeightMapping(stacked=LLAMA_STACKED, renamed=(("language_model.model.", "model."),),
                            skipped=(r"^vision_tower\.", r"rotary_emb\.inv_freq$"))
    model = LlamaForCausalLM(cfg, 32, TorchRefBackend)
    loaded = load_weights(model, nested.items(), mapping, tie_word_embeddings=False)
    assert loaded == {n for n, _ in model.named_parameters()}
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n


def test_unknown_name_is_an_error_naming_it():
    cfg, sd = tiny()
    model = LlamaForCausalLM(cfg, 32, TorchRefBackend)
    sd["model.layers.0.mlp.router.weight"] = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="model.layers.0.mlp.router.weight"):
        model.load_weights(sd.items())


def test_integer_tensor_into_a_float_parameter_is_refused():
    cfg, sd = tiny()
    model = LlamaForCausalLM(cfg, 32, TorchRefBackend)
    sd["model.norm.weight"] = torch.ones(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        model.load_weights(sd.items())


def _model_config(qc=None, quantization=None, gguf=False):
    hf = types.SimpleNamespace(quantization_config=qc) if qc is not None else types.SimpleNamespace()
    return types.SimpleNamespace(hf_config=hf, quantization=quantization, is_gguf=gguf)


def test_quant_config_none_for_dense_and_gguf():
    assert get_quant_config(_model_config()) is None
    assert get_quant_config(_model_config(quantization="gguf", gguf=True)) is None


def test_unregistered_checkpoint_method_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization='hqq'.*not supported yet"):
        get_quant_config(_model_config({"quant_method": "hqq", "bits": 4}))
    with pytest.raises(ValueError, match="'marlin'"):
        get_quant_config(_model_config(quantization="marlin"))
