"""Gated DeltaNet's ops: the gated delta rule (chunked for prefill, step by step for decode), the causal depthwise
conv1d with a carried state, and the gated RMSNorm. Pure PyTorch (the CPU path and the tests' reference); on CUDA
the delta rule runs flash-linear-attention's Triton kernels when that optional package is importable.

Conventions (one sequence's tokens are rows, heads a middle dim):
  q, k: [L, Hk, dk]; v: [L, Hv, dv] (Hv a multiple of Hk: value head j reads key head j // (Hv // Hk));
  g: [L, Hv] log decay (<= 0); beta: [L, Hv] in (0, 1); state S: [Hv, dk, dv] float32.
The recurrence, per value head, with q and k L2-normalised and q scaled by dk ** -0.5:
  S_t = exp(g_t) S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's and HF's definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32 copies with q/k normalised, q scaled, and the key heads repeated to the value heads."""
    hk, hv = q.shape[-2], v.shape[-2]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token over a batch: q, k [B, L, Hk, dk], v [B, L, Hv, dv], g / beta [B, L, Hv],
    state [B, Hv, dk, dv] float32, updated in place. Returns o [B, L, Hv, dv] in v's dtype."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[1]):
        s.mul_(g[:, t].exp()[..., None, None])
        pred = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        d = (v[:, t] - pred) * beta[:, t, :, None]
        s.add_(k[:, t, :, :, None] * d[:, :, None, :])
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out.to(dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None, chunk: int = 64
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk by chunk: (o [L, Hv, dv] in v's dtype, final state [Hv, dk, dv] float32).

    Inside a chunk with start state S0 and cumulative log decay G_t = g_1 + ... + g_t, the updates solve one
    unit lower-triangular system: (I + A) D = beta (V - e^G K S0), A[t, s] = beta_t e^(G_t - G_s) k_t . k_s for
    s < t; then o_t = e^(G_t) S0^T q_t + sum_{s <= t} e^(G_t - G_s) (q_t . k_s) d_s and the chunk's end state is
    e^(G_C) S0 + sum_s e^(G_C - G_s) k_s d_s^T. `state` (None: zeros) is not modified."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    n, hv, dk, dv = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float().clone()
    # Heads first: [H, L, d].
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    out = torch.empty(hv, n, dv, dtype=torch.float32, device=v.device)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = g[:, c0:c1].cumsum(-1)                                    # [H, C]
        m = c1 - c0
        lower = torch.ones(m, m, dtype=torch.bool, device=v.device).tril()
        # e^(G_t - G_s) for s <= t; masked before exp so the upper triangle cannot overflow.
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        kk = kc @ kc.transpose(1, 2)
        a = (bc[:, :, None] * decay * kk).tril(-1)
        eye = torch.eye(m, dtype=torch.float32, device=v.device).expand_as(a)
        rhs = bc[:, :, None] * (vc - G.exp()[:, :, None] * (kc @ s))
        d = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(1, 2)) * decay
        out[:, c0:c1] = G.exp()[:, :, None] * (qc @ s) + qk @ d
        tail = (G[:, -1:] - G).exp()                                  # e^(G_C - G_s)
        s = G[:, -1].exp()[:, None, None] * s + (kc * tail[:, :, None]).transpose(1, 2) @ d
    return out.transpose(0, 1).to(dtype), s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence: x [L, C], weight [C, K], state [C, K - 1] (the K - 1 inputs
    before x; None: zeros). Returns (out [L, C] in x's dtype, the new state [C, K - 1])."""
    c, kw = weight.shape
    prev = x.new_zeros(c, kw - 1) if state is None else state.to(x.dtype)
    full = torch.cat([prev, x.t()], dim=1)                           # [C, K - 1 + L]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=c)[0]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[1] - (kw - 1):]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: x [B, C], state [B, C, K - 1] updated in place. Returns SiLU(conv) [B, C]."""
    full = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)       # [B, C, K]
    state.copy_(full[:, :, 1:])
    return F.silu((full.to(weight.dtype) * weight).sum(-1)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, in float32 with the normalised x cast back to x's dtype
    before the weight (HF's Qwen3_5RMSNormGated order)."""
    dtype = x.dtype
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * h * F.silu(gate.float())).to(dtype)


# ----- flash-linear-attention (optional, CUDA) -----
_FLA = None


def fla_ops():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from flash-linear-attention, or None when it is
    not installed (the optional extra `tokenmill[fla]`)."""
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as rec
            _FLA = (chunk, rec)
        except ImportError:
            _FLA = ()
    return _FLA or None


def _fla_inputs(q, k, v, g, beta):
    """[1, L, H, d] contiguous inputs for flash-linear-attention, key heads repeated to the value heads."""
    rep = v.shape[-2] // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return [t.contiguous()[None] for t in (q, k, v, g.float(), beta.float())]


def delta_rule_prefill(q, k, v, g, beta, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's delta rule from `state` (None: zeros): (o [L, Hv, dv], final state float32). On CUDA with
    flash-linear-attention installed, its chunked Triton kernel; else chunk_gated_delta_rule."""
    fla = fla_ops() if q.is_cuda else None
    if fla is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, state)
    q1, k1, v1, g1, b1 = _fla_inputs(q, k, v, g, beta)
    init = None if state is None else state.float()[None].contiguous()
    o, s = fla[0](q1, k1, v1, g1, b1, scale=q.shape[-1] ** -0.5, initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    return o[0].to(v.dtype), s[0].float()


def delta_rule_decode(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token for each of B sequences: q, k [B, Hk, dk], v [B, Hv, dv], g / beta [B, Hv]; state
    [B, Hv, dk, dv] float32 updated in place. Returns o [B, Hv, dv]. On CUDA with flash-linear-attention, its
    fused recurrent kernel (the B sequences as B one-token sequences)."""
    fla = fla_ops() if q.is_cuda else None
    if fla is None:
        return recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)[:, 0]
    rep = v.shape[-2] // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    o, s = fla[1](q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
                  g=g.float()[:, None].contiguous(), beta=beta.float()[:, None].contiguous(),
                  scale=q.shape[-1] ** -0.5, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    state.copy_(s)
    return o[:, 0].to(v.dtype)
