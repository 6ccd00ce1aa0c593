"""Scatter new tokens' K/V into the paged KV cache (Triton).

Cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_size] (K then V), as `AttentionBackend` defines it.
Token t goes to slot `slot_mapping[t]` = block_id * block_size + offset; a negative slot (-1) means "skip" (the padded
rows of a CUDA-graph batch).

With an fp8 cache (FP8 constexpr) the values are quantised on the way: fp8(clamp(x / scale, -FP8_MAX, FP8_MAX)), the
scales read from device scalars (kernels/kv_fp8.py); other caches compile without any of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import fp8_max, is_fp8, require_scales
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_P2)
    mask = (heads[:, None] < num_heads) & (d[None, :] < HEAD)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk * stride_cb + off * stride_cs + heads[:, None] * stride_ch + d[None, :]
    tt = t.to(tl.int64)
    kk = tl.load(k_ptr + tt * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    vv = tl.load(v_ptr + tt * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:
        # IEEE division, as the torch reference does it; clamp first since out-of-range casts give NaN / inf.
        kk = tl.math.div_rn(kk.to(tl.float32), tl.load(k_scale_ptr))
        vv = tl.math.div_rn(vv.to(tl.float32), tl.load(v_scale_ptr))
        kk = tl.minimum(tl.maximum(kk, -FP8_MAX), FP8_MAX)
        vv = tl.minimum(tl.maximum(vv, -FP8_MAX), FP8_MAX)
    tl.store(k_cache_ptr + dst, kk.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, vv.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, Hkv, D] (or [T, Hkv*D]) into kv_cache [2, N, bs, Hkv, D] at slot_mapping [T] (int32/int64).

    Slots < 0 are skipped. k/v may be strided views (e.g. slices of a fused qkv output) as long as the head dim is
    contiguous; the cache needs a contiguous head dim (the standard layout is fully contiguous). The values are cast
    to the cache dtype; an fp8 cache needs k_scale / v_scale (float32 device scalars) and stores x / scale. One
    program per (token, group of heads); no host sync."""
    _, _, bs, hkv, d = kv_cache.shape
    t = slot_mapping.shape[0]
    if t == 0:
        return
    k = k.view(k.shape[0], hkv, d)
    v = v.view(v.shape[0], hkv, d)
    assert k.shape[0] >= t and v.shape[0] >= t
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    kc, vc = kv_cache[0], kv_cache[1]
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:
        require_scales(k_scale, v_scale)
    else:  # never read: any pointer will do
        k_scale = v_scale = slot_mapping
    head_p2 = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), 4096 // head_p2))
    grid = (t, triton.cdiv(hkv, block_h))
    _store_kv_kernel[grid](
        k, v, kc, vc, slot_mapping, k_scale, v_scale, hkv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        BLOCK_SIZE=bs, HEAD=d, HEAD_P2=head_p2, BLOCK_H=block_h,
        FP8=fp8, FP8_MAX=fp8_max(kv_cache.dtype) if fp8 else 0.0,
        num_warps=4 if block_h * head_p2 >= 1024 else 1, **launch_kwargs(k.device, "rope"),
    )
