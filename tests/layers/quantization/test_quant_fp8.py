"""FP8 linear methods against dequantize-then-matmul: per-tensor scales on stacked slots, per-channel, block-wise,
online quantization, the W8A8 scaled-matmul path, and the start-up refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization.fp8 import FP8, Fp8Config, Fp8LinearMethod, scaled_mm


def _quant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(FP8)


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes per-row scales (2.13 does; 2.11's oneDNN path asserts
    per-tensor ones). The engine never calls it on the CPU: these tests use it as a second implementation."""
    a = torch.ones(16, 16).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


needs_rowwise = pytest.mark.skipif(not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm takes only "
                                   "per-tensor scales")


def test_per_tensor_scales_stay_exact_per_stacked_slot():
    torch.manual_seed(0)
    qc = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    qkv = QKVParallelLinear(32, 8, 4, 2, quant_config=qc, prefix="model.layers.0.self_attn.qkv_proj")
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (3,) and qkv.input_scale.shape == (3,)
    dense, sizes = [], {"q": 32, "k": 16, "v": 16}
    for i, (slot, n) in enumerate(sizes.items()):
        w = torch.randn(n, 32) * (i + 1)
        s = w.abs().max() / 448
        q = _quant(w, s)
        qkv.weight.weight_loader(qkv.weight, q, slot)
        qkv.weight_scale.weight_loader(qkv.weight_scale, s.reshape(()), slot)   # fp8 checkpoints: a 0-d scale
        qkv.input_scale.weight_loader(qkv.input_scale, torch.tensor([0.01 * (i + 1)]), slot)
        dense.append(q.float() * s)
    qkv.process_weights_after_loading()
    assert qkv.weight_scale.shape == (64,) and qkv.input_scale.item() == pytest.approx(0.03)
    x = torch.randn(5, 32)
    # the scheme: activations rounded through fp8 by the static scale (the slots' largest), then the product
    ref = F.linear(_quant(x, torch.tensor(0.03)).float() * 0.03, torch.cat(dense))
    torch.testing.assert_close(qkv(x), ref, rtol=1e-5, atol=1e-5)
    # the W8A8 path (torch._scaled_mm, which runs on this CPU too)
    if not _cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes only per-tensor scales")
    got = scaled_mm(x, qkv.weight, qkv.weight_scale, qkv.input_scale)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_fused_checkpoint_scale_fills_every_slot():
    qc = Fp8Config.from_config({"quant_method": "fp8"})
    gu = MergedColumnParallelLinear(16, [8, 8], quant_config=qc, prefix="mlp.gate_up_proj")
    gu.weight_scale.weight_loader(gu.weight_scale, torch.tensor([0.5]))
    assert gu.weight_scale.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="gate_up_proj.weight_scale: expected one scale per tensor"):
        gu.weight_scale.weight_loader(gu.weight_scale, torch.ones(8, 1), 0)


@needs_rowwise
def test_dynamic_per_token_scaled_mm():
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    q, s = _quant(w, w.abs().amax(1, keepdim=True) / 448), w.abs().amax(1) / 448
    x = torch.randn(7, 64) * torch.arange(1, 8).unsqueeze(1)  # rows of very different ranges
    xs = x.abs().amax(1, keepdim=True) / 448
    ref = F.linear(_quant(x, xs).float() * xs, q.float() * s[:, None])
    torch.testing.assert_close(scaled_mm(x, q, s, None), ref, rtol=1e-4, atol=1e-4)


def test_block_wise_scales():
    torch.manual_seed(2)
    qc = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]})
    row = RowParallelLinear(64, 48, quant_config=qc, prefix="model.layers.0.mlp.down_proj")
    assert row.weight_scale_inv.shape == (3, 2)
    scale = torch.rand(3, 2) + 0.1
    q = (torch.randn(48, 64) * 100).clamp(-448, 448).to(FP8)
    row.weight.weight_loader(row.weight, q)
    row.weight_scale_inv.weight_loader(row.weight_scale_inv, scale)
    row.process_weights_after_loading()
    expanded = scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
    x = torch.randn(3, 64)
    torch.testing.assert_close(row(x), F.linear(x, q.float() * expanded), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="weight_block_size \\[16, 32\\] does not divide"):
        RowParallelLinear(48, 40, quant_config=qc, prefix="x")


