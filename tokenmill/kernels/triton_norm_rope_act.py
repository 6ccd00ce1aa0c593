"""Fused elementwise kernels (Triton): RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

Each reproduces the rounding of the plain-torch layers in tokenmill/layers (HF semantics): intermediate results are
rounded to the activation dtype exactly where torch would round them, so bf16/fp16 results match torch up to the last
bit in almost every element (fp32 math inside; differences come only from rsqrt/exp implementations and FMA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait


# ----------------------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False, GEMMA: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)     # a weight: read before the PDL wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)     # torch adds in the input dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    if GEMMA:  # scaled by (1 + w) in fp32, rounded once at the end
        y = xf * tl.math.rsqrt(var + eps) * (1.0 + w)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        y = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             inplace: bool = False, gemma: bool = False):
    """HF RMSNorm over the last dim: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32.
    gemma=True: HF's Gemma form, (x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(x.dtype), all in fp32 (the output
    then has x's dtype).

    Without residual returns out. With residual returns (norm(x + residual), x + residual), the sum rounded to
    x.dtype like torch. The output dtype is promote(x.dtype, weight.dtype) (as `weight * x` in torch).
    inplace=True writes the output into x and the new residual into residual (vLLM's fused_add_rms_norm style;
    needs weight.dtype == x.dtype and contiguous rows) and returns those same tensors.
    Any leading shape; the last dim must be contiguous (otherwise a copy is made, which inplace refuses)."""
    n = x.shape[-1]
    x2 = _rows(x)
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    if inplace:
        assert out_dtype == x.dtype and x2.data_ptr() == x.data_ptr(), "inplace needs same dtype and a view of x"
        out2 = x2
    else:
        out2 = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    m = x2.shape[0]
    if residual is not None:
        r2 = _rows(residual)
        if inplace:
            assert r2.data_ptr() == residual.data_ptr() and residual.dtype == x.dtype
            ro2 = r2
        else:
            ro2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = ro2 = x2
    block = triton.next_power_of_2(n)
    warps = 1 if block <= 512 else 4 if block <= 4096 else 8 if block <= 8192 else 16
    if m:
        _rms_norm_kernel[(m,)](
            x2, r2, weight, out2, ro2, n, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            HAS_RES=residual is not None, BLOCK=block, num_warps=warps, GEMMA=gemma,
            **launch_kwargs(x.device, "norm"),
        )
    out = x if inplace else out2.view(x.shape)
    if residual is None:
        return out
    return out, (residual if inplace else ro2.view(x.shape))


# ----------------------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rope_heads(x_ptr, tok, heads, num_heads, stride_t, stride_h, off1, off2, i_mask, c, s):
    mask = (heads[:, None] < num_heads) & i_mask[None, :]
    base = x_ptr + tok * stride_t + heads[:, None] * stride_h
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0)
    dt = x_ptr.dtype.element_ty
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # torch (activation dtype): x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product and sum rounded to dt.
    o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    tl.store(base + off1[None, :], o1.to(dt), mask=mask)
    tl.store(base + off2[None, :], o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, HAS_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    i_mask = i < HALF
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + i, mask=i_mask, other=0.0).to(dt).to(tl.float32)
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    _rope_heads(q_ptr, tok, heads, num_q_heads, stride_qt, stride_qh, off1, off2, i_mask, c, s)
    if HAS_K:
        _rope_heads(k_ptr, tok, heads, num_k_heads, stride_kt, stride_kh, off1, off2, i_mask, c, s)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_dim: int, rotary_dim: int, is_neox: bool = True):
    """Applies RoPE IN PLACE to q [T, Hq*D] (or [T, Hq, D]) and k [T, Hkv*D] (or None); returns (q, k).

    positions [T] (int32/int64); cos_cache/sin_cache [max_pos, rotary_dim / 2] (fp32, as RotaryEmbedding builds
    them; cast to the activation dtype before multiplying like HF). Only the first rotary_dim dims of each head
    rotate (neox: the two halves; gptj: even/odd pairs); the rest is untouched. q/k may be strided views (e.g.
    slices of a fused qkv output) as long as each head's dims are contiguous."""
    t = positions.shape[0]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    qv = q.view(q.shape[0], -1, head_dim)
    kv = k.view(k.shape[0], -1, head_dim) if k is not None else qv
    assert qv.stride(-1) == 1 and kv.stride(-1) == 1
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    if t == 0:
        return q, k
    half = rotary_dim // 2
    half_p2 = triton.next_power_of_2(half)
    hmax = max(qv.shape[1], kv.shape[1] if k is not None else 0)
    block_h = max(1, min(triton.next_power_of_2(hmax), 4096 // half_p2))
    grid = (t, triton.cdiv(hmax, block_h))
    _rope_kernel[grid](
        positions, qv, kv, cos_cache, sin_cache,
        qv.shape[1], kv.shape[1] if k is not None else 0,
        qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        HALF=half, HALF_P2=half_p2, BLOCK_H=block_h, IS_NEOX=is_neox, HAS_K=k is not None,
        num_warps=4 if block_h * half_p2 >= 1024 else 1, **launch_kwargs(q.device, "rope"),
    )
    return q, k


# ------------------------------------------------------------------------------------------------------ SiLU-and-mul
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)     # torch: silu rounded to dt, then the product
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2d] = [gate, up] -> silu(gate) * up [..., d] (new tensor, or written into `out`)."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    m = x2.shape[0]
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, d)
    assert o2.stride(-1) == 1
    block = min(triton.next_power_of_2(d), 1024)
    if m:
        _silu_and_mul_kernel[(m, triton.cdiv(d, block))](x2, o2, d, x2.stride(0), o2.stride(0), BLOCK=block,
                                                          num_warps=4 if block >= 512 else 1,
                                                          **launch_kwargs(x.device, "act"))
    return out
