"""torch's CPU int4 weight-only matmul (`aten._weight_int4pack_mm_for_cpu`), wrapped for the GGUF CPU method.

Not a Triton kernel: the product is ATen's own AVX512 / AVX2 kernel. It holds a weight as 4-bit codes q in [0, 15]
per element and, per group of `group_size` inputs and per output row, a bf16 scale s and zero z, and computes
x @ W^T with W = (q - 8) * s + z. The activations must be bf16 (with fp32 activations the op falls back to a path
measured 15-100x slower), the output is bf16.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32  # the block size of GGUF's Q4_0 / Q4_1 and of Q4_K's sub-blocks
_N_MULTIPLE = 16  # the packing wants whole tiles of 16 output rows
_INNER_K_TILES = 2  # the CPU packing ignores the tile count beyond validating it; 2 is what its tests use


def available() -> bool:
    """Whether this torch build has the CPU int4 pack and matmul ops."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] integers in [0, 15]; scales, zeros [N, K / GROUP_SIZE] (float, any dtype) such that the weight is
    (codes - 8) * scale + zero. Returns (packed weight, scales-and-zeros [K / GROUP_SIZE, N', 2] bf16) for `mm`, N'
    being N rounded up to a multiple of 16 (the extra output columns of `mm` are zeros, for the caller to drop)."""
    n, k = codes.shape
    if k % GROUP_SIZE or scales.shape != (n, k // GROUP_SIZE) or zeros.shape != scales.shape:
        raise ValueError(f"int4pack: codes {tuple(codes.shape)} need K divisible by {GROUP_SIZE} and scales / zeros "
                         f"of shape {(n, k // GROUP_SIZE)}, got {tuple(scales.shape)} / {tuple(zeros.shape)}")
    pad = -n % _N_MULTIPLE
    if pad:  # zero rows (code 0, scale 0, zero 0) whose outputs `mm`'s caller drops
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scales = torch.cat([scales, scales.new_zeros(pad, k // GROUP_SIZE)])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, k // GROUP_SIZE)])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 -> x @ W^T [M, N'] bf16 (N' as `pack` padded it)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_zeros)
