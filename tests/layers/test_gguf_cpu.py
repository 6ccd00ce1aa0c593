"""The GGUF CPU method: 4-bit ggml blocks decoded and repacked for torch's int4 matmul give the dequantized product.

Blocks come from the gguf package's own quantizers (Q4_0, Q4_1) or are random bytes (Q4_K, whose quantizer the
package does not implement; its dequantizer is the reference for every type)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenmill.kernels import cpu_int4pack  # noqa: E402
from tokenmill.layers.quantization.base import LinearShape  # noqa: E402
from tokenmill.layers.quantization.gguf_blocks import decode_blocks  # noqa: E402
from tokenmill.layers.quantization.gguf_cpu import GGUFCpuConfig, GGUFInt4LinearMethod  # noqa: E402
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_int4pack.available(), reason="torch lacks the CPU int4pack ops")


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
        # d, dmin: finite halves of a realistic size (random bytes would give NaN / inf / huge values)
        raw[..., 0:2] = np.float16(rng.uniform(1e-3, 2e-2, size=(n, k // block))).view(np.uint8).reshape(
            n, k // block, 2)
        raw[..., 2:4] = np.float16(rng.uniform(1e-3, 2e-2, size=(n, k // block))).view(np.uint8).reshape(
            n, k // block, 2)
        return raw.reshape(n, -1)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qtype)


def _dequantized(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(n, k))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_decoded_blocks_are_the_dequantized_weight(type_name):
    n, k = 24, 512
    raw = _blocks(type_name, n, k)
    codes, s, m = decode_blocks(torch.from_numpy(raw), type_name)
    assert codes.shape == (n, k) and int(codes.max()) <= 15
    w = codes.float().reshape(n, k // 32, 32) * s.unsqueeze(-1) + m.unsqueeze(-1)
    torch.testing.assert_close(w.reshape(n, k), _dequantized(raw, type_name, n, k), rtol=1e-6, atol=1e-6)


def _layer(type_name: str, raw: np.ndarray, n: int, k: int, out_dtype=torch.bfloat16):
    method = GGUFInt4LinearMethod(type_name)
    layer = torch.nn.Module()
    method.create_weights(layer, LinearShape(k, (n,), k, n), out_dtype)
    assert layer.qweight.shape == raw.shape
    layer.qweight.data.copy_(torch.from_numpy(raw))
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "qweight")
    return method, layer


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int4pack_product_matches_dequantize_then_matmul(type_name, m):
    n, k = 96, 512
    raw = _blocks(type_name, n, k, seed=m)
    method, layer = _layer(type_name, raw, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    xb = x.bfloat16()
    ref = xb.float() @ _dequantized(raw, type_name, n, k).t()
    bias = torch.randn(n).bfloat16()
    y = method.apply(layer, xb, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the only differences: scales and zeros rounded to bf16, bf16 output; both far below a 4-bit step's error
    err = (y.float() - bias.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("copy", ["bf16", "fp16", "fp32"])
def test_many_rows_run_a_dense_copy_of_the_int4_kernels_own_weights(type_name, copy, monkeypatch):
    """bf16 where the CPU has bf16 instructions, else FBGEMM's packed fp16 weight, else fp32 (a bf16 GEMM without
    bf16 instructions is several times slower)."""
    from tokenmill.kernels import cpu_int4pack
    from tokenmill.kernels.cpu_features import fbgemm_fp16_rows
    from tokenmill.layers.quantization import gguf_cpu
    from tokenmill.layers.quantization.gguf_cpu import (DENSE_MIN_ROWS, DENSE_MIN_ROWS_AMX, DENSE_MIN_ROWS_FP16,
                                                        WT_MAX_ROWS)
    if copy == "fp16" and not fbgemm_fp16_rows():
        pytest.skip("FBGEMM's fp16-weight linear does not run here")
    monkeypatch.setattr(gguf_cpu, "fast_bf16_matmul", lambda: copy == "bf16")
    monkeypatch.setattr(gguf_cpu, "fbgemm_fp16_rows", lambda: 6 if copy == "fp16" else 0)
    monkeypatch.setattr(gguf_cpu, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    n, k = 80, 256
    raw = _blocks(type_name, n, k, seed=3)
    method, layer = _layer(type_name, raw, n, k)
    first = {"bf16": DENSE_MIN_ROWS_AMX, "fp16": DENSE_MIN_ROWS_FP16, "fp32": DENSE_MIN_ROWS}[copy]
    assert layer.gguf_dense_min_rows == first
    below = torch.randn(first - 1, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    kernel_below = cpu_int4pack.mm(below, layer.packed, layer.scales_zeros)[:, :n]
    assert torch.equal(method.apply(layer, below, None), kernel_below)
    for rows in (first, WT_MAX_ROWS, WT_MAX_ROWS + 1):   # as W x^T, then as x W^T
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = method.apply(layer, x, None)
        assert y.shape == (rows, n) and y.is_contiguous()
        kernel = cpu_int4pack.mm(x, layer.packed, layer.scales_zeros)[:, :n]
        # same weights, each rounded to bf16 once: within bf16 output rounding of the kernel's product
        assert (y.float() - kernel.float()).abs().max().item() <= 1e-2 * kernel.float().abs().max().item()
    if copy == "fp16":
        assert layer.gguf_dense_fp16 is not None and "dense" not in layer._parameters
    else:
        dense_dtype = torch.bfloat16 if copy == "bf16" else torch.float32
        assert layer.gguf_dense_fp16 is None and layer.dense.dtype == dense_dtype and layer.dense.shape == (n, k)


def test_fp32_activations_come_back_fp32_and_3d_inputs_keep_their_shape():
    n, k = 64, 256
    raw = _blocks("Q4_1", n, k)
    method, layer = _layer("Q4_1", raw, n, k, out_dtype=torch.float32)
    x = torch.randn(2, 3, k)
    y = method.apply(layer, x, None)
    assert y.dtype == torch.float32 and y.shape == (2, 3, n)
    ref = x.bfloat16().float() @ _dequantized(raw, "Q4_1", n, k).t()
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_a_quantized_block_that_is_wrong_changes_the_product():
    """The product reads the file's codes: flipping one code's nibble moves exactly that output row."""
    n, k = 8, 64
    raw = _blocks("Q4_1", n, k)
    method, layer = _layer("Q4_1", raw, n, k)
    raw2 = raw.copy()
    raw2[3, 4] ^= 0x0F  # row 3, first block, a code byte (after d and m)
    method2, layer2 = _layer("Q4_1", raw2, n, k)
    x = torch.randn(1, k).bfloat16()
    diff = (method.apply(layer, x, None).float() - method2.apply(layer2, x, None).float()).abs()[0]
    assert diff[3] > 0 and torch.count_nonzero(diff) == 1


def test_config_keeps_a_stacked_layer_quantized_only_when_all_its_tensors_share_a_4bit_type():
    types = {
        "model.layers.0.self_attn.q_proj.weight": "Q4_1", "model.layers.0.self_attn.k_proj.weight": "Q4_1",
        "model.layers.0.self_attn.v_proj.weight": "Q4_1", "model.layers.0.self_attn.o_proj.weight": "Q8_0",
        "model.layers.0.mlp.gate_proj.weight": "Q4_K", "model.layers.0.mlp.up_proj.weight": "Q6_K",
        "model.layers.0.mlp.down_proj.weight": "Q4_0",
    }
    cfg = GGUFCpuConfig(types)
    qkv = cfg.get_linear_method("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, GGUFInt4LinearMethod) and qkv.type_name == "Q4_1"
    assert isinstance(cfg.get_linear_method("model.layers.0.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(cfg.get_linear_method("model.layers.0.mlp.gate_up_proj"), UnquantizedLinearMethod)
    assert cfg.get_linear_method("model.layers.0.mlp.down_proj").type_name == "Q4_0"
    assert cfg.raw_names == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight"}


def test_inputs_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        GGUFInt4LinearMethod("Q4_K").create_weights(torch.nn.Module(), LinearShape(576, (64,), 576, 64),
                                                    torch.bfloat16)


def test_the_gguf_reader_yields_raw_blocks_for_the_named_tensors_and_the_header_lists_their_types(tmp_path):
    from tokenmill.models.weight_utils import iter_gguf_weights
    from tokenmill.transformers_utils.gguf import read_gguf_tensor_infos
    n, k = 64, 96
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_k.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_tensor_infos(path) == {"blk.0.attn_q.weight": (3, (n, k)), "blk.0.attn_k.weight": (3, (n, k))}
    out = dict(iter_gguf_weights(path, None, use_tqdm=False,
                                 raw_names={"model.layers.0.self_attn.q_proj.weight"}))
    assert out["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.uint8
    assert torch.equal(out["model.layers.0.self_attn.q_proj.qweight"], torch.from_numpy(q))
    dense = out["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(dense, _dequantized(q, "Q4_1", n, k))
