"""The matrix products of the linear layers, with the small-batch decode kernels where they were measured faster.

At a few tokens per step (batch-1..2 decode) the weight-streaming Triton gemv of tokenmill.kernels.triton_gemv
beats cuBLAS on some shapes, and it can fold the RMSNorm (+ residual add) before a projection, or the SiLU-and-mul
before down_proj, into the product, saving a launch each. A product takes the gemv path only for a (rows, N, K,
prologue) that the device's measured table (tokenmill/kernels/configs/) lists; everything else is F.linear plus
the separate kernels. The numerics differ only by rounding (the unfused path rounds the
normalised activations to the model dtype before the product, the fused one keeps more precision).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.activation import SiluAndMul

_silu_and_mul = SiluAndMul()


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, prologue: str | None):
    """The gemv config of this product on x's device (its measured table, see kernels/gemv_config.py), or None."""
    if not x.is_cuda:
        return None
    from tokenmill.kernels.gemv_config import choose
    from tokenmill.kernels.triton_gemv import use_gemv
    if not use_gemv(x, weight):
        return None
    return choose(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1], prologue, x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    cfg = _gemv_config(x, weight, None)
    if cfg is None:
        return F.linear(x, weight, bias)
    from tokenmill.kernels.triton_gemv import gemv
    return gemv(x, weight, bias, config=cfg)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, W, b) for x = [gate | up]."""
    if x.is_cuda and x.shape[-1] == 2 * weight.shape[1]:
        cfg = _gemv_config(x, weight, "silu_mul")
        if cfg is not None:
            from tokenmill.kernels.triton_gemv import gemv
            return gemv(x, weight, bias, act="silu_mul", config=cfg)
    return linear(_silu_and_mul(x), weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(norm(x + residual), W, b), x + residual); without a residual the second item is x itself."""
    cfg = _gemv_config(x, weight, "rmsnorm")
    if cfg is not None:
        return _norm_gemv(x, residual, norm, weight, bias, cfg)
    if residual is None:
        return linear(norm(x), weight, bias), x
    h, residual = norm(x, residual)
    return linear(h, weight, bias), residual


def norm_linear_silu(x: torch.Tensor, residual: torch.Tensor | None, norm, weight: torch.Tensor,
                     bias: torch.Tensor | None, down_weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(silu(gate) * up, x + residual) for [gate | up] = F.linear(norm(x + residual), W, b), the SiLU-and-mul in
    the gemv's epilogue; None where that does not pay: the gemv must take this product (with or without the norm
    folded in) and down_proj's plain product (`down_weight`) too, else the caller keeps the [gate | up] output and
    down_proj's SiLU prologue."""
    # _gemv_config looks only at x's rows and dtype and at the weight's shape: x stands in for down_proj's input.
    if not x.is_cuda or _gemv_config(x, down_weight, None) is None:
        return None
    cfg = _gemv_config(x, weight, "rmsnorm")
    if cfg is not None:
        return _norm_gemv(x, residual, norm, weight, bias, cfg, epilogue="silu_mul")
    cfg = _gemv_config(x, weight, None)
    if cfg is None:
        return None
    from tokenmill.kernels.triton_gemv import gemv
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    return gemv(h, weight, bias, config=cfg, epilogue="silu_mul"), residual


def _norm_gemv(x, residual, norm, weight, bias, cfg, epilogue: str | None = None):
    """The gemv with the RMSNorm (+ residual add) folded in: (y, x + residual), or (y, x) without a residual."""
    from tokenmill.kernels.triton_gemv import gemv
    kw = dict(norm_weight=norm.weight, eps=norm.eps, config=cfg, epilogue=epilogue)
    if residual is None:
        return gemv(x, weight, bias, **kw), x
    return gemv(x, weight, bias, residual=residual, **kw)
