"""The decode step of a Gated DeltaNet layer (layers/gated_deltanet.py) in two Triton launches, in place on the
layer's state caches.

Why: the torch path of one decode token per sequence (gather the states, conv update, gating math, repeat the key
heads, flash-linear-attention's recurrent kernel, scatter the states back, the gated RMSNorm's elementwise ops) is
~45 tiny launches per layer; in a decode CUDA graph of a 48-layer model that is ~2,000 kernels a token, most of the
step. Here:
  1. `_conv_update_kernel`, grid (B, cdiv(C, BLOCK_C)): per decode row and block of channels, the causal depthwise
     conv over (the slot's K - 1 previous inputs, the new input) + SiLU, fp32 inside, written in the model dtype
     (where torch rounds the conv output); the slot's window is shifted in place.
  2. `_recurrence_norm_kernel`, grid (B, Hv): per decode row and value head, the gating (beta = sigmoid(b),
     g = -exp(A_log) softplus(a + dt_bias)), q / k L2-normalised (q scaled by dk ** -0.5), the delta-rule step on
     the slot's fp32 state tile [dk, dv] in place, o = S^T q rounded to the model dtype, then the gated RMSNorm
     over dv (ops.gated_rms_norm's rounding) written to the output row.
The conv must finish for every channel of a row before any head reads q / k / v (heads share key heads), hence two
launches. Math and conventions: layers/gated_deltanet_ops.py. Rows that share a slot (CUDA-graph padding rows all on
the scratch slot) race on that slot's state: its contents are garbage by design and their outputs unused.

PDL (kernels/pdl.py, kind "attention"): before the wait the kernels read only weights and the step's row metadata
(token indices, slots); the state caches and activations are read after it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, tok_ptr, slot_ptr,
    C, stride_x, stride_w, stride_ss, stride_sc, stride_sk, stride_o,
    K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    tok = tl.load(tok_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    pdl_wait(PDL)
    x = tl.load(x_ptr + tok * stride_x + c, mask=cm, other=0.0)
    st = state_ptr + slot * stride_ss + c * stride_sc
    # Window element j (0 .. K-2 from the state, K-1 the new input) times weight j. Every load and store below is
    # a [BLOCK_C] vector of one layout, so the thread that overwrites state[c, j] has already read it: no race.
    acc = tl.load(w_ptr + c * stride_w + (K - 1), mask=cm, other=0.0).to(tl.float32) * x.to(tl.float32)
    prev = tl.load(st, mask=cm, other=0.0)
    for j in tl.static_range(K - 1):
        acc += tl.load(w_ptr + c * stride_w + j, mask=cm, other=0.0).to(tl.float32) * prev.to(tl.float32)
        if j + 1 < K - 1:
            nxt = tl.load(st + (j + 1) * stride_sk, mask=cm, other=0.0)
        else:
            nxt = x.to(state_ptr.dtype.element_ty)
        tl.store(st + j * stride_sk, nxt, mask=cm)
        prev = nxt
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + i * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _recurrence_norm_kernel(
    conv_ptr, b_ptr, a_ptr, z_ptr, alog_ptr, dtb_ptr, nw_ptr, ssm_ptr, out_ptr, tok_ptr, slot_ptr,
    key_dim, stride_c, stride_b, stride_a, stride_zt, stride_zh, stride_ss, stride_sh,
    stride_ot, stride_oh, q_scale, eps,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr, DV_P2: tl.constexpr,
    ROUND_WH: tl.constexpr, PDL: tl.constexpr = False,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    rk = tl.arange(0, DK_P2)
    rv = tl.arange(0, DV_P2)
    km = rk < DK
    vm = rv < DV
    tok = tl.load(tok_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    nw = tl.load(nw_ptr + rv, mask=vm, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    # A head's [dk, dv] tile is contiguous: with a constant row stride every address of a thread's part of it is
    # one base register plus an immediate, which keeps the 128 x 128 tile's addresses out of the registers.
    sp = ssm_ptr + slot * stride_ss + h * stride_sh + rk[:, None] * DV + rv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=sm, other=0.0)
    row = conv_ptr + i * stride_c
    q = tl.load(row + hk * DK + rk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(row + key_dim + hk * DK + rk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_dim + h * DV + rv, mask=vm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * stride_b + h).to(tl.float32)
    a = tl.load(a_ptr + tok * stride_a + h).to(tl.float32) + dt_bias
    z = tl.load(z_ptr + tok * stride_zt + h * stride_zh + rv, mask=vm, other=0.0).to(tl.float32)
    # ops.l2_normalize (eps 1e-6), then the 1/sqrt(dk) scale on q.
    q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
    k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
    beta = tl.sigmoid(b)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))   # torch's beta=1, threshold=20
    g = -tl.exp(a_log) * softplus
    s = s * tl.exp(g)
    d = beta * (v - tl.sum(s * k[:, None], 0))
    s = s + k[:, None] * d[None, :]
    tl.store(sp, s, mask=sm)
    # The gated RMSNorm as ops.gated_rms_norm: o rounded to the model dtype (the rule's output dtype), fp32
    # statistics, the normalised value rounded before the weight, weight * h rounded where torch's promotion rounds.
    dt = out_ptr.dtype.element_ty
    o = tl.sum(s * q[:, None], 0).to(dt).to(tl.float32)
    o = (o * tl.math.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(dt).to(tl.float32)
    wh = nw * o
    if ROUND_WH:
        wh = wh.to(dt).to(tl.float32)
    y = wh * (z * tl.sigmoid(z))
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + rv, y.to(dt), mask=vm)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"gdn_decode: {msg}")


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               conv_cache: torch.Tensor, ssm_cache: torch.Tensor, tok: torch.Tensor, slots: torch.Tensor,
               out: torch.Tensor, *, hk: int, hv: int, dk: int, dv: int) -> None:
    """One decode token for each of B sequences through a Gated DeltaNet layer (this rank's heads): the conv
    update, the gated delta rule and the gated RMSNorm, the state caches updated in place.

    Row i of the batch is token tok[i] of the step's rows with state slot slots[i] (tok, slots: [B] int32/int64 on
    the device; read there, so they may be CUDA-graph buffers; no host sync).
      mixed [T, 2 * hk * dk + hv * dv]: in_proj_qkv's output (q, k, v channels), contiguous rows, model dtype;
      z [T, hv, dv] (contiguous dv), b / a [T, hv] (any row stride, contiguous heads): in_proj_z / in_proj_ba;
      conv_weight [C, K] (contiguous K), C = mixed's width; A_log, dt_bias [hv]; norm_weight [dv];
      conv_cache [slots, C, K - 1] in the model dtype; ssm_cache [slots, hv, dk, dv] float32 (contiguous dv);
      out [T, hv, dv] (contiguous dv): rows tok[i] receive the gated RMSNorm's output, in out's dtype; other rows
      are not touched.
    Matches ops.causal_conv1d_update + ops.recurrent_gated_delta_rule + ops.gated_rms_norm with the layer's gating
    math. Allocates only the conv output [B, C]; shapes are fixed by B, so it is CUDA-graph safe."""
    n = tok.shape[0]
    t, c = mixed.shape
    kw = conv_weight.shape[1]
    _check(hv % hk == 0, f"hv ({hv}) must be a multiple of hk ({hk})")
    _check(c == 2 * hk * dk + hv * dv and mixed.stride(1) == 1, f"mixed must be [T, {2 * hk * dk + hv * dv}] with "
           f"contiguous rows, got {tuple(mixed.shape)} strides {mixed.stride()}")
    _check(conv_weight.shape[0] == c and conv_weight.stride(1) == 1, f"conv_weight must be [{c}, K] with a "
           f"contiguous K, got {tuple(conv_weight.shape)}")
    _check(conv_cache.dim() == 3 and conv_cache.shape[1:] == (c, kw - 1), f"conv_cache must be [slots, {c}, "
           f"{kw - 1}], got {tuple(conv_cache.shape)}")
    _check(ssm_cache.dim() == 4 and ssm_cache.shape[1:] == (hv, dk, dv) and ssm_cache.stride()[2:] == (dv, 1)
           and ssm_cache.dtype == torch.float32, f"ssm_cache must be float32 [slots, {hv}, {dk}, {dv}] with "
           f"contiguous [dk, dv] tiles, got {ssm_cache.dtype} {tuple(ssm_cache.shape)} {ssm_cache.stride()}")
    for name, x in (("z", z), ("out", out)):
        _check(x.dim() == 3 and x.shape[1:] == (hv, dv) and x.shape[0] >= t and x.stride(2) == 1,
               f"{name} must be [{t}, {hv}, {dv}] with a contiguous dv, got {tuple(x.shape)}")
    for name, x in (("b", b), ("a", a)):
        _check(x.dim() == 2 and x.shape[1] == hv and x.stride(1) == 1, f"{name} must be [T, {hv}] with contiguous "
               f"heads, got {tuple(x.shape)}")
    _check(A_log.shape == (hv,) and dt_bias.shape == (hv,) and norm_weight.shape == (dv,)
           and norm_weight.stride(0) == 1, "A_log / dt_bias must be [hv] and norm_weight a contiguous [dv]")
    _check(slots.shape == (n,), f"slots must be [{n}] like tok, got {tuple(slots.shape)}")
    if n == 0:
        return
    conv_out = torch.empty(n, c, dtype=mixed.dtype, device=mixed.device)
    block_c = min(256, triton.next_power_of_2(c))
    pdl = launch_kwargs(mixed.device, "attention")
    _conv_update_kernel[(n, triton.cdiv(c, block_c))](
        mixed, conv_weight, conv_cache, conv_out, tok, slots,
        c, mixed.stride(0), conv_weight.stride(0), conv_cache.stride(0), conv_cache.stride(1), conv_cache.stride(2),
        conv_out.stride(0), K=kw, BLOCK_C=block_c, num_warps=2, **pdl,
    )
    dk_p2, dv_p2 = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    # The fp32 state tile is dk_p2 * dv_p2 values, 128 a thread at 128 x 128 and 4 warps (~236 registers, no
    # spills with triton 3.6). Measured on an H100 at the 27B shape, 4 warps beat 8 and 16 at every batch size
    # (B = 1: 5.5 / 7.5 / 9.8 us for both launches; B = 64: 156 / 176 / 218 us, ~2.6 TB/s).
    warps = max(1, min(4, dk_p2 * dv_p2 // 4096))
    _recurrence_norm_kernel[(n, hv)](
        conv_out, b, a, z, A_log, dt_bias, norm_weight, ssm_cache, out, tok, slots,
        hk * dk, conv_out.stride(0), b.stride(0), a.stride(0), z.stride(0), z.stride(1),
        ssm_cache.stride(0), ssm_cache.stride(1), out.stride(0), out.stride(1),
        dk ** -0.5, eps,
        GROUP=hv // hk, DK=dk, DV=dv, DK_P2=dk_p2, DV_P2=dv_p2,
        ROUND_WH=torch.promote_types(norm_weight.dtype, out.dtype) == out.dtype, num_warps=warps, **pdl,
    )
