"""FP8 (e4m3) activations for the decode products of FP8 checkpoints (Triton): x [M, K] -> (x / s rounded to fp8,
s) with one float32 scale s per row.

Dynamic (no input scale): s = max(amax(|row|) / 448, 1e-12), the per-token scheme of
layers/quantization/fp8.quantize_activation, computed the same way (a division, then clamp to +-448, then
round-to-nearest-even), so both give the same bytes. Static: s is the checkpoint's input_scale for every row.

One program per row (decode has at most 16): a pass for the row's amax, a pass to write it. Both read the row from
L2, so the kernel costs little beside the weight stream of the product that follows it (kernels/triton_gemv.py reads
the fp8 rows straight into fp8 x fp8 tensor-core dots: no weight is widened).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_BLOCK = 1024


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest-even on the e4m3 grid, in fp32 arithmetic: the cast that follows is
    then exact. (Triton's CPU interpreter rounds its fp8 casts differently from the GPU's RNE conversion.)"""
    bits = v.to(tl.int32, bitcast=True)
    # Normal e4m3 values keep 3 of fp32's 23 mantissa bits: round the low 20 to nearest-even (a carry moves into
    # the exponent, as it should).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal ones (|v| < 2^-6) are multiples of 2^-9: adding 1.5 * 2^14 leaves 2^-9 as fp32's last place.
    # The sum drops the sign of a value that rounds to zero; the cast keeps it (-0 is its own byte).
    sub = tl.abs((tl.abs(v) + 24576.0) - 24576.0)
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_x, stride_q,
                       STATIC: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    pdl_wait(PDL)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK)
    if STATIC:
        s = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, s)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(x / s, -FP8_MAX), FP8_MAX))
        tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                      block: int = _BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [M, K], float32 scales [M]) for x [..., K] (fp16 / bf16 / fp32, contiguous last dim); input_scale: a
    float32 device scalar (static scheme), else one scale per row. CUDA-graph safe (no host syncs)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(m,)](x2, q, s, input_scale if input_scale is not None else s, k, x2.stride(0),
                                 q.stride(0), STATIC=input_scale is not None, FP8_MAX=_FP8_MAX, BLOCK=block,
                                 num_warps=4, **launch_kwargs(x.device, "gemv"))
    return q, s
