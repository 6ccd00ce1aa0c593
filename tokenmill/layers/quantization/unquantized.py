"""Dense weights in the model dtype: F.linear, or the small-batch Triton gemv where it was measured faster."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import linear_ops
from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig


class UnquantizedLinearMethod(LinearMethod):
    """One [output, input] weight per layer (the stacked slots one after another along the output dim).

    The fused variants fold the RMSNorm (+ residual add) and SiLU-and-mul into the gemv where linear_ops' tuning
    table says it pays; elsewhere they are exactly the unfused composition.
    """

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        w = nn.Parameter(torch.empty(shape.output_size_per_rank, shape.input_size_per_rank, dtype=dtype),
                         requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear_ops.linear(x, layer.weight, bias)

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear_ops.silu_mul_linear(x, layer.weight, bias)

    def apply_norm(self, layer, x, residual, norm, bias):
        return linear_ops.norm_linear(x, residual, norm, layer.weight, bias)

    def apply_norm_silu(self, layer, x, residual, norm, bias, down):
        if not isinstance(down.quant_method, UnquantizedLinearMethod) or down.output_delta is not None:
            return None
        return linear_ops.norm_linear_silu(x, residual, norm, layer.weight, bias, down.weight)


class UnquantizedConfig(QuantizationConfig):
    """Every layer dense."""

    name = "none"

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()
