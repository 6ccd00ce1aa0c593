"""The attention layer models use: it finds its KV cache and the step's metadata in the forward context."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention of one decoder layer through an `AttentionBackend`.

    Owns the layer's KV quantisation scales `k_scale` / `v_scale` (float32 device scalars, 1.0 unless the checkpoint
    supplies them; see kernels/kv_fp8.py). They are buffers, not parameters, so a checkpoint without them still
    loads completely; loaders must update them in place, because kernels and CUDA graphs hold their addresses. The
    backend applies them only when the layer's cache tensor is fp8.
    """

    def __init__(self, layer_idx: int, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 backend_cls: type, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window  # None: full attention (core/kv_cache_spec.py groups layers by it)
        self.impl = backend_cls(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap)
        # Explicit float32: models are built under their activation dtype as the default dtype.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary_emb, q_norm=None,
                    k_norm=None) -> torch.Tensor | None:
        """Attention straight from the fused qkv projection, or None when the fused path does not apply.

        On CUDA with a backend that reads K/V only from the cache, one kernel normalises q/k per head (Qwen3),
        rotates them and writes K/V into the paged cache (tokenmill.kernels.triton_qk_norm_rope_store), replacing
        four to five launches per layer; a backend with `forward_decode_qkv` may fold that kernel into decode
        attention too (the CPU backend's does the same with torch ops: torch_ref.TorchRefBackend.forward_decode_qkv).
        fp8 caches keep the unfused path (the fused store does not scale)."""
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx.layer_metadata is None else ctx.layer_metadata[self.layer_idx]
        if md is None:
            return None
        kv_cache = ctx.kv_caches[self.layer_idx]
        fused = getattr(self.impl, "forward_decode_qkv", None)
        if fused is not None:
            out = fused(qkv, positions, rotary_emb, q_norm, k_norm, kv_cache, md)
            if out is not None:
                return out
        if kv_cache.dtype != qkv.dtype or not qkv.is_cuda or not getattr(self.impl, "supports_prestored_kv", False):
            return None
        from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store
        t = md.num_actual_tokens
        q = qk_norm_rope_store(
            qkv, positions, md.slot_mapping, kv_cache, rotary_emb.cos_cache, rotary_emb.sin_cache,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            rotary_dim=rotary_emb.rotary_dim, is_neox=rotary_emb.is_neox_style,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            eps=q_norm.eps if q_norm is not None else 1e-6, num_tokens=t)
        return self.impl.forward(q, None, None, kv_cache, md, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn_metadata is None:  # profiling run without a cache: skip attention math
            return q
        md = ctx.attn_metadata if ctx.layer_metadata is None else ctx.layer_metadata[self.layer_idx]
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx], md, self.k_scale, self.v_scale)

    def forward_opaque(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`forward` as compiled models reach it (layers/opaque_attention.py): the backend's decode-only path where
        it has one, else `forward`."""
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx.layer_metadata is None else ctx.layer_metadata[self.layer_idx]
        if md is not None:
            fast = getattr(self.impl, "forward_decode", None)
            out = None if fast is None else fast(q, k, v, ctx.kv_caches[self.layer_idx], md)
            if out is not None:
                return out
        return self.forward(q, k, v.contiguous())
