"""Decode attention straight from the qkv projection, for pure-decode steps (Triton): one launch replaces
qk_norm_rope_store + decode stage 1.

Why it pays: with programmatic dependent launch (tokenmill/kernels/pdl.py) a kernel boundary costs little; what a
batch-1 layer waits on is each kernel's chain of dependent memory round trips after its PDL wait. So everything that
does not depend on the previous kernel is read before the wait: the step metadata (seq_len, position, slot), the
RoPE table and the block-table entries of the program's first K/V tile. After the wait the loads of that tile and of
the row of qkv go out together (one round trip); every program normalises (Qwen3's per-head q_norm / k_norm, optional)
and rotates its G query heads and its kv head's new k in one tile (row G is k), and patches the new k and v into its
tiles from registers (the tiles may hold the slot's stale bytes); the program whose split holds the new token also
stores them into the cache. Then flash-decoding as in
triton_decode_attention: a normalised partial output and log-sum-exp per split, merged by that module's stage 2
(a separate launch measured faster than a merge by the last-arriving split, whose fence and atomic add round trips).

Rounding matches the kernels it replaces (q/k as qk_norm_rope_store, attention as decode stage 1), so results agree
with the unfused path to fp32 reassociation of the RMSNorm sums. Every row of the batch must have query_len 1 (row b's
token is b; CUDA-graph padding rows have seq_len 0 and give zeros). 16-bit caches of qkv's dtype only.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, wait_then_release
from tokenmill.kernels.triton_decode_attention import _LOG2E, decode_config, merge_splits, split_buffers
from tokenmill.kernels.triton_qk_norm_rope_store import norm_rope_tile, rope_cos_sin, rope_partner


@dataclasses.dataclass(frozen=True)
class QkvRope:
    """What decode_attention_qkv needs besides the attention inputs: positions and slot_mapping [>= B] (token b of
    the step goes to slot slot_mapping[b]; negative: not stored); RotaryEmbedding's cos/sin caches
    [max_pos, rotary_dim / 2]; optional per-head RMSNorm weights [D] of q and k with their eps."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    rotary_dim: int
    is_neox: bool = True
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@triton.jit
def _kv_rows(bt_row_ptr, kv_head_off, offs, end, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [BLOCK_N] of context positions offs through the block table (position 0's for masked ones)."""
    blk = tl.load(bt_row_ptr + offs // BLOCK_SIZE, mask=offs < end, other=0).to(tl.int64)
    return blk * stride_cb + (offs % BLOCK_SIZE) * stride_cs + kv_head_off


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, row_off, offs, end, d, d_mask):
    """K^T [HEAD_P2, BLOCK_N] and V [BLOCK_N, HEAD_P2] at cache offsets row_off (zeros from position `end` on)."""
    k_mask = offs < end
    kt = tl.load(k_cache_ptr + row_off[None, :] + d[:, None], mask=k_mask[None, :] & d_mask[:, None], other=0.0)
    vv = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0)
    return kt, vv


@triton.jit
def _attend_tile(acc, l_i, m_i, q, kt, vv, offs, end, new, k_new, v_new, qk_scale, IEEE: tl.constexpr):
    """One online-softmax step over a K/V tile, with position `new` taken from registers (k_new, v_new)."""
    is_new = offs == new
    kt = tl.where(is_new[None, :], k_new[:, None], kt.to(q.dtype))
    vv = tl.where(is_new[:, None], v_new[None, :], vv.to(q.dtype))
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where((offs < end)[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(q.dtype), vv, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), vv)
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # vary per step: no recompiles while serving
def _decode_qkv_kernel(
    qkv_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    qw_ptr, kw_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    qk_scale, num_splits, eps,
    stride_qt, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_mb, stride_mh, stride_ms, stride_cos, stride_sin,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, ROT: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tok = b.to(tl.int64)
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    g = tl.arange(0, BLOCK_G)
    head = kvh * G + g
    g_mask = g < G
    dt = qkv_ptr.dtype.element_ty

    # Before the PDL wait: nothing the previous kernels write (see the module docstring), and no stores.
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    new = seq_len - 1
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    c, sn = rope_cos_sin(cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, d, d_mask, dt, ROT, IS_NEOX)
    # Tile row G (BLOCK_G > G) carries the kv head's new k, so q and k are normalised and rotated in one pass.
    is_k = g == G
    src = tl.where(is_k, HQ + kvh, head)
    if HAS_NORM:
        partner, _, _ = rope_partner(d, ROT, IS_NEOX)
        qw = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qwp = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kwp = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w = tl.where(is_k[:, None], kw, qw)
        wp = tl.where(is_k[:, None], kwp, qwp)
    else:
        w = tl.zeros([1, HEAD_P2], dtype=tl.float32)
        wp = w
    bt_row = block_table_ptr + b * stride_bt
    kv_off = kvh * stride_ch
    offs = start + tl.arange(0, BLOCK_N)
    rows = _kv_rows(bt_row, kv_off, offs, end, stride_cb, stride_cs, BLOCK_SIZE)
    wait_then_release(PDL)

    if start >= seq_len:
        if DIRECT:          # one split and seq_len 0: a CUDA-graph padding row, whose output is zeros
            tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                     tl.zeros([BLOCK_G, HEAD_P2], dtype=out_ptr.dtype.element_ty),
                     mask=g_mask[:, None] & d_mask[None, :])
        return              # an unused split: stage 2 does not read it
    # Every load below is independent of the others: one round trip for the qkv row and the first K/V tile.
    kt, vv = _load_kv_tile(k_cache_ptr, v_cache_ptr, rows, offs, end, d, d_mask)
    row = qkv_ptr + tok * stride_qt
    qk = norm_rope_tile(row, src, g <= G, w, wp, c, sn, d, d_mask, eps, HEAD, ROT, IS_NEOX, HAS_NORM)
    v_new = tl.load(row + (HQ + HKV + kvh) * HEAD + d, mask=d_mask, other=0.0)
    k_new = tl.sum(tl.where(is_k[:, None], qk.to(tl.float32), 0.0), 0).to(dt)          # exact: one term
    q = tl.where(is_k[:, None], 0.0, qk.to(tl.float32)).to(dt)
    if new < end:           # this split holds the step's token (new >= start always holds here)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_off
            tl.store(k_cache_ptr + dst + d, k_new.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
            tl.store(v_cache_ptr + dst + d, v_new.to(v_cache_ptr.dtype.element_ty), mask=d_mask)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_P2], dtype=tl.float32)
    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kt, vv, offs, end, new, k_new, v_new, qk_scale, IEEE)
    for start_n in range(start + BLOCK_N, end, BLOCK_N):
        offs = start_n + tl.arange(0, BLOCK_N)
        rows = _kv_rows(bt_row, kv_off, offs, end, stride_cb, stride_cs, BLOCK_SIZE)
        kt, vv = _load_kv_tile(k_cache_ptr, v_cache_ptr, rows, offs, end, d, d_mask)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kt, vv, offs, end, new, k_new, v_new, qk_scale, IEEE)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        base = b * stride_mb + head * stride_mh + split * stride_ms
        tl.store(mid_o_ptr + base[:, None] + d[None, :], o, mask=mask)
        tl.store(mid_lse_ptr + base // HEAD_P2, lse, mask=g_mask)    # mid_lse is mid_o without its last dim


def decode_attention_qkv(qkv: torch.Tensor, rope: QkvRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, scale: float, num_splits: int = 1,
                         block_n: int | None = None) -> None:
    """Decode attention of a pure-decode step from its qkv projection [>= B, (Hq + 2 * Hkv) * D] (contiguous rows):
    q/k normalised (optional) and rotated in the kernel, each row's new k/v stored at rope.slot_mapping[b] before
    anything reads them. Row b (B = seq_lens.shape[0]) is token b and must have query_len 1; query_start_loc is only
    read by the stage-2 merge (num_splits > 1). k_cache/v_cache [num_blocks, block_size, Hkv, D] of qkv's dtype;
    out [>= B, Hq, D]."""
    num_rows = seq_lens.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    width = qkv.shape[-1]
    hq = width // d - 2 * hkv
    if qkv.dim() != 2 or qkv.stride(1) != 1 or hq <= 0 or (hq + 2 * hkv) * d != width or hq % hkv \
            or qkv.shape[0] < num_rows:
        raise ValueError(f"decode_attention_qkv: qkv must be [>= {num_rows}, (Hq + 2 * {hkv}) * {d}] with contiguous "
                         f"rows, got {tuple(qkv.shape)}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"decode_attention_qkv: the cache dtype must be qkv's ({qkv.dtype}), got {k_cache.dtype}")
    if rope.rotary_dim % 2 or not 0 < rope.rotary_dim <= d:
        raise ValueError(f"decode_attention_qkv: rotary_dim must be even and in (0, {d}], got {rope.rotary_dim}")
    if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
        raise ValueError("decode_attention_qkv: give both q_norm_weight and k_norm_weight, or neither")
    for t in (rope.cos_cache, rope.sin_cache):
        if t.shape[-1] != rope.rotary_dim // 2 or t.stride(-1) != 1:
            raise ValueError(f"decode_attention_qkv: cos/sin caches must be [max_pos, {rope.rotary_dim // 2}] with "
                             f"contiguous rows, got {tuple(t.shape)}")
    if num_rows == 0:
        return
    assert out.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    g = hq // hkv
    block_n_cfg, num_warps, _ = decode_config(d, g, qkv.dtype, False, num_rows)
    block_n = block_n or block_n_cfg
    head_p2 = triton.next_power_of_2(d)
    mid_o, mid_lse, sm = split_buffers(out, num_rows, hq, num_splits, head_p2)
    unused = seq_lens
    _decode_qkv_kernel[(num_rows, hkv, num_splits)](
        qkv, k_cache, v_cache, block_table, seq_lens, rope.positions, rope.slot_mapping, rope.cos_cache,
        rope.sin_cache, rope.q_norm_weight if rope.q_norm_weight is not None else unused,
        rope.k_norm_weight if rope.k_norm_weight is not None else unused, mid_o, mid_lse, out,
        scale * _LOG2E, num_splits, rope.eps,
        qkv.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), sm[0], sm[1], sm[2], rope.cos_cache.stride(0), rope.sin_cache.stride(0),
        BLOCK_SIZE=k_cache.shape[1], G=g, BLOCK_G=max(16, triton.next_power_of_2(g + 1)), BLOCK_N=block_n, HEAD=d,
        HEAD_P2=head_p2, HQ=hq, HKV=hkv, ROT=rope.rotary_dim, IS_NEOX=rope.is_neox,
        HAS_NORM=rope.q_norm_weight is not None, DIRECT=num_splits == 1, IEEE=qkv.dtype == torch.float32,
        num_warps=num_warps, num_stages=2, **launch_kwargs(qkv.device),
    )
    if num_splits > 1:
        merge_splits(mid_o, mid_lse, out, query_start_loc, seq_lens, num_splits, block_n, num_warps)
