"""AWQ and GPTQ weights packed by their documented rules (written independently here), against dequantize-then-
matmul; the repacked storage through the Triton kernel; a tiny GPTQ Llama end to end; and the refusals."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.kernels.triton_quant_matmul import int_matmul
from tokenmill.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization.wna16 import AWQConfig, GPTQConfig

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _word(vals: list[torch.Tensor], bits: int) -> torch.Tensor:
    w = sum(v.to(torch.int64) << (i * bits) for i, v in enumerate(vals))
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def gptq_pack(q, z, bits, v1=True):
    """q [K, N], z [G, N] -> (qweight [K/pack, N] packed along K, qzeros [G, N/pack] along N, v1 stores z - 1)."""
    pack = 32 // bits
    qw = _word([q[i::pack] for i in range(pack)], bits)
    zz = (z - 1) if v1 else z
    qz = _word([zz[:, i::pack] for i in range(pack)], bits)
    return qw.contiguous(), qz.contiguous()


def awq_pack(t):
    """[R, C] 4-bit -> [R, C/8], value i of a word = column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return _word([t[:, order[i]::8] for i in range(8)], 4)


def _check(layer, x, w_t):
    torch.testing.assert_close(layer(x), x @ w_t, rtol=1e-4, atol=1e-4)
    m = layer.quant_method
    k = layer.qweight.shape[0] * 32 // m.bits
    g_idx = getattr(layer, "g_idx", None)
    # the kernel on the GPU where there is one (a compiled Triton kernel cannot read host tensors), else interpreted
    got = int_matmul(x.to(DEV), layer.qweight.to(DEV), layer.scales.to(DEV), layer.qzeros.to(DEV), m.bits,
                     k // m.groups, None if g_idx is None else g_idx.to(DEV)).cpu()
    torch.testing.assert_close(got, x @ w_t, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bits, sym, desc_act, v2", [(4, False, False, False), (4, True, True, False),
                                                     (8, False, True, True), (8, True, False, False)])
