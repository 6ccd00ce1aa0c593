"""bitsandbytes 4-bit (NF4) weights quantized at load from a dense checkpoint (`--quantization bitsandbytes`),
through the bitsandbytes library itself.

Each layer loads its dense shard as usual; `process_weights_after_loading` replaces it with bitsandbytes' packed
uint8 values (two per byte) and one absmax per block of 64 weights (stored as parameters `weight` and
`weight_absmax`, so the start-up memory log counts them), keeping the library's QuantState for the product. The
product is bitsandbytes.matmul_4bit on CUDA; elsewhere (CPU) the weight is dequantized by the library per call and
multiplied by F.linear. Pre-quantized bitsandbytes checkpoints (`quant_method: bitsandbytes` in config.json) and
8-bit LLM.int8() are refused at start-up as not supported yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig
from tokenmill.layers.quantization.common import replace_param

BLOCKSIZE = 64


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError as e:
        raise ImportError("--quantization bitsandbytes needs the bitsandbytes package (pip install bitsandbytes)."
                          ) from e
    return bitsandbytes


class BnbLinearMethod(LinearMethod):
    """A dense weight at load, NF4 after `process_weights_after_loading`."""

    def __init__(self, quant_type: str) -> None:
        self.quant_type = quant_type

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        w = nn.Parameter(torch.empty(shape.output_size_per_rank, shape.input_size_per_rank, dtype=dtype),
                         requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bnb = _bnb()
        w = layer.weight.data
        layer.bnb_dtype = w.dtype
        packed, state = bnb.functional.quantize_4bit(w.contiguous(), blocksize=BLOCKSIZE, quant_type=self.quant_type)
        replace_param(layer, "weight", packed)
        replace_param(layer, "weight_absmax", state.absmax)
        layer.bnb_state = state

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        bnb = _bnb()
        if x.is_cuda:
            y = bnb.matmul_4bit(x, layer.weight.t(), layer.bnb_state)
        else:
            y = F.linear(x, bnb.functional.dequantize_4bit(layer.weight, layer.bnb_state).to(x.dtype))
        return y if bias is None else y + bias


class BnbConfig(QuantizationConfig):
    """In-flight NF4 of every linear layer."""

    name = "bitsandbytes"

    def __init__(self, quant_type: str = "nf4") -> None:
        self.quant_type = quant_type

    @classmethod
    def from_config(cls, qc: dict) -> "BnbConfig":
        if qc:
            kind = "8-bit" if qc.get("load_in_8bit") else "4-bit"
            from tokenmill.config.utils import not_supported_yet
            raise not_supported_yet("quantization", "bitsandbytes",
                                    f"This checkpoint is pre-quantized with bitsandbytes ({kind}); tokenmill "
                                    "quantizes dense checkpoints to NF4 at load (--quantization bitsandbytes on the "
                                    "unquantized model) but does not read bitsandbytes checkpoints yet.")
        _bnb()
        return cls()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return BnbLinearMethod(self.quant_type)
