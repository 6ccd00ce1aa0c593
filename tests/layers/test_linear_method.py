"""The linear layers' seams: a weight format plugged in as a LinearMethod (no model file changes), parameters whose
dims are packed or grouped loading through the same sharding code, and the per-row output delta (multi-LoRA's hook)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from tokenmill.attention.backends.torch_ref import TorchRefBackend
from tokenmill.distributed import ParallelState, use_parallel_state
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization import LinearMethod, QuantizationConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.weight_mapping import process_weights_after_loading


def tiny_cfg():
    return tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          attention_bias=True)


def hf_checkpoint(cfg, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return [(n, t.detach().clone()) for n, t in hf.state_dict().items()]


def forward(model, ids):
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.forward_context import set_forward_context
    import numpy as np
    n = len(ids)
    cache = [torch.zeros(TorchRefBackend.kv_cache_shape(4, 16, 2, 8)) for _ in range(2)]
    md = AttentionMetadata(num_actual_tokens=n, slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n]),
                           seq_lens=torch.tensor([n]), block_table=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
                           max_query_len=n, max_seq_len=n, query_start_loc_cpu=np.array([0, n]),
                           seq_lens_cpu=np.array([n]))
    with torch.no_grad(), set_forward_context(md, cache):
        return model.compute_logits(model(ids, torch.arange(n)))


class TransposedInt8Method(LinearMethod):
    """A stand-in format: the weight is held as [input, output] int8 with one float scale per output feature and
    quantized once after loading, so loading, the after-loading step and apply all differ from the dense path."""

    def __init__(self) -> None:
        self.calls = 0

    def create_weights(self, layer, shape, dtype):
        w = nn.Parameter(torch.empty(shape.input_size_per_rank, shape.output_size_per_rank, dtype=dtype),
                         requires_grad=False)
        w.output_dim, w.input_dim = 1, 0
        # The checkpoint's [out, in] tensor arrives transposed by this parameter's own loader.
        base = layer.weight_loader
        w.weight_loader = lambda p, t, shard=None: base(p, t.t(), shard)
        layer.register_parameter("weight", w)

    def process_weights_after_loading(self, layer):
        self.calls += 1
        w = layer.weight.data.float()
        scale = w.abs().amax(dim=0).clamp_min(1e-8) / 127
        layer.qweight = (w / scale).round().to(torch.int8)
        layer.scale = scale
        del layer.weight

    def apply(self, layer, x, bias):
        y = x @ (layer.qweight.float() * layer.scale).to(x.dtype)
        return y if bias is None else y + bias


class TransposedInt8Config(QuantizationConfig):
    name = "test-int8"

    def __init__(self):
        self.methods: dict[str, TransposedInt8Method] = {}

    def get_linear_method(self, prefix):
        return self.methods.setdefault(prefix, TransposedInt8Method())


def test_a_new_format_plugs_in_without_model_changes():
    cfg = tiny_cfg()
    ckpt = hf_checkpoint(cfg)
    dense = LlamaForCausalLM(cfg, 64, TorchRefBackend)
    dense.load_weights(ckpt)
    qc = TransposedInt8Config()
    quant = LlamaForCausalLM(cfg, 64, TorchRefBackend, quant_config=qc)
    assert sorted(qc.methods) == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in
                                        ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                         "mlp.down_proj"))
    qkv = quant.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == (32, 64) and qkv.weight.full_shape == (32, 64)
    loaded = quant.load_weights(ckpt)
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
    process_weights_after_loading(quant)
    assert all(m.calls == 1 for m in qc.methods.values())
    assert not hasattr(qkv, "weight") and qkv.qweight.dtype == torch.int8
    ids = torch.tensor([3, 17, 5, 80, 41])
    ref, out = forward(dense, ids), forward(quant, ids)
    # int8 rounding moves the logits a little; a mis-sliced q/k/v or gate/up slot would move them by O(1).
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert (out - ref).abs().max() > 0  # the int8 path really ran


class PackedMethod(LinearMethod):
    """Eight 4-bit values per int32 along the input dim, and one scale per group of 4 inputs, as GPTQ-style formats
    store them: the loader must scale slot offsets and TP splits by the packing and grouping."""

    def create_weights(self, layer, shape, dtype):
        q = nn.Parameter(torch.zeros(shape.output_size_per_rank, shape.input_size_per_rank // 8, dtype=torch.int32),
                         requires_grad=False)
        q.output_dim, q.input_dim = 0, 1
        s = nn.Parameter(torch.zeros(shape.input_size_per_rank // 4, shape.output_size_per_rank),
                         requires_grad=False)
        s.output_dim, s.input_dim = 1, 0
        layer.register_parameter("qweight", q)
        layer.register_parameter("scales", s)

    def apply(self, layer, x, bias):
        raise AssertionError("not used")


class PackedConfig(QuantizationConfig):
    def get_linear_method(self, prefix):
        return PackedMethod()


def as_rank(r, tp):
    return use_parallel_state(ParallelState(world_size=tp, rank=r, tp_size=tp, tp_rank=r))


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_and_grouped_params_shard_like_dense_features(tp):
    torch.manual_seed(0)
    q = {s: torch.randint(0, 2 ** 31 - 1, (n, 4), dtype=torch.int32) for s, n in (("q", 16), ("k", 8), ("v", 8))}
    sc = {s: torch.randn(8, n) for s, n in (("q", 16), ("k", 8), ("v", 8))}
    down_q, down_s = torch.randint(0, 2 ** 31 - 1, (32, 4), dtype=torch.int32), torch.randn(8, 32)
    for r in range(tp):
        with as_rank(r, tp):
            qkv = QKVParallelLinear(32, 4, 4, 2, quant_config=PackedConfig(), prefix="qkv")
            down = RowParallelLinear(32, 32, quant_config=PackedConfig(), prefix="down")
        assert qkv.qweight.full_shape == (32, 4) and qkv.scales.full_shape == (8, 32)
        assert down.qweight.full_shape == (32, 4) and down.scales.full_shape == (8, 32)
        for s in "qkv":
            qkv.qweight.weight_loader(qkv.qweight, q[s], s)
            qkv.scales.weight_loader(qkv.scales, sc[s], s)
        down.qweight.weight_loader(down.qweight, down_q)
        down.scales.weight_loader(down.scales, down_s)
        # Rank r holds query heads [2r, 2r + 2) of 4 (rows 8r.. of q) and KV head r of 2 (rows 4r.. of k, v).
        nq, nkv = 16 // tp, 8 // tp
        want_q = torch.cat([q["q"][r * nq:(r + 1) * nq], q["k"][r * nkv:(r + 1) * nkv], q["v"][r * nkv:(r + 1) * nkv]])
        want_s = torch.cat([sc["q"][:, r * nq:(r + 1) * nq], sc["k"][:, r * nkv:(r + 1) * nkv],
                            sc["v"][:, r * nkv:(r + 1) * nkv]], dim=1)
        assert torch.equal(qkv.qweight, want_q) and torch.equal(qkv.scales, want_s)
        # Row-parallel: rank r holds inputs [16r, 16r + 16): packed columns 2r.., scale groups 4r..
        assert torch.equal(down.qweight, down_q[:, r * 4 // tp:(r + 1) * 4 // tp])
        assert torch.equal(down.scales, down_s[r * 8 // tp:(r + 1) * 8 // tp])


def test_merged_fused_checkpoint_tensor_splits_by_scaled_slots():
    m = MergedColumnParallelLinear(16, [8, 8], quant_config=PackedConfig(), prefix="gate_up")
    fused = torch.arange(16 * 2, dtype=torch.int32).reshape(16, 2)
    m.qweight.weight_loader(m.qweight, fused)
    assert torch.equal(m.qweight, fused)
    with pytest.raises(ValueError, match="expected 8"):
        m.qweight.weight_loader(m.qweight, fused[:4], 0)


def lora_delta(a: torch.Tensor, b: torch.Tensor):
    def delta(x, y):
        y.add_(x @ a.t() @ b.t())
    return delta


def test_output_delta_adds_to_every_projection_as_merged_weights_would():
    cfg = tiny_cfg()
    ckpt = hf_checkpoint(cfg, seed=1)
    torch.manual_seed(2)
    with_delta = LlamaForCausalLM(cfg, 64, TorchRefBackend)
    with_delta.load_weights(ckpt)
    merged = dict(ckpt)
    for i in range(2):
        layer = with_delta.model.layers[i]
        for name, mod in (("self_attn.qkv_proj", layer.self_attn.qkv_proj), ("self_attn.o_proj",
                          layer.self_attn.o_proj), ("mlp.gate_up_proj", layer.mlp.gate_up_proj),
                          ("mlp.down_proj", layer.mlp.down_proj)):
            a = torch.randn(3, mod.in_features) * 0.1
            b = torch.randn(mod.out_features, 3) * 0.1
            mod.set_output_delta(lora_delta(a, b))
            extra = b @ a
            parts = {"self_attn.qkv_proj": [("self_attn.q_proj", 32), ("self_attn.k_proj", 16),
                                             ("self_attn.v_proj", 16)],
                     "mlp.gate_up_proj": [("mlp.gate_proj", 48), ("mlp.up_proj", 48)]}.get(name, [(name, None)])
            o = 0
            for ckpt_name, rows in parts:
                rows = rows or extra.shape[0]
                key = f"model.layers.{i}.{ckpt_name}.weight"
                merged[key] = merged[key] + extra[o:o + rows]
                o += rows
    ref = LlamaForCausalLM(cfg, 64, TorchRefBackend)
    ref.load_weights(list(merged.items()))
    ids = torch.tensor([1, 2, 3, 50, 60, 70])
    plain = LlamaForCausalLM(cfg, 64, TorchRefBackend)
    plain.load_weights(ckpt)
    out, want, base = forward(with_delta, ids), forward(ref, ids), forward(plain, ids)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert (out - base).abs().max() > 1e-2  # the deltas matter
    for layer in with_delta.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.set_output_delta(None)
    torch.testing.assert_close(forward(with_delta, ids), base)


def test_row_parallel_delta_is_added_before_the_all_reduce():
    """Each rank's delta sees its input slice, so partial deltas sum like the partial products do."""
    torch.manual_seed(0)
    w, a, b, x = torch.randn(8, 12), torch.randn(2, 12), torch.randn(8, 2), torch.randn(3, 12)
    partial = []
    for r in range(2):
        with as_rank(r, 2):
            row = RowParallelLinear(12, 8)
        row.weight.weight_loader(row.weight, w)
        row.set_output_delta(lora_delta(a[:, r * 6:(r + 1) * 6], b))
        partial.append(row._product(x[:, r * 6:(r + 1) * 6], None))
    torch.testing.assert_close(sum(partial), F.linear(x, w + b @ a))


def test_layers_move_and_cast_as_modules():
    """nn.Module.to / .cuda / .double go through nn.Module._apply: a layer's own methods must not shadow it."""
    layer = QKVParallelLinear(32, 8, 4, 2, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(3, 32)
    want = layer(x).double()
    moved = layer.to(torch.float64)
    assert moved.weight.dtype == torch.float64 and moved.bias.dtype == torch.float64
    torch.testing.assert_close(moved(x.double()), want, rtol=1e-6, atol=1e-6)
