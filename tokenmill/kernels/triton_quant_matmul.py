"""Matrix products with quantized weights dequantized in registers: y[M, N] = x[M, K] W^T, W read in its stored form.

Two kernels share one tiling (a program per BLOCK_M x BLOCK_N output tile, a loop over K):
- `fp8_matmul`: W is float8 e4m3 [N, K] with either one float32 scale per output row (per-tensor and per-channel
  checkpoints, whose per-slot scales the linear method expands to rows) or one scale per (block_n x block_k) block
  (DeepSeek-V3 / Qwen3-FP8 block-wise checkpoints). A row scale multiplies the accumulator once at the end; a
  block scale multiplies each tile's product when the tile lies inside one block (128 x 128 blocks), else the
  weight tile before the dot.
- `int_matmul`: W is 4- or 8-bit integers packed along K into int32 ([K * bits / 32, N], value j of a word in bits
  j*bits .. j*bits + bits - 1), with a scale and a zero point per (group, output column): w = (q - z) * s for an
  integer z (AWQ, GPTQ), or w = q * s + m for a float offset m (GGUF's block types). The group of input k is
  `g_idx[k]` when given (GPTQ act-order), else k // group_size.

The activations stay in their dtype (bf16 / fp16 / fp32) and the dot runs in it with fp32 accumulation (fp32
operands in full precision, not TF32: an fp32 model stays exact), so these are weight-only products: at a few rows
(decode) the cost is the weight bytes streamed, which is what quantization shrinks. BLOCK_M follows the row count
(tl.dot's minimum is 16). On a GPU, 16 rows or fewer take kernels/triton_int_gemv.py (each packed word loaded once;
4-bit codes with whole-group K steps up to its MAX_TILE_M rows) unless a split over K is asked for: then each share
writes its fp32 partial product and one sum in a fixed order (deterministic) adds them. Past those rows, from
DEQUANT_MIN_ROWS on (large decode batches, prefill), the product is no longer bound by the weight bytes but by the
tiles' math, where these 64 x 64 tiles are far from cuBLAS: `int_dequantize` writes W in x's dtype (one pass, ~4x
the packed bytes) and cuBLAS multiplies, the usual trade of W4A16 engines.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Rows from which int_matmul dequantizes W and calls cuBLAS on a GPU (see the module docstring): on an H100 at 32
# rows already 1.7-2.7x faster than the tile kernel on the 8B products (gate/up 342 -> 204 us), 5-14x at 256+.
DEQUANT_MIN_ROWS = 17


def _tiles(m: int, n: int) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    return block_m, block_n, 64


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym, s_cols, BN_SCALE, BK_SCALE,
                       BLOCK_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr = False):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if TILE_SCALE:
            # The tile lies inside one scale block: one scale for its whole product (e4m3 -> bf16 is exact).
            s = tl.load(s_ptr + (pid_n * BLOCK_N // BN_SCALE) * s_cols + k0 // BK_SCALE)
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee") * s
        elif BLOCK_SCALES:
            s = tl.load(s_ptr + (rn[None, :] // BN_SCALE) * s_cols + rk[:, None] // BK_SCALE,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(x, (w.to(tl.float32) * s).to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] float8_e4m3fn, dequantized)^T in x's dtype. `scale` is float32 [N] (one per
    row) or, with `block` = (block_n, block_k), float32 [ceil(N / block_n), ceil(K / block_k)]."""
    if not (weight.is_contiguous() and scale.is_contiguous()):
        raise ValueError("fp8_matmul: weight and scale must be contiguous (the kernel reads them row-major)")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = _tiles(m, n)
    bn_s, bk_s = block if block is not None else (1, 1)
    # Published block-wise checkpoints use 128 x 128 blocks: every 64 x 64 tile then sits inside one block.
    tile_scale = block is not None and bn_s % bn == 0 and bk_s % bk == 0
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_matmul_kernel[grid](x2, weight, scale, y, m, n, k, x2.stride(0), y.stride(0),
                             scale.shape[1] if block is not None else 0, bn_s, bk_s,
                             BLOCK_SCALES=block is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             TILE_SCALE=tile_scale)
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, k_ok, kn_ok, N, GROUP, BITS: tl.constexpr,
                  HAS_G_IDX: tl.constexpr, FLOAT_ZERO: tl.constexpr):
    """W's [rk, rn] tile in fp32 from the packed layout (`int_matmul`'s docstring)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # each packed word is loaded by the PACK rows that share it (one cache line, no extra HBM traffic)
    word = tl.load(q_ptr + (rk[:, None] // PACK) * N + rn[None, :], mask=kn_ok, other=0)
    q = (word >> ((rk[:, None] % PACK) * BITS)) & MASK
    if HAS_G_IDX:
        g = tl.load(g_ptr + rk, mask=k_ok, other=0)
    else:
        g = rk // GROUP
    s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0)
    if FLOAT_ZERO:
        return q.to(tl.float32) * s + z.to(tl.float32)
    else:
        return (q - z.to(tl.int32)).to(tl.float32) * s


@triton.jit
def _int_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_ym, GROUP,
                       BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, FLOAT_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr = 0):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo, k_hi = 0, K
    if K_PER_SPLIT:  # this program's share of K, its partial sum written to y's (fp32) slice of the share
        k_lo = tl.program_id(2) * K_PER_SPLIT
        y_ptr += tl.program_id(2).to(tl.int64) * M * stride_ym
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        kn_ok = k_ok[:, None] & n_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, k_ok, kn_ok, N, GROUP, BITS, HAS_G_IDX,
                          FLOAT_ZERO).to(x.dtype)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, g_idx: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ W with W [K, N] = (unpack(qweight) - zeros[g]) * scales[g]; qweight int32 [K * bits / 32, N],
    scales [G, N] (any float dtype), zeros uint8 [G, N], g = g_idx[k] (int32 [K]) or k // group_size. With float
    `zeros` (offsets), W = unpack(qweight) * scales[g] + zeros[g] instead. split_k: K per program, a multiple of
    the K tile (64) (None: no split; on CUDA, up to `triton_int_gemv.magic_tile_rows` rows then run its int_gemv
    and more `int_dequantize` + cuBLAS; 0: this kernel without a split)."""
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("int_matmul: qweight, scales and zeros must be contiguous (the kernel reads them row-major)")
    n = qweight.shape[1]
    k = qweight.shape[0] * (32 // bits)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if split_k is None and x.is_cuda:
        # Decode: the weight-streaming GEMV (each packed word loaded once, unpacked in registers), and for 4-bit
        # codes its magic tiles a little further.
        from tokenmill.kernels.triton_int_gemv import int_gemv, magic_tile_rows
        if m <= magic_tile_rows(x.dtype, bits, group_size, g_idx):
            return int_gemv(x, qweight, scales, zeros, bits, group_size, g_idx)
    if split_k is None and x.is_cuda and m >= DEQUANT_MIN_ROWS:
        w = int_dequantize(qweight, scales, zeros, bits, group_size, g_idx, x.dtype)
        return torch.mm(x2, w).reshape(*x.shape[:-1], n)
    bm, bn, bk = _tiles(m, n)
    k_split = split_k or 0
    if k_split % bk:
        raise ValueError(f"int_matmul: split_k={k_split} must be a multiple of the K tile ({bk})")
    # Split over K: each share's partial product in fp32, summed in a fixed order afterwards (deterministic, unlike
    # atomic adds: seeded sampling stays reproducible).
    splits = triton.cdiv(k, k_split) if k_split else 1
    y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if k_split else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    _int_matmul_kernel[grid](x2, qweight, scales, zeros, g_idx if g_idx is not None else qweight, y, m, n, k,
                             x2.stride(0), y.stride(-2), group_size, BITS=bits, HAS_G_IDX=g_idx is not None,
                             FLOAT_ZERO=zeros.is_floating_point(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             K_PER_SPLIT=k_split)
    if k_split:
        y = y.sum(0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _int_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, GROUP, BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                        FLOAT_ZERO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = rk < K
    kn_ok = k_ok[:, None] & (rn < N)[None, :]
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, k_ok, kn_ok, N, GROUP, BITS, HAS_G_IDX, FLOAT_ZERO)
    tl.store(w_ptr + rk[:, None] * N + rn[None, :], w.to(w_ptr.dtype.element_ty), mask=kn_ok)


def int_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   g_idx: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [K, N] in `dtype` from int_matmul's packed layout (same arguments), each weight computed in fp32 and
    rounded once, as int_matmul's tiles round it."""
    n = qweight.shape[1]
    k = qweight.shape[0] * (32 // bits)
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    _int_dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, w, n, k, group_size, BITS=bits,
        HAS_G_IDX=g_idx is not None, FLOAT_ZERO=zeros.is_floating_point(), BLOCK_K=block_k, BLOCK_N=block_n)
    return w
