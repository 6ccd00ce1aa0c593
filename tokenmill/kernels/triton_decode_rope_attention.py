"""Decode attention straight from the qkv projection (Triton): per-head RMSNorm (optional) and RoPE of q and of the
step's new k, the new k/v stored into the paged cache, and split-K attention, in one stage-1 launch.

Why: at decode batch 1 every kernel boundary costs a launch gap and a dependent memory round trip (see
kernels/pdl.py), and the separate norm/rope/store kernel (kernels/triton_qk_norm_rope_store.py) is one of the short
kernels per layer. Here each stage-1 program (request, kv head, split) rotates its own G query heads from the qkv
row; the program whose split holds the newest position also rotates that kv head's new k, stores k and v into the
cache, and then (after a CTA barrier, which orders its own global writes before its reads) attends over its split
like kernels/triton_decode_attention.py, the new key included. Stage 2 (the merge of splits) is that module's.

A sliding window W (window > 0) limits every row to keys [max(seq_len - W, 0), seq_len), which the splits divide
(as kernels/triton_decode_attention.py); logit soft-capping is not taken here (the backend keeps the separate path).

Only pure decode steps (every row query_len 1, or CUDA-graph padding with seq_len 0 and a negative slot) take this
path; prefill and mixed batches keep the separate store kernel. Rounding follows the separate kernel (RMSNorm as
tokenmill/layers/layernorm.py, RoPE products and sums rounded to the activation dtype); the norm's sum of squares
is summed in another order, so values may differ from it in the last bit of the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait
from tokenmill.kernels.triton_decode_attention import (_LOG2E, _decode_stage2_kernel, _splits_p2, decode_config,
                                                       row_meta, split_len_of, store_stage1, window_lo)
from tokenmill.kernels.triton_prefill_attention import softmax_tile
from tokenmill.kernels.triton_qk_norm_rope_store import check_rope_args


@triton.jit
def _rope_operands(c_row, s_row, w_ptr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, HALF: tl.constexpr,
                   IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
    """What rotating a head at one position needs besides the head itself, none of it written by the forward
    (load it before the PDL wait): the partner index of each dim, cos / sin per dim (rounded to the activation
    dtype like the torch rotary), the norm weight per dim and at the partner dim, and the rotate/first-half masks."""
    dt = w_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_P2)
    rot = d < 2 * HALF
    if IS_NEOX:
        first = d < HALF
        pd = tl.where(first, d + HALF, d - HALF)
        ci = tl.where(first, d, d - HALF)
    else:
        first = (d % 2) == 0
        pd = tl.where(first, d + 1, d - 1)
        ci = d // 2
    pd = tl.where(rot, pd, d)
    ci = tl.where(rot, ci, 0)
    c = tl.load(c_row + ci, mask=rot, other=0.0).to(dt).to(tl.float32)
    s = tl.load(s_row + ci, mask=rot, other=0.0).to(dt).to(tl.float32)
    if HAS_NORM:
        w = tl.load(w_ptr + d, mask=d < HEAD, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + pd, mask=d < HEAD, other=0.0).to(tl.float32)
    else:
        w = c
        wp = c
    return pd, c, s, w, wp, rot, first


@triton.jit
def _norm_rope_tile(row_ptr, heads, h_mask, pd, c, s, w, wp, rot, first, eps,
                    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads [R] of one token (row_ptr + head * HEAD + d) normalised and rotated (operands from _rope_operands),
    as an [R, HEAD_P2] tile in the activation dtype; dims past the rotary ones pass through (normalised)."""
    dt = row_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_P2)
    base = row_ptr + heads[:, None] * HEAD
    m = h_mask[:, None] & (d < HEAD)[None, :]
    x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(base + pd[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD + eps)[:, None]
        x = (w[None, :] * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp[None, :] * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    a = (x * c[None, :]).to(dt).to(tl.float32)
    b = (xp * s[None, :]).to(dt).to(tl.float32)
    out = tl.where(first[None, :], a - b, a + b)
    return tl.where(rot[None, :], out, x).to(dt)


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, pos, k_mask, d, d_mask, stride_cb, stride_cs,
             BLOCK_SIZE: tl.constexpr):
    """K^T [HEAD_P2, BLOCK_N] and V [BLOCK_N, HEAD_P2] of cache positions `pos` (masked keys read as 0)."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
    row_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head_off
    kt = tl.load(k_cache_ptr + row_off[None, :] + d[:, None], mask=k_mask[None, :] & d_mask[:, None], other=0.0)
    vv = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0)
    return kt, vv


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_rope_stage1_kernel(
    qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    qk_scale, eps, num_splits, window,
    stride_qkv, stride_ot, stride_oh, stride_cos, stride_sin,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_mb, stride_mh, stride_ms,
    HQ: tl.constexpr, HKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait: everything that no kernel of this forward writes. That is the step metadata, the RoPE
    # table and norm weights, and the cached K/V of the older positions (stored by earlier steps; a pure decode
    # step writes only each row's newest slot), so the split's first K/V tile is in flight under the qkv product.
    q_start, q_len, seq_len = row_meta(qsl_ptr, seq_lens_ptr, b)
    tok = q_start.to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    lo = window_lo(seq_len, window)
    split_len = split_len_of(seq_len - lo, num_splits, BLOCK_N)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    old_end = tl.minimum(end, seq_len - 1)             # cached keys of this split; the newest key comes from qkv
    has_new = (start <= seq_len - 1) & (seq_len - 1 < end)
    # Nothing to do (not a decode row, or a split past the context, which stage 2 does not read): leave before the
    # PDL wait, freeing the SM slot at once.
    if q_len != 1:
        return
    if not DIRECT:
        if start >= seq_len:
            return
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    bt_row = block_table_ptr + b * stride_bt
    kv_off = kvh * stride_ch
    pos0 = start + tl.arange(0, BLOCK_N)
    m0 = pos0 < old_end
    kt0, vv0 = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_off, pos0, m0, d, d_mask, stride_cb, stride_cs,
                        BLOCK_SIZE)
    pd, c, s, qw, qwp, rot, first = _rope_operands(cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, qw_ptr,
                                                   HEAD, HEAD_P2, HALF, IS_NEOX, HAS_NORM)
    pdl_wait(PDL)
    row = qkv_ptr + tok * stride_qkv
    g = tl.arange(0, BLOCK_G)
    head = kvh * G + g
    g_mask = g < G
    q = _norm_rope_tile(row, head, g_mask, pd, c, s, qw, qwp, rot, first, eps, HEAD, HEAD_P2, HAS_NORM)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_P2], dtype=tl.float32)
    acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, kt0, vv0, m0[None, :], qk_scale, True, IEEE)
    for start_n in range(start + BLOCK_N, old_end, BLOCK_N):
        pn = start_n + tl.arange(0, BLOCK_N)
        mn = pn < old_end
        kt, vv = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_off, pn, mn, d, d_mask, stride_cb, stride_cs,
                          BLOCK_SIZE)
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, kt, vv, mn[None, :], qk_scale, True, IEEE)
    if has_new:
        # The newest key straight from qkv: rotate it, add it to the softmax, and store k / v for later steps.
        kh = kvh + tl.arange(0, 1)
        _, _, _, kw, kwp, _, _ = _rope_operands(cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, kw_ptr,
                                                HEAD, HEAD_P2, HALF, IS_NEOX, HAS_NORM)
        k_new = _norm_rope_tile(row + HQ * HEAD, kh, kh < HKV, pd, c, s, kw, kwp, rot, first, eps,
                                HEAD, HEAD_P2, HAS_NORM)
        v_new = tl.load(row + (HQ + HKV) * HEAD + kh[:, None] * HEAD + d[None, :], mask=d_mask[None, :],
                        other=0.0)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale           # [BLOCK_G]
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
        m_i = m_new
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_off + d[None, :]
            tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty), mask=d_mask[None, :])
            tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=d_mask[None, :])
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_stage1(o, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, tok, b, split, head, g_mask, d, d_mask,
                 stride_ot, stride_oh, stride_mb, stride_mh, stride_ms, HEAD_P2, DIRECT)


def decode_rope_attention(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_cache: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                          num_heads: int, num_kv_heads: int, head_dim: int, scale: float, num_splits: int,
                          rotary_dim: int | None = None, is_neox: bool = True,
                          q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-6, num_tokens: int | None = None,
                          sliding_window: int | None = None) -> torch.Tensor:
    """Attention output [T, Hq * D] of a pure decode step from qkv [>= T, (Hq + 2 * Hkv) * D], storing the step's
    k/v into kv_cache [2, num_blocks, block_size, Hkv, D] (same dtype as qkv) at slot_mapping (negative: skipped).
    Row b of seq_lens / block_table owns token query_start_loc[b]; every row must have query_len 1, or 0 / 1 with
    seq_len 0 (padding, output zeros). sliding_window W: the query at p sees keys (p - W, p]. Other arguments as qk_norm_rope_store and decode_attention take them."""
    rotary_dim = check_rope_args("decode_rope_attention", qkv, kv_cache, cos_cache, sin_cache, num_heads,
                                 num_kv_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight)
    if kv_cache.dtype != qkv.dtype:
        raise ValueError(f"decode_rope_attention: kv_cache must have qkv's dtype {qkv.dtype}, got {kv_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"decode_rope_attention: {num_heads} q heads do not group over {num_kv_heads} kv heads")
    t = qkv.shape[0] if num_tokens is None else num_tokens
    num_rows = seq_lens.shape[0]
    out = torch.empty((t, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_rows == 0 or t == 0:
        return out
    g = num_heads // num_kv_heads
    block_n, num_warps, num_stages = decode_config(head_dim, g, qkv.dtype, num_rows)
    if head_dim > 64:
        # At D=128 four warps spill ~112 bytes per thread on sm_90 (the first K/V tile is held across the wait);
        # eight hold it in registers: 1.3% faster in Llama-3-8B's batch-1 decode graph on an H200, 7.4% in
        # Qwen3-0.6B's.
        num_warps = max(num_warps, 8)
    head_p2 = triton.next_power_of_2(head_dim)
    direct = num_splits == 1
    out3 = out.view(t, num_heads, head_dim)
    if direct:
        mid_o = mid_lse = out
        sm = (0, 0, 0)
    else:
        mid_o = torch.empty((num_rows, num_heads, num_splits, head_p2), dtype=torch.float32, device=qkv.device)
        mid_lse = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=qkv.device)
        sm = mid_o.stride()[:3]
    kc, vc = kv_cache[0], kv_cache[1]
    pdl = launch_kwargs(qkv.device, "attention")
    _decode_rope_stage1_kernel[(num_rows, num_kv_heads, num_splits)](
        qkv, positions, slot_mapping, cos_cache, sin_cache,
        q_norm_weight if q_norm_weight is not None else qkv, k_norm_weight if k_norm_weight is not None else qkv,
        kc, vc, block_table, query_start_loc, seq_lens, mid_o, mid_lse, out3,
        scale * _LOG2E, eps, num_splits, sliding_window or 0,
        qkv.stride(0), out3.stride(0), out3.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        block_table.stride(0),
        sm[0], sm[1], sm[2],
        HQ=num_heads, HKV=num_kv_heads, BLOCK_SIZE=kc.shape[1], G=g, BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_N=block_n, HEAD=head_dim, HEAD_P2=head_p2, HALF=rotary_dim // 2, IS_NEOX=is_neox,
        HAS_NORM=q_norm_weight is not None, DIRECT=direct, IEEE=qkv.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if not direct:
        _decode_stage2_kernel[(num_rows, num_heads)](
            mid_o, mid_lse, out3, query_start_loc, seq_lens, num_splits, sliding_window or 0,
            out3.stride(0), out3.stride(1), sm[0], sm[1], sm[2],
            BLOCK_N=block_n, HEAD=head_dim, HEAD_P2=head_p2, SPLITS_P2=_splits_p2(num_splits),
            num_warps=num_warps, **pdl,
        )
    return out
