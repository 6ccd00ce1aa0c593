"""GGUF weights kept quantized on the GPU: ggml blocks repacked for the Triton integer matmul, w = s * q + m.

Every block type of layers/quantization/gguf_blocks.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) decodes
to codes and one (scale, offset) per group of 16 or 32 inputs. After loading, a layer holds int_matmul's layout
(kernels/triton_quant_matmul.py): `qweight` int32 [K / pack, N] (4-bit codes packed 8 to a word; 5-, 6- and 8-bit
codes 4 to a word, one byte each), `scales` and `offsets` fp16 [K / group, N]. The product dequantizes in registers,
so the weights stay about 4.5 (Q4_*) or 8.5 bits per value in memory instead of 16. fp16 keeps 11 bits of each
scale and offset, finer than the codes themselves resolve.

Layers whose checkpoint tensors mix types (rare) and tensors of other types (F16, F32, Q2_K, ...) load dequantized.
Off CUDA (the tests) the method dequantizes per call.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig
from tokenmill.layers.quantization.common import checkpoint_modules, replace_param
from tokenmill.layers.quantization.gguf_blocks import BLOCK_TYPES, decode_blocks
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.layers.quantization.wna16 import pack_rows, unpack_rows


class GGUFBlockLinearMethod(LinearMethod):
    """A layer whose checkpoint tensors are all of one ggml block type.

    Contract: `qweight` [out, in / block * bytes] uint8 holds the file's blocks (stacked slots one after another,
    tensor-parallel shards whole blocks); after loading it is replaced by the packed codes, `scales` and `offsets`
    (module docstring)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.t = BLOCK_TYPES[type_name]
        self.bits = 4 if self.t.bits == 4 else 8

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        k = shape.input_size_per_rank
        if k % self.t.inputs:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: {k} inputs per rank are not whole {self.type_name} "
                             f"blocks of {self.t.inputs}")
        w = nn.Parameter(torch.empty(shape.output_size_per_rank, k // self.t.inputs * self.t.nbytes,
                                     dtype=torch.uint8), requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("qweight", w)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, s, m = decode_blocks(layer.qweight.data, self.type_name)
        replace_param(layer, "qweight", pack_rows(codes.t().to(torch.int32), self.bits))
        replace_param(layer, "scales", s.t().to(torch.float16).contiguous())
        replace_param(layer, "offsets", m.t().to(torch.float16).contiguous())

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N] in `dtype`."""
        q = unpack_rows(layer.qweight, self.bits).float()
        g = torch.arange(q.shape[0], device=q.device) // self.t.group
        return (q * layer.scales[g].float() + layer.offsets[g].float()).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.triton_quant_matmul import int_matmul
            y = int_matmul(x, layer.qweight, layer.scales, layer.offsets, self.bits, self.t.group)
        else:
            y = x @ self.dequantize(layer, x.dtype)
        return y if bias is None else y + bias


class GGUFBlockConfig(QuantizationConfig):
    """A GGUF file kept quantized (the GPU's format): layers whose checkpoint tensors are all one block type run
    GGUFBlockLinearMethod, the others dense.

    Contract: built from {HF weight name: ggml type name} of the file's tensors; `get_linear_method(prefix)` records
    the checkpoint weights it keeps quantized in `raw_names`, which the GGUF reader then yields as raw blocks
    (models/weight_utils.iter_gguf_weights's `raw_names`)."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]) -> None:
        self.tensor_types = dict(tensor_types)
        self.raw_names: set[str] = set()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        names = [f"{m}.weight" for m in checkpoint_modules(prefix)]
        types = {self.tensor_types.get(n) for n in names}
        method = self.kept_method(types.pop()) if len(types) == 1 else None
        if method is None:
            return UnquantizedLinearMethod()
        self.raw_names.update(names)
        return method

    def kept_method(self, type_name: str | None) -> LinearMethod | None:
        """The method for a layer whose tensors are all of `type_name`, or None to load it dense."""
        return GGUFBlockLinearMethod(type_name) if type_name in BLOCK_TYPES else None

    def summary(self) -> str:
        """'Q4_K x154, Q6_K x28' over the checkpoint weights kept quantized."""
        counts: dict[str, int] = {}
        for n in self.raw_names:
            t = self.tensor_types[n]
            counts[t] = counts.get(t, 0) + 1
        return ", ".join(f"{t} x{c}" for t, c in sorted(counts.items())) or "none"
