"""RMSNorm with an optional fused residual add (computed in fp32 like HF, then cast back)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        w = self._parameters["weight"]   # not nn.Module.__getattr__: the CPU step is bound by such overhead
        if dtype == torch.float32:  # HF's arithmetic with its no-op casts left out and the temporaries reused
            return torch.mul(x, x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(w)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:  # one fused kernel instead of ~8 elementwise launches
            from tokenmill.kernels.triton_norm_rope_act import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
