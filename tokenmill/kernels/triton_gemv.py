"""Skinny GEMM for decode (Triton): y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= 16, bf16/fp16, fp32 accumulation.

At decode batch sizes a linear layer is a weight stream: every byte of W is read once and the FLOPs are free. So the
grid is cut to keep every SM busy with wide, in-flight loads of W: programs over N tiles and, when N alone gives too
few programs, over K splits. Split-K needs no second launch and no atomics on the output: each split writes its fp32
partial tile to a workspace, then bumps a per-N-tile arrival counter; the split that arrives last sums the partials,
finishes the epilogue and resets the counter to 0, so the next call (or CUDA-graph replay) finds it clean.

Two inner products, picked per config: `use_dot` stacks the M rows into a 16-row tl.dot (tensor cores, fp32
accumulator; the padding rows cost no memory traffic), otherwise an FMA loop keeps a [M, BLOCK_K, BLOCK_N] fp32
accumulator in registers and reduces over K once at the end, or with `acc2d` reduces every K step into [M, BLOCK_N]
(about half the registers, so more programs per SM).

Optional prologues on x, each saving a launch per layer:
  act="silu_mul"  x is [M, 2K] = [gate | up]; the input is silu(gate) * up, rounded like torch (down_proj).
  norm_weight     RMSNorm of x (or of h = x + residual, rounded to the activation dtype like torch), with the sum
                  written once to residual_out by the programs of the first N tile. The row statistic needs all of
                  K, so the kernel streams x * norm_weight (rounded to the activation dtype) into the product and
                  scales each output row by rsqrt(mean(h^2) + eps) at the end: one pass over x instead of two.
                  fp16 caveat: |h * norm_weight| must stay below 65504 (it is rounded before normalisation).

An optional epilogue, epilogue="silu_mul": W = [gate | up] (2I rows) and the tile's columns alternate gate and up
rows, so each program writes silu(gate) * up for its I-columns (the SiLU-and-mul after gate_up_proj, rounded like
torch), saving the separate SiLU kernel where the next product takes a plain input.

With programmatic dependent launch (tokenmill/kernels/pdl.py) each program loads its first W tile before waiting
on the previous kernel, so that load overlaps the previous kernel's tail; the batch-1 configs of the measured tables
(tokenmill/kernels/configs/) use one deep K tile that holds the program's whole share of W where that measured
fastest. With `prefetch` the second tile is loaded before the wait too and every K step issues the next
tile's load before its own product (two tiles in flight), so a program whose share is two tiles has all of it in
flight before the wait. `xprefetch` does the same for the prologue's loads (x, residual, norm weight), one K step
ahead: without it a dot-path config with a prologue ran 2.5-3x slower than the plain product on the H200.

CUDA-graph safe: no host syncs, the launch configuration depends only on shapes, the workspace is allocated per call
(from the graph pool when capturing), and the counters are one per-device zeroed buffer created on the first eager
call. That buffer assumes split-K launches of this module on one device do not run concurrently on two streams.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels.gemv_config import GemvConfig, default_config, sm_count, table_for
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

MAX_M = 16                    # rows above this go to cuBLAS: the weight is no longer the only cost
_MAX_SPLIT_TILES = 8192       # size of the per-device arrival-counter buffer (N tiles of one split-K launch)
_DTYPES = (torch.bfloat16, torch.float16)
_ACTS = (None, "silu_mul")
# Triton's CPU interpreter (3.9) multiplies bf16 dot operands as their raw 16-bit patterns; it gets fp32 operands
# (exact for bf16/fp16 values) instead. Compiled kernels never take that branch.
_INTERPRETED = envs.TRITON_INTERPRET
# A block-scaled fp8 weight with bf16 activations is dotted in fp16 (F16_DOT): e4m3 widens to fp16 in one
# instruction per pair and to bf16 in four. Each K step scales every x row by a power of two chosen from that row's
# largest value (computed from the data, so the compiler cannot move the scale after the narrowing as it does with a
# literal), which brings the row into [2^14, 2^15): any bf16 value keeps every bit unless it is 2^28 times smaller
# than the row's largest, and nothing overflows. Block scales already multiply every K step's product, so the row
# scale rides along (H100, 8B shape, bs1: 4.35 -> 4.05 ms a token); with one scale per row the per-step row maximum
# cost more than the cheaper widening saved (3.91 -> 4.06 ms), so that path widens to bf16.


# M, N and split_k never decide vector widths (K and k_per_split do), so they do not key separate compiles.
@triton.jit(do_not_specialize=["M", "N", "split_k"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, nw_ptr, res_ptr, res_out_ptr, ws_ptr, cnt_ptr,
    M, N, K, k_per_split, split_k, eps,
    stride_xm, stride_wn, stride_ym, stride_rm, stride_rom,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr = False,
    ACC2D: tl.constexpr = False, OUT_SILU: tl.constexpr = False, XPRE: tl.constexpr = False,
    PDL: tl.constexpr = False, wsc_ptr=0, W_SCALE: tl.constexpr = False,
    bsc_cols=0, BLOCK_SCALE: tl.constexpr = False, BN_SCALE: tl.constexpr = 128, BK_SCALE: tl.constexpr = 128,
    F16_DOT: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    xdt = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    # Rows past N re-read row N-1 instead of being masked, so W loads stay unpredicated; only the store is masked.
    if OUT_SILU:
        # W = [gate | up] (N = 2I rows): tile column c computes gate row c // 2 (even c) or up row I + c // 2.
        n_safe = tl.minimum(offs_n // 2, N // 2 - 1) + (offs_n % 2) * (N // 2)
    else:
        n_safe = tl.minimum(offs_n, N - 1)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # W^T tile [BLOCK_K, BLOCK_N]: K is contiguous in memory, so each thread loads 16-byte runs along K.
    w_ptrs = w_ptr + n_safe.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    ro_rows = res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_rom
    ro_m = tl.where(pid_n == 0, M, 0)          # only the first N tile writes residual_out
    if USE_DOT or ACC2D:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # The first weight tile is loaded before waiting on the previous kernel (PDL): no kernel writes weights, and
    # this load is what overlaps the previous kernel's tail. Every other load and every store comes after the wait.
    w = _load_w_tile(w_ptrs, k_start + offs_k, K, EVEN_K)
    if PREFETCH:
        # The second tile is in flight before the wait too, and every K step issues the next tile's load before
        # its own product: two tiles per program in flight instead of one serial round trip per step. Past the
        # program's last tile the offset is 0, a re-read of the current tile (L2), so the loads stay unmasked.
        step1 = tl.where(k_start + BLOCK_K < k_end, BLOCK_K, 0)
        w_nxt = _load_w_tile(w_ptrs + step1, k_start + step1 + offs_k, K, EVEN_K)
    pdl_wait(PDL)
    xa, xb, xc = _load_x(k_start + offs_k, x_rows, r_rows, nw_ptr, m_mask, K, BLOCK_M, BLOCK_K, SILU_MUL, NORM,
                         HAS_RES, EVEN_K)
    if XPRE:
        # x (and residual / norm weight) one K step ahead too: the prologue's loads are not left to the compiler's
        # pipeliner, which does not take loads whose values are transformed before the product.
        step1x = tl.where(k_start + BLOCK_K < k_end, BLOCK_K, 0)
        na, nb, nc = _load_x(k_start + step1x + offs_k, x_rows, r_rows, nw_ptr, m_mask, K, BLOCK_M, BLOCK_K,
                             SILU_MUL, NORM, HAS_RES, EVEN_K)
    bs = _block_scales(wsc_ptr, n_safe, k_start, bsc_cols, BLOCK_SCALE, BN_SCALE, BK_SCALE)
    acc, ss = _gemv_step(acc, ss, w, k_start + offs_k, xa, xb, xc, ro_rows, m_mask, ro_m, offs_m, K,
                         xdt, BLOCK_M, BLOCK_K, SILU_MUL, NORM, HAS_RES, USE_DOT, EVEN_K, DOT_F32, ACC2D,
                         bs, BLOCK_SCALE, F16_DOT)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        kk = k0 + offs_k
        if PREFETCH:
            w = w_nxt
            step = tl.where(k0 + BLOCK_K < k_end, BLOCK_K, 0)
            w_nxt = _load_w_tile(w_ptrs + step, kk + step, K, EVEN_K)
        else:
            w = _load_w_tile(w_ptrs, kk, K, EVEN_K)
        if XPRE:
            xa, xb, xc = na, nb, nc
            stepx = tl.where(k0 + BLOCK_K < k_end, BLOCK_K, 0)
            na, nb, nc = _load_x(kk + stepx, x_rows, r_rows, nw_ptr, m_mask, K, BLOCK_M, BLOCK_K, SILU_MUL, NORM,
                                 HAS_RES, EVEN_K)
        else:
            xa, xb, xc = _load_x(kk, x_rows, r_rows, nw_ptr, m_mask, K, BLOCK_M, BLOCK_K, SILU_MUL, NORM,
                                 HAS_RES, EVEN_K)
        bs = _block_scales(wsc_ptr, n_safe, k0, bsc_cols, BLOCK_SCALE, BN_SCALE, BK_SCALE)
        acc, ss = _gemv_step(acc, ss, w, kk, xa, xb, xc, ro_rows, m_mask, ro_m, offs_m, K,
                             xdt, BLOCK_M, BLOCK_K, SILU_MUL, NORM, HAS_RES, USE_DOT, EVEN_K, DOT_F32, ACC2D,
                             bs, BLOCK_SCALE, F16_DOT)
    if USE_DOT or ACC2D:
        part = acc
    else:
        part = tl.sum(acc, axis=1)
    ssum = tl.sum(ss, axis=1)
    y_mask = m_mask[:, None] & (offs_n < N)[None, :]
    if not SPLIT:
        if OUT_SILU:
            _gemv_epilogue_silu(part, ssum, b_ptr, y_ptr, offs_m, m_mask, n_safe, pid_n, N, K, eps, stride_ym,
                                BLOCK_M, BLOCK_N, NORM, HAS_BIAS, wsc_ptr, W_SCALE)
        else:
            _gemv_epilogue(part, ssum, b_ptr, y_ptr, offs_m, offs_n, y_mask, N, K, eps, stride_ym, NORM,
                           HAS_BIAS, wsc_ptr, W_SCALE)
    else:
        tile = pid_n * split_k
        tile_elems = BLOCK_M * BLOCK_N
        ws_tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ss_ptr = ws_ptr + tl.cdiv(N, BLOCK_N) * split_k * tile_elems         # [n_tiles, split_k, BLOCK_M]
        tl.store(ws_ptr + (tile + pid_k) * tile_elems + ws_tile, part, mask=m_mask[:, None])
        if NORM:
            tl.store(ss_ptr + (tile + pid_k) * BLOCK_M + offs_m, ssum, mask=m_mask)
        # Every thread's partial store must precede the (single-thread) release of the arrival counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            ss_total = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(split_k):
                # .cg: read from L2, where the other programs' partials are, never from a stale L1 line.
                total += tl.load(ws_ptr + (tile + s) * tile_elems + ws_tile, mask=m_mask[:, None], other=0.0,
                                 cache_modifier=".cg")
                if NORM:
                    ss_total += tl.load(ss_ptr + (tile + s) * BLOCK_M + offs_m, mask=m_mask, other=0.0,
                                        cache_modifier=".cg")
            if OUT_SILU:
                _gemv_epilogue_silu(total, ss_total, b_ptr, y_ptr, offs_m, m_mask, n_safe, pid_n, N, K, eps,
                                    stride_ym, BLOCK_M, BLOCK_N, NORM, HAS_BIAS, wsc_ptr, W_SCALE)
            else:
                _gemv_epilogue(total, ss_total, b_ptr, y_ptr, offs_m, offs_n, y_mask, N, K, eps, stride_ym, NORM,
                               HAS_BIAS, wsc_ptr, W_SCALE)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _block_scales(bsc_ptr, rows, k0, bsc_cols, BLOCK_SCALE: tl.constexpr, BN_SCALE: tl.constexpr,
                  BK_SCALE: tl.constexpr):
    """The scale of each tile column's weight row in the K block holding k0 ([N / BN_SCALE, K / BK_SCALE] row-major
    block scales); 0.0 (unused) without block scales."""
    if BLOCK_SCALE:
        s = tl.load(bsc_ptr + (rows // BN_SCALE) * bsc_cols + k0 // BK_SCALE)
    else:
        s = 0.0
    return s


@triton.jit
def _load_w_tile(w_ptrs, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(kk < K)[:, None], other=0.0)


@triton.jit
def _load_x(kk, x_rows, r_rows, nw_ptr, m_mask, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
            SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """The loads of one step's prologue on x's columns kk: (gate, up) with SILU_MUL, else (x, residual or x) and
    the norm weight (or x again)."""
    if EVEN_K:
        xm = tl.broadcast_to(m_mask[:, None], [BLOCK_M, BLOCK_K])
    else:
        xm = m_mask[:, None] & (kk < K)[None, :]
    a = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
    if SILU_MUL:
        b = tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0)
    elif HAS_RES:
        b = tl.load(r_rows + kk[None, :], mask=xm, other=0.0)
    else:
        b = a
    if NORM:
        c = tl.load(nw_ptr + kk, mask=kk < K, other=0.0)
    else:
        c = kk
    return a, b, c


@triton.jit
def _gemv_step(acc, ss, w, kk, xa, xb, xc, ro_rows, m_mask, ro_m, offs_m, K, xdt,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
               HAS_RES: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
               ACC2D: tl.constexpr, bs=0.0, BLOCK_SCALE: tl.constexpr = False, F16_DOT: tl.constexpr = False):
    """One BLOCK_K step: the prologue on x's columns kk (loaded by _load_x), then acc += x_tile @ w_tile."""
    if SILU_MUL:
        gate = xa.to(tl.float32)
        up = xb.to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate))).to(xdt).to(tl.float32)       # torch rounds silu(gate) first
        xin = (a * up).to(xdt)
    else:
        xin = xa
        if HAS_RES:
            xin = (xin.to(tl.float32) + xb.to(tl.float32)).to(xdt)     # torch adds in the activation dtype
            if EVEN_K:
                xm = tl.broadcast_to(m_mask[:, None], [BLOCK_M, BLOCK_K])
            else:
                xm = m_mask[:, None] & (kk < K)[None, :]
            tl.store(ro_rows + kk[None, :], xin, mask=xm & (offs_m < ro_m)[:, None])
        if NORM:
            xf = xin.to(tl.float32)
            ss += xf * xf
            xin = (xf * xc.to(tl.float32)[None, :]).to(xdt)
    if USE_DOT:
        if BLOCK_SCALE:
            # Each column's scale for this K step's block (the host keeps a step inside one block).
            if F16_DOT:
                xs, inv = _pow2_rows(xin.to(tl.float32))
                if DOT_F32:
                    d = tl.dot(xs.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    d = tl.dot(xs, w.to(tl.float16))
                acc += d * inv[:, None] * bs[None, :]
            else:
                if DOT_F32:
                    d = tl.dot(xin.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    d = tl.dot(xin, w.to(xdt))
                acc += d * bs[None, :]
        elif DOT_F32:
            acc += tl.dot(xin.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xin, w.to(xdt))   # fp8 weights widen exactly to bf16 / fp16
    else:
        prod = xin.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
        if ACC2D:
            acc += tl.sum(prod, axis=1)
        else:
            acc += prod
    return acc, ss


@triton.jit
def _pow2_rows(xf):
    """xf [rows, K] fp32 -> (xf * 2^s as fp16, 2^-s per row), 2^s putting each row's largest |value| in
    [2^14, 2^15); the powers of two are built from exponent bits, so both products are exact."""
    amax = tl.max(tl.abs(xf), axis=1)
    # Biased exponent of the row maximum, clamped so that both powers below stay normal fp32 numbers.
    eb = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)
    scale = ((268 - eb) << 23).to(tl.float32, bitcast=True)       # 2^(141 - eb)
    inv = ((eb - 14) << 23).to(tl.float32, bitcast=True)          # 2^(eb - 141)
    return (xf * scale[:, None]).to(tl.float16), inv


@triton.jit
def _gemv_epilogue(acc, ssum, b_ptr, y_ptr, offs_m, offs_n, y_mask, N, K, eps, stride_ym,
                   NORM: tl.constexpr, HAS_BIAS: tl.constexpr, wsc_ptr, W_SCALE: tl.constexpr):
    if W_SCALE:
        acc = acc * tl.load(wsc_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if NORM:
        acc = acc * tl.math.rsqrt(ssum / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _gemv_epilogue_silu(acc, ssum, b_ptr, y_ptr, offs_m, m_mask, rows, pid_n, N, K, eps, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        wsc_ptr, W_SCALE: tl.constexpr):
    """silu(gate) * up of the interleaved tile (even columns gate, odd up), rounded like the unfused layers: the
    product's gate and up outputs to the activation dtype, then silu(gate), then the product."""
    dt = y_ptr.dtype.element_ty
    if W_SCALE:
        acc = acc * tl.load(wsc_ptr + rows)[None, :]
    if NORM:
        acc = acc * tl.math.rsqrt(ssum / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    a = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :], (a * up).to(dt),
             mask=m_mask[:, None] & (cols < N // 2)[None, :])


# ----------------------------------------------------------------------------------------------------------- host
_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def _counters(device: torch.device, user: str = "gemv") -> torch.Tensor:
    """The zeroed arrival counters of split-K launches on `device`. Kernels that may run at the same time (on two
    streams) need different `user`s; kernels of one stream share a buffer, each leaving it zeroed."""
    buf = _COUNTERS.get((device, user))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A zeros() inside a capture would only run at replay: graphs replayed in another order would start
            # from garbage counters.
            raise RuntimeError(f"split-K counters ({user}): run the kernel once outside CUDA-graph capture "
                               "(warm-up) before capturing a graph that uses it.")
        buf = _COUNTERS[(device, user)] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return buf


def use_gemv(x: torch.Tensor, weight: torch.Tensor, max_m: int = MAX_M) -> bool:
    """True when gemv() handles this product on CUDA: at most max_m rows, matching fp16/bf16 dtypes, a 2-D weight
    with contiguous rows."""
    return (x.is_cuda and weight.is_cuda and x.dtype == weight.dtype and x.dtype in _DTYPES
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.numel() // max(1, x.shape[-1]) <= max_m)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        raise ValueError(f"gemv: `{name}` needs a contiguous last dim")
    return t2


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, act: str | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
         residual_out: torch.Tensor | None = None, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, epilogue: str | None = None,
         weight_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None):
    """F.linear(prologue(x), weight, bias) for a few rows of x.

    x [..., K] (or [..., 2K] with act="silu_mul"), weight [N, K], bias [N] or None; fp16/bf16, x and weight of one
    dtype; at most MAX_M rows is the intended use (more rows work but re-read W per 16 rows). Prologues:
      act="silu_mul": input = silu(x[..., :K]) * x[..., K:].
      norm_weight [K]: input = RMSNorm(h) with h = x (+ residual); eps is the RMSNorm epsilon.
      residual [..., K] (same shape/dtype as x): h = x + residual; h is written to residual_out (allocated when
        None; must not overlap x or residual) and the call returns (y, residual_out).
    Epilogue: epilogue="silu_mul" treats weight as [gate | up] (N = 2I rows) and returns silu(gate) * up, y [..., I]
      (the SiLU-and-mul after gate_up_proj; combines with the norm prologue).
    Returns y [..., N] in x.dtype (written into `out` when given). config overrides the device table's config for
    the shape, or the heuristic (gemv_config.default_config); a per-row fp8 weight takes the table's fp8 entry for
    the shape, or `untuned_fp8_config`.
    weight_scale [N] float32: the weight is float8 e4m3 with one scale per row (W = weight * weight_scale[:, None]),
    widened in registers: the stream is 1 byte per weight. With block = (block_n, block_k), weight_scale is
    [ceil(N / block_n), ceil(K / block_k)] float32, one scale per block (block-wise FP8 checkpoints); block_k must
    be a multiple of 16, and the config's K step is cut to divide it."""
    if act not in _ACTS:
        raise ValueError(f"gemv: unsupported act={act!r}; supported: None, 'silu_mul'")
    if epilogue not in (None, "silu_mul"):
        raise ValueError(f"gemv: unsupported epilogue={epilogue!r}; supported: None, 'silu_mul'")
    if epilogue is not None and act is not None:
        raise ValueError("gemv: epilogue='silu_mul' cannot be combined with act='silu_mul'")
    if act is not None and (norm_weight is not None or residual is not None):
        raise ValueError("gemv: act='silu_mul' cannot be combined with norm_weight or residual")
    if residual_out is not None and residual is None:
        raise ValueError("gemv: residual_out needs residual")
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn or x.dtype not in _DTYPES:
            raise TypeError(f"gemv: weight_scale goes with a float8_e4m3fn weight and fp16/bf16 x, got "
                            f"{weight.dtype} and {x.dtype}")
        want = (weight.shape[0],) if block is None else \
            (triton.cdiv(weight.shape[0], block[0]), triton.cdiv(weight.shape[1], block[1]))
        if weight_scale.shape != want or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
            raise ValueError(f"gemv: weight_scale must be contiguous float32 {want}, got "
                             f"{tuple(weight_scale.shape)} {weight_scale.dtype}")
        if block is not None and (block[0] <= 0 or block[1] <= 0 or block[1] % 16):
            raise ValueError(f"gemv: block must be (block_n, block_k) with block_k a multiple of 16, got {block}")
    elif block is not None:
        raise ValueError("gemv: block goes with a float8 weight_scale")
    elif x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"gemv: x and weight must share dtype float16 or bfloat16, got {x.dtype} and "
                        f"{weight.dtype}")
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"gemv: weight must be 2-D with contiguous rows, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    n, k = weight.shape
    k_in = 2 * k if act == "silu_mul" else k
    if x.shape[-1] != k_in:
        raise ValueError(f"gemv: x has last dim {x.shape[-1]}, expected {k_in} for weight {tuple(weight.shape)}"
                         f"{' with act=silu_mul' if act else ''}")
    lead = x.shape[:-1]
    x2 = _rows(x, "x")
    m = x2.shape[0]
    dev = x.device
    if bias is not None and (bias.shape != (n,) or bias.device != dev):
        raise ValueError(f"gemv: bias must have shape ({n},) on {dev}, got {tuple(bias.shape)} on {bias.device}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.device != dev):
        raise ValueError(f"gemv: norm_weight must have shape ({k},) on {dev}, got {tuple(norm_weight.shape)}")
    if epilogue is not None and n % 2:
        raise ValueError(f"gemv: epilogue='silu_mul' needs an even number of weight rows ([gate | up]), got {n}")
    n_out = n // 2 if epilogue is not None else n
    if out is None:
        out = torch.empty((*lead, n_out), dtype=x.dtype, device=dev)
    elif out.shape != (*lead, n_out) or out.dtype != x.dtype:
        raise ValueError(f"gemv: out must be {tuple((*lead, n_out))} {x.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    y2 = _rows(out, "out")
    if _overlaps(y2, x2):
        raise ValueError("gemv: out must not overlap x (other programs still read x while one writes its tile)")
    r2 = ro2 = x2
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"gemv: residual must match x ({tuple(x.shape)} {x.dtype}), got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        r2 = _rows(residual, "residual")
        if residual_out is None:
            residual_out = torch.empty_like(x)
        elif residual_out.shape != x.shape or residual_out.dtype != x.dtype:
            raise ValueError(f"gemv: residual_out must match x ({tuple(x.shape)} {x.dtype}), got "
                             f"{tuple(residual_out.shape)} {residual_out.dtype}")
        ro2 = _rows(residual_out, "residual_out")
        for other, name in ((x2, "x"), (r2, "residual")):
            if _overlaps(ro2, other):
                # Other N tiles still read their inputs while the first tile writes the sum.
                raise ValueError(f"gemv: residual_out must not overlap {name}")
    if m and n:
        if config is None:
            table = table_for(dev)
            if weight_scale is not None:
                config = (table.prefer(m, n, k, None, "fp8") if block is None else None) or \
                    untuned_fp8_config(m, n, k, dev)
            else:
                config = default_config(m, n, k, sm_count(dev), table)
        if epilogue is not None and config.block_n < 2:
            config = dataclasses.replace(config, block_n=2)
        if block is not None:
            config = _block_scaled(config, block[1], m, n, k, dev)
        _launch(x2, weight, bias, y2, norm_weight, r2, ro2, m, n, k, eps, config, act == "silu_mul",
                residual is not None, epilogue is not None, weight_scale, block)
    if residual is None:
        return out
    return out, residual_out


def untuned_fp8_config(m: int, n: int, k: int, dev: torch.device) -> GemvConfig:
    """A per-row fp8 product's config where the device table has no fp8 entry for it (what `tokenmill bench kernels
    --quantization fp8` measures its entries against): the bf16 product's config with twice the K splits on the
    dot path, since it streams half the bytes per K step (H200, 8B shapes at 1 and 8 rows: 70 -> 53 us for
    gate_up, 33 -> 24 us for down_proj; the FMA path's configs measured no better)."""
    config = default_config(m, n, k, sm_count(dev), table_for(dev))
    return dataclasses.replace(config, split_k=2 * config.split_k) if config.use_dot else config


def _block_scaled(cfg: GemvConfig, block_k: int, m: int, n: int, k: int, dev: torch.device) -> GemvConfig:
    """A config for block scales: the dot path (the scale multiplies each K step's product), with a K step that
    divides block_k so that a step never straddles two scale blocks."""
    if not cfg.use_dot:
        cfg = default_config(m, n, k, sm_count(dev))
    step = cfg.block_k
    while block_k % step:
        step //= 2
    return cfg if step == cfg.block_k else dataclasses.replace(cfg, block_k=step)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (a.shape[0] - 1) * a.stride(0) * a.element_size() + a.shape[1] * a.element_size()
    b1 = b0 + (b.shape[0] - 1) * b.stride(0) * b.element_size() + b.shape[1] * b.element_size()
    return a0 < b1 and b0 < a1


def launch_plan(m: int, n: int, k: int, cfg: GemvConfig) -> tuple[int, int, int, int]:
    """(BLOCK_M, N tiles, K splits actually launched, K per split) for a config."""
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m)
    n_tiles = triton.cdiv(n, cfg.block_n)
    split = min(cfg.split_k, triton.cdiv(k, cfg.block_k))
    if split > 1 and n_tiles > _MAX_SPLIT_TILES:
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    return block_m, n_tiles, triton.cdiv(k, k_per_split), k_per_split


def _launch(x2, weight, bias, y2, norm_weight, r2, ro2, m, n, k, eps, cfg: GemvConfig, silu_mul: bool,
            has_res: bool, out_silu: bool = False, weight_scale: torch.Tensor | None = None,
            block: tuple[int, int] | None = None) -> None:
    block_m, n_tiles, split, k_per_split = launch_plan(m, n, k, cfg)
    if split > 1:
        ws = torch.empty(n_tiles * split * block_m * (cfg.block_n + 1), dtype=torch.float32, device=x2.device)
        cnt = _counters(x2.device)
    else:
        ws = cnt = y2       # unused
    _gemv_kernel[(n_tiles, split)](
        x2, weight, bias if bias is not None else weight, y2,
        norm_weight if norm_weight is not None else weight, r2, ro2, ws, cnt,
        m, n, k, k_per_split, split, eps,
        x2.stride(0), weight.stride(0), y2.stride(0), r2.stride(0), ro2.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
        SILU_MUL=silu_mul, NORM=norm_weight is not None, HAS_RES=has_res, HAS_BIAS=bias is not None,
        USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0, DOT_F32=_INTERPRETED, PREFETCH=cfg.prefetch,
        ACC2D=cfg.acc2d, OUT_SILU=out_silu, XPRE=cfg.xprefetch,
        wsc_ptr=weight_scale if weight_scale is not None else y2, W_SCALE=weight_scale is not None and block is None,
        bsc_cols=weight_scale.shape[1] if block is not None else 0, BLOCK_SCALE=block is not None,
        BN_SCALE=block[0] if block is not None else 128, BK_SCALE=block[1] if block is not None else 128,
        F16_DOT=block is not None and x2.dtype == torch.bfloat16 and cfg.use_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(x2.device, "gemv"),
    )
