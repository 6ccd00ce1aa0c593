"""The attention layer models use: it finds its KV cache and the step's metadata in the forward context."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention of one decoder layer through an `AttentionBackend`.

    Owns the layer's KV quantisation scales `k_scale` / `v_scale` (float32 device scalars, 1.0 unless the checkpoint
    supplies them; see attention/kv_quant.py). They are buffers, not parameters, so a checkpoint without them still
    loads completely; loaders must update them in place, because kernels and CUDA graphs hold their addresses. The
    backend applies them only when the layer's cache tensor is fp8.
    """

    def __init__(self, layer_idx: int, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 backend_cls: type) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.impl = backend_cls(num_heads, head_size, num_kv_heads, scale)
        # Explicit float32: models are built under their activation dtype as the default dtype.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn_metadata is None:  # profiling run without a cache: skip attention math
            return q
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata,
                                 self.k_scale, self.v_scale)
