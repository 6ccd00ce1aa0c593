"""Activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate, up] along the last dim -> silu(gate) * up (one Triton kernel on CUDA)."""
    if x.is_cuda:
        from tokenmill.kernels.triton_norm_rope_act import silu_and_mul as fused
        return fused(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def gated_activation(name: str) -> nn.Module:
    """HF's activation `name` (a config's hidden_act) for a gated MLP's gate, as HF's own module so the values match
    it bit for bit. Only parameter-free ones: a learned activation (prelu, xielu) would need checkpoint weights
    that the models here do not load."""
    from transformers.activations import ACT2CLS, ACT2FN
    if name not in ACT2CLS:
        raise ValueError(f"Unsupported hidden_act {name!r}; supported: {', '.join(sorted(ACT2CLS))}.")
    act = ACT2FN[name]
    if any(True for _ in act.parameters()):
        raise ValueError(f"Unsupported hidden_act {name!r}: it has learned parameters.")
    return act