def test_online_quantization_of_dense_weights():
    torch.manual_seed(3)
    col = MergedColumnParallelLinear(64, [32, 32], quant_config=Fp8Config.online(), prefix="mlp.gate_up_proj")
    assert col.weight.dtype == torch.float32
    w = torch.randn(64, 64)
    col.weight.weight_loader(col.weight, w)
    col.process_weights_after_loading()
    assert col.weight.dtype == FP8 and col.weight_scale.shape == (64,)
    x = torch.randn(4, 64)
    y, ref = col(x), F.linear(x, w)
    err = (y - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.1                        # e4m3's 3 mantissa bits on weights and (per token) activations
    xs = x.abs().amax(1, keepdim=True) / 448
    torch.testing.assert_close(y, F.linear(_quant(x, xs).float() * xs, col.weight.float() * col.weight_scale[:, None]))


def test_ignored_layers_stay_dense_and_must_name_whole_stacks():
    qc = Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.q_proj",
                                                                          "model.layers.0.self_attn.k_proj",
                                                                          "model.layers.0.self_attn.v_proj"]})
    assert not isinstance(qc.get_linear_method("model.layers.0.self_attn.qkv_proj"), Fp8LinearMethod)
    assert isinstance(qc.get_linear_method("model.layers.1.self_attn.qkv_proj"), Fp8LinearMethod)
    qc = Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(ValueError, match="stacked into model.layers.0.self_attn.qkv_proj"):
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported. Supported: e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "mx"}, "activation_scheme 'mx'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size \\[128\\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
])
def test_unsupported_fp8_configs_are_refused(qc, match):
    with pytest.raises(ValueError, match=match):
        Fp8Config.from_config(qc)



def test_compressed_tensors_refuses_schemes_without_a_kernel_naming_the_first_layer():
    from tokenmill.layers.quantization.compressed_tensors import CompressedTensorsConfig
    w8a8_int = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                              "input_activations": {"num_bits": 8, "type": "int",
                                                                    "strategy": "token", "dynamic": True}}}}
    qc = CompressedTensorsConfig.from_config(w8a8_int)
    with pytest.raises(ValueError, match="8-bit int weights with 8-bit int activations.*first layer it applies "
                                         "to: model.layers.0.self_attn.qkv_proj.*Supported: FP8"):
        QKVParallelLinear(32, 8, 4, 2, quant_config=qc, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="sparsity_config"):
        CompressedTensorsConfig.from_config(dict(w8a8_int, sparsity_config={"format": "sparse-24-bitmask"}))


def test_tensor_parallel_fp8_shards():
    """Block-wise row-parallel: each rank's input slice of weight and block scales; per-tensor q/k/v
    column-parallel: each rank keeps every slot's scale for its rows."""
    from tests.layers.test_linear_method import as_rank
    torch.manual_seed(5)
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16]})
    tensor = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    w = (torch.randn(32, 64) * 100).clamp(-448, 448).to(FP8)
    bs = torch.rand(2, 4) + 0.1
    slots = {s: ((torch.randn(n, 64) * 100).clamp(-448, 448).to(FP8), torch.rand(()) + 0.1)
             for s, n in (("q", 32), ("k", 16), ("v", 16))}
    x = torch.randn(3, 64)
    want_row = F.linear(x, w.float() * bs.repeat_interleave(16, 0).repeat_interleave(16, 1))
    partial, outs = [], []
    for r in range(2):
        with as_rank(r, 2):
            row = RowParallelLinear(64, 32, quant_config=block, prefix="down_proj")
            qkv = QKVParallelLinear(64, 8, 4, 2, quant_config=tensor, prefix="qkv_proj")
        row.weight.weight_loader(row.weight, w)
        row.weight_scale_inv.weight_loader(row.weight_scale_inv, bs)
        for s, (q, sc) in slots.items():
            qkv.weight.weight_loader(qkv.weight, q, s)
            qkv.weight_scale.weight_loader(qkv.weight_scale, sc, s)
        row.process_weights_after_loading()
        qkv.process_weights_after_loading()
        partial.append(row.quant_method.apply(row, x[:, r * 32:(r + 1) * 32], None))
        outs.append(qkv(x))
    torch.testing.assert_close(partial[0] + partial[1], want_row, rtol=1e-4, atol=1e-3)
    xs = x.abs().amax(1, keepdim=True) / 448
    xq = _quant(x, xs).float() * xs
    ref = {s: F.linear(xq, q.float() * sc) for s, (q, sc) in slots.items()}
    got = {"q": torch.cat([o[:, :16] for o in outs], 1), "k": torch.cat([o[:, 16:24] for o in outs], 1),
           "v": torch.cat([o[:, 24:32] for o in outs], 1)}
    for s in "qkv":
        torch.testing.assert_close(got[s], ref[s], rtol=1e-4, atol=1e-3)
