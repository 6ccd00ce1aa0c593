"""Decode-sized products (16 rows or fewer; 4-bit up to MAX_TILE_M) with packed integer weights: a streaming GEMV.

The weight layout is `int_matmul`'s (kernels/triton_quant_matmul.py): int32 words [K * bits / 32, N] packed along
K (value j of a word in bits j*bits ..), a scale and a zero point per (group, output column), w = (q - z) * s, or
w = q * s + m with float offsets (GGUF blocks). At a few rows the cost is the weight bytes, so each program loads
every word of its tile exactly once, coalesced along N, and unpacks the PACK values of a word in registers by
shifts (int_matmul's tile instead has each word loaded by the PACK rows that share it). When a K step lies inside
one quantization group (group 128, no act-order) the scale and zero point are one row per step; otherwise they
are gathered per input (act-order `g_idx`, small groups). One row with such steps takes a register-FMA kernel (no
tensor-core tile): `_int4_gemv_row_kernel` for 4-bit codes and 16-bit x, `_int_gemv_row_kernel` otherwise; more
rows take `_int_gemv_kernel` (a tl.dot tile of 16 rows; past 16 rows, for 4-bit codes, a program per 32- or 64-row
tile, which beats dequantizing W for cuBLAS up to MAX_TILE_M rows).

K is split across programs when the N tiles alone leave SMs idle; each split writes an fp32 partial product and
one sum in a fixed order adds them (deterministic: seeded sampling stays reproducible): in the row kernels the last
split of an N tile to arrive sums them (no second launch), after the tile kernel a torch sum. The row kernels launch
with programmatic dependent launch (kernels/pdl.py): their first word tile is loaded before waiting on the previous
kernel. Whole N tiles keep the columns unclamped, so the words arrive in 16-byte loads.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

MAX_M = 16
# Rows up to which 4-bit magic tiles (no dequantized copy of W) beat dequantize + cuBLAS: an H100 sweep of the 8B
# products measured them 1.2-2x faster at 32 and 64 rows and up to 1.4x slower at 128 (the tiles' tl.dot then runs
# far from the tensor cores' peak, and each row tile unpacks W again).
MAX_TILE_M = 64
# The CPU interpreter multiplies bf16 dot operands as raw bit patterns (see triton_gemv): it gets fp32 operands.
_INTERPRETED = envs.TRITON_INTERPRET
# x dtype -> (the 16-bit pattern a 4-bit code is OR-ed into, the value it encodes)
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@dataclasses.dataclass(frozen=True)
class IntGemvConfig:
    """One launch: N tile, K step (a multiple of the words' PACK values), number of K splits, warps, stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    magic: bool = True      # 4-bit codes as float bit patterns where the K step lies in one group (see the kernel)
    row_kernel: bool = True  # one row, K steps inside one group: a register-FMA kernel (not the tl.dot tile)
    nibble_words: bool = True  # there, 4-bit codes and 16-bit x: _int4_gemv_row_kernel (else _int_gemv_row_kernel)
    prefetch: bool = False  # _int4_gemv_row_kernel: the next K step's words in flight during each step's math
    block_m: int = 16       # the tl.dot tile's rows (more rows: a program per row tile)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _int_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_ym, GROUP, k_per_split,
                     BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, FLOAT_ZERO: tl.constexpr,
                     GROUP_STEP: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MAGIC: tl.constexpr = 0, OFFSET: tl.constexpr = 0.0, EVEN_N: tl.constexpr = False):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WROWS: tl.constexpr = BLOCK_K // PACK
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_safe = _safe_cols(rn, N, EVEN_N)      # only the store is masked along N
    rw = tl.arange(0, WROWS)
    shifts = tl.arange(0, PACK) * BITS
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xdt = x_ptr.dtype.element_ty
    for k0 in range(k_lo, k_hi, BLOCK_K):
        wrow = k0 // PACK + rw
        words = tl.load(q_ptr + wrow[:, None] * N + n_safe[None, :], mask=(wrow < K // PACK)[:, None], other=0)
        qi = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if GROUP_STEP:
            # The step lies inside one group: one scale / zero row for the tile.
            g = k0 // GROUP
            s = tl.load(s_ptr + g * N + n_safe).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + n_safe).to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + rk, mask=k_ok, other=0)
            else:
                g = tl.minimum(rk, K - 1) // GROUP
            s = tl.load(s_ptr + g[:, None] * N + n_safe[None, :]).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * N + n_safe[None, :]).to(tl.float32)
        if MAGIC:
            # A 4-bit code OR-ed into the bits of a 16-bit float is that float plus the code (bf16 0x4300 = 128,
            # fp16 0x6400 = 1024; both hold OFFSET + q exactly), so the tile needs no conversion instructions. The
            # step's one scale and zero point apply after the product, in fp32:
            # sum_k x (q - z) s = s (x . (OFFSET + q) - (OFFSET + z) sum_k x).
            qb = (qi | MAGIC).to(tl.int16).to(xdt, bitcast=True)
            if DOT_F32:
                p = tl.dot(x.to(tl.float32), qb.to(tl.float32), input_precision="ieee")
            else:
                p = tl.dot(x, qb)
            xs = tl.sum(x.to(tl.float32), axis=1)[:, None]
            if FLOAT_ZERO:
                acc += (p - OFFSET * xs) * s + xs * z
            else:
                acc += (p - (OFFSET + z) * xs) * s
        else:
            q = qi.to(tl.float32)
            if FLOAT_ZERO:
                w = q * s + z
            else:
                w = (q - z) * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w.to(xdt).to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(xdt), input_precision="ieee")
    if SPLIT:
        y_ptr += pid_k.to(tl.int64) * M * stride_ym
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["k_per_split", "split_k"])
def _int_gemv_row_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, GROUP, k_per_split, split_k,
                         BITS: tl.constexpr, FLOAT_ZERO: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr = False,
                         PDL: tl.constexpr = 0):
    """One row of x, every K step inside one group: no tensor-core tile (whose 16-row minimum wastes 15 rows and
    whose operand layouts cost shared-memory shuffles), only register math per weight: shift, mask-and-OR the code
    into the bits of the float 2^23 + q, subtract 2^23 (exact), one FMA into a [K step / PACK, BLOCK_N] accumulator
    of this step's group; the group's scale multiplies it once per step, its zero point enters through sum(x)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WROWS: tl.constexpr = BLOCK_K // PACK
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_safe = _safe_cols(rn, N, EVEN_N)
    rw = tl.arange(0, WROWS)
    rj = tl.arange(0, PACK)
    shifts = rj * BITS
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((WROWS, BLOCK_N), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    pdl_wait(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        wrow = k0 // PACK + rw
        words = tl.load(q_ptr + wrow[:, None] * N + n_safe[None, :], mask=(wrow < K // PACK)[:, None], other=0)
        kk = k0 + rw[:, None] * PACK + rj[None, :]
        xk = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)                  # [WROWS, PACK]
        q = ((words[:, None, :] >> shifts[None, :, None]) & MASK) | 0x4B000000           # [WROWS, PACK, BLOCK_N]
        qf = q.to(tl.float32, bitcast=True) - 8388608.0
        part = tl.sum(qf * xk[:, :, None], axis=1)                                       # [WROWS, BLOCK_N]
        acc, acc_z = _group_step(acc, acc_z, part, tl.sum(tl.sum(xk, axis=1), axis=0), s_ptr, z_ptr,
                                 k0 // GROUP, N, n_safe, FLOAT_ZERO)
    _row_store(acc, acc_z, y_ptr, ws_ptr, cnt_ptr, rn, N, pid_n, pid_k, split_k, SPLIT, BLOCK_N)


@triton.jit
def _safe_cols(rn, N, EVEN_N: tl.constexpr):
    """The tile's columns for loads: past N they re-read column N - 1 (loads stay unpredicated along N). With N a
    multiple of the tile the columns stay as they are: the compiler then knows each thread's run of columns is
    contiguous and aligned (N is specialized on divisibility) and loads 16 bytes at a time instead of 4."""
    if EVEN_N:
        return rn
    else:
        return tl.minimum(rn, N - 1)


@triton.jit
def _group_step(acc, acc_z, part, xs, s_ptr, z_ptr, g, N, n_safe, FLOAT_ZERO: tl.constexpr):
    """A row kernel's K step inside group g: its codes' products `part` [rows, BLOCK_N] scaled by the group's scale
    into acc; the zero point (or float offset) times sum(x) = xs into acc_z."""
    s = tl.load(s_ptr + g * N + n_safe).to(tl.float32)
    z = tl.load(z_ptr + g * N + n_safe).to(tl.float32)
    acc += part * s[None, :]
    if FLOAT_ZERO:
        acc_z -= z * xs
    else:
        acc_z += z * s * xs
    return acc, acc_z


@triton.jit
def _row_store(acc, acc_z, y_ptr, ws_ptr, cnt_ptr, rn, N, pid_n, pid_k, split_k, SPLIT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The row's output tile in y's dtype. Under a K split each program writes its fp32 partial to the workspace
    and bumps its N tile's arrival counter; the last to arrive sums the partials in split order (deterministic),
    stores y and resets the counter for the next call or graph replay (triton_gemv's scheme, its counters)."""
    y = tl.sum(acc, axis=0) - acc_z
    if SPLIT:
        offs = tl.arange(0, BLOCK_N)
        tile = pid_n * split_k
        tl.store(ws_ptr + (tile + pid_k) * BLOCK_N + offs, y)
        # Every thread's partial store must precede the (single-thread) release of the arrival counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(split_k):
                # .cg: the other programs' partials are in L2; an L1 line could be stale.
                total += tl.load(ws_ptr + (tile + s) * BLOCK_N + offs, cache_modifier=".cg")
            tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=rn < N)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _nibbles(w, x_lo, x_hi):
    """The two 4-bit codes at bits 15-18 and 19-22 of `w` (the top of a float's mantissa) times their inputs, each
    code as mantissa bits: (w & 0x78000) | 1.0f is 1 + q / 256 exactly (0x780000: 1 + q / 16), so one AND-OR per
    code widens it and the FMA with x * 256 (x * 16) is exact for 16-bit x (at most 9 + 11 significant bits); the
    leading 1's share, x * 256 + x * 16, is the caller's to subtract."""
    f_lo = ((w & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True)
    f_hi = ((w & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
    return f_lo * x_lo[:, None] + f_hi * x_hi[:, None]


@triton.jit
def _int4_step(acc, acc_z, w, x_ptr, k0, rw, ok, s_ptr, z_ptr, GROUP, N, n_safe, FLOAT_ZERO: tl.constexpr):
    """One K step of `_int4_gemv_row_kernel` on its loaded word tile w [BLOCK_K / 8, BLOCK_N]."""
    xp = x_ptr + k0 + rw * 8
    x0 = tl.load(xp + 0, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(xp + 1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xp + 2, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(xp + 3, mask=ok, other=0.0).to(tl.float32)
    x4 = tl.load(xp + 4, mask=ok, other=0.0).to(tl.float32)
    x5 = tl.load(xp + 5, mask=ok, other=0.0).to(tl.float32)
    x6 = tl.load(xp + 6, mask=ok, other=0.0).to(tl.float32)
    x7 = tl.load(xp + 7, mask=ok, other=0.0).to(tl.float32)
    # code j sits at bits 4j..4j+3: codes 2i and 2i+1 reach bits 15-22 by a shift of 15 - 8i (the sign bits an
    # arithmetic >> brings in are masked off)
    part = _nibbles(w << 15, x0 * 256.0, x1 * 16.0) + _nibbles(w << 7, x2 * 256.0, x3 * 16.0) \
        + _nibbles(w >> 1, x4 * 256.0, x5 * 16.0) + _nibbles(w >> 9, x6 * 256.0, x7 * 16.0)
    lead = (x0 + x2 + x4 + x6) * 256.0 + (x1 + x3 + x5 + x7) * 16.0
    xs = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=0)
    return _group_step(acc, acc_z, part - lead[:, None], xs, s_ptr, z_ptr, k0 // GROUP, N, n_safe, FLOAT_ZERO)


@triton.jit(do_not_specialize=["k_per_split", "split_k"])
def _int4_gemv_row_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, GROUP, k_per_split, split_k,
                          FLOAT_ZERO: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = False, EVEN_N: tl.constexpr = False,
                          PDL: tl.constexpr = 0):
    """One row of 16-bit x, 4-bit codes, every K step inside one group. `_int_gemv_row_kernel` spends a shift, an
    AND, an OR, a subtract and an FMA on each code; here a word is shifted four times (<< 15, << 7, >> 1, >> 9) so
    that each of its eight codes lies at bits 15-18 or 19-22 of one of the four, and a code then costs one AND-OR
    and one FMA (`_nibbles`). Each word row's leading-1 share is subtracted once per step: it is the same for every
    column, and at most 2^8 times a product, so the fp32 sums keep ~16 bits of each product.
    The first word tile (with PREFETCH the second too, and then each step's next) is loaded before the PDL wait:
    weights are never written by a kernel of the step."""
    WROWS: tl.constexpr = BLOCK_K // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_safe = _safe_cols(rn, N, EVEN_N)
    rw = tl.arange(0, WROWS)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = q_ptr + (k_lo // 8 + rw)[:, None] * N + n_safe[None, :]
    ok = k_lo // 8 + rw < K // 8
    w = tl.load(w_ptrs, mask=ok[:, None], other=0)
    if PREFETCH:
        # Past the program's last step the offset is 0: a re-read of the current tile (L2), the loads stay simple.
        step1 = tl.where(k_lo + BLOCK_K < k_hi, BLOCK_K // 8, 0)
        w_nxt = tl.load(w_ptrs + step1 * N, mask=(k_lo // 8 + step1 + rw < K // 8)[:, None], other=0)
    pdl_wait(PDL)
    acc = tl.zeros((WROWS, BLOCK_N), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc, acc_z = _int4_step(acc, acc_z, w, x_ptr, k_lo, rw, ok, s_ptr, z_ptr, GROUP, N, n_safe, FLOAT_ZERO)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w_ptrs += (BLOCK_K // 8) * N
        ok = k0 // 8 + rw < K // 8
        if PREFETCH:
            w = w_nxt
            step = tl.where(k0 + BLOCK_K < k_hi, BLOCK_K // 8, 0)
            w_nxt = tl.load(w_ptrs + step * N, mask=(k0 // 8 + step + rw < K // 8)[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=ok[:, None], other=0)
        acc, acc_z = _int4_step(acc, acc_z, w, x_ptr, k0, rw, ok, s_ptr, z_ptr, GROUP, N, n_safe, FLOAT_ZERO)
    _row_store(acc, acc_z, y_ptr, ws_ptr, cnt_ptr, rn, N, pid_n, pid_k, split_k, SPLIT, BLOCK_N)


def default_config(m: int, n: int, k: int, bits: int, num_sms: int, row_kernel: bool = True) -> IntGemvConfig:
    """128-deep K steps. One row (the row kernels), from a sweep of the 8B products on an H100 (132 SMs): a product
    with fewer 128-wide N tiles than SMs (q/k/v, o, down) runs fastest as 256-wide tiles split over K to about two
    programs per SM; a wide one (gate/up, 224 tiles) as 64-wide tiles split to about eight programs per SM, each a
    longer run of K steps. Up to 16 rows (the tl.dot tile kernel): 128-wide tiles split to about four programs per
    SM (each split at least two K steps), the best of a sweep at 1 and 8 rows on an H200. More rows (4-bit magic
    tiles up to MAX_TILE_M): 32- or 64-row tiles, 128 wide, split to about two programs per SM only where the tiles
    number fewer than the SMs (an H100 sweep of the 8B products at 32 and 64 rows). One row that a row kernel
    cannot take (`row_kernel` False: small groups, act-order) is tiled as more rows are (a 256-wide fp32 tile
    overflows shared memory)."""
    block_k = 128
    if m > MAX_M:
        block_m = 32 if m <= 32 else 64
        tiles = triton.cdiv(n, 128) * triton.cdiv(m, block_m)
        split = max(1, min(triton.cdiv(2 * num_sms, tiles), k // (2 * block_k))) if tiles < num_sms else 1
        return IntGemvConfig(block_m=block_m, block_n=128, block_k=block_k, split_k=split)
    if m == 1 and row_kernel:
        wide = triton.cdiv(n, 128) >= num_sms
        block_n, programs = (64, 8 * num_sms) if wide else (256, 2 * num_sms)
    else:
        block_n, programs = 128, 4 * num_sms
    n_tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(programs, n_tiles), k // (2 * block_k)))
    return IntGemvConfig(block_n=block_n, block_k=block_k, split_k=split)


def magic_tile_rows(dtype: torch.dtype, bits: int, group_size: int, g_idx: torch.Tensor | None) -> int:
    """The most rows `int_gemv` takes for these weights on a GPU: MAX_TILE_M where 4-bit codes enter the tl.dot as
    16-bit float bit patterns (x bf16 / fp16, whole 128-deep steps per group, no act-order), else MAX_M."""
    if bits == 4 and dtype in _MAGIC and g_idx is None and group_size % 128 == 0:
        return MAX_TILE_M
    return MAX_M


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
             group_size: int, g_idx: torch.Tensor | None = None,
             config: IntGemvConfig | None = None) -> torch.Tensor:
    """`int_matmul`'s product (same arguments and layout), in x's dtype; meant for at most `magic_tile_rows` rows
    (more work, re-reading W per row tile)."""
    n = qweight.shape[1]
    pack = 32 // bits
    k = qweight.shape[0] * pack
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if config is None:
        from tokenmill.kernels.gemv_config import sm_count
        config = default_config(m, n, k, bits, sm_count(x.device), g_idx is None and group_size % 128 == 0)
    bk = config.block_k
    if bk % pack or bk & (bk - 1) or bk < 16:
        raise ValueError(f"int_gemv: block_k={bk} must be a power of two >= 16 and a multiple of {pack}")
    split = max(1, min(config.split_k, triton.cdiv(k, bk)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    group_step = g_idx is None and group_size % bk == 0
    if m == 1 and group_step and config.row_kernel:
        return _row_launch(x, x2, qweight, scales, zeros, bits, group_size, n, k, bk, split, k_per_split, config)
    y = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    magic, offset = (_MAGIC.get(x.dtype, (0, 0.0)) if bits == 4 and group_step and config.magic else (0, 0.0))
    _int_gemv_kernel[(triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))](
        x2, qweight, scales, zeros, g_idx if g_idx is not None else qweight, y, m, n, k, x2.stride(0),
        y.stride(-2), group_size, k_per_split, BITS=bits, HAS_G_IDX=g_idx is not None,
        FLOAT_ZERO=zeros.is_floating_point(), GROUP_STEP=group_step, SPLIT=split > 1, DOT_F32=_INTERPRETED,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=bk, MAGIC=magic, OFFSET=offset,
        EVEN_N=n % config.block_n == 0, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        y = y.sum(0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _row_launch(x, x2, qweight, scales, zeros, bits, group_size, n, k, bk, split, k_per_split,
                config: IntGemvConfig) -> torch.Tensor:
    """One row through a row kernel: y in x's dtype straight from the kernel (a K split reduces in-kernel)."""
    from tokenmill.kernels.triton_gemv import _MAX_SPLIT_TILES, _counters
    n_tiles = triton.cdiv(n, config.block_n)
    if split > 1 and n_tiles > _MAX_SPLIT_TILES:
        split, k_per_split = 1, triton.cdiv(k, bk) * bk
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if split > 1:
        ws, cnt = torch.empty(n_tiles * split * config.block_n, dtype=torch.float32, device=x.device), \
            _counters(x.device)
    else:
        ws = cnt = y        # unused
    common = dict(SPLIT=split > 1, BLOCK_N=config.block_n, BLOCK_K=bk, EVEN_N=n % config.block_n == 0,
                  num_warps=config.num_warps,
                  num_stages=config.num_stages, **launch_kwargs(x.device, "gemv"))
    args = (x2, qweight, scales, zeros, y, ws, cnt, n, k, group_size, k_per_split, split)
    if bits == 4 and x.dtype in _MAGIC and config.nibble_words:
        _int4_gemv_row_kernel[(n_tiles, split)](*args, FLOAT_ZERO=zeros.is_floating_point(),
                                                PREFETCH=config.prefetch, **common)
    else:
        _int_gemv_row_kernel[(n_tiles, split)](*args, BITS=bits, FLOAT_ZERO=zeros.is_floating_point(), **common)
    return y.reshape(*x.shape[:-1], n)
