"""One launch per layer between the qkv projection and attention (Triton): per-head RMSNorm of q and k (Qwen3's
q_norm / k_norm, optional), rotary embedding of q and k, q written out for attention, k and v stored straight into the
paged KV cache.

It replaces q_norm + k_norm + rotary + KV store (four launches, plus a copy of v) and rounds like the torch layers:
RMSNorm as tokenmill/layers/layernorm.py (fp32 statistics, normalised value rounded to the activation dtype, times
the weight, rounded), RoPE as tokenmill/kernels/triton_norm_rope_act.py (cos/sin cast to the activation dtype, each
product and sum rounded). Layouts: qkv [T, (Hq + 2 * Hkv) * D] rows (any row stride, contiguous inside a row);
cos/sin caches [max_pos, rotary_dim / 2] as RotaryEmbedding builds them; the KV cache of one layer
[2, num_blocks, block_size, Hkv, D] as AttentionBackend.kv_cache_shape, token t going to slot_mapping[t] =
block * block_size + offset, and a negative slot (CUDA-graph padding) storing nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _norm_rope(src, w_ptr, heads, h_mask, off1, off2, i_mask, rest, r_mask, c, s, eps,
               HEAD: tl.constexpr, HAS_NORM: tl.constexpr, HAS_REST: tl.constexpr):
    """Loads heads [BLOCK_H] of one token from src (row base + head * HEAD) as the rotary pairs (x1 at off1, x2 at
    off2) and the pass-through dims; returns them normalised and rotated, in the activation dtype."""
    dt = src.dtype.element_ty
    base = src + heads[:, None] * HEAD
    m1 = h_mask[:, None] & i_mask[None, :]
    x1 = tl.load(base + off1[None, :], mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=m1, other=0.0).to(tl.float32)
    if HAS_REST:
        mr = h_mask[:, None] & r_mask[None, :]
        xr = tl.load(base + rest[None, :], mask=mr, other=0.0).to(tl.float32)
    else:
        xr = x1
    if HAS_NORM:
        ssq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if HAS_REST:
            ssq += tl.sum(xr * xr, 1)
        rstd = tl.math.rsqrt(ssq / HEAD + eps)[:, None]
        w1 = tl.load(w_ptr + off1, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + off2, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if HAS_REST:
            wr = tl.load(w_ptr + rest, mask=r_mask, other=0.0).to(tl.float32)[None, :]
            xr = (wr * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt), xr.to(dt)


@triton.jit
def _store3(dst, heads, h_mask, off1, off2, i_mask, rest, r_mask, o1, o2, xr, stride_h, HAS_REST: tl.constexpr):
    base = dst + heads[:, None] * stride_h
    m1 = h_mask[:, None] & i_mask[None, :]
    et = dst.dtype.element_ty
    tl.store(base + off1[None, :], o1.to(et), mask=m1)
    tl.store(base + off2[None, :], o2.to(et), mask=m1)
    if HAS_REST:
        tl.store(base + rest[None, :], xr.to(et), mask=h_mask[:, None] & r_mask[None, :])


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
    num_q_heads, num_kv_heads, eps,
    stride_t, stride_qo, stride_ko, stride_cos, stride_sin, stride_cb, stride_cs, stride_ch,
    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, REST_P2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, HAS_REST: tl.constexpr, WRITE_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    n_qg = tl.cdiv(num_q_heads, BLOCK_H)
    n_kg = tl.cdiv(num_kv_heads, BLOCK_H)
    # Step metadata and the RoPE table are written by no kernel of the forward: read before the PDL wait.
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    i_mask = i < HALF
    dt = qkv_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + i, mask=i_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    pdl_wait(PDL)
    row = qkv_ptr + tok * stride_t
    hb = tl.arange(0, BLOCK_H)
    if grp >= n_qg + n_kg:
        # v heads: a copy into the cache, nothing else needs them.
        if slot >= 0:
            heads = (grp - n_qg - n_kg) * BLOCK_H + hb
            d = tl.arange(0, HEAD_P2)
            mask = (heads[:, None] < num_kv_heads) & (d[None, :] < HEAD)
            vv = tl.load(row + (num_q_heads + num_kv_heads + heads[:, None]) * HEAD + d[None, :], mask=mask)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            tl.store(v_cache_ptr + dst + heads[:, None] * stride_ch + d[None, :],
                     vv.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        if IS_NEOX:
            off1 = i
            off2 = i + HALF
        else:
            off1 = 2 * i
            off2 = 2 * i + 1
        rest = 2 * HALF + tl.arange(0, REST_P2)
        r_mask = rest < HEAD
        if grp < n_qg:
            heads = grp * BLOCK_H + hb
            h_mask = heads < num_q_heads
            o1, o2, xr = _norm_rope(row, qw_ptr, heads, h_mask, off1, off2, i_mask, rest, r_mask, c, s, eps,
                                    HEAD, HAS_NORM, HAS_REST)
            _store3(q_out_ptr + tok * stride_qo, heads, h_mask, off1, off2, i_mask, rest, r_mask, o1, o2, xr,
                    HEAD, HAS_REST)
        else:
            heads = (grp - n_qg) * BLOCK_H + hb
            h_mask = heads < num_kv_heads
            o1, o2, xr = _norm_rope(row + num_q_heads * HEAD, kw_ptr, heads, h_mask, off1, off2, i_mask, rest,
                                    r_mask, c, s, eps, HEAD, HAS_NORM, HAS_REST)
            if WRITE_K:
                _store3(k_out_ptr + tok * stride_ko, heads, h_mask, off1, off2, i_mask, rest, r_mask, o1, o2, xr,
                        HEAD, HAS_REST)
            # A skipped slot (negative) masks every head of the cache store.
            c_mask = h_mask & (heads < tl.where(slot >= 0, num_kv_heads, 0))
            dst = (tl.maximum(slot, 0) // BLOCK_SIZE) * stride_cb + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_cs
            _store3(k_cache_ptr + dst, heads, c_mask, off1, off2, i_mask, rest, r_mask, o1, o2, xr, stride_ch,
                    HAS_REST)


def check_rope_args(who: str, qkv: torch.Tensor, kv_cache: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                    rotary_dim: int | None, q_norm_weight: torch.Tensor | None,
                    k_norm_weight: torch.Tensor | None) -> int:
    """The argument checks of a kernel that rotates (and optionally normalises) q/k straight from a qkv row and
    stores k/v into the paged cache; ValueError naming `who`. Returns the rotary dim (default head_dim)."""
    if rotary_dim is None:
        rotary_dim = head_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{who}: rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{who}: give both q_norm_weight and k_norm_weight, or neither")
    for name, wt in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if wt is not None and (wt.shape != (head_dim,) or wt.stride(-1) != 1):
            raise ValueError(f"{who}: {name} must be a contiguous [{head_dim}], got {tuple(wt.shape)}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"{who}: qkv must be [T, {width}] with contiguous rows, got {tuple(qkv.shape)} strides "
                         f"{qkv.stride()}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim) \
            or kv_cache.stride(-1) != 1:
        raise ValueError(f"{who}: kv_cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}] with a "
                         f"contiguous head dim, got {tuple(kv_cache.shape)}")
    half = rotary_dim // 2
    if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half or cos_cache.stride(-1) != 1 \
            or sin_cache.stride(-1) != 1:
        raise ValueError(f"{who}: cos/sin caches must be [max_pos, {half}] with contiguous rows, got "
                         f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}")
    return rotary_dim


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_cache: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, *,
                       num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int | None = None,
                       is_neox: bool = True, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                       num_tokens: int | None = None) -> torch.Tensor:
    """Normalise (optional), rotate and store one step's q/k/v; returns q [T, Hq * D] ready for attention.

    qkv [>= T, (Hq + 2 * Hkv) * D]; positions and slot_mapping [>= T] (int32/int64); kv_cache
    [2, num_blocks, block_size, Hkv, D] (values cast to its dtype); cos_cache / sin_cache [max_pos, rotary_dim / 2]
    (fp32 as RotaryEmbedding keeps them). T = num_tokens, default qkv.shape[0]. rotary_dim (default head_dim, even)
    dims rotate, neox (halves) or gptj (even/odd pairs) layout; the rest pass through (normalised). q_norm_weight and
    k_norm_weight [D] come together or not at all. q_out [T, Hq * D] is allocated when None and may be the q slice of
    qkv itself (in place). k_out [T, Hkv * D], when given, also receives the rotated k (e.g. the k slice of qkv, for
    a backend that stores K/V itself). No host sync; one program per (token, group of heads)."""
    rotary_dim = check_rope_args("qk_norm_rope_store", qkv, kv_cache, cos_cache, sin_cache, num_heads, num_kv_heads,
                                 head_dim, rotary_dim, q_norm_weight, k_norm_weight)
    t = qkv.shape[0] if num_tokens is None else num_tokens
    if not 0 <= t <= qkv.shape[0] or positions.shape[0] < t or slot_mapping.shape[0] < t:
        raise ValueError(f"qk_norm_rope_store: num_tokens={t} exceeds qkv rows {qkv.shape[0]}, positions "
                         f"{positions.shape[0]} or slot_mapping {slot_mapping.shape[0]}")
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if q_out is None:
        q_out = torch.empty((t, q_size), dtype=qkv.dtype, device=qkv.device)
    elif q_out.dim() != 2 or q_out.shape[0] < t or q_out.shape[1] != q_size or q_out.stride(1) != 1:
        raise ValueError(f"qk_norm_rope_store: q_out must be [>= {t}, {q_size}] with contiguous rows, got "
                         f"{tuple(q_out.shape)}")
    if k_out is not None and (k_out.dim() != 2 or k_out.shape[0] < t or k_out.shape[1] != kv_size
                              or k_out.stride(1) != 1):
        raise ValueError(f"qk_norm_rope_store: k_out must be [>= {t}, {kv_size}] with contiguous rows, got "
                         f"{tuple(k_out.shape)}")
    if t == 0:
        return q_out
    _, _, bs, _, _ = kv_cache.shape
    kc, vc = kv_cache[0], kv_cache[1]
    head_p2 = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 2048 // head_p2))
    n_groups = triton.cdiv(num_heads, block_h) + 2 * triton.cdiv(num_kv_heads, block_h)
    nw = q_norm_weight if q_norm_weight is not None else qkv
    kw = k_norm_weight if k_norm_weight is not None else qkv
    _qk_norm_rope_store_kernel[(t, n_groups)](
        qkv, positions, slot_mapping, cos_cache, sin_cache, nw, kw, q_out,
        k_out if k_out is not None else q_out, kc, vc,
        num_heads, num_kv_heads, eps,
        qkv.stride(0), q_out.stride(0), k_out.stride(0) if k_out is not None else 0,
        cos_cache.stride(0), sin_cache.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        HEAD=head_dim, HEAD_P2=head_p2, HALF=rotary_dim // 2, HALF_P2=triton.next_power_of_2(rotary_dim // 2),
        REST_P2=triton.next_power_of_2(max(1, head_dim - rotary_dim)), BLOCK_H=block_h, BLOCK_SIZE=bs,
        IS_NEOX=is_neox, HAS_NORM=q_norm_weight is not None, HAS_REST=rotary_dim < head_dim,
        WRITE_K=k_out is not None,
        num_warps=4 if block_h * head_p2 >= 1024 else 2 if block_h * head_p2 >= 256 else 1,
        **launch_kwargs(qkv.device, "rope"),
    )
    return q_out
