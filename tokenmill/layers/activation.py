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