def test_gptq_row_parallel(bits, sym, desc_act, v2):
    g = torch.Generator().manual_seed(bits + 2 * sym + 4 * desc_act)
    k, n, group = 128, 48, 32
    qc = GPTQConfig.from_config({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                 "desc_act": desc_act, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    layer = RowParallelLinear(k, n, quant_config=qc, prefix="model.layers.0.mlp.down_proj")
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    groups = k // group
    z = torch.full((groups, n), 2 ** (bits - 1)) if sym else torch.randint(1, 2 ** bits, (groups, n), generator=g)
    s = torch.rand(k // group, n, generator=g) * 0.02 + 0.001
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if desc_act else torch.arange(k) // group
    qw, qz = gptq_pack(q, z, bits, v1=not v2)
    for name, t in (("qweight", qw), ("qzeros", qz), ("scales", s), ("g_idx", g_idx.to(torch.int32))):
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    layer.process_weights_after_loading()
    assert hasattr(layer, "g_idx") == desc_act
    _check(layer, torch.randn(5, k, generator=g), (q - z[g_idx]).float() * s[g_idx])


def test_awq_stacked_qkv():
    g = torch.Generator().manual_seed(0)
    k, group = 64, 32
    qc = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                "version": "gemm"})
    layer = QKVParallelLinear(k, 16, 2, 1, quant_config=qc, prefix="attn.qkv_proj")
    parts = []
    for slot, n in (("q", 32), ("k", 16), ("v", 16)):
        q = torch.randint(0, 16, (k, n), generator=g)
        z = torch.randint(0, 16, (k // group, n), generator=g)
        s = torch.rand(k // group, n, generator=g) * 0.05
        for name, t in (("qweight", awq_pack(q)), ("qzeros", awq_pack(z)), ("scales", s)):
            getattr(layer, name).weight_loader(getattr(layer, name), t, slot)
        parts.append((q - z.repeat_interleave(group, 0)).float() * s.repeat_interleave(group, 0))
    layer.process_weights_after_loading()
    _check(layer, torch.randn(3, k, generator=g), torch.cat(parts, dim=1))


@pytest.mark.parametrize("cfg, match", [
    (dict(quant_method="gptq", bits=3, group_size=128), "bits 3 is not supported \\(first layer it applies to: "
                                                        "model.layers.0.mlp.down_proj\\). Supported: 4, 8"),
    (dict(quant_method="gptq", bits=4, group_size=100), "group_size 100"),
    (dict(quant_method="awq", bits=8, group_size=128), "bits 8 .*Supported: 4"),
])
def test_unsupported_bits_and_groups_name_the_first_layer(cfg, match):
    qc = (GPTQConfig if cfg["quant_method"] == "gptq" else AWQConfig).from_config(cfg)
    with pytest.raises(ValueError, match=match):
        RowParallelLinear(128, 64, quant_config=qc, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        GPTQConfig.from_config(dict(quant_method="gptq", bits=4, checkpoint_format="marlin"))


def test_tiny_gptq_llama_matches_its_dequantized_weights(tiny_model_factory, tmp_path):
    from tests.layers.quantization.test_quant_checkpoints import _is_linear, _rewrite, greedy
    src = tiny_model_factory("llama")
    sd = load_file(os.path.join(src, "model.safetensors"))
    group, packed, dense = 32, {}, {}
    for name, t in sd.items():
        if not _is_linear(name):
            packed[name] = dense[name] = t
            continue
        w = t.t()                                             # [K, N]
        wg = w.reshape(-1, group, w.shape[1])
        lo, hi = wg.amin(1), wg.amax(1)
        s = ((hi - lo) / 15).clamp_min(1e-6)
        z = (-lo / s).round().clamp(1, 15)
        q = (wg / s[:, None] + z[:, None]).round().clamp(0, 15).reshape(w.shape).long()
        zl = z.long()
        qw, qz = gptq_pack(q, zl, 4)
        base = name[:-len("weight")]
        g_idx = torch.arange(w.shape[0], dtype=torch.int32) // group
        packed.update({base + "qweight": qw, base + "qzeros": qz, base + "scales": s, base + "g_idx": g_idx})
        dense[name] = ((q - zl.repeat_interleave(group, 0)).float() * s.repeat_interleave(group, 0)).t().contiguous()
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False, "desc_act": False}
    gptq_dir = _rewrite(src, str(tmp_path / "q"), packed, qcfg)
    # On the CPU, where the quantized product is exactly dequantize-then-matmul: on a GPU the kernels' summation
    # order differs from cuBLAS's and flips near-ties of a random tiny model (the kernels' own tests run there).
    assert greedy(gptq_dir, quantization="gptq_marlin", device="cpu") == \
        greedy(_rewrite(src, str(tmp_path / "d"), dense, None), device="cpu")
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized with awq"):
        greedy(src, quantization="awq")
    with pytest.raises(ValueError, match="--quantization awq does not match .*'gptq'"):
        greedy(gptq_dir, quantization="awq_marlin")


@pytest.mark.parametrize("bits, sym", [(4, False), (8, True)])
def test_compressed_tensors_pack_quantized_matches_transformers(tiny_model_factory, tmp_path, bits, sym):
    """A W4A16 / W8A16 checkpoint written by the compressed-tensors library (min-max qparams per group of 32 from
    its own calculate_qparams), run by tokenmill and by HF transformers (which decompresses it on the CPU)."""
    pytest.importorskip("compressed_tensors")
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from tests.layers.quantization.test_quant_checkpoints import PROMPTS, greedy, hf_greedy
    src = tiny_model_factory("llama")
    model = tf.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=32)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "weight_scale"):
                wg = mod.weight.reshape(mod.weight.shape[0], -1, 32)
                scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
                mod.weight_scale.copy_(scale)
                mod.weight_zero_point.copy_(zp)
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    comp.compress_model(model)
    d = str(tmp_path / "ct")
    model.save_pretrained(d)
    comp.update_config(d)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(src, f), d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    assert sd["model.layers.0.mlp.down_proj.weight_packed"].shape == (64, 128 * bits // 32)
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in sd) == (not sym)
    ours = greedy(d)
    if sym:
        assert ours == hf_greedy(d)
    # transformers 5.24 with compressed-tensors 0.20 cannot load the packed zero points (a size mismatch on
    # weight_zero_point), so the reference is the library's own decompression of the model it compressed.
    comp.decompress_model(model)
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
               .tolist() for p in PROMPTS]
    assert ours == ref


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_tensor_parallel_shards_sum_to_the_one_rank_product(fmt):
    """Row-parallel: each rank loads its input slice of the packed weights, zero points and scales; the partial
    products sum to the one-rank product. Column-parallel q/k/v: the ranks' outputs concatenate per slot."""
    from tests.layers.test_linear_method import as_rank
    g = torch.Generator().manual_seed(7)
    k, n, group = 128, 64, 32
    cfg = {"quant_method": fmt, "bits": 4, "group_size": group, "sym": False, "desc_act": False}
    qc = GPTQConfig.from_config(cfg) if fmt == "gptq" else AWQConfig.from_config(cfg)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(1, 16, (k // group, n), generator=g)
    s = torch.rand(k // group, n, generator=g) * 0.02
    tensors = dict(zip(("qweight", "qzeros"), gptq_pack(q, z, 4) if fmt == "gptq" else (awq_pack(q), awq_pack(z))))
    tensors["scales"] = s
    if fmt == "gptq":
        tensors["g_idx"] = (torch.arange(k) // group).to(torch.int32)
    x = torch.randn(3, k, generator=g)
    want = x @ ((q - z.repeat_interleave(group, 0)).float() * s.repeat_interleave(group, 0))
    rows, cols = [], []
    for r in range(2):
        with as_rank(r, 2):
            row = RowParallelLinear(k, n, quant_config=qc, prefix="down_proj")
            col = QKVParallelLinear(k, 16, 2, 1, quant_config=qc, prefix="qkv_proj")  # the KV head replicated
        for name, t in tensors.items():
            getattr(row, name).weight_loader(getattr(row, name), t)
            if name == "g_idx":
                getattr(col, name).weight_loader(getattr(col, name), t, None)
                continue
            # q, k and v slots: the first 32 / next 16 / last 16 output features of the same tensors
            for slot, lo, hi in (("q", 0, 32), ("k", 32, 48), ("v", 48, 64)):
                dim_cols = t.shape[1] * lo // n, t.shape[1] * hi // n
                getattr(col, name).weight_loader(getattr(col, name), t[:, dim_cols[0]:dim_cols[1]], slot)
        row.process_weights_after_loading()
        col.process_weights_after_loading()
        rows.append(row.quant_method.apply(row, x[:, r * k // 2:(r + 1) * k // 2], None))
        cols.append(col(x))
    torch.testing.assert_close(rows[0] + rows[1], want, rtol=1e-4, atol=1e-4)
    # rank r: query head r (16 features), then the one KV head's k and v (16 each) that both ranks hold
    got = torch.cat([cols[0][:, :16], cols[1][:, :16], cols[0][:, 16:48]], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cols[1][:, 16:48], cols[0][:, 16:48])


def test_tiny_awq_llama_matches_its_dequantized_weights(tiny_model_factory, tmp_path):
    """AWQ GEMM checkpoint ([K, N/8] interleaved words), HF needs autoawq's CUDA kernels: the reference is
    tokenmill on the dequantized dense weights."""
    from tests.layers.quantization.test_quant_checkpoints import _is_linear, _rewrite, greedy
    src = tiny_model_factory("llama")
    sd = load_file(os.path.join(src, "model.safetensors"))
    group, packed, dense = 32, {}, {}
    for name, t in sd.items():
        if not _is_linear(name):
            packed[name] = dense[name] = t
            continue
        w = t.t()
        wg = w.reshape(-1, group, w.shape[1])
        lo, hi = wg.amin(1), wg.amax(1)
        s = ((hi - lo) / 15).clamp_min(1e-6)
        z = (-lo / s).round().clamp(0, 15)
        q = (wg / s[:, None] + z[:, None]).round().clamp(0, 15).reshape(w.shape).long()
        base = name[:-len("weight")]
        packed.update({base + "qweight": awq_pack(q).contiguous(), base + "qzeros": awq_pack(z.long()).contiguous(),
                       base + "scales": s})
        dense[name] = ((q - z.long().repeat_interleave(group, 0)).float() * s.repeat_interleave(group, 0)).t()
        dense[name] = dense[name].contiguous()
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    assert greedy(_rewrite(src, str(tmp_path / "q"), packed, qcfg), device="cpu") == \
        greedy(_rewrite(src, str(tmp_path / "d"), dense, None), device="cpu")   # as in the GPTQ test above
