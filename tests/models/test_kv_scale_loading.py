"""KV-cache scales in checkpoints: the names producers use, loading into the Attention buffers, bad values."""
from __future__ import annotations

import pytest
import torch

from tokenmill.attention.backends.torch_ref import TorchRefBackend
from tokenmill.attention.kv_quant import kv_scale_targets
from tokenmill.models.llama import LlamaForCausalLM

L = "model.layers.3.self_attn"


@pytest.mark.parametrize("name, targets", [
    (f"{L}.k_proj.k_scale", [f"{L}.attn.k_scale"]),                   # llm-compressor / compressed-tensors
    (f"{L}.v_proj.v_scale", [f"{L}.attn.v_scale"]),
    (f"{L}.k_scale", [f"{L}.attn.k_scale"]),                          # ModelOpt, Quark
    (f"{L}.v_scale", [f"{L}.attn.v_scale"]),
    (f"{L}.k_proj.output_scale", [f"{L}.attn.k_scale"]),              # older ModelOpt exports
    (f"{L}.attn.v_scale", [f"{L}.attn.v_scale"]),                     # already in tokenmill's / vLLM's naming
    (f"{L}.kv_scale", [f"{L}.attn.k_scale", f"{L}.attn.v_scale"]),    # AutoFP8-era: one scale for both
    (f"{L}.k_proj.weight", None),
    (f"{L}.k_proj.weight_scale", None),
    ("model.layers.3.mlp.down_proj.input_scale", None),
])
def test_kv_scale_names(name, targets):
    assert kv_scale_targets(name) == targets


def tiny_model() -> LlamaForCausalLM:
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg, 64, TorchRefBackend)


def checkpoint(model: LlamaForCausalLM, extra: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The model's own tensors under HF names (q/k/v and gate/up unpacked), plus `extra`."""
    out = []
    for name, p in model.named_parameters():
        if ".qkv_proj." in name:
            q, k, v = p.detach().split([32, 16, 16])                     # head_dim 8: q 4 heads, k/v 2
            out += [(name.replace("qkv_proj", s), t) for s, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
        elif ".gate_up_proj." in name:
            gate, up = p.detach().chunk(2)
            out += [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
        else:
            out.append((name, p.detach().clone()))
    return out + list(extra.items())


def test_scales_load_into_attention_buffers_in_place():
    model = tiny_model()
    attn0, attn1 = model.model.layers[0].self_attn.attn, model.model.layers[1].self_attn.attn
    assert attn0.k_scale.item() == 1.0 and attn0.k_scale.dtype == torch.float32     # vLLM's default
    ptr = attn0.k_scale.data_ptr()
    loaded = model.load_weights(checkpoint(model, {
        "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.05, dtype=torch.bfloat16),
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.02]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.25),
    }))
    assert loaded == {n for n, _ in model.named_parameters()}      # scales are buffers: not required, not counted
    assert attn0.k_scale.item() == pytest.approx(0.05, rel=1e-2)   # bf16 in the checkpoint
    assert attn0.v_scale.item() == pytest.approx(0.02)
    assert attn1.k_scale.item() == attn1.v_scale.item() == 0.25
    assert attn0.k_scale.data_ptr() == ptr and attn0.k_scale.shape == ()


@pytest.mark.parametrize("name, value, match", [
    ("model.layers.0.self_attn.k_proj.k_scale", torch.ones(2), "only per-tensor KV scales"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), "must be positive and finite"),
    ("model.layers.1.self_attn.kv_scale", torch.tensor(float("nan")), "must be positive and finite"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), "has no 'model.layers.7.self_attn.attn.k_scale'"),
])
def test_bad_scales_fail_clearly(name, value, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        model.load_weights([(name, value)])
