"""bitsandbytes NF4 quantized at load, through the library: the layer against the library's own dequantization,
a tiny Llama end to end against the dense checkpoint of those dequantized weights, and pre-quantized checkpoints
refused."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as BF  # noqa: E402

from tokenmill.layers.linear import MergedColumnParallelLinear  # noqa: E402
from tokenmill.layers.quantization.bnb import BnbConfig  # noqa: E402


def test_nf4_layer_matches_the_library():
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(128, [64, 64], quant_config=BnbConfig.from_config({}), prefix="gate_up_proj")
    w = torch.randn(128, 128)
    layer.weight.weight_loader(layer.weight, w)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == 128 * 128 // 2
    assert layer.weight_absmax.numel() == 128 * 128 // 64
    q, st = BF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    x = torch.randn(3, 128)
    want = F.linear(x, BF.dequantize_4bit(q, st))
    torch.testing.assert_close(layer(x), want)
    assert 0 < (want - x @ w.t()).abs().max() < 0.2 * (x @ w.t()).abs().max()


def test_tiny_llama_in_flight_nf4_matches_its_dequantized_weights(tiny_model_factory, tmp_path):
    from tests.layers.quantization.test_quant_checkpoints import _is_linear, _rewrite, greedy
    src = tiny_model_factory("llama")
    sd = load_file(os.path.join(src, "model.safetensors"))
    dense = {}
    for name, t in sd.items():
        if _is_linear(name):
            q, st = BF.quantize_4bit(t.contiguous(), blocksize=64, quant_type="nf4")
            t = BF.dequantize_4bit(q, st)
        dense[name] = t
    # Blocks of 64 never straddle two stacked slots (each slot holds a multiple of 64 values), so quantizing
    # q, k, v separately equals quantizing the stacked [q | k | v] as tokenmill does.
    assert greedy(src, quantization="bitsandbytes") == greedy(_rewrite(src, str(tmp_path / "d"), dense, None))


def test_prequantized_bnb_checkpoints_are_refused():
    with pytest.raises(ValueError, match="pre-quantized with bitsandbytes \\(4-bit\\).*not read"):
        BnbConfig.from_config({"quant_method": "bitsandbytes", "load_in_4bit": True})
