"""Persistent-grid form of the skinny GEMM (tokenmill/kernels/triton_gemv.py) for large batch-1 products.

Why: with one program per N tile, a product whose tile count is not a multiple of the programs the GPU holds at
once ends in a partial wave: the last programs stream their whole share of W while most SMs idle, a tail of up to
one program's duration (~4 us for Llama-3-8B's qkv at 8-row tiles). Here the grid is sized to what the GPU holds
(`GemvConfig.persistent` programs per SM), each program walks the N tiles pid, pid + G, ... as one flattened
sequence of K steps, and the W loads run DEPTH - 1 steps ahead across tile boundaries (DEPTH = 2 or 4 tiles in
flight per program: `GemvConfig.depth`), so every SM streams until its
last tile and the imbalance is at most one tile. With programmatic dependent launch the first two W tiles are
loaded before the wait on the previous kernel, as in the plain kernel.

Limits (the caller falls back to the plain kernel otherwise): N a multiple of BLOCK_N, K a multiple of BLOCK_K,
no K split. Prologues, bias and the inner products are the plain kernel's own (`_gemv_step`, `_gemv_epilogue`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.pdl import wait_then_release
from tokenmill.kernels.triton_gemv import _gemv_epilogue, _gemv_step


@triton.jit
def _w_offset(i, pid, G, k_steps, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Element offset of flattened step i's W tile: tile pid + (i // k_steps) * G, K step i % k_steps."""
    t = pid + (i // k_steps) * G
    return t.to(tl.int64) * (BLOCK_N * stride_wn) + (i % k_steps) * BLOCK_K


# M and N never decide vector widths; n_tiles only bounds loops.
@triton.jit(do_not_specialize=["M", "N", "n_tiles"])
def _gemv_persistent_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, nw_ptr, res_ptr, res_out_ptr,
    M, N, K, n_tiles, eps,
    stride_xm, stride_wn, stride_ym, stride_rm, stride_rom,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ACC2D: tl.constexpr, DEPTH: tl.constexpr = 2,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    xdt = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_steps = K // BLOCK_K
    total = tl.cdiv(n_tiles - pid, G) * k_steps          # this program's flattened K steps
    # Addresses of a W^T tile [BLOCK_K, BLOCK_N] relative to its (tile, K step) offset; K is contiguous.
    w_tile = w_ptr + offs_bn.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_rom
    # Steps 0 .. DEPTH-1 before the wait (weights only). Past the last step the offset repeats it: a re-read, so
    # the loads stay unmasked.
    w = tl.load(w_tile + _w_offset(0, pid, G, k_steps, stride_wn, BLOCK_N, BLOCK_K))
    w_nxt = tl.load(w_tile + _w_offset(tl.minimum(1, total - 1), pid, G, k_steps, stride_wn, BLOCK_N, BLOCK_K))
    if DEPTH == 4:
        w_2 = tl.load(w_tile + _w_offset(tl.minimum(2, total - 1), pid, G, k_steps, stride_wn, BLOCK_N, BLOCK_K))
        w_3 = tl.load(w_tile + _w_offset(tl.minimum(3, total - 1), pid, G, k_steps, stride_wn, BLOCK_N, BLOCK_K))
    wait_then_release(PDL)
    if USE_DOT or ACC2D:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        t = pid + (i // k_steps) * G
        ks = i % k_steps
        kk = ks * BLOCK_K + offs_k
        ro_m = tl.where(t == 0, M, 0)                   # the first N tile's owner writes residual_out
        acc, ss = _gemv_step(acc, ss, w, kk, x_rows, r_rows, ro_rows, nw_ptr, m_mask, ro_m, offs_m, K, xdt,
                             BLOCK_M, BLOCK_K, SILU_MUL, NORM, HAS_RES, USE_DOT, True, DOT_F32, ACC2D)
        if DEPTH == 4:
            w = w_nxt
            w_nxt = w_2
            w_2 = w_3
            w_3 = tl.load(w_tile + _w_offset(tl.minimum(i + 4, total - 1), pid, G, k_steps, stride_wn,
                                             BLOCK_N, BLOCK_K))
        else:
            w = w_nxt
            w_nxt = tl.load(w_tile + _w_offset(tl.minimum(i + 2, total - 1), pid, G, k_steps, stride_wn,
                                               BLOCK_N, BLOCK_K))
        if ks == k_steps - 1:
            if USE_DOT or ACC2D:
                part = acc
            else:
                part = tl.sum(acc, axis=1)
            offs_n = t * BLOCK_N + offs_bn
            y_mask = m_mask[:, None] & (offs_n < N)[None, :]
            _gemv_epilogue(part, tl.sum(ss, axis=1), b_ptr, y_ptr, offs_m, offs_n, y_mask, N, K, eps, stride_ym,
                           NORM, HAS_BIAS)
            acc = tl.zeros_like(acc)
            ss = tl.zeros_like(ss)


def persistent_fits(n: int, k: int, block_n: int, block_k: int) -> bool:
    """True when the persistent kernel handles an [n, k] weight with these tiles (else the plain kernel runs)."""
    return n % block_n == 0 and k % block_k == 0
