"""ggml block types decoded as affine groups (gguf_blocks.py) and the GPU's kept-quantized method (gguf_gpu.py): the
gguf package's own dequantizer is the oracle; its quantizers make the blocks where it has them, random bytes (with
sane fp16 scale fields) elsewhere. The Triton product runs under the interpreter here and compiled on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenmill.layers.quantization.base import LinearShape  # noqa: E402
from tokenmill.layers.quantization.gguf_blocks import BLOCK_TYPES, dequantize_blocks  # noqa: E402
from tokenmill.layers.quantization.gguf_gpu import GGUFBlockConfig, GGUFBlockLinearMethod  # noqa: E402
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}   # types the gguf package can quantize
# byte offsets of the fp16 fields (d, dmin / min) in each block
_HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}


def blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if type_name in QUANTIZABLE and seed % 2 == 0:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    t = BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, size=(n, k // t.inputs, t.nbytes), dtype=np.uint8)
    for at in _HALVES[type_name]:
        halves = np.float16(rng.uniform(-2e-2, 2e-2, size=(n, k // t.inputs)))
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // t.inputs, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(n, k))


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_block_type_decodes_to_the_gguf_dequantized_weight(type_name, seed):
    n, k = 8, 512
    raw = blocks(type_name, n, k, seed)
    assert raw.shape == (n, k // BLOCK_TYPES[type_name].inputs * BLOCK_TYPES[type_name].nbytes)
    torch.testing.assert_close(dequantize_blocks(torch.from_numpy(raw), type_name), reference(raw, type_name, n, k),
                               rtol=0, atol=0)


def _layer(type_name: str, raw: np.ndarray, n: int, k: int):
    method = GGUFBlockLinearMethod(type_name)
    layer = torch.nn.Module()
    method.create_weights(layer, LinearShape(k, (n,), k, n), torch.float32)
    assert layer.qweight.shape == raw.shape
    layer.qweight.data.copy_(torch.from_numpy(raw))
    method.process_weights_after_loading(layer)
    return method, layer


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_the_kept_quantized_layer_computes_the_dequantized_product(type_name):
    """Dequantize-per-call (CPU) and the Triton integer matmul (interpreter; compiled on CUDA) from the packed
    codes, fp16 scales and offsets, against x @ W^T of the gguf package's dequantized weight."""
    from tokenmill.kernels.triton_quant_matmul import int_matmul
    n, k = 40, 256
    raw = blocks(type_name, n, k, seed=2)
    method, layer = _layer(type_name, raw, n, k)
    bits = 4 if BLOCK_TYPES[type_name].bits == 4 else 8
    assert layer.qweight.shape == (k * bits // 32, n) and layer.scales.dtype == torch.float16
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    want = x @ reference(raw, type_name, n, k).T
    tol = dict(rtol=2e-3, atol=2e-3 * float(want.abs().max()))   # fp16 scales and offsets
    torch.testing.assert_close(method.apply(layer, x, None), want, **tol)
    got = int_matmul(x.to(DEV), layer.qweight.to(DEV), layer.scales.to(DEV), layer.offsets.to(DEV), bits,
                     BLOCK_TYPES[type_name].group).cpu()
    torch.testing.assert_close(got, want, **tol)


def test_config_keeps_layers_of_one_block_type_and_loads_the_rest_dense():
    types = {
        "model.layers.0.self_attn.q_proj.weight": "Q4_K", "model.layers.0.self_attn.k_proj.weight": "Q4_K",
        "model.layers.0.self_attn.v_proj.weight": "Q6_K", "model.layers.0.self_attn.o_proj.weight": "Q8_0",
        "model.layers.0.mlp.gate_proj.weight": "Q5_K", "model.layers.0.mlp.up_proj.weight": "Q5_K",
        "model.layers.0.mlp.down_proj.weight": "F16",
    }
    cfg = GGUFBlockConfig(types)
    assert isinstance(cfg.get_linear_method("model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert cfg.get_linear_method("model.layers.0.self_attn.o_proj").type_name == "Q8_0"
    assert cfg.get_linear_method("model.layers.0.mlp.gate_up_proj").type_name == "Q5_K"
    assert isinstance(cfg.get_linear_method("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    assert cfg.summary() == "Q5_K x2, Q8_0 x1"


def test_the_loader_keeps_gguf_quantized_per_device_unless_float32_is_asked(smollm2_gguf):
    from tokenmill.config.model import ModelConfig
    from tokenmill.models.loader import gguf_quant_config
    mc = ModelConfig(model=smollm2_gguf, skip_tokenizer_init=True)
    assert type(gguf_quant_config(mc, torch.device("cuda"))).__name__ == "GGUFBlockConfig"
    assert type(gguf_quant_config(mc, torch.device("cpu"))).__name__ == "GGUFCpuConfig"
    dense = ModelConfig(model=smollm2_gguf, dtype="float32", skip_tokenizer_init=True)
    assert gguf_quant_config(dense, torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_8b_shaped_layer_on_cuda(type_name):
    n, k = 1024, 4096
    raw = blocks(type_name, n, k, seed=1)
    method, layer = _layer(type_name, raw, n, k)
    layer.cuda()
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ reference(raw, type_name, n, k).cuda().T
        got = method.apply(layer, x, None).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
