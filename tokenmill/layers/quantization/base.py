"""The interface every weight format implements, so that a new format touches no model file.

A linear layer (tokenmill/layers/linear.py) owns one `LinearMethod`. The method decides which parameters the layer
holds (a dense weight; or packed integers with their scales, zero points and group indices), how they are prepared
once after loading, and how the product is computed. The layer keeps what all formats share: the tensor-parallel
split, the bias, the communication and the loading of checkpoint tensors onto shards.

How a parameter says where a checkpoint tensor lands (read by the layer's weight loader):
- `output_dim`: the dim that runs over the layer's output features (split by column-parallel layers, and where the
  q/k/v or gate/up slots of a stacked parameter lie), or None;
- `input_dim`: the dim that runs over the input features (split by row-parallel layers), or None.
Along such a dim a parameter may hold fewer or more entries than there are features (4-bit values packed eight to
an int32, one scale per group of 128 inputs): its extent is scaled from the feature count in proportion, so every
split and slot offset must divide evenly. A parameter with neither dim is replicated. A method that needs another
rule for a parameter (one scale per stacked slot, say) sets the parameter's own `weight_loader`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LinearShape:
    """The sizes a method creates parameters for: this rank's input features, this rank's output features per
    stacked slot (one entry for a plain layer; q, k, v or gate, up otherwise), and the one-rank totals."""
    input_size_per_rank: int
    output_sizes_per_rank: tuple[int, ...]
    input_size: int
    output_size: int

    @property
    def output_size_per_rank(self) -> int:
        return sum(self.output_sizes_per_rank)


class LinearMethod:
    """How one linear layer stores and applies its weights.

    Contract: `create_weights` registers the layer's weight parameters (with `output_dim` / `input_dim` set as
    described in the module docstring); the loader fills them from the checkpoint; `process_weights_after_loading`
    runs exactly once after that (repack, transpose, pre-scale; it may replace parameters); then `apply(layer, x,
    bias)` returns x W^T + bias for this rank's shard, and the fused variants return the same values as their
    unfused definitions up to rounding. The fused variants default to the unfused composition, so a method need
    only implement `create_weights` and `apply`.
    """

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """apply(silu(gate) * up) for x = [gate | up]."""
        from tokenmill.layers.activation import silu_and_mul
        return self.apply(layer, silu_and_mul(x), bias)

    def apply_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(norm(x + residual)), x + residual); without a residual the second item is x itself."""
        if residual is None:
            return self.apply(layer, norm(x), bias), x
        h, residual = norm(x, residual)
        return self.apply(layer, h, bias), residual

    def apply_norm_silu(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm,
                        bias: torch.Tensor | None, down: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a [gate | up] layer followed by `down`: (silu(gate) * up, x + residual) with the activation fused
        into this product, or None where this method does not fuse it (the caller then runs apply_norm and lets
        `down` take the SiLU)."""
        return None


class QuantizationConfig:
    """A checkpoint's weight format: picks the method of each linear layer by its place in the model.

    Contract: `get_linear_method(prefix)` returns the method for the layer whose parameters are named
    `prefix + ".weight"` etc. (formats that leave some modules unquantized answer the unquantized method there).
    """

    name: str = ""

    def get_linear_method(self, prefix: str) -> LinearMethod:
        raise NotImplementedError

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Once, after every layer's process_weights_after_loading: changes a format makes outside the linear
        layers (the LM head, say). Default: none."""
